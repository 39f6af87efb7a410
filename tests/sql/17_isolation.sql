-- Project isolation and resolver identities (D47), with real LOGIN roles. The checks read
-- session_user's memberships, and session_user is the login (SET ROLE does not change it,
-- and the superuser is a member of every role), so each login acts here through SET SESSION
-- AUTHORIZATION, which the superuser may use inside this file's transaction: the roles, the
-- grants and every row roll back with it.
--
-- Two projects, tap17-a and tap17-b, and logins: a runtime, an operator and a reader per
-- project, a runtime of A through a group role, an operator of every project, a reader and a
-- relay with no grant. First the single-tenant state (no grant at all: every login acts on
-- and reads every project); then the first grant turns isolation on, and each writing
-- function refuses another project (42501 for a project it names, Q3N01 for another
-- project's revision, run or invocation, Q3C01 without naming the other project for a
-- run_id taken by another project), with nothing written; row-level security shows each login only its
-- projects' rows; recovery settles only the session's projects; a dropped role breaks
-- nothing; the last grant cannot be revoked; resolutions record the login, and once the owner
-- maps identities a login resolves only as itself or a user_id mapped to one of its roles.
BEGIN;
SET LOCAL client_min_messages = warning;
\ir lib/invocation_helpers.sql

SELECT plan(146);

-- Helpers -----------------------------------------------------------------------------------

