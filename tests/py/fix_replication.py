"""A primary and a ``pg_basebackup -R`` streaming replica on loopback, for the failover
tests (tests/py/test_ha.py): crash the primary (``pg_ctl stop -m immediate``), promote the
replica (``pg_ctl promote``), stall its WAL receiver (SIGSTOP).

Both servers run with fsync off (speed; a crash here is a process crash, not a power cut,
so the page cache survives it) and ``synchronous_commit=on``, so that a primary with
``synchronous_standby_names`` set acknowledges a COMMIT only once the replica has flushed
it. As root, every server command runs as the ``postgres`` user (initdb refuses root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

from ql3.devservers import PG_BIN, free_port

SERVER_OPTIONS = (
    "-c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
    " -c synchronous_commit=on -c max_connections=100 -c shared_buffers=64MB"
    " -c wal_level=replica -c max_wal_senders=4 -c wal_keep_size=512MB -c hot_standby=on"
    " -c wal_receiver_status_interval=1s -c log_min_messages=fatal"
)


def _as_postgres() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _run(*cmd: str) -> None:
    subprocess.run([*_as_postgres(), *cmd], check=True, capture_output=True, timeout=120)


@dataclass
class Node:
    """One PostgreSQL server of the pair."""

    name: str
    datadir: Path
    port: int

    def dsn(self, dbname: str = "postgres", user: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={user}"

    def start(self) -> None:
        options = f"-p {self.port} -c unix_socket_directories={self.datadir} {SERVER_OPTIONS}"
        log = str(self.datadir / "server.log")
        _run(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-l", log, "-o", options,
             "-w", "-t", "60", "start")  # fmt: skip

    def crash(self) -> None:
        """Stop at once, as a crash would: no checkpoint, clients cut."""
        _run(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-m", "immediate", "stop")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _run(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-m", "immediate", "stop")

    def promote(self) -> None:
        _run(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-w", "-t", "60", "promote")

    def execute(self, statement: str, dbname: str = "postgres") -> list[tuple[object, ...]]:
        with psycopg.connect(self.dsn(dbname), autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(statement)
            return cur.fetchall() if cur.description else []

    def walreceiver_pid(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = self.execute("SELECT pid FROM pg_stat_wal_receiver WHERE status = 'streaming'")
            if rows and rows[0][0]:
                return int(str(rows[0][0]))
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: no streaming WAL receiver after 30 s")


@dataclass
class Pair:
    primary: Node
    replica: Node

    def multi_host_dsn(self, dbname: str, user: str = "postgres") -> str:
        """Both servers; libpq picks the one that accepts writes."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.replica.port} "
            f"dbname={dbname} user={user} target_session_attrs=read-write connect_timeout=2"
        )

    def make_synchronous(self) -> None:
        """The primary waits for the replica's flush before acknowledging a COMMIT."""
        self.primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        self.primary.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.primary.execute("SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync'"):
                return
            time.sleep(0.1)
        raise TimeoutError("the replica did not become a synchronous standby")


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the block (a replication stall), SIGCONT after it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def replicated_pair() -> Iterator[Pair]:
    """A running primary and the replica's place: the caller prepares its databases on
    the primary, then starts the replica with ``add_replica``. Both are stopped and their
    files removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="ql3-ha-"))
    if os.geteuid() == 0:
        pg = pwd.getpwnam("postgres")
        os.chown(root, pg.pw_uid, pg.pw_gid)
    primary = Node("primary", root / "primary", free_port())
    replica = Node("replica", root / "replica", free_port())
    try:
        _run(str(PG_BIN / "initdb"), "-D", str(primary.datadir), "-U", "postgres",
             "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8", "-N")  # fmt: skip
        primary.start()
        yield Pair(primary, replica)
    finally:
        replica.stop()
        primary.stop()
        shutil.rmtree(root, ignore_errors=True)


def add_replica(pair: Pair) -> None:
    """``pg_basebackup -R`` of the primary as it is now, started as a streaming replica."""
    _run(str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(pair.primary.port),
         "-U", "postgres", "-D", str(pair.replica.datadir), "-R", "-X", "stream",
         "-c", "fast")  # fmt: skip
    pair.replica.start()
    pair.replica.walreceiver_pid()  # streaming
