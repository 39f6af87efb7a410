-- One trust boundary (D46), read from the catalogue for both schemas at once: the exact
-- lists of tables, sequences, functions and SECURITY DEFINER functions, and exactly who
-- holds what on each. Every check is a query over every object of ql3 and ql3_ai, so a new
-- table, sequence, function or grant without an expectation here fails; 06_privileges.sql
-- and 15_ai_privileges.sql check the same matrices object by object, with behaviour.
BEGIN;
SELECT plan(25);

-- Roles ------------------------------------------------------------------------------------

SELECT is_empty(
    $$SELECT r.rolname FROM pg_roles AS r
      WHERE r.rolname IN ('ql3_owner', 'ql3_runtime', 'ql3_relay', 'ql3_operator', 'ql3_reader')
        AND (r.rolsuper OR r.rolcreaterole OR r.rolcreatedb OR r.rolreplication OR r.rolbypassrls
             OR r.rolcanlogin)$$,
    'the five ql3 roles are NOLOGIN, not superuser, and cannot create roles or databases or bypass RLS'
);
SELECT is_empty(
    $$SELECT m.member::regrole::text || ' in ' || m.roleid::regrole::text FROM pg_auth_members AS m
      WHERE m.roleid IN (SELECT r.oid FROM pg_roles AS r
                         WHERE r.rolname IN ('ql3_owner', 'ql3_runtime', 'ql3_relay', 'ql3_operator', 'ql3_reader'))
        AND m.member IN (SELECT r.oid FROM pg_roles AS r
                         WHERE r.rolname IN ('ql3_owner', 'ql3_runtime', 'ql3_relay', 'ql3_operator', 'ql3_reader'))$$,
    'no ql3 role is a member of another (none may SET ROLE ql3_owner, nor inherit another job)'
);

-- Schemas ----------------------------------------------------------------------------------

SELECT set_eq(
    $$SELECT n.nspname::text, coalesce(r.rolname::text, 'public'), a.privilege_type::text
      FROM pg_namespace AS n
      CROSS JOIN LATERAL aclexplode(n.nspacl) AS a
      LEFT JOIN pg_roles AS r ON r.oid = a.grantee
      WHERE n.nspname IN ('ql3', 'ql3_ai') AND a.grantee <> n.nspowner$$,
    $$SELECT s.nspname, g.role, 'USAGE'
      FROM (VALUES ('ql3'), ('ql3_ai')) AS s (nspname)
      CROSS JOIN (VALUES ('ql3_runtime'), ('ql3_relay'), ('ql3_operator'), ('ql3_reader')) AS g (role)$$,
    'on schemas ql3 and ql3_ai the four roles hold USAGE and nothing else (no CREATE), PUBLIC nothing'
);

-- Tables -----------------------------------------------------------------------------------

CREATE TEMP TABLE expected_tables (schema_name, table_name, runtime, relay, operator, reader) AS
VALUES
    ('ql3', 'schema_history', TRUE, TRUE, TRUE, TRUE),
    ('ql3', 'contract_families', TRUE, FALSE, TRUE, TRUE),
    ('ql3', 'contract_revisions', TRUE, FALSE, TRUE, TRUE),
    ('ql3', 'revision_revocations', TRUE, FALSE, TRUE, TRUE),
    ('ql3', 'active_revisions', TRUE, FALSE, TRUE, TRUE),
    ('ql3', 'contract_outbox', FALSE, TRUE, TRUE, TRUE),
    ('ql3', 'project_grants', FALSE, FALSE, TRUE, FALSE),
    ('ql3', 'runs', TRUE, FALSE, TRUE, TRUE),
    ('ql3', 'step_runs', TRUE, FALSE, TRUE, TRUE),
    ('ql3', 'run_events', TRUE, FALSE, TRUE, TRUE),
    ('ql3', 'step_run_mutations', TRUE, FALSE, TRUE, TRUE),
    ('ql3_ai', 'feature_history', TRUE, TRUE, TRUE, TRUE),
    ('ql3_ai', 'model_invocation_starts', TRUE, FALSE, TRUE, TRUE),
    ('ql3_ai', 'model_invocation_completions', TRUE, FALSE, TRUE, TRUE),
    ('ql3_ai', 'model_invocation_resolutions', TRUE, FALSE, TRUE, TRUE),
    ('ql3_ai', 'usage_ledger', TRUE, FALSE, TRUE, TRUE),
    ('ql3_ai', 'resolver_identities', FALSE, FALSE, TRUE, FALSE);

