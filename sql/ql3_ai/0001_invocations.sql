-- requires: core 0004
-- Durable model invocations (SPEC section 4; seed ADR-0168, usage ledger ADR-0170).
--
-- An invocation is a receipt chain on a model step, never a second state machine:
-- admission (ready -> running) writes the Start before any provider I/O, completion
-- (running -> succeeded | failed | timed_out | lost) writes the Completion and, when the
-- call reported usage, its usage_ledger row; only a human Resolution moves a lost step on.
-- Each transition also bumps the step and run versions and appends one run event and one
-- step mutation, all in one transaction. Receipts are immutable: old attempts are never
-- overwritten, a retry is a new invocation chain on the same step.
--
-- Concurrency: every function locks the step row (FOR UPDATE on ql3.step_runs) before it
-- looks for an existing receipt of its phase, which serialises everything that happens to
-- one step; the run row is locked last, by the UPDATE that allocates the next event seq.
-- No function locks receipt rows itself (ql3_runtime has no UPDATE on them and so cannot);
-- the only lock on one is PostgreSQL's FOR KEY SHARE of a foreign-key check, which a
-- completion takes on its start and a resolution or ledger row on its completion. It
-- conflicts only with deleting the receipt or changing its key, which nobody may do.
--
-- The internal helpers (prefix _) carry no SET clause: they run several times per call,
-- call only pg_catalog built-ins and schema-qualified ql3 functions, and the public entry
-- points pin search_path for the whole call tree.

-- Constraint policy: the functions below are the writers and validate every field before
-- they write, so the tables keep only the constraints that guard the invariants a direct
-- INSERT by ql3_runtime could break (the receipt chain, outcome/result_code pairing),
-- not format checks: each CHECK and FK costs every insert (measured: a first version with
-- format CHECKs and an FK on every id spent about a quarter of an admit+complete pair there).

-- Identifiers and records are of the domains ql3.identifier and ql3.bounded_json, as
-- defence in depth behind the functions' checks (D46; see core 0002 for why domains).
CREATE TABLE ql3_ai.model_invocation_starts (
    invocation_id ql3.identifier PRIMARY KEY,
    request_id ql3.identifier NOT NULL,
    project_id ql3.identifier NOT NULL,
    run_id uuid NOT NULL,
    step_run_id uuid NOT NULL REFERENCES ql3.step_runs (step_run_id),
    trace_id ql3.identifier NOT NULL,
    attempt integer NOT NULL,
    provider ql3.identifier NOT NULL,
    model ql3.identifier NOT NULL,
    policy_contract_family text,
    policy_contract_id text,
    policy_revision_id uuid,
    request_digest text NOT NULL,
    deadline_at timestamptz NOT NULL,
    input_bytes bigint NOT NULL,
    command_digest text NOT NULL,
    record ql3.bounded_json NOT NULL,
    start_digest text NOT NULL,
    mutation_id text NOT NULL,
    event_id text NOT NULL,
    dedupe_key text NOT NULL,
    admitted_at timestamptz NOT NULL
);

COMMENT ON TABLE ql3_ai.model_invocation_starts IS
'Immutable Start receipts, written by admission before any provider I/O; record is the ql3/model-invocation-start@v1 JSON.';

-- History, not identity: one step has as many starts as it has attempts.
CREATE INDEX model_invocation_starts_history
ON ql3_ai.model_invocation_starts (run_id, step_run_id, admitted_at, invocation_id);

-- `ql3 invocations list`: the newest starts first, without sorting the whole history.
CREATE INDEX model_invocation_starts_recent
ON ql3_ai.model_invocation_starts (admitted_at, invocation_id);

CREATE TABLE ql3_ai.model_invocation_completions (
    invocation_id text PRIMARY KEY REFERENCES ql3_ai.model_invocation_starts (invocation_id),
    start_digest text NOT NULL,
    project_id text NOT NULL,
    run_id uuid NOT NULL,
    step_run_id uuid NOT NULL,
    outcome text NOT NULL,
    result_code ql3.identifier NOT NULL,
    output_bytes bigint,
    output_digest text,
    input_tokens bigint,
    output_tokens bigint,
    cost_micros bigint,
    currency text,
    recovered boolean NOT NULL,
    command_digest text NOT NULL,
    record ql3.bounded_json NOT NULL,
    completion_digest text NOT NULL,
    mutation_id text NOT NULL,
    event_id text NOT NULL,
    dedupe_key text NOT NULL,
    completed_at timestamptz NOT NULL,
    CHECK (
        CASE outcome
            WHEN 'lost' THEN result_code = 'outcome_unknown'
            WHEN 'succeeded' THEN NOT recovered AND result_code <> 'outcome_unknown'
            WHEN 'failed' THEN NOT recovered AND result_code <> 'outcome_unknown'
            WHEN 'timed_out' THEN NOT recovered AND result_code <> 'outcome_unknown'
            ELSE FALSE
        END
    )
);

COMMENT ON TABLE ql3_ai.model_invocation_completions IS
'Immutable Completion receipts (one per start); lost always carries outcome_unknown; recovered = written by recover_expired.';

CREATE INDEX model_invocation_completions_history
ON ql3_ai.model_invocation_completions (run_id, step_run_id, completed_at, invocation_id);

-- Lost outcomes wait for a human; this keeps "what is unresolved" cheap.
CREATE INDEX model_invocation_completions_lost
ON ql3_ai.model_invocation_completions (completed_at, invocation_id) WHERE outcome = 'lost';

CREATE TABLE ql3_ai.model_invocation_resolutions (
    invocation_id text PRIMARY KEY REFERENCES ql3_ai.model_invocation_completions (invocation_id),
    completion_digest text NOT NULL,
    run_id uuid NOT NULL,
    step_run_id uuid NOT NULL,
    decision text NOT NULL CHECK (decision IN ('retry', 'fail', 'cancel')),
    user_id ql3.identifier NOT NULL,
    -- The login that resolved (session_user), beside the user it resolved as (D47).
    resolved_by name NOT NULL,
    reason text,
    command_digest text NOT NULL,
    record ql3.bounded_json NOT NULL,
    resolution_digest text NOT NULL,
    mutation_id text NOT NULL,
    event_id text NOT NULL,
    dedupe_key text NOT NULL,
    resolved_at timestamptz NOT NULL
);

COMMENT ON TABLE ql3_ai.model_invocation_resolutions IS
'Immutable human Resolutions of lost/outcome_unknown completions: at most one per invocation.';

-- Who may resolve as whom (D47). With no row at all, a resolution may name any user_id
-- (the single-tenant behaviour). Once one exists, a login resolves as itself (user_id =
-- session_user) or as a user_id mapped to a role it is a member of. Managed by the owner:
-- an operator that could map identities could map itself to anyone.
CREATE TABLE ql3_ai.resolver_identities (
    role_name name NOT NULL,
    user_id ql3.identifier NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT ql3._now(),
    PRIMARY KEY (role_name, user_id)
);

COMMENT ON TABLE ql3_ai.resolver_identities IS
'The user_ids the members of a role may resolve as; no row at all = any user_id (single tenant).';

CREATE TABLE ql3_ai.usage_ledger (
    invocation_id text PRIMARY KEY REFERENCES ql3_ai.model_invocation_completions (invocation_id),
    project_id text NOT NULL,
    run_id uuid NOT NULL,
    provider text NOT NULL,
    model text NOT NULL,
    input_tokens bigint,
    output_tokens bigint,
    cost_micros bigint,
    currency text,
    outcome text NOT NULL,
    completion_digest text NOT NULL,
    recorded_at timestamptz NOT NULL,
    -- A row exists only for usage that exists; unknown cost stays NULL, never 0.
    CHECK (coalesce(input_tokens, output_tokens, cost_micros) IS NOT NULL OR currency IS NOT NULL)
);

COMMENT ON TABLE ql3_ai.usage_ledger IS
'Immutable projection of completions that report usage; cost_micros NULL means unknown, never a faked 0.';

CREATE INDEX usage_ledger_project ON ql3_ai.usage_ledger (project_id, recorded_at);

CREATE TRIGGER model_invocation_starts_immutable
BEFORE UPDATE OR DELETE ON ql3_ai.model_invocation_starts
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER model_invocation_starts_no_truncate
BEFORE TRUNCATE ON ql3_ai.model_invocation_starts
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER model_invocation_completions_immutable
BEFORE UPDATE OR DELETE ON ql3_ai.model_invocation_completions
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER model_invocation_completions_no_truncate
BEFORE TRUNCATE ON ql3_ai.model_invocation_completions
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER model_invocation_resolutions_immutable
BEFORE UPDATE OR DELETE ON ql3_ai.model_invocation_resolutions
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER model_invocation_resolutions_no_truncate
BEFORE TRUNCATE ON ql3_ai.model_invocation_resolutions
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER usage_ledger_immutable
BEFORE UPDATE OR DELETE ON ql3_ai.usage_ledger
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER usage_ledger_no_truncate
BEFORE TRUNCATE ON ql3_ai.usage_ledger
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

