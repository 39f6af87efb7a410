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
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
from collections.abc import Callable
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
    alternating,
    fresh_database,
    median,
    ratio,
    run_pgbench,
    verdict,
    with_dbname,
)
from ql3.devservers import PG_BIN

TARGET_RATIO = 0.4
TARGET_DBOS_RATIO = 4.0
TARGET_CLIENTS = 8
CLIENT_COUNTS = (1, 8)
ROUNDS = 5
ROUND_SECONDS = 4
RUNTIME_ENV = {"PGOPTIONS": "-c role=ql3_runtime"}

PAIR_SCRIPT = """\
\\set idx :base + :client_id * 1000000 + :n
\\set n :n + 1
SELECT a.r ->> 'start_digest' AS sd
FROM (SELECT ql3_ai.admit_invocation(bench_admission(:idx)) AS r) AS a \\gset
SELECT ql3_ai.complete_invocation(bench_completion(:idx, :sd));
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
_MAX_PER_CLIENT = 999_999


def _completions(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM ql3_ai.model_invocation_completions").fetchone()
        assert row is not None
        return int(row[0])


class _Pairs:
    """The pair side: a fresh batch of ready steps (new base) before every pgbench run."""

    def __init__(self, dsn: str, script: str) -> None:
        self.dsn = dsn
        self.script = script
        self.rounds = 0

    def run(self, clients: int, seconds: int, per_client: int) -> PgbenchRun:
        self.rounds += 1
        base = _BASE0 + self.rounds * 10_000_000
        per_client = min(per_client, _MAX_PER_CLIENT)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("SELECT bench_prepare(%s, %s, %s)", (base, clients, per_client))
            conn.execute("VACUUM ANALYZE")
        before = _completions(self.dsn)
        run = run_pgbench(
            self.dsn,
            ["-n", "-f", self.script, "-D", f"base={base}", "-D", "n=0"],
            clients=clients,
            seconds=seconds,
            env=RUNTIME_ENV,
        )
        written = _completions(self.dsn) - before
        if run.failed or written != run.transactions:
            raise RuntimeError(
                f"pairs: pgbench processed {run.transactions} pairs ({run.failed} failed)"
                f" but {written} completions were written"
            )
        return run


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
    tpcb_dsn: str,
    dbos: _Dbos,
    clients: int,
    rounds: int,
    seconds: int,
    per_client: int,
) -> dict[str, list[_Sample | None]]:
    """``rounds`` runs of each side, alternating (``bench.common.alternating``)."""

    def tpcb() -> _Sample:
        done = run_pgbench(tpcb_dsn, ["-b", "tpcb-like"], clients=clients, seconds=seconds)
        return _Sample(done.tps, done.transactions)

    def pair() -> _Sample:
        done = pairs.run(clients, seconds, per_client)
        return _Sample(done.tps, done.transactions)

    sides: dict[str, Callable[[], _Sample | None]] = {
        "tpcb": tpcb,
        "pairs": pair,
        "dbos": lambda: dbos.run(clients, seconds),
    }
    return alternating(sides, rounds)


def _every_round(samples: list[_Sample | None]) -> list[_Sample] | None:
    """The samples of a side, or None if any round could not measure it."""
    done = [s for s in samples if s is not None]
    return done if len(done) == len(samples) else None


def run(settings: Settings) -> Result:
    rounds, seconds = (1, 2) if settings.quick else (ROUNDS, ROUND_SECONDS)
    figures: dict[str, Any] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    checks: dict[str, int] = {}
    rows: list[Row] = []
    passed: bool | None = None
    dbos_passed: bool | None = None
    dbos = _Dbos(settings.base_dsn)
    tpcb_db = f"bench_tpcb_{os.getpid()}"
    with (
        fresh_database(settings.base_dsn, "pairs") as dsn,
        tempfile.NamedTemporaryFile("w", suffix=".pgbench", prefix="ql3-pairs-") as f,
    ):
        f.write(PAIR_SCRIPT)
        f.flush()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP_SQL)
        with psycopg.connect(settings.base_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{tpcb_db}"')
        tpcb_dsn = with_dbname(settings.base_dsn, tpcb_db)
        try:
            subprocess.run(
                [str(PG_BIN / "pgbench"), "-i", "-q", "-s", "8", tpcb_dsn],
                check=True,
                capture_output=True,
            )
            pairs = _Pairs(dsn, f.name)
            for clients in CLIENT_COUNTS:
                # Warm-up (plans, buffers); its rate sizes the batch of ready steps.
                warm = pairs.run(clients, 1, 5000)
                run_pgbench(tpcb_dsn, ["-b", "tpcb-like"], clients=clients, seconds=1)
                per_client = math.ceil(warm.tps / clients * seconds * 3) + 1000
                runs = _rounds(pairs, tpcb_dsn, dbos, clients, rounds, seconds, per_client)
                pair_runs, tpcb_runs = _every_round(runs["pairs"]), _every_round(runs["tpcb"])
                assert pair_runs is not None and tpcb_runs is not None  # these raise instead
                per_round = [
                    ratio(p.per_s, t.per_s) for p, t in zip(pair_runs, tpcb_runs, strict=True)
                ]
                pairs_tps = median([r.per_s for r in pair_runs])
                tpcb_tps = median([r.per_s for r in tpcb_runs])
                key = f"{clients}_clients"
                figures[f"pairs_per_s_{key}"] = round(pairs_tps, 1)
                figures[f"pairs_over_tpcb_by_round_{key}"] = per_round
                baseline[f"pgbench_tpcb_like_tps_{key}"] = round(tpcb_tps, 1)
                ratios[key] = round(median(per_round), 3)
                written = sum(r.count for r in pair_runs)
                checks[f"pairs_{key}"] = written
                checks[f"completions_written_{key}"] = written
                ok: bool | None = None
                if clients == TARGET_CLIENTS:
                    ok = ratios[key] >= TARGET_RATIO
                    passed = ok
                plural = "s" if clients > 1 else ""
                rows.append(
                    Row(
                        label=f"admit+complete pairs/s, {clients} client{plural}",
                        figure=(
                            f"{pairs_tps:,.0f} /s (ratio per round {min(per_round):.3f}"
                            f" to {max(per_round):.3f})"
                        ),
                        baseline=f"{tpcb_tps:,.0f} /s pgbench tpcb-like",
                        ratio=ratios[key],
                        target=f"ratio >= {TARGET_RATIO}" if ok is not None else "none",
                        result=verdict(ok),
                    )
                )
                dbos_runs = _every_round(runs["dbos"])
                dbos_tps: float | None = None
                dbos_ok: bool | None = None
                if dbos_runs is not None:
                    dbos_tps = median([r.per_s for r in dbos_runs])
                    over_dbos = [
                        ratio(p.per_s, d.per_s) for p, d in zip(pair_runs, dbos_runs, strict=True)
                    ]
                    baseline[f"dbos_one_step_workflows_per_s_{key}"] = round(dbos_tps, 1)
                    ratios[f"pairs_over_dbos_{key}"] = round(median(over_dbos), 3)
                    figures[f"pairs_over_dbos_by_round_{key}"] = over_dbos
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
    return Result(
        name="pairs",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"pairs/s >= {TARGET_RATIO} x pgbench tpcb-like TPS and >= {TARGET_DBOS_RATIO:g} x DBOS"
            f" one-step workflows/s at {TARGET_CLIENTS} clients (DBOS when measured)"
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
