"""Settings given in code are checked when they are given: a NaN, an infinity, a negative
or wrongly typed timeout, or a project list that is a string, is ``QL3_INVALID_ARGUMENT``
at construction, not a silent change of behaviour later (a NaN heartbeat timeout compared
false, so the cache never noticed that heartbeats stopped; ``projects="acme"`` subscribed
to the projects "a", "c", "e" and "m")."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from ql3 import errors
from ql3.cache import RevisionCache
from ql3.db import Timeouts
from ql3.edge import EdgeStore
from ql3.edge.cache import EdgeRevisionCache
from ql3.edge.relay import EdgeRelay
from ql3.gateway import ModelGateway
from ql3.providers import OpenAICompatibleProvider
from ql3.store import PgStore
from ql3.store_async import AsyncPgStore

BAD_SECONDS: list[Any] = [math.nan, math.inf, -1.0, 0, "5", True, None]


@pytest.mark.parametrize("name", ["heartbeat_timeout", "subscribe_timeout", "redis_timeout",
                                  "db_timeout"])  # fmt: skip
@pytest.mark.parametrize("value", BAD_SECONDS)
def test_revision_cache_timeouts_are_finite_positive_seconds(name: str, value: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match=name):
        RevisionCache("host=nowhere", "redis://nowhere", **{name: value})


@pytest.mark.parametrize("prefix", ["", None, 7])
def test_revision_cache_channel_prefix_is_a_non_empty_string(prefix: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="channel_prefix"):
        RevisionCache("host=nowhere", "redis://nowhere", channel_prefix=prefix)


@pytest.mark.parametrize(
    "overrides",
    [{"policy_routing": math.nan}, {"policy_routing": -1}, {"policy_routing": "30"},
     {"policy_routing": math.inf}, {1: 30.0}, [("policy_routing", 30.0)]],
)  # fmt: skip
def test_both_caches_refuse_a_bad_staleness_budget(tmp_path: Path, overrides: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="max_staleness"):
        RevisionCache("host=nowhere", "redis://nowhere", max_staleness=overrides)
    with (
        EdgeStore(tmp_path / "edge.db") as store,
        pytest.raises(errors.InvalidArgument, match="max_staleness"),
    ):
        EdgeRevisionCache(store, None, max_staleness=overrides)


def test_a_zero_budget_is_allowed_it_means_verify_every_use(tmp_path: Path) -> None:
    with EdgeStore(tmp_path / "edge.db") as store:
        cache = EdgeRevisionCache(store, None, max_staleness={"policy_routing": 0})
        assert cache.staleness("policy_routing") == 0.0
        cache.close()


@pytest.mark.parametrize("projects", ["acme", b"acme", [""], ["ac\x00me"], ["ac\ud800me"], [7], 7])
def test_projects_are_a_list_of_ids_never_a_string(tmp_path: Path, projects: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="project"):
        RevisionCache("host=nowhere", "redis://nowhere", projects=projects)
    with EdgeStore(tmp_path / "edge.db") as store:
        relay = EdgeRelay(store)
        with pytest.raises(errors.InvalidArgument, match="project"):
            EdgeRevisionCache(store, relay, projects=projects)


@pytest.mark.parametrize(
    "changes",
    [{"statement_ms": -1}, {"lock_ms": 1.5}, {"connect_s": "5"}, {"connect_s": 0},
     {"statement_ms": True},
     {"tcp_user_timeout_s": math.nan}, {"tcp_user_timeout_s": -1.0}, {"call_s": math.nan}],
)  # fmt: skip
def test_store_timeouts_are_checked_when_made(changes: dict[str, Any]) -> None:
    with pytest.raises(errors.InvalidArgument, match=next(iter(changes))):
        Timeouts(**changes)


@pytest.mark.parametrize("value", [0, -1, 1.5, math.nan, "4", None, True])
def test_store_pool_sizes_are_whole_numbers_of_at_least_one(value: Any) -> None:
    for store in (PgStore, AsyncPgStore):
        with pytest.raises(errors.InvalidArgument, match="max_connections"):
            store("host=nowhere", max_connections=value)
    with pytest.raises(errors.InvalidArgument, match="store_threads"):
        ModelGateway(PgStore.__new__(PgStore), None, None, store_threads=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [{"batch": 0}, {"batch": 10001}, {"batch": "5"}, {"poll_interval": 0},
     {"poll_interval": math.nan}, {"heartbeat_interval": math.inf}, {"backoff_initial": -1},
     {"backoff_max": math.nan}, {"redis_timeout": 0}, {"channel_prefix": ""}],
)  # fmt: skip
def test_edge_relay_settings(tmp_path: Path, changes: dict[str, Any]) -> None:
    with (
        EdgeStore(tmp_path / "edge.db") as store,
        pytest.raises(errors.InvalidArgument, match=next(iter(changes))),
    ):
        EdgeRelay(store, **changes)


@pytest.mark.parametrize("value", [-1, 1.5, "5000"])
def test_edge_busy_timeout_is_whole_milliseconds(tmp_path: Path, value: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="busy_timeout_ms"):
        EdgeStore(tmp_path / "edge.db", busy_timeout_ms=value)


@pytest.mark.parametrize("value", [0, math.nan, math.inf, "5"])
def test_provider_connect_timeout(value: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="connect_timeout"):
        OpenAICompatibleProvider(None, connect_timeout=value)  # type: ignore[arg-type]