-- Only a human resolution moves a lost step (SPEC section 4): ql3_runtime may UPDATE
-- step_runs (SPEC section 5) but has no INSERT on resolutions, so a lost step may leave
-- `lost`, or change its invocation or attempt count, only once a resolution of its newest
-- start with the matching decision exists (resolve_invocation writes it before the step).
-- The WHEN clause keeps admission and completion from calling anything (D33).
CREATE FUNCTION ql3_ai._require_resolution() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    IF NEW.status <> 'lost' AND EXISTS (
        SELECT 1 FROM ql3_ai.model_invocation_resolutions AS r
        INNER JOIN ql3_ai.model_invocation_starts AS st ON st.invocation_id = r.invocation_id
        WHERE r.invocation_id = OLD.current_invocation_id
          AND r.step_run_id = OLD.step_run_id
          AND r.decision = CASE NEW.status WHEN 'ready' THEN 'retry' WHEN 'failed' THEN 'fail'
                                           WHEN 'cancelled' THEN 'cancel' END
          AND st.attempt = (SELECT max(n.attempt) FROM ql3_ai.model_invocation_starts AS n
                            WHERE n.run_id = OLD.run_id AND n.step_run_id = OLD.step_run_id)
    ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'Q3S01',
        MESSAGE = format('QL3_ILLEGAL_TRANSITION: step run %s is lost; only a resolution of its '
                         'invocation %s moves it', OLD.step_run_id, OLD.current_invocation_id);
END;
$$;

COMMENT ON FUNCTION ql3_ai._require_resolution() IS
'Trigger: a lost step changes only after a human resolution of its newest invocation.';

CREATE TRIGGER step_runs_lost_needs_resolution
BEFORE UPDATE ON ql3.step_runs
FOR EACH ROW
WHEN (
    old.status = 'lost'
    AND (new.status IS DISTINCT FROM old.status
         OR new.current_invocation_id IS DISTINCT FROM old.current_invocation_id
         OR new.attempt_count IS DISTINCT FROM old.attempt_count)
)
EXECUTE FUNCTION ql3_ai._require_resolution();

-- Command validation helpers.

-- kinds: string | integer (a JSON number >= 0 without fraction) | object | boolean,
-- suffixed with ? when null is allowed. Every field is required, nullable ones included,
-- so that one meaning has one canonical form and one command digest.
CREATE FUNCTION ql3_ai._check_shape(
    what text, command jsonb, schema_name text, fields text [], kinds text []
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    kind text;
    got text;
    num text;
    problem text;
BEGIN
    IF jsonb_typeof(command) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s must be a JSON object, not %s',
                             what, coalesce(jsonb_typeof(command), 'NULL'));
    END IF;
    IF schema_name IS NOT NULL AND (command ->> 'schema') IS DISTINCT FROM schema_name THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s schema must be %L, not %s',
                             what, schema_name, coalesce((command -> 'schema')::text, 'missing'));
    END IF;
    IF NOT (command ?& fields) THEN
        SELECT string_agg(f.name, ', ' ORDER BY f.name) INTO problem
        FROM unnest(fields) AS f (name) WHERE NOT command ? f.name;
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s lacks required field(s) %s', what, problem);
    END IF;
    IF (command - fields) <> '{}'::jsonb THEN
        SELECT string_agg(k.key, ', ' ORDER BY k.key) INTO problem
        FROM jsonb_object_keys(command - fields) AS k (key);
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s has unknown field(s) %s', what, problem);
    END IF;
    -- A loop of simple expressions: no executor start-up, unlike a query over unnest().
    FOR i IN 1 .. cardinality(fields) LOOP
        kind := kinds[i];
        got := jsonb_typeof(command -> fields[i]);
        IF got = 'number' THEN
            num := command ->> fields[i];
            -- An integer is written without a fraction: 512.0 is refused here, as on SQLite
            -- (D15), rather than by PostgreSQL's own 22P02 at a later cast.
            CONTINUE WHEN kind LIKE 'integer%' AND left(num, 1) <> '-' AND strpos(num, '.') = 0;
        ELSIF got = 'null' THEN
            CONTINUE WHEN kind LIKE '%?';
        ELSE
            CONTINUE WHEN got = rtrim(kind, '?');
        END IF;
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s field %s must be %s, not %s', what, fields[i],
                             CASE WHEN kind LIKE '%?' THEN rtrim(kind, '?') || ' or null' ELSE kind END,
                             left((command -> fields[i])::text, 64));
    END LOOP;
END;
$$;

COMMENT ON FUNCTION ql3_ai._check_shape(text, jsonb, text, text [], text []) IS
'Raises QL3_INVALID_ARGUMENT unless command is an object of exactly these fields with these JSON kinds.';

-- Canonical size limit and digest in one JCS pass: the framing of ql3.digest applied to
-- the ql3.jcs text that the size check needs anyway (the pgTAP suite proves they agree).
CREATE FUNCTION ql3_ai._checked_digest(what text, domain text, value jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    canonical text := ql3.jcs(value);
BEGIN
    IF octet_length(canonical) > 24576 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V02',
            MESSAGE = format('QL3_RECORD_TOO_LARGE: %s is %s bytes of canonical JSON (at most 24576)',
                             what, octet_length(canonical));
    END IF;
    RETURN ql3._framed_digest(domain, canonical);
END;
$$;

COMMENT ON FUNCTION ql3_ai._checked_digest(text, text, jsonb) IS
'digest(domain, value) after refusing values over 24 KiB of canonical JSON (QL3_RECORD_TOO_LARGE).';

-- Format checks below avoid regular expressions: PostgreSQL's regex engine costs about
-- 10 microseconds per 64-character match, and every command carries several of these.
CREATE FUNCTION ql3_ai._uuid(field text, value text) RETURNS uuid
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF length(value) <> 36 OR translate(value, '0123456789abcdef', '') <> '----'
       OR substr(value, 9, 1) <> '-' OR substr(value, 14, 1) <> '-' OR substr(value, 19, 1) <> '-'
       OR substr(value, 24, 1) <> '-' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s must be a lowercase hyphenated uuid, not %L',
                             field, left(value, 64));
    END IF;
    RETURN value::uuid;
END;
$$;

COMMENT ON FUNCTION ql3_ai._uuid(text, text) IS 'value as uuid, if it is the canonical lowercase form.';

CREATE FUNCTION ql3_ai._check_sha256(field text, value text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF length(value) <> 64 OR translate(value, '0123456789abcdef', '') <> '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s must be 64 lowercase hex digits, not %L',
                             field, left(value, 80));
    END IF;
END;
$$;

COMMENT ON FUNCTION ql3_ai._check_sha256(text, text) IS 'Raises unless value is a lowercase hex SHA-256.';

-- Commands use the record timestamp format too, so that one instant has one spelling and
-- a replay cannot differ from the original by formatting alone.
CREATE FUNCTION ql3_ai._timestamp(field text, value text) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    -- After the shape test every field below is digits only, so the integer casts are safe.
    IF length(value) <> 27 OR translate(value, '0123456789', '') <> '--T::.Z'
       OR substr(value, 5, 1) <> '-' OR substr(value, 8, 1) <> '-' OR substr(value, 11, 1) <> 'T'
       OR substr(value, 14, 1) <> ':' OR substr(value, 17, 1) <> ':' OR substr(value, 20, 1) <> '.'
       OR substr(value, 27, 1) <> 'Z' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s must be RFC 3339 UTC with six fractional digits '
                             '(2026-12-02T12:00:00.000000Z), not %L', field, left(value, 64));
    END IF;
    IF left(value, 4)::integer = 0
       OR substr(value, 6, 2)::integer NOT BETWEEN 1 AND 12 OR substr(value, 9, 2)::integer NOT BETWEEN 1 AND 31
       OR substr(value, 12, 2)::integer > 23 OR substr(value, 15, 2)::integer > 59
       OR substr(value, 18, 2)::integer > 59
       OR (substr(value, 9, 2)::integer > 28 AND substr(value, 9, 2)::integer > extract(DAY FROM
           make_date(left(value, 4)::integer, substr(value, 6, 2)::integer, 1) + interval '1 month - 1 day')) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: %s must be RFC 3339 UTC with six fractional digits '
                             '(2026-12-02T12:00:00.000000Z), not %L', field, left(value, 64));
    END IF;
    RETURN value::timestamptz;
END;
$$;

COMMENT ON FUNCTION ql3_ai._timestamp(text, text) IS
'Parses YYYY-MM-DDTHH:MM:SS.ffffffZ (the only timestamp spelling ql3 records and commands use).';

CREATE FUNCTION ql3_ai._utc(ts timestamptz) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT pg_catalog.to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
$$;

COMMENT ON FUNCTION ql3_ai._utc(timestamptz) IS 'RFC 3339 UTC text with exactly six fractional digits.';

-- mutation_id, event_id and dedupe_key of one phase (SPEC section 2): the three digests
-- share one canonical text, so it is computed once instead of three times. The pgTAP
-- suite holds the result equal to ql3.mutation_id, ql3.event_id and ql3.dedupe_key.
-- The canonical text of a two-element array is written out: a JSON string's canonical
-- form is what escape_json prints, which is what to_json(text) and jsonb output print.
CREATE FUNCTION ql3_ai._identities(invocation_id text, phase text) RETURNS text []
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    -- One SELECT of one expression, so that the planner inlines it into the caller's
    -- expression (no function call per admission or completion); STABLE because to_json
    -- and convert_to are.
    SELECT ARRAY[
        'mut_' || ql3._framed_digest('ql3/mutation-id@v1',
            '[' || coalesce(to_json(invocation_id)::text, 'null') || ',' || coalesce(to_json(phase)::text, 'null')
            || ']'),
        'evt_' || ql3._framed_digest('ql3/run-event-id@v1',
            '[' || coalesce(to_json(invocation_id)::text, 'null') || ',' || coalesce(to_json(phase)::text, 'null')
            || ']'),
        'ddp_' || ql3._framed_digest('ql3/dedupe-key@v1',
            '[' || coalesce(to_json(invocation_id)::text, 'null') || ',' || coalesce(to_json(phase)::text, 'null')
            || ']')
    ]
$$;

COMMENT ON FUNCTION ql3_ai._identities(text, text) IS
'ARRAY[mutation_id, event_id, dedupe_key] of an invocation phase, from one canonical text.';

