"""Differential fuzzing: PostgreSQL and the SQLite shim given the same random, mostly
malformed input give the same answer (SPEC sections 10 and 11).

The conformance suite (``test_conformance.py``) lists the refusals someone thought of;
here hypothesis mutates valid commands and arguments (fields removed, replaced by values
near every limit and of every JSON kind, fields added, nested policy and usage objects
changed) and runs each one on a ``PgStore`` and on an ``EdgeStore``, both with pinned
clocks. The two must agree exactly: the same error code, or the same result, records and
digests byte for byte, and then the same step state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fix_servers import create_database, drop_database
from fix_stores import make_edge_store, pin_clock
from ql3 import errors
from ql3.cache import RevisionCache
from ql3.edge.cache import EdgeRevisionCache
from ql3.invocations import (
    ADMISSION_SCHEMA,
    COMPLETION_COMMAND_SCHEMA,
    RESOLUTION_COMMAND_SCHEMA,
    format_timestamp,
)
from ql3.store import PgStore
from ql3.store_async import AsyncPgStore

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
FAMILY = "policy_routing"
SETTINGS = settings(
    max_examples=int(os.environ.get("QL3_FUZZ_EXAMPLES", "300")),
    deadline=None,
    derandomize="QL3_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

NEAR_LIMITS: list[Any] = [
    # integers and numbers around the checks: version >= 1, 10^15, 2^53 - 1
    0,
    1,
    -1,
    2,
    512,
    10**15,
    10**15 + 1,
    2**53 - 1,
    2**53,
    -(2**53) + 1,
    10**20,
    0.0,
    -0.0,
    1.0,
    512.0,
    1.5,
    1e-7,
    1e20,
    2.0**53,
    float("nan"),
    float("inf"),
    True,
    False,
    None,
    # strings around identifier, uuid, digest and timestamp checks
    "",
    " ",
    "a" * 128,
    "a" * 129,
    "é" * 128,
    "é" * 129,
    "\x00",
    "a\x00b",
    "\ud800",
    "x\udfff",
    "😀" * 64,
    "😀" * 129,
    "bbbbbbbb-0000-0000-0000-000000000001",
    "BBBBBBBB-0000-0000-0000-000000000001",
    "bbbbbbbb000000000000000000000001",
    "{bbbbbbbb-0000-0000-0000-000000000001}",
    "bbbbbbbb-0000-0000-0000-00000000000g",
    "2026-12-02T12:00:00.000000Z",
    "2999-01-01T00:00:00.000000Z",
    "2026-02-29T00:00:00.000000Z",
    "2028-02-29T00:00:00.000000Z",
    "2026-04-31T00:00:00.000000Z",
    "2026-12-02T12:00:00Z",
    "2026-12-02T12:00:00.000000+00:00",
    "2026-12-02 12:00:00.000000Z",
    "0000-01-01T00:00:00.000000Z",
    "2026-13-01T00:00:00.000000Z",
    "2026-12-02T24:00:00.000000Z",
    "2026-12-02T23:59:60.000000Z",
    "2026-12-02t12:00:00.000000z",
    "\uff19" * 4 + "-01-01T00:00:00.000000Z",
    "a" * 64,
    "A" * 64,
    "a" * 63,
    "g" * 64,
    "٣" * 64,
    ADMISSION_SCHEMA,
    COMPLETION_COMMAND_SCHEMA,
    RESOLUTION_COMMAND_SCHEMA,
    "succeeded",
    "failed",
    "timed_out",
    "lost",
    "ok",
    "outcome_unknown",
    "retry",
    "fail",
    "cancel",
    "USD",
    FAMILY,
    "channel_event",
    "unknown_family",
]
leaves = st.one_of(
    st.sampled_from(NEAR_LIMITS),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
)
values = st.one_of(
    leaves,
    st.lists(leaves, max_size=2),
    st.dictionaries(st.text(max_size=4), leaves, max_size=2),
)


identifiers = st.one_of(
    st.text(max_size=130),
    st.text(alphabet="é😀a\u0301", min_size=126, max_size=130),
    st.sampled_from(["", "a" * 128, "a" * 129, "ok", "outcome_unknown", "USD", "usd", FAMILY]),
)
numbers = st.one_of(
    st.integers(-2, 3),
    st.integers(10**15 - 2, 10**15 + 2),
    st.integers(2**53 - 2, 2**53 + 2),
    st.sampled_from([512.0, 0.5, -0.0]),
)
timestamps = st.one_of(
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)).map(
        lambda t: t.strftime("%Y-%m-%dT%H:%M:%S.%fZ").rjust(27, "0")
    ),
    st.sampled_from(
        [v for v in NEAR_LIMITS if isinstance(v, str) and v[:2] in ("20", "00", "\uff19" * 2)]
    ),
)
digests = st.text(alphabet="0123456789abcdefA", min_size=63, max_size=65)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    **dict.fromkeys(
        ["invocation_id", "request_id", "project_id", "trace_id", "provider", "model", "user_id",
         "contract_family", "contract_id", "result_code", "currency", "reason"], identifiers),
    **dict.fromkeys(
        ["expected_step_run_version", "input_bytes", "output_bytes", "input_tokens",
         "output_tokens", "cost_micros"], numbers),
    "deadline_at": timestamps,
    **dict.fromkeys(
        ["request_digest", "start_digest", "completion_digest", "output_digest"], digests),
}  # fmt: skip
"""Values of the right kind near each field's limits, so that some mutations are valid."""


