"""admit+complete pairs/s against pgbench tpcb-like TPS, same server, same run.

A pair is one pgbench transaction of ``PAIR_SCRIPT`` = two database transactions (each
``SELECT`` autocommits): ``ql3_ai.admit_invocation`` of a fresh ready model step, created
beforehand by ``bench_prepare`` outside the timed window, then
``ql3_ai.complete_invocation`` of it (succeeded, with usage, so a usage_ledger row is
written too). pairs/s = pgbench's tps. The pairs run as ``ql3_runtime`` (PGOPTIONS
``-c role=ql3_runtime``). The baseline is pgbench's built-in tpcb-like in its own database
(``pgbench -i -s 8``). Both sides: ``pgbench -M prepared -c C -j C -T S``, in rounds
with the sides back to back and the order reversed every other round; the ratio is
the median of the per-round ratios (one 10-second run per side moved it by about 0.03).

The peer comparison (issue 4): DBOS Transact at the same client counts, a third side of
every round, one workflow with one step per model call, its system database on the same
server (``bench.dbos_pairs``); reported as "not measured: <reason>" when DBOS cannot run
here.

The floor (diagnostic, no target): ``FLOOR_SCRIPT`` writes the rows of one pair by plain
SQL, the admission and the completion each one autocommitted statement of data-modifying
CTEs (so two transactions per pgbench transaction, as for a pair), with no function, no
validation and no digest computation (ids and digests are md5 strings of the same length
as the real sha256 ones, unique per step), on the same schema (every constraint, foreign
key, index and trigger in place), as ``ql3_owner`` (since D46 no other role may write the
tables), on its own fresh batch of ready
steps. The step's row lock is taken by the fenced UPDATE itself. It answers what the
schema's required writing alone costs; once per run the floor is checked to change every
table exactly as a pair does (rows, counters, bytes).

The function floor (diagnostic, D61): the floor's two statements, each inside a SECURITY
DEFINER PL/pgSQL function owned by ``ql3_owner`` with ql3's ``search_path``, called as
``ql3_runtime`` (``FUNCTION_FLOOR_SCRIPT``): what being one of ql3's functions costs
before any check, read or digest. Issue 23 judges the pairs against the floor of the same
rounds: pairs/s >= 0.85 x floor/s at 8 clients.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import psycopg

from bench import dbos_pairs
from bench.common import (
    PgbenchRun,
    Result,
    Row,
    Settings,
    against,
    alternating,
    diagnostic_row,
    fresh_database,
    judged_row,
    median,
    run_pgbench,
    verdict,
    with_dbname,
)
from ql3.devservers import PG_BIN

TARGET_RATIO = 0.4
TARGET_DBOS_RATIO = 4.0
TARGET_CLIENTS = 8
TARGET_FLOOR_RATIO = 0.85  # issue 23: pairs/s against the floor's, same rounds
CLIENT_COUNTS = (1, 8)
ROUNDS = 5
ROUND_SECONDS = 4
RUNTIME_ENV = {"PGOPTIONS": "-c role=ql3_runtime"}
# The floor writes the tables directly, which only their owner may do (D46).
OWNER_ENV = {"PGOPTIONS": "-c role=ql3_owner"}

PAIR_SCRIPT = """\
\\set idx :base + :client_id * 1000000 + :n
\\set n :n + 1
SELECT a.r ->> 'start_digest' AS sd
FROM (SELECT ql3_ai.admit_invocation(bench_admission(:idx)) AS r) AS a \\gset
SELECT ql3_ai.complete_invocation(bench_completion(:idx, :sd));
"""

# The rows of PAIR_SCRIPT, written directly: the step UPDATE is the fence (and the row
# lock) of each transition, the run UPDATE allocates the event seq, and every other row is
# built from the step's and the run's new counters as admit_invocation and
# _write_completion build them (same columns, same record and payload keys and value
# lengths; digests are two md5s = 64 hex digits, ids the same prefixes). A step that is not
# in the expected state updates nothing, so nothing is written and 1 / count(*) fails the
# transaction. No colon is followed by a letter in the text: pgbench would take it for a
# variable (hence '": null', '": false' and the quoted ":" of the to_char format).
FLOOR_SCRIPT = """\
\\set idx :base + :client_id * 1000000 + :n
\\set n :n + 1
WITH v AS (
    SELECT x.i, 'inv-' || x.i AS inv,
           ('00000000-0000-4000-8000-' || x.i)::uuid AS run_id,
           ('00000000-0000-4000-9000-' || x.i)::uuid AS step_run_id,
           md5(x.i || 'admission') || md5(x.i || 'admission2') AS command_digest,
           md5(x.i || 'start') || md5(x.i || 'start2') AS start_digest,
           'mut_' || md5(x.i || 'mut-a') || md5(x.i || 'mut-a2') AS mutation_id,
           'evt_' || md5(x.i || 'evt-a') || md5(x.i || 'evt-a2') AS event_id,
           'ddp_' || md5(x.i || 'ddp-a') || md5(x.i || 'ddp-a2') AS dedupe_key,
           to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24":"MI":"SS.US"Z"') AS at
    FROM (SELECT CAST(:idx AS text) AS i) AS x
), s AS (
    UPDATE ql3.step_runs AS s
    SET status = 'running', version = s.version + 1, attempt_count = s.attempt_count + 1,
        current_invocation_id = v.inv, updated_at = now()
    FROM v
    WHERE s.step_run_id = v.step_run_id AND s.status = 'ready' AND s.version = 1
    RETURNING s.version, s.attempt_count
), r AS (
    UPDATE ql3.runs AS r
    SET version = r.version + 1, event_seq = r.event_seq + 1, updated_at = now()
    FROM v, s
    WHERE r.run_id = v.run_id
    RETURNING r.version, r.event_seq
), st AS (
    INSERT INTO ql3_ai.model_invocation_starts (
        invocation_id, request_id, project_id, run_id, step_run_id, trace_id, attempt, provider,
        model, policy_contract_family, policy_contract_id, policy_revision_id, request_digest,
        deadline_at, input_bytes, command_digest, record, start_digest, mutation_id, event_id,
        dedupe_key, admitted_at
    )
    SELECT v.inv, 'req-' || v.i, 'bench', v.run_id, v.step_run_id, 'trace-' || v.i,
           s.attempt_count, 'ollama', 'llama3.1:8b', NULL, NULL, NULL,
           '9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08',
           '2999-01-01T00:00:00.000000Z', 512, v.command_digest,
           format(
               '{"admitted_at":"%s","attempt":%s,"command_digest":"%s",'
               '"deadline_at":"2999-01-01T00:00:00.000000Z","dedupe_key":"%s","event_id":"%s",'
               '"input_bytes":512,"invocation_id":"%s","model":"llama3.1:8b","mutation_id":"%s",'
               '"policy": null,"project_id":"bench","provider":"ollama",'
               '"request_digest":"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",'
               '"request_id":"req-%s","run_event_seq":%s,"run_id":"%s","run_version":%s,'
               '"schema":"ql3/model-invocation-start@v1","step_run_id":"%s",'
               '"step_run_version":%s,"trace_id":"trace-%s"}',
               v.at, s.attempt_count, v.command_digest, v.dedupe_key, v.event_id, v.inv,
               v.mutation_id, v.i, r.event_seq, v.run_id, r.version, v.step_run_id, s.version,
               v.i
           )::jsonb,
           v.start_digest, v.mutation_id, v.event_id, v.dedupe_key, now()
    FROM v, s, r
), e AS (
    INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
    SELECT v.run_id, r.event_seq, v.event_id, 'model_invocation_admitted', v.step_run_id,
           jsonb_build_object('invocation_id', v.inv, 'attempt', s.attempt_count,
                              'from_status', 'ready', 'to_status', 'running',
                              'step_run_version', s.version, 'start_digest', v.start_digest)
    FROM v, s, r
), m AS (
    INSERT INTO ql3.step_run_mutations (
        mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version,
        command_digest
    )
    SELECT v.mutation_id, v.dedupe_key, v.step_run_id, 'ready', 'running', s.version - 1,
           s.version, v.command_digest
    FROM v, s
)
SELECT 1 / count(*) FROM s;
WITH v AS (
    SELECT x.i, 'inv-' || x.i AS inv,
           ('00000000-0000-4000-8000-' || x.i)::uuid AS run_id,
           ('00000000-0000-4000-9000-' || x.i)::uuid AS step_run_id,
           md5(x.i || 'start') || md5(x.i || 'start2') AS start_digest,
           md5(x.i || 'completion-command') || md5(x.i || 'completion-command2')
               AS command_digest,
           md5(x.i || 'completion') || md5(x.i || 'completion2') AS completion_digest,
           'mut_' || md5(x.i || 'mut-c') || md5(x.i || 'mut-c2') AS mutation_id,
           'evt_' || md5(x.i || 'evt-c') || md5(x.i || 'evt-c2') AS event_id,
           'ddp_' || md5(x.i || 'ddp-c') || md5(x.i || 'ddp-c2') AS dedupe_key,
           to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24":"MI":"SS.US"Z"') AS at
    FROM (SELECT CAST(:idx AS text) AS i) AS x
), s AS (
    UPDATE ql3.step_runs AS s
    SET status = 'succeeded', version = s.version + 1,
        output_ref = 'model-invocation:' || v.inv, result_code = 'ok', updated_at = now()
    FROM v
    WHERE s.step_run_id = v.step_run_id AND s.status = 'running'
      AND s.current_invocation_id = v.inv
    RETURNING s.version, s.attempt_count
), r AS (
    UPDATE ql3.runs AS r
    SET version = r.version + 1, event_seq = r.event_seq + 1, updated_at = now()
    FROM v, s
    WHERE r.run_id = v.run_id
    RETURNING r.version, r.event_seq
), c AS (
    INSERT INTO ql3_ai.model_invocation_completions (
        invocation_id, start_digest, project_id, run_id, step_run_id, outcome, result_code,
        output_bytes, output_digest, input_tokens, output_tokens, cost_micros, currency,
        recovered, command_digest, record, completion_digest, mutation_id, event_id, dedupe_key,
        completed_at
    )
    SELECT v.inv, v.start_digest, 'bench', v.run_id, v.step_run_id, 'succeeded', 'ok', 2048,
           '60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752', 128, 512, 1500,
           'USD', false, v.command_digest,
           format(
               '{"attempt":%s,"command_digest":"%s","completed_at":"%s","dedupe_key":"%s",'
               '"event_id":"%s","invocation_id":"%s","model":"llama3.1:8b","mutation_id":"%s",'
               '"outcome":"succeeded","output_bytes":2048,'
               '"output_digest":"60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752",'
               '"output_ref":"model-invocation:%s","project_id":"bench","provider":"ollama",'
               '"recovered": false,"result_code":"ok","run_event_seq":%s,"run_id":"%s",'
               '"run_version":%s,"schema":"ql3/model-invocation-completion@v1",'
               '"start_digest":"%s","step_run_id":"%s","step_run_version":%s,'
               '"trace_id":"trace-%s","usage":{"cost_micros":1500,"currency":"USD",'
               '"input_tokens":128,"output_tokens":512}}',
               s.attempt_count, v.command_digest, v.at, v.dedupe_key, v.event_id, v.inv,
               v.mutation_id, v.inv, r.event_seq, v.run_id, r.version, v.start_digest,
               v.step_run_id, s.version, v.i
           )::jsonb,
           v.completion_digest, v.mutation_id, v.event_id, v.dedupe_key, now()
    FROM v, s, r
), u AS (
    INSERT INTO ql3_ai.usage_ledger (
        invocation_id, project_id, run_id, provider, model, input_tokens, output_tokens,
        cost_micros, currency, outcome, completion_digest, recorded_at
    )
    SELECT v.inv, 'bench', v.run_id, 'ollama', 'llama3.1:8b', 128, 512, 1500, 'USD',
           'succeeded', v.completion_digest, now()
    FROM v, s
), e AS (
    INSERT INTO ql3.run_events (run_id, seq, event_id, event_type, step_run_id, payload)
    SELECT v.run_id, r.event_seq, v.event_id, 'model_invocation_completed', v.step_run_id,
           jsonb_build_object('invocation_id', v.inv, 'outcome', 'succeeded',
                              'result_code', 'ok', 'recovered', false,
                              'from_status', 'running', 'to_status', 'succeeded',
                              'step_run_version', s.version,
                              'completion_digest', v.completion_digest)
    FROM v, s, r
), m AS (
    INSERT INTO ql3.step_run_mutations (
        mutation_id, dedupe_key, step_run_id, from_status, to_status, from_version, to_version,
        command_digest
    )
    SELECT v.mutation_id, v.dedupe_key, v.step_run_id, 'running', 'succeeded', s.version - 1,
           s.version, v.command_digest
    FROM v, s
)
SELECT 1 / count(*) FROM s;
"""


def _floor_statements() -> tuple[str, str]:
    """The admission and the completion statement of ``FLOOR_SCRIPT``, ending with their
    CTEs (the ``SELECT 1 / count(*) FROM s`` that fails a transaction which moved no step
    is left to the caller), ``:idx`` read from a parameter ``idx``."""
    body = FLOOR_SCRIPT.split("\\set n :n + 1\n", 1)[1]
    admission, completion, rest = body.split("SELECT 1 / count(*) FROM s;\n")
    assert rest == "", rest
    return (
        admission.replace("CAST(:idx AS text)", "CAST(idx AS text)"),
        completion.replace("CAST(:idx AS text)", "CAST(idx AS text)"),
    )


def _function_floor_sql() -> str:
    """``bench_floor_admission(idx)`` and ``bench_floor_completion(idx)``: the floor's
    statements as ql3's functions are made (SECURITY DEFINER, owned by ql3_owner,
    ``search_path`` pinned, EXECUTE for ql3_runtime alone), without anything else."""
    parts = []
    for name, statement in zip(("admission", "completion"), _floor_statements(), strict=True):
        function = f"bench_floor_{name}(idx bigint)"
        parts.append(
            f"CREATE FUNCTION {function} RETURNS integer\n"
            "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, ql3, pg_temp\n"
            "AS $fn$\nDECLARE moved integer;\nBEGIN\n"
            f"{statement}SELECT 1 / count(*) INTO moved FROM s;\n"
            "RETURN moved;\nEND;\n$fn$;\n"
            f"ALTER FUNCTION {function} OWNER TO ql3_owner;\n"
            f"REVOKE ALL ON FUNCTION {function} FROM PUBLIC;\n"
            f"GRANT EXECUTE ON FUNCTION {function} TO ql3_runtime;\n"
        )
    return "".join(parts)


FUNCTION_FLOOR_SCRIPT = """\
\\set idx :base + :client_id * 1000000 + :n
\\set n :n + 1
SELECT bench_floor_admission(:idx);
SELECT bench_floor_completion(:idx);
"""


SETUP_SQL = """\
CREATE FUNCTION bench_admission(idx bigint) RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT format(
        '{"schema": "ql3/model-invocation-admission@v1", "invocation_id": "inv-%1$s",'
        ' "request_id": "req-%1$s", "project_id": "bench",'
        ' "run_id": "00000000-0000-4000-8000-%1$s",'
        ' "step_run_id": "00000000-0000-4000-9000-%1$s", "trace_id": "trace-%1$s",'
        ' "expected_step_run_version": 1, "provider": "ollama", "model": "llama3.1:8b",'
        ' "policy": null,'
        ' "request_digest": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",'
        ' "input_bytes": 512, "deadline_at": "2999-01-01T00:00:00.000000Z"}',
        idx
    )::jsonb
