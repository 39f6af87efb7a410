"""The relay and the cache on Redis Sentinel and Redis Cluster (issue 21 section 4, D52, D53).

Each topology runs on loopback (tests/py/fix_redis_topologies.py) with the real PostgreSQL
fixtures. The failover tests kill a master with SIGKILL, make activations while it is
gone, and check that nothing was lost: every event reaches a witness subscriber that no
failover disconnects (the outbox redelivers what the dead master refused), the outbox
drains, and the cache converges to every contract's last revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg.types.json import Jsonb
from redis.asyncio.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

from fix_redis_topologies import RedisCluster, RedisSentinel
from ql3 import errors, redis_links
from ql3.cache import RevisionCache
from ql3.channels import project_channel
from ql3.relay import Relay, RelayConfig

FAMILY = "policy_routing"
PROBE = "__probe__"  # the witness's project for probes: no outbox row has it
Key = tuple[str, str, str]


# -- helpers -------------------------------------------------------------------------------


def run(scenario: Coroutine[Any, Any, None], timeout: float = 45.0) -> None:
    asyncio.run(asyncio.wait_for(scenario, timeout))


async def until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def activate(conn: psycopg.AsyncConnection[Any], key: Key, body: dict[str, Any]) -> str:
    cur = await conn.execute(
        "SELECT revision_id FROM ql3.put_revision(%s, %s, %s, %s::jsonb, 'test')",
        (*key, Jsonb(body)),
    )
    row = await cur.fetchone()
    assert row is not None
    await conn.execute("SELECT ql3.activate_revision(%s, %s, %s, %s, 'test')", (*key, row[0]))
    return str(row[0])


async def until_served(cache: RevisionCache, key: Key, revision_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(errors.NotFound, errors.Unavailable):
            if (await cache.get_effective(*key)).revision_id == revision_id:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{'/'.join(key)} not at {revision_id} after {timeout}s")
        await asyncio.sleep(0.02)


async def witnessed(w: Witness, project: str, seqs: set[int], what: str) -> None:
    """Wait until the witness has received every seq in ``seqs``; name the missing ones."""
    try:
        await until(lambda: w.seqs.get(project, set()) >= seqs, 5, what)
    except AssertionError as exc:
        missing = sorted(seqs - w.seqs.get(project, set()))
        raise AssertionError(f"{exc}: seqs {missing} never reached the witness") from None


async def served_by_message(
    cache: RevisionCache, conn: psycopg.AsyncConnection[Any], key: Key
) -> None:
    """An activation now reaches the cache by its message: in normal mode, with a 300 s
    budget, nothing else would make it read the database.

    Three tries: a subscription that moves late after a failover (the Cluster client's
    slot-map refresh) marks every entry unverified once more, and the next read of the
    key goes to the database before its message arrives. A dead subscription fails all
    three.
    """
    for attempt in range(3):
        messages = cache.health().messages
        await until_served(cache, key, await activate(conn, key, {"v": f"after {attempt}"}), 5)
        if cache.health().messages > messages:
            assert cache.mode == "normal"
            return
    raise AssertionError(
        f"three activations of {'/'.join(key)} reached the cache without a message"
    )


async def outbox(dsn: str) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT seq, project_id, delivered_at IS NOT NULL, relay_attempts"
            " FROM ql3.contract_outbox ORDER BY seq"
        )
        return [
            {"seq": r[0], "project": r[1], "delivered": r[2], "attempts": r[3]}
            for r in await cur.fetchall()
        ]


@contextlib.asynccontextmanager
async def relay(dsn: str, url: str, prefix: str) -> AsyncIterator[Relay]:
    config = RelayConfig(
        dsn=dsn,
        redis_url=url,
        channel_prefix=prefix,
        heartbeat_interval=0.2,
        poll_interval=0.2,
        backoff_initial=0.05,
        backoff_max=0.3,
        redis_timeout=1.0,
        metrics_port=None,
    )
    r = Relay(config)
    await r.start()
    try:
        await r.wait_ready()
        yield r
    finally:
        await r.stop()


def cache_for(dsn: str, url: str, prefix: str, projects: list[str]) -> RevisionCache:
    # A long staleness budget: what the cache serves fresh came by message or by the
    # verification a resubscription starts, never by the budget running out.
    return RevisionCache(
        dsn,
        url,
        channel_prefix=prefix,
        projects=projects,
        max_staleness={FAMILY: 300.0},
        heartbeat_timeout=1.0,
        redis_timeout=1.0,
    )


class Witness:
    """A plain subscriber on one node: the seqs of the events it received, per project.

    It also listens on a probe channel in the hash slot of its first channel (a hash tag),
    which no cache subscribes to: ``hears`` publishes there.
    """

    def __init__(self, port: int, channels: list[str], *, sharded: bool) -> None:
        self.client = aioredis.Redis(host="127.0.0.1", port=port)
        self.probe_channel = f"{{{channels[0]}}}:probe"
        self.channels = [*channels, self.probe_channel]
        self.sharded = sharded
        self.seqs: dict[str, set[int]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Witness:
        pubsub = self.client.pubsub()
        if self.sharded:
            for channel in self.channels:  # one SSUBSCRIBE per slot
                await pubsub.ssubscribe(channel)
        else:
            await pubsub.subscribe(*self.channels)
        confirmed = 0
        while confirmed < len(self.channels):
            message = await pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] in ("subscribe", "ssubscribe"):
                confirmed += 1
        self._task = asyncio.create_task(self._read(pubsub))
        return self

    async def _read(self, pubsub: Any) -> None:
        try:
            while True:
                message = await pubsub.get_message(timeout=1.0)
                if message is not None and message["type"] in ("message", "smessage"):
                    doc = json.loads(message["data"])
                    self.seqs.setdefault(doc["project_id"], set()).add(int(doc["seq"]))
        finally:
            await pubsub.aclose()

    async def hears(self, port: int, project: str) -> None:
        """Publish probes on the master at ``port`` until this subscriber receives one.

        A test that kills a master must first know that the replication path to the witness
        is up: a replica that is still resyncing drops what is published meanwhile.
        """
        probe = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            for n in range(100):
                doc = json.dumps({"project_id": project, "seq": n})
                await (probe.spublish if self.sharded else probe.publish)(self.probe_channel, doc)
                with contextlib.suppress(AssertionError):
                    await until(lambda: bool(self.seqs.get(project)), 0.1, "a probe")
                    return
            raise AssertionError(f"the witness heard no probe from the master at {port}")
        finally:
            await probe.aclose()

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()


def projects_on_every_shard(cluster: RedisCluster, prefix: str) -> dict[int, str]:
    """A project id per master port whose channel lands on that master's shard."""
    found: dict[int, str] = {}
    owners: dict[int, int] = {}
    n = 0
    while len(found) < 3:
        project = f"proj{n}"
        slot = key_slot(project_channel(prefix, project).encode())
        if slot not in owners:
            owners[slot] = cluster.slot_owner(slot)[0]
        found.setdefault(owners[slot], project)
        n += 1
    return found


