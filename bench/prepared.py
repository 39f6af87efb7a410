"""What psycopg's prepared statements would buy ql3's stores on a direct connection (D54).

ql3's connections prepare nothing unless ``QL3_PREPARED_STATEMENTS=on``, since behind a
transaction pooler a prepared statement's name runs another client's statement. This
measures what that safe default costs, one client through ``PgStore``, both sides
alternating in one run on one server:

- reads: ``active_revision`` calls per second;
- pairs: ``create_run``, ``add_step_run``, admit, complete (a durable model call on a
  new step, as a user runs it) per second.

The figure is the default (no preparation); the baseline prepares (psycopg's threshold
of 5). A ratio below 1 is the cost of the default.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from bench.common import (
    FAMILY,
    PROJECT,
    Result,
    Row,
    Settings,
    alternating,
    contract_pair,
    fresh_database,
    median,
    ratio,
)
from ql3 import pooler
from ql3.invocations import Outcome, admission_command, completion_command, request_digest
from ql3.store import PgStore

CONTRACT = "prepared"


def _store(dsn: str, prepare: bool) -> PgStore:
    """A one-connection PgStore with automatic preparation on or off (its pool reads
    ``QL3_PREPARED_STATEMENTS`` when it is made)."""
    saved = os.environ.get(pooler.PREPARED_STATEMENTS_VAR)
    os.environ[pooler.PREPARED_STATEMENTS_VAR] = "on" if prepare else "off"
    try:
        return PgStore(dsn, max_connections=1)
    finally:
        if saved is None:
            del os.environ[pooler.PREPARED_STATEMENTS_VAR]
        else:
            os.environ[pooler.PREPARED_STATEMENTS_VAR] = saved


def _pair(store: PgStore) -> None:
    run_id = store.create_run(PROJECT, "prepared-bench")
    step = store.add_step_run(run_id, "model")
    admitted = store.admit_invocation(
        admission_command(
            invocation_id=f"inv-{uuid.uuid4().hex}",
            request_id=f"req-{uuid.uuid4().hex}",
            project_id=PROJECT,
            run_id=run_id,
            step_run_id=step,
            trace_id="prepared-bench",
            expected_step_run_version=1,
            provider="bench",
            model="bench-model",
            policy=None,
            request_digest=request_digest(b"bench"),
            input_bytes=5,
            deadline_at=datetime.now(UTC) + timedelta(hours=1),
        )
    )
    store.complete_invocation(
        completion_command(
            invocation_id=admitted["start"]["invocation_id"],
            start_digest=admitted["start_digest"],
            outcome=Outcome.SUCCEEDED,
            result_code="ok",
            output_bytes=0,
            output_digest=request_digest(b""),
        )
    )


def _rate(call: Callable[[], Any], seconds: float) -> float:
    """Calls per second over ``seconds`` (after 20 untimed calls)."""
    for _ in range(20):
        call()
    count = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        call()
        count += 1
    return count / elapsed


def run(settings: Settings) -> Result:
    seconds, rounds = (0.5, 2) if settings.quick else (3.0, 7)
    with fresh_database(settings.base_dsn, "prepared") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            contract_pair(conn, CONTRACT)
        stores = {"off": _store(dsn, False), "on": _store(dsn, True)}
        try:

            def reads(store: PgStore) -> Callable[[], float]:
                return lambda: _rate(
                    lambda: store.active_revision(PROJECT, FAMILY, CONTRACT), seconds
                )

            def pairs(store: PgStore) -> Callable[[], float]:
                return lambda: _rate(lambda: _pair(store), seconds)

            read_runs = alternating({k: reads(s) for k, s in stores.items()}, rounds)
            pair_runs = alternating({k: pairs(s) for k, s in stores.items()}, rounds)
        finally:
            for store in stores.values():
                store.close()
    r = {k: median(v) for k, v in read_runs.items()}
    p = {k: median(v) for k, v in pair_runs.items()}
    return Result(
        name="prepared",
        figures={
            "reads_per_s_unprepared": round(r["off"]),
            "pairs_per_s_unprepared": round(p["off"]),
        },
        baseline={"reads_per_s_prepared": round(r["on"]), "pairs_per_s_prepared": round(p["on"])},
        ratio={"reads": ratio(r["off"], r["on"]), "pairs": ratio(p["off"], p["on"])},
        target=None,
        passed=None,
        rows=[
            Row(
                label="PgStore active_revision, 1 client, no prepared statements (default)",
                figure=f"{r['off']:,.0f}/s",
                baseline=f"{r['on']:,.0f}/s prepared",
                ratio=ratio(r["off"], r["on"]),
                target="(cost of the safe default)",
                result="n/a",
            ),
            Row(
                label="PgStore run+step+admit+complete, 1 client, no prepared statements",
                figure=f"{p['off']:,.0f}/s",
                baseline=f"{p['on']:,.0f}/s prepared",
                ratio=ratio(p["off"], p["on"]),
                target="(cost of the safe default)",
                result="n/a",
            ),
        ],
        notes=[f"medians of {rounds} alternating {seconds:g} s runs per side"],
    )