$$;

CREATE FUNCTION bench_completion(idx bigint, start_digest text) RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT format(
        '{"schema": "ql3/model-invocation-completion-command@v1", "invocation_id": "inv-%1$s",'
        ' "start_digest": "%2$s", "outcome": "succeeded", "result_code": "ok",'
        ' "output_bytes": 2048,'
        ' "output_digest": "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752",'
        ' "usage": {"input_tokens": 128, "output_tokens": 512, "cost_micros": 1500,'
        ' "currency": "USD"}}',
        idx, start_digest
    )::jsonb
$$;

-- Ready model steps for idx = base + client * 1000000 + 0 .. per_client-1, one run each,
-- in the state ql3.create_run and ql3.add_step_run leave them (version 1, no events).
CREATE FUNCTION bench_prepare(base bigint, clients integer, per_client integer) RETURNS void
LANGUAGE sql
AS $$
    INSERT INTO ql3.runs (run_id, project_id, trace_id)
    SELECT ('00000000-0000-4000-8000-' || i)::uuid, 'bench', 'trace-' || i
    FROM generate_series(0, clients - 1) AS c, generate_series(0, per_client - 1) AS k,
         LATERAL (SELECT base + c * 1000000 + k AS i) AS x;
    INSERT INTO ql3.step_runs (step_run_id, run_id, kind)
    SELECT ('00000000-0000-4000-9000-' || i)::uuid, ('00000000-0000-4000-8000-' || i)::uuid,
           'model'
    FROM generate_series(0, clients - 1) AS c, generate_series(0, per_client - 1) AS k,
         LATERAL (SELECT base + c * 1000000 + k AS i) AS x;
