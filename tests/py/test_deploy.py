"""The deployment files name only things that exist: every ``ql3`` command they run parses
with the real command line, every environment variable they set is one the daemon reads,
and the services are wired as the relay and the recovery daemon need."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import hmac
import importlib
import io
import itertools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ql3 import cli, recovery, relay
from ql3.store import PgStore

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


def test_the_compose_header_names_every_service_it_starts(compose: dict[str, Any]) -> None:
    lines = (ROOT / "docker-compose.yml").read_text().splitlines()
    header = " ".join(line for line in itertools.takewhile(lambda x: x.startswith("#"), lines))
    for name in compose["services"]:
        assert name in header.lower(), f"the docker-compose.yml header never mentions {name}"


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
    # every daemon the image runs needs the server extras (the bare package is the edge shim)
    assert re.search(r"^RUN pip install '\.\[all\]'", dockerfile, re.M)
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


def test_an_unknown_subcommand_is_caught() -> None:
    with pytest.raises(AssertionError, match="not a valid ql3 command"):
        assert_ql3_command(["relay", "--no-such-flag"], "self-test")


def test_compose_runs_the_recovery_loop_after_migrate(compose: dict[str, Any]) -> None:
    recovery = compose["services"]["recovery"]
    assert recovery["command"][:2] == ["recover", "--loop"]
    assert recovery["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert_ql3_command([str(c) for c in recovery["command"]], "docker-compose.yml recovery")


# -- the daemons' logins in compose ------------------------------------------------------

LOGINS_SQL = ROOT / "deploy" / "compose" / "logins.sql"
# Each daemon's service and the one group role its login must be a member of.
DAEMON_GROUPS = {"relay": "ql3_relay", "recovery": "ql3_operator"}
COMPOSE_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}")


def interpolate(value: str, environ: Mapping[str, str] | None = None) -> str:
    """compose's ``${NAME:-default}``: NAME's value when set and not empty, else default."""
    env = environ or {}
    return COMPOSE_VARIABLE.sub(lambda m: env.get(m["name"]) or m["default"] or "", str(value))


def service_environment(compose: dict[str, Any], name: str) -> dict[str, str]:
    env = compose["services"][name]["environment"]
    return {key: interpolate(value) for key, value in env.items()}


def daemon_login(compose: dict[str, Any], service: str) -> tuple[str, str]:
    """(user, password) of a daemon's QL3_DSN, with compose's defaults."""
    params = conninfo_to_dict(service_environment(compose, service)["QL3_DSN"])
    return str(params["user"]), str(params.get("password", ""))


def test_the_daemons_log_in_as_their_own_logins_made_after_migrate(
    compose: dict[str, Any],
) -> None:
    logins = compose["services"]["logins"]
    assert logins["image"] == "postgres:15" and logins["restart"] == "no"
    assert logins["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    command = [str(arg) for arg in logins["command"]]
    assert command[0] == "psql" and "ON_ERROR_STOP=1" in command
    mounts = dict(reversed(volume.split(":")[:2]) for volume in logins["volumes"])
    assert (ROOT / mounts[command[command.index("-f") + 1]]).resolve() == LOGINS_SQL
    passwords = service_environment(compose, "logins")
    for service in DAEMON_GROUPS:
        svc = compose["services"][service]
        assert svc["depends_on"]["logins"]["condition"] == "service_completed_successfully"
        user, password = daemon_login(compose, service)
        assert user != "postgres" and password in passwords.values(), service
        assert password not in " ".join(command), "a password on psql's command line"
    relay_user, recovery_user = (daemon_login(compose, s)[0] for s in DAEMON_GROUPS)
    assert relay_user != recovery_user


def run_logins_sql(
    compose: dict[str, Any], dsn: str, **overrides: str | None
) -> subprocess.CompletedProcess[str]:
    """deploy/compose/logins.sql run as the logins service runs it (its command, its
    environment with compose's defaults), against ``dsn`` instead of the postgres
    service; ``overrides`` change (or, with None, remove) its variables."""
    psql = shutil.which("psql")
    if psql is None:
        pytest.skip("psql is not installed")
    command = [str(arg) for arg in compose["services"]["logins"]["command"]]
    command[command.index("-f") + 1] = str(LOGINS_SQL)
    target = conninfo_to_dict(dsn)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "QL3_"))}
    env.update(service_environment(compose, "logins"))
    env.update(
        PGHOST=str(target.get("host", "")),
        PGPORT=str(target.get("port", "5432")),
        PGUSER=str(target.get("user", "")),
        PGDATABASE=str(target["dbname"]),
        PGPASSWORD=str(target.get("password", "")),
    )
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run(
        [psql, *command[1:]], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def password_matches(stored: str, user: str, password: str) -> bool:
    """Whether ``stored`` (pg_authid.rolpassword, SCRAM or md5) is ``password``'s."""
    if stored.startswith("SCRAM-SHA-256$"):
        head, keys = stored.removeprefix("SCRAM-SHA-256$").split("$")
        iterations, salt = head.split(":")
        salted = hashlib.pbkdf2_hmac(
            "sha256", password.encode(), base64.b64decode(salt), int(iterations)
        )
        client_key = hmac.new(salted, b"Client Key", "sha256").digest()
        return base64.b64encode(hashlib.sha256(client_key).digest()).decode() == keys.split(":")[0]
    return stored == "md5" + hashlib.md5((password + user).encode()).hexdigest()


def fetch(dsn: str, query: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


@pytest.fixture
def compose_logins(compose: dict[str, Any], base_dsn: str) -> Iterator[list[str]]:
    """The daemons' login names; the roles are dropped afterwards (they are cluster-wide)."""
    users = [daemon_login(compose, service)[0] for service in DAEMON_GROUPS]
    yield users
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        for user in users:
            conn.execute(f'DROP ROLE IF EXISTS "{user}"')


def test_the_logins_sql_gives_each_daemon_exactly_its_role_twice_over(
    compose: dict[str, Any], db_dsn: str, compose_logins: list[str]
) -> None:
    first = run_logins_sql(compose, db_dsn)
    assert first.returncode == 0, first.stderr
    relay_user = daemon_login(compose, "relay")[0]
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # by hand, between two runs
        conn.execute(f'GRANT ql3_reader TO "{relay_user}"')
    again = run_logins_sql(compose, db_dsn)
    assert again.returncode == 0, again.stderr

    for service, group in DAEMON_GROUPS.items():
        user, password = daemon_login(compose, service)
        ((superuser, login, inherit, create_role, create_db, replication, bypass, stored),) = fetch(
            db_dsn,
            "SELECT rolsuper, rolcanlogin, rolinherit, rolcreaterole, rolcreatedb,"
            " rolreplication, rolbypassrls, rolpassword FROM pg_authid WHERE rolname = %s",
            [user],
        )
        assert login and inherit and password_matches(stored, user, password), service
        assert not (superuser or create_role or create_db or replication or bypass), service
        groups = fetch(
            db_dsn,
            "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
            " JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = %s",
            [user],
        )
        assert groups == [(group,)], service

    # A changed password takes effect at the next run.
    assert run_logins_sql(compose, db_dsn, QL3_RELAY_DB_PASSWORD="changed-pw").returncode == 0
    ((stored,),) = fetch(
        db_dsn, "SELECT rolpassword FROM pg_authid WHERE rolname = %s", [relay_user]
    )
    assert password_matches(stored, relay_user, "changed-pw")


def as_login(dsn: str, compose: dict[str, Any], service: str) -> str:
    user, password = daemon_login(compose, service)
    return make_conninfo(dsn, user=user, password=password)


def test_the_daemons_logins_can_do_their_jobs_and_no_more(
    compose: dict[str, Any],
    db_dsn: str,
    compose_logins: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    done = run_logins_sql(compose, db_dsn)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(as_login(db_dsn, compose, "relay")) as conn:
        assert conn.execute("SELECT count(*) FROM ql3.claim_outbox(10)").fetchone() == (0,)
        conn.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT ql3_ai.recover_expired(10, interval '30 seconds')")
    with psycopg.connect(as_login(db_dsn, compose, "recovery")) as conn:
        (result,) = conn.execute(
            "SELECT ql3_ai.recover_expired(10, interval '30 seconds')"
        ).fetchone() or (None,)
        assert result["count"] == 0
    for service in DAEMON_GROUPS:
        assert cli.main(["ready", "--with-ai", "--dsn", as_login(db_dsn, compose, service)]) == 0
        ready, durability = capsys.readouterr().out.splitlines()
        assert ready == "ready"
        # every login may read what a COMMIT survives (D49); the test cluster has no standby
        assert durability.startswith("durability: ") and "sync_standbys=0" in durability


def test_the_relay_and_recovery_run_as_their_compose_logins(
    compose: dict[str, Any],
    db_dsn: str,
    redis_url: str,
    compose_logins: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_logins_sql(compose, db_dsn).returncode == 0
    with PgStore(db_dsn, max_connections=1) as store:
        revision = store.put_revision("p", "policy_routing", "c", {"k": 1}, "deploy-test")
        event = store.activate_revision("p", "policy_routing", "c", revision["revision_id"], "t")
    assert event is not None

    async def deliver() -> int:
        config = relay.RelayConfig(
            dsn=as_login(db_dsn, compose, "relay"), redis_url=redis_url, heartbeat_interval=0.1
        )
        daemon = relay.Relay(config)
        await daemon.start()
        try:
            await daemon.wait_ready()
            for _ in range(100):
                if daemon.delivered_seq >= event["seq"]:
                    break
                await asyncio.sleep(0.05)
            return daemon.delivered_seq
        finally:
            await daemon.stop()

    assert asyncio.run(deliver()) >= event["seq"]
    assert cli.main(["recover", "--dsn", as_login(db_dsn, compose, "recovery")]) == 0
    assert '"count": 0' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"QL3_RELAY_DB_PASSWORD": None}, "QL3_RELAY_DB_PASSWORD is not set"),
        ({"QL3_RECOVERY_DB_PASSWORD": None}, "QL3_RECOVERY_DB_PASSWORD is not set"),
        ({"QL3_RELAY_DB_PASSWORD": ""}, "must not be empty"),
    ],
)
def test_the_logins_sql_refuses_a_missing_password(
    compose: dict[str, Any],
    db_dsn: str,
    compose_logins: list[str],
    overrides: dict[str, str | None],
    message: str,
) -> None:
    done = run_logins_sql(compose, db_dsn, **overrides)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert fetch(db_dsn, "SELECT 1 FROM pg_roles WHERE rolname = ANY(%s)", [compose_logins]) == []


