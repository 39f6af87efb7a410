-- Contract revisions, active pointers and the transactional outbox (SPEC section 3).
--
-- Revisions are immutable; activation swaps the pointer and appends an outbox row in
-- the caller's transaction, and the outbox trigger NOTIFYs the relay at COMMIT.

ALTER DEFAULT PRIVILEGES FOR ROLE ql3_owner REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;  -- noqa: CP02

-- Defence in depth behind the functions' checks (D46): the identifiers and records of the
-- hot tables are of these domains. A domain's CHECK is prepared once per session (the type
-- cache) and sits in the cached plan of each INSERT or UPDATE; a table's CHECK is read back
-- from the catalogue and prepared again by every statement that writes the table, which
-- cost about a tenth of an admit+complete pair for a handful of length checks.
CREATE DOMAIN ql3.identifier AS text CHECK (char_length(value) BETWEEN 1 AND 128);

COMMENT ON DOMAIN ql3.identifier IS '1..128 characters: project, trace, invocation, model ids and the like.';

CREATE DOMAIN ql3.bounded_json AS jsonb CHECK (pg_column_size(value) <= 196608);

COMMENT ON DOMAIN ql3.bounded_json IS
'A stored record: never more than 196608 bytes of jsonb (8 x the 24576-byte canonical limit).';

CREATE TABLE ql3.contract_families (
    contract_family text PRIMARY KEY,
    max_staleness_seconds integer NOT NULL CHECK (max_staleness_seconds > 0),
    description text NOT NULL
);

COMMENT ON TABLE ql3.contract_families IS
'Known contract families and how stale a cached revision of each may be before it is re-verified.';

INSERT INTO ql3.contract_families (contract_family, max_staleness_seconds, description) VALUES
('policy_routing', 30, 'model routing policy: which provider and model a call runs under'),
('channel_event', 300, 'channel event handling configuration'),
('platform_resource', 30, 'platform resources such as the ollama_topology endpoints');

CREATE TABLE ql3.contract_revisions (
    revision_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    project_id text NOT NULL CHECK (char_length(project_id) BETWEEN 1 AND 128),
    contract_family text NOT NULL REFERENCES ql3.contract_families (contract_family),
    contract_id text NOT NULL CHECK (char_length(contract_id) BETWEEN 1 AND 128),
    revision_no integer NOT NULL CHECK (revision_no >= 1),
    -- The size bound of D46 again, as defence in depth: put_revision refuses more first.
    body jsonb NOT NULL CHECK (jsonb_typeof(body) = 'object' AND pg_column_size(body) <= 196608),
    body_hash text NOT NULL CHECK (body_hash ~ '^[0-9a-f]{64}$'),
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL CHECK (char_length(created_by) BETWEEN 1 AND 128),
    UNIQUE (project_id, contract_family, contract_id, revision_no),
    UNIQUE (project_id, contract_family, contract_id, body_hash)
);

COMMENT ON TABLE ql3.contract_revisions IS
'Immutable contract documents; body_hash = digest(''ql3/contract-body@v1'', body).';

CREATE TABLE ql3.revision_revocations (
    revision_id uuid PRIMARY KEY REFERENCES ql3.contract_revisions (revision_id),
    reason text NOT NULL CHECK (char_length(reason) BETWEEN 1 AND 1024),
    revoked_at timestamptz NOT NULL DEFAULT now(),
    revoked_by text NOT NULL CHECK (char_length(revoked_by) BETWEEN 1 AND 128)
);

COMMENT ON TABLE ql3.revision_revocations IS
'Immutable revocations: a revoked revision can never be activated again.';

