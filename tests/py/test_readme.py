"""The README's examples run as written, as the role they say they need, and its
references name what the code has: every command and flag, every environment variable the
daemons read, every metric they export."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fix_servers import role_dsn
from ql3.recovery import RecoveryMetrics
from ql3.relay import RelayMetrics
from test_deploy import assert_ql3_command, env_read_by, ql3_parser

README = Path(__file__).resolve().parents[2] / "README.md"
# The login roles the README's Python examples connect as, and the test users that play them.
EXAMPLE_ROLES = {"app_operator": "operator", "app_worker": "runtime"}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def sql_blocks() -> list[str]:
    return blocks("sql")


def run_psql(dsn: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        check=False,
    )


def test_readme_contract_walkthrough_runs_in_psql_as_operator(db_dsn: str) -> None:
    block = next(b for b in sql_blocks() if "ql3.put_revision" in b and "ql3_ai" not in b)
    result = run_psql(role_dsn(db_dsn, "operator"), block)
    assert result.returncode == 0, result.stderr
    assert '{"a":[1,0.5],"b":1}' in result.stdout
    assert "revision_revoked" in result.stdout


def test_readme_invocation_walkthrough_runs_in_psql(db_dsn: str) -> None:
    # The superuser login exercises the grants anyway: the block SET ROLEs to each role.
    block = next(b for b in sql_blocks() if "ql3_ai.admit_invocation" in b)
    result = run_psql(db_dsn, block)
    assert result.returncode == 0, result.stderr
    assert "retry admitted as attempt 2" in result.stdout
    assert "model_invocation_resolved" in result.stdout


def test_readme_python_store_examples_run_twice(db_dsn: str) -> None:
    """Each example that opens a PgStore runs, and runs again (no fixed ids that conflict)."""
    examples = [b for b in blocks("python") if 'PgStore("postgresql://' in b]
    assert any("admit_invocation" in b for b in examples)
    for block in examples:
        (dsn, login) = re.findall(r'PgStore\("(postgresql://(\w+)@localhost/app)"\)', block)[0]
        script = block.replace(dsn, role_dsn(db_dsn, EXAMPLE_ROLES[login]))
        for attempt in (1, 2):
            done = subprocess.run(
                [sys.executable, "-c", script],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, f"run {attempt} of\n{block}\n{done.stderr}"
            assert done.stderr == "", done.stderr


def run_logging(script: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", f"import logging, ql3\n{script}\n"
         'logging.getLogger("ql3.cache").warning("cache_mode", extra={"ql3": {"mode": "x"}})'],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stderr


def test_ql3_logs_nothing_until_the_application_configures_logging() -> None:
    assert run_logging("") == ""
    assert "cache_mode" in run_logging("logging.basicConfig(level=logging.INFO)")


def shell_commands() -> Iterator[list[str]]:
    """Each ``ql3`` command line in the README's sh blocks (continuations joined, comments
    and what follows ``&&`` dropped), as argv after ``ql3``."""
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split(" && ")[0]
            words = command.split()
            if words and Path(words[0]).name == "ql3":
                yield shlex.split(command, comments=True)[1:]


def test_every_ql3_command_in_the_readme_is_real() -> None:
    commands = list(shell_commands())
    assert len(commands) > 10
    for argv in commands:
        assert_ql3_command(argv, "README.md")


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(command, option) of every option of every (nested) subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, f"{prefix} {name}".strip())
        elif prefix:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    yield prefix, option


def test_the_command_line_reference_names_every_command_and_flag() -> None:
    reference = README.read_text().split("## Command-line reference", 1)[1].split("\n## ")[0]
    pairs = list(subcommands(ql3_parser()))
    assert ("revision put", "--body-file") in pairs
    for command, option in pairs:
        assert command.split()[-1] in reference, f"ql3 {command} is not in the reference"
        assert re.search(re.escape(option) + r"\b", reference), f"ql3 {command} {option}"


@pytest.mark.parametrize("argv", [["relay"], ["recover", "--loop"]])
def test_the_readme_names_every_variable_the_daemons_read(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, root_logging: None
) -> None:
    text = README.read_text()
    for name in env_read_by(argv, monkeypatch):
        if "_TEST_" not in name:  # test hooks stay undocumented
            assert f"`{name}`" in text, f"ql3 {shlex.join(argv)} reads {name}"


def test_the_readme_names_every_metric_the_daemons_export() -> None:
    text = README.read_text()
    for metrics in (RelayMetrics, RecoveryMetrics):
        registry = CollectorRegistry()
        metrics(registry)
        for family in registry.collect():
            name = f"{family.name}_total" if family.type == "counter" else family.name
            assert f"`{name}" in text, f"{name} ({family.documentation}) is not in README.md"
