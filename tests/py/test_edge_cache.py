"""The edge revision cache (``ql3.edge.cache``, SPEC section 8 on the SQLite shim): what it
does when a reload fails, when a writer commits during a load, and without a relay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ql3 import errors
from ql3.edge import EdgeRelay, EdgeRevisionCache, EdgeStore
from ql3.edge.cache import _Entry

FAMILY = "policy_routing"  # max staleness 30 s: no test here waits for the budget
KEY = ("proj", FAMILY, "router")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EdgeStore]:
    with EdgeStore(tmp_path / "edge.db") as opened:
        yield opened


@contextlib.contextmanager
def write_locked(path: str) -> Iterator[None]:
    """Another connection holds the file's EXCLUSIVE lock: in DELETE journal mode every
    read of the store waits for its busy timeout and fails with ``QL3_UNAVAILABLE``."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            other.execute("ROLLBACK")


def after_first_read(
    store: EdgeStore, monkeypatch: pytest.MonkeyPatch, writer: Callable[[], object]
) -> None:
    """Run ``writer`` once, right after the first contract read the cache makes returns."""
    done = False

    def wrap(read: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            nonlocal done
            result = read(*args)
            if not done:
                done = True
                writer()
            return result

        return wrapped

    for name in ("active_revision", "active_pointers", "active_revisions"):
        if hasattr(store, name):
            monkeypatch.setattr(store, name, wrap(getattr(store, name)))


# -- a hint whose reload fails ----------------------------------------------------------------


def test_a_hint_whose_reload_fails_drops_the_entry_so_a_revoked_revision_is_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "edge.db")
    with EdgeStore(path, journal_mode="delete", busy_timeout_ms=50) as store:
        relay = EdgeRelay(store, redis_url="")
        cache = EdgeRevisionCache(store, relay)
        one = store.put_revision(*KEY, {"r": 1}, "ops")
        store.activate_revision(*KEY, one["revision_id"], "ops")
        relay.drain()

        async def scenario() -> None:
            escaped: list[dict[str, Any]] = []
            asyncio.get_running_loop().set_exception_handler(lambda _, ctx: escaped.append(ctx))
            assert (await cache.get_effective(*KEY)).revision_id == one["revision_id"]
            store.revoke_revision(one["revision_id"], "ops", "compromised")
            # The relay delivers on its own thread: the hint is queued on this loop (blocked
            # here on purpose) and the batch is marked delivered, so it never comes again.
            delivering = threading.Thread(target=relay.drain)
            delivering.start()
            delivering.join()
            assert store.outbox_backlog()["undelivered"] == 0
            with write_locked(path):
                await asyncio.sleep(0)  # the queued hint runs now; its reload is refused
                assert cache.messages == 2
                with pytest.raises(errors.Unavailable):  # fail closed, not the revoked one
                    await cache.get_effective(*KEY)
            with pytest.raises(errors.NotFound):
                await cache.get_effective(*KEY)
            assert escaped == []

        with caplog.at_level(logging.WARNING, logger="ql3.edge.cache"):
            asyncio.run(scenario())
        assert any("QL3_UNAVAILABLE" in r.getMessage() for r in caplog.records)
        cache.close()
        relay.close()


# -- a writer commits during a load -----------------------------------------------------------


def test_a_load_reads_revision_and_pointer_in_one_snapshot(
    store: EdgeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    relay = EdgeRelay(store, redis_url="")
    cache = EdgeRevisionCache(store, relay)
    one = store.put_revision(*KEY, {"r": 1}, "ops")
    two = store.put_revision(*KEY, {"r": 2}, "ops")
    store.activate_revision(*KEY, one["revision_id"], "ops")
    store.revoke_revision(one["revision_id"], "ops", "bad")  # pointer_version 2, none active
    relay.drain()
    after_first_read(
        store, monkeypatch, lambda: store.activate_revision(*KEY, two["revision_id"], "ops")
    )
    with pytest.raises(errors.NotFound):
        cache.lookup(*KEY)  # loaded before the activation committed
    relay.drain()  # its event (pointer_version 3) must be newer than what was loaded
    assert cache.lookup(*KEY).revision_id == two["revision_id"]
    cache.close()
    relay.close()


def test_verify_reloads_an_entry_whose_revision_differs_at_the_same_pointer_version(
    store: EdgeStore,
) -> None:
    cache = EdgeRevisionCache(store, None, max_staleness={FAMILY: 0.0})
    one = store.put_revision(*KEY, {"r": 1}, "ops")
    store.activate_revision(*KEY, one["revision_id"], "ops")
    # The entry a load that read the revision and the pointer apart could install: "none
    # active" at the pointer_version that already names a revision.
    cache._entries[KEY] = _Entry(None, 1, 0.0)
    assert cache.verify() == [KEY]
    assert cache.lookup(*KEY).revision_id == one["revision_id"]


# -- without a relay: degraded, verified before every use -------------------------------------


def test_without_a_relay_every_lookup_is_verified_against_the_active_pointer(
    store: EdgeStore,
) -> None:
    cache = EdgeRevisionCache(store, None)  # budgets untouched: 30 s for this family
    assert cache.health()["mode"] == "degraded"
    one = store.put_revision(*KEY, {"r": 1}, "ops")
    two = store.put_revision(*KEY, {"r": 2}, "ops")
    store.activate_revision(*KEY, one["revision_id"], "ops")
    assert cache.lookup(*KEY).revision_id == one["revision_id"]
    store.activate_revision(*KEY, two["revision_id"], "ops")
    assert cache.lookup(*KEY).revision_id == two["revision_id"]
    store.revoke_revision(two["revision_id"], "ops", "compromised")
    with pytest.raises(errors.NotFound):
        cache.lookup(*KEY)


def test_with_a_relay_an_entry_within_its_budget_is_used_without_a_read(
    store: EdgeStore,
) -> None:
    relay = EdgeRelay(store, redis_url="")
    cache = EdgeRevisionCache(store, relay)
    one = store.put_revision(*KEY, {"r": 1}, "ops")
    store.activate_revision(*KEY, one["revision_id"], "ops")
    assert cache.lookup(*KEY).revision_id == one["revision_id"]
    assert cache.health()["mode"] == "normal"
    for _ in range(3):
        cache.lookup(*KEY)
    assert cache.verifications == 0
    cache.close()  # unsubscribed: no more hints, so every use is verified again
    assert cache.health()["mode"] == "degraded"
    cache.lookup(*KEY)
    assert cache.verifications == 1
    relay.close()
