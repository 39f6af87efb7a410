"""Conformance of the operator commands: ``ql3 recover``, ``ql3 invocations``, ``ql3 resolve``
and ``ql3 usage`` give the same results with ``--dsn`` (PostgreSQL) and with ``--sqlite``
(an edge file in either journal mode), because both run the same code through the store
interface (issue 22, part 4; D58).

``test_every_command_gives_the_same_results_on_every_store`` runs one operator session on
the three stores and compares what each command printed, ids, digests, timestamps and
ages aside (``resolved_by`` too: a device has no logins). The ``store`` fixture tests hold
each kind to the same literal results; the rest covers what ``--sqlite`` refuses and the
recovery daemon on an edge file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from fix_invocations import PAST, admission, completion, model_step
from fix_stores import make_edge_store
from ql3 import cli, recovery
from ql3.edge import EdgeStore
from ql3.edge.schema import file_journal_mode
from ql3.invocations import Outcome, Usage
from ql3.recovery import RecoveryConfig, RecoveryLoop
from ql3.store import PgStore
from test_conformance import deliver_aged, outbox_seqs
from test_invocations_cli import fetch, recover_loop

# ``recover --loop`` run in process configures the root logger: each test restores it, so
# no later test logs to a capture stream that is gone.
pytestmark = pytest.mark.usefixtures("root_logging")

Store = Any
"""A PgStore or an EdgeStore."""

DAY = timedelta(days=1)


def target(store: Store) -> list[str]:
    """The flags that point a ``ql3`` command at ``store``."""
    if isinstance(store, EdgeStore):
        return ["--sqlite", store.path]
    return ["--dsn", store.dsn]


@pytest.fixture
def cli_stores(every_store: dict[str, Store], db_dsn: str) -> dict[str, Store]:
    """The ``every_store`` fixture, with the conninfo ``target`` needs on PostgreSQL."""
    every_store["pg"].dsn = db_dsn
    return every_store


@pytest.fixture
def cli_store(store: Store, db_dsn: str) -> Store:
    """The ``store`` fixture, with the conninfo ``target`` needs on PostgreSQL."""
    if isinstance(store, PgStore):
        store.dsn = db_dsn  # type: ignore[attr-defined]
    return store


def ql3(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def ql3_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code, out, err = ql3(capsys, *argv)
    return code, json.loads(out) if out.strip() else None, err


# -- the session: the same data, the same commands ------------------------------------------


def populate(store: Store) -> dict[str, str]:
    """Three expired starts (two projects), one success with usage, one live call, one
    failure: what recovery and the operator commands then work on. Returns step ids."""
    steps: dict[str, str] = {}

    def admit(name: str, project: str = "proj", deadline: Any = None) -> dict[str, Any]:
        run_id, step = model_step(store, project=project)
        steps[name] = step
        command = admission(run_id, step, invocation_id=name, request_id=f"req-{name}",
                            project=project, deadline=deadline)  # fmt: skip
        return dict(store.admit_invocation(command))

    admit("inv-a-lost", deadline=PAST)
    admit("inv-b-lost", deadline=PAST + DAY)
    admit("inv-c-other", project="other", deadline=PAST + 2 * DAY)
    ok = admit("inv-ok")
    store.complete_invocation(
        completion(ok, Outcome.SUCCEEDED, usage=Usage(input_tokens=10, output_tokens=4,
                                                      cost_micros=70, currency="USD"))
    )  # fmt: skip
    failed = admit("inv-failed")
    store.complete_invocation(
        completion(failed, Outcome.FAILED, usage=Usage(input_tokens=5))
    )  # fmt: skip
    admit("inv-live")
    return steps


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DIGEST = re.compile(r"\b[0-9a-f]{64}\b")
_RECORD_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
_JSON_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?[+-]\d\d:\d\d")
_PAST_DEADLINES = {"2020-01-01T00:00:00.000000Z", "2020-01-02T00:00:00.000000Z",
                   "2020-01-03T00:00:00.000000Z"}  # fmt: skip


def normal(value: Any, key: str = "") -> Any:
    """``value`` with what differs from store to store by nature replaced: uuids, digests,
    timestamps (but the pinned past deadlines), ages and the resolving login."""
    if isinstance(value, dict):
        return {k: normal(v, k) for k, v in value.items()}
    if key == "recovered" and isinstance(value, list):
        # Recovery settles in step order (its lock order), and the steps' ids are random
        # here; its order is held equal by test_conformance with fixed ids.
        return sorted((normal(v) for v in value), key=lambda r: str(r["invocation_id"]))
    if isinstance(value, list):
        return [normal(v) for v in value]
    if key == "age_seconds" or key == "oldest_age_seconds":
        assert isinstance(value, float) and 0 <= value < 600, value
        return "<age>"
    if key == "resolved_by":
        return "<login>" if value is not None else None
    if isinstance(value, str):
        if value in _PAST_DEADLINES:
            return value
        value = _UUID.sub("<uuid>", value)
        value = _DIGEST.sub("<digest>", value)
        value = _RECORD_TIME.sub("<time>", value)
        return _JSON_TIME.sub("<json-time>", value)
    return value


def session(capsys: pytest.CaptureFixture[str], store: Store) -> list[tuple[str, Any]]:
    """One operator session on ``store``: each command's exit code and output, normalized."""
    populate(store)
    where = target(store)
    out: list[tuple[str, Any]] = []

    def json_step(name: str, *argv: str) -> Any:
        code, doc, err = ql3_json(capsys, *argv, *where)
        out.append((name, (code, normal(doc), normal(err))))
        return code, doc

    def text_step(name: str, *argv: str) -> str:
        code, text, err = ql3(capsys, *argv, *where)
        table = [line.split() for line in text.splitlines()]
        for row in table[1:]:
            row[0] = "<age>"  # the AGE column
        out.append((name, (code, normal(table), normal(err))))
        return text

    json_step("recover", "recover", "--grace", "0")
    json_step("recover again", "recover", "--grace", "0")
    json_step("queue", "invocations", "list", "--unresolved", "--json")
    json_step("queue of proj, 1", "invocations", "list", "--unresolved", "--json",
              "--project", "proj", "--limit", "1")  # fmt: skip
    json_step("queue older than 1h", "invocations", "list", "--unresolved", "--json",
              "--older-than", "1h")  # fmt: skip
    text_step("queue table", "invocations", "list", "--unresolved")
    json_step("list", "invocations", "list")
    json_step("list other", "invocations", "list", "--project", "other")
    json_step("show ok", "invocations", "show", "inv-ok")
    json_step("show lost", "invocations", "show", "inv-a-lost")
    json_step("show live", "invocations", "show", "inv-live")
    json_step("show never", "invocations", "show", "inv-never")
    bulk = ("resolve", "inv-a-lost", "inv-ok", "inv-live", "inv-never", "inv-a-lost",
            "--decision", "fail", "--user", "alice", "--reason", "outage")  # fmt: skip
    json_step("bulk resolve", *bulk, "--json")
    text_step("bulk resolve again", *bulk)
    json_step("other decision", "resolve", "inv-a-lost", "--decision", "cancel",
              "--user", "alice", "--reason", "outage", "--json")  # fmt: skip
    json_step("show resolved", "invocations", "show", "inv-a-lost")
    json_step("resolve the rest", "resolve", "inv-b-lost", "inv-c-other", "--decision",
              "retry", "--user", "bob", "--json")  # fmt: skip
    json_step("queue empty", "invocations", "list", "--unresolved", "--json")
    text_step("queue table empty", "invocations", "list", "--unresolved")
    json_step("list after", "invocations", "list", "--limit", "3")
    json_step("usage", "usage", "--project", "proj")
    json_step("usage other", "usage", "--project", "other")
    json_step("usage window", "usage", "--project", "proj", "--until", "2000-01-01")
    return out