CREATE TABLE ql3.active_revisions (
    project_id text NOT NULL,
    contract_family text NOT NULL REFERENCES ql3.contract_families (contract_family),
    contract_id text NOT NULL,
    active_revision_id uuid REFERENCES ql3.contract_revisions (revision_id),
    pointer_version bigint NOT NULL DEFAULT 0 CHECK (pointer_version >= 0),
    last_revision_no integer NOT NULL DEFAULT 0 CHECK (last_revision_no >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL,
    PRIMARY KEY (project_id, contract_family, contract_id)
);

COMMENT ON TABLE ql3.active_revisions IS
'The active pointer per contract; pointer_version grows by one on every change. NULL = none active.';

COMMENT ON COLUMN ql3.active_revisions.last_revision_no IS
'Highest revision_no stored for the contract. put_revision bumps it, so concurrent puts '
'under REPEATABLE READ fail with a serialization error instead of a duplicate number.';

-- A version 7 uuid (RFC 9562): 48 bits of Unix milliseconds, the version and variant bits,
-- and 74 random bits. Outbox event_ids are drawn from it so that their unique index grows at
-- its right edge: a random (version 4) key dirtied a random leaf page per activation, and
-- after each checkpoint wrote a full-page image of it (D25). SQL, without a SET clause, so
-- that the planner inlines it into the column default; every name is schema-qualified and
-- every operator has an exact pg_catalog match (numeric * numeric), so no search_path can
-- substitute its own.
CREATE FUNCTION ql3._uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT pg_catalog.encode(
        pg_catalog.set_bit(pg_catalog.set_bit(
            overlay(
                pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                PLACING substring(
                    pg_catalog.int8send(
                        pg_catalog.floor(extract(EPOCH FROM pg_catalog.clock_timestamp()) * 1000.0)::bigint
                    ) FROM 3
                ) FROM 1 FOR 6
            ), 52, 1), 53, 1),  -- version 4 (0100) becomes 7 (0111); the variant stays 10
        'hex'
    )::uuid
$$;

COMMENT ON FUNCTION ql3._uuid_v7() IS
'A time-ordered version 7 uuid (RFC 9562): Unix milliseconds, then random bits.';

CREATE TABLE ql3.contract_outbox (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL UNIQUE DEFAULT ql3._uuid_v7(),
    event_type text NOT NULL CHECK (event_type IN ('revision_activated', 'revision_revoked')),
    project_id text NOT NULL,
    contract_family text NOT NULL,
    contract_id text NOT NULL,
    old_revision_id uuid,  -- no FK: it was the pointer's revision, which has one (D25)
    new_revision_id uuid NOT NULL REFERENCES ql3.contract_revisions (revision_id),
    pointer_version bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    relay_attempts integer NOT NULL DEFAULT 0,
    last_error text
);

COMMENT ON TABLE ql3.contract_outbox IS
'Transactional outbox of pointer changes; only delivered_at, relay_attempts and last_error ever change.';

CREATE INDEX contract_outbox_undelivered ON ql3.contract_outbox (seq) WHERE delivered_at IS NULL;

-- Project isolation (D47). An operator maps login roles to the projects they may act on
-- (ql3.grant_project); a deployment that maps none keeps the single-tenant behaviour, in
-- which every login acts on every project. Once one mapping exists, a session acts on a
-- project only when its session_user is a member of a role mapped to that project, or to
-- every project (project_id NULL). The writing functions check it (they run as the owner,
-- so session_user is still the login); row-level security limits what the roles read.
CREATE TABLE ql3.project_grants (
    role_name name NOT NULL,
    project_id text CHECK (char_length(project_id) BETWEEN 1 AND 128),  -- NULL: every project
    granted_by name NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE NULLS NOT DISTINCT (role_name, project_id)
);

COMMENT ON TABLE ql3.project_grants IS
'Which login roles (and their members) act on which projects; no row at all = single tenant.';

CREATE INDEX project_grants_project ON ql3.project_grants (project_id);

-- Drawn once by the first grant_project and never reset (nextval is not transactional):
-- while it was never drawn, no grant ever existed, and ql3._may_act answers from this
-- sequence's last_value, a function call, instead of a query of project_grants on the
-- hot path of every call (D47). Once drawn, the table is read (empty again = no isolation).
CREATE SEQUENCE ql3.project_grants_used;

COMMENT ON SEQUENCE ql3.project_grants_used IS
'Drawn by the first project grant: until then ql3._may_act need not read ql3.project_grants.';

-- Whether session_user is a member of a role named in a grant: SQL without a SET clause,
-- inlined into the queries that call it. A role dropped after its grant matches nobody
-- (to_regrole gives NULL) instead of making pg_has_role fail every call.
CREATE FUNCTION ql3._session_is_member(p_role_name name) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT pg_catalog.pg_has_role(
        session_user, pg_catalog.to_regrole(pg_catalog.quote_ident(p_role_name))::oid, 'MEMBER')
$$;

COMMENT ON FUNCTION ql3._session_is_member(name) IS
'True when session_user is a member of the role (false for a role that no longer exists).';

-- PL/pgSQL, so that its queries are planned once per session: inlined as SQL, with the
-- project as a parameter, the caller's statement was planned again on every call, and
-- that cost a third of the pairs' and activations' throughput (D47). The common case (no
-- grant was ever made) is settled by a sequence's last_value, with no query at all. No SET
-- clause (it runs inside the writers' pinned path); every name is qualified. With a NULL
-- project it asks for every project: true while isolation is off, or for a session with
-- an every-project grant.
CREATE FUNCTION ql3._may_act(p_project_id text) RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF pg_catalog.pg_sequence_last_value('ql3.project_grants_used'::regclass) IS NULL THEN  -- a simple expression: no query, no executor
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM ql3.project_grants) THEN
        RETURN true;
    END IF;
    RETURN EXISTS (
        SELECT 1
        FROM ql3.project_grants AS g
        WHERE (g.project_id = p_project_id OR g.project_id IS NULL) AND ql3._session_is_member(g.role_name)
    );
END;
$$;

COMMENT ON FUNCTION ql3._may_act(text) IS
'True when the session may act on the project: no grants at all, or one that covers its session_user.';

CREATE FUNCTION ql3.may_act_on(p_project_id text) RETURNS boolean
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
BEGIN
    RETURN ql3._may_act(p_project_id);
END;
$$;

COMMENT ON FUNCTION ql3.may_act_on(text) IS
'Whether this session may act on a project (D47): what every writing function checks.';

-- PL/pgSQL for plans kept per session (a SQL function is planned at every call, and
-- every query of a role under row-level security calls this once).
CREATE FUNCTION ql3.visible_projects() RETURNS text []
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    granted text [];
BEGIN
    IF ql3._may_act(NULL) THEN  -- isolation off, or a grant of every project
        RETURN NULL;
    END IF;
    SELECT array_agg(DISTINCT g.project_id) INTO granted
    FROM ql3.project_grants AS g
    WHERE ql3._session_is_member(g.role_name);
    RETURN coalesce(granted, '{}');
END;
$$;

COMMENT ON FUNCTION ql3.visible_projects() IS
'The projects this session may act on (D47); NULL means every project.';

CREATE FUNCTION ql3.grant_project(p_role name, p_project_id text) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
BEGIN
    IF p_role IS NULL OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS r WHERE r.rolname = p_role) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: no role %s', coalesce(quote_ident(p_role), 'NULL'));
    END IF;
    IF p_project_id IS NOT NULL THEN
        PERFORM ql3._check_identifier('project_id', p_project_id);
    END IF;
    -- Only a session that may act on the project (on every project, for NULL) may hand it on.
    IF NOT ql3._may_act(p_project_id) THEN
        PERFORM ql3._refuse_project(p_project_id, 'grant');
    END IF;
    INSERT INTO ql3.project_grants (role_name, project_id, granted_by)
    VALUES (p_role, p_project_id, session_user)
    ON CONFLICT DO NOTHING;
    IF found AND pg_catalog.pg_sequence_last_value('ql3.project_grants_used'::regclass) IS NULL THEN
        PERFORM nextval('ql3.project_grants_used');  -- before COMMIT makes the grant visible
    END IF;
    RETURN found;
