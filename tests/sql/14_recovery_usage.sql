-- Recovery by the database clock and the usage summary (sql/ql3_ai/0001_invocations.sql).
BEGIN;
\ir lib/invocation_helpers.sql

SELECT plan(40);

-- Fixture: run R1 with model steps S1..S7 admitted as inv-e1..inv-e7. Deadlines, by the
-- database clock now(): e1 2000, e5 2001, e6 2002, e7 2003 (long expired); e4 an hour ago;
-- e2 far in the future; e3 long expired but completed. Run R0 holds inv-o1 and inv-o2,
-- expired in 1990, before any other, for the read count below.
SELECT ql3.create_run('proj', 'trace-1', 'aaaaaaaa-0000-0000-0000-000000000001');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000001', 'model', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid)
FROM generate_series(1, 7) AS g;
SELECT ql3.create_run('proj', 'trace-0', 'aaaaaaaa-0000-0000-0000-000000000000');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000000', 'model', ('dddddddd-0000-0000-0000-00000000000' || g)::uuid)
FROM generate_series(1, 2) AS g;

-- Scans of model_invocation_starts in this transaction, by any plan: sequential scans of
-- the table plus scans of each of its indexes.
CREATE FUNCTION tests.start_scans() RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT pg_stat_get_xact_numscans('ql3_ai.model_invocation_starts'::regclass)
        + (SELECT sum(pg_stat_get_xact_numscans(i.indexrelid))::bigint FROM pg_index AS i
           WHERE i.indrelid = 'ql3_ai.model_invocation_starts'::regclass);
$$;

SET ROLE ql3_runtime;
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-e' || g, 'aaaaaaaa-0000-0000-0000-000000000001', ('bbbbbbbb-0000-0000-0000-00000000000' || g)::uuid, 1,
    p_deadline_at => CASE g
        WHEN 1 THEN '2000-01-01T00:00:00.000000Z'
        WHEN 2 THEN '2999-01-01T00:00:00.000000Z'
        WHEN 3 THEN '2000-06-01T00:00:00.000000Z'
        WHEN 4 THEN to_char((now() - interval '1 hour') AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
        ELSE (2000 + g - 4)::text || '-01-01T00:00:00.000000Z'
    END
))
FROM generate_series(1, 7) AS g;
SELECT ql3_ai.complete_invocation(tests.completion('inv-e3', 'succeeded', 'ok'));
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-o' || g, 'aaaaaaaa-0000-0000-0000-000000000000', ('dddddddd-0000-0000-0000-00000000000' || g)::uuid, 1,
    p_deadline_at => '1990-01-01T00:00:00.000000Z', p_trace_id => 'trace-0'
))
FROM generate_series(1, 2) AS g;

-- Recovery is an operator's act, bounded by its limit, oldest deadline first.
SET ROLE ql3_operator;

-- Recovery reads each start once, in the scan that also locks its step: the only other
-- scan of the starts per recovered start is the foreign-key check of its completion. A
-- scan over the same running steps that recovers nothing is the baseline (the first two
-- scans of this session, so both are planned alike: the grace leaves the estimates as
-- they are).
CREATE TEMP TABLE scans AS
SELECT
    0 AS k,
    tests.start_scans() AS n;
SELECT is(
    ql3_ai.recover_expired(2, interval '36500 days'), '{"count": 0, "recovered": [], "failed": []}'::jsonb,
    'a scan whose grace covers every deadline recovers nothing'
);
INSERT INTO scans (k, n)
SELECT
    1 AS k,
    tests.start_scans() AS n;
SELECT is(
    (SELECT jsonb_agg(x ->> 'invocation_id') FROM jsonb_array_elements(ql3_ai.recover_expired(2, interval '0') -> 'recovered') AS x),
    '["inv-o1", "inv-o2"]'::jsonb,
    'the same scan without grace recovers the two oldest starts'
);
INSERT INTO scans (k, n)
SELECT
    2 AS k,
    tests.start_scans() AS n;
