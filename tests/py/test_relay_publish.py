"""The relay's batch publishing path: cheap messages, one Lua script call per batch.

``event_payload`` must produce exactly ``json.dumps(event_message(row))``, the server-side
projection (``CLAIM_SQL``) must carry the same values as the outbox row, and the publish
script must deliver every message of a batch, in order, on its project's channel.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from redis._parsers import _AsyncHiredisParser

from ql3.relay import (
    CLAIM_SQL,
    PUBLISH_SCRIPT,
    ClaimedRow,
    RedisUnavailable,
    Relay,
    event_message,
    event_payload,
    make_redis,
    publish_args,
)
from test_relay import Subscriber, backlog, config, run, until

NAMES = st.text(min_size=1, max_size=40)
ZONES = [UTC, timezone(timedelta(hours=5, minutes=30))]


@pytest.fixture
def db(db_dsn: str) -> str:
    return db_dsn


def as_tuple(row: dict[str, Any]) -> ClaimedRow:
    """The CLAIM_SQL form of an outbox row given as event_message input."""
    old = row["old_revision_id"]
    return (
        row["seq"],
        str(row["event_id"]),
        row["event_type"],
        row["project_id"],
        row["contract_family"],
        row["contract_id"],
        None if old is None else str(old),
        str(row["new_revision_id"]),
        row["pointer_version"],
        row["created_at"].astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        row["failover_epoch"],
    )


@settings(max_examples=300, deadline=None)
@given(
    seq=st.integers(min_value=1, max_value=2**63 - 1),
    event_type=st.sampled_from(["revision_activated", "revision_revoked"]),
    project=NAMES,
    family=NAMES,
    contract=NAMES,
    old=st.none() | st.uuids(),
    new=st.uuids(),
    version=st.integers(min_value=1, max_value=2**63 - 1),
    epoch=st.text(min_size=1),
    created=st.datetimes(
        min_value=datetime(2000, 1, 1),
        timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30))]),
    ),
)
def test_event_payload_is_json_dumps_of_event_message_byte_for_byte(
    seq: int,
    event_type: str,
    project: str,
    family: str,
    contract: str,
    old: uuid.UUID | None,
    new: uuid.UUID,
    version: int,
    epoch: str,
    created: datetime,
) -> None:
    row = {
        "seq": seq,
        "event_id": uuid.uuid4(),
        "event_type": event_type,
        "project_id": project,
        "contract_family": family,
        "contract_id": contract,
        "old_revision_id": old,
        "new_revision_id": new,
        "pointer_version": version,
        "created_at": created,
        "failover_epoch": epoch,
    }
    payload = event_payload(as_tuple(row))
    assert payload == json.dumps(event_message(row))
    assert "\n" not in payload  # the publish script splits its batch on newlines


def test_publish_args_code_channels_in_runs_and_keep_order() -> None:
    def row(seq: int, project: str) -> ClaimedRow:
        return (seq, str(uuid.UUID(int=seq)), "revision_activated", project, "f", "c", None,
                str(uuid.UUID(int=0)), 1, "2026-12-02T12:00:00.000000Z", "1/1/1")  # fmt: skip

    rows = [row(1, "a"), row(2, "a"), row(3, "b\nb"), row(4, "a"), row(5, "a"), row(6, "a")]
    args = publish_args("pre", rows)
    assert args[1:] == ["pre:a", "2", "pre:b\nb", "1", "pre:a", "3"]
    assert args[0].split("\n") == [event_payload(r) for r in rows] + [""]
    assert publish_args("pre", []) == [""]


def test_the_script_publishes_in_order_and_counts_what_it_published(redis_url: str) -> None:
    prefix = f"test:{uuid.uuid4().hex[:10]}"

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        script = client.register_script(PUBLISH_SCRIPT)
        try:
            async with Subscriber(redis_url, prefix) as sub:
                docs = [{"seq": i, "project_id": p} for i, p in enumerate("xxyzzx")]
                blob = "".join(json.dumps(d) + "\n" for d in docs)
                runs = ["x", "2", "y", "1", "z", "2", "x", "1"]
                runs[0::2] = [f"{prefix}:{p}" for p in runs[0::2]]
                assert await script(args=[blob, *runs]) == 6
                await until(lambda: len(sub.events) == 6, 5, "six messages")
                assert sub.events == docs
                # A blob shorter than the counts say: the script stops and says how many.
                assert await script(args=[blob, f"{prefix}:x", "7"]) == 6
        finally:
            await client.aclose()

    run(scenario())


def test_redis_replies_are_parsed_in_c_by_hiredis(redis_url: str) -> None:
    """redis[hiredis] is a dependency: redis-py's pure-Python reply parser was the largest
    single cost of a worker cache's message path (about 60 us of its ~300 us per reload)."""

    async def scenario() -> None:
        client = make_redis(redis_url)
        assert isinstance(client, aioredis.Redis)  # one server, not a Cluster (D52)
        try:
            conn = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]  # untyped in redis-py
            try:
                assert isinstance(conn._parser, _AsyncHiredisParser)
                assert await client.ping()
            finally:
                await client.connection_pool.release(conn)
        finally:
            await client.aclose()

    run(scenario())


