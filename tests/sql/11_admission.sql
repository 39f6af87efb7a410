-- Admission (sql/ql3_ai/0001_invocations.sql): ready -> running, the Start receipt, replay,
-- conflicts, the v1 command schema and the policy fence.
BEGIN;
\ir lib/invocation_helpers.sql

SELECT plan(111);

-- Fixture: run R1 (proj/trace-1) with model steps S1..S5 and a tool step; run R2 (proj/trace-2)
-- with one step; run R3 for the identity vectors.
SELECT ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001');
SELECT ql3.create_run('proj', 'trace-2', 'aaaaaaaa-0000-0000-0000-000000000002');
SELECT ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000003');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'model', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid)
FROM generate_series(1, 5) AS g;
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'tool', 'bbbbbbbb-0000-0000-0000-0000000000ff');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000002', 'model', 'bbbbbbbb-0000-0000-0000-000000000021');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000002', 'model', 'bbbbbbbb-0000-0000-0000-000000000022');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000003', 'model', 'bbbbbbbb-0000-0000-0000-000000000031');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000003', 'model', 'bbbbbbbb-0000-0000-0000-000000000032');

CREATE TEMP TABLE cmd AS
SELECT tests.admission(
    'inv-a1', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 1
) AS c;
GRANT SELECT ON cmd TO PUBLIC;  -- noqa: CP02

-- Admission runs as the runtime role: its grants are what the gateway has.
SET ROLE ql3_runtime;

CREATE TEMP TABLE a1 AS SELECT ql3_ai.admit_invocation(c) AS r FROM cmd;

SELECT is((SELECT r ->> 'status' FROM a1), 'created', 'admitting a ready step at its version is created');
SELECT is(
    (SELECT r -> 'start' ->> 'schema' FROM a1), 'ql3/model-invocation-start@v1', 'the start record names its schema'
);
SELECT is(
    (SELECT r ->> 'start_digest' FROM a1),
    (SELECT ql3.digest('ql3/model-invocation-start@v1', r -> 'start') FROM a1),
    'start_digest is the digest of the start record under ql3/model-invocation-start@v1'
);
SELECT is(
    (SELECT r -> 'start' ->> 'command_digest' FROM a1),
    (SELECT ql3.digest('ql3/model-invocation-admission@v1', c) FROM cmd),
    'command_digest is the digest of the command under ql3/model-invocation-admission@v1'
);
SELECT is(
    (SELECT array_agg(k.key ORDER BY k.key) FROM a1, jsonb_object_keys(a1.r -> 'start') AS k (key)),
    ARRAY[
        'admitted_at', 'attempt', 'command_digest', 'deadline_at', 'dedupe_key', 'event_id', 'input_bytes',
        'invocation_id', 'model', 'mutation_id', 'policy', 'project_id', 'provider', 'request_digest', 'request_id',
        'run_event_seq', 'run_id', 'run_version', 'schema', 'step_run_id', 'step_run_version', 'trace_id'
    ],
    'the start record has exactly the v1 fields'
);
SELECT results_eq(
    $$SELECT (r -> 'start' ->> 'attempt')::integer, (r -> 'start' ->> 'step_run_version')::bigint,
             (r -> 'start' ->> 'run_version')::bigint, (r -> 'start' ->> 'run_event_seq')::bigint,
             r -> 'start' -> 'policy'
      FROM a1$$,
    $$VALUES (1, 2::bigint, 2::bigint, 1::bigint, 'null'::jsonb)$$,
    'the start binds attempt 1, step version 2, run version 2, run event 1 and no policy'
);
SELECT ok(
    (SELECT r -> 'start' ->> 'admitted_at' ~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z$'
     FROM a1),
    'admitted_at is RFC 3339 UTC with six fractional digits'
);
SELECT results_eq(
    $$SELECT status, version, attempt_count, current_invocation_id::text, output_ref, result_code::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    $$VALUES ('running', 2::bigint, 1, 'inv-a1', NULL::text, NULL::text)$$,
    'admission moves the step ready -> running, version 2, attempt_count 1'
);
SELECT results_eq(
    $$SELECT version, event_seq FROM ql3.runs WHERE run_id = 'aaaaaaaa-0000-0000-0000-000000000001'$$,
    $$VALUES (2::bigint, 1::bigint)$$,
    'admission bumps the run version and its event seq'
);
SELECT results_eq(
    $$SELECT seq, event_id, event_type, step_run_id, payload ->> 'invocation_id', payload ->> 'start_digest'
      FROM ql3.run_events WHERE run_id = 'aaaaaaaa-0000-0000-0000-000000000001'$$,
    $$SELECT 1::bigint, ql3.event_id('inv-a1', 'admission'), 'model_invocation_admitted',
             'bbbbbbbb-0000-0000-0000-000000000001'::uuid, 'inv-a1', r ->> 'start_digest' FROM a1$$,
    'admission appends run event 1 with event_id = ql3.event_id(invocation_id, admission)'
);
SELECT results_eq(
    $$SELECT mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version, command_digest
      FROM ql3.step_run_mutations$$,
    $$SELECT ql3.mutation_id('inv-a1', 'admission'), ql3.dedupe_key('inv-a1', 'admission'),
             'bbbbbbbb-0000-0000-0000-000000000001'::uuid, 'ready', 'running', 1::bigint, 2::bigint,
             r -> 'start' ->> 'command_digest' FROM a1$$,
    'admission appends one step mutation with the derived mutation_id and dedupe_key'
);
SELECT results_eq(
    $$SELECT s.invocation_id::text, s.request_id::text, s.project_id::text, s.run_id::text, s.step_run_id::text, s.trace_id::text,
             s.attempt, s.provider::text, s.model::text, s.request_digest, s.input_bytes, s.command_digest, s.start_digest,
             s.mutation_id, s.event_id, s.dedupe_key, s.record::jsonb, s.deadline_at
      FROM ql3_ai.model_invocation_starts AS s$$,
    $$SELECT r -> 'start' ->> 'invocation_id', r -> 'start' ->> 'request_id', r -> 'start' ->> 'project_id',
             r -> 'start' ->> 'run_id', r -> 'start' ->> 'step_run_id', r -> 'start' ->> 'trace_id',
             (r -> 'start' ->> 'attempt')::integer, r -> 'start' ->> 'provider', r -> 'start' ->> 'model',
             r -> 'start' ->> 'request_digest', (r -> 'start' ->> 'input_bytes')::bigint,
             r -> 'start' ->> 'command_digest', r ->> 'start_digest', r -> 'start' ->> 'mutation_id',
             r -> 'start' ->> 'event_id', r -> 'start' ->> 'dedupe_key', r -> 'start',
             '2999-01-01 00:00:00+00'::timestamptz
      FROM a1$$,
    'the stored start row agrees with the returned record'
);

