-- Outbox retention (D55): ql3.prune_outbox removes delivered rows older than the cut-off,
-- oldest seq first and at most a batch at a time, keeps each pointer's newest row and every
-- undelivered row, refuses bad input before it writes anything, and is executable by
-- ql3_operator (and the owner) only. A direct DELETE stays refused to every login.
-- 18b_prune_claims.sql runs it beside a relay's open claim and another prune (dblink).
--
-- Rows of other files may be delivered in this database: this file's rows are marked
-- delivered in 2000, and the cut-off is just after that, so only they can qualify.
BEGIN;
SELECT plan(28);
SET LOCAL client_min_messages = warning;

CREATE SCHEMA IF NOT EXISTS tests;

-- Put and activate a revision of contract p_contract; returns the outbox seq.
CREATE FUNCTION tests.activate18(p_contract text, p_n integer) RETURNS bigint
LANGUAGE sql AS $$
    SELECT (ql3.activate_revision('tap18', 'policy_routing', p_contract, r.revision_id, 'tap18')).seq
    FROM ql3.put_revision('tap18', 'policy_routing', p_contract, jsonb_build_object('n', p_n), 'tap18') AS r;
$$;

CREATE TABLE tests.rows18 (name text PRIMARY KEY, seq bigint NOT NULL);
INSERT INTO tests.rows18 (name, seq) VALUES
('a1', tests.activate18('a', 1)),
('a2', tests.activate18('a', 2)),
('a3', tests.activate18('a', 3)),
('b1', tests.activate18('b', 1)),
('c1', tests.activate18('c', 1)),
('c2', tests.activate18('c', 2));

CREATE FUNCTION tests.seq18(p_name text) RETURNS bigint
LANGUAGE sql STABLE AS $$ SELECT r.seq FROM tests.rows18 AS r WHERE r.name = p_name $$;

CREATE FUNCTION tests.left18() RETURNS text []
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(r.name ORDER BY r.name), '{}')
    FROM tests.rows18 AS r JOIN ql3.contract_outbox AS o ON o.seq = r.seq;
$$;

-- Only this file's rows qualify: delivered in 2000, cut-off 2000-01-02.
CREATE FUNCTION tests.cutoff18() RETURNS interval
LANGUAGE sql STABLE AS $$ SELECT now() - timestamptz '2000-01-02 00:00:00+00' $$;

-- a and b delivered (long ago); c's rows stay undelivered, the older one below its pointer.
SELECT ql3.mark_outbox_delivered(ARRAY[tests.seq18('a1'), tests.seq18('a2'), tests.seq18('a3'), tests.seq18('b1')]);
UPDATE ql3.contract_outbox SET delivered_at = timestamptz '2000-01-01 00:00:00+00'
WHERE seq IN (tests.seq18('a1'), tests.seq18('a2'), tests.seq18('a3'), tests.seq18('b1'));

-- Refused input writes nothing ----------------------------------------------------------------

SELECT throws_ok($$SELECT ql3.prune_outbox(NULL, 10)$$, 'Q3V01', NULL, 'a NULL interval is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT ql3.prune_outbox('-1 second', 10)$$, 'Q3V01', NULL,
                 'a negative interval is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT ql3.prune_outbox(tests.cutoff18(), 0)$$, 'Q3V01', NULL, 'a batch of 0 is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT ql3.prune_outbox(tests.cutoff18(), -1)$$, 'Q3V01', NULL,
                 'a negative batch is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT ql3.prune_outbox(tests.cutoff18(), 100001)$$, 'Q3V01', NULL,
                 'a batch above 100000 is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT ql3.prune_outbox(tests.cutoff18(), NULL)$$, 'Q3V01', NULL,
                 'a NULL batch is QL3_INVALID_ARGUMENT');
SELECT is(tests.left18(), '{a1,a2,a3,b1,c1,c2}', 'refused calls removed nothing');

-- Batches, order, what is kept ----------------------------------------------------------------

