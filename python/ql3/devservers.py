"""Throwaway PostgreSQL and Redis servers on free loopback ports, for the demo, the
benchmarks, fault tests that restart a server, and development.

``python -m ql3.devservers -- CMD ...`` starts both, exports ``QL3_TEST_DSN`` (superuser,
database ``ql3_test``) and ``QL3_TEST_REDIS_URL``, runs CMD and removes the servers
afterwards; ``up`` and ``down`` (``make db-up`` / ``make db-down``) start servers that
outlive the command and stop them. The test suite's own PostgreSQL comes from
pytest-postgresql (tests/py/fix_servers.py). As root, PostgreSQL runs as the ``postgres`` system
user because ``initdb`` and ``postgres`` refuse to run as root. When ``QL3_TEST_DSN`` /
``QL3_TEST_REDIS_URL`` are already set, the existing servers are used and nothing starts.
"""

from __future__ import annotations

import contextlib
import json
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


def wait_port(port: int, timeout: float = 30.0) -> None:
    """Wait until a server listens on 127.0.0.1:port. A connection to itself does not
    count: a port of the ephemeral range that nothing listens on yet can be given to the
    probe as its own source port, and TCP's simultaneous open then connects it to itself."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2) as s:
            if s.getsockname() != s.getpeername():
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
        wait_port(self.port)
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
        wait_port(self.port)

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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def up(state_dir: Path) -> int:
    """Start development servers that outlive this process (``make db-up``): PostgreSQL with
    a database ``ql3`` migrated with both streams, and Redis. Prints their settings and
    writes them to ``state_dir/env``; ``down`` stops them."""
    state_file = state_dir / "servers.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if _pid_alive(state["postgres_pid"]) and _pid_alive(state["redis_pid"]):
            print((state_dir / "env").read_text(), end="")
            return 0
        down(state_dir)
    from ql3.migrate import migrate  # needs the postgres extra; the edge shim does not

    state_dir.mkdir(parents=True, exist_ok=True)
    # The data live under the system's temporary directory, which the postgres user can
    # reach wherever the checkout is; the state stays in state_dir.
    root = Path(tempfile.mkdtemp(prefix="ql3-dev-"))
    pg = start_postgres(root)
    rd = start_redis(root)
    assert pg.proc is not None and rd.proc is not None
    # Recorded at once, so that down() stops them if anything below fails.
    state = {"root": str(root), "postgres_pid": pg.proc.pid, "redis_pid": rd.proc.pid}
    state_file.write_text(json.dumps(state))
    try:
        dsn = create_database(pg, "ql3")
        migrate(dsn, with_ai=True)
    except BaseException:
        down(state_dir)
        raise
    env = f"export QL3_DSN={dsn}\nexport QL3_REDIS_URL={rd.url}\n"
    (state_dir / "env").write_text(env)
    print(env, end="")
    print(f"# stop them with: make db-down   (settings in {state_dir / 'env'})", file=sys.stderr)
    return 0


def down(state_dir: Path) -> int:
    """Stop the servers ``up`` started and remove their files."""
    state_file = state_dir / "servers.json"
    if not state_file.exists():
        print("no development servers are running", file=sys.stderr)
        return 0
    state = json.loads(state_file.read_text())
    for key, sig in (("redis_pid", signal.SIGKILL), ("postgres_pid", signal.SIGINT)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(state[key], sig)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        _pid_alive(state[key]) for key in ("redis_pid", "postgres_pid")
    ):
        time.sleep(0.05)
    shutil.rmtree(state["root"], ignore_errors=True)
    state_file.unlink()
    (state_dir / "env").unlink(missing_ok=True)
    print("development servers stopped", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    """``up [DIR]`` / ``down [DIR]`` (``make db-up`` / ``db-down``), or ``-- CMD ...``: run
    CMD with throwaway servers in ``QL3_TEST_DSN`` and ``QL3_TEST_REDIS_URL``."""
    if argv and argv[0] in ("up", "down"):
        state_dir = Path(argv[1] if len(argv) > 1 else ".tmp/devservers")
        return up(state_dir) if argv[0] == "up" else down(state_dir)
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print(
            "usage: python -m ql3.devservers up|down [DIR]  |  -- CMD [ARGS...]",
            file=sys.stderr,
        )
        return 2
    with test_servers() as (dsn, redis_url):
        env = dict(os.environ, QL3_TEST_DSN=dsn, QL3_TEST_REDIS_URL=redis_url)
        print(f"servers: postgres {dsn} redis {redis_url}", file=sys.stderr, flush=True)
        return subprocess.run(argv, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