-- Re-verifies a stored receipt before an exact replay reports it as existing.
CREATE FUNCTION ql3_ai._verify_receipt(what text, domain text, stored jsonb, stored_digest text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF ql3_ai._checked_digest(what, domain, stored) IS DISTINCT FROM stored_digest THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: stored %s no longer matches its digest %s', what, stored_digest);
    END IF;
END;
$$;

COMMENT ON FUNCTION ql3_ai._verify_receipt(text, text, jsonb, text) IS
'Raises QL3_CONFLICT unless the stored record still hashes to its stored digest.';

-- The QL3_CONFLICT (Q3C01) message for a unique violation while writing a phase's
-- receipts, naming what was taken. Unreachable while the functions are the only writers
-- (D46); a raw 23505 would hide which receipt identity it was.
CREATE FUNCTION ql3_ai._identity_taken(invocation_id text, phase text, taken text) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT pg_catalog.format(
        'QL3_CONFLICT: a receipt identity of the %s of invocation %s exists already (constraint %s; '
        'identities %s)', phase, invocation_id, taken,
        pg_catalog.array_to_string(ql3_ai._identities(invocation_id, phase), ', '))
$$;

COMMENT ON FUNCTION ql3_ai._identity_taken(text, text, text) IS
'The QL3_CONFLICT message for a receipt identity of an invocation phase that exists already.';

-- Admission, in a run and step that exist or (new_run) in a new one: the body of
-- admit_invocation and admit_in_new_run.
CREATE FUNCTION ql3_ai._admit(command jsonb, new_run boolean) RETURNS jsonb
LANGUAGE plpgsql
AS $$
-- Hot path: one admission per transaction, so each expression below is also set up once
-- per call; they are kept few and compact. Every check first runs as a cheap expression
-- that implies the original checks pass; only when it does not are the original helpers
-- called, in the original order, so that each error keeps its SQLSTATE, message and
-- precedence. The canonical texts of the command (in the common shape) and of the start
-- record are written out in sorted key order instead of walking them with ql3.jcs: the
-- fields are fixed, a JSON string's canonical form is its jsonb (escape_json) text, and an
-- integer's is its digits. The pgTAP suite holds every digest equal to ql3.digest of the
-- same value.
<<_admit>>
DECLARE
    command_digest text;
    invocation_id text;
    run_id uuid;
    step_run_id uuid;
    expected_version bigint;
    input_bytes bigint;
    deadline_at timestamptz;
    policy jsonb := command -> 'policy';
    policy_family text;
    policy_contract text;
    policy_revision uuid;
    family_known boolean;
    active_revision uuid;
    step ql3.step_runs;
    run ql3.runs;
    prior ql3_ai.model_invocation_starts;
    ids text [];
    receipt jsonb;
    start_digest text;
    result jsonb;
    canonical text;
    policy_text text := 'null';
    common_shape boolean;
    takes_ids boolean;
    fresh boolean := FALSE;
BEGIN
    IF pg_column_size(command) > 196608 THEN  -- the input's size first, in O(1) (D46)
        PERFORM ql3._refuse_too_large('admission command', command);
    END IF;
    -- In a new run (D59, D60). Ids that create_run and add_step_run could not take go on
    -- to the admission's own checks and errors. A run, step and invocation that do not
    -- exist yet are fresh: the run is inserted now and the step later, each as the
    -- admission leaves it, so no row is written twice and no step locked (nobody else
    -- can see either before COMMIT); whether the run exists is decided by inserting it.
    -- Anything else takes create_run and add_step_run first, with their answers and
    -- errors. Every later error takes the run with the transaction.
    IF new_run THEN
        takes_ids := coalesce(
            jsonb_typeof(command) = 'object'
            AND jsonb_typeof(command -> 'project_id') = 'string'
            AND jsonb_typeof(command -> 'trace_id') = 'string'
            AND jsonb_typeof(command -> 'run_id') = 'string'
            AND jsonb_typeof(command -> 'step_run_id') = 'string'
            AND char_length(command ->> 'project_id') BETWEEN 1 AND 128
            AND char_length(command ->> 'trace_id') BETWEEN 1 AND 128
            AND translate(command ->> 'run_id', '0123456789abcdef', '0000000000000000')
                = '00000000-0000-0000-0000-000000000000'
            AND translate(command ->> 'step_run_id', '0123456789abcdef', '0000000000000000')
                = '00000000-0000-0000-0000-000000000000',
            FALSE);
        IF takes_ids AND ql3._may_act(command ->> 'project_id')
           AND NOT EXISTS (SELECT 1 FROM ql3.step_runs AS s WHERE s.step_run_id = (command ->> 'step_run_id')::uuid)
           AND NOT EXISTS (SELECT 1 FROM ql3_ai.model_invocation_starts AS st
                           WHERE st.invocation_id = command ->> 'invocation_id') THEN
            INSERT INTO ql3.runs (run_id, project_id, trace_id, version, event_seq, updated_at)
            VALUES ((command ->> 'run_id')::uuid, command ->> 'project_id', command ->> 'trace_id', 2, 1, ql3._now())
            ON CONFLICT ON CONSTRAINT runs_pkey DO NOTHING;
            fresh := found;
        END IF;
        IF takes_ids AND NOT fresh THEN
            PERFORM ql3.create_run(command ->> 'project_id', command ->> 'trace_id', (command ->> 'run_id')::uuid);
            PERFORM ql3.add_step_run((command ->> 'run_id')::uuid, 'model', (command ->> 'step_run_id')::uuid);
        END IF;
    END IF;
    -- The common shape: exactly the v1 fields, strings where strings belong, integers
    -- written as plain digits up to 10^15 (within 2^53-1 and canonical as they are), policy
    -- null or exactly three strings. Anything else takes the original checks.
    common_shape := coalesce(
        command ?& '{schema,invocation_id,request_id,project_id,run_id,step_run_id,trace_id,expected_step_run_version,provider,model,policy,request_digest,input_bytes,deadline_at}'::text []
        AND command - '{schema,invocation_id,request_id,project_id,run_id,step_run_id,trace_id,expected_step_run_version,provider,model,policy,request_digest,input_bytes,deadline_at}'::text []
            = '{}'::jsonb
        AND jsonb_path_match(
            command,
            'strict $.schema == "ql3/model-invocation-admission@v1" && $.invocation_id.type() == "string"'
            ' && $.request_id.type() == "string" && $.project_id.type() == "string"'
            ' && $.run_id.type() == "string" && $.step_run_id.type() == "string" && $.trace_id.type() == "string"'
            ' && $.provider.type() == "string" && $.model.type() == "string"'
            ' && $.request_digest.type() == "string" && $.deadline_at.type() == "string"'
            ' && $.expected_step_run_version.type() == "number" && $.expected_step_run_version <= 999999999999999'
            ' && $.input_bytes.type() == "number" && $.input_bytes <= 999999999999999'
            ' && ($.policy.type() == "null" || ($.policy.contract_family.type() == "string"'
            ' && $.policy.contract_id.type() == "string" && $.policy.revision_id.type() == "string"))',
            '{}', TRUE)
        AND translate((command ->> 'expected_step_run_version') || (command ->> 'input_bytes'), '0123456789', '') = ''
        AND (policy = 'null'::jsonb
             OR (policy ?& '{contract_family,contract_id,revision_id}'::text []
                 AND policy - '{contract_family,contract_id,revision_id}'::text [] = '{}'::jsonb)),
        FALSE);
    IF common_shape THEN
        IF policy <> 'null'::jsonb THEN
            policy_text := format('{"contract_family":%s,"contract_id":%s,"revision_id":%s}',
                                  policy -> 'contract_family', policy -> 'contract_id', policy -> 'revision_id');
        END IF;
        canonical := format(
            '{"deadline_at":%s,"expected_step_run_version":%s,"input_bytes":%s,"invocation_id":%s,"model":%s,'
            '"policy":%s,"project_id":%s,"provider":%s,"request_digest":%s,"request_id":%s,"run_id":%s,'
            '"schema":"ql3/model-invocation-admission@v1","step_run_id":%s,"trace_id":%s}',
            command -> 'deadline_at', command -> 'expected_step_run_version', command -> 'input_bytes',
            command -> 'invocation_id', command -> 'model', policy_text, command -> 'project_id',
            command -> 'provider', command -> 'request_digest', command -> 'request_id', command -> 'run_id',
            command -> 'step_run_id', command -> 'trace_id');
        IF octet_length(canonical) > 24576 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V02',
                MESSAGE = format('QL3_RECORD_TOO_LARGE: %s is %s bytes of canonical JSON (at most 24576)',
                                 'admission command', octet_length(canonical));
        END IF;
        command_digest := ql3._framed_digest('ql3/model-invocation-admission@v1', canonical);
    ELSE
        PERFORM ql3_ai._check_shape(
            'admission command', command, 'ql3/model-invocation-admission@v1',
            ARRAY['schema', 'invocation_id', 'request_id', 'project_id', 'run_id', 'step_run_id', 'trace_id',
                  'expected_step_run_version', 'provider', 'model', 'policy', 'request_digest', 'input_bytes',
                  'deadline_at'],
            ARRAY['string', 'string', 'string', 'string', 'string', 'string', 'string',
                  'integer', 'string', 'string', 'object?', 'string', 'integer',
                  'string']);
        IF jsonb_typeof(policy) = 'object' THEN
            PERFORM ql3_ai._check_shape(
                'admission command policy', policy, NULL,
                ARRAY['contract_family', 'contract_id', 'revision_id'], ARRAY['string', 'string', 'string']);
            policy_text := format('{"contract_family":%s,"contract_id":%s,"revision_id":%s}',
                                  policy -> 'contract_family', policy -> 'contract_id', policy -> 'revision_id');
        END IF;
        command_digest := ql3_ai._checked_digest('admission command', 'ql3/model-invocation-admission@v1', command);
    END IF;
    -- The field checks of the original order as one expression: identifiers of 1..128
    -- characters, lowercase hyphenated uuids, a lowercase hex SHA-256, the version >= 1
    -- (plain digits without leading zeros: not "0"), and the record timestamp format with
    -- a day of at most 28 (later days take the original check of the month's length).
    IF NOT coalesce(
        common_shape
        AND least(char_length(command ->> 'invocation_id'), char_length(command ->> 'request_id'),
                  char_length(command ->> 'project_id'), char_length(command ->> 'trace_id'),
                  char_length(command ->> 'provider'), char_length(command ->> 'model')) >= 1
        AND greatest(char_length(command ->> 'invocation_id'), char_length(command ->> 'request_id'),
                     char_length(command ->> 'project_id'), char_length(command ->> 'trace_id'),
                     char_length(command ->> 'provider'), char_length(command ->> 'model')) <= 128
        AND translate(command ->> 'run_id', '0123456789abcdef', '0000000000000000')
            = '00000000-0000-0000-0000-000000000000'
        AND translate(command ->> 'step_run_id', '0123456789abcdef', '0000000000000000')
            = '00000000-0000-0000-0000-000000000000'
        AND command ->> 'expected_step_run_version' <> '0'
        AND translate(command ->> 'request_digest', '0123456789abcdef', '0000000000000000')
            = '0000000000000000000000000000000000000000000000000000000000000000'
        AND translate(command ->> 'deadline_at', '0123456789', '0000000000') = '0000-00-00T00:00:00.000000Z'
        AND left(command ->> 'deadline_at', 4) <> '0000'
        AND substr(command ->> 'deadline_at', 6, 2) COLLATE "C" BETWEEN '01' AND '12'
        AND substr(command ->> 'deadline_at', 9, 2) COLLATE "C" BETWEEN '01' AND '28'
        AND substr(command ->> 'deadline_at', 12, 2) COLLATE "C" <= '23'
        AND substr(command ->> 'deadline_at', 15, 2) COLLATE "C" <= '59'
        AND substr(command ->> 'deadline_at', 18, 2) COLLATE "C" <= '59'
        AND (policy = 'null'::jsonb
             OR (char_length(policy ->> 'contract_family') BETWEEN 1 AND 128
                 AND char_length(policy ->> 'contract_id') BETWEEN 1 AND 128
                 AND translate(policy ->> 'revision_id', '0123456789abcdef', '0000000000000000')
                     = '00000000-0000-0000-0000-000000000000')),
        FALSE) THEN
        PERFORM ql3._check_identifier('invocation_id', command ->> 'invocation_id');
        PERFORM ql3._check_identifier('request_id', command ->> 'request_id');
        PERFORM ql3._check_identifier('project_id', command ->> 'project_id');
        PERFORM ql3._check_identifier('trace_id', command ->> 'trace_id');
        PERFORM ql3._check_identifier('provider', command ->> 'provider');
        PERFORM ql3._check_identifier('model', command ->> 'model');
        PERFORM ql3_ai._uuid('run_id', command ->> 'run_id');
        PERFORM ql3_ai._uuid('step_run_id', command ->> 'step_run_id');
        IF (command ->> 'expected_step_run_version')::bigint < 1 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: expected_step_run_version must be >= 1';
        END IF;
        PERFORM ql3_ai._check_sha256('request_digest', command ->> 'request_digest');
        PERFORM (command ->> 'input_bytes')::bigint;
        PERFORM ql3_ai._timestamp('deadline_at', command ->> 'deadline_at');
        IF policy <> 'null'::jsonb THEN
            PERFORM ql3._check_identifier('policy.contract_family', policy ->> 'contract_family');
            PERFORM ql3._check_identifier('policy.contract_id', policy ->> 'contract_id');
            PERFORM ql3_ai._uuid('policy.revision_id', policy ->> 'revision_id');
        END IF;
    END IF;
    invocation_id := command ->> 'invocation_id';
    run_id := (command ->> 'run_id')::uuid;
    step_run_id := (command ->> 'step_run_id')::uuid;
    expected_version := (command ->> 'expected_step_run_version')::bigint;
    input_bytes := (command ->> 'input_bytes')::bigint;
    deadline_at := (command ->> 'deadline_at')::timestamptz;
    IF policy <> 'null'::jsonb THEN
        policy_family := policy ->> 'contract_family';
        policy_contract := policy ->> 'contract_id';
        policy_revision := (policy ->> 'revision_id')::uuid;
    END IF;

    IF NOT ql3._may_act(command ->> 'project_id') THEN
        PERFORM ql3._refuse_project(command ->> 'project_id', 'act on');
    END IF;
    -- With isolation on, another project's run is as absent as a missing one before anything
    -- of it is locked or compared, so that no answer tells its steps' state (D47).
    IF pg_catalog.pg_sequence_last_value('ql3.project_grants_used'::regclass) IS NOT NULL THEN
        IF NOT EXISTS (SELECT 1 FROM ql3.runs AS r
                       WHERE r.run_id = _admit.run_id AND ql3._may_act(r.project_id)) THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3N01', MESSAGE = format('QL3_NOT_FOUND: run %s does not exist', run_id);
        END IF;
    END IF;
    IF fresh THEN  -- the step add_step_run would have made, and no start of this invocation
        step.step_run_id := step_run_id;
        step.run_id := run_id;
        step.kind := 'model';
        step.status := 'ready';
        step.version := 1;
        step.attempt_count := 0;
    ELSE
        -- The step lock comes first: it orders this admission against every other
        -- transition of the step, including a concurrent admission of the same command.
        SELECT * INTO step FROM ql3.step_runs AS s WHERE s.step_run_id = _admit.step_run_id FOR UPDATE;
        IF NOT found OR step.run_id <> _admit.run_id THEN
            IF NOT EXISTS (SELECT 1 FROM ql3.runs AS r WHERE r.run_id = _admit.run_id) THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'Q3N01', MESSAGE = format('QL3_NOT_FOUND: run %s does not exist', run_id);
            END IF;
            RAISE EXCEPTION USING
                ERRCODE = 'Q3N01',
                MESSAGE = format('QL3_NOT_FOUND: step run %s does not exist in run %s', step_run_id, run_id);
        END IF;

        SELECT * INTO prior FROM ql3_ai.model_invocation_starts AS st WHERE st.invocation_id = _admit.invocation_id;
        IF found THEN
            IF prior.command_digest = _admit.command_digest THEN
                PERFORM ql3_ai._verify_receipt('start record', 'ql3/model-invocation-start@v1',
                                               prior.record, prior.start_digest);
                RETURN jsonb_build_object('status', 'existing', 'start', prior.record,
                                          'start_digest', prior.start_digest);
            END IF;
            IF NOT ql3._may_act(prior.project_id) THEN  -- no word about another project's start (D47)
                RAISE EXCEPTION USING
                    ERRCODE = 'Q3C01',
                    MESSAGE = format('QL3_CONFLICT: invocation %s was admitted in another project', invocation_id);
            END IF;
            RAISE EXCEPTION USING
                ERRCODE = 'Q3C01',
                MESSAGE = format('QL3_CONFLICT: invocation %s was admitted with another command (digest %s)',
                                 invocation_id, prior.command_digest);
        END IF;
    END IF;

    IF step.kind <> 'model' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: step run %s is of kind %L, not model', step_run_id, step.kind);
    END IF;
    IF step.status <> 'ready' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: step run %s is %s, not ready', step_run_id, step.status);
    END IF;
    IF step.version <> expected_version THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: step run %s is at version %s, the command expects %s',
                             step_run_id, step.version, expected_version);
    END IF;

    -- The policy fence, after the step lock (D46): no admission is made under a revision
    -- that a committed activation or revocation had replaced when it was made.
    -- - READ COMMITTED: this statement's snapshot is taken now, so it sees every change
    --   committed before it. A change still in flight is ordered after the admission, as
    --   if the admission had committed first. (FOR SHARE would make the two wait for each
    --   other, at the price of a MultiXact written into the pointer row whenever two
    --   admissions under one policy overlap; an advisory lock would be free but public:
    --   any login may take any advisory lock, and pg_locks shows every key in use.)
    -- - REPEATABLE READ and SERIALIZABLE: the snapshot may predate a committed change, so
    --   the pointer row is read FOR SHARE, which fails with 40001 when the row changed
    --   after the snapshot, and otherwise holds changes off until COMMIT. No role but the
    --   owner can lock the row itself (row locks need UPDATE).
    IF policy_revision IS NOT NULL THEN
        SELECT true INTO family_known FROM ql3.contract_families AS f WHERE f.contract_family = policy_family;
        IF family_known IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01',
                MESSAGE = format('QL3_INVALID_ARGUMENT: unknown contract family %L', policy_family);
        END IF;
        IF current_setting('transaction_isolation') = 'read committed' THEN
            SELECT a.active_revision_id INTO active_revision FROM ql3.active_revisions AS a
            WHERE a.project_id = command ->> 'project_id' AND a.contract_family = policy_family
              AND a.contract_id = policy_contract;
        ELSE
            SELECT a.active_revision_id INTO active_revision FROM ql3.active_revisions AS a
            WHERE a.project_id = command ->> 'project_id' AND a.contract_family = policy_family
              AND a.contract_id = policy_contract
            FOR SHARE;
        END IF;
        IF active_revision IS DISTINCT FROM policy_revision THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3C02',
                MESSAGE = format('QL3_STALE_REVISION: policy revision %s of %s/%s is not active (active: %s)',
                                 policy_revision, policy_family, policy_contract,
                                 coalesce(active_revision::text, 'none')),
                DETAIL = coalesce(active_revision::text, '');
        END IF;
    END IF;

    IF fresh THEN  -- inserted as the admission leaves it
        run.version := 2;
        run.event_seq := 1;
    ELSE
        UPDATE ql3.runs AS r
        SET version = r.version + 1, event_seq = r.event_seq + 1, updated_at = ql3._now()
        WHERE r.run_id = _admit.run_id
        RETURNING * INTO run;
        IF (run.project_id, run.trace_id) IS DISTINCT FROM (command ->> 'project_id', command ->> 'trace_id') THEN
            IF NOT ql3._may_act(run.project_id) THEN  -- no word about another project (D47)
                RAISE EXCEPTION USING
                    ERRCODE = 'Q3C01',
                    MESSAGE = format('QL3_CONFLICT: run %s belongs to another project', run_id);
            END IF;
            RAISE EXCEPTION USING
                ERRCODE = 'Q3C01',
                MESSAGE = format('QL3_CONFLICT: run %s belongs to project %L and trace %L, not %L and %L',
                                 run_id, run.project_id, run.trace_id,
                                 command ->> 'project_id', command ->> 'trace_id');
        END IF;
    END IF;

    ids := ql3_ai._identities(invocation_id, 'admission');  -- mutation_id, event_id, dedupe_key
    -- ql3.jcs refuses numbers beyond 2^53-1; only a counter that large takes the long way.
    IF greatest(step.attempt_count + 1, step.version + 1, run.version, run.event_seq, input_bytes)
       <= 9007199254740991
       AND least(step.attempt_count + 1, step.version + 1, run.version, run.event_seq, input_bytes)
       >= -9007199254740991 THEN
        canonical := format(
            '{"admitted_at":"%s","attempt":%s,"command_digest":"%s","deadline_at":%s,"dedupe_key":"%s",'
            '"event_id":"%s","input_bytes":%s,"invocation_id":%s,"model":%s,"mutation_id":"%s","policy":%s,'
            '"project_id":%s,"provider":%s,"request_digest":%s,"request_id":%s,"run_event_seq":%s,'
            '"run_id":%s,"run_version":%s,"schema":"ql3/model-invocation-start@v1","step_run_id":%s,'
            '"step_run_version":%s,"trace_id":%s}',
            ql3_ai._utc(ql3._now()), step.attempt_count + 1, command_digest, command -> 'deadline_at', ids[3],
            ids[2], input_bytes, command -> 'invocation_id', command -> 'model', ids[1], policy_text,
            command -> 'project_id', command -> 'provider', command -> 'request_digest', command -> 'request_id',
            run.event_seq, command -> 'run_id', run.version, command -> 'step_run_id', step.version + 1,
            command -> 'trace_id');
        IF octet_length(canonical) > 24576 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V02',
                MESSAGE = format('QL3_RECORD_TOO_LARGE: %s is %s bytes of canonical JSON (at most 24576)',
                                 'start record', octet_length(canonical));
        END IF;
        start_digest := ql3._framed_digest('ql3/model-invocation-start@v1', canonical);
        -- The result parsed once; the stored record is its "start" (a copy of the bytes).
        result := format('{"start":%s,"start_digest":"%s","status":"created"}', canonical, start_digest)::jsonb;
        receipt := result -> 'start';
    ELSE
        receipt := jsonb_build_object(
            'schema', 'ql3/model-invocation-start@v1',
            'invocation_id', invocation_id,
            'request_id', command ->> 'request_id',
            'project_id', command ->> 'project_id',
            'run_id', command ->> 'run_id',
            'step_run_id', command ->> 'step_run_id',
            'trace_id', command ->> 'trace_id',
            'attempt', step.attempt_count + 1,
            'provider', command ->> 'provider',
            'model', command ->> 'model',
            'policy', policy,
            'request_digest', command ->> 'request_digest',
            'input_bytes', input_bytes,
            'deadline_at', command ->> 'deadline_at',
            'command_digest', command_digest,
            'step_run_version', step.version + 1,
            'run_version', run.version,
            'run_event_seq', run.event_seq,
            'mutation_id', ids[1],
            'event_id', ids[2],
            'dedupe_key', ids[3],
            'admitted_at', ql3_ai._utc(ql3._now())
        );
        start_digest := ql3_ai._checked_digest('start record', 'ql3/model-invocation-start@v1', receipt);
        result := jsonb_build_object('status', 'created', 'start', receipt, 'start_digest', start_digest);
    END IF;

    IF fresh THEN
        INSERT INTO ql3.step_runs (
            step_run_id, run_id, kind, status, version, attempt_count, current_invocation_id, updated_at
        ) VALUES (
            step_run_id, run_id, 'model', 'running', 2, 1, invocation_id, ql3._now()
        )
        ON CONFLICT ON CONSTRAINT step_runs_pkey DO NOTHING;
        IF NOT found THEN
            -- Made meanwhile in another run: add_step_run raises its QL3_CONFLICT, as on
            -- the long way.
            PERFORM ql3.add_step_run(run_id, 'model', step_run_id);
            RAISE EXCEPTION USING
                ERRCODE = 'Q3C01', MESSAGE = format('QL3_CONFLICT: step run %s exists already', step_run_id);
        END IF;
    END IF;
    INSERT INTO ql3_ai.model_invocation_starts (
        invocation_id, request_id, project_id, run_id, step_run_id, trace_id, attempt, provider, model,
        policy_contract_family, policy_contract_id, policy_revision_id, request_digest, deadline_at,
        input_bytes, command_digest, record, start_digest, mutation_id, event_id, dedupe_key, admitted_at
    ) VALUES (
        invocation_id, command ->> 'request_id', command ->> 'project_id', run_id, step_run_id,
        command ->> 'trace_id', step.attempt_count + 1, command ->> 'provider', command ->> 'model',
        policy_family, policy_contract, policy_revision, command ->> 'request_digest', deadline_at,
        input_bytes, command_digest, receipt, start_digest, ids[1], ids[2], ids[3], ql3._now()
    )
    ON CONFLICT ON CONSTRAINT model_invocation_starts_pkey DO NOTHING;
    IF NOT found THEN
        -- Only a concurrent admission of the same invocation_id on another step gets here
        -- (one step's admissions are serialised by its lock): same id, other content.
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: invocation %s was admitted concurrently with another command',
                             invocation_id);
    END IF;
    IF NOT fresh THEN
        UPDATE ql3.step_runs AS s
        SET status = 'running', version = s.version + 1, attempt_count = s.attempt_count + 1,
            current_invocation_id = _admit.invocation_id, updated_at = ql3._now()
        WHERE s.step_run_id = _admit.step_run_id;
    END IF;
    INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
    VALUES (run_id, run.event_seq, ids[2], 'model_invocation_admitted', step_run_id,
            jsonb_build_object('invocation_id', invocation_id, 'attempt', step.attempt_count + 1,
                               'from_status', 'ready', 'to_status', 'running',
                               'step_run_version', step.version + 1, 'start_digest', start_digest));
    INSERT INTO ql3.step_run_mutations (
        mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version, command_digest
    ) VALUES (
        ids[1], ids[3], step_run_id, 'ready', 'running', step.version, step.version + 1, command_digest
    );
    RETURN result;
END;
$$;

COMMENT ON FUNCTION ql3_ai._admit(jsonb, boolean) IS
'The admission of admit_invocation and (new_run) admit_in_new_run.';

CREATE FUNCTION ql3_ai.admit_invocation(command jsonb) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
BEGIN
    RETURN ql3_ai._admit(command, FALSE);
END;
$$;

COMMENT ON FUNCTION ql3_ai.admit_invocation(jsonb) IS
'Admission: fences a ready model step to running and writes the Start receipt; only "created" may lead to provider I/O.';

-- Admission in a new run (D59): the run and its model step named by the command are
-- created, then admitted, in the caller's one transaction, so a model call that starts a
-- run costs one transaction and one round trip instead of three. The same ids again are
-- the same run and step (create_run and add_step_run's replay rules), so a replay after
-- an unknown outcome is exactly admit_invocation's replay. A command create_run or
-- add_step_run could not take (not an object; project_id or trace_id not 1..128
-- characters of text; run_id or step_run_id not a canonical uuid) is refused with the
-- admission's own error. Any error writes nothing. A run, step and invocation that do not
-- exist yet are written once, in their admitted state (D60).
CREATE FUNCTION ql3_ai.admit_in_new_run(command jsonb) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
BEGIN
    RETURN ql3_ai._admit(command, TRUE);
END;
$$;

COMMENT ON FUNCTION ql3_ai.admit_in_new_run(jsonb) IS
'Creates the run and model step the admission command names (or finds them, the same), then admits, in one transaction (D59).';

-- The writes of a completion, shared by complete_invocation and recover_expired. The
-- caller holds the step lock and has checked that the step is running this invocation.
CREATE FUNCTION ql3_ai._write_completion(
    start ql3_ai.model_invocation_starts, step_version bigint, command jsonb, command_digest text,
    recovered boolean
) RETURNS jsonb
LANGUAGE plpgsql
AS $$
<<_write_completion>>
DECLARE
    invocation_id text := start.invocation_id;
    outcome text := command ->> 'outcome';
    result_code text := command ->> 'result_code';
    usage jsonb := command -> 'usage';
    input_tokens bigint := (usage ->> 'input_tokens')::bigint;
    output_tokens bigint := (usage ->> 'output_tokens')::bigint;
    cost_micros bigint := (usage ->> 'cost_micros')::bigint;
    currency text := usage ->> 'currency';
    output_ref text;
    run ql3.runs;
    ids text [] := ql3_ai._identities(invocation_id, 'completion');
    mutation_id text := ids[1];
    event_id text := ids[2];
    dedupe_key text := ids[3];
    receipt jsonb;
    completion_digest text;
    result jsonb;
    output_bytes bigint;
    canonical text;
BEGIN
    IF outcome = 'succeeded' THEN
        output_ref := 'model-invocation:' || invocation_id;
    END IF;
    UPDATE ql3.runs AS r
    SET version = r.version + 1, event_seq = r.event_seq + 1, updated_at = ql3._now()
    WHERE r.run_id = start.run_id
    RETURNING * INTO run;
    output_bytes := (command ->> 'output_bytes')::bigint;
    -- The record's canonical text written out in sorted key order (see admit_invocation).
    -- ql3.jcs refuses numbers beyond 2^53-1 and prints SQL NULL as null: a record with a
    -- number that large or a NULL where the start row never has one takes the long way.
    IF greatest(start.attempt, output_bytes, input_tokens, output_tokens, cost_micros, step_version + 1,
                run.version, run.event_seq) <= 9007199254740991
       AND least(start.attempt, output_bytes, input_tokens, output_tokens, cost_micros, step_version + 1,
                 run.version, run.event_seq) >= -9007199254740991
       AND num_nulls(start.attempt, invocation_id, start.project_id, start.provider, start.model, start.run_id,
                     start.step_run_id, start.trace_id, start.start_digest, command_digest, recovered, step_version,
                     run.version, run.event_seq) = 0 THEN
        canonical := format(
            '{"attempt":%s,"command_digest":%s,"completed_at":"%s","dedupe_key":"%s","event_id":"%s",'
            '"invocation_id":%s,"model":%s,"mutation_id":"%s","outcome":%s,"output_bytes":%s,"output_digest":%s,'
            '"output_ref":%s,"project_id":%s,"provider":%s,"recovered":%s,"result_code":%s,"run_event_seq":%s,'
            '"run_id":"%s","run_version":%s,"schema":"ql3/model-invocation-completion@v1","start_digest":%s,'
            '"step_run_id":"%s","step_run_version":%s,"trace_id":%s,"usage":%s}',
            start.attempt, to_json(command_digest), ql3_ai._utc(ql3._now()), dedupe_key, event_id,
            to_json(invocation_id), to_json(start.model), mutation_id, coalesce(to_json(outcome)::text, 'null'),
            coalesce(output_bytes::text, 'null'), coalesce(to_json(command ->> 'output_digest')::text, 'null'),
            coalesce(to_json(output_ref)::text, 'null'), to_json(start.project_id), to_json(start.provider),
            to_json(recovered), coalesce(to_json(result_code)::text, 'null'), run.event_seq, start.run_id,
            run.version, to_json(start.start_digest), start.step_run_id, step_version + 1, to_json(start.trace_id),
            CASE WHEN coalesce(usage, 'null'::jsonb) = 'null'::jsonb THEN 'null' ELSE format(
                '{"cost_micros":%s,"currency":%s,"input_tokens":%s,"output_tokens":%s}',
                coalesce(cost_micros::text, 'null'), coalesce(to_json(currency)::text, 'null'),
                coalesce(input_tokens::text, 'null'), coalesce(output_tokens::text, 'null')) END);
        IF octet_length(canonical) > 24576 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V02',
                MESSAGE = format('QL3_RECORD_TOO_LARGE: %s is %s bytes of canonical JSON (at most 24576)',
                                 'completion record', octet_length(canonical));
        END IF;
        completion_digest := ql3._framed_digest('ql3/model-invocation-completion@v1', canonical);
        -- The result parsed once; the stored record is its "completion" (a copy of the bytes).
        result := format('{"completion":%s,"completion_digest":"%s","status":"created"}', canonical,
                         completion_digest)::jsonb;
        receipt := result -> 'completion';
    ELSE
        IF usage <> 'null'::jsonb THEN
            usage := jsonb_build_object('input_tokens', input_tokens, 'output_tokens', output_tokens,
                                        'cost_micros', cost_micros, 'currency', currency);
        END IF;
        receipt := jsonb_build_object(
            'schema', 'ql3/model-invocation-completion@v1',
            'invocation_id', invocation_id,
            'start_digest', start.start_digest,
            'project_id', start.project_id,
            'run_id', start.run_id,
            'step_run_id', start.step_run_id,
            'trace_id', start.trace_id,
            'attempt', start.attempt,
            'provider', start.provider,
            'model', start.model,
            'outcome', outcome,
            'result_code', result_code,
            'output_bytes', output_bytes,
            'output_digest', command ->> 'output_digest',
            'usage', usage,
            'recovered', recovered,
            'output_ref', output_ref,
            'command_digest', command_digest,
            'step_run_version', step_version + 1,
            'run_version', run.version,
            'run_event_seq', run.event_seq,
            'mutation_id', mutation_id,
            'event_id', event_id,
            'dedupe_key', dedupe_key,
            'completed_at', ql3_ai._utc(ql3._now())
        );
        completion_digest := ql3_ai._checked_digest(
            'completion record', 'ql3/model-invocation-completion@v1', receipt);
        result := jsonb_build_object('status', 'created', 'completion', receipt, 'completion_digest',
                                     completion_digest);
    END IF;

    INSERT INTO ql3_ai.model_invocation_completions (
        invocation_id, start_digest, project_id, run_id, step_run_id, outcome, result_code, output_bytes,
        output_digest, input_tokens, output_tokens, cost_micros, currency, recovered, command_digest, record,
        completion_digest, mutation_id, event_id, dedupe_key, completed_at
    ) VALUES (
        invocation_id, start.start_digest, start.project_id, start.run_id, start.step_run_id, outcome,
        result_code, output_bytes, command ->> 'output_digest', input_tokens,
        output_tokens, cost_micros, currency, recovered, command_digest, receipt, completion_digest,
        mutation_id, event_id, dedupe_key, ql3._now()
    );
    IF coalesce(input_tokens, output_tokens, cost_micros) IS NOT NULL OR currency IS NOT NULL THEN
        INSERT INTO ql3_ai.usage_ledger (
            invocation_id, project_id, run_id, provider, model, input_tokens, output_tokens, cost_micros,
            currency, outcome, completion_digest, recorded_at
        ) VALUES (
            invocation_id, start.project_id, start.run_id, start.provider, start.model, input_tokens,
            output_tokens, cost_micros, currency, outcome, completion_digest, ql3._now()
        );
    END IF;
    UPDATE ql3.step_runs AS s
    SET status = _write_completion.outcome, version = s.version + 1, output_ref = _write_completion.output_ref,
        result_code = _write_completion.result_code, updated_at = ql3._now()
    WHERE s.step_run_id = start.step_run_id;
    INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
    VALUES (start.run_id, run.event_seq, event_id, 'model_invocation_completed', start.step_run_id,
            jsonb_build_object('invocation_id', invocation_id, 'outcome', outcome, 'result_code', result_code,
                               'recovered', recovered, 'from_status', 'running', 'to_status', outcome,
                               'step_run_version', step_version + 1, 'completion_digest', completion_digest));
    INSERT INTO ql3.step_run_mutations (
        mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version, command_digest
    ) VALUES (
        mutation_id, dedupe_key, start.step_run_id, 'running', outcome, step_version, step_version + 1,
        command_digest
    );
    RETURN result;
END;
$$;

COMMENT ON FUNCTION ql3_ai._write_completion(ql3_ai.model_invocation_starts, bigint, jsonb, text, boolean) IS
'Writes a Completion, its usage_ledger row when usage is reported, and the step/run transition.';

CREATE FUNCTION ql3_ai.complete_invocation(command jsonb) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
<<complete_invocation>>
DECLARE
    command_digest text;
    invocation_id text;
    outcome text := command ->> 'outcome';
    result_code text := command ->> 'result_code';
    usage jsonb := command -> 'usage';
    start ql3_ai.model_invocation_starts;
    step ql3.step_runs;
    prior ql3_ai.model_invocation_completions;
    ledger ql3_ai.usage_ledger;
    canonical text;
    common_shape boolean;
    taken text;
BEGIN
    IF pg_column_size(command) > 196608 THEN  -- the input's size first, in O(1) (D46)
        PERFORM ql3._refuse_too_large('completion command', command);
    END IF;
    -- As in admit_invocation: the common shape (exactly the v1 fields and kinds, integers
    -- as plain digits up to 10^15) gets its canonical text written out; anything else
    -- takes the original checks, in the original order.
    common_shape := coalesce(
        command ?& '{schema,invocation_id,start_digest,outcome,result_code,output_bytes,output_digest,usage}'::text []
        AND command - '{schema,invocation_id,start_digest,outcome,result_code,output_bytes,output_digest,usage}'::text []
            = '{}'::jsonb
        AND jsonb_path_match(
            command,
            'strict $.schema == "ql3/model-invocation-completion-command@v1" && $.invocation_id.type() == "string"'
            ' && $.start_digest.type() == "string" && $.outcome.type() == "string"'
            ' && $.result_code.type() == "string"'
            ' && ($.output_bytes.type() == "null" || ($.output_bytes.type() == "number"'
            ' && $.output_bytes <= 999999999999999))'
            ' && ($.output_digest.type() == "null" || $.output_digest.type() == "string")'
            ' && ($.usage.type() == "null" || (($.usage.input_tokens.type() == "null"'
            ' || ($.usage.input_tokens.type() == "number" && $.usage.input_tokens <= 999999999999999))'
            ' && ($.usage.output_tokens.type() == "null"'
            ' || ($.usage.output_tokens.type() == "number" && $.usage.output_tokens <= 999999999999999))'
            ' && ($.usage.cost_micros.type() == "null"'
            ' || ($.usage.cost_micros.type() == "number" && $.usage.cost_micros <= 999999999999999))'
            ' && ($.usage.currency.type() == "null" || $.usage.currency.type() == "string")))',
            '{}', TRUE)
        AND translate(coalesce(command ->> 'output_bytes', '') || coalesce(usage ->> 'input_tokens', '')
                      || coalesce(usage ->> 'output_tokens', '') || coalesce(usage ->> 'cost_micros', ''),
                      '0123456789', '') = ''
        AND (usage = 'null'::jsonb
             OR (usage ?& '{input_tokens,output_tokens,cost_micros,currency}'::text []
                 AND usage - '{input_tokens,output_tokens,cost_micros,currency}'::text [] = '{}'::jsonb)),
        FALSE);
    IF common_shape THEN
        canonical := format(
            '{"invocation_id":%s,"outcome":%s,"output_bytes":%s,"output_digest":%s,"result_code":%s,'
            '"schema":"ql3/model-invocation-completion-command@v1","start_digest":%s,"usage":%s}',
            command -> 'invocation_id', command -> 'outcome', command -> 'output_bytes', command -> 'output_digest',
            command -> 'result_code', command -> 'start_digest',
            CASE WHEN usage = 'null'::jsonb THEN 'null' ELSE format(
                '{"cost_micros":%s,"currency":%s,"input_tokens":%s,"output_tokens":%s}',
                usage -> 'cost_micros', usage -> 'currency', usage -> 'input_tokens', usage -> 'output_tokens') END);
        IF octet_length(canonical) > 24576 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V02',
                MESSAGE = format('QL3_RECORD_TOO_LARGE: %s is %s bytes of canonical JSON (at most 24576)',
                                 'completion command', octet_length(canonical));
        END IF;
        command_digest := ql3._framed_digest('ql3/model-invocation-completion-command@v1', canonical);
    ELSE
        PERFORM ql3_ai._check_shape(
            'completion command', command, 'ql3/model-invocation-completion-command@v1',
            ARRAY['schema', 'invocation_id', 'start_digest', 'outcome', 'result_code', 'output_bytes',
                  'output_digest', 'usage'],
            ARRAY['string', 'string', 'string', 'string', 'string', 'integer?', 'string?', 'object?']);
        IF jsonb_typeof(usage) = 'object' THEN
            PERFORM ql3_ai._check_shape(
                'completion command usage', usage, NULL,
                ARRAY['input_tokens', 'output_tokens', 'cost_micros', 'currency'],
                ARRAY['integer?', 'integer?', 'integer?', 'string?']);
        END IF;
        command_digest := ql3_ai._checked_digest(
            'completion command', 'ql3/model-invocation-completion-command@v1', command);
    END IF;
    invocation_id := command ->> 'invocation_id';
    IF NOT coalesce(char_length(invocation_id) BETWEEN 1 AND 128
                    AND translate(command ->> 'start_digest', '0123456789abcdef', '0000000000000000')
                        = '0000000000000000000000000000000000000000000000000000000000000000', FALSE) THEN
        PERFORM ql3._check_identifier('invocation_id', command ->> 'invocation_id');
        PERFORM ql3_ai._check_sha256('start_digest', command ->> 'start_digest');
    END IF;
    IF outcome NOT IN ('succeeded', 'failed', 'timed_out', 'lost') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: outcome must be succeeded, failed, timed_out or lost, not %L',
                             left(outcome, 64));
    END IF;
    IF NOT coalesce(char_length(result_code) BETWEEN 1 AND 128, FALSE) THEN
        PERFORM ql3._check_identifier('result_code', result_code);
    END IF;
    IF translate(result_code, 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-', '') <> ''
       OR translate(left(result_code, 1), 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz', '') <> '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: result_code must match [A-Za-z][A-Za-z0-9_.:-]*, not %L',
                             result_code);
    END IF;
    IF (outcome = 'lost') <> (result_code = 'outcome_unknown') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: outcome %s with result_code %s (lost goes with outcome_unknown, '
                             'and only lost)', outcome, result_code);
    END IF;
    IF result_code IN ('model_outcome_rejected', 'model_outcome_cancelled') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: result_code %s is reserved for resolutions', result_code);
    END IF;
    IF command ->> 'output_digest' IS NOT NULL
       AND NOT coalesce(translate(command ->> 'output_digest', '0123456789abcdef', '0000000000000000')
                        = '0000000000000000000000000000000000000000000000000000000000000000', FALSE) THEN
        PERFORM ql3_ai._check_sha256('output_digest', command ->> 'output_digest');
    END IF;
    IF usage <> 'null'::jsonb THEN
        IF length(usage ->> 'currency') <> 3 OR translate(usage ->> 'currency', 'ABCDEFGHIJKLMNOPQRSTUVWXYZ', '') <> '' THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01',
                MESSAGE = format('QL3_INVALID_ARGUMENT: usage.currency must be an ISO 4217 code, not %L',
                                 left(usage ->> 'currency', 64));
        END IF;
        IF usage ->> 'cost_micros' IS NOT NULL AND usage ->> 'currency' IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: usage.cost_micros needs usage.currency';
        END IF;
    END IF;

    SELECT * INTO start FROM ql3_ai.model_invocation_starts AS st
    WHERE st.invocation_id = complete_invocation.invocation_id;
    -- Another project's invocation is as absent as one never admitted (D47).
    IF NOT found OR NOT ql3._may_act(start.project_id) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3N01',
            MESSAGE = format('QL3_NOT_FOUND: invocation %s was never admitted', invocation_id);
    END IF;
    SELECT * INTO step FROM ql3.step_runs AS s WHERE s.step_run_id = start.step_run_id FOR UPDATE;

    SELECT * INTO prior FROM ql3_ai.model_invocation_completions AS c
    WHERE c.invocation_id = complete_invocation.invocation_id;
    IF found THEN
        IF prior.command_digest <> complete_invocation.command_digest THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3C01',
                MESSAGE = format('QL3_CONFLICT: invocation %s was completed with another command '
                                 '(outcome %s, result_code %s)', invocation_id, prior.outcome, prior.result_code);
        END IF;
        PERFORM ql3_ai._verify_receipt('completion record', 'ql3/model-invocation-completion@v1',
                                       prior.record, prior.completion_digest);
        SELECT * INTO ledger FROM ql3_ai.usage_ledger AS u WHERE u.invocation_id = complete_invocation.invocation_id;
        IF found IS DISTINCT FROM (coalesce(prior.input_tokens, prior.output_tokens, prior.cost_micros) IS NOT NULL
                                   OR prior.currency IS NOT NULL)
           OR (found AND (ledger.input_tokens, ledger.output_tokens, ledger.cost_micros, ledger.currency,
                          ledger.outcome, ledger.completion_digest, ledger.project_id, ledger.run_id)
                         IS DISTINCT FROM
                         (prior.input_tokens, prior.output_tokens, prior.cost_micros, prior.currency,
                          prior.outcome, prior.completion_digest, prior.project_id, prior.run_id)) THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3C01',
                MESSAGE = format('QL3_CONFLICT: the usage_ledger row of invocation %s does not match its completion',
                                 invocation_id);
        END IF;
        RETURN jsonb_build_object('status', 'existing', 'completion', prior.record,
                                  'completion_digest', prior.completion_digest);
    END IF;

    IF start.start_digest <> command ->> 'start_digest' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: start_digest of invocation %s is %s, not %s',
                             invocation_id, start.start_digest, command ->> 'start_digest');
    END IF;
    IF step.status <> 'running' OR step.current_invocation_id IS DISTINCT FROM invocation_id THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3S01',
            MESSAGE = format('QL3_ILLEGAL_TRANSITION: step run %s is %s with invocation %s, not running %s',
                             step.step_run_id, step.status, coalesce(step.current_invocation_id, 'none'),
                             invocation_id);
    END IF;
    BEGIN
        RETURN ql3_ai._write_completion(start, step.version, command, command_digest, false);
    EXCEPTION WHEN unique_violation THEN
        GET STACKED DIAGNOSTICS taken = CONSTRAINT_NAME;
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01', MESSAGE = ql3_ai._identity_taken(invocation_id, 'completion', taken);
    END;
END;
$$;

COMMENT ON FUNCTION ql3_ai.complete_invocation(jsonb) IS
'Completion: writes the Completion receipt (and usage_ledger row) and moves the running step to its outcome.';

CREATE FUNCTION ql3_ai.resolve_invocation(command jsonb) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
<<resolve_invocation>>
DECLARE
    command_digest text;
    invocation_id text;
    decision text := command ->> 'decision';
    expected_version bigint;
    new_status text;
    new_result_code text;
    start ql3_ai.model_invocation_starts;
    step ql3.step_runs;
    completion ql3_ai.model_invocation_completions;
    prior ql3_ai.model_invocation_resolutions;
    run ql3.runs;
    ids text [];
    mutation_id text;
    event_id text;
    dedupe_key text;
    receipt jsonb;
    resolution_digest text;
    taken text;
BEGIN
    IF pg_column_size(command) > 196608 THEN  -- the input's size first, in O(1) (D46)
        PERFORM ql3._refuse_too_large('resolution command', command);
    END IF;
    PERFORM ql3_ai._check_shape(
        'resolution command', command, 'ql3/model-invocation-resolution-command@v1',
        ARRAY['schema', 'invocation_id', 'completion_digest', 'decision', 'user_id', 'expected_step_run_version',
              'reason'],
        ARRAY['string', 'string', 'string', 'string', 'string', 'integer', 'string?']);
    command_digest := ql3_ai._checked_digest(
        'resolution command', 'ql3/model-invocation-resolution-command@v1', command);
    invocation_id := ql3._check_identifier('invocation_id', command ->> 'invocation_id');
    PERFORM ql3._check_identifier('user_id', command ->> 'user_id');
    PERFORM ql3_ai._check_sha256('completion_digest', command ->> 'completion_digest');
    CASE decision
        WHEN 'retry' THEN new_status := 'ready';
        WHEN 'fail' THEN new_status := 'failed'; new_result_code := 'model_outcome_rejected';
        WHEN 'cancel' THEN new_status := 'cancelled'; new_result_code := 'model_outcome_cancelled';
        ELSE
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01',
                MESSAGE = format('QL3_INVALID_ARGUMENT: decision must be retry, fail or cancel, not %L',
                                 left(decision, 64));
    END CASE;
    expected_version := (command ->> 'expected_step_run_version')::bigint;
    IF expected_version < 1 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: expected_step_run_version must be >= 1';
    END IF;
    IF command ->> 'reason' = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: reason must be null or non-empty';
    END IF;
    IF EXISTS (SELECT 1 FROM ql3_ai.resolver_identities)
       AND command ->> 'user_id' IS DISTINCT FROM session_user::text
       AND NOT EXISTS (
           SELECT 1 FROM ql3_ai.resolver_identities AS i
           WHERE i.user_id = command ->> 'user_id' AND ql3._session_is_member(i.role_name)
       ) THEN
        RAISE EXCEPTION USING
            ERRCODE = '42501',
            MESSAGE = format('QL3_PERMISSION_DENIED: %s may not resolve as %L', session_user,
                             command ->> 'user_id'),
            HINT = 'the owner maps logins to user_ids in ql3_ai.resolver_identities (D47)';
    END IF;

    SELECT * INTO start FROM ql3_ai.model_invocation_starts AS st
    WHERE st.invocation_id = resolve_invocation.invocation_id;
    -- Another project's invocation is as absent as one never admitted (D47).
    IF NOT found OR NOT ql3._may_act(start.project_id) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3N01',
            MESSAGE = format('QL3_NOT_FOUND: invocation %s was never admitted', invocation_id);
    END IF;
    SELECT * INTO step FROM ql3.step_runs AS s WHERE s.step_run_id = start.step_run_id FOR UPDATE;

    SELECT * INTO prior FROM ql3_ai.model_invocation_resolutions AS v
    WHERE v.invocation_id = resolve_invocation.invocation_id;
    IF found THEN
        IF prior.command_digest <> resolve_invocation.command_digest THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3C01',
                MESSAGE = format('QL3_CONFLICT: invocation %s was already resolved (%s by %s)',
                                 invocation_id, prior.decision, prior.user_id);
        END IF;
        PERFORM ql3_ai._verify_receipt('resolution record', 'ql3/model-invocation-resolution@v1',
                                       prior.record, prior.resolution_digest);
        RETURN jsonb_build_object('status', 'existing', 'resolution', prior.record,
                                  'resolution_digest', prior.resolution_digest);
    END IF;

    SELECT * INTO completion FROM ql3_ai.model_invocation_completions AS c
    WHERE c.invocation_id = resolve_invocation.invocation_id;
    IF NOT found OR completion.outcome <> 'lost' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3S01',
            MESSAGE = format('QL3_ILLEGAL_TRANSITION: invocation %s is %s, only lost/outcome_unknown is resolved',
                             invocation_id, coalesce(completion.outcome, 'not completed'));
    END IF;
    IF completion.completion_digest <> command ->> 'completion_digest' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: completion_digest of invocation %s is %s, not %s',
                             invocation_id, completion.completion_digest, command ->> 'completion_digest');
    END IF;
    IF step.status <> 'lost' OR step.current_invocation_id IS DISTINCT FROM invocation_id THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3S01',
            MESSAGE = format('QL3_ILLEGAL_TRANSITION: step run %s is %s with invocation %s, not lost with %s',
                             step.step_run_id, step.status, coalesce(step.current_invocation_id, 'none'),
                             invocation_id);
    END IF;
    IF step.version <> expected_version THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: step run %s is at version %s, the command expects %s',
                             step.step_run_id, step.version, expected_version);
    END IF;

    BEGIN
        UPDATE ql3.runs AS r
        SET version = r.version + 1, event_seq = r.event_seq + 1, updated_at = ql3._now()
        WHERE r.run_id = start.run_id
        RETURNING * INTO run;
        ids := ql3_ai._identities(invocation_id, 'resolution');
        mutation_id := ids[1];
        event_id := ids[2];
        dedupe_key := ids[3];
        receipt := jsonb_build_object(
            'schema', 'ql3/model-invocation-resolution@v1',
            'invocation_id', invocation_id,
            'completion_digest', completion.completion_digest,
            'project_id', start.project_id,
            'run_id', start.run_id,
            'step_run_id', start.step_run_id,
            'trace_id', start.trace_id,
            'attempt', start.attempt,
            'decision', decision,
            'user_id', command ->> 'user_id',
            'reason', command ->> 'reason',
            'to_status', new_status,
            'result_code', new_result_code,
            'command_digest', command_digest,
            'step_run_version', step.version + 1,
            'run_version', run.version,
            'run_event_seq', run.event_seq,
            'mutation_id', mutation_id,
            'event_id', event_id,
            'dedupe_key', dedupe_key,
            'resolved_at', ql3_ai._utc(ql3._now())
        );
        resolution_digest := ql3_ai._checked_digest(
            'resolution record', 'ql3/model-invocation-resolution@v1', receipt);

        INSERT INTO ql3_ai.model_invocation_resolutions (
            invocation_id, completion_digest, run_id, step_run_id, decision, user_id, resolved_by, reason,
            command_digest, record, resolution_digest, mutation_id, event_id, dedupe_key, resolved_at
        ) VALUES (
            invocation_id, completion.completion_digest, start.run_id, start.step_run_id, decision,
            command ->> 'user_id', session_user, command ->> 'reason', command_digest, receipt,
            resolution_digest, mutation_id, event_id, dedupe_key, ql3._now()
        );
        -- retry clears the old result (the next admission needs a new invocation_id, its
        -- start raises attempt_count); fail and cancel keep the invocation that ended it.
        UPDATE ql3.step_runs AS s
        SET status = new_status, version = s.version + 1, output_ref = NULL, result_code = new_result_code,
            current_invocation_id = CASE WHEN new_status = 'ready' THEN NULL ELSE s.current_invocation_id END,
            updated_at = ql3._now()
        WHERE s.step_run_id = start.step_run_id;
        INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
        VALUES (start.run_id, run.event_seq, event_id, 'model_invocation_resolved', start.step_run_id,
                jsonb_build_object('invocation_id', invocation_id, 'decision', decision,
                                   'user_id', command ->> 'user_id', 'from_status', 'lost', 'to_status', new_status,
                                   'step_run_version', step.version + 1, 'resolution_digest', resolution_digest));
        INSERT INTO ql3.step_run_mutations (
            mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version, command_digest
        ) VALUES (
            mutation_id, dedupe_key, start.step_run_id, 'lost', new_status, step.version, step.version + 1,
            command_digest
        );
        RETURN jsonb_build_object('status', 'created', 'resolution', receipt, 'resolution_digest', resolution_digest);
    EXCEPTION WHEN unique_violation THEN
        GET STACKED DIAGNOSTICS taken = CONSTRAINT_NAME;
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01', MESSAGE = ql3_ai._identity_taken(invocation_id, 'resolution', taken);
    END;