$$;
"""

_BASE0 = 100_000_000_000
_BATCH = 10_000_000  # ids of one batch: base + client * 1000000 + 0 .. 999999, clients <= 9
_MAX_PER_CLIENT = 999_999

# What a pair changes in each table it writes: rows, the counters of the rows it updates,
# and bytes (pg_column_size of every row, so that the floor's rows have the real sizes).
_FOOTPRINT_TABLES = (
    "ql3_ai.model_invocation_starts",
    "ql3_ai.model_invocation_completions",
    "ql3_ai.model_invocation_resolutions",
    "ql3_ai.usage_ledger",
    "ql3.run_events",
    "ql3.step_run_mutations",
    "ql3.runs",
    "ql3.step_runs",
)
_FOOTPRINT_COUNTERS = (  # name, value, FROM ...
    ("ql3.runs sum(version)", "sum(version)", "ql3.runs"),
    ("ql3.runs sum(event_seq)", "sum(event_seq)", "ql3.runs"),
    ("ql3.step_runs sum(version)", "sum(version)", "ql3.step_runs"),
    ("ql3.step_runs sum(attempt_count)", "sum(attempt_count)", "ql3.step_runs"),
    ("ql3.step_runs succeeded", "count(*)", "ql3.step_runs WHERE status = 'succeeded'"),
    ("ql3.step_runs running", "count(*)", "ql3.step_runs WHERE status = 'running'"),
)
_FOOTPRINT_SQL = "\nUNION ALL\n".join(
    [
        f"SELECT '{table} rows', count(*), sum(pg_column_size(t.*))::bigint FROM {table} AS t"
        for table in _FOOTPRINT_TABLES
    ]
    + [
        f"SELECT '{name}', {value}::bigint, NULL FROM {source}"
        for name, value, source in _FOOTPRINT_COUNTERS
    ]
)


def _completions(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM ql3_ai.model_invocation_completions").fetchone()
        assert row is not None
        return int(row[0])


def _footprint(dsn: str) -> dict[str, int]:
    """Every figure of ``_FOOTPRINT_SQL`` (row counts and counters; ``... bytes`` too)."""
    out: dict[str, int] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, value, size in conn.execute(_FOOTPRINT_SQL).fetchall():
            out[name] = int(value or 0)
            if name.endswith(" rows"):
                out[name.removesuffix(" rows") + " bytes"] = int(size or 0)
    return out


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after}


class _Pairs:
    """One side run by pgbench (the pairs or the floor): a fresh batch of ready steps (the
    next base of ``bases``, which the sides share, so that ids never collide and every
    batch sorts after all earlier ones) before every pgbench run."""

    def __init__(
        self, name: str, dsn: str, script: str, bases: Iterator[int], env: dict[str, str]
    ) -> None:
        self.name = name
        self.dsn = dsn
        self.script = script
        self.bases = bases
        self.env = env
        # What the last run changed (``_FOOTPRINT_SQL``) when it was asked to count.
        self.footprint: dict[str, int] | None = None

    def run(
        self, clients: int, seconds: int, per_client: int, *, count: bool = False
    ) -> PgbenchRun:
        base = next(self.bases)
        per_client = min(per_client, _MAX_PER_CLIENT)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("SELECT bench_prepare(%s, %s, %s)", (base, clients, per_client))
            conn.execute("VACUUM ANALYZE")
        before = _completions(self.dsn)
        counted = _footprint(self.dsn) if count else None
        run = run_pgbench(
            self.dsn,
            ["-n", "-f", self.script, "-D", f"base={base}", "-D", "n=0"],
            clients=clients,
            seconds=seconds,
            env=self.env,
        )
        written = _completions(self.dsn) - before
        if run.failed or written != run.transactions:
            raise RuntimeError(
                f"{self.name}: pgbench processed {run.transactions} pairs ({run.failed} failed)"
                f" but {written} completions were written"
            )
        self.footprint = None if counted is None else _delta(counted, _footprint(self.dsn))
        return run


def _check_floor(
    pair: PgbenchRun, pair_fp: dict[str, int], floor: PgbenchRun, floor_fp: dict[str, int]
) -> dict[str, float]:
    """Raises unless the floor changed every table as the pairs did, per pair: the same rows
    and counters exactly, the same bytes to the byte (a sum of ``pg_column_size(t.*)`` can
    be a few bytes off in total); the per-pair changes."""

    def same(name: str) -> bool:
        if name.endswith(" bytes"):
            return round(pair_fp[name] / pair.transactions) == round(
                floor_fp[name] / floor.transactions
            )
        return pair_fp[name] * floor.transactions == floor_fp[name] * pair.transactions

    differ = [
        f"{name}: pairs {pair_fp[name] / pair.transactions:g}"
        f" floor {floor_fp[name] / floor.transactions:g} per pair"
        for name in pair_fp
        if not same(name)
    ]
    if differ:
        raise RuntimeError("floor: does not write what a pair writes: " + "; ".join(differ))
    return {
        name: round(value / pair.transactions, 0 if name.endswith(" bytes") else 2)
        for name, value in pair_fp.items()
    }


@dataclass(frozen=True)
class _Sample:
    """One side's run in a round: its rate and the units it completed."""

    per_s: float
    count: int


