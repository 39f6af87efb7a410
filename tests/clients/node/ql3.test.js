'use strict';
// ql3's documented SQL flow end to end through node-postgres (pg), as a Node.js service
// would call it: no ql3 code on this side, only the SQL functions (README "Contract
// revisions from psql", "Model invocations from psql", "Calling ql3 from other languages").
//
// Environment (URLs that node-postgres understands, postgresql://user@host:port/db):
//   QL3_NODE_DSN           required: a superuser or ql3_owner of a database migrated with
//                          both streams (ql3 migrate --with-ai)
//   QL3_NODE_OPERATOR_DSN  a login in ql3_operator  (default: QL3_NODE_DSN)
//   QL3_NODE_RUNTIME_DSN   a login in ql3_runtime   (default: QL3_NODE_DSN)
//   QL3_NODE_RELAY_DSN     a login in ql3_relay     (default: QL3_NODE_DSN; it LISTENs)
//   QL3_NODE_READER_DSN    a login in ql3_reader    (default: QL3_NODE_DSN)
// tests/py/test_node_client.py sets all five, the four roles as least-privilege logins.
// Every run works under a project id of its own, so it can run again on the same database.
//
// Runs on Node 18+ with `node --test` (node:test, node:assert only).

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const { Client } = require('pg');

const OWNER_DSN = process.env.QL3_NODE_DSN;
if (!OWNER_DSN) {
  throw new Error('QL3_NODE_DSN must name a database migrated with both ql3 streams (see this file\'s header)');
}
const DSN = {
  owner: OWNER_DSN,
  operator: process.env.QL3_NODE_OPERATOR_DSN || OWNER_DSN,
  runtime: process.env.QL3_NODE_RUNTIME_DSN || OWNER_DSN,
  relay: process.env.QL3_NODE_RELAY_DSN || OWNER_DSN,
  reader: process.env.QL3_NODE_READER_DSN || OWNER_DSN,
};

const RUN = crypto.randomUUID().slice(0, 8);
const FAMILY = 'policy_routing';
const CHANNEL = 'ql3_contract_outbox';

// -- helpers ---------------------------------------------------------------------------

async function connect(role) {
  const client = new Client({ connectionString: DSN[role], application_name: `ql3-node-test-${role}` });
  await client.connect();
  return client;
}

// Opens one client per role named, runs fn with them, always closes them.
async function withClients(roles, fn) {
  const clients = {};
  try {
    for (const role of roles) clients[role] = await connect(role);
    return await fn(clients);
  } finally {
    await Promise.all(Object.values(clients).map((c) => c.end().catch(() => {})));
  }
}

// The SQLSTATE a call fails with, from the driver's error `code` field (and the error).
async function failure(promise) {
  try {
    await promise;
  } catch (err) {
    return err;
  }
  assert.fail('the call succeeded; an error was expected');
}

async function assertFails(promise, sqlstate, name) {
  const err = await failure(promise);
  assert.equal(err.code, sqlstate, `expected SQLSTATE ${sqlstate}, got ${err.code}: ${err.message}`);
  if (name) assert.ok(err.message.startsWith(`${name}:`), `message starts with ${name}: ${err.message}`);
  return err;
}

// ql3 command timestamps: YYYY-MM-DDTHH:MM:SS.ffffffZ, exactly six fractional digits.
// Date#toISOString() gives three, which ql3 refuses (QL3_INVALID_ARGUMENT).
function recordTime(date) {
  return date.toISOString().replace(/Z$/, '000Z');
}

const sha256 = (text) => crypto.createHash('sha256').update(text).digest('hex');

async function putRevision(client, project, contract, body) {
  // jsonb parameters: pass JSON text (JSON.stringify), never the value itself.
  const { rows } = await client.query(
    'SELECT revision_id, revision_no, body_hash FROM ql3.put_revision($1, $2, $3, $4::jsonb, $5)',
    [project, FAMILY, contract, JSON.stringify(body), 'node'],
  );
  assert.equal(rows.length, 1);
  return rows[0];
}