SELECT is(
    (SELECT (max(n) FILTER (WHERE k = 2) - max(n) FILTER (WHERE k = 1))
            - (max(n) FILTER (WHERE k = 1) - max(n) FILTER (WHERE k = 0)) FROM scans),
    2::bigint,
    'recovery scans the starts once per recovered start beyond its own scan (the completion''s foreign-key check)'
);

CREATE TEMP TABLE rec1 AS SELECT ql3_ai.recover_expired(1, interval '0') AS r;
GRANT SELECT ON rec1 TO PUBLIC;  -- noqa: CP02
SELECT is(
    (SELECT r FROM rec1),
    jsonb_build_object('count', 1, 'recovered', jsonb_build_array(jsonb_build_object(
        'invocation_id', 'inv-e1',
        'run_id', 'aaaaaaaa-0000-0000-0000-000000000001',
        'step_run_id', 'bbbbbbbb-0000-0000-0000-000000000001',
        'deadline_at', '2000-01-01T00:00:00.000000Z',
        'completion_digest', (SELECT completion_digest FROM ql3_ai.model_invocation_completions
                              WHERE invocation_id = 'inv-e1')
    )), 'failed', '[]'::jsonb),
    'recover_expired(1, 0) settles the start with the oldest expired deadline and reports it'
);
SELECT results_eq(
    $$SELECT outcome, result_code::text, recovered, (record ->> 'recovered')::boolean, record -> 'usage', output_bytes,
             command_digest, completion_digest
      FROM ql3_ai.model_invocation_completions WHERE invocation_id = 'inv-e1'$$,
    $$SELECT 'lost', 'outcome_unknown', TRUE, TRUE, 'null'::jsonb, NULL::bigint,
             ql3.digest('ql3/model-invocation-completion-command@v1', jsonb_build_object(
                 'schema', 'ql3/model-invocation-completion-command@v1', 'invocation_id', 'inv-e1',
                 'start_digest', s.start_digest, 'outcome', 'lost', 'result_code', 'outcome_unknown',
                 'output_bytes', NULL, 'output_digest', NULL, 'usage', NULL)),
             ql3.digest('ql3/model-invocation-completion@v1', c.record)
      FROM ql3_ai.model_invocation_starts AS s, ql3_ai.model_invocation_completions AS c
      WHERE s.invocation_id = 'inv-e1' AND c.invocation_id = 'inv-e1'$$,
    'the recovered completion is lost/outcome_unknown, recovered, and digests the lost command it stands for'
);
SELECT results_eq(
    $$SELECT status, version, result_code::text, current_invocation_id::text
      FROM ql3.step_runs WHERE step_run_id = 'bbbbbbbb-0000-0000-0000-000000000001'$$,
    $$VALUES ('lost', 3::bigint, 'outcome_unknown', 'inv-e1')$$,
    'the recovered step is lost/outcome_unknown'
);
SELECT results_eq(
    $$SELECT e.seq, e.event_type, (e.payload ->> 'recovered')::boolean, m.from_status, m.to_status, m.dedupe_key
      FROM ql3.run_events AS e, ql3.step_run_mutations AS m
      WHERE e.event_id = ql3.event_id('inv-e1', 'completion') AND m.mutation_id = ql3.mutation_id('inv-e1', 'completion')$$,
    $$VALUES (9::bigint, 'model_invocation_completed', TRUE, 'running', 'lost', ql3.dedupe_key('inv-e1', 'completion'))$$,
    'recovery appends the next run event and one step mutation, like any completion'
);
SELECT is(
    (SELECT count(*) FROM ql3_ai.usage_ledger WHERE invocation_id = 'inv-e1')::integer, 0,
    'a recovered completion reports no usage and gets no ledger row'
);