def test_every_command_gives_the_same_results_on_every_store(
    capsys: pytest.CaptureFixture[str], cli_stores: dict[str, Store]
) -> None:
    sessions = {kind: session(capsys, store) for kind, store in cli_stores.items()}
    expected = sessions.pop("pg")
    by_name = dict(expected)
    recovered = by_name["recover"][1]
    assert recovered["count"] == 3
    assert [r["invocation_id"] for r in recovered["recovered"]] == [  # sorted by normal
        "inv-a-lost", "inv-b-lost", "inv-c-other"]  # fmt: skip
    assert [r["invocation_id"] for r in by_name["queue"][1]] == [
        "inv-a-lost", "inv-b-lost", "inv-c-other"]  # fmt: skip
    assert by_name["queue older than 1h"][1] == []
    code, summary, err = by_name["bulk resolve"]
    assert code == 1 and len(err.splitlines()) == 3
    assert [(r["status"], r.get("code")) for r in summary["results"]] == [
        ("created", None), ("refused", "QL3_ILLEGAL_TRANSITION"),
        ("refused", "QL3_ILLEGAL_TRANSITION"), ("refused", "QL3_NOT_FOUND")]  # fmt: skip
    assert by_name["bulk resolve again"][0] == 1
    assert by_name["other decision"][1]["results"][0]["code"] == "QL3_CONFLICT"
    assert by_name["resolve the rest"][0] == 0
    assert by_name["queue table empty"][1] == [["no", "unresolved", "invocations"]]
    assert by_name["show never"][0] == 1
    assert by_name["usage"][1][0]["known_cost_micros"] == 70
    for kind, got in sessions.items():
        assert [name for name, _ in got] == [name for name, _ in expected]
        for (name, result), (_, want) in zip(got, expected, strict=True):
            want = _without_login(want, edge=True)
            assert result == want, f"{kind}: ql3 {name} differs: {differences(result, want)}"
    assert file_journal_mode(Path(cli_stores["edge-delete"].path)) == "delete"


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where two results differ, as paths with both values."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [
            d
            for k in sorted({*got, *want})
            for d in differences(got.get(k, "<absent>"), want.get(k, "<absent>"), f"{path}.{k}")
        ]
    if isinstance(got, list | tuple) and isinstance(want, list | tuple) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in
                differences(g, w, f"{path}[{i}]")]  # fmt: skip
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def _without_login(value: Any, *, edge: bool) -> Any:
    """PostgreSQL records the resolving login (D47); a device has none (section 12.1)."""
    if isinstance(value, dict):
        return {k: None if k == "resolved_by" and edge else _without_login(v, edge=edge)
                for k, v in value.items()}  # fmt: skip
    if isinstance(value, list | tuple):
        return type(value)(_without_login(v, edge=edge) for v in value)
    return value