END;
$$;

COMMENT ON FUNCTION ql3_ai.resolve_invocation(jsonb) IS
'Human Resolution of a lost/outcome_unknown invocation: retry (lost -> ready), fail or cancel; one per invocation.';

CREATE FUNCTION ql3_ai.recover_expired(p_limit integer, p_grace interval) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    expired record;
    start ql3_ai.model_invocation_starts;
    command jsonb;
    result jsonb;
    recovered jsonb := '[]'::jsonb;
    failed jsonb := '[]'::jsonb;
    failed_state text;
    failed_message text;
    failed_constraint text;
    -- The grace in seconds (a month as 30 days, a year as 365.25): '1 day' is 86400 s here,
    -- not a calendar day in the session's time zone, which a DST change makes 23 or 25 h (D29).
    grace_seconds numeric := extract(EPOCH FROM p_grace);
    horizon timestamptz;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: limit must be 1..10000';
    END IF;
    IF grace_seconds IS NULL OR grace_seconds < 0 OR grace_seconds > 3153600000 THEN  -- 36500 days
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: grace must be a non-negative interval of at most 36500 days';
    END IF;
    horizon := ql3._now() - make_interval(secs => grace_seconds::double precision);
    -- An unfinished start is exactly the current invocation of a running step, so the
    -- scan walks running steps (few) rather than the start history (unbounded). Steps
    -- another transaction holds are skipped: their owner is completing them right now.
    -- The scan returns the start row itself, so each start is read once, and it locks
    -- the step row only (OF s): never a receipt.
    -- The batch is chosen oldest deadline first, then settled run by run: each settlement
    -- locks its run, and two recoveries that lock runs in one order cannot deadlock (D33).
    FOR expired IN
        SELECT b.start, b.step_version
        FROM (
            SELECT st AS start, s.version AS step_version, st.run_id, st.deadline_at, st.invocation_id
            FROM ql3.step_runs AS s
            INNER JOIN ql3_ai.model_invocation_starts AS st ON st.invocation_id = s.current_invocation_id
            WHERE s.status = 'running'
              AND st.deadline_at < horizon
              AND ql3._may_act(st.project_id)  -- the session's projects only (D47)
              AND NOT EXISTS (
                  SELECT 1 FROM ql3_ai.model_invocation_completions AS c WHERE c.invocation_id = st.invocation_id
              )
            ORDER BY st.deadline_at, st.invocation_id COLLATE "C"  -- byte order, whatever the database's
            LIMIT p_limit
            FOR UPDATE OF s SKIP LOCKED
        ) AS b
        ORDER BY b.run_id, b.deadline_at, b.invocation_id COLLATE "C"
    LOOP
        start := expired.start;
        command := jsonb_build_object(
            'schema', 'ql3/model-invocation-completion-command@v1',
            'invocation_id', start.invocation_id,
            'start_digest', start.start_digest,
            'outcome', 'lost',
            'result_code', 'outcome_unknown',
            'output_bytes', NULL,
            'output_digest', NULL,
            'usage', NULL
        );
        -- Each settlement in a subtransaction of its own: one start that cannot be settled
        -- is reported (and logged) and skipped, and the rest of the batch is settled (D46).
        BEGIN
            result := ql3_ai._write_completion(
                start, expired.step_version, command,
                ql3_ai._checked_digest('completion command', 'ql3/model-invocation-completion-command@v1', command),
                true);
            recovered := recovered || jsonb_build_array(jsonb_build_object(
                'invocation_id', start.invocation_id,
                'run_id', start.run_id,
                'step_run_id', start.step_run_id,
                'deadline_at', ql3_ai._utc(start.deadline_at),
                'completion_digest', result ->> 'completion_digest'
            ));
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS failed_state = RETURNED_SQLSTATE, failed_message = MESSAGE_TEXT,
                                    failed_constraint = CONSTRAINT_NAME;
            IF failed_state = '23505' THEN  -- as complete_invocation reports it: Q3C01, never 23505
                failed_state := 'Q3C01';
                failed_message := ql3_ai._identity_taken(start.invocation_id, 'completion', failed_constraint);
            END IF;
            RAISE WARNING 'ql3 recovery skipped invocation %: % %', start.invocation_id, failed_state, failed_message;
            failed := failed || jsonb_build_array(jsonb_build_object(
                'invocation_id', start.invocation_id,
                'run_id', start.run_id,
                'step_run_id', start.step_run_id,
                'sqlstate', failed_state,
                'message', failed_message
            ));
        END;
    END LOOP;
    RETURN jsonb_build_object('count', jsonb_array_length(recovered), 'recovered', recovered,
                              'failed', failed);
