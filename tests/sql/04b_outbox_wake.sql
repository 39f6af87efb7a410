-- Deferred relay wake-up (D17): a transaction that sets ql3.outbox_notify = 'deferred'
-- commits its outbox row without a NOTIFY; ql3.wake_relays() sends one notification at the
-- COMMIT of its own transaction (or, called inside a writing transaction, at that one's).
-- Seen from other sessions through dblink, like 04_outbox.sql.
BEGIN;
SELECT plan(11);
SET LOCAL client_min_messages = warning;

\ir lib/outbox_helpers.sql
INSERT INTO tests.ctx (key, value) VALUES ('project', 'tap04b-' || gen_random_uuid());

CREATE TABLE tests.notes (notify_name text, be_pid integer, extra text);

SELECT dblink_connect('tap04b_l', tests.dsn());
SELECT dblink_connect('tap04b_w', tests.dsn());
SELECT dblink_exec('tap04b_l', 'LISTEN ql3_contract_outbox');
-- Whatever other sessions left queued is not ours.
SELECT count(*) FROM tests.poll('tap04b_l');

-- A deferred activation commits its row but notifies nobody ---------------------------------

SELECT dblink_exec('tap04b_w', 'BEGIN');
SELECT dblink_exec('tap04b_w', 'SET LOCAL ql3.outbox_notify = deferred');
INSERT INTO tests.ctx (key, value) VALUES ('seq', tests.remote_activate('tap04b_w', 'deferred', 1)::text);
SELECT dblink_exec('tap04b_w', 'COMMIT');

SELECT is(
    (SELECT count(*) FROM tests.poll('tap04b_l')),
    0::bigint,
    'a committed activation with ql3.outbox_notify = deferred notifies nobody'
);

SELECT is(
    (SELECT count(*) FROM ql3.contract_outbox AS o
     WHERE o.seq = (SELECT c.value::bigint FROM tests.ctx AS c WHERE c.key = 'seq')
       AND o.project_id = tests.p() AND o.delivered_at IS NULL),
    1::bigint,
    'its outbox row is committed and undelivered, for the relay poll to find'
);

-- ql3.wake_relays() in its own transaction: one notification at its COMMIT ------------------

SELECT dblink_exec('tap04b_w', 'SET synchronous_commit = on');
SELECT dblink_exec('tap04b_w', 'BEGIN');
SELECT is(
    (SELECT t.v FROM dblink('tap04b_w', 'SELECT ql3.wake_relays()::text') AS t (v text)),
    '',
    'ql3.wake_relays() runs'
);
SELECT is(
    (SELECT t.v FROM dblink('tap04b_w', 'SHOW synchronous_commit') AS t (v text)),
    'on',
    'it leaves the durability of its transaction alone'
);
SELECT is((SELECT count(*) FROM tests.poll('tap04b_l')), 0::bigint, 'it notifies nobody before COMMIT');
SELECT dblink_exec('tap04b_w', 'COMMIT');

INSERT INTO tests.notes (notify_name, be_pid, extra)
SELECT
    n.notify_name,
    n.be_pid,
    n.extra
FROM tests.poll('tap04b_l') AS n;

SELECT is((SELECT count(*) FROM tests.notes), 1::bigint, 'the wake sends exactly one notification');
SELECT is(
    (SELECT n.notify_name FROM tests.notes AS n),
    'ql3_contract_outbox',
    'on the relay channel ql3_contract_outbox'
);
SELECT is((SELECT n.extra::jsonb FROM tests.notes AS n), '{"wake": true}'::jsonb, 'with payload {"wake": true}');

-- Any other value of the setting still notifies at COMMIT -----------------------------------

SELECT dblink_exec('tap04b_w', 'BEGIN');
SELECT dblink_exec('tap04b_w', 'SET LOCAL ql3.outbox_notify = commit');
SELECT tests.remote_activate('tap04b_w', 'not-deferred', 1);
SELECT dblink_exec('tap04b_w', 'COMMIT');
SELECT is(
    (SELECT count(*) FROM tests.poll('tap04b_l') AS n WHERE n.extra::jsonb ->> 'project_id' = tests.p()),
    1::bigint,
    'ql3.outbox_notify other than deferred keeps the NOTIFY at COMMIT'
);

-- Inside the writing transaction itself: an ordinary NOTIFY at that COMMIT -----------------

SELECT dblink_exec('tap04b_w', 'BEGIN');
SELECT dblink_exec('tap04b_w', 'SET LOCAL ql3.outbox_notify = deferred');
SELECT tests.remote_activate('tap04b_w', 'wake-inside', 1);
SELECT t.v FROM dblink('tap04b_w', 'SELECT ql3.wake_relays()::text') AS t (v text);
SELECT is((SELECT count(*) FROM tests.poll('tap04b_l')), 0::bigint, 'a wake inside a writing transaction waits for its COMMIT');
SELECT dblink_exec('tap04b_w', 'COMMIT');
SELECT is(
    (SELECT array_agg(n.extra) FROM tests.poll('tap04b_l') AS n),
    ARRAY['{"wake": true}'],
    'and then sends one notification, the wake (the deferred row sent none)'
);

-- Leave nothing undelivered for later files (committed remotely, so marked remotely).
SELECT dblink_exec(
    'tap04b_w',
    format('UPDATE ql3.contract_outbox SET delivered_at = now() WHERE project_id = %L AND delivered_at IS NULL',
           tests.p())
);
SELECT dblink_disconnect('tap04b_l');
SELECT dblink_disconnect('tap04b_w');

SELECT * FROM finish();
ROLLBACK;
