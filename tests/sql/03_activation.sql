-- ql3.activate_revision, ql3.revoke_revision, ql3.active_revision, ql3.active_pointers
-- (SPEC 3, 6): pointer swaps with their outbox rows, compare-and-set, revocation, and
-- atomicity (a failure anywhere leaves pointer, revocations and outbox untouched).
BEGIN;
SELECT plan(92);
SET LOCAL client_min_messages = warning;

CREATE SCHEMA IF NOT EXISTS tests;

-- Everything this file writes lives under projects named 'tap03-...'.
CREATE FUNCTION tests.contract_state(p_prefix text) RETURNS text
LANGUAGE sql AS $$
    SELECT format(
        'revisions=%s revocations=%s outbox=%s pointers=[%s]',
        (SELECT count(*) FROM ql3.contract_revisions AS r WHERE starts_with(r.project_id, p_prefix)),
        (SELECT count(*)
         FROM ql3.revision_revocations AS v
         INNER JOIN ql3.contract_revisions AS r ON v.revision_id = r.revision_id
         WHERE starts_with(r.project_id, p_prefix)),
        (SELECT count(*) FROM ql3.contract_outbox AS o WHERE starts_with(o.project_id, p_prefix)),
        (SELECT string_agg(
                    format('%s/%s/%s=%s@%s', a.project_id, a.contract_family, a.contract_id,
                           a.active_revision_id, a.pointer_version),
                    ',' ORDER BY a.project_id, a.contract_family, a.contract_id)
         FROM ql3.active_revisions AS a WHERE starts_with(a.project_id, p_prefix))
    );
$$;

-- Two tests: the statement fails with exactly this SQLSTATE, and nothing was written.
CREATE FUNCTION tests.refused(p_sql text, p_errcode char(5), p_description text)
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    before text := tests.contract_state('tap03-');
BEGIN
    RETURN NEXT throws_ok(p_sql, p_errcode, NULL, p_description);
    RETURN NEXT is(tests.contract_state('tap03-'), before, p_description || ': nothing written');
END;
$$;

CREATE TABLE tests.snapshots (label text PRIMARY KEY, snapshot text NOT NULL);