END;
$$;

COMMENT ON FUNCTION ql3.grant_project(name, text) IS
'Lets the members of a role act on a project (NULL: every project); true if the grant is new. The first grant turns isolation on.';

CREATE FUNCTION ql3.revoke_project(p_role name, p_project_id text) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
BEGIN
    IF NOT ql3._may_act(p_project_id) THEN
        PERFORM ql3._refuse_project(p_project_id, 'revoke');
    END IF;
    -- Serialises revocations, so that two of them cannot each leave the other's last grant.
    LOCK TABLE ql3.project_grants IN SHARE ROW EXCLUSIVE MODE;
    IF (SELECT count(*) FROM ql3.project_grants) = 1
       AND EXISTS (SELECT 1 FROM ql3.project_grants AS g
                   WHERE g.role_name = p_role AND g.project_id IS NOT DISTINCT FROM p_project_id) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = 'QL3_CONFLICT: this is the last project grant; without it every login acts on every '
                      'project again (the owner may delete it to turn isolation off)';
    END IF;
    DELETE FROM ql3.project_grants AS g
    WHERE g.role_name = p_role AND g.project_id IS NOT DISTINCT FROM p_project_id;
    RETURN found;
END;
$$;

COMMENT ON FUNCTION ql3.revoke_project(name, text) IS
'Removes a grant of grant_project; true if it existed. The last grant is refused: isolation stays on.';

-- Immutability: enforced by trigger so that it binds the owner too.

CREATE FUNCTION ql3._reject_mutation() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'Q3S01',
        MESSAGE = format('QL3_ILLEGAL_TRANSITION: %s.%s is immutable (%s refused)',
                         TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_OP);
END;
$$;

COMMENT ON FUNCTION ql3._reject_mutation() IS 'Trigger: refuses UPDATE, DELETE and TRUNCATE on immutable tables.';

CREATE TRIGGER contract_revisions_immutable
BEFORE UPDATE OR DELETE ON ql3.contract_revisions
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER contract_revisions_no_truncate
BEFORE TRUNCATE ON ql3.contract_revisions
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER revision_revocations_immutable
BEFORE UPDATE OR DELETE ON ql3.revision_revocations
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER revision_revocations_no_truncate
BEFORE TRUNCATE ON ql3.revision_revocations
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

CREATE FUNCTION ql3._guard_outbox() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF OLD.delivered_at IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3S01',
                MESSAGE = format('QL3_ILLEGAL_TRANSITION: outbox row %s is not delivered yet', OLD.seq);
        END IF;
        RETURN OLD;
    END IF;
    IF (NEW.seq, NEW.event_id, NEW.event_type, NEW.project_id, NEW.contract_family, NEW.contract_id,
        NEW.old_revision_id, NEW.new_revision_id, NEW.pointer_version, NEW.created_at)
       IS DISTINCT FROM
       (OLD.seq, OLD.event_id, OLD.event_type, OLD.project_id, OLD.contract_family, OLD.contract_id,
        OLD.old_revision_id, OLD.new_revision_id, OLD.pointer_version, OLD.created_at) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3S01',
            MESSAGE = 'QL3_ILLEGAL_TRANSITION: only the delivery columns of ql3.contract_outbox may change';
    END IF;
    RETURN NEW;
END;
$$;

COMMENT ON FUNCTION ql3._guard_outbox() IS
'Trigger: outbox rows change only in their delivery columns and are deleted only once delivered.';

CREATE TRIGGER contract_outbox_guard
BEFORE UPDATE OF seq, event_id, event_type, project_id, contract_family, contract_id, old_revision_id,
new_revision_id, pointer_version, created_at OR DELETE ON ql3.contract_outbox
FOR EACH ROW EXECUTE FUNCTION ql3._guard_outbox();

CREATE TRIGGER contract_outbox_no_truncate
BEFORE TRUNCATE ON ql3.contract_outbox
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

-- A notifying COMMIT holds a cluster-wide lock until its WAL is flushed, so notifying
-- transactions cannot share a group commit (D16, D17). A transaction that sets
-- ql3.outbox_notify = 'deferred' skips this trigger (its WHEN clause) and promises to call
-- ql3.wake_relays() after its COMMIT; if it never does, the relays' poll finds the row.
CREATE FUNCTION ql3._notify_outbox() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    PERFORM pg_notify('ql3_contract_outbox',
                      json_build_object('seq', NEW.seq, 'project_id', NEW.project_id)::text);
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION ql3._notify_outbox() IS
'Trigger: wakes relays at COMMIT (not called when ql3.outbox_notify = deferred).';