SELECT is(ql3.prune_outbox('1000 years', 100000), 0, 'nothing was delivered more than 1000 years ago');
SELECT is(ql3.prune_outbox('1000000 years', 100000), 0,
          'a cut-off before any representable instant removes nothing (not 22008, D65)');
SELECT is(ql3.prune_outbox('2000000000 days', 100000), 0, 'the same with an interval of days');
SELECT is(tests.left18(), '{a1,a2,a3,b1,c1,c2}', 'far cut-offs removed nothing');
SELECT is(ql3.prune_outbox(tests.cutoff18(), 1), 1, 'a batch of 1 removes one row');
SELECT is(tests.left18(), '{a2,a3,b1,c1,c2}', 'the oldest seq went first');
SELECT is(ql3.prune_outbox(tests.cutoff18(), 100000), 1, 'the next batch removes the one row left to remove');
SELECT is(tests.left18(), '{a3,b1,c1,c2}',
          'each pointer keeps its newest row (a3, b1), and undelivered rows stay (c1 below its pointer, c2)');
SELECT is(ql3.prune_outbox(tests.cutoff18(), 100000), 0, 'a further prune removes nothing');
SELECT is(
    (SELECT o.pointer_version FROM ql3.contract_outbox AS o WHERE o.seq = tests.seq18('a3')),
    (SELECT a.pointer_version FROM ql3.active_revisions AS a
     WHERE (a.project_id, a.contract_family, a.contract_id) = ('tap18', 'policy_routing', 'a')),
    'the pointer still equals its last outbox row (the invariant ql3 verify checks)'
);
SELECT is(ql3.prune_outbox('0 seconds', 100000) >= 0, TRUE, 'an interval of zero is accepted');
SELECT is(tests.left18(), '{a3,b1,c1,c2}', 'even with no retention the newest and the undelivered rows stay');

-- Who may call it, and who may delete ------------------------------------------------------------

SET LOCAL ROLE ql3_operator;
SELECT lives_ok($$SELECT ql3.prune_outbox('1000 years', 1)$$, 'ql3_operator may prune');
RESET ROLE;
SET LOCAL ROLE ql3_runtime;
SELECT throws_ok($$SELECT ql3.prune_outbox('1000 years', 1)$$, '42501', NULL, 'ql3_runtime may not prune');
RESET ROLE;
SET LOCAL ROLE ql3_relay;
SELECT throws_ok($$SELECT ql3.prune_outbox('1000 years', 1)$$, '42501', NULL, 'ql3_relay may not prune');
RESET ROLE;
SET LOCAL ROLE ql3_reader;
SELECT throws_ok($$SELECT ql3.prune_outbox('1000 years', 1)$$, '42501', NULL, 'ql3_reader may not prune');
RESET ROLE;

-- A login holding every ql3 job still cannot DELETE: no role holds DELETE (D46).
CREATE ROLE tap18_login LOGIN IN ROLE ql3_runtime;
GRANT ql3_relay TO tap18_login;
GRANT ql3_operator TO tap18_login;
GRANT ql3_reader TO tap18_login;
SET LOCAL ROLE tap18_login;
SELECT throws_ok(
    $$DELETE FROM ql3.contract_outbox WHERE delivered_at IS NOT NULL$$, '42501', NULL,
    'a login in every ql3 role may not DELETE delivered outbox rows'
);
SELECT throws_ok(
    $$TRUNCATE ql3.contract_outbox$$, '42501', NULL, 'nor TRUNCATE the outbox'
);
SELECT throws_ok(
    $$SET ql3.outbox_notify = 'deferred'; DELETE FROM ql3.contract_outbox$$, '42501', NULL,
    'no setting a session can make lets it DELETE'
);
RESET ROLE;

-- Even the owner's path cannot remove an undelivered row: the guard trigger refuses it.
SELECT throws_ok(
    format('DELETE FROM ql3.contract_outbox WHERE seq = %s', tests.seq18('c1')), 'Q3S01', NULL,
    'the guard trigger refuses deleting an undelivered row, whoever asks'
);
SELECT is(tests.left18(), '{a3,b1,c1,c2}', 'the refused deletes removed nothing');

SELECT * FROM finish();
ROLLBACK;