END;
$$;

COMMENT ON FUNCTION ql3_ai.recover_expired(integer, interval) IS
'Settles up to p_limit starts past deadline_at + p_grace (database clock) as lost/outcome_unknown; never re-invokes.';

CREATE FUNCTION ql3_ai.usage_summary(p_project_id text, p_from timestamptz, p_to timestamptz)
RETURNS TABLE (
    provider text,
    model text,
    currency text,
    completions bigint,
    input_tokens bigint,
    output_tokens bigint,
    known_cost_micros bigint,
    known_cost_completions bigint,
    unknown_cost_completions bigint
)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    -- Checked inline: ql3_reader, which reads this summary, has no EXECUTE on ql3._check_identifier.
    IF p_project_id IS NULL OR p_project_id = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: project_id is required';
    END IF;
    IF char_length(p_project_id) > 128 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V03',
            MESSAGE = format('QL3_IDENTIFIER_TOO_LONG: project_id has %s characters (at most 128)',
                             char_length(p_project_id));
    END IF;
    IF p_from IS NOT NULL AND p_to IS NOT NULL AND p_from > p_to THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: from is after to';
    END IF;
    IF NOT ql3.may_act_on(p_project_id) THEN
        RAISE EXCEPTION USING
            ERRCODE = '42501',
            MESSAGE = format('QL3_PERMISSION_DENIED: %s may not act on project %L', session_user, p_project_id);
    END IF;
    RETURN QUERY
    SELECT u.provider, u.model, u.currency, count(*), sum(u.input_tokens)::bigint, sum(u.output_tokens)::bigint,
           sum(u.cost_micros)::bigint, count(u.cost_micros), count(*) - count(u.cost_micros)
    FROM ql3_ai.usage_ledger AS u
    WHERE u.project_id = p_project_id
      AND (p_from IS NULL OR u.recorded_at >= p_from)
      AND (p_to IS NULL OR u.recorded_at < p_to)
    GROUP BY u.provider, u.model, u.currency
    ORDER BY u.provider COLLATE "C", u.model COLLATE "C", u.currency COLLATE "C";