-- Replay: the same invocation_id and command is "existing" and writes nothing.

CREATE TEMP TABLE fp AS SELECT tests.footprint() AS v;
CREATE TEMP TABLE a1_again AS SELECT ql3_ai.admit_invocation(c) AS r FROM cmd;
SELECT is((SELECT r ->> 'status' FROM a1_again), 'existing', 'an exact replay is existing');
SELECT is(
    (SELECT r FROM a1_again), (SELECT jsonb_set(r, '{status}', '"existing"') FROM a1),
    'an exact replay returns the stored start and start_digest'
);
SELECT is(tests.footprint(), (SELECT v FROM fp), 'an exact replay writes nothing');

-- Conflicts and illegal admissions, each refused with nothing written.

SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{model}', '"other-model"')) FROM cmd$$,
    'Q3C01', 'the same invocation_id with other content is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a1', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000002', 1))$$,
    'Q3C01', 'the same invocation_id on another step is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a2', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000001', 2))$$,
    'Q3C01', 'admitting a running step (at its current version) is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a3', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000002', 2))$$,
    'Q3C01', 'a version drift is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a4', 'aaaaaaaa-0000-0000-0000-00000000dead', 'bbbbbbbb-0000-0000-0000-000000000002', 1))$$,
    'Q3N01', 'an unknown run is QL3_NOT_FOUND'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a4', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-00000000dead', 1))$$,
    'Q3N01', 'an unknown step is QL3_NOT_FOUND'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a4', 'aaaaaaaa-0000-0000-0000-000000000002', 'bbbbbbbb-0000-0000-0000-000000000002', 1,
        p_trace_id => 'trace-2'))$$,
    'Q3N01', 'a step of another run is QL3_NOT_FOUND'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a4', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000002', 1,
        p_project_id => 'other'))$$,
    'Q3C01', 'a project_id other than the run''s is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a4', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000002', 1,
        p_trace_id => 'trace-x'))$$,
    'Q3C01', 'a trace_id other than the run''s is QL3_CONFLICT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-a4', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-0000000000ff', 1))$$,
    'Q3V01', 'admitting a step that is not of kind model is QL3_INVALID_ARGUMENT'
);

