-- requires: core 0004
-- The receipt functions read the clock through ql3._now() (core 0004), so that a test can
-- pin it and compare record digests with the SQLite shim; in production ql3._now() is
-- now(), so nothing changes but the name of the clock.
--
-- Each function below is its ql3_ai 0001 definition with every now() replaced by
-- ql3._now() and nothing else changed (tests/py/test_conformance.py holds the two files to
-- exactly that). CREATE OR REPLACE keeps each function's owner, grants and comment.

CREATE OR REPLACE FUNCTION ql3_ai.admit_invocation(command jsonb) RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
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
<<admit_invocation>>
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
BEGIN
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
        command_digest := encode(sha256(
            convert_to('ql3/model-invocation-admission@v1', 'UTF8') || decode('00', 'hex')
            || convert_to(canonical, 'UTF8')), 'hex');
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

    -- The step lock comes first: it orders this admission against every other
    -- transition of the step, including a concurrent admission of the same command.
    SELECT * INTO step FROM ql3.step_runs AS s WHERE s.step_run_id = admit_invocation.step_run_id FOR UPDATE;
    IF NOT found OR step.run_id <> admit_invocation.run_id THEN
        IF NOT EXISTS (SELECT 1 FROM ql3.runs AS r WHERE r.run_id = admit_invocation.run_id) THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3N01', MESSAGE = format('QL3_NOT_FOUND: run %s does not exist', run_id);
        END IF;
        RAISE EXCEPTION USING
            ERRCODE = 'Q3N01',
            MESSAGE = format('QL3_NOT_FOUND: step run %s does not exist in run %s', step_run_id, run_id);
    END IF;

    SELECT * INTO prior FROM ql3_ai.model_invocation_starts AS st WHERE st.invocation_id = admit_invocation.invocation_id;
    IF found THEN
        IF prior.command_digest = admit_invocation.command_digest THEN
            PERFORM ql3_ai._verify_receipt('start record', 'ql3/model-invocation-start@v1',
                                           prior.record, prior.start_digest);
            RETURN jsonb_build_object('status', 'existing', 'start', prior.record,
                                      'start_digest', prior.start_digest);
        END IF;
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: invocation %s was admitted with another command (digest %s)',
                             invocation_id, prior.command_digest);
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

    -- The policy fence: read in this transaction, after the step lock. An admission that
    -- races an activation is ordered before it; one that starts after it sees it.
    IF policy_revision IS NOT NULL THEN
        SELECT true, a.active_revision_id INTO family_known, active_revision
        FROM ql3.contract_families AS f
        LEFT JOIN ql3.active_revisions AS a
            ON a.project_id = command ->> 'project_id' AND a.contract_family = f.contract_family
               AND a.contract_id = policy_contract
        WHERE f.contract_family = policy_family;
        IF family_known IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01',
                MESSAGE = format('QL3_INVALID_ARGUMENT: unknown contract family %L', policy_family);
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

    UPDATE ql3.runs AS r
    SET version = r.version + 1, event_seq = r.event_seq + 1, updated_at = ql3._now()
    WHERE r.run_id = admit_invocation.run_id
    RETURNING * INTO run;
    IF (run.project_id, run.trace_id) IS DISTINCT FROM (command ->> 'project_id', command ->> 'trace_id') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: run %s belongs to project %L and trace %L, not %L and %L',
                             run_id, run.project_id, run.trace_id,
                             command ->> 'project_id', command ->> 'trace_id');
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
        start_digest := encode(sha256(
            convert_to('ql3/model-invocation-start@v1', 'UTF8') || decode('00', 'hex')
            || convert_to(canonical, 'UTF8')), 'hex');
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
    UPDATE ql3.step_runs AS s
    SET status = 'running', version = s.version + 1, attempt_count = s.attempt_count + 1,
        current_invocation_id = admit_invocation.invocation_id, updated_at = ql3._now()
    WHERE s.step_run_id = admit_invocation.step_run_id;
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

CREATE OR REPLACE FUNCTION ql3_ai._write_completion(
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
        completion_digest := encode(sha256(
            convert_to('ql3/model-invocation-completion@v1', 'UTF8') || decode('00', 'hex')
            || convert_to(canonical, 'UTF8')), 'hex');
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

CREATE OR REPLACE FUNCTION ql3_ai.resolve_invocation(command jsonb) RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
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
BEGIN
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

    SELECT * INTO start FROM ql3_ai.model_invocation_starts AS st
    WHERE st.invocation_id = resolve_invocation.invocation_id;
    IF NOT found THEN
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
        invocation_id, completion_digest, run_id, step_run_id, decision, user_id, reason, command_digest,
        record, resolution_digest, mutation_id, event_id, dedupe_key, resolved_at
    ) VALUES (
        invocation_id, completion.completion_digest, start.run_id, start.step_run_id, decision,
        command ->> 'user_id', command ->> 'reason', command_digest, receipt, resolution_digest,
        mutation_id, event_id, dedupe_key, ql3._now()
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
END;
$$;

CREATE OR REPLACE FUNCTION ql3_ai.recover_expired(p_limit integer, p_grace interval) RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
DECLARE
    expired record;
    start ql3_ai.model_invocation_starts;
    command jsonb;
    result jsonb;
    recovered jsonb := '[]'::jsonb;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: limit must be 1..10000';
    END IF;
    IF p_grace IS NULL OR p_grace < interval '0' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: grace must be a non-negative interval';
    END IF;
    -- An unfinished start is exactly the current invocation of a running step, so the
    -- scan walks running steps (few) rather than the start history (unbounded). Steps
    -- another transaction holds are skipped: their owner is completing them right now.
    FOR expired IN
        SELECT s.step_run_id, s.version, s.current_invocation_id
        FROM ql3.step_runs AS s
        INNER JOIN ql3_ai.model_invocation_starts AS st ON st.invocation_id = s.current_invocation_id
        WHERE s.status = 'running'
          AND st.deadline_at + p_grace < ql3._now()
          AND NOT EXISTS (
              SELECT 1 FROM ql3_ai.model_invocation_completions AS c WHERE c.invocation_id = st.invocation_id
          )
        ORDER BY st.deadline_at, st.invocation_id
        LIMIT p_limit
        FOR UPDATE OF s SKIP LOCKED
    LOOP
        SELECT * INTO start FROM ql3_ai.model_invocation_starts AS st
        WHERE st.invocation_id = expired.current_invocation_id;
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
        result := ql3_ai._write_completion(
            start, expired.version, command,
            ql3_ai._checked_digest('completion command', 'ql3/model-invocation-completion-command@v1', command),
            true);
        recovered := recovered || jsonb_build_array(jsonb_build_object(
            'invocation_id', start.invocation_id,
            'run_id', start.run_id,
            'step_run_id', start.step_run_id,
            'deadline_at', ql3_ai._utc(start.deadline_at),
            'completion_digest', result ->> 'completion_digest'
        ));
    END LOOP;
    RETURN jsonb_build_object('count', jsonb_array_length(recovered), 'recovered', recovered);
END;
$$;
