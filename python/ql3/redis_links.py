"""Which Redis a URL names, and the client for it: one server, a Sentinel-watched master,
or a Cluster (D52). The relay and the cache build their clients here.

- ``redis://``, ``rediss://``, ``unix://``: one server, exactly as redis-py reads the URL.
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db][?query]``:
  the master Sentinel names ``service`` (default port 26379). The userinfo and the query
  are the master's, as in a ``redis://`` URL; ``sentinel_username`` and
  ``sentinel_password`` in the query are the sentinels' own. ``rediss+sentinel://``
  speaks TLS to the master (the sentinels are reached in clear).
- ``redis+cluster://[[user]:password@]host:port[,host:port...][?query]``: a Redis
  Cluster found from any of those nodes (default port 6379); ``rediss+cluster://`` for
  TLS. Events go out with SPUBLISH and are read with SSUBSCRIBE (sharded pub/sub, Redis
  7): a project's channel lives on the shard that owns its hash slot.

Heartbeats on a Cluster (D53): a heartbeat sent to one shard is not heard on another, so
the relay sends one to every master, on the heartbeat channel of that master's lowest
slot (``shard_heartbeat_channel``), and a cache listens, for each shard that carries one
of its projects, to that shard's heartbeat channel. Both read the same slot map, so they
agree while the slot ranges stay where they are; a failover keeps them in place (the
replica takes over its master's ranges).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import parse_qsl, unquote, urlencode

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ql3.channels import HEARTBEAT_NAME

Kind = Literal["server", "sentinel", "cluster"]
AnyRedis = aioredis.Redis | RedisCluster

SENTINEL_PORT: Final = 26379
CLUSTER_PORT: Final = 6379
_SCHEMES: Final[Mapping[str, tuple[Kind, str]]] = {
    "redis+sentinel": ("sentinel", "redis"),
    "rediss+sentinel": ("sentinel", "rediss"),
    "redis+cluster": ("cluster", "redis"),
    "rediss+cluster": ("cluster", "rediss"),
}
_SENTINEL_QUERY: Final = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True, kw_only=True)
class RedisLink:
    """A parsed Redis URL: what it names, and the keyword arguments of its connections."""

    kind: Kind
    url: str
    # Sentinels or cluster seed nodes (empty for one server).
    hosts: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    # Connection arguments of the data nodes (redis-py's parse_url of the URL).
    options: Mapping[str, Any] = field(default_factory=dict)
    sentinel_options: Mapping[str, Any] = field(default_factory=dict)


def _hosts(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hosts = []
    for part in netloc.split(","):
        part = part.strip()
        if part.startswith("["):  # [IPv6]:port
            host, _, rest = part[1:].partition("]")
            port_text = rest.removeprefix(":")
        else:
            host, _, port_text = part.partition(":")
        if not host:
            raise ValueError(f"empty host in {netloc!r}")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(f"port {port_text!r} is not an integer") from None
        if not 0 < port <= 65535:
            raise ValueError(f"port {port} is not 1..65535")
        hosts.append((host, port))
    return tuple(hosts)


def parse(url: str) -> RedisLink:
    """The link a URL names; ``ValueError`` (saying why) when it names none."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("no scheme (redis://, rediss://, unix://, redis+sentinel://, ...)")
    found = _SCHEMES.get(scheme.lower())
    if found is None:
        return RedisLink(kind="server", url=url, options=dict(parse_url(url)))
    kind, data_scheme = found
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    default_port = SENTINEL_PORT if kind == "sentinel" else CLUSTER_PORT
    hosts = _hosts(hostlist, default_port)
    pairs = parse_qsl(query, keep_blank_values=True)
    sentinel_options = {k: unquote(v) for k, v in pairs if k in _SENTINEL_QUERY}
    data_query = urlencode([(k, v) for k, v in pairs if k not in _SENTINEL_QUERY])
    segments = [unquote(s) for s in path.split("/") if s]
    service: str | None = None
    if kind == "sentinel":
        if not segments:
            raise ValueError("no master name: redis+sentinel://host:port[,host:port]/NAME")
        service, segments = segments[0], segments[1:]
    if len(segments) > 1 or (kind == "cluster" and segments and segments[0] != "0"):
        raise ValueError(
            "a cluster has only database 0" if kind == "cluster" else f"bad path {path!r}"
        )
    # The data nodes' options, read by redis-py from the equivalent one-server URL.
    host, port = hosts[0]
    shown_host = f"[{host}]" if ":" in host else host
    single = f"{data_scheme}://{userinfo}{at}{shown_host}:{port}/{''.join(segments)}"
    options: dict[str, Any] = dict(parse_url(single + (f"?{data_query}" if data_query else "")))
    for key in ("host", "port"):
        options.pop(key, None)
    if kind == "sentinel":
        sentinel_options = {
            ("username" if k == "sentinel_username" else "password"): v
            for k, v in sentinel_options.items()
        }
    elif sentinel_options:
        raise ValueError("sentinel_username and sentinel_password are for redis+sentinel://")
    return RedisLink(
        kind=kind,
        url=url,
        hosts=hosts,
        service=service,
        options=options,
        sentinel_options=sentinel_options,
    )


class SentinelRedis(aioredis.Redis):
    """The client of a Sentinel-watched master; closing it closes its sentinel clients."""

    watchers: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            sentinel, self.watchers = self.watchers, None
            if sentinel is not None:
                await sentinel.aclose()


def make_client(url: str | RedisLink, *, timeout: float = 5.0) -> AnyRedis:
    """A client of what ``url`` names whose failures surface at once (ql3 backs off itself).

    A Cluster client retries a command once, after refreshing its slot map, so that a
    command sent to a master that just failed over goes to its successor.
    """
    link = url if isinstance(url, RedisLink) else parse(url)
    common: dict[str, Any] = {
        "socket_connect_timeout": timeout,
        "socket_timeout": timeout,
    }
    if link.kind == "server":
        client: aioredis.Redis = aioredis.Redis.from_url(
            link.url, retry=Retry(NoBackoff(), 0), **common
        )
        return client
    options = dict(link.options)
    if link.kind == "sentinel":
        if options.pop("connection_class", None) is SSLConnection:
            options["ssl"] = True
        sentinel = Sentinel(
            link.hosts,
            sentinel_kwargs={**common, **link.sentinel_options},
            **common,
        )
        assert link.service is not None
        master = sentinel.master_for(
            link.service,
            redis_class=SentinelRedis,
            retry=Retry(NoBackoff(), 0),
            **options,
        )
        assert isinstance(master, SentinelRedis)
        master.watchers = sentinel
        return master
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    options.pop("db", None)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in link.hosts],
        require_full_coverage=False,
        retry=Retry(NoBackoff(), 1),
        **common,
        **options,
    )