-- The v1 command schema. Each bad command names a fresh invocation on ready step S2.

CREATE TEMP TABLE ok2 AS
SELECT tests.admission(
    'inv-v', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000002', 1
) AS c;

SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(NULL)$$, 'Q3V01', 'a NULL command is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation('[]')$$, 'Q3V01', 'a command that is not an object is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{schema}', '"ql3/model-invocation-admission@v2"')) FROM ok2$$,
    'Q3V01', 'an unknown schema name is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(c - 'deadline_at') FROM ok2$$,
    'Q3V01', 'a missing field is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(c - 'policy') FROM ok2$$,
    'Q3V01', 'a missing nullable field (policy) is QL3_INVALID_ARGUMENT: null must be explicit'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(c || '{"prompt": "hello"}') FROM ok2$$,
    'Q3V01', 'an unknown field is QL3_INVALID_ARGUMENT (and a prompt body is never stored)'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{input_bytes}', '"512"')) FROM ok2$$,
    'Q3V01', 'a string where an integer belongs is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{input_bytes}', '-1')) FROM ok2$$,
    'Q3V01', 'a negative input_bytes is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{input_bytes}', '1.5')) FROM ok2$$,
    'Q3V01', 'a fractional input_bytes is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{input_bytes}', '9007199254740992')) FROM ok2$$,
    'Q3V01', 'a number beyond 2^53-1 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{expected_step_run_version}', '0')) FROM ok2$$,
    'Q3V01', 'expected_step_run_version 0 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{invocation_id}', '""')) FROM ok2$$,
    'Q3V01', 'an empty invocation_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{invocation_id}', to_jsonb(repeat('i', 129)))) FROM ok2$$,
    'Q3V03', 'a 129-character invocation_id is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{request_id}', to_jsonb(repeat('r', 129)))) FROM ok2$$,
    'Q3V03', 'a 129-character request_id is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{model}', to_jsonb(repeat('m', 129)))) FROM ok2$$,
    'Q3V03', 'a 129-character model is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{model}', to_jsonb(repeat('m', 30000)))) FROM ok2$$,
    'Q3V02', 'a command over 24 KiB of canonical JSON is QL3_RECORD_TOO_LARGE'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{run_id}', to_jsonb(upper(c ->> 'run_id')))) FROM ok2$$,
    'Q3V01', 'an uppercase run_id is QL3_INVALID_ARGUMENT (one spelling per uuid)'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{step_run_id}', '"step-2"')) FROM ok2$$,
    'Q3V01', 'a step_run_id that is not a uuid is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{request_digest}', to_jsonb(upper(c ->> 'request_digest'))))
      FROM ok2$$,
    'Q3V01', 'a request_digest that is not lowercase hex SHA-256 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{deadline_at}', '"2030-01-01T00:00:00Z"')) FROM ok2$$,
    'Q3V01', 'a deadline without six fractional digits is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{deadline_at}', '"2030-01-01T00:00:00.000000+01:00"')) FROM ok2$$,
    'Q3V01', 'a deadline that is not UTC is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{deadline_at}', '"2030-02-30T00:00:00.000000Z"')) FROM ok2$$,
    'Q3V01', 'a deadline on a day that does not exist is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{policy}', '{"contract_family": "policy_routing"}')) FROM ok2$$,
    'Q3V01', 'a policy without contract_id and revision_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{policy}', '"router"')) FROM ok2$$,
    'Q3V01', 'a policy that is not an object is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{policy}',
        '{"contract_family": "no_such_family", "contract_id": "router",
          "revision_id": "00000000-0000-0000-0000-000000000000"}')) FROM ok2$$,
    'Q3V01', 'a policy of an unknown contract family is QL3_INVALID_ARGUMENT'
);
SELECT is(
    (SELECT status FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000002'), 'ready',
    'after every refused command the step is still ready'
);

-- The policy fence: admission binds the policy revision the caller holds, and only the
-- active one passes, in the admission's own transaction.

RESET ROLE;
CREATE TEMP TABLE revs AS
SELECT
    (ql3.put_revision('proj', 'policy_routing', 'router', '{"route": "a"}', 'ops')).revision_id AS a,
    (ql3.put_revision('proj', 'policy_routing', 'router', '{"route": "b"}', 'ops')).revision_id AS b,
    (ql3.put_revision('proj', 'policy_routing', 'idle', '{"route": "c"}', 'ops')).revision_id AS c;
GRANT SELECT ON revs TO PUBLIC;  -- noqa: CP02
SELECT ql3.activate_revision('proj', 'policy_routing', 'router', a, 'ops') FROM revs;
SET ROLE ql3_runtime;

CREATE TEMP TABLE pa AS
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-p1', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000003', 1,
    jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router', 'revision_id', a)
)) AS r
FROM revs;
SELECT is((SELECT r ->> 'status' FROM pa), 'created', 'admission under the active policy revision is created');
SELECT results_eq(
    $$SELECT policy_contract_family, policy_contract_id, policy_revision_id, record -> 'policy'
      FROM ql3_ai.model_invocation_starts WHERE invocation_id = 'inv-p1'$$,
    $$SELECT 'policy_routing', 'router', a,
             jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router', 'revision_id', a)
      FROM revs$$,
    'the start binds the policy family, contract and revision'
);