END;
$$;

COMMENT ON FUNCTION ql3_ai.usage_summary(text, timestamptz, timestamptz) IS
'Usage in [from, to) by provider, model and currency; unknown costs are counted apart, never summed as 0.';

-- Grants (SPEC section 5, D46): reads, and EXECUTE on the functions of each role's job.
-- The functions run as ql3_owner; no role but the owner writes a receipt or may call a
-- `_` helper. The runtime admits and completes but cannot resolve or recover, so it
-- cannot settle its own unknown outcomes.

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ql3_ai FROM PUBLIC;  -- noqa: CP02

GRANT SELECT ON ql3_ai.model_invocation_starts, ql3_ai.model_invocation_completions,
ql3_ai.model_invocation_resolutions, ql3_ai.usage_ledger TO ql3_runtime;
GRANT EXECUTE ON FUNCTION ql3_ai.admit_invocation(jsonb), ql3_ai.admit_in_new_run(jsonb),
ql3_ai.complete_invocation(jsonb), ql3_ai.usage_summary(text, timestamptz, timestamptz) TO ql3_runtime;

GRANT SELECT ON ql3_ai.model_invocation_starts, ql3_ai.model_invocation_completions,
ql3_ai.model_invocation_resolutions, ql3_ai.usage_ledger, ql3_ai.resolver_identities TO ql3_operator;
GRANT EXECUTE ON FUNCTION ql3_ai.resolve_invocation(jsonb), ql3_ai.recover_expired(integer, interval),
ql3_ai.usage_summary(text, timestamptz, timestamptz) TO ql3_operator;