def test_show_spells_step_and_usage_timestamps_as_postgresql_does(
    capsys: pytest.CaptureFixture[str], cli_stores: dict[str, Store]
) -> None:
    spellings = {}
    for kind, store in cli_stores.items():
        populate(store)
        code, shown, _ = ql3_json(capsys, "invocations", "show", "inv-ok", *target(store))
        assert code == 0
        spellings[kind] = {
            key: _JSON_TIME.sub("<json-time>", str(value))
            for key, value in (*shown["step"].items(), *shown["usage"].items())
            if key.endswith("_at")
        }
    assert spellings["pg"] == {"created_at": "<json-time>", "updated_at": "<json-time>",
                               "recorded_at": "<json-time>"}  # fmt: skip
    assert spellings["edge-wal"] == spellings["edge-delete"] == spellings["pg"]


# -- each store alone, the same literal results ----------------------------------------------


def test_recover_settles_an_expired_start_as_lost_and_the_queue_shows_it(
    capsys: pytest.CaptureFixture[str], cli_store: Store
) -> None:
    steps = populate(cli_store)
    where = target(cli_store)
    code, first, _ = ql3_json(capsys, "recover", "--grace", "0", "--limit", "2", *where)
    assert code == 0 and first["count"] == 2
    code, rest, _ = ql3_json(capsys, "recover", "--grace", "0", *where)
    assert code == 0 and rest["count"] == 1
    settled = {r["invocation_id"] for r in (*first["recovered"], *rest["recovered"])}
    assert settled == {"inv-a-lost", "inv-b-lost", "inv-c-other"}
    row = cli_store.step_run(steps["inv-a-lost"])
    assert row is not None and row["status"] == "lost"
    code, rows, _ = ql3_json(capsys, "invocations", "list", "--unresolved", "--json",
                             "--project", "other", *where)  # fmt: skip
    assert code == 0 and len(rows) == 1
    (row,) = rows
    assert (row["invocation_id"], row["outcome"], row["result_code"], row["recovered"]) == (
        "inv-c-other", "lost", "outcome_unknown", True)  # fmt: skip
    assert row["deadline_at"] == "2020-01-03T00:00:00.000000Z"
    assert row["policy_revision_id"] is None
    code, _, err = ql3_json(capsys, "invocations", "list", "--unresolved", "--json",
                            "--limit", "2", *where)  # fmt: skip
    assert code == 0 and err.startswith("note: more than 2 unresolved invocations")