RESET ROLE;
SELECT ql3.activate_revision('proj', 'policy_routing', 'router', b, 'ops') FROM revs;
SET ROLE ql3_runtime;

SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-p2', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000004', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router', 'revision_id', a)))
      FROM revs$$,
    'Q3C02', 'admission under a revision that is no longer active is QL3_STALE_REVISION'
);
SELECT is(
    tests.error_of($$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-p2', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000004', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router', 'revision_id', a)))
      FROM revs$$),
    (SELECT 'Q3C02 ' || b FROM revs),
    'the QL3_STALE_REVISION DETAIL names the active revision'
);
SELECT is(
    (SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-p2', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000004', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router', 'revision_id', b))) ->> 'status'
     FROM revs),
    'created',
    'after reloading the policy, admission under the new active revision is created'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-p3', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000005', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'idle', 'revision_id', c)))
      FROM revs$$,
    'Q3C02', 'admission under a revision of a contract with no active revision is QL3_STALE_REVISION'
);
SELECT is(
    tests.error_of($$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-p3', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000005', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'idle', 'revision_id', c)))
      FROM revs$$),
    'Q3C02 ',
    'with no active revision the DETAIL is empty'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        'inv-p3', 'aaaaaaaa-0000-0000-0000-000000000001', 'bbbbbbbb-0000-0000-0000-000000000005', 1,
        jsonb_build_object('contract_family', 'policy_routing', 'contract_id', 'router', 'revision_id', c)))
      FROM revs$$,
    'Q3C02', 'a revision of another contract is never the active one of this contract'
);

-- Stored identities equal the shared vectors (tests/vectors/identity.json), including
-- the longest invocation_id allowed.

SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        '7b0c6f7e-2d7e-4a53-9a55-0c8f3c1c2a11', 'aaaaaaaa-0000-0000-0000-000000000003',
        'bbbbbbbb-0000-0000-0000-000000000031', 1)) ->> 'status',
    'created', 'admission with the first vector invocation_id is created'
);
SELECT results_eq(
    $$SELECT s.mutation_id, s.event_id, s.dedupe_key, m.dedupe_key, e.event_id
      FROM ql3_ai.model_invocation_starts AS s
      INNER JOIN ql3.step_run_mutations AS m ON m.mutation_id = s.mutation_id
      INNER JOIN ql3.run_events AS e ON e.event_id = s.event_id
      WHERE s.invocation_id = '7b0c6f7e-2d7e-4a53-9a55-0c8f3c1c2a11'$$,
    $$VALUES ('mut_e821613c7e2667649242aed4e9289edd8e2bd70c4844f1d2567a2290dcf011a7',
              'evt_834c22e2fd2adb270f8c8271902bf696a70d67578c1d4c6aa4b69ffab6bf8949',
              'ddp_8f2687bacd9d9438ce2142ae6cbdcbf6210a76c24eb327fcb4709519a0c8534a',
              'ddp_8f2687bacd9d9438ce2142ae6cbdcbf6210a76c24eb327fcb4709519a0c8534a',
              'evt_834c22e2fd2adb270f8c8271902bf696a70d67578c1d4c6aa4b69ffab6bf8949')$$,
    'admission identities of the first vector match identity.json'
);
SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        repeat('r', 128), 'aaaaaaaa-0000-0000-0000-000000000003', 'bbbbbbbb-0000-0000-0000-000000000032', 1)) ->> 'status',
    'created', 'a 128-character invocation_id is admitted'
);
SELECT results_eq(
    $$SELECT mutation_id, event_id, dedupe_key FROM ql3_ai.model_invocation_starts
      WHERE invocation_id = repeat('r', 128)$$,
    $$VALUES ('mut_c3739c94bf04570e0b5843e9ddf73e5058e1db9a977c21850e104cac8bae4680',
              'evt_62f69d6e412a7020c5d57d7e45e7ea94348a022395cf3760b46aec07a6ebf320',
              'ddp_e89eb902f86a952d7bdda7c5db3cff5685149b09b30f2994efc13afed4e82dfd')$$,
    'admission identities of the 128-character vector match identity.json'
);
-- The `_` helpers are the owner's alone (D46): checked outside the runtime's role.
RESET ROLE;
SELECT is(
    ql3_ai._identities('inv-1', 'completion'),
    ARRAY[ql3.mutation_id('inv-1', 'completion'), ql3.event_id('inv-1', 'completion'),
          ql3.dedupe_key('inv-1', 'completion')],
    'ql3_ai._identities agrees with ql3.mutation_id, ql3.event_id and ql3.dedupe_key'
);
SELECT is(
    (SELECT ql3_ai._checked_digest('test', 'ql3/model-invocation-admission@v1', c) FROM cmd),
    (SELECT ql3.digest('ql3/model-invocation-admission@v1', c) FROM cmd),
    'ql3_ai._checked_digest agrees with ql3.digest'
);
SET ROLE ql3_runtime;

-- Integers written with a fraction (512.0) are refused with our own code (as on SQLite,
-- D15), not PostgreSQL's 22P02 from a later cast.
CREATE TEMP TABLE whole AS
SELECT tests.admission(
    'inv-whole', 'aaaaaaaa-0000-0000-0000-000000000002', 'bbbbbbbb-0000-0000-0000-000000000022', 1,
    p_trace_id => 'trace-2'
) AS c;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{input_bytes}', '512.0')) FROM whole$$,
    'Q3V01', 'an input_bytes written 512.0 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(jsonb_set(c, '{expected_step_run_version}', '1.0')) FROM whole$$,
    'Q3V01', 'an expected_step_run_version written 1.0 is QL3_INVALID_ARGUMENT'
);

-- An exact replay re-verifies the stored start against its digest: a start that a damaged
-- database changed is QL3_CONFLICT, never "existing". Tampering needs the superuser and
-- session_replication_role = replica (which skips the immutability triggers).

RESET ROLE;
SET LOCAL session_replication_role = replica;
UPDATE ql3_ai.model_invocation_starts SET record = jsonb_set(record, '{model}', '"other-model"')
WHERE invocation_id = 'inv-a1';
UPDATE ql3_ai.model_invocation_starts SET start_digest = repeat('0', 64)
WHERE invocation_id = repeat('r', 128);
SET LOCAL session_replication_role = origin;
SET ROLE ql3_runtime;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(c) FROM cmd$$,
    'Q3C01', 'a replay whose stored start record was changed is QL3_CONFLICT',
    (SELECT 'QL3_CONFLICT: stored start record no longer matches its digest ' || start_digest
     FROM ql3_ai.model_invocation_starts WHERE invocation_id = 'inv-a1')
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
        repeat('r', 128), 'aaaaaaaa-0000-0000-0000-000000000003', 'bbbbbbbb-0000-0000-0000-000000000032', 1))$$,
    'Q3C01', 'a replay whose stored start_digest was changed is QL3_CONFLICT',
    'QL3_CONFLICT: stored start record no longer matches its digest ' || repeat('0', 64)
);

RESET ROLE;
SELECT * FROM finish();
ROLLBACK;