function activate(client, project, contract, revisionId, expected = null) {
  return client.query(
    'SELECT * FROM ql3.activate_revision($1, $2, $3, $4, $5, $6)',
    [project, FAMILY, contract, revisionId, 'node', expected],
  );
}

function admissionCommand(fields) {
  return {
    schema: 'ql3/model-invocation-admission@v1',
    invocation_id: fields.invocation_id,
    request_id: fields.request_id || `req-${fields.invocation_id}`,
    project_id: fields.project_id,
    run_id: fields.run_id,
    step_run_id: fields.step_run_id,
    trace_id: fields.trace_id,
    expected_step_run_version: fields.expected_step_run_version,
    provider: 'ollama',
    model: 'qwen2.5:7b',
    policy: fields.policy === undefined ? null : fields.policy,
    request_digest: sha256(fields.request || '{"prompt": "hello"}'),
    input_bytes: 19,
    deadline_at: fields.deadline_at,
  };
}

async function command(client, fn, cmd) {
  const { rows } = await client.query(`SELECT ql3_ai.${fn}($1::jsonb) AS r`, [JSON.stringify(cmd)]);
  return rows[0].r; // jsonb arrives parsed: a plain object
}

// A project with an active policy revision, a run and model steps: the world a worker sees.
async function modelWorld(op, rt, name, steps) {
  const project = `node-${RUN}-${name}`;
  const policy = await putRevision(op, project, 'support-bot', { routes: [{ model: 'qwen2.5:7b', weight: 1 }] });
  await activate(op, project, 'support-bot', policy.revision_id);
  const trace = `trace-${name}`;
  const runId = (await rt.query('SELECT ql3.create_run($1, $2) AS id', [project, trace])).rows[0].id;
  const stepIds = [];
  for (let i = 0; i < steps; i += 1) {
    stepIds.push((await rt.query("SELECT ql3.add_step_run($1, 'model') AS id", [runId])).rows[0].id);
  }
  const policyRef = { contract_family: FAMILY, contract_id: 'support-bot', revision_id: policy.revision_id };
  return { project, trace, runId, stepIds, policy, policyRef };
}