class _Dbos:
    """The DBOS side: one run per round, until one cannot be measured (``reason`` says why;
    then every later round skips it)."""

    def __init__(self, base_dsn: str) -> None:
        self.base_dsn = base_dsn
        self.reason: str | None = dbos_pairs.available()

    def run(self, clients: int, seconds: int) -> _Sample | None:
        if self.reason is not None:
            return None
        try:
            done = dbos_pairs.measure(self.base_dsn, [clients], seconds)[clients]
        except dbos_pairs.NotMeasured as exc:
            self.reason = str(exc)
            return None
        return _Sample(done.per_s, done.workflows)


def _rounds(
    pairs: _Pairs,
    floor: _Pairs,
    function_floor: _Pairs,
    tpcb_dsn: str,
    dbos: _Dbos,
    clients: int,
    rounds: int,
    seconds: int,
    per_client: int,
    floor_per_client: int,
) -> dict[str, list[_Sample | None]]:
    """``rounds`` runs of each side, alternating (``bench.common.alternating``); the
    function floor's batches are sized as the floor's."""

    def tpcb() -> _Sample:
        done = run_pgbench(tpcb_dsn, ["-b", "tpcb-like"], clients=clients, seconds=seconds)
        return _Sample(done.tps, done.transactions)

    def pair() -> _Sample:
        done = pairs.run(clients, seconds, per_client)
        return _Sample(done.tps, done.transactions)

    def floor_pair() -> _Sample:
        done = floor.run(clients, seconds, floor_per_client)
        return _Sample(done.tps, done.transactions)

    def function_floor_pair() -> _Sample:
        done = function_floor.run(clients, seconds, floor_per_client)
        return _Sample(done.tps, done.transactions)

    sides: dict[str, Callable[[], _Sample | None]] = {
        "tpcb": tpcb,
        "pairs": pair,
        "floor": floor_pair,
        "function_floor": function_floor_pair,
        "dbos": lambda: dbos.run(clients, seconds),
    }
    return alternating(sides, rounds)