def with_options(dsn: str, options: str) -> str:
    params = conninfo_to_dict(dsn)
    params["options"] = options
    return make_conninfo(**params)  # type: ignore[arg-type]


def test_claimed_rows_carry_the_outbox_values_whatever_the_session_time_zone(db: str) -> None:
    """CLAIM_SQL's text forms (UUIDs, created_at in UTC) against the row read as objects."""
    with psycopg.connect(db, autocommit=True) as conn:
        for i, project in enumerate(["plain", "plain", 'ünïcödé "q" \\', "new\nline"]):
            rev = conn.execute(
                "SELECT revision_id FROM ql3.put_revision(%s, 'policy_routing', 'c', %s, 't')",
                (project, Jsonb({"i": i})),
            ).fetchone()
            assert rev is not None
            conn.execute(
                "SELECT ql3.activate_revision(%s, 'policy_routing', 'c', %s, 't')",
                (project, rev[0]),
            )
        # A created_at with zero microseconds must still print six digits.
        conn.execute(
            "INSERT INTO ql3.contract_outbox (event_type, project_id, contract_family,"
            " contract_id, new_revision_id, pointer_version, created_at)"
            " SELECT 'revision_revoked', 'p', 'policy_routing', 'c', new_revision_id, 9,"
            " '2026-12-02 23:30:00+00' FROM ql3.contract_outbox LIMIT 1"
        )
    with psycopg.connect(with_options(db, "-c TimeZone=Pacific/Chatham"), autocommit=True) as conn:
        with conn.transaction():
            claimed = conn.execute(CLAIM_SQL, (100,)).fetchall()
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(
                "SELECT *, ql3.failover_epoch() AS failover_epoch"
                " FROM ql3.contract_outbox ORDER BY seq"
            )
            rows = cur.fetchall()
    assert len(claimed) == len(rows) == 5
    for tup, row in zip(claimed, rows, strict=True):
        assert event_payload(tup) == json.dumps(event_message(row))
    assert json.loads(event_payload(claimed[-1]))["created_at"] == "2026-12-02T23:30:00.000000Z"
    assert [r["old_revision_id"] is None for r in rows] == [True, False, True, True, True]


def test_an_empty_claim_still_returns_the_failover_epoch(db: str) -> None:
    """An idle relay learns the epoch its heartbeats carry from its empty claims (D48)."""
    with psycopg.connect(db, autocommit=True) as conn:
        epoch_row = conn.execute("SELECT ql3.failover_epoch()").fetchone()
        with conn.transaction():
            claimed = conn.execute(CLAIM_SQL, (100,)).fetchall()
    assert epoch_row is not None
    system_identifier, timeline, database_oid = epoch_row[0].split("/")
    assert int(system_identifier) > 0 and int(timeline) >= 1 and int(database_oid) > 0
    assert claimed == [(None,) * 10 + (epoch_row[0],)]


def test_odd_project_ids_reach_their_own_channels_in_seq_order(db: str, redis_url: str) -> None:
    prefix = f"test:{uuid.uuid4().hex[:10]}"
    projects = ["a", "a", "b c", "ünï", "a", "new\nline", "new\nline", "b c"]

    async def scenario() -> None:
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
        ):
            written = []
            for i, project in enumerate(projects):
                cur = await conn.execute(
                    "SELECT revision_id FROM ql3.put_revision(%s, 'policy_routing', %s, %s, 't')",
                    (project, f"c{i}", Jsonb({"i": i})),
                )
                rev = await cur.fetchone()
                assert rev is not None
                cur = await conn.execute(
                    "SELECT seq FROM ql3.activate_revision(%s, 'policy_routing', %s, %s, 't')",
                    (project, f"c{i}", rev[0]),
                )
                seq = await cur.fetchone()
                assert seq is not None
                written.append(seq[0])
            relay = Relay(config(db, redis_url, prefix, batch=5))
            try:
                assert [await relay.run_once() for _ in range(3)] == [5, 3, 0]
            finally:
                await relay.stop()
            await until(lambda: len(sub.events) == len(projects), 5, "every event")
            # Subscriber checks that each message came on prefix:<its project_id>.
            assert [e["seq"] for e in sub.events] == written
            assert [e["project_id"] for e in sub.events] == projects

    run(scenario())


