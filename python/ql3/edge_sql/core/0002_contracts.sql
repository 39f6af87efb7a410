-- core 0002 on SQLite: contract revisions, active pointers and the transactional outbox
-- (SPEC section 3), the same tables as sql/core/0002_contracts.sql.
--
-- Types: uuid and text are TEXT (uuids in their lowercase hyphenated spelling), jsonb is
-- TEXT holding canonical JSON (RFC 8785, what ql3.canonical.jcs returns), timestamptz is
-- TEXT as YYYY-MM-DDTHH:MM:SS.ffffffZ (fixed width, so text order is time order), boolean
-- is INTEGER 0/1. Tables are STRICT so that a wrong type is an error, not an affinity.
-- The procedures in ql3.edge validate their input; constraints here guard invariants.
-- Immutable tables refuse UPDATE and DELETE by trigger (SQLite has no TRUNCATE, and a
-- DELETE trigger also turns off its truncate optimisation).

CREATE TABLE contract_families (
    contract_family TEXT PRIMARY KEY,
    max_staleness_seconds INTEGER NOT NULL CHECK (max_staleness_seconds > 0),
    description TEXT NOT NULL
) STRICT;

INSERT INTO contract_families (contract_family, max_staleness_seconds, description) VALUES
('policy_routing', 30, 'model routing policy: which provider and model a call runs under'),
('channel_event', 300, 'channel event handling configuration'),
('platform_resource', 30, 'platform resources such as the ollama_topology endpoints');

CREATE TABLE contract_revisions (
    revision_id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL CHECK (length(project_id) BETWEEN 1 AND 128),
    contract_family TEXT NOT NULL REFERENCES contract_families (contract_family),
    contract_id TEXT NOT NULL CHECK (length(contract_id) BETWEEN 1 AND 128),
    revision_no INTEGER NOT NULL CHECK (revision_no >= 1),
    body TEXT NOT NULL,
    body_hash TEXT NOT NULL CHECK (length(body_hash) = 64),
    created_at TEXT NOT NULL,
    created_by TEXT NOT NULL CHECK (length(created_by) BETWEEN 1 AND 128),
    UNIQUE (project_id, contract_family, contract_id, revision_no),
    UNIQUE (project_id, contract_family, contract_id, body_hash)
) STRICT;

CREATE TABLE revision_revocations (
    revision_id TEXT PRIMARY KEY REFERENCES contract_revisions (revision_id),
    reason TEXT NOT NULL CHECK (length(reason) BETWEEN 1 AND 1024),
    revoked_at TEXT NOT NULL,
    revoked_by TEXT NOT NULL CHECK (length(revoked_by) BETWEEN 1 AND 128)
) STRICT;

CREATE TABLE active_revisions (
    project_id TEXT NOT NULL,
    contract_family TEXT NOT NULL REFERENCES contract_families (contract_family),
    contract_id TEXT NOT NULL,
    active_revision_id TEXT REFERENCES contract_revisions (revision_id),
    pointer_version INTEGER NOT NULL DEFAULT 0 CHECK (pointer_version >= 0),
    last_revision_no INTEGER NOT NULL DEFAULT 0 CHECK (last_revision_no >= 0),
    updated_at TEXT NOT NULL,
    updated_by TEXT NOT NULL,
    PRIMARY KEY (project_id, contract_family, contract_id)
) STRICT;

-- AUTOINCREMENT: a seq is never handed out twice, even after delivered rows are deleted
-- (PostgreSQL's identity column gives the same guarantee).
CREATE TABLE contract_outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    event_type TEXT NOT NULL CHECK (event_type IN ('revision_activated', 'revision_revoked')),
    project_id TEXT NOT NULL,
    contract_family TEXT NOT NULL,
    contract_id TEXT NOT NULL,
    old_revision_id TEXT,  -- no FK, as on PostgreSQL (D25)
    new_revision_id TEXT NOT NULL REFERENCES contract_revisions (revision_id),
    pointer_version INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    delivered_at TEXT,
    relay_attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT
) STRICT;

CREATE INDEX contract_outbox_undelivered ON contract_outbox (seq) WHERE delivered_at IS NULL;

CREATE TRIGGER contract_revisions_no_update BEFORE UPDATE ON contract_revisions
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: contract_revisions is immutable (UPDATE refused)');
END;

CREATE TRIGGER contract_revisions_no_delete BEFORE DELETE ON contract_revisions
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: contract_revisions is immutable (DELETE refused)');
END;

CREATE TRIGGER revision_revocations_no_update BEFORE UPDATE ON revision_revocations
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: revision_revocations is immutable (UPDATE refused)');
END;

CREATE TRIGGER revision_revocations_no_delete BEFORE DELETE ON revision_revocations
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: revision_revocations is immutable (DELETE refused)');
END;

-- The outbox: only the delivery columns change, and only delivered rows may be deleted.
CREATE TRIGGER contract_outbox_guard_update BEFORE UPDATE ON contract_outbox
WHEN NEW.seq IS NOT OLD.seq OR NEW.event_id IS NOT OLD.event_id
    OR NEW.event_type IS NOT OLD.event_type OR NEW.project_id IS NOT OLD.project_id
    OR NEW.contract_family IS NOT OLD.contract_family OR NEW.contract_id IS NOT OLD.contract_id
    OR NEW.old_revision_id IS NOT OLD.old_revision_id
    OR NEW.new_revision_id IS NOT OLD.new_revision_id
    OR NEW.pointer_version IS NOT OLD.pointer_version OR NEW.created_at IS NOT OLD.created_at
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: only the delivery columns of contract_outbox may change');
END;

CREATE TRIGGER contract_outbox_guard_delete BEFORE DELETE ON contract_outbox
WHEN OLD.delivered_at IS NULL
BEGIN
    SELECT RAISE(ABORT, 'QL3_ILLEGAL_TRANSITION: an undelivered outbox row cannot be deleted');
END;
