"""Throwaway Redis topologies on loopback for pytest: a Cluster and a Sentinel set-up.

``redis_cluster``: three masters and three replicas (``redis-cli --cluster create
--cluster-replicas 1``), node timeout 1 s so that a killed master's replica takes over in
about two seconds. ``redis_sentinel``: one master, one replica, three sentinels
(``redis-server CONF --sentinel``; Debian ships no redis-sentinel binary), quorum 2, down
after 1 s. A third data node replicates from the replica: Sentinel does not know it (it
only reconfigures what the master lists), so a subscriber on it is never disconnected by a
failover, and tests use it as a witness of everything the shard published.

Both are session-scoped but cheap (well under two seconds to start); a test that kills a
master restarts the killed process, so later tests find every node up again (roles may
have moved: the fixtures hand out addresses, not roles).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
SERVICE = "ql3master"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(1000):
        port = random.randint(20000, 30000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(port: int, *args: str, timeout: float = 5.0) -> str:
    """``redis-cli -p port args...``; its output (raises on a non-zero exit)."""
    done = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return done.stdout.strip()


def wait_until(predicate: object, timeout: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            if predicate():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Node:
    """One redis-server process (data node or sentinel) started from its own config."""

    port: int
    workdir: Path
    extra: list[str] = field(default_factory=list)
    sentinel: bool = False
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "redis.conf"
        if not conf.exists():  # a sentinel rewrites its config: keep it across restarts
            lines = [
                f"port {self.port}",
                "bind 127.0.0.1",
                f"dir {self.workdir}",
                "loglevel warning",
                f"logfile {self.workdir / 'redis.log'}",
            ]
            if not self.sentinel:
                # No 5 s wait for more replicas before a full sync starts.
                lines += ['save ""', "appendonly no", "repl-diskless-sync-delay 0"]
            conf.write_text("\n".join([*lines, *self.extra]) + "\n")
        argv = [REDIS_SERVER, str(conf)]
        if self.sentinel:
            argv.append("--sentinel")
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_until(lambda: cli(self.port, "PING") == "PONG", 10, f"redis on {self.port}")

    def kill(self) -> None:
        """SIGKILL: the node vanishes as in a crash (no FIN to wait for from Redis itself)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None


@dataclass
class RedisCluster:
    nodes: list[Node]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])
        return f"redis+cluster://{hosts}"

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def slot_owner(self, slot: int) -> tuple[int, list[int]]:
        """(master port, replica ports) of the shard that owns ``slot``, as a live node says."""
        live = next(n for n in self.nodes if n.alive)
        master = 0
        replicas: list[int] = []
        rows = [line.split() for line in cli(live.port, "CLUSTER", "NODES").splitlines()]
        ids: dict[str, int] = {}
        for row in rows:
            ids[row[0]] = int(row[1].split(":")[1].split("@")[0])
        for row in rows:
            flags = row[2].split(",")
            if "master" not in flags or "fail" in flags:
                continue
            for part in row[8:]:
                low, _, high = part.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    master = ids[row[0]]
        for row in rows:
            flags = row[2].split(",")
            if "slave" in flags and "fail" not in flags and ids.get(row[3]) == master:
                replicas.append(ids[row[0]])
        return master, replicas

    def healthy(self) -> bool:
        return all(
            "cluster_state:ok" in cli(n.port, "CLUSTER", "INFO") for n in self.nodes if n.alive
        )

    def restart_dead(self) -> None:
        """Start every killed node again (it rejoins as a replica of its shard's master)."""
        for node in self.nodes:
            if not node.alive:
                node.start()
        wait_until(self.healthy, 20, "the cluster to be ok again")


