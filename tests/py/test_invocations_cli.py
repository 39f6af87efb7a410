"""``ql3 invocations``, ``ql3 resolve``, ``ql3 usage`` and ``ql3 recover``, called as a user
would (QL3_DSN from the environment, each command as the role it needs), and the recovery
daemon in-process and as a process stopped by SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from fix_invocations import PAST, PROJECT, PROVIDER, admission, completion, model_step
from fix_servers import role_dsn
from fix_stores import pin_clock
from fix_tcp_proxy import PgProxy, pg_proxy  # noqa: F401  (pg_proxy is a fixture)
from ql3 import arguments, cli, errors, invocation_reads, invocations_cli, recovery
from ql3.invocations import Outcome, PolicyBinding, Usage
from ql3.recovery import RecoveryConfig, RecoveryLoop
from ql3.store import PgStore


def run_text(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of one ``ql3`` command that prints text."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """Exit code, parsed JSON stdout (None when empty) and stderr of one ``ql3`` command."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


@pytest.fixture
def runtime(db_dsn: str) -> Iterator[PgStore]:
    with PgStore(role_dsn(db_dsn, "runtime")) as store:
        yield store


@pytest.fixture
def as_role(db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(role: str) -> str:
        dsn = role_dsn(db_dsn, role)
        monkeypatch.setenv("QL3_DSN", dsn)
        return dsn

    return use


@pytest.fixture
def owner(db_dsn: str) -> Iterator[PgStore]:
    """The superuser test connection: it may pin the database clock."""
    with PgStore(db_dsn) as store:
        yield store


def settled(store: PgStore, outcome: Outcome, **kw: Any) -> tuple[str, dict[str, Any]]:
    """A new step admitted and completed: (step_run_id, completion result)."""
    run_id, step = model_step(store)
    start = store.admit_invocation(admission(run_id, step))
    return step, store.complete_invocation(completion(start, outcome, **kw))


def running(store: PgStore, **kw: Any) -> tuple[str, dict[str, Any]]:
    run_id, step = model_step(store)
    return step, store.admit_invocation(admission(run_id, step, **kw))


def invocation_id(result: dict[str, Any]) -> str:
    record = result.get("completion") or result["start"]
    return str(record["invocation_id"])


# -- invocations list / show -----------------------------------------------------------


def test_list_shows_newest_first_and_unresolved_shows_only_lost_ones(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    _, ok = settled(runtime, Outcome.SUCCEEDED)
    _, lost = settled(runtime, Outcome.LOST)
    _, live = running(runtime)
    as_role("reader")

    code, rows, _ = run(capsys, "invocations", "list")
    assert code == 0
    assert [r["invocation_id"] for r in rows] == [invocation_id(x) for x in (live, lost, ok)]
    assert [r["outcome"] for r in rows] == [None, "lost", "succeeded"]
    assert rows[1]["result_code"] == "outcome_unknown" and rows[1]["decision"] is None

    code, rows, _ = run(capsys, "invocations", "list", "--unresolved", "--json")
    assert code == 0 and [r["invocation_id"] for r in rows] == [invocation_id(lost)]

    code, rows, _ = run(capsys, "invocations", "list", "--limit", "1", "--project", PROJECT)
    assert code == 0 and [r["invocation_id"] for r in rows] == [invocation_id(live)]
    code, rows, _ = run(capsys, "invocations", "list", "--project", "elsewhere")
    assert code == 0 and rows == []
    code, _, err = run(capsys, "invocations", "list", "--limit", "0")
    assert code == 1 and err.startswith("error: QL3_INVALID_ARGUMENT")


# -- the resolution queue (list --unresolved) ------------------------------------------


def lost_since(
    runtime: PgStore, owner: PgStore, ago: timedelta, *, project: str = PROJECT, **kw: Any
) -> str:
    """An invocation admitted with a past deadline and settled as lost by recovery ``ago``
    before now (the database clock pinned there): its invocation_id."""
    run_id, step = model_step(runtime, project=project)
    start = runtime.admit_invocation(admission(run_id, step, project=project, deadline=PAST, **kw))
    pin_clock(owner, datetime.now(UTC) - ago)
    try:
        result = owner.recover_expired(100, 0)
    finally:
        pin_clock(owner, None)
    assert [r["invocation_id"] for r in result["recovered"]] == [invocation_id(start)]
    return invocation_id(start)


def active_policy(owner: PgStore, project: str = PROJECT) -> PolicyBinding:
    revision = owner.put_revision(project, "policy_routing", "router", {"v": 1}, "test")
    owner.activate_revision(project, "policy_routing", "router", revision["revision_id"], "test")
    return PolicyBinding(
        contract_family="policy_routing", contract_id="router", revision_id=revision["revision_id"]
    )


def queue_ids(capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    code, rows, err = run(capsys, "invocations", "list", "--unresolved", "--json", *flags)
    assert code == 0, err
    return [r["invocation_id"] for r in rows]


def test_the_queue_shows_what_waits_oldest_first_with_its_age(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, owner: PgStore, as_role: Any
) -> None:
    policy = active_policy(owner)
    hours = lost_since(runtime, owner, timedelta(hours=3), policy=policy)
    days = lost_since(runtime, owner, timedelta(days=2), project="other", model="m-2")
    minutes = lost_since(runtime, owner, timedelta(minutes=10))
    settled(runtime, Outcome.SUCCEEDED)
    resolved = lost_since(runtime, owner, timedelta(days=5))
    invocations_cli.resolve(owner, resolved, decision="fail", user_id="alice")
    as_role("reader")

    code, rows, err = run(capsys, "invocations", "list", "--unresolved", "--json")
    assert code == 0 and err == ""
    assert [r["invocation_id"] for r in rows] == [days, hours, minutes]
    first, second, _ = rows
    assert (first["project_id"], first["provider"], first["model"]) == ("other", PROVIDER, "m-2")
    assert first["attempt"] == 1 and first["deadline_at"] == "2020-01-01T00:00:00.000000Z"
    assert first["policy_revision_id"] is None
    assert second["policy_revision_id"] == str(policy.revision_id)
    assert second["policy_contract_id"] == "router"
    assert (first["outcome"], first["result_code"], first["recovered"]) == (
        "lost", "outcome_unknown", True)  # fmt: skip
    assert 2 * 86400 <= first["age_seconds"] < 2 * 86400 + 600
    assert 3 * 3600 <= second["age_seconds"] < 3 * 3600 + 600

    code, out, err = run_text(capsys, "invocations", "list", "--unresolved")
    assert code == 0 and err == ""
    header, *lines = out.splitlines()
    assert header.split() == ["AGE", "PROJECT", "PROVIDER/MODEL", "ATTEMPT", "DEADLINE",
                              "POLICY", "REVISION", "INVOCATION"]  # fmt: skip
    assert [line.split()[-1] for line in lines] == [days, hours, minutes]
    assert lines[0].split()[:6] == ["2d00h", "other", f"{PROVIDER}/m-2", "1",
                                    "2020-01-01T00:00:00.000000Z", "-"]  # fmt: skip
    assert lines[1].split()[0] == "3h00m" and str(policy.revision_id) in lines[1]
    assert lines[2].split()[0] == "10m"


def test_the_queue_filters_by_project_and_by_age(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, owner: PgStore, as_role: Any
) -> None:
    old = lost_since(runtime, owner, timedelta(days=3), project="a")
    mid = lost_since(runtime, owner, timedelta(hours=5), project="b")
    new = lost_since(runtime, owner, timedelta(minutes=1), project="c")
    as_role("reader")
    assert queue_ids(capsys, "--project", "b") == [mid]
    assert queue_ids(capsys, "--project", "c", "--project", "a") == [old, new]
    assert queue_ids(capsys, "--project", "nobody") == []
    assert queue_ids(capsys, "--older-than", "1h") == [old, mid]
    assert queue_ids(capsys, "--older-than", "2d") == [old]
    assert queue_ids(capsys, "--older-than", "1w") == []
    assert queue_ids(capsys, "--older-than", "30s", "--project", "c") == [new]
    code, out, _ = run_text(capsys, "invocations", "list", "--unresolved", "--older-than", "1w")
    assert code == 0 and out == "no unresolved invocations\n"


@pytest.mark.parametrize(
    "duration", ["10", "1y", "-1h", "1.5h", "h", "", "36501d", "999999w", "9999999999w", "\u0661d"]
)
def test_older_than_is_a_usage_error_unless_a_whole_number_and_a_unit(
    capsys: pytest.CaptureFixture[str], as_role: Any, duration: str
) -> None:
    as_role("reader")
    with pytest.raises(SystemExit) as usage_error:
        cli.main(["invocations", "list", "--unresolved", f"--older-than={duration}"])
    assert usage_error.value.code == 2
    assert "--older-than" in capsys.readouterr().err
    code, _, err = run(capsys, "invocations", "list", "--older-than", "1h")
    assert code == 2 and err.startswith("error: QL3_INVALID_ARGUMENT: --older-than needs")


def test_the_queue_is_one_bounded_page_and_says_when_more_wait(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, owner: PgStore, as_role: Any
) -> None:
    ids = [lost_since(runtime, owner, timedelta(hours=h)) for h in (3, 2, 1)]
    as_role("reader")
    code, rows, err = run(capsys, "invocations", "list", "--unresolved", "--json", "--limit", "2")
    assert code == 0 and [r["invocation_id"] for r in rows] == ids[:2]
    assert err.startswith("note: more than 2 unresolved invocations; these are the oldest 2")
    code, out, err = run_text(capsys, "invocations", "list", "--unresolved", "--limit", "2")
    assert code == 0 and len(out.splitlines()) == 3 and "note: more than 2" in err
    code, rows, err = run(capsys, "invocations", "list", "--unresolved", "--json", "--limit", "3")
    assert code == 0 and len(rows) == 3 and err == ""
    code, _, err = run(capsys, "invocations", "list", "--unresolved", "--limit", "10001")
    assert code == 1 and err.startswith("error: QL3_INVALID_ARGUMENT: limit must be 1..10000")


def test_the_queue_shows_only_the_logins_projects(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, owner: PgStore, db_dsn: str
) -> None:
    mine = lost_since(runtime, owner, timedelta(hours=2), project="mine")
    lost_since(runtime, owner, timedelta(hours=3), project="theirs")
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SELECT ql3.grant_project('ql3_test_reader', 'mine')")
    code, rows, _ = run(capsys, "invocations", "list", "--unresolved", "--json",
                        "--dsn", role_dsn(db_dsn, "reader"))  # fmt: skip
    assert code == 0 and [r["invocation_id"] for r in rows] == [mine]
    code, rows, _ = run(capsys, "invocations", "list", "--unresolved", "--json",
                        "--project", "theirs", "--dsn", role_dsn(db_dsn, "reader"))  # fmt: skip
    assert code == 0 and rows == []


def test_the_queue_escapes_control_characters_in_its_table(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, owner: PgStore, as_role: Any
) -> None:
    hostile = "p\x1b[2J\x9b31m\u2028"
    lost = lost_since(runtime, owner, timedelta(hours=1), project=hostile, model=hostile)
    as_role("reader")
    code, out, _ = run_text(capsys, "invocations", "list", "--unresolved")
    assert code == 0 and lost in out
    assert not any(c in out for c in "\x1b\x9b\u2028"), repr(out)
    assert "p\\x1b[2J\\x9b31m\\u2028" in out
    code, rows, _ = run(capsys, "invocations", "list", "--unresolved", "--json")
    assert code == 0 and rows[0]["project_id"] == hostile


def test_durations_and_ages_read_as_written() -> None:
    parse = arguments.duration_type
    assert [parse(t) for t in ("30s", "10m", "2h", "1d", "1w")] == [
        timedelta(seconds=30), timedelta(minutes=10), timedelta(hours=2), timedelta(days=1),
        timedelta(weeks=1)]  # fmt: skip
    age = invocations_cli.format_age
    assert [age(s) for s in (-1, 45, 754, 3 * 3600 + 300, 2 * 86400 + 4 * 3600 + 59)] == [
        "0s", "45s", "12m", "3h05m", "2d04h"]  # fmt: skip


@pytest.mark.parametrize("project", [None, PROJECT])
@pytest.mark.parametrize("unresolved", [False, True])
def test_listings_read_an_index_in_order_instead_of_sorting_the_history(
    runtime: PgStore, db_dsn: str, unresolved: bool, project: str | None
) -> None:
    settled(runtime, Outcome.SUCCEEDED)
    settled(runtime, Outcome.LOST)
    sql = invocation_reads.UNRESOLVED_SQL if unresolved else invocation_reads.RECENT_SQL
    projects = None if project is None else [project]
    params = {"projects": projects, "limit": 10, "older_than": timedelta(minutes=5)}
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("ANALYZE ql3_ai.model_invocation_starts, ql3_ai.model_invocation_completions")
        # A few rows would be read whole and sorted; forbid that so the plan shows whether
        # an index can deliver the order, as it must once the history is large.
        conn.execute("SET enable_seqscan = off")
        rows = conn.execute("EXPLAIN " + sql, params).fetchall()
    plan = "\n".join(str(r[0]) for r in rows)
    index = "model_invocation_completions_lost" if unresolved else "model_invocation_starts_recent"
    assert f"Index Scan Backward using {index}" in plan or f"Index Scan using {index}" in plan, plan
    assert "Sort" not in plan, plan


def test_show_prints_receipts_step_and_usage(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    step, done = settled(runtime, Outcome.SUCCEEDED, usage=Usage(input_tokens=3, output_tokens=9))
    as_role("reader")
    code, shown, _ = run(capsys, "invocations", "show", invocation_id(done))
    assert code == 0
    assert shown["completion"] == done["completion"]
    assert shown["completion_digest"] == done["completion_digest"]
    assert shown["start_digest"] == done["completion"]["start_digest"]
    assert shown["start"]["invocation_id"] == invocation_id(done)
    assert shown["resolution"] is None and shown["resolution_digest"] is None
    assert shown["step"]["step_run_id"] == step and shown["step"]["status"] == "succeeded"
    assert (shown["usage"]["input_tokens"], shown["usage"]["output_tokens"]) == (3, 9)
    assert shown["usage"]["cost_micros"] is None

    _, live = running(runtime)
    code, shown, _ = run(capsys, "invocations", "show", invocation_id(live))
    assert code == 0 and shown["completion"] is None and shown["usage"] is None

    code, _, err = run(capsys, "invocations", "show", "inv-never")
    assert code == 1 and err.startswith("error: QL3_NOT_FOUND")


# -- resolve ---------------------------------------------------------------------------


def test_resolve_reads_the_digest_and_version_itself_and_replays_as_existing(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    step, lost = settled(runtime, Outcome.LOST)
    as_role("operator")
    argv = ("resolve", invocation_id(lost), "--decision", "retry", "--user", "alice",
            "--reason", "provider has no record", "--json")  # fmt: skip
    code, summary, _ = run(capsys, *argv)
    assert code == 0 and summary["created"] == 1
    (result,) = summary["results"]
    assert result["status"] == "created"
    assert result["resolution"]["completion_digest"] == lost["completion_digest"]
    assert result["resolution"]["reason"] == "provider has no record"
    step_row = runtime.step_run(step)
    assert step_row is not None and step_row["status"] == "ready"

    code, summary, _ = run(capsys, *argv)
    assert code == 0 and summary["existing"] == 1
    (again,) = summary["results"]
    assert again["status"] == "existing"
    assert again["resolution_digest"] == result["resolution_digest"]

    # show and list tell the user it was resolved as from the login that resolved (D47)
    code, shown, _ = run(capsys, "invocations", "show", invocation_id(lost))
    assert code == 0 and shown["resolution"]["user_id"] == "alice"
    assert shown["resolved_by"] == "ql3_test_operator"
    code, rows, _ = run(capsys, "invocations", "list")
    row = next(r for r in rows if r["invocation_id"] == invocation_id(lost))
    assert (row["resolved_as"], row["resolved_by"]) == ("alice", "ql3_test_operator")

    code, _, err = run(capsys, "resolve", invocation_id(lost), "--decision", "cancel",
                       "--user", "alice", "--json")  # fmt: skip
    assert code == 1 and err.startswith("error: QL3_CONFLICT")


def test_resolve_refuses_what_is_not_lost_with_stable_codes(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    _, ok = settled(runtime, Outcome.SUCCEEDED)
    _, live = running(runtime)
    as_role("operator")
    for target in (invocation_id(ok), invocation_id(live)):
        code, _, err = run(capsys, "resolve", target, "--decision", "fail", "--user", "alice",
                           "--json")  # fmt: skip
        assert code == 1 and err.startswith("error: QL3_ILLEGAL_TRANSITION"), err
    code, _, err = run(capsys, "resolve", "inv-never", "--decision", "fail", "--user", "alice",
                       "--json")  # fmt: skip
    assert code == 1 and err.startswith("error: QL3_NOT_FOUND")
    with pytest.raises(SystemExit) as usage_error:
        cli.main(["resolve", invocation_id(ok), "--decision", "ignore", "--user", "alice"])
    assert usage_error.value.code == 2


def test_resolve_several_at_once_writes_a_receipt_for_each_and_exits_0(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    lost = [settled(runtime, Outcome.LOST) for _ in range(3)]
    ids = [invocation_id(result) for _, result in lost]
    as_role("operator")
    argv = (
        "resolve",
        "--decision",
        "fail",
        "--user",
        "alice",
        "--reason",
        "provider outage",
        *ids,
        ids[0],
    )  # fmt: skip  (a repeated id counts once)
    code, summary, err = run(capsys, *argv, "--json")
    assert code == 0 and err == ""
    counts = ("requested", "resolved", "created", "existing", "refused", "not_tried")
    assert [summary[k] for k in counts] == [3, 3, 3, 0, 0, 0]
    assert (summary["decision"], summary["user_id"], summary["reason"]) == (
        "fail", "alice", "provider outage")  # fmt: skip
    assert [r["invocation_id"] for r in summary["results"]] == ids
    digests = {r["resolution_digest"] for r in summary["results"]}
    assert len(digests) == 3  # one Resolution receipt each
    for (step, done), result in zip(lost, summary["results"], strict=True):
        assert result["resolution"]["completion_digest"] == done["completion_digest"]
        assert result["resolution"]["reason"] == "provider outage"
        step_row = runtime.step_run(step)
        assert step_row is not None and step_row["status"] == "failed"

    code, out, err = run_text(capsys, *argv)  # the same command again: all existing
    assert code == 0 and err == ""
    *lines, last = out.splitlines()
    assert [line.split() for line in lines] == [["existing", i] for i in ids]
    assert last == ("3 of 3 resolved as fail by alice (0 created, 3 existing), 0 refused, "
                    "0 not tried, reason: provider outage")  # fmt: skip
    code, rows, _ = run(capsys, "invocations", "list", "--unresolved", "--json")
    assert code == 0 and rows == []


def test_resolve_several_reports_each_refusal_with_its_code_and_exits_1(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    _, first = settled(runtime, Outcome.LOST)
    _, taken = settled(runtime, Outcome.LOST)
    _, last = settled(runtime, Outcome.LOST)
    as_role("operator")
    code, _, _ = run(capsys, "resolve", invocation_id(taken), "--decision", "retry",
                     "--user", "bob", "--json")  # fmt: skip
    assert code == 0
    ids = [invocation_id(first), invocation_id(taken), "inv-never", invocation_id(last)]

    code, summary, err = run(capsys, "resolve", "--decision", "fail", "--user", "alice",
                             "--reason", "outage", *ids, "--json")  # fmt: skip
    assert code == 1
    assert [(r["invocation_id"], r["status"], r.get("code")) for r in summary["results"]] == [
        (ids[0], "created", None), (ids[1], "refused", "QL3_CONFLICT"),
        (ids[2], "refused", "QL3_NOT_FOUND"), (ids[3], "created", None)]  # fmt: skip
    assert (summary["resolved"], summary["refused"]) == (2, 2)
    assert "inv-never was never admitted" in summary["results"][2]["message"]
    errors_ = err.splitlines()
    assert len(errors_) == 2
    assert errors_[0].startswith(f"error: QL3_CONFLICT: invocation {ids[1]}: ")
    assert errors_[1].startswith("error: QL3_NOT_FOUND: invocation inv-never: ")

    code, out, err = run_text(capsys, "resolve", "--decision", "fail", "--user", "alice",
                              "--reason", "outage", *ids)  # fmt: skip
    assert code == 1 and len(err.splitlines()) == 2
    assert [line.split() for line in out.splitlines()[:-1]] == [
        ["existing", ids[0]], ["refused", ids[1], "QL3_CONFLICT"],
        ["refused", ids[2], "QL3_NOT_FOUND"], ["existing", ids[3]]]  # fmt: skip
    assert out.splitlines()[-1].startswith("2 of 4 resolved as fail by alice (0 created, "
                                           "2 existing), 2 refused, 0 not tried")  # fmt: skip


def test_resolve_stops_trying_once_the_database_is_unavailable(
    capsys: pytest.CaptureFixture[str],
    runtime: PgStore,
    as_role: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [invocation_id(settled(runtime, Outcome.LOST)[1]) for _ in range(3)]
    real_resolve = invocations_cli.resolve

    def connection_lost_at_the_second(store: PgStore, target: str, **kw: Any) -> Any:
        if target == ids[1]:
            raise errors.OutcomeUnknown("QL3_UNAVAILABLE: connection lost during the commit")
        return real_resolve(store, target, **kw)

    monkeypatch.setattr(invocations_cli, "resolve", connection_lost_at_the_second)
    as_role("operator")
    argv = ("resolve", "--decision", "fail", "--user", "alice", *ids)
    code, summary, err = run(capsys, *argv, "--json")
    assert code == 1
    assert [r["status"] for r in summary["results"]] == ["created", "refused", "not_tried"]
    assert summary["results"][1]["code"] == "QL3_UNAVAILABLE"
    assert err.splitlines() == [
        f"error: QL3_UNAVAILABLE: invocation {ids[1]}: connection lost during the commit"
    ]

    monkeypatch.setattr(invocations_cli, "resolve", real_resolve)
    code, summary, err = run(capsys, *argv, "--json")  # the rerun finishes the job
    assert code == 0 and err == ""
    assert [r["status"] for r in summary["results"]] == ["existing", "created", "created"]


def test_resolve_text_output_escapes_control_characters(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    _, lost = settled(runtime, Outcome.LOST)
    as_role("operator")
    hostile_reason = "outage \x1b]0;owned\x07 \x9b2J"
    hostile_id = "inv-\x1b[2J"
    argv = ("resolve", "--decision", "cancel", "--user", "alice", "--reason", hostile_reason,
            invocation_id(lost), hostile_id)  # fmt: skip
    code, out, err = run_text(capsys, *argv)
    assert code == 1
    for text in (out, err):
        assert not any(c in text for c in "\x1b\x07\x9b"), repr(text)
    assert "reason: outage \\x1b]0;owned\\x07 \\x9b2J" in out
    assert "refused   inv-\\x1b[2J  QL3_NOT_FOUND" in out
    assert "inv-\\x1b[2J" in err


def test_resolve_takes_a_bounded_number_of_invocations(
    capsys: pytest.CaptureFixture[str], as_role: Any
) -> None:
    as_role("operator")
    many = [f"inv-{n}" for n in range(invocations_cli.MAX_RESOLVE_IDS + 1)]
    code, _, err = run(capsys, "resolve", "--decision", "fail", "--user", "alice", *many)
    assert code == 2 and err.startswith("error: QL3_INVALID_ARGUMENT: at most 10000")


def test_the_runtime_role_cannot_resolve_from_the_cli(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    step, lost = settled(runtime, Outcome.LOST)
    as_role("runtime")
    code, _, err = run(capsys, "resolve", invocation_id(lost), "--decision", "retry",
                       "--user", "worker", "--json")  # fmt: skip
    assert code == 1 and err.startswith("error: QL3_PERMISSION_DENIED")
    step_row = runtime.step_run(step)
    assert step_row is not None and step_row["status"] == "lost"


# -- usage -----------------------------------------------------------------------------


def test_usage_totals_by_provider_and_model_within_the_window(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    settled(runtime, Outcome.SUCCEEDED, usage=Usage(input_tokens=10, cost_micros=7, currency="USD"))
    settled(runtime, Outcome.FAILED, usage=Usage(input_tokens=5, cost_micros=3, currency="USD"))
    settled(runtime, Outcome.SUCCEEDED, usage=Usage(output_tokens=4))
    as_role("reader")

    code, rows, _ = run(capsys, "usage", "--project", PROJECT)
    assert code == 0
    by_currency = {r["currency"]: r for r in rows}
    assert by_currency["USD"]["completions"] == 2 and by_currency["USD"]["input_tokens"] == 15
    assert by_currency["USD"]["known_cost_micros"] == 10
    assert by_currency[None]["unknown_cost_completions"] == 1

    hour_ago = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    code, rows, _ = run(capsys, "usage", "--project", PROJECT, "--since", hour_ago)
    assert code == 0 and len(rows) == 2
    code, rows, _ = run(capsys, "usage", "--project", PROJECT, "--until", "2000-01-01")
    assert code == 0 and rows == []
    code, _, err = run(capsys, "usage", "--project", PROJECT, "--since", "last week")
    assert code == 1 and err.startswith("error: QL3_INVALID_ARGUMENT")


# -- recover ---------------------------------------------------------------------------


def test_recover_once_prints_what_it_settled(
    capsys: pytest.CaptureFixture[str], runtime: PgStore, as_role: Any
) -> None:
    step, expired = running(runtime, deadline=PAST)
    running(runtime)
    as_role("operator")
    code, result, _ = run(capsys, "recover", "--grace", "0")
    assert code == 0 and result["count"] == 1
    assert result["recovered"][0]["invocation_id"] == invocation_id(expired)
    step_row = runtime.step_run(step)
    assert step_row is not None and step_row["status"] == "lost"
    code, result, _ = run(capsys, "recover", "--grace", "0")
    assert code == 0 and result == {"count": 0, "recovered": [], "failed": []}
    code, _, err = run(capsys, "recover", "--limit", "0")
    assert code == 2 and err.startswith("error: QL3_INVALID_ARGUMENT")  # a bad setting


def test_recover_as_runtime_is_permission_denied(
    capsys: pytest.CaptureFixture[str], as_role: Any
) -> None:
    as_role("runtime")
    code, _, err = run(capsys, "recover")
    assert code == 1 and err.startswith("error: QL3_PERMISSION_DENIED")


def fetch(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_recovery_loop_drains_full_batches_then_waits(runtime: PgStore, db_dsn: str) -> None:
    steps = [running(runtime, deadline=PAST)[0] for _ in range(5)]
    config = RecoveryConfig(limit=2, grace_seconds=0, interval=3600, metrics_port=0)
    loop = RecoveryLoop(role_dsn(db_dsn, "operator"), config, registry=CollectorRegistry())
    loop.start()
    try:
        loop.wait_until(lambda r: r.recovered == 5)
        assert loop.batches == 3  # 2 + 2 + 1: the short batch ends the round
        assert loop.metrics_port is not None
        status, body = fetch(loop.metrics_port, "/metrics")
        assert status == 200
        assert "ql3_recovery_recovered_total 5.0" in body
        assert "ql3_recovery_errors_total 0.0" in body
        assert "ql3_recovery_last_run_timestamp_seconds" in body
        status, body = fetch(loop.metrics_port, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
    finally:
        loop.stop()
    for step in steps:
        row = runtime.step_run(step)
        assert row is not None and row["status"] == "lost"


def test_recovery_loop_logs_database_errors_and_keeps_retrying(db_dsn: str) -> None:
    config = RecoveryConfig(grace_seconds=0, interval=0.05, backoff_initial=0.01,
                            backoff_max=0.05, metrics_port=0)  # fmt: skip
    # The runtime role may not recover: every batch fails with QL3_PERMISSION_DENIED.
    loop = RecoveryLoop(role_dsn(db_dsn, "runtime"), config, registry=CollectorRegistry())
    loop.start()
    try:
        loop.wait_until(lambda r: r.errors >= 3)
        assert loop.batches == 0 and not loop.stopping
        assert loop.last_error is not None and "PermissionDenied" in loop.last_error
        assert loop.metrics_port is not None
        status, body = fetch(loop.metrics_port, "/healthz")
        assert status == 503 and json.loads(body)["status"] == "failing"
        status, body = fetch(loop.metrics_port, "/metrics")
        assert "ql3_recovery_errors_total" in body and "ql3_recovery_up 0.0" in body
    finally:
        loop.stop()


class LineReader:
    """The lines a process writes to a pipe, awaited one by one."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.stream:
            self.lines.put(line)

    def close(self) -> None:
        """After the process ended: wait for the pipe's end, then close it."""
        self.pump.join(timeout=10)
        self.stream.close()

    def until(self, event: str, timeout: float = 20.0, **fields: Any) -> dict[str, Any]:
        deadline = datetime.now(UTC) + timedelta(seconds=timeout)
        while (left := (deadline - datetime.now(UTC)).total_seconds()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            doc = json.loads(line)
            if doc.get("event") == event and all(doc.get(k) == v for k, v in fields.items()):
                return dict(doc)
        raise AssertionError(f"no {event} log line; saw: {''.join(self.seen)}")


@contextlib.contextmanager
def recover_loop(dsn: str, *flags: str) -> Iterator[tuple[subprocess.Popen[str], LineReader]]:
    """``ql3 recover --loop --grace 0 --metrics-port 0 FLAGS`` as a process of its own on
    ``dsn``, and a reader of its log lines; killed at the end if still running."""
    exe = Path(sys.executable).with_name("ql3")
    argv = [str(exe), "recover", "--loop", "--grace", "0", "--metrics-port", "0", *flags]
    env = {**os.environ, "QL3_DSN": dsn}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    logs = LineReader(proc.stderr)
    try:
        yield proc, logs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        logs.close()


def test_recover_loop_process_recovers_serves_metrics_and_exits_0_on_sigterm(
    runtime: PgStore, db_dsn: str
) -> None:
    with recover_loop(role_dsn(db_dsn, "operator"), "--interval", "0.1") as (proc, logs):
        port = int(logs.until("metrics_listening")["port"])
        _, expired = running(runtime, deadline=PAST)
        logs.until("invocation_recovered", invocation_id=invocation_id(expired))
        status, body = fetch(port, "/metrics")
        assert status == 200 and "ql3_recovery_recovered_total 1.0" in body
        assert fetch(port, "/healthz")[0] == 200

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        logs.until("recovery_stopped", recovered=1)


# -- bad settings, stalled connections, stop grace --------------------------------------


@pytest.mark.parametrize(
    "setting",
    [
        {"interval": float("nan")},
        {"interval": float("inf")},
        {"interval": 1e10},
        {"interval": 0},
        {"backoff_max": float("nan")},
        {"backoff_initial": float("inf")},
        {"backoff_max": -1.0},
        {"statement_timeout": float("nan")},
        {"health_margin": float("nan")},
        {"stop_grace": 0},
        {"metrics_port": 99999},
    ],
)
def test_recovery_settings_must_be_finite_positive_and_at_most_a_day(
    setting: dict[str, Any],
) -> None:
    with pytest.raises(errors.InvalidArgument, match="QL3_INVALID_ARGUMENT"):
        RecoveryConfig(**setting)


def test_recovery_settings_from_the_environment_are_checked_too() -> None:
    parser = argparse.ArgumentParser()
    recovery.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["recover", "--loop"])
    for var in ("QL3_RECOVERY_INTERVAL", "QL3_RECOVERY_BACKOFF_MAX"):
        for text in ("nan", "inf", "1e10"):
            with pytest.raises(errors.InvalidArgument, match="at most 86400"):
                recovery.config_from_args(args, {var: text})


def test_recover_loop_bad_flags_are_clean_errors(
    capsys: pytest.CaptureFixture[str],
    as_role: Any,
    root_logging: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    as_role("operator")
    real_run = RecoveryLoop.run

    def must_not_run(loop: RecoveryLoop) -> None:
        raise AssertionError(f"the loop ran with {loop.config}")  # NaN would spin for ever

    monkeypatch.setattr(RecoveryLoop, "run", must_not_run)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = str(taken.getsockname()[1])
        for flags, message, exit_code in (
            (["--interval", "nan"], "interval must be a number of seconds", 2),
            (["--interval", "inf"], "interval must be a number of seconds", 2),
            (["--backoff-max", "nan"], "backoff_max must be a number of seconds", 2),
            (["--log-level", "bogus"], "log level 'bogus' is not one of", 2),
            (["--metrics-port", "99999"], "metrics port 99999 is not a TCP port", 2),
            (["--metrics-port", busy], f"cannot serve /metrics on 127.0.0.1:{busy}", 1),
        ):
            if flags[-1] == busy:
                monkeypatch.setattr(RecoveryLoop, "run", real_run)  # binding is run's job
            code, _, err = run(capsys, "recover", "--loop", *flags)
            assert code == exit_code, flags
            last = err.strip().splitlines()[-1]
            assert last.startswith(f"error: QL3_INVALID_ARGUMENT: {message}"), err
            assert "Traceback" not in err


def test_a_malformed_dsn_is_invalid_argument_in_every_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QL3_DSN", "bogus")
    for argv in (
        ["invocations", "list"],
        ["invocations", "show", "inv-1"],
        ["resolve", "inv-1", "--decision", "fail", "--user", "u"],
        ["usage", "--project", "p"],
        ["recover"],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2, argv  # the command did not start
        assert err.startswith("error: QL3_INVALID_ARGUMENT: malformed connection string"), err


def wait_for_health(port: int, status: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        code, body = fetch(port, "/healthz")
        report: dict[str, Any] = json.loads(body)
        if report["status"] == status:
            assert code == (200 if status == "ok" else 503)
            return report
        if time.monotonic() > deadline:
            raise AssertionError(f"/healthz never said {status}: last {report}")
        time.sleep(0.05)  # polling a condition, with a deadline


def test_healthz_is_stale_when_a_batch_hangs_on_a_stalled_connection(
    db_dsn: str,
    pg_proxy: PgProxy,  # noqa: F811
) -> None:
    config = RecoveryConfig(grace_seconds=0, interval=0.05, statement_timeout=0.5,
                            health_margin=0.5, metrics_port=0)  # fmt: skip
    loop = RecoveryLoop(pg_proxy.dsn(role_dsn(db_dsn, "operator")), config)
    loop.start()
    try:
        loop.wait_until(lambda r: r.batches >= 1)
        assert loop.metrics_port is not None
        wait_for_health(loop.metrics_port, "ok")
        pg_proxy.freeze()  # the next batch's query is never answered
        report = wait_for_health(loop.metrics_port, "stale")
        assert "no batch has committed for" in report["reason"]
        assert report["consecutive_errors"] == 0
    finally:
        loop.request_stop()
        pg_proxy.close()  # cuts the frozen connection: the batch fails and the loop ends
        loop.stop(timeout=10)


def test_sigterm_ends_the_daemon_within_stop_grace_even_while_a_batch_hangs(
    db_dsn: str,
    pg_proxy: PgProxy,  # noqa: F811
) -> None:
    with recover_loop(
        pg_proxy.dsn(role_dsn(db_dsn, "operator")), "--interval", "0.05",
        "--statement-timeout", "0.5", "--health-margin", "0.5", "--stop-grace", "1",
    ) as (proc, logs):  # fmt: skip
        port = int(logs.until("metrics_listening")["port"])
        wait_for_health(port, "ok")
        pg_proxy.freeze()
        wait_for_health(port, "stale")  # a batch is stuck on the frozen connection

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 1
        logs.until("stop_requested", signal="SIGTERM")
        logs.until("stop_grace_exceeded", stop_grace=1.0)


def test_the_signal_handler_takes_no_lock_the_interrupted_thread_may_hold(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A signal handler runs on the main thread between two bytecodes, possibly while that
    # thread holds the stop Event's lock inside wait(): a handler that needs the lock
    # (Event.set) would then wait for itself for ever. Here another thread holds it.
    loops: list[RecoveryLoop] = []

    class Captured(RecoveryLoop):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            loops.append(self)

    monkeypatch.setattr(recovery, "RecoveryLoop", Captured)
    original = signal.getsignal(signal.SIGTERM)
    returned_while_held: list[bool] = []

    def interrupt() -> None:
        deadline = time.monotonic() + 10
        while not loops or signal.getsignal(signal.SIGTERM) is original:
            assert time.monotonic() < deadline, "serve never installed its handler"
            time.sleep(0.01)  # polling a condition, with a deadline
        loops[0].wait_until(lambda r: r.batches >= 1)
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with loops[0]._stop._cond:  # type: ignore[attr-defined]
            call = threading.Thread(target=handler, args=(signal.SIGTERM, None), daemon=True)
            call.start()
            call.join(2)
            returned_while_held.append(not call.is_alive())

    helper = threading.Thread(target=interrupt, daemon=True)
    helper.start()
    config = RecoveryConfig(grace_seconds=0, interval=3600)
    assert recovery.serve(role_dsn(db_dsn, "operator"), config) == 0
    helper.join(10)
    assert returned_while_held == [True], "the SIGTERM handler waited for the stop Event's lock"