SELECT set_eq(
    $$SELECT c.relnamespace::regnamespace::text, c.relname::text FROM pg_class AS c
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relkind IN ('r', 'p', 'v', 'm', 'f')$$,
    $$SELECT e.schema_name, e.table_name FROM expected_tables AS e$$,
    'ql3 and ql3_ai hold exactly the expected tables (a new one needs an expectation here)'
);

SELECT set_eq(
    $$SELECT c.relnamespace::regnamespace::text, c.relname::text, coalesce(r.rolname::text, 'public'),
             a.privilege_type::text
      FROM pg_class AS c
      CROSS JOIN LATERAL aclexplode(c.relacl) AS a
      LEFT JOIN pg_roles AS r ON r.oid = a.grantee
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
        AND a.grantee <> c.relowner$$,
    $$SELECT e.schema_name, e.table_name, g.role, 'SELECT'
      FROM expected_tables AS e
      CROSS JOIN LATERAL (VALUES
          ('ql3_runtime', e.runtime), ('ql3_relay', e.relay), ('ql3_operator', e.operator), ('ql3_reader', e.reader)
      ) AS g (role, granted)
      WHERE g.granted$$,
    'every role (and PUBLIC) holds exactly the expected table privileges on every table: SELECT or nothing'
);

SELECT is_empty(
    $$SELECT c.oid::regclass::text || '.' || t.attname::text
      FROM pg_class AS c
      INNER JOIN pg_attribute AS t ON t.attrelid = c.oid
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND t.attacl IS NOT NULL$$,
    'no column of any table in ql3 or ql3_ai carries a column-level grant'
);

SELECT is_empty(
    $$SELECT c.oid::regclass::text || ': ' || a.grantee::regrole::text || ' ' || a.privilege_type
      FROM pg_class AS c
      CROSS JOIN LATERAL aclexplode(c.relacl) AS a
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace)
        AND a.grantee <> c.relowner
        AND a.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES', 'TRIGGER')
      UNION ALL
      SELECT c.oid::regclass::text || '.' || t.attname::text || ': ' || a.grantee::regrole::text || ' '
             || a.privilege_type
      FROM pg_class AS c
      INNER JOIN pg_attribute AS t ON t.attrelid = c.oid
      CROSS JOIN LATERAL aclexplode(t.attacl) AS a
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace)
        AND a.privilege_type IN ('INSERT', 'UPDATE', 'REFERENCES')$$,
    'no role but the owner holds INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES or TRIGGER on any relation (aclexplode)'
);

SELECT is_empty(
    $$SELECT p.table_schema || '.' || p.table_name || ': ' || p.grantee || ' ' || p.privilege_type
      FROM information_schema.table_privileges AS p
      WHERE p.table_schema IN ('ql3', 'ql3_ai') AND p.grantee <> 'ql3_owner'
        AND p.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES', 'TRIGGER')
      UNION ALL
      SELECT p.table_schema || '.' || p.table_name || '.' || p.column_name || ': ' || p.grantee || ' '
             || p.privilege_type
      FROM information_schema.column_privileges AS p
      WHERE p.table_schema IN ('ql3', 'ql3_ai') AND p.grantee <> 'ql3_owner'
        AND p.privilege_type IN ('INSERT', 'UPDATE', 'REFERENCES')$$,
    'information_schema agrees: no write, REFERENCES or TRIGGER privilege for any role but the owner'
);

-- Sequences --------------------------------------------------------------------------------