def _value_for(draw: st.DrawFn, key: str, plausible_only: bool = False) -> Any:
    plausible = PLAUSIBLE.get(key)
    if plausible is not None and (plausible_only or draw(st.booleans())):
        return draw(plausible)
    return draw(values)


@st.composite
def mutated(
    draw: st.DrawFn, command: dict[str, Any], nested: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``command`` with 1..3 random changes; ``nested`` names object fields whose own fields
    may be changed instead (policy, usage)."""
    out = dict(command)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["plausible", "plausible", "replace", "delete", "add", "nested"]))
        if op == "nested" and nested:
            name = draw(st.sampled_from(nested))
            inner = out.get(name)
            if isinstance(inner, dict) and inner:
                key = draw(st.sampled_from(sorted(inner)))
                inner = dict(inner)
                if draw(st.booleans()):
                    inner[key] = _value_for(draw, key, draw(st.booleans()))
                else:
                    del inner[key]
                out[name] = inner
                continue
            op = "replace"
        if op == "add":
            out[draw(st.sampled_from(["extra", "Schema", "", "schema\x00", "usage", "policy"]))] = (
                draw(values)
            )
        elif out:
            key = draw(st.sampled_from(sorted(out)))
            if op == "delete":
                del out[key]
            else:
                out[key] = _value_for(draw, key, op == "plausible")
    return out


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except errors.Ql3Error as exc:
        return ("error", exc.code)
    except Exception as exc:  # a raw exception is a store letting bad input through
        return ("raw", f"{type(exc).__name__}: {exc}")


REV = "<revision>"
"""Stands for the store's own revision id: each store draws its revision ids at random."""


def _swap(value: Any, old: str, new: str) -> Any:
    if value == old:
        return new
    if isinstance(value, dict):
        return {k: _swap(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_swap(v, old, new) for v in value]
    return value


def _comparable(value: Any, revision: str | None) -> Any:
    """A result with the store's own random ids out of the way: its revision ids become
    REV, outbox event ids (random version 7 uuids) are dropped, and so are digests of
    records that hold a revision id (they differ with it)."""
    if revision is None:
        return value
    swapped = _swap(value, revision, REV)
    if swapped == value:
        return value
    return _without_digests(swapped)


def _without_digests(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_digests(v) for k, v in value.items() if not k.endswith("_digest")}
    if isinstance(value, list):
        return [_without_digests(v) for v in value]
    return value


class Pair:
    """A PgStore and another store (``pair`` says which) driven in lockstep, with fresh
    ids per example."""

    def __init__(self, pg: PgStore, other: Any) -> None:
        self.pg = pg
        self.other = other
        self.counter = itertools.count(1)
        self.revisions: dict[int, str] = {}

    def both(self, call: Callable[[Any], Any], digests: bool = True) -> tuple[str, Any]:
        """call(store) on each store; REV in what it returns stands for that store's
        revision of the policy contract. ``digests=False``: compare without digests (of
        records that chain to one holding a revision id)."""
        got = []
        for store in (self.pg, self.other):
            revision = self.revisions.get(id(store))
            status, value = outcome(functools.partial(call, store))
            if isinstance(value, dict) and "event_id" in value:
                value = {k: v for k, v in value.items() if k != "event_id"}
            value = _comparable(value, revision)
            got.append((status, value if digests else _without_digests(value)))
        assert got[0][0] != "raw", got[0]
        assert got[1] == got[0]
        event(got[0][0] if got[0][0] == "ok" else got[0][1])
        return got[0]

    def own(self, store: Any, value: Any) -> Any:
        """value with REV as ``store``'s own policy revision id."""
        return _swap(value, REV, self.revisions[id(store)])

    def fresh_step(self) -> tuple[str, str, int]:
        n = next(self.counter)
        run_id = f"cccccccc-0000-0000-0000-{n:012d}"
        step_id = f"dddddddd-0000-0000-0000-{n:012d}"
        for store in (self.pg, self.other):
            store.create_run("proj", "trace-1", run_id)
            store.add_step_run(run_id, "model", step_id)
        return run_id, step_id, n

    def step_state(self, step_id: str) -> None:
        """The same step state on both (core's create_run and add_step_run stamp rows with
        now(), which the pinned receipt clock does not cover)."""
        states = []
        for store in (self.pg, self.other):
            state = store.step_run(step_id)
            assert state is not None
            del state["created_at"], state["updated_at"]
            states.append(state)
        assert states[1] == states[0]


class SyncAsyncStore:
    """``AsyncPgStore`` driven through the store interface of the tests: its own calls run
    to completion on one event loop; what it does not offer (contracts, reads) goes to a
    ``PgStore`` on the same database."""

    ASYNC = frozenset(
        {"create_run", "add_step_run", "admit_invocation", "complete_invocation",
         "resolve_invocation", "recover_expired"}
    )  # fmt: skip

    def __init__(self, dsn: str, runner: asyncio.Runner) -> None:
        self.sync = PgStore(dsn)
        self.store = AsyncPgStore(dsn)
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        if name not in self.ASYNC:
            return getattr(self.sync, name)
        method = getattr(self.store, name)
        return lambda *args: self.runner.run(method(*args))

    def close(self) -> None:
        self.runner.run(self.store.close())
        self.sync.close()


@pytest.fixture(params=["edge-wal", "asyncio"])
def pair(
    request: pytest.FixtureRequest, db_dsn: str, base_dsn: str, migrated_template: str,
    tmp_path: Path,
) -> Iterator[Pair]:  # fmt: skip
    """PgStore against the SQLite shim, or against AsyncPgStore on a second database (the
    asyncio store shares the SQL but not the Python around it)."""
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(PgStore(db_dsn))
        if request.param == "asyncio":
            other_dsn = create_database(base_dsn, template=migrated_template, prefix="db")
            stack.callback(drop_database, base_dsn, other_dsn)
            runner = stack.enter_context(asyncio.Runner())
            other: Any = SyncAsyncStore(other_dsn, runner)
            stack.callback(other.close)
            stack.callback(pin_clock, other.sync, None)
        else:
            other = stack.enter_context(make_edge_store("edge-wal", tmp_path))
        stack.callback(pin_clock, pg, None)
        both = Pair(pg, other)
        for store in (pg, other):
            pin_clock(store.sync if isinstance(store, SyncAsyncStore) else store, T0)
            revision = store.put_revision("proj", FAMILY, "router", {"r": 1}, "ops")["revision_id"]
            store.activate_revision("proj", FAMILY, "router", revision, "ops")
            both.revisions[id(store)] = revision
        # Blocking pools at their size: psycopg_pool draws from the global random state
        # when it opens a connection, which hypothesis would take for its strategies' doing.
        for sync in (pg, getattr(other, "sync", None)):
            if isinstance(sync, PgStore):
                sync.pool.wait()
        yield both


def admission(run_id: str, step_id: str, n: int, policy: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "schema": ADMISSION_SCHEMA,
        "invocation_id": f"inv-{n}",
        "request_id": f"req-{n}",
        "project_id": "proj",
        "run_id": run_id,
        "step_run_id": step_id,
        "trace_id": "trace-1",
        "expected_step_run_version": 1,
        "provider": "ollama",
        "model": "llama3.1:8b",
        "policy": policy,
        "request_digest": hashlib.sha256(b"prompt").hexdigest(),
        "input_bytes": 512,
        "deadline_at": "2999-01-01T00:00:00.000000Z",
    }


def completion(n: int, start_digest: str, outcome_: str = "succeeded") -> dict[str, Any]:
    succeeded = outcome_ == "succeeded"
    return {
        "schema": COMPLETION_COMMAND_SCHEMA,
        "invocation_id": f"inv-{n}",
        "start_digest": start_digest,
        "outcome": outcome_,
        "result_code": {"succeeded": "ok", "lost": "outcome_unknown"}.get(
            outcome_, "provider_error"
        ),
        "output_bytes": 2048 if succeeded else None,
        "output_digest": "c" * 64 if succeeded else None,
        "usage": {"input_tokens": 10, "output_tokens": 20, "cost_micros": 30, "currency": "USD"},
    }


def _policy(with_policy: bool) -> dict[str, Any] | None:
    if not with_policy:
        return None
    return {"contract_family": FAMILY, "contract_id": "router", "revision_id": REV}


def _admitted(pair: Pair) -> tuple[str, int, str]:
    _, step_id, n = pair.fresh_step()
    run_id = f"cccccccc-0000-0000-0000-{n:012d}"
    status, result = pair.both(lambda s: s.admit_invocation(admission(run_id, step_id, n, None)))
    assert status == "ok" and result["status"] == "created"
    return step_id, n, result["start_digest"]


@SETTINGS
@given(data=st.data(), with_policy=st.booleans())
def test_admissions(pair: Pair, data: st.DataObject, with_policy: bool) -> None:
    run_id, step_id, n = pair.fresh_step()
    command = data.draw(mutated(admission(run_id, step_id, n, _policy(with_policy)), ("policy",)))
    pair.both(lambda s: s.admit_invocation(pair.own(s, command)))
    pair.step_state(step_id)


@SETTINGS
@given(data=st.data(), outcome_=st.sampled_from(["succeeded", "failed", "timed_out", "lost"]))
def test_completions(pair: Pair, data: st.DataObject, outcome_: str) -> None:
    step_id, n, start_digest = _admitted(pair)
    command = data.draw(mutated(completion(n, start_digest, outcome_), ("usage",)))
    pair.both(lambda s: s.complete_invocation(command))
    pair.step_state(step_id)


@SETTINGS
@given(data=st.data())
def test_resolutions(pair: Pair, data: st.DataObject) -> None:
    step_id, n, start_digest = _admitted(pair)
    status, done = pair.both(lambda s: s.complete_invocation(completion(n, start_digest, "lost")))
    assert status == "ok"
    command = data.draw(
        mutated(
            {
                "schema": RESOLUTION_COMMAND_SCHEMA,
                "invocation_id": f"inv-{n}",
                "completion_digest": done["completion_digest"],
                "decision": data.draw(st.sampled_from(["retry", "fail", "cancel"])),
                "user_id": "alice",
                "expected_step_run_version": 3,
                "reason": "checked by hand",
            }
        )
    )
    pair.both(lambda s: s.resolve_invocation(command))
    pair.step_state(step_id)


@SETTINGS
@given(
    args=st.lists(values, min_size=5, max_size=5),
    keep=st.lists(st.booleans(), min_size=5, max_size=5),
)
@pytest.mark.parametrize("pair", ["edge-wal"], indirect=True)  # AsyncPgStore has no contracts
def test_contract_calls(pair: Pair, args: list[Any], keep: list[bool]) -> None:
    n = next(pair.counter)
    valid = ["proj", FAMILY, f"c-{n}", {"n": n}, "ops"]
    project, family, contract, body, actor = (
        v if k else a for v, a, k in zip(valid, args, keep, strict=True)
    )
    own: dict[int, str] = {}

    def put(store: Any) -> Any:
        row = store.put_revision(project, family, contract, body, actor)
        own[id(store)] = row["revision_id"]
        return _without_ids(row)

    status, _ = pair.both(put)
    if status != "ok":
        return
    reason = "gone" if keep[0] else args[0]
    pair.both(
        lambda s: _without_ids(s.activate_revision(project, family, contract, own[id(s)], actor))
    )
    pair.both(lambda s: _without_ids(s.active_revision(project, family, contract)))
    pair.both(lambda s: _without_ids(s.revoke_revision(own[id(s)], actor, reason)))
    pair.both(lambda s: _without_ids(s.active_revision(project, family, contract)))


def _without_ids(row: Any) -> Any:
    """A contract row without what differs between stores by design: random revision and
    event ids, and times of day (core stamps these rows with now(), which the pinned
    receipt clock does not cover)."""
    if not isinstance(row, dict):
        return row
    return {
        k: v
        for k, v in row.items()
        if "revision_id" not in k and k not in ("event_id", "created_at", "updated_at")
    }


times = st.one_of(
    st.none(),
    st.datetimes(timezones=st.sampled_from([None, UTC]), allow_imaginary=False),
    values,
)


@SETTINGS
@given(
    limit=st.one_of(st.sampled_from([0, 1, 10, 1000, 1001, -1, 2**31, 2**63]), values),
    grace=st.one_of(st.sampled_from([0, 0.5, -1, 1e9, 86400 * 365 * 10_000]), values),
    project=st.one_of(st.just("proj"), values),
    since=times,
    until=times,
    keys=st.one_of(
        st.lists(st.tuples(*[st.one_of(st.sampled_from(["proj", FAMILY, "router"]), values)] * 3),
                 max_size=3),
        st.lists(values, max_size=3),
        values,
    ),
    some_id=values,
    retention=st.one_of(
        st.sampled_from([timedelta(0), timedelta(microseconds=-1), timedelta(days=36500),
                         timedelta(days=36500, microseconds=1), timedelta.max, timedelta.min]),
        st.timedeltas(), values,
    ),
)  # fmt: skip
def test_reads_and_operator_calls(
    pair: Pair,
    limit: Any,
    grace: Any,
    project: Any,
    since: Any,
    until: Any,
    keys: Any,
    some_id: Any,
    retention: Any,
) -> None:
    # recover_expired reports what it settled; nothing here has expired, so it is a count 0
    pair.both(lambda s: s.recover_expired(limit, grace))
    pair.both(lambda s: s.usage_summary(project, since, until))
    pair.both(lambda s: s.active_pointers(keys))
    pair.both(lambda s: s.revision(some_id))
    pair.both(lambda s: s.step_run(some_id))
    pair.both(lambda s: s.run(some_id))
    pair.both(lambda s: _without_ids(s.activate_revision("proj", FAMILY, "router", some_id, "ops")))
    # nothing was delivered, so a prune that is not refused removes nothing (D65)
    pair.both(lambda s: s.prune_outbox(retention, limit))


@SETTINGS
@given(data=st.data(), with_policy=st.booleans())
def test_replays(pair: Pair, data: st.DataObject, with_policy: bool) -> None:
    """A changed replay of an admitted and of a completed command: existing, conflict or
    a refusal, the same on both."""
    run_id, step_id, n = pair.fresh_step()
    admitted = admission(run_id, step_id, n, _policy(with_policy))
    starts: dict[int, str] = {}

    def admit(store: Any, command: dict[str, Any]) -> Any:
        result = store.admit_invocation(pair.own(store, command))
        starts.setdefault(id(store), result["start_digest"])
        return result

    assert pair.both(lambda s: admit(s, admitted))[0] == "ok"
    replay = data.draw(mutated(admitted, ("policy",)))
    pair.both(lambda s: admit(s, replay))
    pair.step_state(step_id)

    def complete(store: Any, command: dict[str, Any]) -> Any:
        if command.get("start_digest") == "":
            command = {**command, "start_digest": starts[id(store)]}
        return store.complete_invocation(command)

    done = completion(n, "", data.draw(st.sampled_from(["succeeded", "failed", "lost"])))
    assert pair.both(lambda s: complete(s, done), not with_policy)[0] == "ok"
    again = data.draw(mutated(done, ("usage",)))
    pair.both(lambda s: complete(s, again), not with_policy)
    pair.step_state(step_id)


CACHE_KEYS: list[tuple[Any, Any, Any]] = [
    ("proj", FAMILY, "router"),
    ("proj", FAMILY, "none"),
    ("proj", "Policy_routing", "router"),
    ("proj", "unknown_family", "router"),
    ("", FAMILY, "router"),
    ("p" * 129, FAMILY, "router"),
    ("proj", FAMILY, "r" * 129),
    ("proj", 0, "router"),
    ("p" * 129, 0, "router"),
    ("proj", FAMILY, None),
    ([], FAMILY, "router"),
    ("proj", FAMILY, ["router"]),
    ("proj\x00", FAMILY, "router"),
    ("x\ud800", FAMILY, "router"),
    ("proj", FAMILY, "router"),  # still served after every refusal above
]


@pytest.mark.parametrize("pair", ["edge-wal"], indirect=True)
def test_both_revision_caches_answer_every_key_alike(
    pair: Pair, db_dsn: str, redis_url: str
) -> None:
    """``RevisionCache`` (PostgreSQL, Redis) and ``EdgeRevisionCache`` (SQLite) give the
    same revision or the same error code for each key, bad ones included."""

    async def answers(cache: Any) -> list[Any]:
        got: list[Any] = []
        for key in CACHE_KEYS:
            try:
                found = await asyncio.wait_for(cache.get_effective(*key), 10)
                got.append((found.revision_no, found.pointer_version, found.body))
            except errors.Ql3Error as exc:
                got.append(exc.code)
            except Exception as exc:  # a raw exception is a cache letting bad input through
                got.append(f"raw {type(exc).__name__}: {exc}")
        return got

    async def both() -> tuple[list[Any], list[Any]]:
        async with RevisionCache(db_dsn, redis_url) as cache:
            on_pg = await answers(cache)
        edge = EdgeRevisionCache(pair.other, None)
        try:
            return on_pg, await answers(edge)
        finally:
            edge.close()

    on_pg, on_edge = asyncio.run(both())
    assert on_pg[0] == (1, 1, {"r": 1}) == on_pg[-1]
    assert not [a for a in on_pg if isinstance(a, str) and a.startswith("raw")], on_pg
    assert on_edge == on_pg


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["step", "admit", "admit", "complete", "complete", "resolve",
                         "recover", "clock", "usage"]),
        st.integers(0, 10**6),
    ),
    min_size=5,
    max_size=30,
)  # fmt: skip
OUTCOMES = ["succeeded", "failed", "timed_out", "lost"]
USAGES: list[dict[str, Any] | None] = [
    None,
    {"input_tokens": 10, "output_tokens": 20, "cost_micros": 30, "currency": "USD"},
    {"input_tokens": 5, "output_tokens": None, "cost_micros": None, "currency": None},
    {"input_tokens": None, "output_tokens": None, "cost_micros": None, "currency": "EUR"},
]