# -- sharded pub/sub on a Cluster --------------------------------------------------------


@functools.lru_cache(maxsize=256)
def slot_tag(slot: int) -> str:
    """The smallest decimal number whose hash slot is ``slot`` (a hash tag that lands a
    channel on that slot). Found by search: about 16,000 CRC16s, a few milliseconds."""
    if not 0 <= slot < REDIS_CLUSTER_HASH_SLOTS:
        raise ValueError(f"slot {slot} is not 0..16383")
    n = 0
    while key_slot(str(n).encode()) != slot:
        n += 1
    return str(n)


def shard_heartbeat_channel(prefix: str, slot: int) -> str:
    """The heartbeat channel of the shard whose lowest slot is ``slot`` (D53)."""
    return f"{prefix}:{HEARTBEAT_NAME}:{{{slot_tag(slot)}}}"


def _lowest_slots(cluster: RedisCluster) -> dict[str, int]:
    """Each master's name (host:port) to the lowest slot it serves, per the client's map."""
    lowest: dict[str, int] = {}
    for slot, nodes in sorted(cluster.nodes_manager.slots_cache.items()):
        if nodes and nodes[0].name not in lowest:
            lowest[nodes[0].name] = slot
    return lowest


def shard_heartbeat_channels(cluster: RedisCluster, prefix: str) -> list[str]:
    """The heartbeat channel of every master (the relay sends a heartbeat on each)."""
    return sorted(shard_heartbeat_channel(prefix, s) for s in _lowest_slots(cluster).values())


def heartbeat_channels_for(
    cluster: RedisCluster, prefix: str, channels: Iterable[str]
) -> list[str]:
    """The heartbeat channels of the shards that carry ``channels`` (a cache hears these)."""
    lowest = _lowest_slots(cluster)
    found = set()
    for channel in channels:
        node = cluster.get_node_from_key(channel)
        if node is None or node.name not in lowest:
            raise ValueError(f"no master serves the slot of {channel!r}")
        found.add(shard_heartbeat_channel(prefix, lowest[node.name]))
    return sorted(found)


async def spublish_all(cluster: RedisCluster, messages: Sequence[tuple[str, str]]) -> None:
    """SPUBLISH each (channel, message) in order (per shard) in one pipeline; raises the
    first error. What a failed call published is published again with its batch later."""
    if not messages:
        # Still ask every master: an idle relay's probe of whether Redis is back.
        await cluster.ping(target_nodes=RedisCluster.PRIMARIES)
        return
    pipe = cluster.pipeline(transaction=False)
    for channel, message in messages:
        pipe.spublish(channel, message)
    await pipe.execute(raise_on_error=True)


__all__ = [
    "AnyRedis",
    "RedisLink",
    "SentinelRedis",
    "heartbeat_channels_for",
    "make_client",
    "parse",
    "shard_heartbeat_channel",
    "shard_heartbeat_channels",
    "slot_tag",
    "spublish_all",
]
