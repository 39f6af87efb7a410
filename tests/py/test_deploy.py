"""The deployment files name only things that exist: every ``ql3`` command they run parses
with the real command line, and the services are wired as the relay needs."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
QL3_IMAGE = "ql3:local"


def ql3_parser() -> argparse.ArgumentParser:
    """ql3.cli's parser; without cli.py, one built from each module's ``register``."""
    try:
        cli = importlib.import_module("ql3.cli")
    except ModuleNotFoundError as exc:
        if exc.name != "ql3.cli":
            raise
    else:
        parser: argparse.ArgumentParser = cli.build_parser()
        return parser
    parser = argparse.ArgumentParser(prog="ql3")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in ("ql3.migrate", "ql3.relay"):
        importlib.import_module(name).register(subparsers)
    return parser


def assert_ql3_command(argv: list[str], where: str) -> None:
    """argv (what follows ``ql3``) parses, and names a subcommand with a handler."""
    assert argv, f"{where}: empty ql3 command"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = ql3_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(
            f"{where}: `ql3 {shlex.join(argv)}` is not a valid ql3 command: {stderr.getvalue()}"
        ) from exc
    assert callable(getattr(args, "func", None)), f"{where}: {argv[0]} has no handler"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def ql3_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if svc.get("image") == QL3_IMAGE or "build" in svc
    }


def test_compose_runs_postgres_15_redis_7_migrate_and_relay(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "relay"} <= set(services)
    assert services["postgres"]["image"] == "postgres:15"
    assert services["redis"]["image"] == "redis:7"
    for name in ("postgres", "redis", "relay"):
        assert "healthcheck" in services[name], f"{name} has no healthcheck"
    assert services["migrate"]["restart"] == "no"
    relay_deps = services["relay"]["depends_on"]
    assert relay_deps["migrate"]["condition"] == "service_completed_successfully"
    assert relay_deps["redis"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_every_ql3_command_in_compose_is_a_real_subcommand(compose: dict[str, Any]) -> None:
    services = ql3_services(compose)
    assert {"migrate", "relay"} <= set(services)
    for name, svc in services.items():
        command = svc["command"]
        argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        assert_ql3_command(argv, f"docker-compose.yml service {name}")
    assert services["migrate"]["command"] == ["migrate", "--with-ai"]
    assert services["relay"]["command"][0] == "relay"


def test_ql3_services_get_the_database_and_redis_from_the_environment(
    compose: dict[str, Any],
) -> None:
    for name, svc in ql3_services(compose).items():
        assert "QL3_DSN" in svc["environment"], name
    relay = compose["services"]["relay"]
    env = relay["environment"]
    assert env["QL3_REDIS_URL"].startswith("redis://:")  # Redis runs with a password
    port = env["QL3_RELAY_METRICS_PORT"]
    assert env["QL3_RELAY_METRICS_HOST"] == "0.0.0.0"
    probe = " ".join(relay["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/healthz" in probe
    assert relay["stop_signal"] == "SIGTERM"


def test_the_image_runs_ql3() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", dockerfile, re.M)
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["ql3"\]\s*$', dockerfile, re.M)


def unit_values(text: str, key: str) -> list[str]:
    """Values of key in a systemd unit (keys may repeat; comments skipped)."""
    values = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith(("#", ";")) or "=" not in line:
            continue
        name, _, value = line.partition("=")
        if name.strip() == key:
            values.append(value.strip())
    return values


def test_the_systemd_unit_starts_a_real_subcommand() -> None:
    text = (ROOT / "deploy" / "systemd" / "ql3-relay.service").read_text()
    (exec_start,) = unit_values(text, "ExecStart")
    argv = shlex.split(exec_start.lstrip("-@:+!"))
    assert Path(argv[0]).name == "ql3"
    assert_ql3_command(argv[1:], "ql3-relay.service ExecStart")
    assert argv[1] == "relay"
    assert unit_values(text, "KillSignal") == ["SIGTERM"]
    assert unit_values(text, "Restart") == ["always"]


def test_an_unknown_subcommand_is_caught() -> None:
    with pytest.raises(AssertionError, match="not a valid ql3 command"):
        assert_ql3_command(["relay", "--no-such-flag"], "self-test")


def test_compose_runs_the_recovery_loop_after_migrate(compose: dict[str, Any]) -> None:
    recovery = compose["services"]["recovery"]
    assert recovery["command"][:2] == ["recover", "--loop"]
    assert recovery["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert_ql3_command([str(c) for c in recovery["command"]], "docker-compose.yml recovery")
