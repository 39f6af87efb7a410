-- The CHECK and WHEN helpers of core 0006 and ql3_ai 0002 (D67): the constraints and the
-- state machine's trigger call them, the lost-step trigger tests the rest of its old WHEN
-- itself, each answers exactly what the expression it replaced answered (NULLs
-- included) over every combination of its inputs, and a search_path that shadows
-- pg_catalog's operators does not change an answer.
BEGIN;
SELECT plan(19);

-- In place, and validated ------------------------------------------------------------------

SELECT is(
    (SELECT pg_get_constraintdef(c.oid) FROM pg_constraint AS c
     WHERE c.conrelid = 'ql3.step_runs'::regclass AND c.conname = 'step_runs_check'),
    'CHECK (ql3._step_state_valid(status, (current_invocation_id)::text, output_ref, (result_code)::text))',
    'step_runs_check calls ql3._step_state_valid'
);
SELECT is(
    (SELECT pg_get_constraintdef(c.oid) FROM pg_constraint AS c
     WHERE c.conrelid = 'ql3_ai.model_invocation_completions'::regclass
       AND c.conname = 'model_invocation_completions_check'),
    'CHECK (ql3_ai._completion_valid(outcome, (result_code)::text, recovered))',
    'model_invocation_completions_check calls ql3_ai._completion_valid'
);
SELECT is_empty(
    $$SELECT c.conname FROM pg_constraint AS c
      WHERE c.conrelid IN ('ql3.step_runs'::regclass, 'ql3_ai.model_invocation_completions'::regclass)
        AND NOT c.convalidated$$,
    'both constraints are validated (0007 and ql3_ai 0003)'
);
SELECT is(
    (SELECT pg_get_triggerdef(t.oid) FROM pg_trigger AS t
     WHERE t.tgrelid = 'ql3.step_runs'::regclass AND t.tgname = 'step_runs_state_machine'),
    'CREATE TRIGGER step_runs_state_machine BEFORE UPDATE OF status ON ql3.step_runs FOR EACH ROW '
    'WHEN (((old.status IS DISTINCT FROM new.status) AND ql3._step_transition_refused(old.status, new.status))) '
    'EXECUTE FUNCTION ql3._refuse_step_transition()',
    'the state machine''s WHEN calls ql3._step_transition_refused'
);

SELECT is(
    (SELECT pg_get_triggerdef(t.oid) FROM pg_trigger AS t
     WHERE t.tgrelid = 'ql3.step_runs'::regclass AND t.tgname = 'step_runs_lost_needs_resolution'),
    'CREATE TRIGGER step_runs_lost_needs_resolution BEFORE UPDATE ON ql3.step_runs FOR EACH ROW '
    'WHEN ((old.status = ''lost''::text)) EXECUTE FUNCTION ql3_ai._require_resolution()',
    'the lost-step trigger''s WHEN is its first test alone'
);

-- The lost-step trigger makes the rest of its old WHEN's test itself: an update of a lost
-- step that keeps its status, invocation and attempt count goes through; one that changes
-- any of them needs a resolution (13_resolution.sql has the resolutions).
INSERT INTO ql3.runs (run_id, project_id, trace_id) VALUES ('c0c0c0c0-0000-0000-0000-000000000001', 'proj', 'trace');
INSERT INTO ql3.step_runs (step_run_id, run_id, kind, status, version, attempt_count, current_invocation_id)
VALUES ('c0c0c0c0-0000-0000-0000-000000000002', 'c0c0c0c0-0000-0000-0000-000000000001', 'model', 'lost', 3, 1,
        'inv-lost');
SELECT lives_ok(
    $$UPDATE ql3.step_runs SET updated_at = updated_at + interval '1 second', version = version + 1
      WHERE step_run_id = 'c0c0c0c0-0000-0000-0000-000000000002'$$,
    'a lost step may be updated when its status, invocation and attempt count stay'
);
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET attempt_count = 2 WHERE step_run_id = 'c0c0c0c0-0000-0000-0000-000000000002'$$,
    'Q3S01', NULL, 'a lost step''s attempt count does not change without a resolution'
);
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET current_invocation_id = 'inv-other'
      WHERE step_run_id = 'c0c0c0c0-0000-0000-0000-000000000002'$$,
    'Q3S01', NULL, 'a lost step''s invocation does not change without a resolution'
);
SELECT throws_ok(
    $$UPDATE ql3.step_runs SET status = 'failed' WHERE step_run_id = 'c0c0c0c0-0000-0000-0000-000000000002'$$,
    'Q3S01', NULL, 'a lost step does not fail without a resolution'
);

-- The same answers as the replaced expressions ---------------------------------------------

CREATE TEMP TABLE statuses (s) AS
VALUES ('ready'), ('running'), ('succeeded'), ('failed'), ('timed_out'), ('lost'), ('cancelled'),
       ('bogus'), (NULL);
CREATE TEMP TABLE maybe (v) AS VALUES ('x'), (NULL);

