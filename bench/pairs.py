"""admit+complete pairs/s against pgbench tpcb-like TPS, same server, same run.

A pair is one pgbench transaction of ``PAIR_SCRIPT`` = two database transactions (each
``SELECT`` autocommits): ``ql3_ai.admit_invocation`` of a fresh ready model step, created
beforehand by ``bench_prepare`` outside the timed window, then
``ql3_ai.complete_invocation`` of it (succeeded, with usage, so a usage_ledger row is
written too). pairs/s = pgbench's tps. The pairs run as ``ql3_runtime`` (PGOPTIONS
``-c role=ql3_runtime``). The baseline is pgbench's built-in tpcb-like in its own database
(``pgbench -i -s 8``). Both sides: ``pgbench -M prepared -c C -j C -T S``.

The peer comparison (issue 4): DBOS Transact at the same client counts in the same run,
one workflow with one step per model call, its system database on the same server
(``bench.dbos_pairs``); reported as "not measured: <reason>" when DBOS cannot run here.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from contextlib import suppress

import psycopg

from bench import dbos_pairs
from bench.common import (
    PgbenchRun,
    Result,
    Row,
    Settings,
    fresh_database,
    ratio,
    verdict,
    with_dbname,
)
from ql3.devservers import PG_BIN

TARGET_RATIO = 0.4
TARGET_DBOS_RATIO = 4.0
TARGET_CLIENTS = 8
CLIENT_COUNTS = (1, 8)
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

_PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
_FAILED = re.compile(r"number of failed transactions: (\d+)")
_TPS = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")
_BASE0 = 100_000_000_000
_MAX_PER_CLIENT = 999_999


def _pgbench(
    dsn: str, args: Sequence[str], *, clients: int, seconds: int, env: dict[str, str] | None = None
) -> PgbenchRun:
    """``pgbench -M prepared -c C -j C -T S ARGS DSN``, parsed."""
    done = subprocess.run(
        [str(PG_BIN / "pgbench"), "-M", "prepared", "-c", str(clients), "-j", str(clients),
         "-T", str(seconds), *args, dsn],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr.strip()}")
    out = done.stdout
    processed, tps = _PROCESSED.search(out), _TPS.search(out)
    if processed is None or tps is None:
        raise RuntimeError(f"cannot parse pgbench output:\n{out}")
    failed = _FAILED.search(out)
    return PgbenchRun(
        clients=clients,
        seconds=seconds,
        transactions=int(processed.group(1)),
        failed=int(failed.group(1)) if failed else 0,
        tps=float(tps.group(1)),
    )


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
        run = _pgbench(
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


def run(settings: Settings) -> Result:
    seconds = 2 if settings.quick else 10
    figures: dict[str, float] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    checks: dict[str, int] = {}
    rows: list[Row] = []
    passed: bool | None = None
    dbos_passed: bool | None = None
    dbos_reason: str | None = dbos_pairs.available()
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
                _pgbench(tpcb_dsn, ["-b", "tpcb-like"], clients=clients, seconds=1)
                per_client = math.ceil(warm.tps / clients * seconds * 3) + 1000
                tpcb = _pgbench(tpcb_dsn, ["-b", "tpcb-like"], clients=clients, seconds=seconds)
                pair = pairs.run(clients, seconds, per_client)
                key = f"{clients}_clients"
                figures[f"pairs_per_s_{key}"] = round(pair.tps, 1)
                baseline[f"pgbench_tpcb_like_tps_{key}"] = round(tpcb.tps, 1)
                ratios[key] = ratio(pair.tps, tpcb.tps)
                checks[f"pairs_{key}"] = pair.transactions
                checks[f"completions_written_{key}"] = pair.transactions
                ok: bool | None = None
                if clients == TARGET_CLIENTS:
                    ok = ratios[key] >= TARGET_RATIO
                    passed = ok
                plural = "s" if clients > 1 else ""
                rows.append(
                    Row(
                        label=f"admit+complete pairs/s, {clients} client{plural}",
                        figure=f"{pair.tps:,.0f} /s",
                        baseline=f"{tpcb.tps:,.0f} /s pgbench tpcb-like",
                        ratio=ratios[key],
                        target=f"ratio >= {TARGET_RATIO}" if ok is not None else "none",
                        result=verdict(ok),
                    )
                )
                dbos: dbos_pairs.DbosRun | None = None
                if dbos_reason is None:
                    try:
                        dbos = dbos_pairs.measure(settings.base_dsn, [clients], seconds)[clients]
                    except dbos_pairs.NotMeasured as exc:
                        dbos_reason = str(exc)
                dbos_ok: bool | None = None
                if dbos is not None:
                    baseline[f"dbos_one_step_workflows_per_s_{key}"] = dbos.per_s
                    ratios[f"pairs_over_dbos_{key}"] = ratio(pair.tps, dbos.per_s)
                    checks[f"dbos_workflows_{key}"] = dbos.workflows
                    if clients == TARGET_CLIENTS:
                        dbos_ok = ratios[f"pairs_over_dbos_{key}"] >= TARGET_DBOS_RATIO
                        dbos_passed = dbos_ok
                rows.append(
                    Row(
                        label=f"admit+complete pairs/s vs DBOS, {clients} client{plural}",
                        figure=f"{pair.tps:,.0f} /s",
                        baseline=(
                            f"{dbos.per_s:,.0f} /s DBOS one-step workflows"
                            if dbos is not None
                            else f"DBOS not measured: {dbos_reason}"
                        ),
                        ratio=None if dbos is None else ratios[f"pairs_over_dbos_{key}"],
                        target=(
                            f"ratio >= {TARGET_DBOS_RATIO:g}"
                            if clients == TARGET_CLIENTS and dbos is not None
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
            f"pgbench -M prepared -c C -j C -T {seconds} on both sides, after a 1 s warm-up;"
            " pairs as ql3_runtime (PGOPTIONS -c role=ql3_runtime), tpcb-like in its own"
            " database (pgbench -i -s 8)",
            "a pair = admit_invocation + complete_invocation (succeeded, with usage) of a ready"
            " model step created before the timed window; completions written = pairs",
            (
                f"DBOS Transact {dbos_pairs.version()}: one workflow with one step (no I/O) per"
                " model call, C threads through its synchronous API, system database on the same"
                f" server, {seconds} s after a {dbos_pairs.WARMUP_SECONDS:g} s warm-up"
                if dbos_reason is None
                else f"DBOS comparison not measured: {dbos_reason}"
            ),
        ],
    )