CREATE FUNCTION tests.snap(p_label text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO tests.snapshots (label, snapshot) VALUES (p_label, tests.contract_state('tap03-'));
$$;

CREATE FUNCTION tests.snapshot(p_label text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT s.snapshot FROM tests.snapshots AS s WHERE s.label = p_label;
$$;

CREATE TABLE tests.revs (name text PRIMARY KEY, revision_id uuid NOT NULL);

CREATE FUNCTION tests.put(p_name text, p_project text, p_family text, p_contract text, p_body jsonb)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO tests.revs (name, revision_id)
    SELECT p_name, r.revision_id FROM ql3.put_revision(p_project, p_family, p_contract, p_body, 'alice') AS r;
$$;

CREATE FUNCTION tests.rev(p_name text) RETURNS uuid
LANGUAGE sql STABLE AS $$
    SELECT r.revision_id FROM tests.revs AS r WHERE r.name = p_name;
$$;

CREATE TABLE tests.events (name text PRIMARY KEY, event ql3.contract_outbox NOT NULL);

CREATE FUNCTION tests.keep(p_name text, p_event ql3.contract_outbox) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO tests.events (name, event) VALUES (p_name, p_event);
$$;

CREATE FUNCTION tests.ev(p_name text) RETURNS ql3.contract_outbox
LANGUAGE sql STABLE AS $$
    SELECT e.event FROM tests.events AS e WHERE e.name = p_name;
$$;

-- The fields of an outbox event that a test states, in a fixed order.
CREATE FUNCTION tests.event_fields(p_name text)
RETURNS TABLE (
    event_type text, project_id text, contract_family text, contract_id text, old_revision_id uuid,
    new_revision_id uuid, pointer_version bigint, delivered_at timestamptz, relay_attempts integer,
    last_error text
)
LANGUAGE sql STABLE AS $$
    SELECT (e.event).event_type, (e.event).project_id, (e.event).contract_family, (e.event).contract_id,
           (e.event).old_revision_id, (e.event).new_revision_id, (e.event).pointer_version,
           (e.event).delivered_at, (e.event).relay_attempts, (e.event).last_error
    FROM tests.events AS e WHERE e.name = p_name;
$$;

CREATE FUNCTION tests.pointer(p_project text, p_contract text)
RETURNS TABLE (active_revision_id uuid, pointer_version bigint, updated_by text)
LANGUAGE sql STABLE AS $$
    SELECT a.active_revision_id, a.pointer_version, a.updated_by
    FROM ql3.active_revisions AS a
    WHERE a.project_id = p_project AND a.contract_family = 'policy_routing' AND a.contract_id = p_contract;
$$;

SELECT tests.put('r1', 'tap03-p', 'policy_routing', 'c1', '{"model": "m1"}');
SELECT tests.put('r2', 'tap03-p', 'policy_routing', 'c1', '{"model": "m2"}');
SELECT tests.put('r3', 'tap03-p', 'policy_routing', 'c1', '{"model": "m3"}');
SELECT tests.put('o1', 'tap03-p', 'policy_routing', 'c2', '{"model": "m1"}');
SELECT tests.put('q1', 'tap03-q', 'policy_routing', 'c1', '{"model": "m1"}');
SELECT tests.put('f1', 'tap03-p', 'channel_event', 'c1', '{"model": "m1"}');

-- Activation -------------------------------------------------------------------------------

SELECT tests.keep('a1', ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r1'), 'alice'));

SELECT row_eq(
    $$SELECT * FROM tests.event_fields('a1')$$,
    row('revision_activated'::text, 'tap03-p'::text, 'policy_routing'::text, 'c1'::text, NULL::uuid,
        tests.rev('r1'), 1::bigint, NULL::timestamptz, 0, NULL::text),
    'the first activation returns a revision_activated row: no old revision, pointer_version 1, undelivered'
);

SELECT is(
    (SELECT o FROM ql3.contract_outbox AS o WHERE o.seq = (tests.ev('a1')).seq),
    tests.ev('a1'),
    'the returned event is the row stored in the outbox'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-p', 'c1')$$,
    row(tests.rev('r1'), 1::bigint, 'alice'::text),
    'the pointer names the activated revision, pointer_version 1, updated_by the actor'
);

SELECT results_eq(
    $$SELECT revision_id, revision_no, body, body_hash, pointer_version
      FROM ql3.active_revision('tap03-p', 'policy_routing', 'c1')$$,
    $$SELECT tests.rev('r1'), 1, '{"model": "m1"}'::jsonb,
             ql3.digest('ql3/contract-body@v1', '{"model": "m1"}'), 1::bigint$$,
    'active_revision returns the active revision with its pointer_version'
);

SELECT tests.keep('a2', ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r2'), 'bob'));

SELECT row_eq(
    $$SELECT * FROM tests.event_fields('a2')$$,
    row('revision_activated'::text, 'tap03-p'::text, 'policy_routing'::text, 'c1'::text, tests.rev('r1'),
        tests.rev('r2'), 2::bigint, NULL::timestamptz, 0, NULL::text),
    'the second activation names the old revision and has pointer_version 2'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-p', 'c1')$$,
    row(tests.rev('r2'), 2::bigint, 'bob'::text),
    'the pointer moved to the second revision, pointer_version 2'
);

SELECT ok(
    (tests.ev('a2')).seq > (tests.ev('a1')).seq AND (tests.ev('a2')).event_id <> (tests.ev('a1')).event_id,
    'each event has a higher seq and its own event_id'
);

-- event_ids are version 7 uuids (D25): Unix milliseconds first, so they are time-ordered.
CREATE FUNCTION tests.uuid_ms(u uuid) RETURNS bigint
LANGUAGE sql AS $$ SELECT ('x' || left(replace(u::text, '-', ''), 12))::bit(48)::bigint $$;

CREATE FUNCTION tests.v7_later_after_sleep() RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    first uuid := ql3._uuid_v7();
BEGIN
    PERFORM pg_sleep(0.002);
    RETURN ql3._uuid_v7() > first;
END;
$$;

SELECT ok(
    substr((tests.ev('a1')).event_id::text, 15, 1) = '7'
    AND substr((tests.ev('a2')).event_id::text, 15, 1) = '7',
    'outbox event_ids are version 7 uuids'
);

SELECT ok(
    tests.uuid_ms((tests.ev('a2')).event_id)
    BETWEEN (extract(EPOCH FROM now()) * 1000)::bigint - 1
    AND (extract(EPOCH FROM clock_timestamp()) * 1000)::bigint + 1,
    'an event_id starts with the Unix milliseconds of its insertion'
);

SELECT is(
    (SELECT count(*) FILTER (WHERE substr(u::text, 15, 1) = '7' AND substr(u::text, 20, 1) IN ('8', '9', 'a', 'b'))
     FROM (SELECT ql3._uuid_v7() AS u FROM generate_series(1, 1000)) AS g),
    1000::bigint,
    'ql3._uuid_v7() gives version 7, variant 10 uuids'
);

SELECT is(
    (SELECT count(DISTINCT u) FROM (SELECT ql3._uuid_v7() AS u FROM generate_series(1, 1000)) AS g),
    1000::bigint,
    '1000 ql3._uuid_v7() values in one millisecond or so are distinct'
);

SELECT ok(tests.v7_later_after_sleep(), 'a uuid_v7 drawn 2 ms later sorts after the earlier one');

SELECT tests.snap('before no-op');

SELECT is_empty(
    $$SELECT * FROM ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r2'), 'carol')$$,
    're-activating the active revision returns no row (not a row of NULLs)'
);

SELECT is_empty(
    $$SELECT * FROM ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r2'), 'carol',
                                          tests.rev('r2'))$$,
    're-activating the active revision with a matching expectation returns no row'
);

SELECT is(
    (SELECT count(*) FROM (
        SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r2'), 'carol')
    ) AS a),
    0::bigint,
    're-activating the active revision called in the select list returns no row either'
);

SELECT is(
    tests.contract_state('tap03-'),
    tests.snapshot('before no-op'),
    're-activating the active revision writes nothing: no event, no pointer_version bump'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-p', 'c1')$$,
    row(tests.rev('r2'), 2::bigint, 'bob'::text),
    'a no-op activation does not even touch updated_by'
);

-- Compare-and-set.

SELECT tests.keep(
    'a3', ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r3'), 'bob', tests.rev('r2'))
);

SELECT row_eq(
    $$SELECT old_revision_id, new_revision_id, pointer_version FROM tests.event_fields('a3')$$,
    row(tests.rev('r2'), tests.rev('r3'), 3::bigint),
    'an activation whose expected active revision matches swaps the pointer'
);

SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r1'), 'bob', tests.rev('r2'))$$,
    'Q3C01', 'an activation whose expected active revision is stale is QL3_CONFLICT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r3'), 'bob', tests.rev('r1'))$$,
    'Q3C01', 'a mismatched expectation is QL3_CONFLICT even when the target is already active'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c2', tests.rev('o1'), 'bob', tests.rev('r1'))$$,
    'Q3C01', 'expecting an active revision where none is active is QL3_CONFLICT'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-p', 'c1')$$,
    row(tests.rev('r3'), 3::bigint, 'bob'::text),
    'after the conflicts the pointer is unchanged'
);

