"""admit+complete pairs/s on SQLite (the edge shim) against raw single-row INSERT commits.

One client. ``ql3.edge.EdgeStore(path, journal_mode=...)`` in WAL (``synchronous=FULL``)
and DELETE (``synchronous=EXTRA``) mode: each pair builds its admission command with
``ql3.invocations`` builders, admits it, builds the completion (succeeded, with usage, so
a ledger row is written too) and completes it - two SQLite transactions. The ready model
steps are created in batches outside the timed windows. The baseline is stdlib
``sqlite3`` committing one single-row INSERT per transaction on another file in the same
temporary directory, same journal mode and synchronous setting. No target.
"""

from __future__ import annotations

import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from bench.common import Result, Row, Settings, ratio
from ql3.edge import EdgeStore
from ql3.invocations import (
    Outcome,
    PolicyBinding,
    Usage,
    admission_command,
    completion_command,
    output_digest,
    request_digest,
)

JOURNAL_MODES: tuple[Literal["wal", "delete"], ...] = ("wal", "delete")
SYNCHRONOUS = {"wal": "FULL", "delete": "EXTRA"}
PROJECT = "bench"
TRACE = "trace-bench"
PROMPT = b"x" * 512
OUTPUT = b"y" * 2048
USAGE = Usage(input_tokens=128, output_tokens=512, cost_micros=1500, currency="USD")
BATCH = 200


def ready_steps(store: Any, count: int) -> list[tuple[str, str]]:
    """``count`` new runs with one ready model step each: (run_id, step_run_id)."""
    out = []
    for _ in range(count):
        run_id = store.create_run(PROJECT, TRACE)
        out.append((run_id, store.add_step_run(run_id, "model")))
    return out


def admission_for(
    run_id: str, step_run_id: str, deadline: datetime, policy: PolicyBinding | None = None
) -> dict[str, Any]:
    """The admission command of a new invocation on a ready model step (under ``policy``,
    which the admission fences against the active revision, when given)."""
    return admission_command(
        invocation_id=f"inv-{uuid.uuid4().hex}",
        request_id=f"req-{uuid.uuid4().hex}",
        project_id=PROJECT,
        run_id=run_id,
        step_run_id=step_run_id,
        trace_id=TRACE,
        expected_step_run_version=1,
        provider="ollama",
        model="llama3.1:8b",
        policy=policy,
        request_digest=request_digest(PROMPT),
        input_bytes=len(PROMPT),
        deadline_at=deadline,
    )


def completion_for(admitted: Any) -> dict[str, Any]:
    """The succeeded completion (with usage) of an admission result; checks the result."""
    if admitted["status"] != "created":
        raise RuntimeError(f"admission: {admitted['status']}")
    return completion_command(
        invocation_id=admitted["start"]["invocation_id"],
        start_digest=admitted["start_digest"],
        outcome=Outcome.SUCCEEDED,
        result_code="ok",
        output_bytes=len(OUTPUT),
        output_digest=output_digest(OUTPUT),
        usage=USAGE,
    )


def check_completed(completed: Any) -> None:
    if completed["status"] != "created":
        raise RuntimeError(f"completion: {completed['status']}")


def pair(store: Any, run_id: str, step_run_id: str, deadline: datetime) -> None:
    """One admit+complete pair of a ready model step: two store transactions."""
    admitted = store.admit_invocation(admission_for(run_id, step_run_id, deadline))
    check_completed(store.complete_invocation(completion_for(admitted)))


def timed_loop(
    seconds: float, prepare: Callable[[], list[Any]], step: Callable[[Any], object]
) -> tuple[int, float]:
    """Runs ``step`` on batches from ``prepare`` (untimed) until ``seconds`` of timed
    work; (operations, timed seconds)."""
    done, spent = 0, 0.0
    while spent < seconds:
        for item in prepare():
            started = time.perf_counter()
            step(item)
            spent += time.perf_counter() - started
            done += 1
    return done, spent


def edge_pairs(path: Path, mode: Literal["wal", "delete"], seconds: float) -> tuple[int, float]:
    deadline = datetime.now(UTC) + timedelta(days=1)
    with EdgeStore(path, journal_mode=mode) as store:
        # Warm-up (statement caches, file pages), then the measured loop.
        for run_id, step_run_id in ready_steps(store, 20):
            pair(store, run_id, step_run_id, deadline)
        return timed_loop(
            seconds,
            lambda: ready_steps(store, BATCH),
            lambda ids: pair(store, ids[0], ids[1], deadline),
        )


def raw_inserts(path: Path, mode: Literal["wal", "delete"], seconds: float) -> tuple[int, float]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA journal_mode = {mode.upper()}")
        conn.execute(f"PRAGMA synchronous = {SYNCHRONOUS[mode]}")
        conn.execute("CREATE TABLE bench_insert (id INTEGER PRIMARY KEY, v INTEGER NOT NULL)")
        for _ in range(20):
            conn.execute("INSERT INTO bench_insert (v) VALUES (1)")
        done, spent = timed_loop(
            seconds,
            lambda: [None] * BATCH,
            lambda _: conn.execute("INSERT INTO bench_insert (v) VALUES (1)"),
        )
        row = conn.execute("SELECT count(*) FROM bench_insert").fetchone()
        if row[0] != done + 20:
            raise RuntimeError(f"{row[0] - 20} rows for {done} inserts")
        return done, spent
    finally:
        conn.close()


def run(settings: Settings) -> Result:
    seconds = 1.0 if settings.quick else 10.0
    figures: dict[str, float] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    checks: dict[str, int] = {}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="ql3-bench-edge-") as tmp:
        for mode in JOURNAL_MODES:
            pairs, pair_s = edge_pairs(Path(tmp) / f"edge-{mode}.db", mode, seconds)
            inserts, insert_s = raw_inserts(Path(tmp) / f"raw-{mode}.db", mode, seconds)
            per_s, insert_per_s = pairs / pair_s, inserts / insert_s
            figures[f"pairs_per_s_{mode}"] = round(per_s, 1)
            baseline[f"sqlite_insert_commits_per_s_{mode}"] = round(insert_per_s, 1)
            ratios[mode] = ratio(per_s, insert_per_s)
            checks[f"pairs_{mode}"] = pairs
            checks[f"inserts_{mode}"] = inserts
            rows.append(
                Row(
                    label=f"edge admit+complete pairs/s, {mode} (synchronous="
                    f"{SYNCHRONOUS[mode]}), 1 client",
                    figure=f"{per_s:,.0f} /s",
                    baseline=f"{insert_per_s:,.0f} /s sqlite3 single-row INSERT commits",
                    ratio=ratios[mode],
                    target="none",
                    result="n/a",
                )
            )
    return Result(
        name="edge_pairs",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=None,
        passed=None,
        rows=rows,
        checks=checks,
        notes=[
            f"single client; about {seconds:g} s of timed work per side and mode, after a"
            " 20-operation warm-up; ready steps created in batches outside the timed window",
            "a pair = admit_invocation + complete_invocation (succeeded, with usage), commands"
            " built with ql3.invocations inside the timed window; a pair is two commits,"
            " the baseline one",
            "wal runs with synchronous=FULL, delete with synchronous=EXTRA, on both sides",
        ],
    )