def _per_s(samples: list[_Sample]) -> list[float]:
    return [s.per_s for s in samples]


def _floor_rows(
    key: str,
    clients: int,
    pair_runs: list[_Sample],
    floor_runs: list[_Sample],
    runs: dict[str, list[_Sample | None]],
    figures: dict[str, Any],
    ratios: dict[str, float],
    checks: dict[str, Any],
    rows: list[Row],
) -> bool | None:
    """The rows against the floor of the same rounds (D61): the function floor's (what a
    SECURITY DEFINER function costs by itself), then the pairs' (issue 23's target at
    ``TARGET_CLIENTS``). The pairs' verdict, or None where there is no target."""
    function_runs = _every_round(runs["function_floor"])
    assert function_runs is not None  # a function floor run raises instead
    plural = "s" if clients > 1 else ""
    base_text = (
        f"{median([r.per_s for r in floor_runs]):,.0f} /s floor (the pair's rows by plain SQL)"
    )
    function = against(_per_s(function_runs), _per_s(floor_runs))
    pairs = against(_per_s(pair_runs), _per_s(floor_runs))
    figures[f"function_floor_pairs_per_s_{key}"] = round(function.per_s, 1)
    figures[f"function_floor_over_floor_by_round_{key}"] = function.by_round
    figures[f"pairs_over_floor_by_round_{key}"] = pairs.by_round
    ratios[f"function_floor_over_floor_{key}"] = function.ratio
    ratios[f"pairs_over_floor_{key}"] = pairs.ratio
    checks[f"function_floor_completions_written_{key}"] = sum(r.count for r in function_runs)
    label = (
        f"admit+complete floor in functions/s, {clients} client{plural}: the floor's"
        " statements in SECURITY DEFINER functions, as ql3_runtime"
    )
    rows.append(diagnostic_row(label, function, base_text))
    ok: bool | None = None
    if clients == TARGET_CLIENTS:
        ok = pairs.ratio >= TARGET_FLOOR_RATIO
    label = f"admit+complete pairs/s against their floor, {clients} client{plural}"
    rows.append(judged_row(label, pairs, base_text, TARGET_FLOOR_RATIO, ok))
    return ok