-- Activation refusals.

SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('o1'), 'bob')$$,
    'Q3V01', 'activating a revision of another contract_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('q1'), 'bob')$$,
    'Q3V01', 'activating a revision of another project is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('f1'), 'bob')$$,
    'Q3V01', 'activating a revision of another family is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', gen_random_uuid(), 'bob')$$,
    'Q3N01', 'activating an unknown revision is QL3_NOT_FOUND'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', NULL, 'bob')$$,
    'Q3V01', 'activating a NULL revision_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'no_such_family', 'c1', tests.rev('r1'), 'bob')$$,
    'Q3V01', 'activating under an unknown family is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', '', tests.rev('r1'), 'bob')$$,
    'Q3V01', 'activating with an empty contract_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision(repeat('p', 129), 'policy_routing', 'c1', tests.rev('r1'), 'bob')$$,
    'Q3V03', 'activating with a 129-character project_id is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r1'), '')$$,
    'Q3V01', 'activating with an empty actor is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r1'), repeat('a', 129))$$,
    'Q3V03', 'activating with a 129-character actor is QL3_IDENTIFIER_TOO_LONG'
);

-- Revocation -------------------------------------------------------------------------------

SELECT tests.keep('v3', ql3.revoke_revision(tests.rev('r3'), 'carol', 'bad routing'));

SELECT row_eq(
    $$SELECT * FROM tests.event_fields('v3')$$,
    row('revision_revoked'::text, 'tap03-p'::text, 'policy_routing'::text, 'c1'::text, tests.rev('r3'),
        tests.rev('r3'), 4::bigint, NULL::timestamptz, 0, NULL::text),
    'revoking the active revision emits revision_revoked with new_revision_id = the revoked one, version + 1'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-p', 'c1')$$,
    row(NULL::uuid, 4::bigint, 'carol'::text),
    'revoking the active revision sets the pointer to NULL and bumps pointer_version'
);