CREATE FUNCTION tests.proj(p_tag text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT 'tap17-' || p_tag $$;

CREATE FUNCTION tests.run(p_tag text) RETURNS uuid
LANGUAGE sql IMMUTABLE AS $$ SELECT format('aaaaaaaa-0017-0000-0000-00000000000%s', p_tag)::uuid $$;

CREATE FUNCTION tests.step(p_tag text, p_n integer) RETURNS uuid
LANGUAGE sql IMMUTABLE AS $$ SELECT format('bbbbbbbb-0017-000%s-0000-%s', p_tag, lpad(p_n::text, 12, '0'))::uuid $$;

CREATE TEMP TABLE fx (key text PRIMARY KEY, value text NOT NULL);
GRANT SELECT ON fx TO PUBLIC;  -- noqa: CP02

CREATE FUNCTION tests.fx(p_key text) RETURNS text
LANGUAGE sql STABLE AS $$ SELECT x.value FROM fx AS x WHERE x.key = p_key $$;

-- Who this session is and what it may act on.
CREATE FUNCTION tests.whoami() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT format('%s: visible=%s a=%s b=%s', session_user, coalesce(ql3.visible_projects()::text, 'every'),
                  ql3.may_act_on('tap17-a')::text, ql3.may_act_on('tap17-b')::text);
$$;

-- The rows of the twelve tables under row-level security that the caller can read, counted
-- by project (a row whose parent it cannot read would count under '?'), skipping the tables
-- it may not read at all (the runtime's outbox).
CREATE FUNCTION tests.rows_by_project() RETURNS TABLE (table_name text, project_id text, n bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT q.table_name, q.relation, q.query
        FROM (VALUES
            ('contract_revisions', 'ql3.contract_revisions',
             'SELECT r.project_id FROM ql3.contract_revisions AS r'),
            ('revision_revocations', 'ql3.revision_revocations',
             'SELECT r.project_id FROM ql3.revision_revocations AS v
              LEFT JOIN ql3.contract_revisions AS r ON r.revision_id = v.revision_id'),
            ('active_revisions', 'ql3.active_revisions', 'SELECT a.project_id FROM ql3.active_revisions AS a'),
            ('contract_outbox', 'ql3.contract_outbox', 'SELECT o.project_id FROM ql3.contract_outbox AS o'),
            ('runs', 'ql3.runs', 'SELECT r.project_id FROM ql3.runs AS r'),
            ('step_runs', 'ql3.step_runs',
             'SELECT r.project_id FROM ql3.step_runs AS s LEFT JOIN ql3.runs AS r ON r.run_id = s.run_id'),
            ('run_events', 'ql3.run_events',
             'SELECT r.project_id FROM ql3.run_events AS e LEFT JOIN ql3.runs AS r ON r.run_id = e.run_id'),
            ('step_run_mutations', 'ql3.step_run_mutations',
             'SELECT r.project_id FROM ql3.step_run_mutations AS m
              LEFT JOIN ql3.step_runs AS s ON s.step_run_id = m.step_run_id
              LEFT JOIN ql3.runs AS r ON r.run_id = s.run_id'),
            ('model_invocation_starts', 'ql3_ai.model_invocation_starts',
             'SELECT st.project_id FROM ql3_ai.model_invocation_starts AS st'),
            ('model_invocation_completions', 'ql3_ai.model_invocation_completions',
             'SELECT c.project_id FROM ql3_ai.model_invocation_completions AS c'),
            ('model_invocation_resolutions', 'ql3_ai.model_invocation_resolutions',
             'SELECT r.project_id FROM ql3_ai.model_invocation_resolutions AS v
              LEFT JOIN ql3.runs AS r ON r.run_id = v.run_id'),
            ('usage_ledger', 'ql3_ai.usage_ledger', 'SELECT u.project_id FROM ql3_ai.usage_ledger AS u')
        ) AS q (table_name, relation, query)
        WHERE has_table_privilege(q.relation, 'SELECT')
    LOOP
        RETURN QUERY EXECUTE format(
            'SELECT %L::text, coalesce(x.project_id, ''?''), count(*) FROM (%s) AS x (project_id) GROUP BY 2',
            t.table_name, t.query);
    END LOOP;
END;
$$;

-- The same, read as the test superuser: every row.
CREATE FUNCTION tests.all_rows() RETURNS TABLE (table_name text, project_id text, n bigint)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT * FROM tests.rows_by_project();
$$;

CREATE TEMP TABLE rls_tables (ord, table_name) AS
VALUES
    (1, 'contract_revisions'), (2, 'revision_revocations'), (3, 'active_revisions'), (4, 'contract_outbox'),
    (5, 'runs'), (6, 'step_runs'), (7, 'run_events'), (8, 'step_run_mutations'), (9, 'model_invocation_starts'),
    (10, 'model_invocation_completions'), (11, 'model_invocation_resolutions'), (12, 'usage_ledger');
GRANT SELECT ON rls_tables TO PUBLIC;  -- noqa: CP02

-- The recovered invocation_ids of a recovery result, sorted.
CREATE FUNCTION tests.recovered(p_result jsonb) RETURNS text []
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(array_agg(i.id ORDER BY i.id COLLATE "C"), '{}')
    FROM jsonb_array_elements_text(jsonb_path_query_array(p_result, '$.recovered[*].invocation_id')) AS i (id);
$$;

-- Roles --------------------------------------------------------------------------------------

CREATE ROLE tap17_rt_a LOGIN IN ROLE ql3_runtime;
CREATE ROLE tap17_rt_b LOGIN IN ROLE ql3_runtime;
CREATE ROLE tap17_team_a NOLOGIN;
CREATE ROLE tap17_rt_a2 LOGIN IN ROLE ql3_runtime;
GRANT tap17_team_a TO tap17_rt_a2;
CREATE ROLE tap17_op_a LOGIN IN ROLE ql3_operator;
CREATE ROLE tap17_op_b LOGIN IN ROLE ql3_operator;
CREATE ROLE tap17_op_all LOGIN IN ROLE ql3_operator;
CREATE ROLE tap17_rd_b LOGIN IN ROLE ql3_reader;
CREATE ROLE tap17_rd_none LOGIN IN ROLE ql3_reader;
CREATE ROLE tap17_relay LOGIN IN ROLE ql3_relay;
CREATE ROLE tap17_gone LOGIN IN ROLE ql3_runtime;
CREATE ROLE tap17_resolvers NOLOGIN;

-- Fixture (as the test superuser) ------------------------------------------------------------
-- In each project P (a, b): revisions r1 (active), r2, r3 (revoked) of policy_routing/c1; run
-- tests.run(P) with model steps 1..12: 1 running (tap17-P-run), 2 and 3 running past their
-- deadline (tap17-P-exp1, -exp2), 4 5 6 lost (tap17-P-lost1..3), 7 ready, 8 succeeded with
-- usage (tap17-P-ok), 9 lost (tap17-P-res, resolved below), 10 11 12 ready.

INSERT INTO fx (key, value)
SELECT
    p.tag || '_r' || v.n AS key,
    (ql3.put_revision(tests.proj(p.tag), 'policy_routing', 'c1', jsonb_build_object('v', v.n), 'setup')).revision_id::text
    AS value
FROM (VALUES ('a'), ('b')) AS p (tag)
CROSS JOIN generate_series(1, 3) AS v (n);
SELECT ql3.activate_revision(tests.proj(p.tag), 'policy_routing', 'c1', tests.fx(p.tag || '_r1')::uuid, 'setup')
FROM (VALUES ('a'), ('b')) AS p (tag);
SELECT ql3.revoke_revision(tests.fx(p.tag || '_r3')::uuid, 'setup', 'withdrawn')
FROM (VALUES ('a'), ('b')) AS p (tag);

SELECT ql3.add_step_run(ql3.create_run(tests.proj(p.tag), 'trace-1', tests.run(p.tag)), 'model', tests.step(p.tag, g))
FROM (VALUES ('a'), ('b')) AS p (tag)
CROSS JOIN generate_series(1, 12) AS g;
SELECT ql3_ai.admit_invocation(tests.admission(
    'tap17-' || p.tag || '-' || i.name, tests.run(p.tag), tests.step(p.tag, i.step), 1,
    p_deadline_at => i.deadline, p_project_id => tests.proj(p.tag)))
FROM (VALUES ('a'), ('b')) AS p (tag)
CROSS JOIN (VALUES
    (1, 'run', '2999-01-01T00:00:00.000000Z'), (2, 'exp1', '2000-01-01T00:00:00.000000Z'),
    (3, 'exp2', '2000-01-02T00:00:00.000000Z'), (4, 'lost1', '2999-01-01T00:00:00.000000Z'),
    (5, 'lost2', '2999-01-01T00:00:00.000000Z'), (6, 'lost3', '2999-01-01T00:00:00.000000Z'),
    (8, 'ok', '2999-01-01T00:00:00.000000Z'), (9, 'res', '2999-01-01T00:00:00.000000Z')
) AS i (step, name, deadline)
ORDER BY p.tag, i.step;
SELECT ql3_ai.complete_invocation(tests.completion('tap17-' || p.tag || '-' || i.name, 'lost', 'outcome_unknown'))
FROM (VALUES ('a'), ('b')) AS p (tag)
CROSS JOIN (VALUES ('lost1'), ('lost2'), ('lost3'), ('res')) AS i (name)
ORDER BY p.tag, i.name;
SELECT ql3_ai.complete_invocation(tests.completion('tap17-' || p.tag || '-ok', p_usage => tests.usage(10, 20, 30, 'USD')))
FROM (VALUES ('a'), ('b')) AS p (tag)
ORDER BY p.tag;

-- 1. No grant at all: the single tenant ---------------------------------------------------------

SELECT is(
    (SELECT count(*) FROM ql3.project_grants) + (SELECT count(*) FROM ql3_ai.resolver_identities), 0::bigint,
    'no project grant and no resolver identity exist: the single-tenant state'
);

SET SESSION AUTHORIZATION tap17_rt_a;
SELECT is(session_user::text, 'tap17_rt_a', 'SET SESSION AUTHORIZATION makes the login the session_user');
SELECT is(tests.whoami(), 'tap17_rt_a: visible=every a=true b=true', 'without grants the runtime of A acts on every project');
SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        'tap17-b-cross', tests.run('b'), tests.step('b', 12), 1, p_project_id => tests.proj('b'))) ->> 'status',
    'created',
    'it admits in project B'
);
SELECT lives_ok(
    $$SELECT ql3.create_run('tap17-b', 'trace-x', 'aaaaaaaa-0017-0000-0000-0000000000b2')$$,
    'and creates a run in project B'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rt_b;
SELECT is(tests.whoami(), 'tap17_rt_b: visible=every a=true b=true', 'so does the runtime of B');
SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        'tap17-a-cross', tests.run('a'), tests.step('a', 12), 1, p_project_id => tests.proj('a'))) ->> 'status',
    'created',
    'which admits in project A'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_a;
SELECT is(tests.whoami(), 'tap17_op_a: visible=every a=true b=true', 'the operator of A acts on every project');
SELECT lives_ok(
    $$SELECT ql3.put_revision('tap17-b', 'policy_routing', 'c2', '{"v": 1}', 'op-a')$$,
    'it puts a revision in project B'
);
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('tap17-b-res', 'retry', 'setup')) ->> 'status', 'created',
    'and resolves an invocation of project B'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_b;
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('tap17-a-res', 'retry', 'setup')) ->> 'status', 'created',
    'the operator of B resolves an invocation of project A'
);
RESET SESSION AUTHORIZATION;

