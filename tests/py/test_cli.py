"""The ``ql3 revision`` commands, called as a user would (QL3_DSN from the environment)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fix_servers import role_dsn
from ql3 import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def operator_env(db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    dsn = role_dsn(db_dsn, "operator")
    monkeypatch.setenv("QL3_DSN", dsn)
    monkeypatch.setenv("QL3_ACTOR", "cli-test")
    return dsn


def test_put_activate_show_revoke_round_trip(
    capsys: pytest.CaptureFixture[str], operator_env: str
) -> None:
    contract = ("--project", "p1", "--family", "policy_routing", "--contract", "sre")
    code, out, _ = run(capsys, "revision", "put", *contract, "--body", '{"temperature": 0.2}')
    assert code == 0
    revision = json.loads(out)
    assert revision["revision_no"] == 1 and revision["created_by"] == "cli-test"

    code, out, _ = run(capsys, "revision", "activate", *contract, "--revision",
                       revision["revision_id"])  # fmt: skip
    assert code == 0 and json.loads(out)["pointer_version"] == 1

    code, out, _ = run(capsys, "revision", "show", *contract)
    assert code == 0 and json.loads(out)["body"] == {"temperature": 0.2}

    code, out, _ = run(capsys, "revision", "revoke", revision["revision_id"], "--reason", "test")
    assert code == 0 and json.loads(out)["event_type"] == "revision_revoked"

    code, _, err = run(capsys, "revision", "show", *contract)
    assert code == 1 and "QL3_NOT_FOUND" in err


def test_put_reads_the_body_from_a_file(
    capsys: pytest.CaptureFixture[str], operator_env: str, tmp_path: Path
) -> None:
    body = tmp_path / "policy.json"
    body.write_text('{"routes": ["a", "b"]}')
    code, out, _ = run(capsys, "revision", "put", "--project", "p1", "--family", "channel_event",
                       "--contract", "c", "--body-file", str(body))  # fmt: skip
    assert code == 0 and json.loads(out)["body"] == {"routes": ["a", "b"]}


def test_bad_input_exits_1_with_the_stable_code(
    capsys: pytest.CaptureFixture[str], operator_env: str
) -> None:
    code, _, err = run(capsys, "revision", "put", "--project", "p1", "--family", "nope",
                       "--contract", "c", "--body", "{}")  # fmt: skip
    assert code == 1 and err.startswith("error: QL3_INVALID_ARGUMENT")
    code, _, err = run(capsys, "revision", "put", "--project", "p1", "--family", "channel_event",
                       "--contract", "c", "--body", "{not json")  # fmt: skip
    assert code == 1 and "QL3_INVALID_ARGUMENT" in err


def test_console_script_is_installed_and_answers_help() -> None:
    exe = Path(sys.executable).with_name("ql3")
    result = subprocess.run([str(exe), "--help"], capture_output=True, text=True,
                            env=dict(os.environ), check=False)  # fmt: skip
    assert result.returncode == 0
    for command in ("revision", "migrate", "ready"):
        assert command in result.stdout


def test_an_unreadable_body_file_is_invalid_argument(
    capsys: pytest.CaptureFixture[str], operator_env: str, tmp_path: Path
) -> None:
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"name": "caf\xe9"}')
    for path, reason in (
        (tmp_path / "missing.json", "No such file"),
        (tmp_path, "Is a directory"),
        (latin1, "can't decode"),
    ):
        code, out, err = run(capsys, "revision", "put", "--project", "p1", "--family", "x",
                             "--contract", "c", "--body-file", str(path))  # fmt: skip
        assert code == 1 and out == ""
        assert err.startswith("error: QL3_INVALID_ARGUMENT: cannot read the body from"), err
        assert reason in err and "Traceback" not in err


def test_a_malformed_dsn_is_invalid_argument_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QL3_DSN", "bogus")
    code, _, err = run(capsys, "revision", "show", "--revision", "x")
    assert code == 2  # the command did not start
    assert err.startswith("error: QL3_INVALID_ARGUMENT: malformed connection string"), err
    code, _, err = run(capsys, "revision", "put", "--project", "p1", "--family", "channel_event",
                       "--contract", "c", "--body", "{}", "--dsn", "host='x")  # fmt: skip
    assert code == 2
    assert err.startswith("error: QL3_INVALID_ARGUMENT: malformed connection string"), err


def test_relay_bad_log_level_and_metrics_port_are_clean_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, root_logging: None
) -> None:
    monkeypatch.setenv("QL3_DSN", "dbname=never_reached")
    monkeypatch.setenv("QL3_REDIS_URL", "redis://127.0.0.1:1/0")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = str(taken.getsockname()[1])
        # Settings: the relay's bad_configuration log line, exit 2.
        for flags, message in (
            (["--log-level", "bogus"], "log level 'bogus' is not one of"),
            (["--metrics-port", "99999"], "metrics port 99999 is not a TCP port"),
        ):
            code, _, err = run(capsys, "relay", *flags)
            assert code == 2, flags
            last = json.loads(err.strip().splitlines()[-1])
            assert last["event"] == "bad_configuration" and message in last["error"], err
            assert "Traceback" not in err
        # A port in use is found when the relay starts serving: an error line, exit 1.
        code, _, err = run(capsys, "relay", "--metrics-port", busy)
        assert code == 1
        last = err.strip().splitlines()[-1]
        assert last.startswith(
            f"error: QL3_INVALID_ARGUMENT: cannot serve /metrics on 127.0.0.1:{busy}"
        ), err


def test_python_m_ql3_relay_is_ql3_relay_bad_input_included() -> None:
    env = {**os.environ, "QL3_DSN": "dbname=never_reached", "QL3_REDIS_URL": "redis://h:1/0"}
    done = subprocess.run(
        [sys.executable, "-m", "ql3.relay", "--log-level", "bogus"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = json.loads(done.stderr.strip().splitlines()[-1])
    assert last["event"] == "bad_configuration" and "log level 'bogus'" in last["error"]


ONE_SHOT_COMMANDS = [
    ["revision", "show", "--revision", "00000000-0000-0000-0000-000000000000"],
    ["revision", "put", "--project", "p", "--family", "policy_routing", "--contract", "c",
     "--body", "{}"],
    ["invocations", "list"],
    ["invocations", "show", "inv-1"],
    ["resolve", "inv-1", "--decision", "fail", "--user", "u"],
    ["usage", "--project", "p"],
    ["recover"],
    ["recover", "--loop"],
    ["migrate"],
    ["ready"],
]  # fmt: skip


@pytest.mark.parametrize("argv", ONE_SHOT_COMMANDS, ids=" ".join)
def test_no_database_is_one_error_line_and_exit_2_for_every_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    monkeypatch.delenv("QL3_DSN", raising=False)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and lines[0].endswith(
        "QL3_INVALID_ARGUMENT: no database: pass --dsn or set QL3_DSN"
    ), err


@pytest.mark.parametrize("argv", ONE_SHOT_COMMANDS[:7], ids=" ".join)
def test_an_unreachable_database_says_why_at_once_on_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    base_dsn: str,
    argv: list[str],
) -> None:
    # A database that does not exist: the pool alone would retry for its whole timeout
    # and then say only that it got no connection.
    monkeypatch.setenv("QL3_DSN", f"{base_dsn.rsplit('/', 1)[0]}/no_such_database")
    started = time.monotonic()
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert time.monotonic() - started < 3.0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: QL3_UNAVAILABLE: "), err
    assert 'database "no_such_database" does not exist' in lines[0], err


def test_a_bad_recovery_setting_is_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QL3_DSN", "dbname=never_reached")
    monkeypatch.setenv("QL3_RECOVERY_INTERVAL", "abc")
    code, _, err = run(capsys, "recover", "--loop")
    assert code == 2
    assert err.startswith("error: QL3_INVALID_ARGUMENT: QL3_RECOVERY_INTERVAL='abc'"), err


def test_with_only_the_postgres_extra_the_commands_that_need_it_still_run() -> None:
    # ql3[postgres] without redis-py, prometheus-client or httpx: the relay and recover
    # commands are left out of the parser, the others work.
    blocked = "import sys; sys.modules.update(redis=None, prometheus_client=None, httpx=None)"
    script = f"{blocked}; from ql3 import command; sys.argv[0] = 'ql3'; command.main()"
    for argv, present in ((["migrate", "--help"], True), (["relay", "--help"], False)):
        done = subprocess.run(
            [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60
        )
        assert "Traceback" not in done.stderr, done.stderr
        assert (done.returncode == 0) is present, (argv, done.returncode, done.stderr)
    assert "invalid choice: 'relay'" in done.stderr