# -- the systemd units -------------------------------------------------------------------

SYSTEMD = ROOT / "deploy" / "systemd"
# Each unit, the ql3 command it runs, and the Restart= it needs: the relay restarts always
# (it exits 0 only when stopped), recovery only on failure (exit 2 is a bad configuration).
UNITS = {
    "ql3-relay.service": (["relay"], "always"),
    "ql3-recovery.service": (["recover", "--loop"], "on-failure"),
}
# ``#   NAME=value`` (or ``#   #NAME=value``, commented out) in a unit's header: its example
# EnvironmentFile.
ENV_EXAMPLE_LINE = re.compile(r"^#\s+(#?)(QL3_[A-Z0-9_]+)=(.*)$")


class RecordingEnv(Mapping[str, str]):
    """An environment that remembers every name looked up in it."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.looked_up: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.looked_up.add(name)
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def env_read_by(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The QL3_* variables ``ql3 argv`` (a daemon) reads while it starts: its command runs
    against a recording ``os.environ``, with the daemon's ``serve`` replaced by a no-op.
    Configures the root logger as the daemon does: callers use ``root_logging``."""

    async def serve_relay(config: relay.RelayConfig) -> int:
        return 0

    def serve_recovery(dsn: str, config: recovery.RecoveryConfig) -> int:
        return 0

    env = RecordingEnv({"QL3_DSN": "dbname=never_reached", "QL3_REDIS_URL": "redis://h:1/0"})
    with monkeypatch.context() as patch:
        patch.setattr(os, "environ", env)
        patch.setattr(relay, "serve", serve_relay)
        patch.setattr(recovery, "serve", serve_recovery)
        args = ql3_parser().parse_args(argv)
        assert args.func(args) == 0, f"ql3 {shlex.join(argv)} did not start"
    return {name for name in env.looked_up if name.startswith("QL3_")}