@SETTINGS
@given(operations=OPERATIONS)
def test_valid_histories_give_identical_records(
    pair: Pair, operations: list[tuple[str, int]]
) -> None:
    """Random valid histories (admissions with deadlines around a moving pinned clock,
    completions of every outcome with and without usage, resolutions, recoveries, usage
    summaries), run in lockstep: every answer and every step state the same."""
    clock = T0
    steps: list[tuple[str, str]] = []  # (run_id, step_run_id) of this example
    starts: dict[str, str] = {}  # step_run_id -> its running invocation

    def state(step_id: str) -> dict[str, Any]:
        found = pair.pg.step_run(step_id)
        assert found is not None
        return found

    for op, r in operations:
        if op == "step" or not steps:
            run_id, step_id, _ = pair.fresh_step()
            steps.append((run_id, step_id))
            continue
        run_id, step_id = steps[r % len(steps)]
        step = state(step_id)
        status = step["status"]
        if op == "admit" and status == "ready":
            n = next(pair.counter)
            command = admission(run_id, step_id, n, None)
            command["expected_step_run_version"] = step["version"]
            command["deadline_at"] = format_timestamp(clock + timedelta(minutes=(r % 3) - 1))
            got = pair.both(calling("admit_invocation", command))
            if got[0] == "ok":
                starts[step_id] = command["invocation_id"]
        elif op == "complete" and status == "running":
            invocation = starts[step_id]
            n = int(invocation.removeprefix("inv-"))
            digest = _start_digest_of(pair, invocation)
            command = completion(n, digest, OUTCOMES[r % 4])
            command["usage"] = USAGES[(r // 4) % len(USAGES)]
            pair.both(calling("complete_invocation", command))
        elif op == "resolve" and status == "lost":
            invocation = starts[step_id]
            done = _completion_digest_of(pair, invocation)
            command = {
                "schema": RESOLUTION_COMMAND_SCHEMA,
                "invocation_id": invocation,
                "completion_digest": done,
                "decision": ["retry", "fail", "cancel"][r % 3],
                "user_id": "alice",
                "expected_step_run_version": step["version"],
                "reason": None if r % 2 else "checked",
            }
            if pair.both(calling("resolve_invocation", command))[0] == "ok":
                event("resolved")
        elif op == "recover":
            recovered = pair.both(calling("recover_expired", 1 + r % 3, float(r % 90)))
            if recovered[0] == "ok" and recovered[1]["count"]:
                event("recovered some")
        elif op == "clock":
            clock += timedelta(seconds=r % 120)
            for store in (pair.pg, pair.other):
                pin_clock(store.sync if isinstance(store, SyncAsyncStore) else store, clock)
        elif op == "usage":
            pair.both(lambda s: s.usage_summary("proj"))
        for _, each in steps:
            pair.step_state(each)
    for store in (pair.pg, pair.other):
        pin_clock(store.sync if isinstance(store, SyncAsyncStore) else store, T0)


def calling(method: str, *args: Any) -> Callable[[Any], Any]:
    """``store.method(*args)`` for ``Pair.both``."""
    return lambda store: getattr(store, method)(*args)


def _start_digest_of(pair: Pair, invocation_id: str) -> str:
    with pair.pg.connection() as conn:
        row = conn.execute(
            "SELECT start_digest FROM ql3_ai.model_invocation_starts WHERE invocation_id = %s",
            (invocation_id,),
        ).fetchone()
    assert row is not None
    return str(row[0])


def _completion_digest_of(pair: Pair, invocation_id: str) -> str:
    with pair.pg.connection() as conn:
        row = conn.execute(
            "SELECT completion_digest FROM ql3_ai.model_invocation_completions"
            " WHERE invocation_id = %s",
            (invocation_id,),
        ).fetchone()
    assert row is not None
    return str(row[0])