SELECT is_empty(
    $$SELECT s.s, i.v, o.v, r.v FROM statuses AS s, maybe AS i, maybe AS o, maybe AS r
      WHERE ql3._step_state_valid(s.s, i.v, o.v, r.v) IS DISTINCT FROM (
          CASE s.s
              WHEN 'ready' THEN i.v IS NULL AND o.v IS NULL AND r.v IS NULL
              WHEN 'running' THEN i.v IS NOT NULL AND o.v IS NULL AND r.v IS NULL
              WHEN 'succeeded' THEN TRUE
              WHEN 'failed' THEN o.v IS NULL
              WHEN 'timed_out' THEN o.v IS NULL
              WHEN 'lost' THEN o.v IS NULL
              WHEN 'cancelled' THEN o.v IS NULL
              ELSE FALSE
          END)$$,
    '_step_state_valid answers as 0003''s CHECK for every status and every empty or set column'
);
SELECT is_empty(
    $$SELECT a.s, b.s FROM statuses AS a, statuses AS b
      WHERE ql3._step_transition_refused(a.s, b.s) IS DISTINCT FROM (
          (a.s, b.s) NOT IN (
              ('ready', 'running'),
              ('running', 'succeeded'), ('running', 'failed'), ('running', 'timed_out'), ('running', 'lost'),
              ('lost', 'ready'), ('lost', 'failed'), ('lost', 'cancelled')))$$,
    '_step_transition_refused answers as 0003''s row NOT IN for every pair of statuses, NULL included'
);
SELECT is(
    (SELECT count(*) FROM statuses AS a, statuses AS b WHERE NOT ql3._step_transition_refused(a.s, b.s)),
    8::bigint,
    'exactly the eight transitions of SPEC section 4 are allowed'
);
SELECT is_empty(
    $$SELECT o.o, r.r, v.v
      FROM (VALUES ('lost'), ('succeeded'), ('failed'), ('timed_out'), ('bogus'), (NULL)) AS o (o),
           (VALUES ('outcome_unknown'), ('ok'), (NULL)) AS r (r),
           (VALUES (TRUE), (FALSE), (NULL)) AS v (v)
      WHERE ql3_ai._completion_valid(o.o, r.r, v.v) IS DISTINCT FROM (
          CASE o.o
              WHEN 'lost' THEN r.r = 'outcome_unknown'
              WHEN 'succeeded' THEN NOT v.v AND r.r <> 'outcome_unknown'
              WHEN 'failed' THEN NOT v.v AND r.r <> 'outcome_unknown'
              WHEN 'timed_out' THEN NOT v.v AND r.r <> 'outcome_unknown'
              ELSE FALSE
          END)$$,
    '_completion_valid answers as ql3_ai 0001''s CHECK for every outcome, result code and recovered flag'
);

-- A search_path that shadows pg_catalog's operators ----------------------------------------
-- The helpers carry no SET search_path (it would cost every row a configuration change);
-- their operators are schema-qualified instead. Under this path an unqualified = or <>
-- on text would be the hostile one, which says true to everything.

CREATE SCHEMA hostile;
CREATE FUNCTION hostile.yes(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT TRUE';
DO $$
BEGIN  -- in a DO block: sqlfluff does not parse CREATE OPERATOR
    EXECUTE 'CREATE OPERATOR hostile.= (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.yes)';
    EXECUTE 'CREATE OPERATOR hostile.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.yes)';
END;
$$;
-- The answers are taken under the hostile path and checked after it is gone: pgTAP's own
-- comparisons would take the hostile operators too.
SET LOCAL search_path = hostile, pg_catalog, public;
CREATE TEMP TABLE under_hostile AS
SELECT
    'a'::text = 'b'::text AS shadowed,
    ql3._step_transition_refused('succeeded', 'ready') AS succeeded_to_ready,
    ql3._step_state_valid('succeeded', 'inv-1', NULL, NULL) AS succeeded_valid,
    ql3._step_state_valid('running', NULL, NULL, NULL) AS running_without_invocation,
    ql3_ai._completion_valid('lost', 'ok', FALSE) AS lost_without_unknown,
    ql3_ai._completion_valid('succeeded', 'outcome_unknown', FALSE) AS success_with_unknown;
RESET search_path;

SELECT ok((SELECT shadowed FROM under_hostile), 'the hostile = was the one that path found first');
SELECT is((SELECT succeeded_to_ready FROM under_hostile), TRUE,
          'succeeded -> ready is still refused under the hostile path');
SELECT is((SELECT succeeded_valid FROM under_hostile), TRUE,
          'a succeeded step is still valid under the hostile path (it is not read as ready)');
SELECT is((SELECT running_without_invocation FROM under_hostile), FALSE,
          'a running step naming no invocation is still invalid under the hostile path');
SELECT is((SELECT lost_without_unknown FROM under_hostile), FALSE,
          'a lost completion without outcome_unknown is still invalid under the hostile path');
SELECT is((SELECT success_with_unknown FROM under_hostile), FALSE,
          'a success carrying outcome_unknown is still invalid under the hostile path');

SELECT * FROM finish();
ROLLBACK;