SELECT is(
    (SELECT jsonb_agg(x ->> 'invocation_id') FROM jsonb_array_elements(ql3_ai.recover_expired(2, interval '2 hours') -> 'recovered') AS x),
    '["inv-e5", "inv-e6"]'::jsonb,
    'the limit bounds the scan: two of the three remaining expired starts, oldest first'
);
SELECT is(
    ql3_ai.recover_expired(10, interval '2 hours') -> 'recovered' -> 0 ->> 'invocation_id', 'inv-e7',
    'the next scan settles the last start expired beyond the grace'
);
CREATE TEMP TABLE fp AS SELECT tests.footprint() AS v;
SELECT is(
    ql3_ai.recover_expired(10, interval '2 hours'), '{"count": 0, "recovered": [], "failed": []}'::jsonb,
    'a start within deadline + grace is left alone'
);
SELECT is(tests.footprint(), (SELECT v FROM fp), 'a scan that finds nothing writes nothing');
SELECT is(
    ql3_ai.recover_expired(10, interval '30 minutes') -> 'recovered' -> 0 ->> 'invocation_id', 'inv-e4',
    'the same start is settled once deadline + grace has passed by the database clock'
);
SELECT is(
    ql3_ai.recover_expired(10, interval '0'), '{"count": 0, "recovered": [], "failed": []}'::jsonb,
    'starts before their deadline and completed starts are never recovered'
);
SELECT results_eq(
    $$SELECT step_run_id::text, status FROM ql3.step_runs
      WHERE run_id = 'aaaaaaaa-0000-0000-0000-000000000001' ORDER BY step_run_id$$,
    $$VALUES ('bbbbbbbb-0000-0000-0000-000000000001', 'lost'), ('bbbbbbbb-0000-0000-0000-000000000002', 'running'),
             ('bbbbbbbb-0000-0000-0000-000000000003', 'succeeded'), ('bbbbbbbb-0000-0000-0000-000000000004', 'lost'),
             ('bbbbbbbb-0000-0000-0000-000000000005', 'lost'), ('bbbbbbbb-0000-0000-0000-000000000006', 'lost'),
             ('bbbbbbbb-0000-0000-0000-000000000007', 'lost')$$,
    'after recovery exactly the expired unfinished starts are lost'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.recover_expired(0, interval '0')$$, 'Q3V01', 'a limit of 0 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.recover_expired(10001, interval '0')$$, 'Q3V01', 'a limit over 10000 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.recover_expired(NULL, interval '0')$$, 'Q3V01', 'a NULL limit is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.recover_expired(10, interval '-1 second')$$, 'Q3V01', 'a negative grace is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.recover_expired(10, NULL)$$, 'Q3V01', 'a NULL grace is QL3_INVALID_ARGUMENT'
);

-- A late answer from the gateway cannot overwrite the recovered outcome.

SET ROLE ql3_runtime;
SELECT * FROM tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('inv-e1', 'succeeded', 'ok'))$$,
    'Q3C01', 'completing a recovered invocation with another outcome is QL3_CONFLICT'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('inv-e1', 'lost', 'outcome_unknown')) ->> 'status', 'existing',
    'completing a recovered invocation as lost/outcome_unknown replays as existing'
);
SET ROLE ql3_operator;
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('inv-e1', 'retry', 'bob')) ->> 'status', 'created',
    'a recovered invocation is resolved like any lost one'
);

-- usage_summary: totals by provider, model and currency; unknown cost counted apart.

