"""What ql3 prints of text it did not write: no connection password, in any form a DSN or
a Redis URL is given, reaches stdout, stderr or a log line (argparse usage errors, libpq
and psycopg messages, the daemons' logs), and no control character reaches a terminal
raw (error lines, JSON output, log lines), data written through the SQL functions
included."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fix_invocations import admission, model_step
from fix_servers import role_dsn
from ql3 import cli
from ql3.logs import JsonLogFormatter, describe_error
from ql3.safe_text import (
    connection_secrets,
    error_text,
    escape_controls,
    json_text,
    redact,
)
from ql3.store import PgStore

SECRET = "s3cret-Pw"
# Every way a password is written in a DSN or a Redis URL.
DSNS = [
    f"postgresql://u:{SECRET}@h:5432/db",
    f"postgres://u:{SECRET}@h/db?sslmode=require",
    f"postgresql://h/db?user=u&password={SECRET}",
    f"postgresql://u:{SECRET}@[::1]:5432/db",
    f"host=h user=u password={SECRET} dbname=db",
    f"host=h password = '{SECRET} with spaces' dbname=db",
    f"host=h sslpassword={SECRET}",
    f"redis://:{SECRET}@h:6379/0",
    f"rediss://default:{SECRET}@h/0",
    f"redis://h:6379/0?password={SECRET}",
    f"unix:///run/redis.sock?db=2&password={SECRET}",
]
# Raw control characters (C0 but newline, DEL, C1, the Unicode line separators).
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")
# An identifier a terminal would obey: clear the screen, CSI colour, set the window title,
# NEL and the line separator.
HOSTILE = "p\x1b[2J\x9b31m\x1b]0;pwned\x07\u2028\x85end"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stderr of a command line argparse refuses (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err


# -- redaction -----------------------------------------------------------------------


@pytest.mark.parametrize("dsn", DSNS)
def test_every_form_of_password_is_redacted_in_text_that_quotes_it(dsn: str) -> None:
    for text in (dsn, f"invalid choice: {dsn!r} (choose from 'a')", f"bad {dsn}: why"):
        redacted = redact(text)
        assert SECRET not in redacted and "***" in redacted, redacted
    assert SECRET in "".join(connection_secrets(dsn))


def test_redaction_keeps_the_rest_of_the_dsn() -> None:
    assert redact(DSNS[0]) == "postgresql://u:***@h:5432/db"
    assert redact(DSNS[4]) == "host=h user=u password=*** dbname=db"
    assert redact(DSNS[5]) == "host=h password = *** dbname=db"
    assert redact(DSNS[7]) == "redis://:***@h:6379/0"
    assert redact(DSNS[10]) == "unix:///run/redis.sock?db=2&password=***"
    assert redact('password authentication failed for user "u"') == (
        'password authentication failed for user "u"'
    )
    assert (
        redact("postgresql://u@h/db and host=h user=u") == "postgresql://u@h/db and host=h user=u"
    )


def test_known_secrets_are_redacted_wherever_a_message_quotes_them() -> None:
    # libpq ends the userinfo at the first "@": the rest of the password becomes the host.
    dsn = f"postgresql://u:p@ss-{SECRET}@h/db"
    message = f"failed to resolve host 'ss-{SECRET}@h': Name or service not known"
    assert SECRET not in redact(message, connection_secrets(dsn))
    # A key=value password with a backslash escape, quoted back without it.
    dsn = f"host=h password='{SECRET}\\'x'"
    assert SECRET not in redact(f"got {SECRET}'x", connection_secrets(dsn))


def test_describe_error_redacts() -> None:
    text = describe_error(ValueError(f"cannot use {DSNS[0]}\nsecond line"))
    assert text == "ValueError: cannot use postgresql://u:***@h:5432/db"


@pytest.mark.parametrize("dsn", DSNS)
def test_log_lines_redact_every_field_and_the_traceback(dsn: str) -> None:
    try:
        raise ConnectionError(f"lost {dsn}")
    except ConnectionError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("ql3.relay", logging.ERROR, __file__, 1, "to %s", (dsn,), exc_info)
    record.ql3 = {"error": f"at {dsn}", "nested": {"dsns": [dsn]}, "exc": ValueError(dsn)}
    line = JsonLogFormatter().format(record)
    assert SECRET not in line, line
    assert json.loads(line)["nested"]["dsns"][0] == redact(dsn)


ARGV_LEAKS = [
    ["--dsn", "{dsn}", "bogus"],  # a flag before the subcommand: "invalid choice"
    ["ready", "{dsn}"],  # a positional argument no command takes
    ["migrate", "--dsn", "{dsn}", "{dsn}", "--with-ai"],  # "unrecognized arguments: <dsn>"
    ["relay", "--redis-url", "{dsn}", "--batch", "{dsn}"],  # "invalid int value: '<dsn>'"
    ["recover", "--loop", "{dsn}"],
    ["invocations", "list", "--dsn", "{dsn}", "--limit", "{dsn}"],
]


@pytest.mark.parametrize("argv", ARGV_LEAKS, ids=lambda argv: " ".join(argv[:2]))
@pytest.mark.parametrize("dsn", [DSNS[0], DSNS[4], DSNS[5], DSNS[7], DSNS[9]])
def test_usage_errors_never_echo_a_password(
    capsys: pytest.CaptureFixture[str], argv: list[str], dsn: str
) -> None:
    err = parse_error(capsys, *(arg.replace("{dsn}", dsn) for arg in argv))
    assert SECRET not in err and "error:" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["revision", "show", "--revision", "00000000-0000-0000-0000-000000000000"],
        ["invocations", "list"],
        ["migrate"],
        ["ready", "--with-ai"],
    ],
    ids=" ".join,
)
@pytest.mark.parametrize(
    "dsn",
    [
        # libpq takes all of it for the host name, and the error quotes the host.
        f"host=127.0.0.1port=1password={SECRET}",
        # an unencoded "@" in the password: libpq's host is what follows it.
        f"postgresql://u:p@ss-{SECRET}@127.0.0.1:1/db",
    ],
)
def test_connection_errors_never_echo_a_password(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    dsn: str,
) -> None:
    for given in (["--dsn", dsn], []):
        monkeypatch.setenv("QL3_DSN", dsn)
        code, out, err = run(capsys, *argv, *given)
        assert code == 1 and out == "", err
        assert SECRET not in err and "QL3_UNAVAILABLE" in err, err


def test_an_unknown_database_named_in_a_dsn_with_a_password_says_so_without_it(
    capsys: pytest.CaptureFixture[str], db_dsn: str
) -> None:
    params = conninfo_to_dict(role_dsn(db_dsn, "reader"))
    dsn = make_conninfo(**{**params, "password": SECRET, "dbname": "no_such_db"})  # type: ignore[arg-type]
    for argv in (["revision", "show", "--revision", "x"], ["ready"], ["usage", "--project", "p"]):
        code, _, err = run(capsys, *argv, "--dsn", dsn)
        assert code == 1 and 'database "no_such_db" does not exist' in err, err
        assert SECRET not in err


def wait_for_line(
    proc: subprocess.Popen[str], log: Path, needle: str, timeout: float = 30.0
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if needle in text or proc.poll() is not None:
            return text
        time.sleep(0.1)
    return log.read_text()


@pytest.mark.parametrize(
    ("argv", "failure"),
    [
        (["relay", "--metrics-port", "-1"], '"event": "postgres_failed"'),
        (["recover", "--loop", "--interval", "0.2"], "resolve host"),
    ],
    ids=["relay", "recover"],
)
def test_the_daemons_logs_never_carry_a_password(
    tmp_path: Path, argv: list[str], failure: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QL3_")}
    env["QL3_DSN"] = f"host=127.0.0.1port=1password={SECRET} dbname=db"
    env["QL3_REDIS_URL"] = f"redis://:{SECRET}@127.0.0.1:1/0"
    log = tmp_path / "daemon.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ql3.cli", *argv], env=env, stdout=sink, stderr=sink, text=True
        )
    try:
        text = wait_for_line(proc, log, failure)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    text = log.read_text()
    assert failure in text and "resolve host" in text, text
    assert SECRET not in text, text


# -- control characters ----------------------------------------------------------------


def test_every_control_character_is_escaped_and_json_still_decodes() -> None:
    controls = "".join(map(chr, [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]))
    text = f"a{controls}é中"
    assert not RAW_CONTROL.search(escape_controls(text).replace("\n", ""))
    assert escape_controls("\x1b[31m\x9b\u2028\t") == "\\x1b[31m\\x9b\\u2028\\x09"
    assert "\n" not in escape_controls(text)
    encoded = json_text({"k": text}, indent=2)
    assert not RAW_CONTROL.search(encoded) and "é中" in encoded
    assert json.loads(encoded) == {"k": text}


def test_error_lines_are_one_line_with_controls_escaped_and_passwords_hidden() -> None:
    text = error_text(f"no revision of {HOSTILE}\nat {DSNS[0]}")
    assert not RAW_CONTROL.search(text) and "\n" not in text and SECRET not in text


def test_log_lines_escape_control_characters() -> None:
    record = logging.LogRecord("ql3.recovery", logging.INFO, __file__, 1, "x", (), None)
    record.ql3 = {"invocation_id": HOSTILE}
    line = JsonLogFormatter().format(record)
    assert not RAW_CONTROL.search(line) and json.loads(line)["invocation_id"] == HOSTILE


def test_usage_errors_escape_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(capsys, "revision", "show", "--revision", "x", HOSTILE)
    assert "\\x1b[2J\\x9b31m" in err and not RAW_CONTROL.search(err), err


def assert_clean(out: str) -> None:
    found = RAW_CONTROL.search(out)
    assert found is None, f"raw {found[0]!r} in {out!r}"


def test_revision_commands_escape_control_characters_of_real_identifiers(
    capsys: pytest.CaptureFixture[str], db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QL3_DSN", role_dsn(db_dsn, "operator"))
    contract = ("--project", HOSTILE, "--family", "channel_event", "--contract", HOSTILE)
    code, out, err = run(capsys, "revision", "put", *contract, "--body", '{"k": "\\u009b"}')
    assert code == 0, err
    assert_clean(out)
    revision = json.loads(out)
    assert revision["project_id"] == HOSTILE and revision["body"] == {"k": "\x9b"}

    code, out, err = run(capsys, "revision", "show", *contract)
    assert code == 1 and out == "" and "QL3_NOT_FOUND" in err  # nothing active yet
    assert_clean(err)
    assert "\\x1b[2J\\x9b31m" in err, err

    code, out, err = run(capsys, "revision", "show", "--revision", revision["revision_id"])
    assert code == 0 and json.loads(out)["contract_id"] == HOSTILE
    assert_clean(out)


def test_invocations_list_and_show_escape_control_characters_of_real_data(
    capsys: pytest.CaptureFixture[str], db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PgStore(role_dsn(db_dsn, "runtime")) as store:
        run_id, step = model_step(store, project=HOSTILE)
        start: dict[str, Any] = store.admit_invocation(
            admission(run_id, step, project=HOSTILE, model=HOSTILE, provider=HOSTILE)
        )
    invocation = str(start["start"]["invocation_id"])
    monkeypatch.setenv("QL3_DSN", role_dsn(db_dsn, "reader"))

    code, out, err = run(capsys, "invocations", "list", "--project", HOSTILE)
    assert code == 0, err
    assert_clean(out)
    (row,) = json.loads(out)
    assert (row["project_id"], row["model"], row["provider"]) == (HOSTILE,) * 3

    code, out, err = run(capsys, "invocations", "show", invocation)
    assert code == 0, err
    assert_clean(out)
    assert json.loads(out)["start"]["model"] == HOSTILE

    code, out, err = run(capsys, "invocations", "show", HOSTILE)
    assert code == 1 and "QL3_NOT_FOUND" in err
    assert_clean(err)
