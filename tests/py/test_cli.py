"""The ``ql3 revision`` commands, called as a user would (QL3_DSN from the environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def test_missing_dsn_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("QL3_DSN", raising=False)
    code, _, err = run(capsys, "revision", "show", "--revision", "x")
    assert code == 1 and "QL3_DSN" in err


def test_console_script_is_installed_and_answers_help() -> None:
    exe = Path(sys.executable).with_name("ql3")
    result = subprocess.run([str(exe), "--help"], capture_output=True, text=True,
                            env=dict(os.environ), check=False)  # fmt: skip
    assert result.returncode == 0
    for command in ("revision", "migrate", "ready"):
        assert command in result.stdout