SELECT ok(
    (SELECT count(*) FROM tests.all_rows() AS r WHERE r.project_id IN ('tap17-a', 'tap17-b')) = 24,
    'every table under row-level security holds rows of both projects (the reads below are not vacuous)'
);
SET SESSION AUTHORIZATION tap17_rd_b;
SELECT is(tests.whoami(), 'tap17_rd_b: visible=every a=true b=true', 'the reader of B may read every project');
SELECT set_eq(
    format($$SELECT project_id, n FROM tests.rows_by_project() WHERE table_name = %L$$, t.table_name),
    format($$SELECT project_id, n FROM tests.all_rows() WHERE table_name = %L$$, t.table_name),
    format('without grants the reader of B reads every row of %s', t.table_name)
)
FROM rls_tables AS t ORDER BY t.ord;
SELECT set_eq(
    $$SELECT * FROM ql3_ai.usage_summary('tap17-a', NULL, NULL)$$,
    $$VALUES ('ollama', 'llama3.1:8b', 'USD', 1::bigint, 10::bigint, 20::bigint, 30::bigint, 1::bigint, 0::bigint)$$,
    'and the usage of project A'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_relay;
SELECT is(
    (SELECT count(*) FROM ql3.contract_outbox AS o WHERE o.project_id IN ('tap17-a', 'tap17-b')), 4::bigint,
    'without grants the relay reads the outbox rows of both projects'
);
RESET SESSION AUTHORIZATION;

-- 2. The first grant turns isolation on --------------------------------------------------------
-- While no grant exists every operator may act on every project, and so may grant one: the
-- first grant is an operator's, here one to itself of every project.

SET SESSION AUTHORIZATION tap17_op_all;
SELECT is(ql3.grant_project('tap17_op_all', NULL), TRUE, 'an operator grants itself every project (the first grant)');
SELECT is(tests.whoami(), 'tap17_op_all: visible=every a=true b=true', 'and still acts on every project');
RESET SESSION AUTHORIZATION;
SELECT is(
    (SELECT string_agg(g.role_name || ':' || coalesce(g.project_id, '*') || ' by ' || g.granted_by, ', ')
     FROM ql3.project_grants AS g),
    'tap17_op_all:* by tap17_op_all',
    'it is the only grant, and records who made it'
);
SET SESSION AUTHORIZATION tap17_rd_b;
SELECT is(tests.whoami(), 'tap17_rd_b: visible={} a=false b=false', 'isolation is on: the reader of B has no project yet');
SELECT is_empty($$SELECT * FROM tests.rows_by_project()$$, 'and reads no row of any table');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_a;
SELECT tests.rejects(
    $$SELECT ql3.grant_project('tap17_op_a', 'tap17-a')$$, '42501',
    'an operator without a grant cannot grant itself a project'
);
RESET SESSION AUTHORIZATION;

SET SESSION AUTHORIZATION tap17_op_all;
SELECT is(
    array_agg(ql3.grant_project(g.role_name, g.project_id) ORDER BY g.ord),
    ARRAY[TRUE, TRUE, TRUE, TRUE, TRUE, TRUE],
    'the operator of every project grants A and B to their logins'
)
FROM (VALUES
    (1, 'tap17_op_a'::name, 'tap17-a'), (2, 'tap17_rt_a', 'tap17-a'), (3, 'tap17_gone', 'tap17-a'),
    (4, 'tap17_op_b', 'tap17-b'), (5, 'tap17_rt_b', 'tap17-b'), (6, 'tap17_rd_b', 'tap17-b')
) AS g (ord, role_name, project_id);
RESET SESSION AUTHORIZATION;

SET SESSION AUTHORIZATION tap17_op_a;
SELECT is(ql3.grant_project('tap17_team_a', 'tap17-a'), TRUE, 'the operator of A grants A to a group role');
SELECT is(ql3.grant_project('tap17_rt_a', 'tap17-a'), FALSE, 'a grant that exists is not new');
SELECT tests.rejects(
    $$SELECT ql3.grant_project('tap17_op_a', 'tap17-b')$$, '42501', 'the operator of A cannot grant project B',
    'QL3_PERMISSION_DENIED: tap17_op_a may not grant project ''tap17-b'''
);
SELECT tests.rejects(
    $$SELECT ql3.grant_project('tap17_op_a', NULL)$$, '42501', 'the operator of A cannot grant every project',
    'QL3_PERMISSION_DENIED: tap17_op_a may not grant every project'
);
SELECT tests.rejects(
    $$SELECT ql3.revoke_project('tap17_rt_b', 'tap17-b')$$, '42501',
    'the operator of A cannot revoke a grant of project B'
);
SELECT tests.rejects(
    $$SELECT ql3.revoke_project('tap17_op_all', NULL)$$, '42501',
    'the operator of A cannot revoke a grant of every project'
);
SELECT tests.rejects(
    $$SELECT ql3.grant_project('tap17_nobody', 'tap17-a')$$, 'Q3V01', 'nobody grants a project to a role that does not exist'
);
SELECT tests.rejects(
    $$INSERT INTO ql3.project_grants (role_name, project_id, granted_by) VALUES ('tap17_op_a', NULL, 'tap17_op_a')$$,
    '42501', 'the operator of A cannot grant itself every project by INSERT'
);
RESET SESSION AUTHORIZATION;

SET SESSION AUTHORIZATION tap17_rt_a;
SELECT is(tests.whoami(), 'tap17_rt_a: visible={tap17-a} a=true b=false', 'the runtime of A acts on A only');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rt_a2;
SELECT is(tests.whoami(), 'tap17_rt_a2: visible={tap17-a} a=true b=false', 'a runtime in a group role granted A acts on A only');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_a;
SELECT is(tests.whoami(), 'tap17_op_a: visible={tap17-a} a=true b=false', 'the operator of A acts on A only');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rt_b;
SELECT is(tests.whoami(), 'tap17_rt_b: visible={tap17-b} a=false b=true', 'the runtime of B acts on B only');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rd_b;
SELECT is(tests.whoami(), 'tap17_rd_b: visible={tap17-b} a=false b=true', 'the reader of B acts on B only');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rd_none;
SELECT is(tests.whoami(), 'tap17_rd_none: visible={} a=false b=false', 'a reader without a grant acts on no project');
RESET SESSION AUTHORIZATION;

-- 3. The runtime of A ----------------------------------------------------------------------------

SET SESSION AUTHORIZATION tap17_rt_a;
SELECT tests.rejects(
    $$SELECT ql3.create_run('tap17-b', 'trace-x')$$, '42501', 'the runtime of A cannot create a run in project B',
    'QL3_PERMISSION_DENIED: tap17_rt_a may not act on project ''tap17-b'''
);
SELECT tests.rejects(
    $$SELECT ql3.create_run('tap17-a', 'trace-1', 'aaaaaaaa-0017-0000-0000-00000000000b')$$, 'Q3C01',
    'the runtime of A cannot take the run_id of a run of B, and is not told its project',
    'QL3_CONFLICT: run aaaaaaaa-0017-0000-0000-00000000000b exists in another project'
);
SELECT lives_ok(
    $$SELECT ql3.create_run('tap17-a', 'trace-2', 'aaaaaaaa-0017-0000-0000-0000000000a2')$$,
    'the runtime of A creates a run in A'
);
SELECT tests.rejects(
    $$SELECT ql3.add_step_run('aaaaaaaa-0017-0000-0000-00000000000b', 'model')$$, 'Q3N01',
    'the runtime of A cannot add a step to a run of B: it does not exist for A',
    'QL3_NOT_FOUND: run aaaaaaaa-0017-0000-0000-00000000000b does not exist'
);
SELECT lives_ok(
    $$SELECT ql3.add_step_run('aaaaaaaa-0017-0000-0000-0000000000a2', 'model', 'bbbbbbbb-0017-000a-0000-0000000000a2')$$,
    'the runtime of A adds a step to its run'
);
SELECT tests.rejects(
    $$SELECT ql3_ai.admit_invocation(tests.admission(
          'tap17-x-1', 'aaaaaaaa-0017-0000-0000-00000000000b', 'bbbbbbbb-0017-000b-0000-0000000000ff', 1,
          p_project_id => 'tap17-b'))$$,
    '42501', 'the runtime of A cannot admit in project B (refused before the step is looked up: it does not exist)',
    'QL3_PERMISSION_DENIED: tap17_rt_a may not act on project ''tap17-b'''
);
-- A run of B named under project A is as absent as a missing one, whatever its steps' state
-- (ready at the expected version, ready at another, running): no answer tells it.
SELECT tests.rejects(
    format($$SELECT ql3_ai.admit_invocation(tests.admission('tap17-x-2', %L, %L, %s, p_project_id => 'tap17-a'))$$,
           tests.run('b'), tests.step('b', c.step), c.version),
    'Q3N01', format('the runtime of A cannot admit under project A in a run of B (%s): it does not exist for A', c.what),
    'QL3_NOT_FOUND: run aaaaaaaa-0017-0000-0000-00000000000b does not exist'
)
FROM (VALUES
    (1, 10, 1, 'a ready step at its version'), (2, 10, 7, 'a ready step at another version'),
    (3, 1, 1, 'a running step')
) AS c (ord, step, version, what)
ORDER BY c.ord;
SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        'tap17-a-new', tests.run('a'), tests.step('a', 7), 1, p_project_id => 'tap17-a')) ->> 'status',
    'created',
    'the runtime of A admits in its run'
);
SELECT tests.rejects(
    $$SELECT ql3_ai.complete_invocation(tests.completion('tap17-b-run'))$$, 'Q3N01',
    'the runtime of A cannot complete an invocation of B: it was never admitted for A',
    'QL3_NOT_FOUND: invocation tap17-b-run was never admitted'
);
SELECT is(
    ql3_ai.complete_invocation(tests.completion('tap17-a-run')) ->> 'status', 'created',
    'the runtime of A completes its invocation'
);
SELECT throws_ok(
    $$SELECT * FROM ql3_ai.usage_summary('tap17-b', NULL, NULL)$$, '42501',
    'QL3_PERMISSION_DENIED: tap17_rt_a may not act on project ''tap17-b''',
    'the runtime of A cannot read the usage of B'
);
SELECT is(
    (SELECT sum(u.completions) FROM ql3_ai.usage_summary('tap17-a', NULL, NULL) AS u), 1::numeric,
    'it reads the usage of A'
);
SELECT set_eq(
    $$SELECT * FROM tests.rows_by_project()$$,
    $$SELECT * FROM tests.all_rows() WHERE project_id = 'tap17-a' AND table_name <> 'contract_outbox'$$,
    'the runtime of A reads exactly the rows of A, in every table it may read'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rt_a2;
SELECT lives_ok(
    $$SELECT ql3.create_run('tap17-a', 'trace-3')$$, 'a member of a group role granted A creates a run in A'
);
SELECT tests.rejects(
    $$SELECT ql3.create_run('tap17-b', 'trace-3')$$, '42501', 'but not in B'
);
RESET SESSION AUTHORIZATION;

-- 4. The operator of A ---------------------------------------------------------------------------

SET SESSION AUTHORIZATION tap17_op_a;
SELECT tests.rejects(
    $$SELECT ql3.put_revision('tap17-b', 'policy_routing', 'c1', '{"v": 9}', 'op-a')$$, '42501',
    'the operator of A cannot put a revision in B',
    'QL3_PERMISSION_DENIED: tap17_op_a may not act on project ''tap17-b'''
);
SELECT lives_ok(
    $$SELECT ql3.put_revision('tap17-a', 'policy_routing', 'c1', '{"v": 9}', 'op-a')$$, 'it puts one in A'
);
SELECT tests.rejects(
    format($$SELECT ql3.activate_revision('tap17-b', 'policy_routing', 'c1', %L, 'op-a')$$, tests.fx('b_r2')),
    '42501', 'the operator of A cannot activate a revision of B',
    'QL3_PERMISSION_DENIED: tap17_op_a may not act on project ''tap17-b'''
);
SELECT tests.rejects(
    format($$SELECT ql3.activate_revision('tap17-a', 'policy_routing', 'c1', %L, 'op-a')$$, tests.fx('b_r2')),
    'Q3N01', 'nor point a contract of A at a revision of B: it does not exist for A',
    format('QL3_NOT_FOUND: revision %s does not exist', tests.fx('b_r2'))
);
SELECT is(
    (SELECT count(*) FROM ql3.activate_revision('tap17-a', 'policy_routing', 'c1', tests.fx('a_r2')::uuid, 'op-a')),
    1::bigint,
    'it activates a revision of A'
);
SELECT tests.rejects(
    format($$SELECT ql3.revoke_revision(%L, 'op-a', 'mine now')$$, tests.fx('b_r1')),
    'Q3N01', 'the operator of A cannot revoke the active revision of B: it does not exist for A',
    format('QL3_NOT_FOUND: revision %s does not exist', tests.fx('b_r1'))
);
SELECT is(
    (ql3.revoke_revision(tests.fx('a_r1')::uuid, 'op-a', 'replaced')).event_type, 'revision_revoked',
    'it revokes a revision of A'
);
SELECT tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('tap17-b-lost1', 'fail', 'anyone'))$$, 'Q3N01',
    'the operator of A cannot resolve an invocation of B: it was never admitted for A',
    'QL3_NOT_FOUND: invocation tap17-b-lost1 was never admitted'
);
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('tap17-a-lost1', 'fail', 'anyone')) ->> 'status', 'created',
    'it resolves an invocation of A as any user_id while no resolver identity is mapped'
);
SELECT throws_ok(
    $$SELECT * FROM ql3_ai.usage_summary('tap17-b', NULL, NULL)$$, '42501', NULL,
    'the operator of A cannot read the usage of B'
);
SELECT is(
    tests.recovered(ql3_ai.recover_expired(10000, interval '0')),
    ARRAY['tap17-a-exp1', 'tap17-a-exp2'],
    'recovery by the operator of A settles exactly the expired starts of A'
);
RESET SESSION AUTHORIZATION;
SELECT results_eq(
    $$SELECT status FROM ql3.step_runs WHERE step_run_id IN (tests.step('b', 2), tests.step('b', 3))$$,
    $$VALUES ('running'), ('running')$$,
    'the expired starts of B are still running'
);
SET SESSION AUTHORIZATION tap17_rt_a;
SELECT is(
    ql3_ai.admit_invocation(tests.admission(
        'tap17-a-exp3', tests.run('a'), tests.step('a', 11), 1, p_deadline_at => '2000-01-03T00:00:00.000000Z',
        p_project_id => 'tap17-a')) ->> 'status',
    'created',
    'another start of A, already expired'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_all;
SELECT is(
    (SELECT array_agg(i ORDER BY i COLLATE "C") FROM unnest(tests.recovered(ql3_ai.recover_expired(10000, interval '0'))) AS i
     WHERE i LIKE 'tap17-%'),
    ARRAY['tap17-a-exp3', 'tap17-b-exp1', 'tap17-b-exp2'],
    'recovery by the operator of every project settles the expired starts of both'
);
RESET SESSION AUTHORIZATION;

-- 5. Readers -------------------------------------------------------------------------------------

SET SESSION AUTHORIZATION tap17_rd_b;
SELECT set_eq(
    format($$SELECT project_id, n FROM tests.rows_by_project() WHERE table_name = %L$$, t.table_name),
    format($$SELECT project_id, n FROM tests.all_rows() WHERE table_name = %L AND project_id = 'tap17-b'$$,
           t.table_name),
    format('the reader of B reads every row of B in %s, and no other', t.table_name)
)
FROM rls_tables AS t ORDER BY t.ord;
SELECT is_empty(
    $$SELECT * FROM ql3.active_revision('tap17-a', 'policy_routing', 'c1')$$,
    'the reader of B finds no active revision of A (as if none were active)'
);
SELECT results_eq(
    $$SELECT revision_id, pointer_version FROM ql3.active_revision('tap17-b', 'policy_routing', 'c1')$$,
    format($$VALUES (%L::uuid, 1::bigint)$$, tests.fx('b_r1')),
    'it reads the active revision of B'
);
SELECT results_eq(
    $$SELECT project_id, revision_id, pointer_version
      FROM ql3.active_pointers('[["tap17-a", "policy_routing", "c1"], ["tap17-b", "policy_routing", "c1"]]')$$,
    format($$VALUES ('tap17-a', NULL::uuid, 0::bigint), ('tap17-b', %L::uuid, 1::bigint)$$, tests.fx('b_r1')),
    'active_pointers shows the pointer of B, and that of A as if it did not exist'
);
SELECT throws_ok(
    $$SELECT * FROM ql3_ai.usage_summary('tap17-a', NULL, NULL)$$, '42501',
    'QL3_PERMISSION_DENIED: tap17_rd_b may not act on project ''tap17-a''',
    'the reader of B cannot read the usage of A'
);
SELECT set_eq(
    $$SELECT * FROM ql3_ai.usage_summary('tap17-b', NULL, NULL)$$,
    $$VALUES ('ollama', 'llama3.1:8b', 'USD', 1::bigint, 10::bigint, 20::bigint, 30::bigint, 1::bigint, 0::bigint)$$,
    'it reads the usage of B'
);
CREATE TEMP TABLE backlog_rd AS
SELECT
    b.undelivered,
    b.max_seq
FROM ql3.outbox_backlog() AS b;
RESET SESSION AUTHORIZATION;
SELECT results_eq(
    $$SELECT * FROM backlog_rd$$,
    $$SELECT count(*) FILTER (WHERE delivered_at IS NULL), max(seq) FROM ql3.contract_outbox$$,
    'outbox_backlog counts the outbox of every project, whoever asks'
);
SET SESSION AUTHORIZATION tap17_rd_none;
SELECT is_empty($$SELECT * FROM tests.rows_by_project()$$, 'a reader without a grant reads no row of any table');
SELECT throws_ok(
    $$SELECT * FROM ql3_ai.usage_summary('tap17-b', NULL, NULL)$$, '42501', NULL,
    'nor any usage'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_all;
SELECT set_eq(
    $$SELECT * FROM tests.rows_by_project()$$, $$SELECT * FROM tests.all_rows()$$,
    'the operator of every project reads every row'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_relay;
SELECT is_empty(
    $$SELECT * FROM ql3.contract_outbox$$, 'a relay without a grant reads no outbox row itself'
);
SELECT is(
    (SELECT count(DISTINCT o.project_id) FROM ql3.claim_outbox(10000) AS o WHERE o.project_id IN ('tap17-a', 'tap17-b')),
    2::bigint,
    'but claims the outbox rows of every project (claim_outbox runs as the owner)'
);
RESET SESSION AUTHORIZATION;

-- 6. A role that was granted, then dropped ---------------------------------------------------

DROP ROLE tap17_gone;
SELECT ok(
    EXISTS (SELECT 1 FROM ql3.project_grants WHERE role_name = 'tap17_gone'),
    'a role that held a grant is dropped; its grant stays behind'
);
SET SESSION AUTHORIZATION tap17_rt_a;
SELECT is(tests.whoami(), 'tap17_rt_a: visible={tap17-a} a=true b=false', 'the other logins act on their projects');
SELECT lives_ok($$SELECT ql3.create_run('tap17-a', 'trace-4')$$, 'the runtime of A still creates runs in A');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rd_b;
SELECT set_eq(
    $$SELECT * FROM tests.rows_by_project()$$,
    $$SELECT * FROM tests.all_rows() WHERE project_id = 'tap17-b'$$,
    'the reader of B still reads exactly the rows of B'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_a;
SELECT tests.rejects(
    $$SELECT ql3.grant_project('tap17_gone', 'tap17-a')$$, 'Q3V01', 'a dropped role cannot be granted a project again'
);
SELECT is(ql3.revoke_project('tap17_gone', 'tap17-a'), TRUE, 'the operator of A revokes the dropped role''s grant');
RESET SESSION AUTHORIZATION;

-- 7. Resolver identities ---------------------------------------------------------------------
-- The owner maps user_ids to roles; once one mapping exists, a login resolves as itself or
-- as a user_id mapped to a role it is a member of. The resolutions record the login.

GRANT tap17_resolvers TO tap17_op_a;
SET SESSION AUTHORIZATION tap17_op_a;
SELECT tests.rejects(
    $$INSERT INTO ql3_ai.resolver_identities (role_name, user_id) VALUES ('tap17_resolvers', 'alice@a')$$,
    '42501', 'an operator cannot map identities (it could map itself to anyone)'
);
RESET SESSION AUTHORIZATION;
SET ROLE ql3_owner;
INSERT INTO ql3_ai.resolver_identities (role_name, user_id) VALUES ('tap17_resolvers', 'alice@a');
RESET ROLE;
SET SESSION AUTHORIZATION tap17_op_a;
SELECT tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('tap17-a-lost2', 'retry', 'mallory'))$$, '42501',
    'once an identity is mapped, the operator of A cannot resolve as another user_id',
    'QL3_PERMISSION_DENIED: tap17_op_a may not resolve as ''mallory'''
);
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('tap17-a-lost2', 'retry', 'tap17_op_a')) ->> 'status', 'created',
    'it resolves as itself'
);
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('tap17-a-lost3', 'cancel', 'alice@a')) ->> 'status', 'created',
    'and as a user_id mapped to a role it is a member of'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_op_b;
