-- Immutable tables (SPEC 3): contract_revisions and revision_revocations refuse UPDATE,
-- DELETE and TRUNCATE by trigger, for every role including their owner ql3_owner.
BEGIN;
SELECT plan(25);
SET LOCAL client_min_messages = warning;

CREATE SCHEMA IF NOT EXISTS tests;

CREATE TABLE tests.revs (name text PRIMARY KEY, revision_id uuid NOT NULL);

CREATE FUNCTION tests.rev(p_name text) RETURNS uuid
LANGUAGE sql STABLE AS $$
    SELECT r.revision_id FROM tests.revs AS r WHERE r.name = p_name;
$$;

INSERT INTO tests.revs (name, revision_id)
SELECT
    'r1' AS name,
    r.revision_id
FROM ql3.put_revision('tap05-p', 'policy_routing', 'c1', '{"model": "m1"}', 'alice') AS r;

SELECT ql3.revoke_revision(tests.rev('r1'), 'alice', 'retired');

CREATE TABLE tests.revisions_before AS
SELECT * FROM ql3.contract_revisions WHERE project_id = 'tap05-p';
CREATE TABLE tests.revocations_before AS
SELECT * FROM ql3.revision_revocations WHERE revision_id = tests.rev('r1');

SELECT is(
    (SELECT tableowner::text FROM pg_tables WHERE schemaname = 'ql3' AND tablename = 'contract_revisions'),
    'ql3_owner',
    'fixture: ql3_owner owns ql3.contract_revisions'
);

SELECT is(
    (SELECT tableowner::text FROM pg_tables WHERE schemaname = 'ql3' AND tablename = 'revision_revocations'),
    'ql3_owner',
    'fixture: ql3_owner owns ql3.revision_revocations'
);

-- As the superuser running the tests ------------------------------------------------------

SELECT throws_ok(
    $$UPDATE ql3.contract_revisions SET body = '{"model": "evil"}' WHERE project_id = 'tap05-p'$$,
    'Q3S01', NULL, 'UPDATE of a revision body is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$UPDATE ql3.contract_revisions SET created_by = created_by WHERE project_id = 'tap05-p'$$,
    'Q3S01', NULL, 'even an UPDATE that changes nothing is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$DELETE FROM ql3.contract_revisions WHERE project_id = 'tap05-p'$$,
    'Q3S01', NULL, 'DELETE of a revision is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    'TRUNCATE ql3.contract_revisions CASCADE',
    'Q3S01', NULL, 'TRUNCATE of the revisions (CASCADE past the foreign keys) is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    'TRUNCATE ql3.contract_revisions',
    '0A000', NULL, 'a plain TRUNCATE of the revisions is refused by the foreign keys before the trigger even runs'
);
SELECT throws_ok(
    $$UPDATE ql3.revision_revocations SET reason = 'never happened'
      WHERE revision_id = tests.rev('r1')$$,
    'Q3S01', NULL, 'UPDATE of a revocation is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$DELETE FROM ql3.revision_revocations WHERE revision_id = tests.rev('r1')$$,
    'Q3S01', NULL, 'DELETE of a revocation (un-revoking) is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    'TRUNCATE ql3.revision_revocations',
    'Q3S01', NULL, 'TRUNCATE of the revocations is QL3_ILLEGAL_TRANSITION'
);

-- As the owner ----------------------------------------------------------------------------

GRANT USAGE ON SCHEMA tests TO ql3_owner;
GRANT SELECT ON tests.revs TO ql3_owner;
GRANT EXECUTE ON FUNCTION tests.rev(text) TO ql3_owner;
SET LOCAL ROLE ql3_owner;

SELECT is(current_user::text, 'ql3_owner', 'the following statements run as ql3_owner');

SELECT throws_ok(
    $$UPDATE ql3.contract_revisions SET body = '{"model": "evil"}' WHERE project_id = 'tap05-p'$$,
    'Q3S01', NULL, 'as the owner: UPDATE of a revision is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$UPDATE ql3.contract_revisions SET created_by = created_by WHERE project_id = 'tap05-p'$$,
    'Q3S01', NULL, 'as the owner: even an UPDATE that changes nothing is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$DELETE FROM ql3.contract_revisions WHERE project_id = 'tap05-p'$$,
    'Q3S01', NULL, 'as the owner: DELETE of a revision is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    'TRUNCATE ql3.contract_revisions CASCADE',
    'Q3S01', NULL, 'as the owner: TRUNCATE ... CASCADE of the revisions is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    'TRUNCATE ql3.contract_revisions',
    '0A000', NULL, 'as the owner: a plain TRUNCATE of the revisions is refused by the foreign keys'
);
SELECT throws_ok(
    $$UPDATE ql3.revision_revocations SET reason = 'never happened'
      WHERE revision_id = tests.rev('r1')$$,
    'Q3S01', NULL, 'as the owner: UPDATE of a revocation is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$DELETE FROM ql3.revision_revocations WHERE revision_id = tests.rev('r1')$$,
    'Q3S01', NULL, 'as the owner: DELETE of a revocation is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    'TRUNCATE ql3.revision_revocations',
    'Q3S01', NULL, 'as the owner: TRUNCATE of the revocations is QL3_ILLEGAL_TRANSITION'
);

RESET ROLE;

-- Inserting stays possible: the tables are append-only, not read-only.

SELECT lives_ok(
    $$INSERT INTO ql3.contract_revisions
          (project_id, contract_family, contract_id, revision_no, body, body_hash, created_by)
      VALUES ('tap05-p', 'policy_routing', 'c1', 2, '{"model": "m2"}',
              ql3.digest('ql3/contract-body@v1', '{"model": "m2"}'), 'alice')$$,
    'INSERT into contract_revisions is still allowed'
);

-- Nothing changed -------------------------------------------------------------------------

SELECT set_eq(
    $$SELECT * FROM ql3.contract_revisions WHERE project_id = 'tap05-p' AND revision_no = 1$$,
    $$SELECT * FROM tests.revisions_before$$,
    'the revision is exactly as it was written'
);

SELECT set_eq(
    $$SELECT * FROM ql3.revision_revocations WHERE revision_id = tests.rev('r1')$$,
    $$SELECT * FROM tests.revocations_before$$,
    'the revocation is exactly as it was written'
);

SELECT is(
    (SELECT count(*) FROM ql3.contract_revisions WHERE project_id = 'tap05-p'),
    2::bigint,
    'both revisions are still there'
);

SELECT has_trigger(
    'ql3', 'contract_revisions', 'contract_revisions_no_truncate', 'contract_revisions has its TRUNCATE trigger'
);

SELECT has_trigger(
    'ql3', 'revision_revocations', 'revision_revocations_no_truncate', 'revision_revocations has its TRUNCATE trigger'
);

SELECT * FROM finish();
ROLLBACK;
