"""``make demo`` tells the whole story on SQLite with no server, and on PostgreSQL with
``--dsn``: the same steps, the same outcomes."""

from __future__ import annotations

import re

import pytest

from ql3 import demo

STORY = [
    r"== store: SQLite|== store: PostgreSQL",
    r"migrations applied: (core 0001_canonical\.sql|none \(already up to date\))",
    r"== activated revision 1: pointer swap and outbox row",
    r"== a worker cache loaded the policy: revision 1",
    r"the relay delivered outbox seq \d+ and the worker cache reloaded revision 2",
    r"a stale compare-and-set is refused: QL3_CONFLICT",
    r"succeeded v3 attempt 1 result_code=ok output_ref=model-invocation:",
    r"exact replay: MODEL_INVOCATION_REPLAY_BLOCKED, provider calls 1 -> 1",
    r"\(HTTP 503\): MODEL_PROVIDER_FAILED",
    r"failed v3 attempt 1 result_code=provider_http_503",
    r"deadline: MODEL_DEADLINE_EXCEEDED",
    r"timed_out v3 attempt 1 result_code=deadline_exceeded",
    r"lost v3 attempt 1 result_code=outcome_unknown",
    r"replaying the lost completion the gateway wrote is 'existing'",
    r"carol resolves the lost call: retry",
    r"ready v4 attempt 1 result_code=None",
    r"a new invocation on the same step succeeds: attempt 2",
    r"succeeded v6 attempt 2 result_code=ok",
    # A crashed worker's call, recovered and resolved from the command line (issue 22.4).
    r"a worker admits inv-crashed-\w+ and crashes before the call completes",
    r"running v2 attempt 1 result_code=None",
    r"\$ ql3 recover --grace 0 (--sqlite \S+|--dsn \$QL3_DSN)\n",
    r'"count": 1,',
    r'"invocation_id": "inv-crashed-\w+"',
    r"\$ ql3 invocations list --unresolved (--sqlite \S+|--dsn \$QL3_DSN)\n",
    r"AGE +PROJECT +PROVIDER/MODEL",
    r"\n\d+s +demo +stub/qwen2\.5:7b +1 .* inv-crashed-\w+\n",
    r"\$ ql3 resolve inv-crashed-\w+ --decision fail --user carol --reason '[^']+' "
    r"(--sqlite \S+|--dsn \$QL3_DSN)\n",
    r"created   inv-crashed-\w+\n",
    r"1 of 1 resolved as fail by carol \(1 created, 0 existing\)",
    r"failed v4 attempt 1 result_code=model_outcome_rejected",
    r'"unknown_cost_completions": 2',
    r"demo finished",
]


def assert_story(out: str) -> None:
    position = 0
    for line in STORY:
        found = re.compile(line).search(out, position)
        assert found is not None, f"missing, or out of order: {line}\n{out}"
        position = found.end()


def test_the_demo_runs_on_sqlite_without_any_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main([]) == 0
    assert_story(capsys.readouterr().out)


def test_the_demo_runs_on_sqlite_in_delete_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--journal-mode", "delete"]) == 0
    assert_story(capsys.readouterr().out)


def test_the_demo_runs_the_same_story_on_postgresql(
    db_dsn: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(["--dsn", db_dsn, "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "== store: PostgreSQL" in out
    assert_story(out)


def test_the_demo_runs_with_the_in_process_provider(capsys: pytest.CaptureFixture[str]) -> None:
    """What a bare ``pip install ql3`` (no httpx) runs: the same story, said in one line."""
    assert demo.main(["--provider", "in-process"]) == 0
    out = capsys.readouterr().out
    assert "provider: an in-process stand-in for the stub HTTP server" in out
    assert_story(out)


def test_the_demo_without_httpx_picks_the_in_process_provider(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "httpx_installed", lambda: False)
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "(httpx is not installed; pip install 'ql3[gateway]' for the HTTP adapter)" in out
    assert_story(out)
    assert demo.main(["--provider", "http"]) == 2
    assert "pip install 'ql3[gateway]'" in capsys.readouterr().err


def test_the_postgresql_demo_without_the_server_extras_names_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "missing_server_modules", lambda: ["psycopg", "redis"])
    assert demo.main(["--dsn", "postgresql://nowhere/none"]) == 2
    err = capsys.readouterr().err
    assert "psycopg, redis not installed" in err
    assert "pip install 'ql3[all]'" in err
