"""Helper processes of the benchmarks: ``python -m bench.worker MODE ...``.

They run apart from the process under measurement so that receiving messages does not
steal its event loop, and they report on stdout, one line per event:

- ``count``: one Redis subscriber counting messages on a channel (delivery proof of
  ``relay_drain``); prints ``ready``, then ``count N`` when N messages arrived or when the
  channel has been quiet for ``--idle`` seconds.
- ``subscribers``: ``--count`` raw Redis subscribers of one channel; for each message
  ``<seq>`` prints ``got SEQ T`` once all of them have it, T = the latest receive time
  (``time.monotonic()``, a clock shared by every process of the machine; then the earliest).
- ``readers``: as ``subscribers``, but each one first reads the revision of ``--key`` from
  ``--dsn`` (the statement a cache reload sends) and checks its body hash: the floor of a
  reload.
- ``caches``: ``--count`` RevisionCache instances watching one contract; for each
  pointer_version prints ``loaded PV T`` once every cache has loaded it (``on_change``).

All of them exit cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import redis.asyncio as aioredis

from ql3 import canonical
from ql3.cache import _LOAD_ONE_SQL as LOAD_ONE_SQL
from ql3.cache import BODY_DOMAIN, EffectiveRevision, RevisionCache

READERS = "ql3-floor"  # application_name of the readers' connections (their CPU is counted)


def settle_heap() -> None:
    """Move everything set up so far out of the garbage collector's reach (``gc.freeze``).

    One helper stands in for many worker processes, so its heap is many workers' heaps in
    one: a full collection walks all of them (30-75 ms measured with 50 caches), a pause no
    single worker would have. Frozen objects are never scanned again; what the measured
    messages and reloads allocate is still collected as usual.
    """
    gc.collect()
    gc.freeze()


def say(*words: object) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def count_messages(url: str, channel: str, expect: int, idle: float) -> None:
    stop = stop_event()
    client = aioredis.Redis.from_url(url)
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)
    while (await pubsub.get_message(timeout=5.0)) is None:
        pass  # the subscribe confirmation
    say("ready")
    received = 0
    last = time.monotonic()
    while received < expect and not stop.is_set():
        message = await pubsub.get_message(timeout=0.2)
        if message is not None and message["type"] == "message":
            received += 1
            last = time.monotonic()
        elif time.monotonic() - last > idle:
            break
    say("count", received)
    await pubsub.aclose()
    await client.aclose()


async def raw_subscribers(
    url: str, channel: str, count: int, *, dsn: str | None = None, key: Sequence[str] = ()
) -> None:
    """``count`` raw subscribers of ``channel``. With ``dsn`` (mode ``readers``), each one
    also reads the revision of ``key`` once per message on a connection of its own (the
    statement a cache reload sends) and checks its body hash before it reports: the least
    work SPEC section 8 asks of a worker per message, without a cache around it."""
    stop = stop_event()
    clients = [aioredis.Redis.from_url(url) for _ in range(count)]
    conns: list[psycopg.AsyncConnection[Any] | None] = [None] * count
    if dsn is not None:
        conns = [
            await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=READERS)
            for _ in range(count)
        ]
    pubsubs = [c.pubsub() for c in clients]
    for p in pubsubs:
        await p.subscribe(channel)
        while (await p.get_message(timeout=5.0)) is None:
            pass
    seen: dict[int, list[float]] = {}

    async def listen(
        pubsub: aioredis.client.PubSub, conn: psycopg.AsyncConnection[Any] | None
    ) -> None:
        async for message in pubsub.listen():
            if message["type"] != "message":
                continue
            seq = int(message["data"].split(b" ", 1)[0])
            if conn is not None:
                cur = await conn.execute(LOAD_ONE_SQL, key, prepare=True)
                row = await cur.fetchone()
                # (epoch, revision_id, revision_no, body, body_hash, pointer_version)
                if row is None or canonical.digest(BODY_DOMAIN, row[3]) != row[4]:
                    raise RuntimeError(f"{key}: no active revision, or not its body_hash")
            at = time.monotonic()
            times = seen.setdefault(seq, [])
            times.append(at)
            if len(times) == count:
                say("got", seq, repr(max(times)), repr(min(times)))
                del seen[seq]

    tasks = [asyncio.create_task(listen(p, c)) for p, c in zip(pubsubs, conns, strict=True)]
    settle_heap()
    say("ready")
    await stop.wait()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for p in pubsubs:
        await p.aclose()
    for c in clients:
        await c.aclose()
    for conn in conns:
        if conn is not None:
            await conn.close()


async def cache_workers(
    dsn: str,
    url: str,
    prefix: str,
    key: tuple[str, str, str],
    count: int,
) -> None:
    stop = stop_event()
    loaded: dict[int, list[float]] = {}
    armed = False  # report only what happens after "ready", not the first loads

    def on_change(revision: EffectiveRevision) -> None:
        at = time.monotonic()
        times = loaded.setdefault(revision.pointer_version, [])
        times.append(at)
        if len(times) == count and armed:
            say("loaded", revision.pointer_version, repr(max(times)), repr(min(times)))

    caches = [RevisionCache(dsn, url, channel_prefix=prefix) for _ in range(count)]
    for cache in caches:
        cache.on_change(key[1], key[2], on_change)
    try:
        await asyncio.gather(*(c.start() for c in caches))
        await asyncio.gather(*(c.get_effective(*key) for c in caches))
        # Measure in steady state: every cache has heard a relay heartbeat.
        deadline = time.monotonic() + 15
        while any(c.mode != "normal" for c in caches) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        modes = sorted({c.mode for c in caches})
        armed = True
        settle_heap()
        say("ready", ",".join(modes))
        await stop.wait()
    finally:
        await asyncio.gather(*(c.close() for c in caches), return_exceptions=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.worker")
    parser.add_argument("mode", choices=["count", "subscribers", "readers", "caches"])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--channel", help="count, subscribers: the channel")
    parser.add_argument("--expect", type=int, default=0, help="count: messages to wait for")
    parser.add_argument("--idle", type=float, default=10.0, help="count: give up after quiet")
    parser.add_argument("--count", type=int, default=1, help="subscribers, caches: how many")
    parser.add_argument("--dsn", help="readers, caches: database")
    parser.add_argument("--prefix", help="caches: channel prefix of the relay")
    parser.add_argument("--key", nargs=3, help="readers, caches: project family contract_id")
    parser.add_argument("--index", type=int, default=0, help="which helper of several")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the caches' mode changes are expected here
    if args.mode == "count":
        asyncio.run(count_messages(args.redis_url, args.channel, args.expect, args.idle))
    elif args.mode == "subscribers":
        asyncio.run(raw_subscribers(args.redis_url, args.channel, args.count))
    elif args.mode == "readers":
        asyncio.run(
            raw_subscribers(args.redis_url, args.channel, args.count, dsn=args.dsn, key=args.key)
        )
    else:
        project, family, contract_id = args.key
        asyncio.run(
            cache_workers(
                args.dsn,
                args.redis_url,
                args.prefix,
                (project, family, contract_id),
                args.count,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