def _every_round(samples: list[_Sample | None]) -> list[_Sample] | None:
    """The samples of a side, or None if any round could not measure it."""
    done = [s for s in samples if s is not None]
    return done if len(done) == len(samples) else None


def run(settings: Settings) -> Result:
    rounds, seconds = (1, 2) if settings.quick else (ROUNDS, ROUND_SECONDS)
    figures: dict[str, Any] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    checks: dict[str, Any] = {}
    rows: list[Row] = []
    passed: bool | None = None
    dbos_passed: bool | None = None
    dbos = _Dbos(settings.base_dsn)
    tpcb_db = f"bench_tpcb_{os.getpid()}"
    floor_per_pair: dict[str, float] | None = None
    with (
        fresh_database(settings.base_dsn, "pairs") as dsn,
        tempfile.NamedTemporaryFile("w", suffix=".pgbench", prefix="ql3-pairs-") as f,
        tempfile.NamedTemporaryFile("w", suffix=".pgbench", prefix="ql3-floor-") as ff,
        tempfile.NamedTemporaryFile("w", suffix=".pgbench", prefix="ql3-ffloor-") as fff,
    ):
        for file, script in ((f, PAIR_SCRIPT), (ff, FLOOR_SCRIPT), (fff, FUNCTION_FLOOR_SCRIPT)):
            file.write(script)
            file.flush()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP_SQL)
            conn.execute(_function_floor_sql())
        with psycopg.connect(settings.base_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{tpcb_db}"')
        tpcb_dsn = with_dbname(settings.base_dsn, tpcb_db)
        try:
            subprocess.run(
                [str(PG_BIN / "pgbench"), "-i", "-q", "-s", "8", tpcb_dsn],
                check=True,
                capture_output=True,
            )
            bases = itertools.count(_BASE0 + _BATCH, _BATCH)
            pairs = _Pairs("pairs", dsn, f.name, bases, RUNTIME_ENV)
            floor = _Pairs("floor", dsn, ff.name, bases, OWNER_ENV)
            function_floor = _Pairs("function floor", dsn, fff.name, bases, RUNTIME_ENV)
            for clients in CLIENT_COUNTS:
                # Warm-up (plans, buffers); its rate sizes the batch of ready steps. The
                # first warm-ups also count what one pair and one floor pair change.
                count = floor_per_pair is None
                warm = pairs.run(clients, 1, 5000, count=count)
                floor_warm = floor.run(clients, 1, 10000, count=count)
                function_warm = function_floor.run(clients, 1, 10000, count=count)
                if pairs.footprint is not None and floor.footprint is not None:
                    floor_per_pair = _check_floor(
                        warm, pairs.footprint, floor_warm, floor.footprint
                    )
                if pairs.footprint is not None and function_floor.footprint is not None:
                    _check_floor(warm, pairs.footprint, function_warm, function_floor.footprint)
                run_pgbench(tpcb_dsn, ["-b", "tpcb-like"], clients=clients, seconds=1)
                per_client = math.ceil(warm.tps / clients * seconds * 3) + 1000
                floor_per_client = math.ceil(floor_warm.tps / clients * seconds * 3) + 1000
                runs = _rounds(
                    pairs,
                    floor,
                    function_floor,
                    tpcb_dsn,
                    dbos,
                    clients,
                    rounds,
                    seconds,
                    per_client,
                    floor_per_client,
                )
                pair_runs, tpcb_runs = _every_round(runs["pairs"]), _every_round(runs["tpcb"])
                assert pair_runs is not None and tpcb_runs is not None  # these raise instead
                over_tpcb = against(_per_s(pair_runs), _per_s(tpcb_runs))
                pairs_tps = over_tpcb.per_s
                tpcb_tps = median([r.per_s for r in tpcb_runs])
                key = f"{clients}_clients"
                figures[f"pairs_per_s_{key}"] = round(pairs_tps, 1)
                figures[f"pairs_over_tpcb_by_round_{key}"] = over_tpcb.by_round
                baseline[f"pgbench_tpcb_like_tps_{key}"] = round(tpcb_tps, 1)
                ratios[key] = over_tpcb.ratio
                written = sum(r.count for r in pair_runs)
                checks[f"pairs_{key}"] = written
                checks[f"completions_written_{key}"] = written
                ok: bool | None = None
                if clients == TARGET_CLIENTS:
                    ok = ratios[key] >= TARGET_RATIO
                    passed = ok
                plural = "s" if clients > 1 else ""
                tpcb_text = f"{tpcb_tps:,.0f} /s pgbench tpcb-like"
                label = f"admit+complete pairs/s, {clients} client{plural}"
                rows.append(judged_row(label, over_tpcb, tpcb_text, TARGET_RATIO, ok))
                floor_runs = _every_round(runs["floor"])
                assert floor_runs is not None  # a floor run raises instead
                floor_over_tpcb = against(_per_s(floor_runs), _per_s(tpcb_runs))
                figures[f"floor_pairs_per_s_{key}"] = round(floor_over_tpcb.per_s, 1)
                figures[f"floor_over_tpcb_by_round_{key}"] = floor_over_tpcb.by_round
                ratios[f"floor_{key}"] = floor_over_tpcb.ratio
                checks[f"floor_completions_written_{key}"] = sum(r.count for r in floor_runs)
                label = (
                    f"admit+complete floor/s, {clients} client{plural}: the pair's rows written"
                    " by plain SQL"
                )
                rows.append(diagnostic_row(label, floor_over_tpcb, tpcb_text))
                floor_ok = _floor_rows(
                    key, clients, pair_runs, floor_runs, runs, figures, ratios, checks, rows
                )
                if floor_ok is not None:
                    passed = bool(passed) and floor_ok
                dbos_runs = _every_round(runs["dbos"])
                dbos_tps: float | None = None
                dbos_ok: bool | None = None
                if dbos_runs is not None:
                    dbos_tps = median([r.per_s for r in dbos_runs])
                    over_dbos = against(_per_s(pair_runs), _per_s(dbos_runs))
                    baseline[f"dbos_one_step_workflows_per_s_{key}"] = round(dbos_tps, 1)
                    ratios[f"pairs_over_dbos_{key}"] = over_dbos.ratio
                    figures[f"pairs_over_dbos_by_round_{key}"] = over_dbos.by_round
                    checks[f"dbos_workflows_{key}"] = sum(r.count for r in dbos_runs)
                    if clients == TARGET_CLIENTS:
                        dbos_ok = ratios[f"pairs_over_dbos_{key}"] >= TARGET_DBOS_RATIO
                        dbos_passed = dbos_ok
                rows.append(
                    Row(
                        label=f"admit+complete pairs/s vs DBOS, {clients} client{plural}",
                        figure=f"{pairs_tps:,.0f} /s",
                        baseline=(
                            f"{dbos_tps:,.0f} /s DBOS one-step workflows"
                            if dbos_tps is not None
                            else f"DBOS not measured: {dbos.reason}"
                        ),
                        ratio=None if dbos_tps is None else ratios[f"pairs_over_dbos_{key}"],
                        target=(
                            f"ratio >= {TARGET_DBOS_RATIO:g}"
                            if clients == TARGET_CLIENTS and dbos_tps is not None
                            else "none"
                        ),
                        result=verdict(dbos_ok),
                    )
                )
        finally:
            with (
                suppress(psycopg.Error),
                psycopg.connect(settings.base_dsn, autocommit=True) as conn,
            ):
                conn.execute(f'DROP DATABASE IF EXISTS "{tpcb_db}" WITH (FORCE)')
    if passed is not None and dbos_passed is not None:
        passed = passed and dbos_passed
    if floor_per_pair is not None:
        checks["floor_changes_per_pair_as_pairs"] = floor_per_pair
    return Result(
        name="pairs",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"pairs/s >= {TARGET_RATIO} x pgbench tpcb-like TPS, >= {TARGET_FLOOR_RATIO} x the"
            f" floor's and >= {TARGET_DBOS_RATIO:g} x DBOS one-step workflows/s at"
            f" {TARGET_CLIENTS} clients (DBOS when measured)"
        ),
        passed=passed,
        rows=rows,
        checks=checks,
        notes=[
            f"pgbench -M prepared -c C -j C -T {seconds} on both sides, {rounds} rounds (order"
            " reversed every other round), after 1 s warm-ups; figures are the medians over the"
            " rounds, the tpcb-like ratio the median of the per-round ratios; pairs as"
            " ql3_runtime (PGOPTIONS -c role=ql3_runtime), tpcb-like in its own database"
            " (pgbench -i -s 8); each pairs run on a fresh batch of ready steps",
            "a pair = admit_invocation + complete_invocation (succeeded, with usage) of a ready"
            " model step created before the timed window; completions written = pairs",
            "floor (diagnostic, no target): the rows one pair writes (start receipt, step"
            " ready->running, run event_seq/version, run event, step mutation; then completion"
            " receipt, usage_ledger row, step running->succeeded, run, run event, mutation)"
            " written by plain SQL, one autocommitted statement of data-modifying CTEs per"
            " transaction, two transactions per pgbench transaction, as ql3_owner, on the same"
            " schema (all constraints, foreign keys, indexes and triggers), on its own fresh"
            " batches of ready steps, one more pgbench side of every round; no function, no"
            " validation, no reads beyond the fenced step/run UPDATEs (which take the row locks),"
            " no digests (md5 strings of the same length); checked once to change every table"
            " exactly as a pair does (rows, counters, bytes): what the schema's writing alone"
            " costs, the ceiling of any admit/complete implementation on this schema",
            "function floor (diagnostic, D61): the floor's two statements, each the body of a"
            " PL/pgSQL function made as ql3's are (SECURITY DEFINER, owned by ql3_owner,"
            " search_path pinned, EXECUTE for ql3_runtime alone), called as ql3_runtime, a fourth"
            " side of every round on batches sized as the floor's, checked once to change every"
            " table exactly as a pair does: the floor plus the price of the trust boundary (D46),"
            " before any check, read or digest; pairs against the floor: the median of the"
            " per-round ratios, issue 23's target at 8 clients",
            (
                f"DBOS Transact {dbos_pairs.version()}: one workflow with one step (no I/O) per"
                " model call, C threads through its synchronous API, system database on the same"
                f" server, a third side of every round ({seconds} s after a"
                f" {dbos_pairs.WARMUP_SECONDS:g} s warm-up, in a fresh system database); its ratio"
                " is the median of the per-round ratios"
                if dbos.reason is None
                else f"DBOS comparison not measured: {dbos.reason}"
            ),
        ],
    )
