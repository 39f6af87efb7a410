"""Crash windows of the SQLite shim (SPEC section 11, seed ADR-0168 verification list).

A child process (``edge_crash_child.py``) runs admission, completion or resolution on a
real file and SIGKILLs itself at a named point: every statement boundary inside the
procedure's transaction, and right after COMMIT (before the result is returned), in both
journal modes. Afterwards ``PRAGMA integrity_check`` is ``ok``; before COMMIT no partial
fact exists (no receipt, step and run unchanged, no event, no mutation) and a replay of the
same command returns ``created``; after COMMIT the durable winner is there and a replay
returns ``existing``.

Starting a Python that imports ql3 takes about a second, so one module fixture prepares
every window and runs them all from one server process that forks a child per window
(``edge_crash_child.py --serve``); each parametrised test then checks its window. One more
test runs a window through a freshly started ``python edge_crash_child.py``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ql3.edge import EdgeStore
from ql3.invocations import (
    PolicyBinding,
    Usage,
    admission_command,
    completion_command,
    request_digest,
    resolution_command,
)

CHILD = Path(__file__).with_name("edge_crash_child.py")
MODES = ("wal", "delete")
RUN = "cccccccc-0000-0000-0000-000000000001"
STEP = "dddddddd-0000-0000-0000-000000000001"
INVOCATION = "crash-inv-1"

BEFORE_COMMIT: dict[str, tuple[str, ...]] = {
    "admission": (
        "after_begin", "after_step_select", "after_prior_select", "after_policy_select",
        "after_run_update", "after_start_insert", "after_step_update", "after_event_insert",
        "after_mutation_insert",
    ),
    "completion": (
        "after_begin", "after_start_select", "after_step_select", "after_prior_select",
        "after_run_update", "after_completion_insert", "after_ledger_insert",
        "after_step_update", "after_event_insert", "after_mutation_insert",
    ),
    "resolution": (
        "after_begin", "after_start_select", "after_step_select", "after_prior_select",
        "after_completion_select", "after_run_update", "after_resolution_insert",
        "after_step_update", "after_event_insert", "after_mutation_insert",
    ),
}  # fmt: skip
RECEIPT_TABLE = {
    "admission": "model_invocation_starts",
    "completion": "model_invocation_completions",
    "resolution": "model_invocation_resolutions",
}
METHOD = {
    "admission": "admit_invocation",
    "completion": "complete_invocation",
    "resolution": "resolve_invocation",
}
STATE_AFTER = {"admission": "running", "completion": "succeeded", "resolution": "ready"}

WINDOWS = [
    (procedure, f"{procedure}:{point}", mode)
    for procedure, points in BEFORE_COMMIT.items()
    for point in (*points, "after_commit")
    for mode in MODES
]


def window_id(window: tuple[str, str, str]) -> str:
    return f"{window[1]}-{window[2]}"


# -- the file each window starts from ---------------------------------------------------------


def prepare(path: Path, mode: str, procedure: str) -> dict[str, Any]:
    """A file where ``procedure`` is the next step of the invocation; its command."""
    with EdgeStore(path, mode) as store:  # type: ignore[arg-type]
        revision = store.put_revision("proj", "policy_routing", "router", {"r": 1}, "ops")
        store.activate_revision("proj", "policy_routing", "router", revision["revision_id"], "ops")
        store.create_run("proj", "trace-1", RUN)
        store.add_step_run(RUN, "model", STEP)
        admission = admission_command(
            invocation_id=INVOCATION,
            request_id="req-1",
            project_id="proj",
            run_id=RUN,
            step_run_id=STEP,
            trace_id="trace-1",
            expected_step_run_version=1,
            provider="ollama",
            model="llama3.1:8b",
            policy=PolicyBinding(
                contract_family="policy_routing",
                contract_id="router",
                revision_id=revision["revision_id"],
            ),
            request_digest=request_digest(b"prompt"),
            input_bytes=6,
            deadline_at=datetime.now(UTC) + timedelta(days=1),
        )
        if procedure == "admission":
            return admission
        start = store.admit_invocation(admission)["start_digest"]
        if procedure == "completion":
            return completion_command(
                invocation_id=INVOCATION,
                start_digest=start,
                outcome="succeeded",
                result_code="ok",
                output_bytes=42,
                output_digest="e" * 64,
                usage=Usage(input_tokens=10, output_tokens=5, cost_micros=70, currency="USD"),
            )
        lost = store.complete_invocation(
            completion_command(invocation_id=INVOCATION, start_digest=start, outcome="lost")
        )
        return resolution_command(
            invocation_id=INVOCATION,
            completion_digest=lost["completion_digest"],
            decision="retry",
            user_id="alice",
            expected_step_run_version=3,
            reason="the provider never saw it",
        )


def facts(path: Path) -> dict[str, Any]:
    """Everything a procedure may write, read through a plain connection."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        counts = {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in (
                "model_invocation_starts", "model_invocation_completions",
                "model_invocation_resolutions", "usage_ledger", "run_events",
                "step_run_mutations", "contract_outbox",
            )
        }  # fmt: skip
        step = conn.execute(
            "SELECT status, version, attempt_count, current_invocation_id, output_ref,"
            " result_code, updated_at FROM step_runs WHERE step_run_id = ?",
            (STEP,),
        ).fetchone()
        run = conn.execute(
            "SELECT version, event_seq, updated_at FROM runs WHERE run_id = ?", (RUN,)
        ).fetchone()
    return {"counts": counts, "step": tuple(step), "run": tuple(run)}


