"""A start that recovery cannot settle is skipped, reported and counted, and the rest of the
batch is settled (D46): the SQLite shim's savepoints, and the recovery loop's metric and
log line, which no PostgreSQL test reaches (only the superuser can squat an identity)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from fix_invocations import PAST, admission, model_step
from ql3.canonical import mutation_id
from ql3.edge import EdgeStore
from ql3.recovery import RecoveryLoop


def test_a_squatted_identity_is_skipped_as_q3c01_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "edge.db"
    with EdgeStore(path, "wal", ai=True) as store:
        starts = []
        for _ in range(2):
            run_id, step = model_step(store)
            starts.append(store.admit_invocation(admission(run_id, step, deadline=PAST))["start"])
        squatted, other = sorted(starts, key=lambda s: (s["run_id"], s["invocation_id"]))
        # What no caller of the shim can do: take the completion's identity by hand.
        with sqlite3.connect(path) as conn:
            conn.execute(
                "INSERT INTO step_run_mutations VALUES (?, 'ddp_squatted', ?, 'running', 'lost',"
                " 99, 100, ?, '2020-01-01T00:00:00.000000Z')",
                (mutation_id(squatted["invocation_id"], "completion"), squatted["step_run_id"],
                 "0" * 64),
            )  # fmt: skip
        loop = RecoveryLoop("unused: run_batch is given its store")
        with caplog.at_level(logging.ERROR, logger="ql3.recovery"):
            result = loop.run_batch(store)
        assert [r["invocation_id"] for r in result["recovered"]] == [other["invocation_id"]]
        assert [(f["invocation_id"], f["sqlstate"]) for f in result["failed"]] == [
            (squatted["invocation_id"], "Q3C01")
        ]
        step_row = store.step_run(squatted["step_run_id"])
        assert step_row is not None and step_row["status"] == "running"  # rolled back whole
    assert loop.registry.get_sample_value("ql3_recovery_skipped_total") == 1
    assert loop.registry.get_sample_value("ql3_recovery_recovered_total") == 1
    (logged,) = [r for r in caplog.records if r.getMessage() == "invocation_not_recovered"]
    assert logged.ql3["invocation_id"] == squatted["invocation_id"]  # type: ignore[attr-defined]
    assert logged.ql3["sqlstate"] == "Q3C01"  # type: ignore[attr-defined]
