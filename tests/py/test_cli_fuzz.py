"""Random arguments to every one-shot command: an exit code of 0, 1 or 2, never a
traceback, and a failure is one ``error: QL3_...`` line (and its detail).

The commands run in-process against a real database, as ``ql3 invocations`` and the
revision commands would from a shell, with values near every check: empty, too long,
not UTF-8 (a shell passes such bytes as lone surrogates), JSON, numbers, times, paths
and argparse's own ``--``. ``QL3_FUZZ_EXAMPLES=N`` runs more, with a random seed.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ql3 import cli

VALUES = st.one_of(
    st.sampled_from([
        "", " ", "proj", "policy_routing", "router", "a" * 129, "\udcff", "x\udcfe",
        "bbbbbbbb-0000-0000-0000-000000000001", "{}", "[]", "null", '{"a": 1}', "0", "-1",
        "1e400", "nan", "inf", "2026-12-02", "2026-12-02T12:00:00", "2026-13-45", "yesterday",
        "9999-12-31T23:59:59+14:00", "0001-01-01", "-", "/nonexistent", "/dev/null", "/tmp",
        "--", "-x", "retry", "fail", "cancel", "1" * 30, "0x10", "\u0661\u0662",
    ]),
    st.text(max_size=20),
)  # fmt: skip
COMMANDS = [
    ("revision put", ["--project", "--family", "--contract", "--body", "--actor"]),
    ("revision put", ["--project", "--family", "--contract", "--body-file", "--actor"]),
    ("revision activate", ["--project", "--family", "--contract", "--revision", "--expect",
                           "--actor"]),
    ("revision revoke", ["", "--reason", "--actor"]),
    ("revision show", ["--project", "--family", "--contract", "--revision"]),
    ("invocations list", ["--project", "--limit"]),
    ("invocations show", [""]),
    ("resolve", ["", "--decision", "--user", "--reason"]),
    ("usage", ["--project", "--since", "--until"]),
    ("recover", ["--limit", "--grace", "--statement-timeout"]),
]  # fmt: skip
"""Each command with its options; "" is a positional argument."""


def call(argv: list[str]) -> tuple[object, str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code: object = cli.main(argv)
    except SystemExit as exc:  # argparse refusing the arguments
        code = exc.code
    return code, err.getvalue()


@settings(
    max_examples=int(os.environ.get("QL3_FUZZ_EXAMPLES", "300")),
    deadline=None,
    derandomize="QL3_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_every_command_ends_with_an_exit_code_and_no_traceback(
    db_dsn: str, data: st.DataObject
) -> None:
    command, options = data.draw(st.sampled_from(COMMANDS))
    argv = command.split()
    for option in options:
        if data.draw(st.integers(0, 4)) == 0:
            continue  # left out
        value = data.draw(VALUES)
        if option:
            argv.append(f"{option}={value}")
        else:  # a positional argument that starts with "-" would read as an option
            argv.append("x" + value if value.startswith("-") else value)
    code, err = call([*argv, f"--dsn={db_dsn}"])
    assert code in (0, 1, 2), (argv, code, err)
    if code == 1:
        lines = err.splitlines()
        assert 1 <= len(lines) <= 2 and lines[0].startswith("error: QL3_"), (argv, err)


@pytest.mark.parametrize(
    "argv",
    [
        ["invocations", "list", "--limit=--"],
        ["recover", "--grace=--"],
        ["usage", "--project=--"],
    ],
)
def test_an_option_given_argparses_double_dash_is_a_usage_error(argv: list[str]) -> None:
    """argparse hands ``--name=--`` an empty list; a number option then raised TypeError."""
    code, err = call(argv)
    assert code == 2
    assert "expected one argument" in err