-- Called on its own, after the COMMIT of deferred outbox writes: a transaction that only
-- notifies writes no WAL of its own, so its COMMIT waits for no flush and holds the
-- notification lock for microseconds. Inside a writing transaction it is an ordinary
-- NOTIFY at that COMMIT (correct, but serialised like the trigger's, D16).
CREATE FUNCTION ql3.wake_relays() RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    PERFORM pg_notify('ql3_contract_outbox', '{"wake": true}');
END;
$$;

COMMENT ON FUNCTION ql3.wake_relays() IS
'Wakes relays at this COMMIT. Call it in a transaction of its own after committing with ql3.outbox_notify = deferred.';

CREATE TRIGGER contract_outbox_notify
AFTER INSERT ON ql3.contract_outbox
FOR EACH ROW
WHEN (current_setting('ql3.outbox_notify', TRUE) IS DISTINCT FROM 'deferred')
EXECUTE FUNCTION ql3._notify_outbox();

-- Argument checks shared by the functions below.

CREATE FUNCTION ql3._check_identifier(field text, value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    IF value IS NULL OR value = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s is required', field);
    END IF;
    IF char_length(value) > 128 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V03',
            MESSAGE = format('QL3_IDENTIFIER_TOO_LONG: %s has %s characters (at most 128)',
                             field, char_length(value));
    END IF;
    RETURN value;
END;
$$;

COMMENT ON FUNCTION ql3._check_identifier(text, text) IS 'Raises unless value is 1..128 characters.';

-- The refusal when ql3._may_act says no: callers test _may_act themselves, as a simple
-- expression, and call this only to raise. No SET clause (PostgreSQL re-plans a cached
-- statement whose search_path differs from its planning one, D47).
CREATE FUNCTION ql3._refuse_project(p_project_id text, p_verb text) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = '42501',
        MESSAGE = format('QL3_PERMISSION_DENIED: %s may not %s %s', session_user, p_verb,
                         coalesce('project ' || quote_literal(p_project_id), 'every project')),
        HINT = 'an operator grants projects with ql3.grant_project (D47)';
END;
$$;

COMMENT ON FUNCTION ql3._refuse_project(text, text) IS
'Raises QL3_PERMISSION_DENIED (42501): the session may not act on (grant, revoke) the project (D47).';

-- The O(1) size refusal of D46, for what is over 8 x 24576 bytes of jsonb: a jsonb value
-- is never more than 6 times the bytes of its canonical text (a number in an array: 12
-- bytes of jsonb, 2 of JCS), so it cannot fit, and is refused before anything walks it.
-- Callers test pg_column_size themselves (a simple expression) and call this to raise.
CREATE FUNCTION ql3._refuse_too_large(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'Q3V02',
        MESSAGE = format('QL3_RECORD_TOO_LARGE: %s is %s bytes of jsonb, more than anything of at most '
                         '24576 bytes of canonical JSON', p_what, pg_column_size(p_value));
END;
$$;

COMMENT ON FUNCTION ql3._refuse_too_large(text, jsonb) IS
'Raises QL3_RECORD_TOO_LARGE for a jsonb input over 196608 bytes, before it is canonicalised (D46).';

CREATE FUNCTION ql3._check_family(family text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    PERFORM ql3._check_identifier('contract_family', family);
    IF NOT EXISTS (SELECT 1 FROM ql3.contract_families AS f WHERE f.contract_family = family) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: unknown contract family %L', family),
            HINT = 'known families are listed in ql3.contract_families';
    END IF;
END;
$$;

COMMENT ON FUNCTION ql3._check_family(text) IS 'Raises unless family is a row of ql3.contract_families.';

-- Locks the pointer row of a contract, creating it (no active revision) on first use.
CREATE FUNCTION ql3._lock_pointer(p_project_id text, p_family text, p_contract_id text, p_actor text)
RETURNS ql3.active_revisions
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
DECLARE
    pointer ql3.active_revisions;
BEGIN
    SELECT * INTO pointer FROM ql3.active_revisions AS a
    WHERE a.project_id = p_project_id AND a.contract_family = p_family AND a.contract_id = p_contract_id
    FOR UPDATE;
    IF NOT found THEN
        INSERT INTO ql3.active_revisions (project_id, contract_family, contract_id, updated_by)
        VALUES (p_project_id, p_family, p_contract_id, p_actor)
        ON CONFLICT DO NOTHING;
        SELECT * INTO pointer FROM ql3.active_revisions AS a
        WHERE a.project_id = p_project_id AND a.contract_family = p_family AND a.contract_id = p_contract_id
        FOR UPDATE;
    END IF;
    RETURN pointer;
END;
$$;

COMMENT ON FUNCTION ql3._lock_pointer(text, text, text, text) IS
'Serialises writers of one contract on its pointer row (created empty on first use).';

CREATE FUNCTION ql3.put_revision(
    p_project_id text, p_contract_family text, p_contract_id text, p_body jsonb, p_actor text
) RETURNS ql3.contract_revisions
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    hash text;
    canonical text;
    next_no integer;
    result ql3.contract_revisions;
BEGIN
    PERFORM ql3._check_identifier('project_id', p_project_id);
    IF NOT ql3._may_act(p_project_id) THEN
        PERFORM ql3._refuse_project(p_project_id, 'act on');
    END IF;
    PERFORM ql3._check_family(p_contract_family);
    PERFORM ql3._check_identifier('contract_id', p_contract_id);
    PERFORM ql3._check_identifier('actor', p_actor);
    IF p_body IS NULL OR jsonb_typeof(p_body) <> 'object' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: body must be a JSON object, not %s',
                             coalesce(jsonb_typeof(p_body), 'NULL'));
    END IF;
    IF pg_column_size(p_body) > 196608 THEN  -- the input's size first, in O(1) (D46)
        PERFORM ql3._refuse_too_large('body', p_body);
    END IF;
    canonical := ql3.jcs(p_body);  -- once: its size and its digest
    IF octet_length(canonical) > 24576 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V02',
            MESSAGE = format('QL3_RECORD_TOO_LARGE: body is %s bytes of canonical JSON (at most 24576)',
                             octet_length(canonical));
    END IF;
    hash := ql3._framed_digest('ql3/contract-body@v1', canonical);

    PERFORM ql3._lock_pointer(p_project_id, p_contract_family, p_contract_id, p_actor);

    SELECT * INTO result FROM ql3.contract_revisions AS r
    WHERE r.project_id = p_project_id AND r.contract_family = p_contract_family
      AND r.contract_id = p_contract_id AND r.body_hash = hash;
    IF found THEN
        RETURN result;
    END IF;

    UPDATE ql3.active_revisions AS a
    SET last_revision_no = a.last_revision_no + 1
    WHERE a.project_id = p_project_id AND a.contract_family = p_contract_family
      AND a.contract_id = p_contract_id
    RETURNING a.last_revision_no INTO next_no;

    INSERT INTO ql3.contract_revisions
        (project_id, contract_family, contract_id, revision_no, body, body_hash, created_by)
    VALUES (p_project_id, p_contract_family, p_contract_id, next_no, p_body, hash, p_actor)
    RETURNING * INTO result;
    RETURN result;
END;
$$;

COMMENT ON FUNCTION ql3.put_revision(text, text, text, jsonb, text) IS
'Stores a new immutable revision (revision_no n+1), or returns the existing one with the same body.';

CREATE FUNCTION ql3._revision_of(p_revision_id uuid) RETURNS ql3.contract_revisions
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, ql3
AS $$
DECLARE
    result ql3.contract_revisions;
BEGIN
    IF p_revision_id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: revision_id is required';
    END IF;
    SELECT * INTO result FROM ql3.contract_revisions AS r WHERE r.revision_id = p_revision_id;
    -- Another project's revision is as absent as one that never existed (D47).
    IF NOT found OR NOT ql3._may_act(result.project_id) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3N01',
            MESSAGE = format('QL3_NOT_FOUND: revision %s does not exist', p_revision_id);
    END IF;
    RETURN result;
END;
$$;

COMMENT ON FUNCTION ql3._revision_of(uuid) IS 'The revision row, or QL3_NOT_FOUND.';

CREATE FUNCTION ql3.activate_revision(
    p_project_id text,
    p_contract_family text,
    p_contract_id text,
    p_revision_id uuid,
    p_actor text,
    p_expected_active_revision_id uuid DEFAULT NULL
) RETURNS SETOF ql3.contract_outbox
LANGUAGE plpgsql ROWS 1
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    revision ql3.contract_revisions;
    old_revision_id uuid;
    old_version bigint;
    event ql3.contract_outbox;
BEGIN
    IF NOT ql3._may_act(p_project_id) THEN
        PERFORM ql3._refuse_project(p_project_id, 'act on');
    END IF;
    -- Fast path: a revision of exactly this contract proves project, family and contract
    -- valid (its row passed the same checks). Anything else takes the slow path, whose
    -- checks run in the documented order and raise the precise error.
    SELECT r.project_id, r.contract_family, r.contract_id
    INTO revision.project_id, revision.contract_family, revision.contract_id
    FROM ql3.contract_revisions AS r WHERE r.revision_id = p_revision_id;
    IF NOT found
       OR (revision.project_id, revision.contract_family, revision.contract_id)
          IS DISTINCT FROM (p_project_id, p_contract_family, p_contract_id)
       OR p_actor IS NULL OR p_actor = '' OR char_length(p_actor) > 128 THEN
        PERFORM ql3._check_identifier('project_id', p_project_id);
        PERFORM ql3._check_family(p_contract_family);
        PERFORM ql3._check_identifier('contract_id', p_contract_id);
        PERFORM ql3._check_identifier('actor', p_actor);
        revision := ql3._revision_of(p_revision_id);
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: revision %s belongs to %s/%s/%s, not %s/%s/%s',
                             p_revision_id, revision.project_id, revision.contract_family,
                             revision.contract_id, p_project_id, p_contract_family, p_contract_id);
    END IF;

    SELECT a.active_revision_id, a.pointer_version INTO old_revision_id, old_version
    FROM ql3.active_revisions AS a
    WHERE a.project_id = p_project_id AND a.contract_family = p_contract_family
      AND a.contract_id = p_contract_id
    FOR UPDATE;
    IF NOT found THEN
        SELECT l.active_revision_id, l.pointer_version INTO old_revision_id, old_version
        FROM ql3._lock_pointer(p_project_id, p_contract_family, p_contract_id, p_actor) AS l;
    END IF;

    IF EXISTS (SELECT 1 FROM ql3.revision_revocations AS v WHERE v.revision_id = p_revision_id) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3R01',
            MESSAGE = format('QL3_REVISION_REVOKED: revision %s is revoked and cannot be activated',
                             p_revision_id);
    END IF;
    IF p_expected_active_revision_id IS NOT NULL
       AND old_revision_id IS DISTINCT FROM p_expected_active_revision_id THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: expected active revision %s but %s is active',
                             p_expected_active_revision_id, coalesce(old_revision_id::text, 'none')),
            DETAIL = coalesce(old_revision_id::text, '');
    END IF;
    IF old_revision_id = p_revision_id THEN
        RETURN;  -- already active: no row (D3)
    END IF;
    UPDATE ql3.active_revisions AS a
    SET active_revision_id = p_revision_id,
        pointer_version = a.pointer_version + 1,
        updated_at = now(),
        updated_by = p_actor
    WHERE a.project_id = p_project_id AND a.contract_family = p_contract_family
      AND a.contract_id = p_contract_id;

    INSERT INTO ql3.contract_outbox
        (event_type, project_id, contract_family, contract_id, old_revision_id, new_revision_id,
         pointer_version)
    VALUES
        ('revision_activated', p_project_id, p_contract_family, p_contract_id,
         old_revision_id, p_revision_id, old_version + 1)
    RETURNING * INTO event;
    RETURN NEXT event;
END;
$$;

COMMENT ON FUNCTION ql3.activate_revision(text, text, text, uuid, text, uuid) IS
'Swaps the active pointer and appends a revision_activated outbox row in one transaction; '
'returns that row, or no row if the revision was already active.';

CREATE FUNCTION ql3.revoke_revision(p_revision_id uuid, p_actor text, p_reason text)
RETURNS ql3.contract_outbox
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    pointer ql3.active_revisions;
    revision ql3.contract_revisions;
    event ql3.contract_outbox;
    was_active boolean;
BEGIN
    PERFORM ql3._check_identifier('actor', p_actor);
    IF p_reason IS NULL OR p_reason = '' OR char_length(p_reason) > 1024 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: reason is required (1..1024 characters)';
    END IF;
    revision := ql3._revision_of(p_revision_id);
    pointer := ql3._lock_pointer(revision.project_id, revision.contract_family, revision.contract_id, p_actor);

    -- Already revoked: nothing to do. (Under REPEATABLE READ a revocation committed after
    -- our snapshot makes ON CONFLICT raise a serialization failure instead.)
    INSERT INTO ql3.revision_revocations (revision_id, reason, revoked_by)
    VALUES (p_revision_id, p_reason, p_actor)
    ON CONFLICT (revision_id) DO NOTHING;
    IF NOT found THEN
        RETURN NULL;
    END IF;

    was_active := pointer.active_revision_id IS NOT DISTINCT FROM p_revision_id;
    IF was_active THEN
        UPDATE ql3.active_revisions AS a
        SET active_revision_id = NULL,
            pointer_version = a.pointer_version + 1,
            updated_at = now(),
            updated_by = p_actor
        WHERE a.project_id = revision.project_id AND a.contract_family = revision.contract_family
          AND a.contract_id = revision.contract_id;
    ELSE
        -- The pointer does not change, but its row gets a new version all the same: an
        -- activation of this revision whose REPEATABLE READ or SERIALIZABLE snapshot predates
        -- this revocation cannot see it, and would activate a revoked revision; updating
        -- the row it locks makes that activation fail with a serialization error (D33).
        UPDATE ql3.active_revisions AS a
        SET pointer_version = a.pointer_version
        WHERE a.project_id = revision.project_id AND a.contract_family = revision.contract_family
          AND a.contract_id = revision.contract_id;
    END IF;

    INSERT INTO ql3.contract_outbox
        (event_type, project_id, contract_family, contract_id, old_revision_id, new_revision_id,
         pointer_version)
    VALUES
        ('revision_revoked', revision.project_id, revision.contract_family, revision.contract_id,
         pointer.active_revision_id, p_revision_id,
         pointer.pointer_version + CASE WHEN was_active THEN 1 ELSE 0 END)
    RETURNING * INTO event;
    RETURN event;
END;
$$;

COMMENT ON FUNCTION ql3.revoke_revision(uuid, text, text) IS
'Revokes a revision for good; if it was active the pointer becomes NULL. NULL if already revoked.';

-- PL/pgSQL, not SQL: a SQL function with a SET clause is never inlined and is planned
-- again on every call (about 6x the cost); PL/pgSQL keeps the plan for the session.
CREATE FUNCTION ql3.active_revision(p_project_id text, p_contract_family text, p_contract_id text)
RETURNS TABLE (revision_id uuid, revision_no integer, body jsonb, body_hash text, pointer_version bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    RETURN QUERY
    SELECT r.revision_id, r.revision_no, r.body, r.body_hash, a.pointer_version
    FROM ql3.active_revisions AS a
    INNER JOIN ql3.contract_revisions AS r ON r.revision_id = a.active_revision_id
    WHERE a.project_id = p_project_id AND a.contract_family = p_contract_family
      AND a.contract_id = p_contract_id;
END;
$$;

COMMENT ON FUNCTION ql3.active_revision(text, text, text) IS
'The active revision of one contract with its pointer_version; no row when none is active.';

CREATE FUNCTION ql3.active_pointers(p_keys jsonb)
RETURNS TABLE (
    project_id text, contract_family text, contract_id text, revision_id uuid, pointer_version bigint
)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    IF p_keys IS NULL OR jsonb_typeof(p_keys) <> 'array'
       OR EXISTS (
           SELECT 1 FROM jsonb_array_elements(p_keys) AS k (key)
           WHERE jsonb_typeof(k.key) <> 'array' OR jsonb_array_length(k.key) <> 3
              OR jsonb_typeof(k.key -> 0) <> 'string' OR jsonb_typeof(k.key -> 1) <> 'string'
              OR jsonb_typeof(k.key -> 2) <> 'string'
       ) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: keys must be an array of [project_id, contract_family, contract_id]';
    END IF;
    RETURN QUERY
    SELECT k.key ->> 0, k.key ->> 1, k.key ->> 2, a.active_revision_id, coalesce(a.pointer_version, 0)
    FROM jsonb_array_elements(p_keys) WITH ORDINALITY AS k (key, ord)
    LEFT JOIN ql3.active_revisions AS a
        ON a.project_id = k.key ->> 0 AND a.contract_family = k.key ->> 1 AND a.contract_id = k.key ->> 2
    ORDER BY k.ord;
END;
$$;

COMMENT ON FUNCTION ql3.active_pointers(jsonb) IS
'One row per [project_id, family, contract_id] key: the active revision_id (NULL if none) and pointer_version.';

CREATE FUNCTION ql3.claim_outbox(p_limit integer)
RETURNS SETOF ql3.contract_outbox
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: limit must be 1..10000';
    END IF;
    RETURN QUERY
    SELECT * FROM ql3.contract_outbox AS o
    WHERE o.delivered_at IS NULL
    ORDER BY o.seq
    LIMIT p_limit
    FOR UPDATE SKIP LOCKED;
END;
$$;

COMMENT ON FUNCTION ql3.claim_outbox(integer) IS
'Locks up to p_limit undelivered rows in seq order for the caller''s transaction, skipping rows other relays hold.';

CREATE FUNCTION ql3.mark_outbox_delivered(p_seqs bigint []) RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
    WITH done AS (
        UPDATE ql3.contract_outbox AS o
        SET delivered_at = now(), relay_attempts = o.relay_attempts + 1, last_error = NULL
        WHERE o.seq = ANY(p_seqs) AND o.delivered_at IS NULL
        RETURNING 1
    )
    SELECT count(*)::integer FROM done;
$$;

COMMENT ON FUNCTION ql3.mark_outbox_delivered(bigint []) IS
'Marks rows delivered (already delivered rows are left alone); returns how many changed.';

CREATE FUNCTION ql3.mark_outbox_failed(p_seqs bigint [], p_error text) RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
    WITH failed AS (
        UPDATE ql3.contract_outbox AS o
        SET relay_attempts = o.relay_attempts + 1, last_error = left(coalesce(p_error, 'unknown error'), 2000)
        WHERE o.seq = ANY(p_seqs) AND o.delivered_at IS NULL
        RETURNING 1
    )
    SELECT count(*)::integer FROM failed;
$$;

COMMENT ON FUNCTION ql3.mark_outbox_failed(bigint [], text) IS
'Records a failed delivery attempt; the rows stay undelivered and will be claimed again.';

CREATE FUNCTION ql3.outbox_backlog()
RETURNS TABLE (undelivered bigint, oldest_age_seconds double precision, max_seq bigint)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
    SELECT
        (SELECT count(*) FROM ql3.contract_outbox AS o WHERE o.delivered_at IS NULL),
        (SELECT coalesce(extract(EPOCH FROM now() - min(o.created_at))::double precision, 0)
         FROM ql3.contract_outbox AS o WHERE o.delivered_at IS NULL),
        (SELECT coalesce(max(o.seq), 0) FROM ql3.contract_outbox AS o);
$$;

COMMENT ON FUNCTION ql3.outbox_backlog() IS
'Undelivered outbox rows, the age in seconds of the oldest one (0 when none), and the highest seq.';

-- Outbox retention (D55, amends D5). Removes at most p_batch delivered rows older than
-- p_delivered_before, oldest seq first. Never an undelivered row (and the guard trigger
-- refuses one anyway), and never a pointer's newest row: only rows whose pointer_version
-- is below the pointer's keep it out, so `ql3 verify`'s "pointer is its last outbox row"
-- invariant holds after a prune. SKIP LOCKED: a row a relay holds (claim_outbox, FOR
-- UPDATE) is skipped, so a prune neither waits on a claim nor changes its order. It acts
-- on every project, so under isolation (D47) it needs an every-project grant.
CREATE FUNCTION ql3.prune_outbox(p_delivered_before interval, p_batch integer) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    removed integer;
BEGIN
    IF p_delivered_before IS NULL OR p_delivered_before < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: delivered_before must be a non-negative interval';
    END IF;
    IF p_batch IS NULL OR p_batch < 1 OR p_batch > 100000 THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: batch must be 1..100000';
    END IF;
    IF NOT ql3._may_act(NULL) THEN
        PERFORM ql3._refuse_project(NULL, 'prune the outbox of');
    END IF;
    WITH doomed AS (
        SELECT o.seq FROM ql3.contract_outbox AS o
        WHERE o.delivered_at IS NOT NULL
          AND o.delivered_at < now() - p_delivered_before
          AND o.pointer_version < (
              SELECT a.pointer_version FROM ql3.active_revisions AS a
              WHERE (a.project_id, a.contract_family, a.contract_id)
                    = (o.project_id, o.contract_family, o.contract_id))
        ORDER BY o.seq
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM ql3.contract_outbox AS o
        USING doomed AS d
        WHERE o.seq = d.seq AND o.delivered_at IS NOT NULL
        RETURNING 1
    )
    SELECT count(*)::integer INTO removed FROM gone;
    RETURN removed;
END;
$$;

COMMENT ON FUNCTION ql3.prune_outbox(interval, integer) IS
'Deletes up to p_batch delivered outbox rows older than p_delivered_before, oldest first, '
'keeping each pointer''s newest row and skipping rows a relay holds; returns how many (D55).';

-- The failover epoch (D48): which history of the data this server holds. A promotion starts
-- a new timeline, a restore a new timeline or cluster, a database recreated from a dump a
-- new database oid; across any of them pointer_versions and outbox seqs may go backwards or
-- be reused with other content, so the relay puts the epoch in every message and heartbeat
-- and a cache that sees it change re-reads what it holds. On a primary the timeline is the
-- one WAL is written on (pg_control's checkpoint timeline lags a promotion until the next
-- checkpoint); a standby, where WAL cannot be named, reports its last checkpoint's.
CREATE FUNCTION ql3.failover_epoch() RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, ql3
AS $$
DECLARE
    timeline bigint;
BEGIN
    IF pg_is_in_recovery() THEN
        SELECT c.timeline_id INTO timeline FROM pg_control_checkpoint() AS c;
    ELSE
        timeline := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint;
    END IF;
    RETURN (SELECT s.system_identifier FROM pg_control_system() AS s)::text || '/' || timeline::text
        || '/' || (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())::text;
END;
$$;

COMMENT ON FUNCTION ql3.failover_epoch() IS
'system_identifier/timeline/database oid: changes on promotion, restore or a recreated database (D48).';

-- Grants (SPEC section 5, D46). The functions are the only writers: each one that writes
-- runs as ql3_owner (SECURITY DEFINER, search_path pinned with pg_temp last), and no other
-- role holds INSERT, UPDATE, DELETE or TRUNCATE on any table, or EXECUTE on a `_` helper.
-- Without UPDATE, no role can LOCK a table in a mode that blocks writers or take row locks
-- (SELECT ... FOR UPDATE/SHARE) on rows the functions write.

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ql3 FROM PUBLIC;  -- noqa: CP02

GRANT SELECT ON ql3.contract_families, ql3.contract_revisions, ql3.revision_revocations,
ql3.active_revisions TO ql3_runtime;
GRANT EXECUTE ON FUNCTION ql3.active_revision(text, text, text), ql3.active_pointers(jsonb) TO ql3_runtime;

GRANT SELECT ON ql3.contract_outbox TO ql3_relay;
GRANT EXECUTE ON FUNCTION ql3.claim_outbox(integer), ql3.mark_outbox_delivered(bigint []),
ql3.mark_outbox_failed(bigint [], text), ql3.outbox_backlog() TO ql3_relay;

GRANT SELECT ON ql3.contract_families, ql3.contract_revisions, ql3.revision_revocations,
ql3.active_revisions, ql3.contract_outbox TO ql3_operator;
GRANT EXECUTE ON FUNCTION ql3.put_revision(text, text, text, jsonb, text),
ql3.activate_revision(text, text, text, uuid, text, uuid), ql3.revoke_revision(uuid, text, text),
ql3.active_revision(text, text, text), ql3.active_pointers(jsonb), ql3.outbox_backlog(), ql3.wake_relays()
TO ql3_operator;
-- Outbox retention (D55): operators (the recovery daemon's login is one) and the owner.
GRANT EXECUTE ON FUNCTION ql3.prune_outbox(interval, integer) TO ql3_operator;

GRANT SELECT ON ql3.contract_families, ql3.contract_revisions, ql3.revision_revocations,
ql3.active_revisions, ql3.contract_outbox TO ql3_reader;
GRANT EXECUTE ON FUNCTION ql3.active_revision(text, text, text), ql3.active_pointers(jsonb),
ql3.outbox_backlog() TO ql3_reader;

-- Project isolation (D47): every role may ask what it may act on; operators map projects.
GRANT EXECUTE ON FUNCTION ql3.may_act_on(text), ql3.visible_projects()
TO ql3_runtime, ql3_relay, ql3_operator, ql3_reader;
-- The failover epoch (D48): relays stamp it on messages, caches compare it with theirs.
GRANT EXECUTE ON FUNCTION ql3.failover_epoch() TO ql3_runtime, ql3_relay, ql3_operator, ql3_reader;
GRANT EXECUTE ON FUNCTION ql3.grant_project(name, text), ql3.revoke_project(name, text) TO ql3_operator;
GRANT SELECT ON ql3.project_grants TO ql3_operator;

-- Row-level security: a role reads the rows of the projects it may act on (all of them
-- while no grant exists). The owner, and so every SECURITY DEFINER function, bypasses it.
-- visible_projects() is a scalar subquery, evaluated once per query, not per row. The
-- relay needs no policy of its own: it claims and counts through SECURITY DEFINER
-- functions, and outbox rows carry ids and versions, never bodies.
ALTER TABLE ql3.contract_revisions ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3.revision_revocations ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3.active_revisions ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3.contract_outbox ENABLE ROW LEVEL SECURITY;

CREATE POLICY project_rows ON ql3.contract_revisions FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR project_id = any((SELECT ql3.visible_projects())::text []));
-- A table without project_id follows its parent row (itself under its own policy); the
-- first test skips the lookup while isolation is off.
CREATE POLICY project_rows ON ql3.revision_revocations FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR EXISTS (
    SELECT 1 FROM ql3.contract_revisions AS r WHERE r.revision_id = revision_revocations.revision_id));
CREATE POLICY project_rows ON ql3.active_revisions FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR project_id = any((SELECT ql3.visible_projects())::text []));
CREATE POLICY project_rows ON ql3.contract_outbox FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR project_id = any((SELECT ql3.visible_projects())::text []));