def env_example(text: str) -> list[tuple[str, str, bool]]:
    """(name, value, set) of each example line in a unit's header; set is False for a line
    that is commented out."""
    found = []
    for line in text.splitlines():
        match = ENV_EXAMPLE_LINE.match(line)
        if match:
            found.append((match[2], match[3], not match[1]))
    return found


def seconds(value: str) -> float:
    return float(value.removesuffix("s"))


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_each_systemd_unit_starts_its_real_subcommand(unit: str) -> None:
    command, restart = UNITS[unit]
    text = (SYSTEMD / unit).read_text()
    (exec_start,) = unit_values(text, "ExecStart")
    argv = shlex.split(exec_start.lstrip("-@:+!"))
    assert Path(argv[0]).name == "ql3"
    assert_ql3_command(argv[1:], f"{unit} ExecStart")
    assert argv[1 : 1 + len(command)] == command
    assert unit_values(text, "KillSignal") == ["SIGTERM"]
    assert unit_values(text, "Restart") == [restart]


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_each_unit_sets_only_variables_its_daemon_reads(
    unit: str, monkeypatch: pytest.MonkeyPatch, root_logging: None
) -> None:
    command, _ = UNITS[unit]
    text = (SYSTEMD / unit).read_text()
    (env_file,) = unit_values(text, "EnvironmentFile")
    assert env_file.lstrip("-") in text.split("[Unit]")[0], f"{unit}: {env_file} not explained"
    example = env_example(text)
    assert "QL3_DSN" in {name for name, _, _ in example}, f"{unit}: no example env file"
    read = env_read_by(command, monkeypatch)
    for name, value, _ in example:
        assert name in read, f"{unit}: ql3 {shlex.join(command)} never reads {name}"
        assert "_TEST_" not in name, f"{unit}: {name} is a test hook"
        # systemd keeps a '#' after a value as part of the value
        assert "#" not in value, f"{unit}: {name}={value}: a comment belongs on its own line"