# -- URLs ----------------------------------------------------------------------------------


def test_urls_name_a_sentinel_master_or_a_cluster() -> None:
    link = redis_links.parse("redis+sentinel://:pw@10.0.0.1,10.0.0.2:26380/main/2")
    assert (link.kind, link.service) == ("sentinel", "main")
    assert link.hosts == (("10.0.0.1", 26379), ("10.0.0.2", 26380))
    assert (link.options["password"], link.options["db"]) == ("pw", 2)
    secret = redis_links.parse("redis+sentinel://h/main?sentinel_password=s")
    assert secret.sentinel_options == {"password": "s"} and "password" not in secret.options
    link = redis_links.parse("rediss+cluster://u:p@[::1]:7000,node2")
    assert link.kind == "cluster" and link.hosts == (("::1", 7000), ("node2", 6379))
    assert redis_links.parse("redis://localhost:6379/0").kind == "server"
    for bad in (
        "redis+sentinel://h:26379",  # no master name
        "redis+cluster://h:7000/3",  # a cluster has database 0 only
        "redis+cluster://h:port",
        "redis+cluster://h:7000?sentinel_password=x",
    ):
        with pytest.raises(ValueError):
            redis_links.parse(bad)


def test_relay_and_cache_take_those_urls_but_a_cluster_cache_needs_projects() -> None:
    for url in ("redis+sentinel://h1,h2/main", "redis+cluster://h1:7000,h2:7000"):
        RelayConfig(dsn="host=db", redis_url=url)
    with pytest.raises(ValueError, match="not a Redis URL"):
        RelayConfig(dsn="host=db", redis_url="redis+sentinel://h1")
    with pytest.raises(errors.InvalidArgument, match="needs projects"):
        RevisionCache("host=db", "redis+cluster://h1:7000")
    RevisionCache("host=db", "redis+cluster://h1:7000", projects=["p"])