def test_a_script_reporting_fewer_publishes_fails_the_batch(db: str, redis_url: str) -> None:
    """If Redis did not publish the whole batch, nothing is marked delivered."""
    prefix = f"test:{uuid.uuid4().hex[:10]}"

    class ShortScript:
        async def __call__(self, args: list[str]) -> int:
            return len(args[0].split("\n")) - 2  # one message short

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            for i in range(3):
                cur = await conn.execute(
                    "SELECT revision_id FROM ql3.put_revision('p', 'policy_routing', %s, %s, 't')",
                    (f"c{i}", Jsonb({"i": i})),
                )
                rev = await cur.fetchone()
                assert rev is not None
                await conn.execute(
                    "SELECT ql3.activate_revision('p', 'policy_routing', %s, %s, 't')",
                    (f"c{i}", rev[0]),
                )
        relay = Relay(config(db, redis_url, prefix))
        relay._publish_script = ShortScript()  # type: ignore[assignment]
        try:
            with pytest.raises(RedisUnavailable, match="published 2 of 3"):
                await relay.run_once()
        finally:
            await relay.stop()
        assert await backlog(db) == 3
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT relay_attempts, last_error FROM ql3.contract_outbox ORDER BY seq"
            )
            rows = await cur.fetchall()
        assert [r[0] for r in rows] == [1, 1, 1]
        assert all("published 2 of 3" in r[1] for r in rows)

    run(scenario())


def test_a_flushed_script_cache_is_reloaded(db: str, redis_url: str) -> None:
    """After SCRIPT FLUSH (or a Redis restart) EVALSHA says NOSCRIPT; redis-py loads it again."""
    prefix = f"test:{uuid.uuid4().hex[:10]}"

    async def activate(conn: psycopg.AsyncConnection[Any], n: int) -> int:
        cur = await conn.execute(
            "SELECT revision_id FROM ql3.put_revision('p', 'policy_routing', 'c', %s, 't')",
            (Jsonb({"n": n}),),
        )
        rev = await cur.fetchone()
        assert rev is not None
        cur = await conn.execute(
            "SELECT seq FROM ql3.activate_revision('p', 'policy_routing', 'c', %s, 't')",
            (rev[0],),
        )
        seq = await cur.fetchone()
        assert seq is not None
        return int(seq[0])

    async def scenario() -> None:
        admin = aioredis.Redis.from_url(redis_url)
        async with (
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn,
            Subscriber(redis_url, prefix) as sub,
        ):
            relay = Relay(config(db, redis_url, prefix))
            try:
                first = await activate(conn, 1)
                assert await relay.run_once() == 1
                await admin.script_flush()
                second = await activate(conn, 2)
                assert await relay.run_once() == 1
            finally:
                await relay.stop()
                await admin.aclose()
            await until(lambda: sub.seqs() == {first, second}, 5, "both events")

    run(scenario())


def test_a_drain_over_many_batches_publishes_each_event_once_in_seq_order(
    db: str, redis_url: str
) -> None:
    """The two work connections take turns; the order and the count must not change."""
    prefix = f"test:{uuid.uuid4().hex[:10]}"

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT revision_id FROM ql3.put_revision('p', 'policy_routing', 'c', %s, 't')",
                (Jsonb({"v": 1}),),
            )
            rev = await cur.fetchone()
            assert rev is not None
            # 95 events straight into the outbox (one statement, so one NOTIFY burst).
            await conn.execute(
                "INSERT INTO ql3.contract_outbox (event_type, project_id, contract_family,"
                " contract_id, new_revision_id, pointer_version)"
                " SELECT 'revision_activated', 'p' || (g %% 3), 'policy_routing', 'c', %s, g"
                " FROM generate_series(1, 95) AS g",
                (rev[0],),
            )
            cur = await conn.execute("SELECT seq FROM ql3.contract_outbox ORDER BY seq")
            written = [int(r[0]) for r in await cur.fetchall()]
        async with Subscriber(redis_url, prefix) as sub:
            relay = Relay(config(db, redis_url, prefix, batch=10))
            await relay.start()
            try:
                await relay.wait_ready()
                await until(lambda: len(sub.events) >= 95, 10, "95 events")
                await until(lambda: relay.published == 95, 5, "every batch committed")
            finally:
                await relay.stop()
            assert [e["seq"] for e in sub.events] == written
            assert relay.delivered_seq == written[-1]
        assert await backlog(db) == 0

    run(scenario())