SELECT tests.rejects(
    $$SELECT ql3_ai.resolve_invocation(tests.resolution('tap17-b-lost2', 'retry', 'alice@a'))$$, '42501',
    'the operator of B cannot resolve as a user_id mapped to a role it is not a member of'
);
SELECT is(
    ql3_ai.resolve_invocation(tests.resolution('tap17-b-lost2', 'retry', 'tap17_op_b')) ->> 'status', 'created',
    'it resolves as itself'
);
RESET SESSION AUTHORIZATION;
SELECT is(
    (SELECT array_agg(r.invocation_id || ' ' || r.user_id || ' by ' || r.resolved_by ORDER BY r.invocation_id)
     FROM ql3_ai.model_invocation_resolutions AS r WHERE r.invocation_id LIKE 'tap17-%'),
    ARRAY['tap17-a-lost1 anyone by tap17_op_a', 'tap17-a-lost2 tap17_op_a by tap17_op_a',
          'tap17-a-lost3 alice@a by tap17_op_a', 'tap17-a-res setup by tap17_op_b',
          'tap17-b-lost2 tap17_op_b by tap17_op_b', 'tap17-b-res setup by tap17_op_a'],
    'every resolution records the login that made it beside the user_id it named'
);

-- 8. The last grant --------------------------------------------------------------------------

SET SESSION AUTHORIZATION tap17_op_all;
SELECT is(
    (SELECT bool_and(ql3.revoke_project(g.role_name, g.project_id)) FROM ql3.project_grants AS g
     WHERE g.role_name <> 'tap17_op_all'),
    TRUE,
    'the operator of every project revokes every other grant'
);
SELECT is(ql3.revoke_project('tap17_rt_a', 'tap17-a'), FALSE, 'a grant that does not exist is not revoked');
SELECT tests.rejects(
    $$SELECT ql3.revoke_project('tap17_op_all', NULL)$$, 'Q3C01',
    'the last grant cannot be revoked (that would turn isolation off)'
);
SELECT is(tests.whoami(), 'tap17_op_all: visible=every a=true b=true', 'its holder still acts on every project');
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION tap17_rt_a;
SELECT is(tests.whoami(), 'tap17_rt_a: visible={} a=false b=false', 'and isolation stays on: the runtime of A acts on none');
RESET SESSION AUTHORIZATION;

SELECT * FROM finish();
ROLLBACK;
