"""DBOS Transact beside the pairs: one workflow with one step per model call, same server.

The peer comparison of issue 4. Each "model call" is one DBOS workflow whose one step
does no I/O, as a pair's provider call is absent; DBOS records the workflow and the
step's output in its system database, which lives on the bench PostgreSQL server (a
fresh database, dropped afterwards). C threads call the workflow function through DBOS's
synchronous API, each its own workflow after the other, for S seconds; workflows/s =
workflows finished / S. Checked afterwards: the system database holds one SUCCESS
workflow and one step output per workflow run.

DBOS is a process-wide singleton with threads of its own, so it runs in a child process
(``python -m bench.dbos_pairs --url URL --clients C --seconds S``, one JSON line on
stdout); the parent (``bench.pairs``) reports "not measured: <reason>" when the package
is missing or the child fails, instead of failing the whole benchmark.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import psycopg

from bench.common import REPO_ROOT, with_dbname

# The package the `bench` extra pins (pyproject.toml); the measurement needs nothing else.
PACKAGE = "dbos"
WARMUP_SECONDS = 1.0


@dataclass(frozen=True)
class DbosRun:
    clients: int
    seconds: float
    workflows: int
    per_s: float


class NotMeasured(Exception):
    """DBOS could not be measured here; the message says why."""


def available() -> str | None:
    """None when DBOS can be imported, else why not."""
    if importlib.util.find_spec(PACKAGE) is None:
        return "the dbos package is not installed (pip install -e '.[bench]')"
    return None


def version() -> str:
    """The installed DBOS version, or "?"."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def sqlalchemy_url(dsn: str) -> str:
    """A libpq DSN (key=value or URI) as the SQLAlchemy URL DBOS takes, psycopg 3 driver."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    user = quote(str(params.get("user", "postgres")), safe="")
    password = f":{quote(str(params['password']), safe='')}" if params.get("password") else ""
    host = str(params.get("host", "127.0.0.1"))
    port = params.get("port", "5432")
    if host.startswith("/"):  # a Unix socket directory goes in the query string
        return f"postgresql+psycopg://{user}{password}@/{params['dbname']}?host={host}&port={port}"
    return f"postgresql+psycopg://{user}{password}@{host}:{port}/{params['dbname']}"


def measure(base_dsn: str, client_counts: Sequence[int], seconds: float) -> dict[int, DbosRun]:
    """workflows/s at each client count, each in a fresh system database; NotMeasured if not."""
    reason = available()
    if reason is not None:
        raise NotMeasured(reason)
    runs: dict[int, DbosRun] = {}
    for clients in client_counts:
        dbname = f"bench_dbos_{os.getpid()}_{clients}"
        with psycopg.connect(base_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{dbname}"')
        try:
            runs[clients] = _child(sqlalchemy_url(with_dbname(base_dsn, dbname)), clients, seconds)
        finally:
            with psycopg.connect(base_dsn, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    return runs


def _child(url: str, clients: int, seconds: float) -> DbosRun:
    cmd = [sys.executable, "-m", "bench.dbos_pairs", "--url", url,
           "--clients", str(clients), "--seconds", str(seconds)]  # fmt: skip
    limit = seconds * 4 + 120
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        raise NotMeasured(f"the DBOS child did not finish within {limit:.0f} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise NotMeasured(f"the DBOS run failed ({done.returncode}): {tail[:300]}")
    doc = json.loads(lines[-1])
    return DbosRun(
        clients=int(doc["clients"]),
        seconds=float(doc["seconds"]),
        workflows=int(doc["workflows"]),
        per_s=float(doc["per_s"]),
    )


# -- the child -----------------------------------------------------------------------------


def _run(url: str, clients: int, seconds: float) -> dict[str, Any]:
    import logging

    from dbos import DBOS, DBOSConfig

    @DBOS.step()
    def model_call(i: int) -> int:
        return i  # no I/O: a pair's provider call is absent too

    @DBOS.workflow()
    def one_call(i: int) -> int:
        return model_call(i)

    config: DBOSConfig = {
        "name": "ql3-bench",
        "system_database_url": url,
        "sys_db_pool_size": clients + 4,
        "log_level": "WARNING",
        "enable_otlp": False,
    }
    DBOS(config=config)
    DBOS.launch()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    try:
        counts = [0] * clients
        errors: list[BaseException] = []

        def drive(slot: int, until: float, record: bool) -> None:
            i = slot * 10_000_000 + (5_000_000 if record else 0)
            try:
                while time.perf_counter() < until:
                    i += 1
                    if one_call(i) != i:
                        raise RuntimeError("the workflow returned another value")
                    if record:
                        counts[slot] += 1
            except BaseException as exc:  # reported by the parent thread
                errors.append(exc)

        timed_threads(drive, clients, WARMUP_SECONDS, False, errors)
        elapsed = timed_threads(drive, clients, seconds, True, errors)
        workflows = sum(counts)
    finally:
        DBOS.destroy()
    total = checked_system_database(
        url.replace("postgresql+psycopg://", "postgresql://"), workflows
    )
    return {
        "clients": clients,
        "seconds": round(elapsed, 3),
        "workflows": workflows,
        "per_s": round(workflows / elapsed, 1),
        "recorded_workflows": total,
    }


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dbos_pairs", description=__doc__)
    parser.add_argument("--url", required=True, help="SQLAlchemy URL of the system database")
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(_run(args.url, args.clients, args.seconds)), flush=True)
    return 0


def timed_threads(
    drive: Callable[[int, float, bool], None],
    workers: int,
    length: float,
    record: bool,
    errors: list[BaseException],
) -> float:
    """``drive(slot, until, record)`` in ``workers`` threads for ``length`` seconds: the
    seconds it took. Raises the first error a thread put in ``errors``."""
    started = time.perf_counter()
    until = started + length
    threads = [threading.Thread(target=drive, args=(n, until, record)) for n in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def checked_system_database(libpq_url: str, workflows: int) -> int:
    """The workflows DBOS recorded, once every one succeeded with its one step output and
    there are at least the ``workflows`` timed (plus the warm-up's); raises otherwise."""
    with psycopg.connect(libpq_url) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'),"
            " (SELECT count(*) FROM dbos.workflow_status),"
            " (SELECT count(*) FROM dbos.operation_outputs)"
        ).fetchone()
    assert row is not None
    succeeded, total, steps = (int(x) for x in row)
    if succeeded != total or steps != total or total < workflows:
        raise RuntimeError(
            f"system database holds {total} workflows ({succeeded} succeeded) and {steps} step"
            f" outputs after {workflows} timed workflows and a warm-up"
        )
    return total


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