RESET ROLE;
SELECT ql3.create_run('proj', 'trace-u', 'aaaaaaaa-0000-0000-0000-000000000002');
SELECT ql3.create_run('other', 'trace-o', 'aaaaaaaa-0000-0000-0000-000000000003');
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000002', 'model', ('cccccccc-0000-0000-0000-00000000000' || g)::uuid)
FROM generate_series(1, 5) AS g;
SELECT ql3.add_step_run('aaaaaaaa-0000-0000-0000-000000000003', 'model', 'cccccccc-0000-0000-0000-000000000009');
SET ROLE ql3_runtime;
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-u' || g, 'aaaaaaaa-0000-0000-0000-000000000002', ('cccccccc-0000-0000-0000-00000000000' || g)::uuid, 1,
    p_trace_id => 'trace-u'
))
FROM generate_series(1, 4) AS g;
SELECT ql3_ai.admit_invocation(
    tests.admission('inv-u5', 'aaaaaaaa-0000-0000-0000-000000000002', 'cccccccc-0000-0000-0000-000000000005', 1,
                    p_trace_id => 'trace-u')
    || '{"provider": "openai", "model": "gpt-4o-mini"}'
);
SELECT ql3_ai.admit_invocation(tests.admission(
    'inv-u9', 'aaaaaaaa-0000-0000-0000-000000000003', 'cccccccc-0000-0000-0000-000000000009', 1,
    p_project_id => 'other', p_trace_id => 'trace-o'
));
SELECT ql3_ai.complete_invocation(tests.completion('inv-u1', 'succeeded', 'ok', tests.usage(100, 50, 2000, 'USD')));
SELECT ql3_ai.complete_invocation(tests.completion('inv-u2', 'failed', 'provider_error', tests.usage(10, NULL, 500, 'USD')));
SELECT ql3_ai.complete_invocation(tests.completion('inv-u3', 'succeeded', 'ok', tests.usage(30, 20, NULL, NULL)));
SELECT ql3_ai.complete_invocation(tests.completion('inv-u4', 'succeeded', 'ok'));
SELECT ql3_ai.complete_invocation(tests.completion('inv-u5', 'succeeded', 'ok', tests.usage(5, 5, 300, 'USD')));
SELECT ql3_ai.complete_invocation(tests.completion('inv-u9', 'succeeded', 'ok', tests.usage(1, 1, 1, 'USD')));

SELECT results_eq(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, NULL)$$,
    $$VALUES ('ollama', 'llama3.1:8b', 'USD', 2::bigint, 110::bigint, 50::bigint, 2500::bigint, 2::bigint, 0::bigint),
             ('ollama', 'llama3.1:8b', NULL, 1::bigint, 30::bigint, 20::bigint, NULL::bigint, 0::bigint, 1::bigint),
             ('openai', 'gpt-4o-mini', 'USD', 1::bigint, 5::bigint, 5::bigint, 300::bigint, 1::bigint, 0::bigint)$$,
    'usage_summary totals one project by provider, model and currency, with unknown cost counted apart'
);
SELECT results_eq(
    $$SELECT completions, known_cost_micros FROM ql3_ai.usage_summary('other', NULL, NULL)$$,
    $$VALUES (1::bigint, 1::bigint)$$,
    'usage_summary of another project sees only its own ledger rows'
);
SELECT is_empty(
    $$SELECT * FROM ql3_ai.usage_summary('proj', now() + interval '1 second', NULL)$$,
    'usage recorded before from is left out'
);
SELECT is_empty(
    $$SELECT * FROM ql3_ai.usage_summary('proj', NULL, now())$$,
    'to is exclusive'
);
SELECT is(
    (SELECT sum(completions) FROM ql3_ai.usage_summary('proj', now(), now() + interval '1 second'))::integer, 4,
    'from is inclusive'
);
SELECT * FROM tests.rejects(
    $$SELECT * FROM ql3_ai.usage_summary('', NULL, NULL)$$, 'Q3V01', 'an empty project_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.rejects(
    $$SELECT * FROM ql3_ai.usage_summary(repeat('p', 129), NULL, NULL)$$,
    'Q3V03', 'a 129-character project_id is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.rejects(
    $$SELECT * FROM ql3_ai.usage_summary('proj', now(), now() - interval '1 day')$$,
    'Q3V01', 'from after to is QL3_INVALID_ARGUMENT'
);

RESET ROLE;
SELECT * FROM finish();
ROLLBACK;