SELECT row_eq(
    $$SELECT reason, revoked_by FROM ql3.revision_revocations WHERE revision_id = tests.rev('r3')$$,
    row('bad routing'::text, 'carol'::text),
    'the revocation is recorded with its reason and actor'
);

SELECT is_empty(
    $$SELECT * FROM ql3.active_revision('tap03-p', 'policy_routing', 'c1')$$,
    'active_revision returns no row once the active revision is revoked'
);

SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r3'), 'bob')$$,
    'Q3R01', 'activating a revoked revision is QL3_REVISION_REVOKED'
);

SELECT tests.keep('a4', ql3.activate_revision('tap03-p', 'policy_routing', 'c1', tests.rev('r2'), 'bob'));

SELECT row_eq(
    $$SELECT old_revision_id, new_revision_id, pointer_version FROM tests.event_fields('a4')$$,
    row(NULL::uuid, tests.rev('r2'), 5::bigint),
    'activating after a revocation starts from a NULL pointer and keeps counting versions'
);

SELECT tests.keep('v1', ql3.revoke_revision(tests.rev('r1'), 'carol', 'obsolete'));

SELECT row_eq(
    $$SELECT * FROM tests.event_fields('v1')$$,
    row('revision_revoked'::text, 'tap03-p'::text, 'policy_routing'::text, 'c1'::text, tests.rev('r2'),
        tests.rev('r1'), 5::bigint, NULL::timestamptz, 0, NULL::text),
    'revoking a non-active revision still emits revision_revoked, with the unchanged pointer_version'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-p', 'c1')$$,
    row(tests.rev('r2'), 5::bigint, 'bob'::text),
    'revoking a non-active revision leaves the pointer alone'
);

SELECT tests.snap('before second revoke');

SELECT ok(
    ql3.revoke_revision(tests.rev('r1'), 'dave', 'again') IS NULL,
    'revoking an already revoked revision returns NULL'
);

SELECT is(
    tests.contract_state('tap03-'),
    tests.snapshot('before second revoke'),
    'a second revoke writes nothing'
);

SELECT row_eq(
    $$SELECT reason, revoked_by FROM ql3.revision_revocations WHERE revision_id = tests.rev('r1')$$,
    row('obsolete'::text, 'carol'::text),
    'a second revoke keeps the first reason and actor'
);

SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(gen_random_uuid(), 'carol', 'x')$$,
    'Q3N01', 'revoking an unknown revision is QL3_NOT_FOUND'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(NULL, 'carol', 'x')$$,
    'Q3V01', 'revoking a NULL revision_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(tests.rev('r2'), 'carol', '')$$,
    'Q3V01', 'revoking with an empty reason is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(tests.rev('r2'), 'carol', NULL)$$,
    'Q3V01', 'revoking with a NULL reason is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(tests.rev('r2'), 'carol', repeat('x', 1025))$$,
    'Q3V01', 'revoking with a 1025-character reason is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(tests.rev('r2'), '', 'x')$$,
    'Q3V01', 'revoking with an empty actor is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(tests.rev('r2'), repeat('a', 129), 'x')$$,
    'Q3V03', 'revoking with a 129-character actor is QL3_IDENTIFIER_TOO_LONG'
);

-- Reads ------------------------------------------------------------------------------------

SELECT results_eq(
    $$SELECT revision_id, revision_no, body, body_hash, pointer_version
      FROM ql3.active_revision('tap03-p', 'policy_routing', 'c1')$$,
    $$SELECT tests.rev('r2'), 2, '{"model": "m2"}'::jsonb,
             ql3.digest('ql3/contract-body@v1', '{"model": "m2"}'), 5::bigint$$,
    'active_revision returns the re-activated revision with the current pointer_version'
);

SELECT is_empty(
    $$SELECT * FROM ql3.active_revision('tap03-nobody', 'policy_routing', 'c1')$$,
    'active_revision returns no row for a contract that was never activated'
);

-- Every cache reload calls it: as SQL with a pinned search_path it was never inlined and
-- was planned on every call; PL/pgSQL keeps the plan for the session.
SELECT function_lang_is(
    'ql3', 'active_revision', ARRAY['text', 'text', 'text'], 'plpgsql',
    'active_revision is PL/pgSQL, so its plan is cached per session'
);