def start_cluster(root: Path, nodes: list[Node]) -> RedisCluster:
    """Three masters, three replicas; ``nodes`` gets every node (to stop on failure)."""
    for i in range(6):
        port = cluster_port()
        nodes.append(
            Node(
                port=port,
                workdir=root / f"node{i}",
                extra=[
                    "cluster-enabled yes",
                    f"cluster-config-file nodes-{port}.conf",
                    "cluster-node-timeout 1000",
                    # A replica may take over however long it was cut off (tests kill
                    # masters one after another).
                    "cluster-replica-validity-factor 0",
                ],
            )
        )
    cluster = RedisCluster(nodes)
    for node in nodes:
        node.start()
    subprocess.run(
        [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
         "--cluster-replicas", "1", "--cluster-yes"],
        capture_output=True,
        check=True,
        timeout=60,
    )  # fmt: skip
    wait_until(cluster.healthy, 30, "cluster_state:ok on every node")
    return cluster


@dataclass
class RedisSentinel:
    master: Node
    replica: Node
    witness: Node  # a replica of the replica, unknown to Sentinel
    sentinels: list[Node]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def master_port(self) -> int:
        """The master's port as the first live sentinel reports it."""
        for s in self.sentinels:
            with contextlib.suppress(subprocess.SubprocessError):
                reply = cli(s.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE).split()
                return int(reply[1])
        raise RuntimeError("no sentinel answers")

    def data_node(self, port: int) -> Node:
        return next(n for n in (self.master, self.replica) if n.port == port)


def start_sentinel(root: Path, started: list[Node]) -> RedisSentinel:
    """The set-up; every node it starts is appended to ``started`` (to stop on failure)."""
    master = Node(port=free_port(), workdir=root / "master")
    started.append(master)
    master.start()
    replica = Node(
        port=free_port(),
        workdir=root / "replica",
        extra=[f"replicaof 127.0.0.1 {master.port}", "replica-priority 100"],
    )
    started.append(replica)
    replica.start()
    witness = Node(
        port=free_port(),
        workdir=root / "witness",
        # Priority 0: never promoted, should Sentinel ever find it.
        extra=[f"replicaof 127.0.0.1 {replica.port}", "replica-priority 0"],
    )
    started.append(witness)
    witness.start()
    # Each sentinel is told the others and the replica up front: discovering them by hello
    # messages takes seconds, and a failover needs a quorum that knows each other.
    ports = [free_port() for _ in range(3)]
    ids = [secrets.token_hex(20) for _ in range(3)]
    sentinels = []
    for i in range(3):
        known = [
            f"sentinel known-sentinel {SERVICE} 127.0.0.1 {ports[j]} {ids[j]}"
            for j in range(3)
            if j != i
        ]
        sentinels.append(
            Node(
                port=ports[i],
                workdir=root / f"sentinel{i}",
                sentinel=True,
                extra=[
                    f"sentinel myid {ids[i]}",
                    f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 2",
                    f"sentinel down-after-milliseconds {SERVICE} 1000",
                    f"sentinel failover-timeout {SERVICE} 5000",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    f"sentinel known-replica {SERVICE} 127.0.0.1 {replica.port}",
                    *known,
                ],
            )
        )
    setup = RedisSentinel(master=master, replica=replica, witness=witness, sentinels=sentinels)
    started.extend(sentinels)
    for s in sentinels:
        s.start()

    def linked() -> bool:
        info = cli(replica.port, "INFO", "replication")
        witness_info = cli(witness.port, "INFO", "replication")
        seen = cli(sentinels[0].port, "SENTINEL", "REPLICAS", SERVICE)
        others = cli(sentinels[0].port, "SENTINEL", "SENTINELS", SERVICE)
        return (
            "master_link_status:up" in info
            and "master_link_status:up" in witness_info
            and str(replica.port) in seen
            and others.count("127.0.0.1") >= 2
        )

    wait_until(linked, 30, "replication and three sentinels that know each other")
    return setup


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    root = Path(tempfile.mkdtemp(prefix="ql3-test-cluster-"))
    nodes: list[Node] = []
    try:
        yield start_cluster(root, nodes)
    finally:
        for node in nodes:
            node.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[RedisSentinel]:
    root = Path(tempfile.mkdtemp(prefix="ql3-test-sentinel-"))
    nodes: list[Node] = []
    try:
        yield start_sentinel(root, nodes)
    finally:
        for node in nodes:
            node.kill()
        shutil.rmtree(root, ignore_errors=True)