def integrity(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]


@dataclass
class Crash:
    path: Path
    mode: str
    command: dict[str, Any]
    before: dict[str, Any]
    status: dict[str, int]
    stderr: str


@pytest.fixture(scope="module")
def crashes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Crash]:
    """Every window prepared, and its child run to its SIGKILL.

    Each window gets a copy of a template file (one per journal mode and procedure; the
    store that made it is closed, so the file is complete on its own). One server process
    (``edge_crash_child.py --serve``) imports ql3 once and forks one child per window.
    """
    root = tmp_path_factory.mktemp("crash")
    templates: dict[tuple[str, str], tuple[Path, dict[str, Any], Path]] = {}
    for procedure in BEFORE_COMMIT:
        for mode in MODES:
            path = root / f"template-{procedure}-{mode}.db"
            command = prepare(path, mode, procedure)
            command_file = root / f"{procedure}-{mode}.json"
            command_file.write_text(json.dumps(command), encoding="utf-8")
            templates[(procedure, mode)] = (path, command, command_file)
    prepared: dict[tuple[str, str, str], tuple[Path, dict[str, Any], dict[str, Any], Path]] = {}
    for n, (procedure, point, mode) in enumerate(WINDOWS):
        template, command, command_file = templates[(procedure, mode)]
        path = root / f"w{n:02d}-{mode}.db"
        shutil.copyfile(template, path)
        prepared[(procedure, point, mode)] = (path, command, facts(path), command_file)

    lines = "".join(
        json.dumps([str(prepared[w][0]), w[2], w[0], w[1], str(prepared[w][3])]) + "\n"
        for w in WINDOWS
    )
    server = subprocess.run(
        [sys.executable, str(CHILD), "--serve"],
        input=lines,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    statuses = [json.loads(line) for line in server.stdout.splitlines()]
    assert server.returncode == 0 and len(statuses) == len(WINDOWS), server.stderr
    return {
        window: Crash(path, window[2], command, before, status, server.stderr)
        for (window, (path, command, before, _)), status in zip(
            prepared.items(), statuses, strict=True
        )
    }


# -- the windows --------------------------------------------------------------------------------


def test_there_are_at_least_forty_windows() -> None:
    assert len(WINDOWS) >= 40
    assert len({window_id(w) for w in WINDOWS}) == len(WINDOWS)


@pytest.mark.parametrize("window", WINDOWS, ids=window_id)
def test_sigkill_window(
    window: tuple[str, str, str], crashes: dict[tuple[str, str, str], Crash]
) -> None:
    procedure, point, mode = window
    crash = crashes[window]
    assert crash.status == {"signal": signal.SIGKILL}, (
        f"the child was not killed at {point} ({crash.status}): {crash.stderr}"
    )
    assert integrity(crash.path) == ["ok"]
    committed = point.endswith(":after_commit")
    after = facts(crash.path)
    table = RECEIPT_TABLE[procedure]
    if committed:
        assert after["counts"][table] == crash.before["counts"][table] + 1, "the winner is lost"
        assert after["step"][0] == STATE_AFTER[procedure]
        assert after["step"][1] == crash.before["step"][1] + 1
    else:
        assert after == crash.before, "a partial fact survived the crash"

    with EdgeStore(crash.path, mode) as store:  # type: ignore[arg-type]
        replay = getattr(store, METHOD[procedure])(crash.command)
    assert replay["status"] == ("existing" if committed else "created")
    assert integrity(crash.path) == ["ok"]
    final = facts(crash.path)
    assert final["step"][0] == STATE_AFTER[procedure]
    assert final["counts"][table] == crash.before["counts"][table] + 1
    assert final["run"][1] == crash.before["run"][1] + 1, "exactly one run event was added"


# -- the windows cover every statement boundary ---------------------------------------------------


@pytest.mark.parametrize("procedure", list(BEFORE_COMMIT))
def test_the_windows_are_every_boundary_a_procedure_passes(procedure: str, tmp_path: Path) -> None:
    command = prepare(tmp_path / "probe.db", "wal", procedure)
    seen: list[str] = []
    record: Callable[[str], None] = seen.append
    with EdgeStore(tmp_path / "probe.db", "wal", _crash_point=record) as store:
        getattr(store, METHOD[procedure])(command)
    assert seen == [f"{procedure}:{p}" for p in (*BEFORE_COMMIT[procedure], "after_commit")]


def test_a_window_in_a_freshly_started_python(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    command = prepare(path, "delete", "completion")
    command_file = tmp_path / "command.json"
    command_file.write_text(json.dumps(command), encoding="utf-8")
    before = facts(path)
    argv = [sys.executable, str(CHILD), str(path), "delete", "completion",
            "completion:after_ledger_insert", str(command_file)]  # fmt: skip
    child = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert integrity(path) == ["ok"]
    assert facts(path) == before
    with EdgeStore(path, "delete") as store:
        assert store.complete_invocation(command)["status"] == "created"
