-- Admission in a new run against a concurrent add_step_run (D60), seen from other sessions
-- through dblink: a step made with the same id in another run after the admission found
-- none, and before it inserted its own, is add_step_run's QL3_CONFLICT, and the new run
-- goes with the admission. The sessions commit real rows under a unique project.
BEGIN;
SELECT plan(4);
SET LOCAL client_min_messages = warning;

\ir lib/invocation_helpers.sql
\ir lib/outbox_helpers.sql
INSERT INTO tests.ctx (key, value) VALUES ('project', 'tap11c-' || gen_random_uuid());
CREATE TABLE tests.ids11c AS
SELECT
    gen_random_uuid() AS run_a,
    gen_random_uuid() AS run_b,
    gen_random_uuid() AS step;

SELECT dblink_connect('tap11c_a', tests.dsn());
SELECT dblink_connect('tap11c_b', tests.dsn());
SELECT dblink_exec('tap11c_a', 'SET statement_timeout = ''5s''');
SELECT dblink_exec('tap11c_b', 'SET statement_timeout = ''5s''');

-- Session a adds the step to a run of its own and keeps its transaction open.
SELECT dblink_exec('tap11c_a', 'BEGIN');
SELECT t.id FROM tests.ids11c AS i,
    dblink('tap11c_a', format('SELECT ql3.create_run(%L, ''trace-a'', %L)', tests.p(), i.run_a)) AS t (id uuid);
SELECT t.id FROM tests.ids11c AS i,
    dblink('tap11c_a', format('SELECT ql3.add_step_run(%L, ''model'', %L)', i.run_a, i.step)) AS t (id uuid);

-- Session b admits in a new run with the same step id: it cannot see a's step, inserts its
-- run and then waits on the step's key.
SELECT dblink_send_query('tap11c_b', format(
    'SELECT ql3_ai.admit_in_new_run(%L::jsonb)',
    tests.admission('inv-11c-' || i.step, i.run_b, i.step, 1, p_project_id => tests.p())))
FROM tests.ids11c AS i;
DO $$
BEGIN
    FOR attempt IN 1 .. 500 LOOP
        -- pg_stat_activity is read once per transaction unless the snapshot is cleared
        PERFORM pg_stat_clear_snapshot();
        EXIT WHEN EXISTS (SELECT 1 FROM pg_stat_activity AS a
                          WHERE a.query LIKE 'SELECT ql3_ai.admit_in_new_run(%' AND a.wait_event_type = 'Lock');
        PERFORM pg_sleep(0.01);
    END LOOP;
END;
$$;
SELECT ok(
    EXISTS (SELECT 1 FROM pg_stat_activity AS a
            WHERE a.query LIKE 'SELECT ql3_ai.admit_in_new_run(%' AND a.wait_event_type = 'Lock'),
    'the admission waits on the step a is adding'
);
SELECT dblink_exec('tap11c_a', 'COMMIT');

SELECT is(
    (SELECT count(t.r)::integer FROM dblink_get_result('tap11c_b', FALSE) AS t (r jsonb)), 0,
    'the admission fails'
);
SELECT is(
    split_part(dblink_error_message('tap11c_b'), E'\n', 1),
    (SELECT format('ERROR:  QL3_CONFLICT: step run %s exists in run %s with kind ''model''', i.step, i.run_a)
     FROM tests.ids11c AS i),
    'with add_step_run''s QL3_CONFLICT, as on the long way'
);
SELECT is(
    (SELECT t.n FROM tests.ids11c AS i,
         dblink('tap11c_a', format('SELECT count(*)::integer FROM ql3.runs WHERE run_id = %L', i.run_b))
             AS t (n integer)),
    0, 'and the run it inserted is not kept'
);

SELECT dblink_disconnect('tap11c_a');
SELECT dblink_disconnect('tap11c_b');

SELECT * FROM finish();
ROLLBACK;
