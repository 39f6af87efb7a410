"""The revision caches' Prometheus series, on prometheus_client's default registry, which
the application's own ``/metrics`` serves (a cache has no HTTP server of its own, D57).

One collector reads every live ``RevisionCache`` of the process at scrape time, so the
hot paths count nothing: ``ql3_cache_heartbeat_age_seconds`` (since the oldest heartbeat
channel the cache listens to was last heard, or since the cache started when one never
was), ``ql3_cache_degraded`` (1 while it reads PostgreSQL on every call) and
``ql3_cache_entries``. The ``cache`` label tells the caches of one process apart
(``<channel_prefix>-<n>``, n counting from 1 in creation order).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class Watched(Protocol):
    """What the collector reads of a cache."""

    metrics_label: str

    def metrics_sample(self, now: float) -> tuple[str, float | None, int]:
        """(mode, heartbeat age in seconds or None, entries) at monotonic ``now``."""
        ...


_caches: weakref.WeakSet[Any] = weakref.WeakSet()
_numbers = itertools.count(1)
_lock = threading.Lock()


def label_for(channel_prefix: str) -> str:
    """A new ``cache`` label: ``<channel_prefix>-<n>``."""
    with _lock:
        return f"{channel_prefix}-{next(_numbers)}"


def watch(cache: Watched) -> None:
    """Export ``cache`` until ``unwatch`` (or until it is garbage)."""
    with _lock:
        _caches.add(cache)


def unwatch(cache: Watched) -> None:
    with _lock:
        _caches.discard(cache)


class CacheCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        age = GaugeMetricFamily(
            "ql3_cache_heartbeat_age_seconds",
            "Seconds since the cache last heard a relay heartbeat on every channel it "
            "listens to (since it started, when it never did).",
            labels=["cache"],
        )
        degraded = GaugeMetricFamily(
            "ql3_cache_degraded",
            "1 while the cache is degraded (no heartbeat within heartbeat_timeout): every "
            "read goes to PostgreSQL.",
            labels=["cache"],
        )
        entries = GaugeMetricFamily(
            "ql3_cache_entries", "Contracts the cache holds.", labels=["cache"]
        )
        now = time.monotonic()
        with _lock:
            caches = list(_caches)
        for cache in caches:
            mode, seconds, held = cache.metrics_sample(now)
            if mode in ("starting", "closed"):
                continue
            label = [cache.metrics_label]
            if seconds is not None:
                age.add_metric(label, seconds)
            degraded.add_metric(label, 1.0 if mode == "degraded" else 0.0)
            entries.add_metric(label, float(held))
        yield age
        yield degraded
        yield entries


REGISTRY.register(CacheCollector())