def test_bulk_resolve_gives_the_same_receipts_refusals_and_exit_codes(
    capsys: pytest.CaptureFixture[str], cli_store: Store
) -> None:
    steps = populate(cli_store)
    where = target(cli_store)
    assert ql3_json(capsys, "recover", "--grace", "0", *where)[0] == 0
    argv = ("resolve", "inv-a-lost", "inv-b-lost", "--decision", "retry", "--user", "carol",
            *where)  # fmt: skip
    code, text, err = ql3(capsys, *argv)
    assert code == 0 and err == ""
    assert text.splitlines() == [
        "created   inv-a-lost",
        "created   inv-b-lost",
        "2 of 2 resolved as retry by carol (2 created, 0 existing), 0 refused, 0 not tried",
    ]
    row = cli_store.step_run(steps["inv-a-lost"])
    assert row is not None and row["status"] == "ready"
    code, text, _ = ql3(capsys, *argv)
    assert code == 0 and text.splitlines()[0] == "existing  inv-a-lost"
    code, summary, err = ql3_json(capsys, "resolve", "inv-a-lost", "inv-ok", "--decision",
                                  "fail", "--user", "carol", "--json", *where)  # fmt: skip
    assert code == 1
    assert [(r["status"], r.get("code")) for r in summary["results"]] == [
        ("refused", "QL3_CONFLICT"), ("refused", "QL3_ILLEGAL_TRANSITION")]  # fmt: skip
    assert err.splitlines()[0].startswith("error: QL3_CONFLICT: invocation inv-a-lost: ")


def test_usage_and_show_give_the_same_totals_and_receipts(
    capsys: pytest.CaptureFixture[str], cli_store: Store
) -> None:
    populate(cli_store)
    where = target(cli_store)
    code, rows, _ = ql3_json(capsys, "usage", "--project", "proj", *where)
    assert code == 0
    assert rows == [
        {"provider": "ollama", "model": "qwen2.5:7b", "currency": "USD", "completions": 1,
         "input_tokens": 10, "output_tokens": 4, "known_cost_micros": 70,
         "known_cost_completions": 1, "unknown_cost_completions": 0},
        {"provider": "ollama", "model": "qwen2.5:7b", "currency": None, "completions": 1,
         "input_tokens": 5, "output_tokens": None, "known_cost_micros": None,
         "known_cost_completions": 0, "unknown_cost_completions": 1},
    ]  # fmt: skip
    code, shown, _ = ql3_json(capsys, "invocations", "show", "inv-ok", *where)
    assert code == 0
    assert shown["invocation_id"] == "inv-ok" and shown["start"]["invocation_id"] == "inv-ok"
    assert shown["completion"]["outcome"] == "succeeded" and shown["resolution"] is None
    assert (shown["step"]["status"], shown["step"]["version"]) == ("succeeded", 3)
    assert (shown["usage"]["input_tokens"], shown["usage"]["cost_micros"]) == (10, 70)


