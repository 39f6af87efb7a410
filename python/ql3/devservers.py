"""Throwaway PostgreSQL and Redis servers on free loopback ports, for tests and the demo.

``python -m ql3.devservers -- CMD ...`` (or ``tests/servers.py``) starts both, exports
``QL3_TEST_DSN`` (superuser, database ``ql3_test``) and ``QL3_TEST_REDIS_URL``, runs CMD
and removes the servers afterwards. As root, PostgreSQL runs as the ``postgres`` system
user because ``initdb`` and ``postgres`` refuse to run as root. When ``QL3_TEST_DSN`` /
``QL3_TEST_REDIS_URL`` are already set, the existing servers are used and nothing starts.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PG_BIN = Path(os.environ.get("QL3_PG_BIN", "/usr/lib/postgresql/15/bin"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_pg_user() -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--"]
    return []


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@dataclass
class PostgresServer:
    """A PostgreSQL cluster in a temporary directory; ``stop``/``start`` restart it in place."""

    datadir: Path
    port: int
    durable: bool = False
    proc: subprocess.Popen[bytes] | None = None

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def dsn(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        cmd = [
            *_as_pg_user(),
            str(PG_BIN / "postgres"),
            "-D", str(self.datadir),
            "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1",
            "-c", f"unix_socket_directories={self.datadir}",
            *self._durability(),
            "-c", "max_connections=300",
            "-c", "shared_buffers=256MB",
            "-c", "log_min_messages=fatal",
        ]  # fmt: skip
        with open(self.datadir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        _wait_port(self.port)
        for _ in range(200):
            ready = subprocess.run(
                [str(PG_BIN / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError("postgres did not become ready")

    def _durability(self) -> list[str]:
        """Tests trade durability for speed; benchmarks keep PostgreSQL's defaults."""
        if self.durable:
            return ["-c", "fsync=on", "-c", "synchronous_commit=on", "-c", "full_page_writes=on"]
        return ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]

    def stop(self, *, fast: bool = True) -> None:
        """Shuts the cluster down; the signal goes to the whole process group because
        ``runuser`` does not forward it to the postmaster."""
        if self.proc is None:
            return
        sig = signal.SIGINT if fast else signal.SIGTERM
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        pidfile = self.datadir / "postmaster.pid"
        deadline = time.monotonic() + 30
        while pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.proc = None

    def psql(self, dbname: str, sql: str) -> None:
        subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", self.dsn(dbname), "-c", sql],
            check=True,
            capture_output=True,
        )


def start_postgres(root: Path, *, durable: bool = False) -> PostgresServer:
    datadir = root / "pgdata"
    datadir.mkdir(parents=True)
    if os.geteuid() == 0:
        pg = pwd.getpwnam("postgres")
        for p in (root, datadir):
            os.chown(p, pg.pw_uid, pg.pw_gid)
        root.chmod(0o755)
    subprocess.run(
        [*_as_pg_user(), str(PG_BIN / "initdb"), "-D", str(datadir), "-U", "postgres",
         "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8", "-N"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    server = PostgresServer(datadir=datadir, port=free_port(), durable=durable)
    server.start()
    return server


@dataclass
class RedisServer:
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        _wait_port(self.port)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None


def start_redis(root: Path) -> RedisServer:
    workdir = root / "redis"
    workdir.mkdir(parents=True)
    server = RedisServer(port=free_port(), workdir=workdir)
    server.start()
    return server


def create_database(server: PostgresServer, name: str) -> str:
    server.psql("postgres", f'CREATE DATABASE "{name}"')
    return server.dsn(name)


@contextlib.contextmanager
def test_servers(*, durable: bool = False) -> Iterator[tuple[str, str]]:
    """Yield (dsn, redis_url): the configured servers, or throwaway ones removed afterwards."""
    dsn = os.environ.get("QL3_TEST_DSN")
    redis_url = os.environ.get("QL3_TEST_REDIS_URL")
    root = Path(tempfile.mkdtemp(prefix="ql3-test-"))
    pg: PostgresServer | None = None
    rd: RedisServer | None = None
    try:
        if not dsn:
            pg = start_postgres(root, durable=durable)
            dsn = create_database(pg, "ql3_test")
        if not redis_url:
            rd = start_redis(root)
            redis_url = rd.url
        yield dsn, redis_url
    finally:
        if rd is not None:
            rd.stop()
        if pg is not None:
            pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: python -m ql3.devservers -- CMD [ARGS...]", file=sys.stderr)
        return 2
    with test_servers() as (dsn, redis_url):
        env = dict(os.environ, QL3_TEST_DSN=dsn, QL3_TEST_REDIS_URL=redis_url)
        print(f"servers: postgres {dsn} redis {redis_url}", file=sys.stderr, flush=True)
        return subprocess.run(argv, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
