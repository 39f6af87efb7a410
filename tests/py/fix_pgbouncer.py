"""Debian's PgBouncer in transaction pooling mode, in front of the test cluster.

``pgbouncer`` starts one (session-wide, per configuration) and returns a function that
turns a DSN of the test cluster into the same DSN through the pooler. Two configurations
matter: PgBouncer's default, which refuses the ``options`` startup parameter, and
``ignore_startup_parameters = options``, which accepts and drops it. The server pool is
small (``SERVER_POOL`` server connections per user and database) so that clients share
server connections, as they do in production.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fix_servers import LOGIN_ROLES
from ql3.devservers import free_port, wait_port

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
# Log lines that say PgBouncer stopped listening or accepting, or why it was told to.
NOTABLE = re.compile(r"got SIG|shutting down|ERROR|FATAL|accept\(\)|listen|pause|suspend", re.I)
FAILED_STATES: list[str] = []  # each PgBouncer's state after a failed test, for the run's end
SERVER_POOL = 4
Through = Callable[[str], str]


def _config(pg_host: str, pg_port: int, port: int, root: Path, ignore_options: bool) -> str:
    ignored = "extra_float_digits,options" if ignore_options else "extra_float_digits"
    return f"""
[databases]
* = host={pg_host} port={pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {root}/users.txt
pool_mode = transaction
default_pool_size = {SERVER_POOL}
max_client_conn = 1000
ignore_startup_parameters = {ignored}
logfile = {root}/pgbouncer.log
pidfile = {root}/pgbouncer.pid
admin_users = postgres
"""


def _start(
    base_dsn: str, ignore_options: bool, port: int | None = None
) -> tuple[subprocess.Popen[bytes], int, Path]:
    params = conninfo_to_dict(base_dsn)
    root = Path(tempfile.mkdtemp(prefix="ql3-pgbouncer-"))
    users = ["postgres", *(f"ql3_test_{role}" for role in LOGIN_ROLES)]
    (root / "users.txt").write_text("".join(f'"{user}" ""\n' for user in users))
    port = free_port() if port is None else port
    pg_host = str(params.get("host", "127.0.0.1"))
    pg_port = int(str(params.get("port", 5432)))
    (root / "pgbouncer.ini").write_text(_config(pg_host, pg_port, port, root, ignore_options))
    command = [PGBOUNCER, str(root / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        pg = pwd.getpwnam("postgres")
        for path in (root, *root.iterdir()):
            os.chown(path, pg.pw_uid, pg.pw_gid)
        command = ["runuser", "-u", "postgres", "--", *command]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 15.0)
    except RuntimeError:
        process.kill()
        log = (root / "pgbouncer.log").read_text() if (root / "pgbouncer.log").exists() else ""
        raise RuntimeError(f"pgbouncer did not start: {log[-2000:]}") from None
    return process, port, root


@dataclass
class Bouncer:
    """One running PgBouncer: its process (runuser's, when run as root) and directory."""

    process: subprocess.Popen[bytes]
    root: Path
    port: int
    ignore_options: bool

    @property
    def through(self) -> Through:
        return _through(self.port)

    def alive(self) -> bool:
        """Whether PgBouncer itself still runs (runuser waits for it, so its exit says)."""
        return self.process.poll() is None

    def state(self) -> str:
        """What a failed test needs to know about this PgBouncer: whether it runs, whether
        its port accepts a connection now, how many descriptors it holds, its log's end."""
        pid = _pid(self.root)
        try:
            fds: int | str = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError as exc:
            fds = f"unknown ({exc.strerror})"
        try:
            socket.create_connection(("127.0.0.1", self.port), 1.0).close()
            port = "accepts connections"
        except OSError as exc:
            port = f"refuses a connection ({exc})"
        log = self.root / "pgbouncer.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        notable = [line for line in lines if NOTABLE.search(line)]
        return "\n".join([
            f"alive={self.alive()} pid={pid} port {self.port} {port}; open descriptors: {fds}",
            f"notable log lines ({len(notable)}, the last 20):", *notable[-20:],
            "the log's last 15 lines:", *lines[-15:],
        ])  # fmt: skip


@pytest.fixture(scope="session")
def bouncers(base_dsn: str, migrated_template: str) -> Iterator[dict[str, Bouncer]]:
    """{"default": ..., "ignore_options": ...}: a PgBouncer in transaction mode with each
    configuration. Depends on ``migrated_template``, which creates the login roles the
    auth file lists."""
    started: dict[str, Bouncer] = {}
    try:
        for name, ignore in (("default", False), ("ignore_options", True)):
            process, port, root = _start(base_dsn, ignore)
            started[name] = Bouncer(process, root, port, ignore)
        yield started
    finally:
        for bouncer in started.values():
            _stop(bouncer.process, bouncer.root)


@pytest.fixture
def pgbouncers(
    request: pytest.FixtureRequest, base_dsn: str, bouncers: dict[str, Bouncer]
) -> Iterator[dict[str, Through]]:
    """{"default": through, "ignore_options": through}: each maps a test-cluster DSN to the
    same DSN through that PgBouncer. A test after which a PgBouncer is no longer running
    fails with its state (its log included); the next test gets a new one on the same
    port, rather than a refused connection. When a test fails, or a PgBouncer is found
    stopped at setup, each one's state is written to the run's end (``FAILED_STATES``),
    where CI's output always shows it."""
    failed_before = request.session.testsfailed
    for name, bouncer in bouncers.items():
        if not bouncer.alive():
            FAILED_STATES.append(
                f"{request.node.nodeid}: at setup, pgbouncer {name!r} had stopped since the "
                f"last test's end; started again. Its state: {bouncer.state()}"
            )
            _stop(bouncer.process, bouncer.root)
            bouncer.process, _, bouncer.root = _start(
                base_dsn, bouncer.ignore_options, bouncer.port
            )
    yield {name: bouncer.through for name, bouncer in bouncers.items()}
    if request.session.testsfailed > failed_before:
        FAILED_STATES.extend(
            f"{request.node.nodeid}: pgbouncer {name!r} {bouncer.state()}"
            for name, bouncer in bouncers.items()
        )
    for name, bouncer in bouncers.items():
        assert bouncer.alive(), f"pgbouncer {name!r} exited during the test: {bouncer.state()}"


def _pid(root: Path) -> int | None:
    """PgBouncer's own pid, from its pidfile (None once it has gone)."""
    with contextlib.suppress(OSError, ValueError):
        return int((root / "pgbouncer.pid").read_text().strip())
    return None


def _stop(process: subprocess.Popen[bytes], root: Path) -> None:
    """SIGINT to PgBouncer itself (runuser does not forward signals): a safe shutdown."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        pid = _pid(root)
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        try:
            process.wait(10)
            break
        except subprocess.TimeoutExpired:
            process.kill()
    shutil.rmtree(root, ignore_errors=True)


def _through(port: int) -> Through:
    def through(dsn: str) -> str:
        params = conninfo_to_dict(dsn)
        params.update(host="127.0.0.1", port=str(port))
        return make_conninfo(**params)  # type: ignore[arg-type]

    return through