SELECT results_eq(
    $$SELECT project_id, contract_family, contract_id, revision_id, pointer_version
      FROM ql3.active_pointers(
          '[["tap03-p", "policy_routing", "c1"], ["tap03-p", "policy_routing", "c2"],
            ["tap03-x", "policy_routing", "nope"], ["tap03-q", "policy_routing", "c1"],
            ["tap03-p", "policy_routing", "c1"]]'
      )$$,
    $$VALUES ('tap03-p', 'policy_routing', 'c1', tests.rev('r2'), 5::bigint),
             ('tap03-p', 'policy_routing', 'c2', NULL::uuid, 0::bigint),
             ('tap03-x', 'policy_routing', 'nope', NULL::uuid, 0::bigint),
             ('tap03-q', 'policy_routing', 'c1', NULL::uuid, 0::bigint),
             ('tap03-p', 'policy_routing', 'c1', tests.rev('r2'), 5::bigint)$$,
    'active_pointers answers every key in order; unknown or never-activated keys give (NULL, 0)'
);

SELECT is_empty(
    $$SELECT * FROM ql3.active_pointers('[]')$$,
    'active_pointers of no keys returns no rows'
);

SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('{"tap03-p": ["policy_routing", "c1"]}')$$,
    'Q3V01', NULL, 'active_pointers of an object is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('"tap03-p"')$$,
    'Q3V01', NULL, 'active_pointers of a string is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers(NULL)$$,
    'Q3V01', NULL, 'active_pointers of NULL is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('["tap03-p", "policy_routing", "c1"]')$$,
    'Q3V01', NULL, 'active_pointers of a flat key (not a list of keys) is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('[["tap03-p", "policy_routing"]]')$$,
    'Q3V01', NULL, 'a key of two elements is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('[["tap03-p", "policy_routing", "c1", "extra"]]')$$,
    'Q3V01', NULL, 'a key of four elements is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('[["tap03-p", "policy_routing", 1]]')$$,
    'Q3V01', NULL, 'a key with a number element is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('[["tap03-p", null, "c1"]]')$$,
    'Q3V01', NULL, 'a key with a null element is QL3_INVALID_ARGUMENT'
);
SELECT throws_ok(
    $$SELECT * FROM ql3.active_pointers('[["tap03-p", "policy_routing", "c1"], "c2"]')$$,
    'Q3V01', NULL, 'one malformed key among good ones is QL3_INVALID_ARGUMENT'
);

-- Atomicity: a failure after the pointer was updated undoes the pointer too -----------------

SELECT tests.put('ff1', 'tap03-fail', 'policy_routing', 'c1', '{"model": "m1"}');
SELECT tests.put('ff2', 'tap03-fail', 'policy_routing', 'c1', '{"model": "m2"}');
SELECT tests.keep('fa1', ql3.activate_revision('tap03-fail', 'policy_routing', 'c1', tests.rev('ff1'), 'alice'));

-- From here on every outbox insert for 'tap03-fail' fails, i.e. after the pointer UPDATE.
CREATE FUNCTION tests.fail_outbox_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'QT001', MESSAGE = 'injected outbox failure';
END;
$$;
CREATE TRIGGER tap03_fail_outbox BEFORE INSERT ON ql3.contract_outbox
FOR EACH ROW WHEN (new.project_id = 'tap03-fail') EXECUTE FUNCTION tests.fail_outbox_insert();

SELECT * FROM tests.refused(
    $$SELECT ql3.activate_revision('tap03-fail', 'policy_routing', 'c1', tests.rev('ff2'), 'bob')$$,
    'QT001', 'an activation whose outbox insert fails'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-fail', 'c1')$$,
    row(tests.rev('ff1'), 1::bigint, 'alice'::text),
    'after a failed activation the pointer still names the old revision at the old version'
);

SELECT * FROM tests.refused(
    $$SELECT ql3.revoke_revision(tests.rev('ff1'), 'bob', 'x')$$,
    'QT001', 'a revocation whose outbox insert fails'
);

SELECT is_empty(
    $$SELECT * FROM ql3.revision_revocations WHERE revision_id = tests.rev('ff1')$$,
    'after a failed revocation the revision is not revoked'
);

SELECT row_eq(
    $$SELECT * FROM tests.pointer('tap03-fail', 'c1')$$,
    row(tests.rev('ff1'), 1::bigint, 'alice'::text),
    'after a failed revocation the pointer still names the revision'
);

SELECT * FROM finish();
ROLLBACK;