# -- what --sqlite refuses --------------------------------------------------------------------

EDGE_COMMANDS = [
    ["recover"],
    ["recover", "--loop", "--metrics-port", "-1"],
    ["invocations", "list"],
    ["invocations", "list", "--unresolved"],
    ["invocations", "show", "inv-1"],
    ["resolve", "inv-1", "--decision", "fail", "--user", "alice"],
    ["usage", "--project", "proj"],
    ["prune", "--delivered-before", "7d"],
]


@pytest.mark.parametrize("argv", EDGE_COMMANDS, ids=" ".join)
def test_a_missing_file_is_a_usage_error_and_nothing_is_created(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    path = tmp_path / "typo.db"
    code, out, err = ql3(capsys, *argv, "--sqlite", str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"error: QL3_INVALID_ARGUMENT: no SQLite file at {path}"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", EDGE_COMMANDS, ids=" ".join)
def test_an_unmigrated_or_foreign_file_is_refused_untouched(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    empty = tmp_path / "empty.db"
    with sqlite3.connect(empty) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    code, _, err = ql3(capsys, *argv, "--sqlite", str(empty))
    assert code == 2 and "is not ready for ql3" in err and "pending migrations" in err, err
    with sqlite3.connect(empty) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master")]
    assert tables == ["notes"]
    text = tmp_path / "notes.txt"
    text.write_text("not a database, " * 100)
    code, _, err = ql3(capsys, *argv, "--sqlite", str(text))
    assert code == 2 and err.startswith(f"error: QL3_INVALID_ARGUMENT: {text} is not an SQLite")


@pytest.mark.parametrize("argv", EDGE_COMMANDS, ids=" ".join)
def test_dsn_and_sqlite_are_mutually_exclusive(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as usage_error:
        cli.main([*argv, "--dsn", "postgresql://x/y", "--sqlite", "edge.db"])
    assert usage_error.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def flipped_and_aged(store: Store, contract: str = "retained") -> list[int]:
    """Five activations of one contract (pointer versions 1..5), all delivered two days ago:
    the first four prunable, the fifth the pointer's newest row; their seqs."""
    revisions = [
        store.put_revision("proj", "policy_routing", contract, {"n": n}, "ops")["revision_id"]
        for n in range(2)
    ]
    seqs = []
    for i in range(5):
        row = store.activate_revision("proj", "policy_routing", contract, revisions[i % 2], "ops")
        assert row is not None
        seqs.append(int(row["seq"]))
    deliver_aged(store, seqs, 2 * DAY)
    return seqs


def test_prune_removes_the_same_rows_on_every_store(
    capsys: pytest.CaptureFixture[str], cli_stores: dict[str, Store]
) -> None:
    """``ql3 prune`` on PostgreSQL and with ``--sqlite`` (D65): the same batches, the same
    rows removed, the same JSON."""
    outputs = {}
    for kind, store in cli_stores.items():
        seqs = flipped_and_aged(store)
        code, out, err = ql3_json(
            capsys, "prune", *target(store), "--delivered-before", "1d", "--batch", "2"
        )
        assert code == 0, err
        outputs[kind] = out
        assert outbox_seqs(store) == seqs[4:]
    expected = {"removed": 4, "delivered_before_seconds": 86400.0}
    assert outputs == {kind: expected for kind in cli_stores}


def test_prune_on_a_busy_file_waits_its_statement_timeout_and_removes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With ``--sqlite``, ``--statement-timeout`` bounds the wait for the file's write lock:
    a file another process holds is ``QL3_UNAVAILABLE`` (exit 1) after it, nothing removed."""
    with make_edge_store("edge-wal", tmp_path) as edge:
        seqs = flipped_and_aged(edge)
    path = str(tmp_path / "ql3-wal.db")
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        code, out, err = ql3(capsys, "prune", "--sqlite", path, "--delivered-before", "1d",
                             "--statement-timeout", "0.5")  # fmt: skip
        waited = time.monotonic() - started
        other.execute("ROLLBACK")
    assert (code, out) == (1, ""), err
    assert "QL3_UNAVAILABLE" in err, err
    assert 0.4 <= waited < 10, waited
    with EdgeStore(path) as edge:
        assert outbox_seqs(edge) == seqs


def test_the_recovery_loop_prunes_an_edge_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--outbox-retention`` with ``--sqlite`` (D65): the loop prunes the file's outbox on
    its schedule, counts the rows and logs them, as it does on PostgreSQL."""
    with make_edge_store("edge-wal", tmp_path) as edge:
        seqs = flipped_and_aged(edge)
        config = RecoveryConfig(
            interval=0.05, outbox_retention=86400.0, prune_batch=1, prune_interval=3600.0
        )
        loop = RecoveryLoop(edge, config, registry=CollectorRegistry())
        loop.start()
        try:
            loop.wait_until(lambda lp: lp.pruned >= 4 and lp.batches >= 2)
        finally:
            loop.stop()
        assert loop.pruned == 4
        assert outbox_seqs(edge) == seqs[4:]
        assert loop.registry.get_sample_value("ql3_outbox_pruned_total") == 4
        assert loop.registry.get_sample_value("ql3_outbox_prune_errors_total") == 0
    monkeypatch.setenv("QL3_OUTBOX_RETENTION", "7d")
    config = recovery.config_from_args(
        cli.build_parser().parse_args(["recover", "--loop", "--sqlite", "edge.db"])
    )
    assert config.outbox_retention == 7 * 86400.0


# -- the recovery daemon on an edge file -------------------------------------------------------


def test_the_recovery_loop_settles_an_edge_file_and_gauges_its_queue(
    tmp_path: Path,
) -> None:
    with make_edge_store("edge-wal", tmp_path) as edge:
        steps = populate(edge)
        config = RecoveryConfig(limit=2, grace_seconds=0, interval=3600, metrics_port=0)
        loop = RecoveryLoop(edge, config, registry=CollectorRegistry())
        loop.start()
        try:
            loop.wait_until(lambda r: r.recovered == 3 and r.batches == 2)
            assert loop.metrics_port is not None
            for _ in range(100):  # the gauges are set right after the round's batches
                if "ql3_invocations_lost_unresolved{" in fetch(loop.metrics_port, "/metrics")[1]:
                    break
                time.sleep(0.05)
            status, body = fetch(loop.metrics_port, "/metrics")
            assert status == 200
            assert "ql3_recovery_recovered_total 3.0" in body
            assert 'ql3_invocations_lost_unresolved{project="proj"} 2.0' in body
            assert 'ql3_invocations_lost_unresolved{project="other"} 1.0' in body
            assert 'ql3_invocations_lost_unresolved_oldest_age_seconds{project="proj"}' in body
            status, body = fetch(loop.metrics_port, "/healthz")
            assert status == 200 and json.loads(body)["status"] == "ok"
        finally:
            loop.stop()
        row = edge.step_run(steps["inv-a-lost"])
        assert row is not None and row["status"] == "lost"


def test_recover_loop_process_on_sqlite_serves_metrics_and_exits_0_on_sigterm(
    tmp_path: Path,
) -> None:
    with make_edge_store("edge-delete", tmp_path) as edge:
        run_id, step = model_step(edge)
        edge.admit_invocation(admission(run_id, step, invocation_id="inv-x", deadline=PAST))
    path = str(tmp_path / "ql3-delete.db")
    with recover_loop("postgresql://unused/none", "--sqlite", path, "--interval", "0.1") as (
        proc,
        logs,
    ):
        port = int(logs.until("metrics_listening")["port"])
        logs.until("invocation_recovered", invocation_id="inv-x")
        status, body = fetch(port, "/metrics")
        assert status == 200 and "ql3_recovery_recovered_total 1.0" in body
        assert fetch(port, "/healthz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        logs.until("recovery_stopped", recovered=1)
    assert file_journal_mode(Path(path)) == "delete"


# -- without the extras (D58): --sqlite needs none, PostgreSQL names its extra ----------------

BARE = (
    "import sys; sys.modules.update(psycopg=None, psycopg_pool=None, redis=None, "
    "prometheus_client=None, httpx=None); from ql3 import command; sys.argv[0] = 'ql3'; "
    "sys.exit(command.main())"
)
"""``ql3`` as on ``pip install ql3`` alone: every driver's import fails (the wheel itself
is checked in ``test_edge_install``)."""


def bare_ql3(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QL3_")}
    return subprocess.run([sys.executable, "-c", BARE, *argv], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip


def test_without_the_drivers_the_edge_commands_run(tmp_path: Path) -> None:
    with make_edge_store("edge-wal", tmp_path) as edge:
        run_id, step = model_step(edge)
        edge.admit_invocation(admission(run_id, step, invocation_id="inv-x", deadline=PAST))
    path = str(tmp_path / "ql3-wal.db")
    for argv in (["recover", "--grace", "0"], ["invocations", "list", "--unresolved", "--json"],
                 ["invocations", "show", "inv-x"], ["usage", "--project", "proj"],
                 ["resolve", "inv-x", "--decision", "fail", "--user", "u"],
                 ["prune", "--delivered-before", "1d"]):  # fmt: skip
        done = bare_ql3(*argv, "--sqlite", path)
        assert done.returncode == 0, (argv, done.stderr)
        assert "Traceback" not in done.stderr
    with EdgeStore(path) as edge:
        row = edge.step_run(step)
    assert row is not None and row["status"] == "failed"


@pytest.mark.parametrize(
    "argv",
    [
        ["recover", "--dsn", "postgresql://x/y"],
        ["recover", "--loop"],
        ["invocations", "list", "--dsn", "postgresql://x/y"],
        ["resolve", "inv-1", "--decision", "fail", "--user", "u"],
        ["revision", "show", "--revision", "r", "--dsn", "postgresql://x/y"],
        ["prune", "--delivered-before", "7d", "--dsn", "postgresql://x/y"],
        ["migrate", "--dsn", "postgresql://x/y"],
        ["ready"],
        ["verify", "--dsn", "postgresql://x/y"],
    ],
    ids=" ".join,
)
def test_without_the_driver_postgresql_names_its_extra(argv: list[str]) -> None:
    done = bare_ql3(*argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "needs psycopg, which this install lacks: pip install 'ql3[postgres]'" in done.stderr


def test_without_prometheus_the_loop_serves_healthz_and_says_why_metrics_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(recovery, "new_registry", lambda: None)
    caplog.set_level(logging.WARNING, logger="ql3.recovery")
    with make_edge_store("edge-wal", tmp_path) as edge:
        config = RecoveryConfig(grace_seconds=0, interval=3600, metrics_port=0)
        loop = RecoveryLoop(edge, config)
        loop.start()
        try:
            loop.wait_until(lambda r: r.batches >= 1)
            assert loop.metrics_port is not None
            status, body = fetch(loop.metrics_port, "/healthz")
            assert status == 200 and json.loads(body)["status"] == "ok"
            status, body = fetch(loop.metrics_port, "/metrics")
            assert status == 501 and "prometheus-client is not installed" in body
        finally:
            loop.stop()
    assert [r.getMessage() for r in caplog.records] == ["metrics_not_served"]
    with pytest.raises(Exception, match="prometheus-client is not installed"):
        _ = loop.registry