SELECT set_eq(
    $$SELECT c.oid::regclass::text FROM pg_class AS c
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relkind = 'S'$$,
    ARRAY['ql3.contract_outbox_seq_seq', 'ql3.project_grants_used'],
    'ql3 and ql3_ai hold exactly two sequences, the outbox''s and the isolation hint (D47)'
);
SELECT is_empty(
    $$SELECT c.oid::regclass::text || ': ' || a.grantee::regrole::text || ' ' || a.privilege_type
      FROM pg_class AS c
      CROSS JOIN LATERAL aclexplode(c.relacl) AS a
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relkind = 'S'
        AND a.grantee <> c.relowner$$,
    'no role but the owner (and not PUBLIC) holds any privilege on any sequence of ql3 or ql3_ai'
);
SELECT is_empty(
    $$SELECT s.sequence_schema || '.' || s.sequence_name || ': ' || g.role || ' ' || g.priv
      FROM information_schema.sequences AS s
      CROSS JOIN (VALUES ('ql3_runtime'), ('ql3_relay'), ('ql3_operator'), ('ql3_reader')) AS g0 (role)
      CROSS JOIN LATERAL (VALUES (g0.role, 'USAGE'), (g0.role, 'SELECT'), (g0.role, 'UPDATE')) AS g (role, priv)
      WHERE s.sequence_schema IN ('ql3', 'ql3_ai')
        AND has_sequence_privilege(g.role, format('%I.%I', s.sequence_schema, s.sequence_name), g.priv)$$,
    'has_sequence_privilege agrees: no ql3 role may use, read or advance any sequence'
);

-- Functions --------------------------------------------------------------------------------
-- Every function of both schemas with the roles that may execute it. `_` functions
-- (helpers and trigger functions): nobody but the owner.