// Collects notifications of one LISTEN connection; waitFor resolves with the first one
// that matches (or null after a bounded wait).
function notificationLog(client) {
  const seen = [];
  const waiters = [];
  client.on('notification', (msg) => {
    const note = { channel: msg.channel, payload: JSON.parse(msg.payload) };
    seen.push(note);
    for (const w of waiters.slice()) {
      if (w.match(note)) {
        waiters.splice(waiters.indexOf(w), 1);
        clearTimeout(w.timer);
        w.resolve(note);
      }
    }
  });
  return {
    seen,
    waitFor(match, ms) {
      const found = seen.find(match);
      if (found) return Promise.resolve(found);
      return new Promise((resolve) => {
        const w = { match, resolve };
        w.timer = setTimeout(() => {
          waiters.splice(waiters.indexOf(w), 1);
          resolve(null);
        }, ms);
        waiters.push(w);
      });
    },
  };
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// -- contract revisions ------------------------------------------------------------------

test('contract revisions: put, activate, compare-and-set, read, revoke', async () => {
  await withClients(['operator', 'reader'], async ({ operator: op, reader }) => {
    const project = `node-${RUN}-contracts`;
    const rev1 = await putRevision(op, project, 'c1', { routes: [{ model: 'qwen2.5:7b', weight: 1 }] });
    const rev2 = await putRevision(op, project, 'c1', { routes: [{ model: 'llama3.1:8b', weight: 1 }] });
    assert.equal(rev1.revision_no, 1); // integer: a JS number
    assert.equal(rev2.revision_no, 2);
    assert.match(rev1.body_hash, /^[0-9a-f]{64}$/);
    // The same body again is the same revision (idempotent put).
    const again = await putRevision(op, project, 'c1', { routes: [{ weight: 1, model: 'qwen2.5:7b' }] });
    assert.equal(again.revision_id, rev1.revision_id);

    const first = await activate(op, project, 'c1', rev1.revision_id);
    assert.equal(first.rows.length, 1);
    const event = first.rows[0];
    assert.equal(event.event_type, 'revision_activated');
    assert.equal(event.old_revision_id, null);
    assert.equal(event.new_revision_id, rev1.revision_id);
    // bigint columns (seq, pointer_version) arrive as strings in node-postgres.
    assert.equal(typeof event.seq, 'string');
    assert.equal(event.pointer_version, '1');

    // Compare-and-set: only if rev1 is still the active one.
    const swapped = await activate(op, project, 'c1', rev2.revision_id, rev1.revision_id);
    assert.equal(swapped.rows.length, 1);
    assert.equal(swapped.rows[0].old_revision_id, rev1.revision_id);
    assert.equal(swapped.rows[0].pointer_version, '2');
    assert.ok(BigInt(swapped.rows[0].seq) > BigInt(event.seq));
    const stale = await assertFails(activate(op, project, 'c1', rev1.revision_id, rev1.revision_id),
      'Q3C01', 'QL3_CONFLICT');
    assert.equal(stale.detail, rev2.revision_id); // DETAIL: the revision that is active

    // What is active now (the reader role may read it), and many pointers in one round trip.
    const active = await reader.query('SELECT * FROM ql3.active_revision($1, $2, $3)', [project, FAMILY, 'c1']);
    assert.equal(active.rows.length, 1);
    assert.equal(active.rows[0].revision_id, rev2.revision_id);
    assert.equal(active.rows[0].revision_no, 2);
    assert.deepEqual(active.rows[0].body, { routes: [{ model: 'llama3.1:8b', weight: 1 }] });
    assert.equal(active.rows[0].pointer_version, '2');
    const keys = [[project, FAMILY, 'c1'], [project, FAMILY, 'never-put']];
    const pointers = await reader.query('SELECT * FROM ql3.active_pointers($1::jsonb)', [JSON.stringify(keys)]);
    assert.deepEqual(pointers.rows.map((r) => [r.contract_id, r.revision_id, r.pointer_version]),
      [['c1', rev2.revision_id, '2'], ['never-put', null, '0']]);
    // The trap: a JS array given as is becomes a PostgreSQL array literal, not JSON.
    await assertFails(reader.query('SELECT * FROM ql3.active_pointers($1::jsonb)', [keys]), '22P02');

    // Revoke for good: the pointer becomes NULL, and no row is active.
    const revoked = await op.query('SELECT * FROM ql3.revoke_revision($1, $2, $3)',
      [rev2.revision_id, 'node', 'routes to a retired model']);
    assert.equal(revoked.rows.length, 1);
    assert.equal(revoked.rows[0].event_type, 'revision_revoked');
    assert.equal(revoked.rows[0].pointer_version, '3');
    const none = await reader.query('SELECT * FROM ql3.active_revision($1, $2, $3)', [project, FAMILY, 'c1']);
    assert.equal(none.rows.length, 0);
    // Revoking again writes nothing (its result has no seq).
    const twice = await op.query('SELECT * FROM ql3.revoke_revision($1, $2, $3)', [rev2.revision_id, 'node', 'again']);
    assert.ok(twice.rows.every((r) => r.seq === null));
    const outbox = await op.query('SELECT count(*) AS n FROM ql3.contract_outbox WHERE project_id = $1', [project]);
    assert.equal(outbox.rows[0].n, '3'); // count(*) is a bigint too
  });
});

test('activating the already active revision returns zero rows and writes nothing', async () => {
  await withClients(['operator'], async ({ operator: op }) => {
    const project = `node-${RUN}-noop`;
    const rev = await putRevision(op, project, 'c1', { v: 1 });
    assert.equal((await activate(op, project, 'c1', rev.revision_id)).rows.length, 1);

    const again = await activate(op, project, 'c1', rev.revision_id);
    assert.equal(again.rows.length, 0);
    assert.equal(again.rowCount, 0);
    const matching = await activate(op, project, 'c1', rev.revision_id, rev.revision_id);
    assert.equal(matching.rows.length, 0);
    // Called in the select list, as a scalar: still no row, not a row holding NULL.
    const scalar = await op.query('SELECT ql3.activate_revision($1, $2, $3, $4, $5) AS event',
      [project, FAMILY, 'c1', rev.revision_id, 'node']);
    assert.equal(scalar.rows.length, 0);

    const pointer = await op.query(
      'SELECT pointer_version FROM ql3.active_pointers($1::jsonb)', [JSON.stringify([[project, FAMILY, 'c1']])]);
    assert.equal(pointer.rows[0].pointer_version, '1');
    const outbox = await op.query('SELECT count(*) AS n FROM ql3.contract_outbox WHERE project_id = $1', [project]);
    assert.equal(outbox.rows[0].n, '1');
  });
});

// -- model invocations -------------------------------------------------------------------

test('model invocations: admit, replay, complete, usage, recover, resolve, retry', async () => {
  await withClients(['operator', 'runtime', 'reader'], async ({ operator: op, runtime: rt, reader }) => {
    const w = await modelWorld(op, rt, 'invocations', 2);
    const [step1, step2] = w.stepIds;
    const inv1 = `inv-${crypto.randomUUID()}`;
    const inv2 = `inv-${crypto.randomUUID()}`;
    const inv3 = `inv-${crypto.randomUUID()}`;
    const future = recordTime(new Date(Date.now() + 3600 * 1000));

    // Admission: ready -> running, the Start receipt, before any provider I/O.
    const admit1 = admissionCommand({
      invocation_id: inv1, project_id: w.project, run_id: w.runId, step_run_id: step1,
      trace_id: w.trace, expected_step_run_version: 1, policy: w.policyRef, deadline_at: future,
    });
    const admitted = await command(rt, 'admit_invocation', admit1);
    assert.equal(admitted.status, 'created');
    assert.equal(admitted.start.attempt, 1); // numbers inside jsonb are JS numbers
    assert.equal(admitted.start.deadline_at, future);
    // The same command again is a replay: "existing", the same receipt; never call twice.
    const replay = await command(rt, 'admit_invocation', admit1);
    assert.equal(replay.status, 'existing');
    assert.equal(replay.start_digest, admitted.start_digest);

    // Completion: running -> succeeded, the Completion receipt and a usage_ledger row.
    const completion = {
      schema: 'ql3/model-invocation-completion-command@v1',
      invocation_id: inv1, start_digest: admitted.start_digest,
      outcome: 'succeeded', result_code: 'ok',
      output_bytes: 42, output_digest: sha256('the answer'),
      usage: { input_tokens: 12, output_tokens: 30, cost_micros: 150, currency: 'USD' },
    };
    const completed = await command(rt, 'complete_invocation', completion);
    assert.equal(completed.status, 'created');
    assert.equal(completed.completion.outcome, 'succeeded');
    assert.equal((await command(rt, 'complete_invocation', completion)).status, 'existing');
    const step = await rt.query('SELECT status, version FROM ql3.step_runs WHERE step_run_id = $1', [step1]);
    assert.deepEqual(step.rows[0], { status: 'succeeded', version: '3' });

    // Usage (the reader role may read it): bigint sums arrive as strings.
    const usage = await reader.query('SELECT * FROM ql3_ai.usage_summary($1, NULL, NULL)', [w.project]);
    assert.deepEqual(usage.rows, [{
      provider: 'ollama', model: 'qwen2.5:7b', currency: 'USD', completions: '1', input_tokens: '12',
      output_tokens: '30', known_cost_micros: '150', known_cost_completions: '1', unknown_cost_completions: '0',
    }]);

    // The second step's worker admits with a deadline already past, then dies.
    const admit2 = admissionCommand({
      invocation_id: inv2, project_id: w.project, run_id: w.runId, step_run_id: step2,
      trace_id: w.trace, expected_step_run_version: 1, deadline_at: '2020-01-01T00:00:00.000000Z',
      request: '{"prompt": "again"}',
    });
    assert.equal((await command(rt, 'admit_invocation', admit2)).status, 'created');

    // Recovery (operator): expired starts without a completion become lost/outcome_unknown.
    const { rows: [{ r: recovered }] } = await op.query("SELECT ql3_ai.recover_expired(100, interval '0 seconds') AS r");
    const mine = recovered.recovered.filter((x) => x.invocation_id === inv2);
    assert.equal(mine.length, 1);
    assert.equal(mine[0].step_run_id, step2);
    assert.equal(recovered.count, recovered.recovered.length);

    const lost = await op.query(
      `SELECT c.completion_digest, c.outcome, c.result_code, s.status, s.version
       FROM ql3_ai.model_invocation_completions AS c
       JOIN ql3.step_runs AS s ON s.step_run_id = c.step_run_id
       WHERE c.invocation_id = $1`, [inv2]);
    const row = lost.rows[0];
    assert.deepEqual([row.outcome, row.result_code, row.status], ['lost', 'outcome_unknown', 'lost']);
    assert.equal(typeof row.version, 'string'); // bigint

    // Resolution by a human: retry. expected_step_run_version must be a JSON integer, so
    // the bigint read above goes through Number(); as a string it is refused.
    const resolution = {
      schema: 'ql3/model-invocation-resolution-command@v1',
      invocation_id: inv2, completion_digest: row.completion_digest, decision: 'retry',
      user_id: 'alice', expected_step_run_version: row.version, reason: 'provider has no record of the call',
    };
    await assertFails(command(op, 'resolve_invocation', resolution), 'Q3V01', 'QL3_INVALID_ARGUMENT');
    resolution.expected_step_run_version = Number(row.version);
    const resolved = await command(op, 'resolve_invocation', resolution);
    assert.equal(resolved.status, 'created');
    assert.equal(resolved.resolution.to_status, 'ready');
    assert.equal((await command(op, 'resolve_invocation', resolution)).status, 'existing');
    // The runtime role cannot resolve its own unknown outcomes (with a least-privilege login).
    if (DSN.runtime !== DSN.owner) {
      await assertFails(command(rt, 'resolve_invocation', resolution), '42501');
    }

    // The retry is a new invocation on the same step: attempt 2.
    const version = Number((await rt.query('SELECT version FROM ql3.step_runs WHERE step_run_id = $1', [step2])).rows[0].version);
    const retried = await command(rt, 'admit_invocation', admissionCommand({
      invocation_id: inv3, project_id: w.project, run_id: w.runId, step_run_id: step2,
      trace_id: w.trace, expected_step_run_version: version, deadline_at: future, request: '{"prompt": "again"}',
    }));
    assert.equal(retried.status, 'created');
    assert.equal(retried.start.attempt, 2);
  });
});

test('commands need six fractional digits in timestamps: toISOString() alone is refused', async () => {
  await withClients(['operator', 'runtime'], async ({ operator: op, runtime: rt }) => {
    const w = await modelWorld(op, rt, 'timestamps', 1);
    const cmd = admissionCommand({
      invocation_id: `inv-${crypto.randomUUID()}`, project_id: w.project, run_id: w.runId,
      step_run_id: w.stepIds[0], trace_id: w.trace, expected_step_run_version: 1,
      deadline_at: new Date(Date.now() + 3600 * 1000).toISOString(), // three digits
    });
    const err = await assertFails(command(rt, 'admit_invocation', cmd), 'Q3V01', 'QL3_INVALID_ARGUMENT');
    assert.match(err.message, /six fractional digits/);
    cmd.deadline_at = recordTime(new Date(Date.now() + 3600 * 1000));
    assert.equal((await command(rt, 'admit_invocation', cmd)).status, 'created');
  });
});

// -- errors ------------------------------------------------------------------------------

test('every ql3 SQLSTATE arrives in the driver error code field', async () => {
  await withClients(['operator', 'runtime'], async ({ operator: op, runtime: rt }) => {
    const project = `node-${RUN}-errors`;
    const seen = new Set();
    const expect = async (promise, sqlstate, name) => {
      await assertFails(promise, sqlstate, name);
      seen.add(sqlstate);
    };

    // Q3V01: malformed JSON text through ql3.parse_json (the ::jsonb cast says 22P02).
    await expect(op.query('SELECT ql3.parse_json($1)', ['{"routes": [']), 'Q3V01', 'QL3_INVALID_ARGUMENT');
    await assertFails(op.query('SELECT $1::jsonb', ['{"routes": [']), '22P02');
    const parsed = await op.query('SELECT ql3.put_revision($1, $2, $3, ql3.parse_json($4), $5) AS r',
      [project, FAMILY, 'parsed', '{"v": 1}', 'node']);
    assert.equal(parsed.rows.length, 1);
    await expect(putRevision(op, project, 'c1', ['not', 'an', 'object']), 'Q3V01', 'QL3_INVALID_ARGUMENT');
    // Q3V02: a body over 24 KiB of canonical JSON.
    await expect(putRevision(op, project, 'c1', { big: 'x'.repeat(25 * 1024) }), 'Q3V02', 'QL3_RECORD_TOO_LARGE');
    // Q3V03: an identifier over 128 characters.
    await expect(putRevision(op, 'p'.repeat(129), 'c1', { v: 1 }), 'Q3V03', 'QL3_IDENTIFIER_TOO_LONG');
    // Q3N01: an unknown revision.
    await expect(op.query('SELECT * FROM ql3.revoke_revision($1, $2, $3)', [crypto.randomUUID(), 'node', 'x']),
      'Q3N01', 'QL3_NOT_FOUND');

    // Q3C01: compare-and-set mismatch. Q3R01: activating a revoked revision.
    const rev1 = await putRevision(op, project, 'c1', { v: 1 });
    const rev2 = await putRevision(op, project, 'c1', { v: 2 });
    await activate(op, project, 'c1', rev1.revision_id);
    await expect(activate(op, project, 'c1', rev2.revision_id, rev2.revision_id), 'Q3C01', 'QL3_CONFLICT');
    await op.query('SELECT * FROM ql3.revoke_revision($1, $2, $3)', [rev2.revision_id, 'node', 'bad']);
    await expect(activate(op, project, 'c1', rev2.revision_id), 'Q3R01', 'QL3_REVISION_REVOKED');

    // Q3C02: admission under a policy revision that is no longer the active one.
    const w = await modelWorld(op, rt, 'errors-model', 2);
    const newer = await putRevision(op, w.project, 'support-bot', { routes: [{ model: 'llama3.1:8b', weight: 1 }] });
    await activate(op, w.project, 'support-bot', newer.revision_id);
    const future = recordTime(new Date(Date.now() + 3600 * 1000));
    const staleErr = await assertFails(command(rt, 'admit_invocation', admissionCommand({
      invocation_id: `inv-${crypto.randomUUID()}`, project_id: w.project, run_id: w.runId,
      step_run_id: w.stepIds[0], trace_id: w.trace, expected_step_run_version: 1,
      policy: w.policyRef, deadline_at: future,
    })), 'Q3C02', 'QL3_STALE_REVISION');
    seen.add('Q3C02');
    assert.equal(staleErr.detail, newer.revision_id); // DETAIL: the active revision

    // Q3S01: resolving an invocation whose outcome is known (succeeded, not lost).
    const inv = `inv-${crypto.randomUUID()}`;
    const admitted = await command(rt, 'admit_invocation', admissionCommand({
      invocation_id: inv, project_id: w.project, run_id: w.runId, step_run_id: w.stepIds[1],
      trace_id: w.trace, expected_step_run_version: 1, deadline_at: future,
    }));
    const done = await command(rt, 'complete_invocation', {
      schema: 'ql3/model-invocation-completion-command@v1', invocation_id: inv,
      start_digest: admitted.start_digest, outcome: 'succeeded', result_code: 'ok',
      output_bytes: 1, output_digest: sha256('x'),
      usage: { input_tokens: null, output_tokens: null, cost_micros: null, currency: null },
    });
    await expect(command(op, 'resolve_invocation', {
      schema: 'ql3/model-invocation-resolution-command@v1', invocation_id: inv,
      completion_digest: done.completion_digest, decision: 'fail', user_id: 'alice',
      expected_step_run_version: 3, reason: null,
    }), 'Q3S01', 'QL3_ILLEGAL_TRANSITION');

    assert.deepEqual([...seen].sort(),
      ['Q3C01', 'Q3C02', 'Q3N01', 'Q3R01', 'Q3S01', 'Q3V01', 'Q3V02', 'Q3V03']);
  });
});

// -- notifications -----------------------------------------------------------------------

test('LISTEN: a notification at COMMIT of an activation, none before it, none on rollback', async () => {
  await withClients(['relay', 'operator'], async ({ relay: listener, operator: op }) => {
    const project = `node-${RUN}-listen`;
    const log = notificationLog(listener);
    await listener.query(`LISTEN ${CHANNEL}`);
    const ofProject = (n) => n.channel === CHANNEL && n.payload.project_id === project;
    const rev1 = await putRevision(op, project, 'c1', { v: 1 });
    const rev2 = await putRevision(op, project, 'c1', { v: 2 });
    const rev3 = await putRevision(op, project, 'c1', { v: 3 });

    // Committed: the trigger's payload {"seq", "project_id"} arrives at COMMIT.
    await op.query('BEGIN');
    const { rows: [event] } = await activate(op, project, 'c1', rev1.revision_id);
    assert.equal(await log.waitFor(ofProject, 300), null, 'no notification before COMMIT');
    await op.query('COMMIT');
    const note = await log.waitFor(ofProject, 5000);
    assert.ok(note, 'a notification within 5 s of the COMMIT');
    assert.deepEqual(note.payload, { seq: Number(event.seq), project_id: project });

    // Rolled back: no notification.
    await op.query('BEGIN');
    assert.equal((await activate(op, project, 'c1', rev2.revision_id)).rows.length, 1);
    await op.query('ROLLBACK');
    // A failed activation: no notification either.
    await op.query('BEGIN');
    await assertFails(activate(op, project, 'c1', rev2.revision_id, rev3.revision_id), 'Q3C01');
    await op.query('ROLLBACK');
    // An activation of the already active revision commits nothing to notify.
    await activate(op, project, 'c1', rev1.revision_id);
    await sleep(500);
    assert.deepEqual(log.seen.filter(ofProject).map((n) => n.payload.seq), [Number(event.seq)]);

    // Deferred (D17): the COMMIT sends nothing; ql3.wake_relays() sends {"wake": true}.
    await op.query('BEGIN');
    await op.query("SET LOCAL ql3.outbox_notify = 'deferred'");
    const { rows: [deferred] } = await activate(op, project, 'c1', rev3.revision_id);
    await op.query('COMMIT');
    assert.ok(deferred);
    await sleep(500);
    assert.equal(log.seen.filter(ofProject).length, 1, 'a deferred COMMIT does not notify');
    const isWake = (n) => n.channel === CHANNEL && n.payload.wake === true;
    const before = log.seen.filter(isWake).length;
    await op.query('SELECT ql3.wake_relays()');
    const wake = await log.waitFor((n) => isWake(n) && log.seen.filter(isWake).length > before, 5000);
    assert.ok(wake, 'wake_relays() notifies');
    assert.deepEqual(wake.payload, { wake: true });
    await listener.query(`UNLISTEN ${CHANNEL}`);
  });
});