GRANT SELECT ON ql3_ai.model_invocation_starts, ql3_ai.model_invocation_completions,
ql3_ai.model_invocation_resolutions, ql3_ai.usage_ledger TO ql3_reader;
GRANT EXECUTE ON FUNCTION ql3_ai.usage_summary(text, timestamptz, timestamptz) TO ql3_reader;

-- Row-level security (D47, see core 0002): the rows of the projects the session may act on.
ALTER TABLE ql3_ai.model_invocation_starts ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3_ai.model_invocation_completions ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3_ai.model_invocation_resolutions ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3_ai.usage_ledger ENABLE ROW LEVEL SECURITY;

CREATE POLICY project_rows ON ql3_ai.model_invocation_starts FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR project_id = any((SELECT ql3.visible_projects())::text []));
CREATE POLICY project_rows ON ql3_ai.model_invocation_completions FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR project_id = any((SELECT ql3.visible_projects())::text []));
CREATE POLICY project_rows ON ql3_ai.model_invocation_resolutions FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR EXISTS (
    SELECT 1 FROM ql3.runs AS r WHERE r.run_id = model_invocation_resolutions.run_id));
CREATE POLICY project_rows ON ql3_ai.usage_ledger FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR project_id = any((SELECT ql3.visible_projects())::text []));