CREATE TEMP TABLE expected_functions (signature, grantees, definer) AS
VALUES
    ('ql3.jcs(jsonb)', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}'::text [], TRUE),
    ('ql3.digest(text,jsonb)', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', TRUE),
    ('ql3.parse_json(text)', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', TRUE),
    ('ql3.mutation_id(text,text)', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', TRUE),
    ('ql3.event_id(text,text)', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', TRUE),
    ('ql3.dedupe_key(text,text)', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', TRUE),
    ('ql3.put_revision(text,text,text,jsonb,text)', '{ql3_operator}', TRUE),
    ('ql3.activate_revision(text,text,text,uuid,text,uuid)', '{ql3_operator}', TRUE),
    ('ql3.revoke_revision(uuid,text,text)', '{ql3_operator}', TRUE),
    ('ql3.active_revision(text,text,text)', '{ql3_runtime,ql3_operator,ql3_reader}', FALSE),
    ('ql3.active_pointers(jsonb)', '{ql3_runtime,ql3_operator,ql3_reader}', FALSE),
    ('ql3.claim_outbox(integer)', '{ql3_relay}', TRUE),
    ('ql3.mark_outbox_delivered(bigint[])', '{ql3_relay}', TRUE),
    ('ql3.mark_outbox_failed(bigint[],text)', '{ql3_relay}', TRUE),
    ('ql3.outbox_backlog()', '{ql3_relay,ql3_operator,ql3_reader}', TRUE),  -- counts every project (D47)
    ('ql3.wake_relays()', '{ql3_operator}', FALSE),
    ('ql3.prune_outbox(interval,integer)', '{ql3_operator}', TRUE),  -- outbox retention (D55)
    ('ql3.failover_epoch()', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', FALSE),  -- D48
    ('ql3.create_run(text,text,uuid)', '{ql3_runtime}', TRUE),
    ('ql3.add_step_run(uuid,text,uuid)', '{ql3_runtime}', TRUE),
    ('ql3.may_act_on(text)', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', TRUE),
    ('ql3.visible_projects()', '{ql3_runtime,ql3_relay,ql3_operator,ql3_reader}', TRUE),
    ('ql3.grant_project(name,text)', '{ql3_operator}', TRUE),
    ('ql3.revoke_project(name,text)', '{ql3_operator}', TRUE),
    ('ql3._may_act(text)', '{}', FALSE),
    ('ql3._refuse_project(text,text)', '{}', FALSE),
    ('ql3._session_is_member(name)', '{}', FALSE),
    ('ql3._refuse_too_large(text,jsonb)', '{}', FALSE),
    ('ql3._jcs_sort_key(text)', '{}', FALSE),
    ('ql3._jcs_number(text)', '{}', FALSE),
    ('ql3._jcs_value(jsonb,integer)', '{}', FALSE),
    ('ql3._framed_digest(text,text)', '{}', FALSE),
    ('ql3._identity(text,text,text,text)', '{}', FALSE),
    ('ql3._uuid_v7()', '{}', FALSE),
    ('ql3._reject_mutation()', '{}', FALSE),
    ('ql3._guard_outbox()', '{}', FALSE),
    ('ql3._notify_outbox()', '{}', FALSE),
    ('ql3._check_identifier(text,text)', '{}', FALSE),
    ('ql3._check_family(text)', '{}', FALSE),
    ('ql3._lock_pointer(text,text,text,text)', '{}', FALSE),
    ('ql3._revision_of(uuid)', '{}', FALSE),
    ('ql3._refuse_step_transition()', '{}', FALSE),
    ('ql3._step_state_valid(text,text,text,text)', '{}', FALSE),  -- CHECK and WHEN helpers (D67)
    ('ql3._step_transition_refused(text,text)', '{}', FALSE),
    ('ql3._now()', '{}', FALSE),
    ('ql3_ai.admit_invocation(jsonb)', '{ql3_runtime}', TRUE),
    ('ql3_ai.admit_in_new_run(jsonb)', '{ql3_runtime}', TRUE),
    ('ql3_ai.complete_invocation(jsonb)', '{ql3_runtime}', TRUE),
    ('ql3_ai.resolve_invocation(jsonb)', '{ql3_operator}', TRUE),
    ('ql3_ai.recover_expired(integer,interval)', '{ql3_operator}', TRUE),
    ('ql3_ai.usage_summary(text,timestamp with time zone,timestamp with time zone)',
     '{ql3_runtime,ql3_operator,ql3_reader}', FALSE),
    ('ql3_ai._require_resolution()', '{}', FALSE),
    ('ql3_ai._check_shape(text,jsonb,text,text[],text[])', '{}', FALSE),
    ('ql3_ai._checked_digest(text,text,jsonb)', '{}', FALSE),
    ('ql3_ai._uuid(text,text)', '{}', FALSE),
    ('ql3_ai._check_sha256(text,text)', '{}', FALSE),
    ('ql3_ai._timestamp(text,text)', '{}', FALSE),
    ('ql3_ai._utc(timestamp with time zone)', '{}', FALSE),
    ('ql3_ai._identities(text,text)', '{}', FALSE),
    ('ql3_ai._verify_receipt(text,text,jsonb,text)', '{}', FALSE),
    ('ql3_ai._identity_taken(text,text,text)', '{}', FALSE),
    ('ql3_ai._write_completion(ql3_ai.model_invocation_starts,bigint,jsonb,text,boolean)', '{}', FALSE),
    ('ql3_ai._admit(jsonb,boolean)', '{}', FALSE),
    ('ql3_ai._completion_valid(text,text,boolean)', '{}', FALSE);

SELECT set_eq(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace)$$,
    $$SELECT f.signature FROM expected_functions AS f$$,
    'ql3 and ql3_ai hold exactly the expected functions (a new one needs an expectation here)'
);

SELECT set_eq(
    $$SELECT p.oid::regprocedure::text, coalesce(r.rolname::text, 'public'), a.privilege_type::text
      FROM pg_proc AS p
      CROSS JOIN LATERAL aclexplode(p.proacl) AS a
      LEFT JOIN pg_roles AS r ON r.oid = a.grantee
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND a.grantee <> p.proowner$$,
    $$SELECT f.signature, g.role, 'EXECUTE' FROM expected_functions AS f CROSS JOIN LATERAL unnest(f.grantees) AS g (role)$$,
    'every function of ql3 and ql3_ai may be executed by exactly the expected roles'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace)
        AND (p.proacl IS NULL  -- NULL means the default: EXECUTE for PUBLIC
             OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) AS a WHERE a.grantee = 0))$$,
    'PUBLIC may execute no function of ql3 or ql3_ai'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text || ': ' || a.grantee::regrole::text FROM pg_proc AS p
      CROSS JOIN LATERAL aclexplode(p.proacl) AS a
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND starts_with(p.proname, '_')
        AND a.grantee <> p.proowner$$,
    'no role but the owner may execute any `_` function of ql3 or ql3_ai'
);

SELECT set_eq(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND p.prosecdef$$,
    $$SELECT f.signature FROM expected_functions AS f WHERE f.definer$$,
    'exactly the functions that write, the canonical and identity functions, the project functions and the '
    'backlog are SECURITY DEFINER'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND p.prosecdef
        AND NOT coalesce(
            (SELECT bool_and(c LIKE '%, pg_temp') AND count(*) = 1
             FROM unnest(p.proconfig) AS c WHERE starts_with(c, 'search_path=')),
            FALSE)$$,
    'every SECURITY DEFINER function pins a search_path that ends in pg_temp'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND p.prosecdef
        AND NOT coalesce('search_path=pg_catalog, ql3, pg_temp' = ANY(p.proconfig), FALSE)$$,
    'and that search_path is exactly pg_catalog, ql3, pg_temp (no schema any other role may create in)'
);

SELECT is_empty(
    $$SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND p.prosecdef
        AND p.prokind <> 'f'$$,
    'every SECURITY DEFINER object is a plain function (no procedure that could COMMIT mid-way)'
);

-- Row-level security (D47) ------------------------------------------------------------------
-- Exactly the tables that hold a project's rows, or hang off one, have row-level security;
-- none has it forced (the owner, whose functions write and check, reads every row); each has
-- exactly one policy, project_rows: permissive, FOR SELECT, for every role.

CREATE TEMP TABLE expected_rls (schema_name, table_name) AS
VALUES
    ('ql3', 'contract_revisions'),
    ('ql3', 'revision_revocations'),
    ('ql3', 'active_revisions'),
    ('ql3', 'contract_outbox'),
    ('ql3', 'runs'),
    ('ql3', 'step_runs'),
    ('ql3', 'run_events'),
    ('ql3', 'step_run_mutations'),
    ('ql3_ai', 'model_invocation_starts'),
    ('ql3_ai', 'model_invocation_completions'),
    ('ql3_ai', 'model_invocation_resolutions'),
    ('ql3_ai', 'usage_ledger');

SELECT set_eq(
    $$SELECT c.relnamespace::regnamespace::text, c.relname::text FROM pg_class AS c
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relrowsecurity$$,
    $$SELECT e.schema_name, e.table_name FROM expected_rls AS e$$,
    'exactly the twelve project tables of ql3 and ql3_ai have row-level security'
);

SELECT is_empty(
    $$SELECT c.oid::regclass::text FROM pg_class AS c
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relforcerowsecurity$$,
    'no table of ql3 or ql3_ai forces row-level security on its owner'
);

SELECT set_eq(
    $$SELECT c.relnamespace::regnamespace::text, c.relname::text, p.polname::text, p.polcmd::text, p.polpermissive,
             p.polroles::text
      FROM pg_policy AS p
      INNER JOIN pg_class AS c ON c.oid = p.polrelid
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace)$$,
    $$SELECT e.schema_name, e.table_name, 'project_rows' AS polname, 'r' AS polcmd, TRUE AS polpermissive,
             '{0}' AS polroles
      FROM expected_rls AS e$$,
    'each of them has exactly one policy, project_rows: permissive, FOR SELECT, for every role (PUBLIC)'
);

-- Ownership and default privileges ----------------------------------------------------------

SELECT is_empty(
    $$SELECT n.nspname::text FROM pg_namespace AS n
      WHERE n.nspname IN ('ql3', 'ql3_ai') AND n.nspowner <> 'ql3_owner'::regrole
      UNION ALL
      SELECT c.oid::regclass::text FROM pg_class AS c
      WHERE c.relnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND c.relowner <> 'ql3_owner'::regrole
      UNION ALL
      SELECT p.oid::regprocedure::text FROM pg_proc AS p
      WHERE p.pronamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND p.proowner <> 'ql3_owner'::regrole
      UNION ALL
      SELECT t.oid::regtype::text FROM pg_type AS t
      WHERE t.typnamespace IN ('ql3'::regnamespace, 'ql3_ai'::regnamespace) AND t.typowner <> 'ql3_owner'::regrole$$,
    'ql3_owner owns both schemas and every table, index, sequence, type and function in them'
);

SELECT is_empty(
    $$SELECT d.defaclrole::regrole::text || ' ' || d.defaclobjtype::text || ': ' || a.grantee::regrole::text
      FROM pg_default_acl AS d
      CROSS JOIN LATERAL aclexplode(d.defaclacl) AS a
      WHERE d.defaclrole = 'ql3_owner'::regrole AND a.grantee <> d.defaclrole$$,
    'ql3_owner''s default privileges grant nothing to any other role (nor PUBLIC)'
);

SELECT ok(
    EXISTS (SELECT 1 FROM pg_default_acl AS d
            WHERE d.defaclrole = 'ql3_owner'::regrole AND d.defaclnamespace = 0 AND d.defaclobjtype = 'f'),
    'ql3_owner''s future functions are not executable by PUBLIC by default (ALTER DEFAULT PRIVILEGES)'
);

SELECT * FROM finish();
ROLLBACK;