def test_an_inline_comment_in_an_example_env_file_is_caught() -> None:
    (example,) = env_example("#   QL3_RELAY_LISTEN_DSN=     # set when QL3_DSN is pooled")
    assert example[0] == "QL3_RELAY_LISTEN_DSN" and "#" in example[1]


def example_settings(unit: str) -> dict[str, str]:
    return {name: value for name, value, on in env_example((SYSTEMD / unit).read_text()) if on}


def test_the_relay_example_settings_are_valid_and_stop_in_time() -> None:
    text = (SYSTEMD / "ql3-relay.service").read_text()
    args = ql3_parser().parse_args(["relay"])
    config = relay.config_from_args(args, example_settings("ql3-relay.service"))
    (timeout,) = unit_values(text, "TimeoutStopSec")
    assert seconds(timeout) > config.stop_grace


def test_the_recovery_unit_waits_longer_than_the_stop_grace() -> None:
    text = (SYSTEMD / "ql3-recovery.service").read_text()
    (exec_start,) = unit_values(text, "ExecStart")
    args = ql3_parser().parse_args(shlex.split(exec_start)[1:])
    config = recovery.config_from_args(args, example_settings("ql3-recovery.service"))
    assert config.metrics_port is not None, "the example serves no /healthz"
    (timeout,) = unit_values(text, "TimeoutStopSec")
    # SIGKILL before the grace is over would cut a batch that was about to commit.
    assert seconds(timeout) >= config.stop_grace + 10