def test_a_slot_tag_lands_a_heartbeat_channel_on_its_slot() -> None:
    for slot in (0, 5461, 10923, 16383):
        channel = redis_links.shard_heartbeat_channel("pfx", slot)
        assert key_slot(channel.encode()) == slot


# -- Cluster -------------------------------------------------------------------------------


def test_cluster_delivers_activations_by_sharded_pubsub_and_heartbeats_on_every_shard(
    db_dsn: str, redis_cluster: RedisCluster
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    projects = sorted(projects_on_every_shard(redis_cluster, prefix).values())
    url = redis_cluster.url

    async def scenario() -> None:
        async with (
            relay(db_dsn, url, prefix),
            cache_for(db_dsn, url, prefix, projects) as cache,
            await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as conn,
        ):
            keys = [(p, FAMILY, "c1") for p in projects]
            for key in keys:
                await activate(conn, key, {"v": 1})
                await cache.get_effective(*key)
            await until(lambda: cache.mode == "normal", 5, "heartbeats from all three shards")
            assert len(cache._heartbeats_heard) == 3  # one heartbeat channel per shard
            for round_no in (2, 3):
                latest = {key: await activate(conn, key, {"v": round_no}) for key in keys}
                for key, revision_id in latest.items():
                    await until_served(cache, key, revision_id, 5)
            assert cache.health().messages >= 6  # by message, not by the 300 s budget
        assert all(row["delivered"] for row in await outbox(db_dsn))

    run(scenario())


def test_cluster_client_is_a_redis_cluster(redis_cluster: RedisCluster) -> None:
    async def scenario() -> None:
        client = redis_links.make_client(redis_cluster.url)
        try:
            assert isinstance(client, ClusterClient)
            await client.initialize()
            assert len(redis_links.shard_heartbeat_channels(client, "p")) == 3
        finally:
            await client.aclose()

    run(scenario())


def test_cluster_master_failover_loses_no_event_and_the_cache_converges(
    db_dsn: str, redis_cluster: RedisCluster
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    by_master = projects_on_every_shard(redis_cluster, prefix)
    projects = sorted(by_master.values())
    victim_port, victim_project = next(iter(sorted(by_master.items())))
    slot = key_slot(project_channel(prefix, victim_project).encode())
    _, replicas = redis_cluster.slot_owner(slot)
    url = redis_cluster.url
    keys = [(p, FAMILY, "c1") for p in projects]

    async def scenario() -> None:
        async with (
            relay(db_dsn, url, prefix) as r,
            cache_for(db_dsn, url, prefix, projects) as cache,
            Witness(replicas[0], [project_channel(prefix, victim_project)], sharded=True) as w,
            await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as conn,
        ):
            await w.hears(victim_port, PROBE)
            for key in keys:
                await until_served(cache, key, await activate(conn, key, {"v": 0}), 5)
            await until(lambda: cache.mode == "normal", 5, "normal mode")
            # Replication is asynchronous: what a master acknowledged but its replica never
            # read dies with it, and only the cache's checks cover that. The claim here is
            # about what the relay publishes after the kill, so the replica catches up first.
            before = {
                row["seq"] for row in await outbox(db_dsn) if row["project"] == victim_project
            }
            await witnessed(w, victim_project, before, "the replica to catch up")

            redis_cluster.node(victim_port).kill()
            latest = {key: await activate(conn, key, {"v": 1}) for key in keys}
            await asyncio.sleep(0.5)  # the relay tries the dead master and fails
            latest.update({key: await activate(conn, key, {"v": 2}) for key in keys})

            def promoted() -> bool:
                return redis_cluster.slot_owner(slot)[0] == replicas[0]

            await until(promoted, 15, "the replica to take over")
            rows: list[dict[str, Any]] = []

            async def drained() -> bool:
                rows[:] = await outbox(db_dsn)
                return all(row["delivered"] for row in rows)

            deadline = time.monotonic() + 15
            while not await drained():
                assert time.monotonic() < deadline, "the outbox did not drain"
                await asyncio.sleep(0.1)
            for key, revision_id in latest.items():
                await until_served(cache, key, revision_id, 10)
            await until(lambda: cache.mode == "normal", 10, "normal mode after the failover")
            await served_by_message(cache, conn, (victim_project, FAMILY, "c1"))
            sent = {row["seq"] for row in rows if row["project"] == victim_project}
            await witnessed(w, victim_project, sent, "every event")
            retried = [
                row for row in rows if row["project"] == victim_project and row["attempts"] > 1
            ]
            assert retried, "no event of the dead shard was published again"
            assert r.registry.get_sample_value("ql3_relay_failures_total", {"target": "redis"})

    try:
        run(scenario())
    finally:
        redis_cluster.restart_dead()


# -- Sentinel ------------------------------------------------------------------------------


def test_sentinel_delivers_activations_to_the_master_it_names(
    db_dsn: str, redis_sentinel: RedisSentinel
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = redis_sentinel.url
    key = ("proj", FAMILY, "c1")

    async def scenario() -> None:
        async with (
            relay(db_dsn, url, prefix),
            cache_for(db_dsn, url, prefix, ["proj"]) as cache,
            await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as conn,
        ):
            await until_served(cache, key, await activate(conn, key, {"v": 1}), 5)
            await until(lambda: cache.mode == "normal", 5, "normal mode")
            await until_served(cache, key, await activate(conn, key, {"v": 2}), 5)
            assert cache.health().messages >= 1

    run(scenario())


def test_sentinel_master_failover_loses_no_event_and_the_cache_converges(
    db_dsn: str, redis_sentinel: RedisSentinel
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = redis_sentinel.url
    keys = [("proj", FAMILY, f"c{i}") for i in range(3)]
    old_master = redis_sentinel.master_port()

    async def scenario() -> None:
        async with (
            relay(db_dsn, url, prefix) as r,
            cache_for(db_dsn, url, prefix, ["proj"]) as cache,
            Witness(
                redis_sentinel.witness.port, [project_channel(prefix, "proj")], sharded=False
            ) as w,
            await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as conn,
        ):
            await w.hears(old_master, PROBE)
            for key in keys:
                await until_served(cache, key, await activate(conn, key, {"v": 0}), 5)
            await until(lambda: cache.mode == "normal", 5, "normal mode")
            # As on the Cluster: the replicas catch up before the master dies.
            before = {row["seq"] for row in await outbox(db_dsn)}
            await witnessed(w, "proj", before, "the replicas to catch up")

            redis_sentinel.data_node(old_master).kill()
            latest = {key: await activate(conn, key, {"v": 1}) for key in keys}
            await asyncio.sleep(0.5)
            latest.update({key: await activate(conn, key, {"v": 2}) for key in keys})
            await until(
                lambda: redis_sentinel.master_port() != old_master, 15, "Sentinel's failover"
            )
            rows = await outbox(db_dsn)
            deadline = time.monotonic() + 15
            while not all(row["delivered"] for row in rows):
                assert time.monotonic() < deadline, "the outbox did not drain"
                await asyncio.sleep(0.1)
                rows = await outbox(db_dsn)
            for key, revision_id in latest.items():
                await until_served(cache, key, revision_id, 10)
            await until(lambda: cache.mode == "normal", 10, "normal mode after the failover")
            await served_by_message(cache, conn, keys[0])
            sent = {row["seq"] for row in await outbox(db_dsn)}
            await witnessed(w, "proj", sent, "every event")
            assert any(row["attempts"] > 1 for row in rows)
            assert r.registry.get_sample_value("ql3_relay_failures_total", {"target": "redis"})

    run(scenario())
