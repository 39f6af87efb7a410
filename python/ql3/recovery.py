"""``ql3 recover``: settle expired model invocations as ``lost/outcome_unknown``.

Recovery is ``ql3_ai.recover_expired`` (SPEC section 4): a bounded scan, by the database's
clock, of starts whose ``deadline_at + grace`` is past and that have no completion. It never
re-invokes a model; every recovered invocation waits for a human resolution
(``ql3 resolve``). This module only decides *when* to call it:

- ``ql3 recover``: one bounded call, its JSON result on stdout.
- ``ql3 recover --loop``: a daemon. Every ``interval`` it calls recover_expired in batches
  of ``limit`` and keeps going while a batch comes back full. Database errors are logged
  and retried with capped exponential backoff; they never end the loop. SIGTERM (or
  SIGINT) lets the batch in flight commit, then exits 0; a batch that has not returned
  ``stop_grace`` seconds after the signal (a stalled connection) is abandoned and the
  process exits 1 (a batch is one transaction: the server rolls it back, nothing is lost).
  Logs are JSON lines on stderr; ``--metrics-port`` serves Prometheus ``/metrics`` and
  ``/healthz``, which is unhealthy when no batch has committed for longer than
  ``interval + statement_timeout + health_margin``.
- ``--outbox-retention 7d`` (``QL3_OUTBOX_RETENTION``): the loop also prunes delivered
  outbox rows older than that, a round of bounded batches at most once per
  ``prune_interval`` (``ql3.prune`` and D55; on an edge device's file too, D65); a failed
  round is logged, counted, and leaves recovery alone.

On an install without prometheus-client (``pip install ql3``, ``--sqlite``) the loop runs
all the same: ``/healthz`` is served and ``/metrics`` answers 501, said once in the log
(D58). Nothing here imports a driver until a PostgreSQL store is opened.

Several recovery daemons may run at once: the SQL skips step rows another transaction
holds (``FOR UPDATE ... SKIP LOCKED``), so two batches never settle the same invocation.
``RecoveryLoop`` is the daemon, usable in-process (``start`` / ``stop``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from ql3 import arguments, errors
from ql3.cli import (
    add_dsn_or_sqlite,
    dsn_from_env,
    limit_ms,
    needs_postgres,
    open_any_store,
    print_json,
)
from ql3.edge import EdgeStore
from ql3.http_status import StatusServer, serve_status
from ql3.invocations import MAX_RECOVERY_LIMIT, format_timestamp, recovery_arguments
from ql3.logs import backoff_delay, configure_logging, describe_error
from ql3.prune import DEFAULT_BATCH as DEFAULT_PRUNE_BATCH
from ql3.prune import MAX_BATCH as MAX_PRUNE_BATCH
from ql3.prune import prune

if TYPE_CHECKING:  # imported on use: --sqlite runs on a bare install (D58)
    from prometheus_client import CollectorRegistry

    from ql3.store import PgStore, Row

    Store = PgStore | EdgeStore
    """What the loop runs on: PostgreSQL, or an edge device's SQLite file (``--sqlite``)."""

MAX_LIMIT = MAX_RECOVERY_LIMIT
DEFAULT_LIMIT = 100
DEFAULT_GRACE_SECONDS = 30.0
DEFAULT_INTERVAL_SECONDS = 5.0
DEFAULT_STATEMENT_TIMEOUT_SECONDS = 5.0
DEFAULT_HEALTH_MARGIN_SECONDS = 10.0
DEFAULT_STOP_GRACE_SECONDS = 10.0
# The longest wait any setting may ask for: time.sleep and friends overflow near 1e10 s,
# and a daemon that waits days between rounds is a typo, not a plan.
MAX_WAIT_SECONDS = 86400.0
# Outbox retention (D55): a prune round at most this often, of at most this many batches.
DEFAULT_PRUNE_INTERVAL_SECONDS = 300.0
PRUNE_MAX_BATCHES = 100

log = logging.getLogger("ql3.recovery")


def _log(level: int, event: str, **fields: Any) -> None:
    log.log(level, event, extra={"ql3": fields})


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """How often and how much to recover; ``grace_seconds`` is added to each deadline."""

    limit: int = DEFAULT_LIMIT
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    interval: float = DEFAULT_INTERVAL_SECONDS
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """Port of /metrics and /healthz: None = no server, 0 = any free port."""
    statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT_SECONDS
    """statement_timeout of the loop's own store (a conninfo given to ``RecoveryLoop``)."""
    health_margin: float = DEFAULT_HEALTH_MARGIN_SECONDS
    """/healthz is ``stale`` once no batch committed for interval + statement_timeout + this."""
    stop_grace: float = DEFAULT_STOP_GRACE_SECONDS
    """How long ``serve`` waits for the batch in flight after SIGTERM before exiting 1."""
    outbox_retention: float | None = None
    """Seconds a delivered outbox row is kept; None = the loop never prunes (D55)."""
    prune_batch: int = DEFAULT_PRUNE_BATCH
    """Rows per ``ql3.prune_outbox`` call; a round is at most ``PRUNE_MAX_BATCHES`` calls."""
    prune_interval: float = DEFAULT_PRUNE_INTERVAL_SECONDS
    """A prune round starts at most once per this many seconds."""

    def __post_init__(self) -> None:
        recovery_arguments(self.limit, self.grace_seconds)
        # At most a day each: NaN would pass ``<= 0`` and spin the loop.
        for name in (
            "interval",
            "backoff_initial",
            "backoff_max",
            "statement_timeout",
            "stop_grace",
        ):
            arguments.check_seconds(name, getattr(self, name), most=MAX_WAIT_SECONDS)
        arguments.check_seconds(
            "health_margin", self.health_margin, zero=True, most=MAX_WAIT_SECONDS
        )
        if self.outbox_retention is not None:
            arguments.check_seconds(
                "outbox_retention",
                self.outbox_retention,
                zero=True,
                most=arguments.MAX_DURATION.total_seconds(),
            )
        arguments.check_count("prune_batch", self.prune_batch, 1, MAX_PRUNE_BATCH)
        arguments.check_seconds("prune_interval", self.prune_interval, most=MAX_WAIT_SECONDS)
        if self.metrics_port is not None and (
            not isinstance(self.metrics_port, int) or self.metrics_port > 65535
        ):
            raise errors.InvalidArgument(
                f"QL3_INVALID_ARGUMENT: metrics port {self.metrics_port!r} is not a TCP port "
                "(0..65535, or negative for none)"
            )

    @property
    def stale_after(self) -> float:
        """Seconds without a committed batch after which the loop reports itself stale."""
        return self.interval + self.statement_timeout + self.health_margin


# The unresolved gauge covers at most this many projects, those waiting longest (D57),
# read with one bounded query per round (``unresolved_by_project``).
UNRESOLVED_PROJECTS_LIMIT = 100

NO_PROMETHEUS = (
    "prometheus-client is not installed: /metrics answers 501, /healthz is served "
    "(pip install prometheus-client, or 'ql3[relay]')"
)


def new_registry() -> CollectorRegistry | None:
    """A ``CollectorRegistry`` of its own, or None without prometheus-client."""
    try:
        from prometheus_client import CollectorRegistry
    except ModuleNotFoundError as exc:
        if exc.name != "prometheus_client":
            raise
        return None
    return CollectorRegistry()


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class _Gauge(Protocol):
    def set(self, value: float) -> None: ...


class _ProjectGauge(Protocol):
    def labels(self, *, project: str) -> _Gauge: ...

    def remove(self, *labelvalues: Any) -> None: ...


class _Unexported:
    """A series of a loop without a registry (no prometheus-client): counts nothing."""

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def labels(self, *, project: str) -> _Unexported:
        return self

    def remove(self, *labelvalues: Any) -> None:
        pass


class RecoveryMetrics:
    """The Prometheus series of one recovery loop (own registry, so tests can run several);
    with no registry (no prometheus-client), series that count nothing."""

    recovered: _Counter
    errors: _Counter
    skipped: _Counter
    batches: _Counter
    last_run: _Gauge
    up: _Gauge
    lost_unresolved: _ProjectGauge
    lost_unresolved_oldest_age: _ProjectGauge
    unresolved_errors: _Counter
    outbox_pruned: _Counter
    outbox_prune_errors: _Counter

    def __init__(self, registry: CollectorRegistry | None) -> None:
        if registry is None:
            for name in RecoveryMetrics.__annotations__:
                setattr(self, name, _Unexported())
            return
        from prometheus_client import Counter, Gauge

        self.recovered = Counter(
            "ql3_recovery_recovered",
            "Invocations settled as lost/outcome_unknown by recovery.",
            registry=registry,
        )
        self.errors = Counter(
            "ql3_recovery_errors", "Recovery batches that failed.", registry=registry
        )
        self.skipped = Counter(
            "ql3_recovery_skipped",
            "Expired starts a batch could not settle and skipped (each is logged).",
            registry=registry,
        )
        self.batches = Counter(
            "ql3_recovery_batches", "Recovery batches committed.", registry=registry
        )
        self.last_run = Gauge(
            "ql3_recovery_last_run_timestamp_seconds",
            "Unix time at which the last recovery batch committed (0 = never).",
            registry=registry,
        )
        self.up = Gauge(
            "ql3_recovery_up", "1 while the last recovery batch succeeded.", registry=registry
        )
        self.lost_unresolved = Gauge(
            "ql3_invocations_lost_unresolved",
            "Lost invocations waiting for a human resolution, by project (D57).",
            ["project"],
            registry=registry,
        )
        self.lost_unresolved_oldest_age = Gauge(
            "ql3_invocations_lost_unresolved_oldest_age_seconds",
            "Seconds the oldest unresolved lost invocation of a project has waited (D57).",
            ["project"],
            registry=registry,
        )
        self.unresolved_errors = Counter(
            "ql3_recovery_unresolved_query_errors",
            "Failed queries of the unresolved lost invocations (recovery goes on; D57).",
            registry=registry,
        )
        self.outbox_pruned = Counter(
            "ql3_outbox_pruned",
            "Delivered outbox rows removed by the retention schedule (D55).",
            registry=registry,
        )
        self.outbox_prune_errors = Counter(
            "ql3_outbox_prune_errors",
            "Failed prune rounds of the retention schedule (recovery goes on; D55).",
            registry=registry,
        )


class RecoveryLoop:
    """The recovery daemon: ``run`` until ``request_stop``.

    Pass a ``PgStore`` or an ``EdgeStore`` (kept open) or a conninfo (a one-connection
    ``PgStore``, closed when ``run`` returns). Every call goes through the store
    interface, the outbox prune included (D65). In-process use: ``start()``
    runs it in a thread, ``stop()`` ends it; ``wait_until`` waits for a condition on its
    counters without sleeping blindly. Its series go to ``registry`` (a new one by
    default); without prometheus-client there is none, and the loop runs all the same
    (``/metrics`` answers 501; D58).
    """

    def __init__(
        self,
        store: Store | str,
        config: RecoveryConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config or RecoveryConfig()
        self._store_arg = store
        self._registry = registry if registry is not None else new_registry()
        self.metrics = RecoveryMetrics(self._registry)
        self.recovered = 0
        self.batches = 0
        self.errors = 0
        self.consecutive_errors = 0
        self.last_error: str | None = None
        self.last_run_at: datetime | None = None
        self._last_progress = time.monotonic()  # last committed batch, or the start
        self.metrics_port: int | None = None
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._http: StatusServer | None = None
        self._unresolved_projects: set[str] = set()
        self.pruned = 0
        self._last_prune: float | None = None  # monotonic start of the last prune round

    @property
    def registry(self) -> CollectorRegistry:
        """The loop's Prometheus registry; ``Misconfigured`` without prometheus-client."""
        if self._registry is None:
            raise errors.Misconfigured(f"QL3_INVALID_ARGUMENT: {NO_PROMETHEUS}")
        return self._registry

    # -- lifecycle ---------------------------------------------------------------------

    def request_stop(self) -> None:
        """Let the batch in flight commit, then leave ``run`` (the SIGTERM handler)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        """Run the loop in a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="ql3-recovery", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Request a stop and wait for the background thread to end."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"recovery loop still running after {timeout}s")
            self._thread = None

    def wait_until(self, predicate: Callable[[RecoveryLoop], bool], timeout: float = 10.0) -> None:
        """Block until ``predicate(self)`` holds (checked after every batch or error)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"recovery loop: condition not met after {timeout}s")
                self._changed.wait(remaining)

    def run(self) -> None:
        """Recover until ``request_stop``: drain, wait ``interval``, again; back off on errors."""
        store: Store
        if isinstance(self._store_arg, str):
            store, owned = owned_store(self._store_arg, self.config), True
        else:
            store, owned = self._store_arg, False
        _log(
            logging.INFO,
            "recovery_starting",
            limit=self.config.limit,
            grace_seconds=self.config.grace_seconds,
            interval=self.config.interval,
        )
        with self._changed:
            self._last_progress = time.monotonic()
        try:
            self._open_http()
            while not self._stop.is_set():
                try:
                    self.drain(store)
                except Exception as exc:
                    delay = self._record_error(exc)
                    self._stop.wait(delay)
                    continue
                self.observe_unresolved(store)
                self.maybe_prune(store)
                self._stop.wait(self.config.interval)
        finally:
            self._close_http()
            if owned:
                store.close()
            self.metrics.up.set(0)
            _log(
                logging.INFO,
                "recovery_stopped",
                recovered=self.recovered,
                batches=self.batches,
                errors=self.errors,
            )

    # -- work --------------------------------------------------------------------------

    def run_batch(self, store: Store) -> Row:
        """One ``recover_expired`` call; its result. Errors propagate (as ``ql3.errors``)."""
        result = store.recover_expired(self.config.limit, self.config.grace_seconds)
        count = int(result["count"])
        with self._changed:
            self.batches += 1
            self.recovered += count
            self.consecutive_errors = 0
            self.last_error = None
            self.last_run_at = datetime.now(UTC)
            self._last_progress = time.monotonic()
            self._changed.notify_all()
        self.metrics.batches.inc()
        self.metrics.recovered.inc(count)
        self.metrics.last_run.set(time.time())
        self.metrics.up.set(1)
        for item in result["recovered"]:
            _log(
                logging.INFO,
                "invocation_recovered",
                invocation_id=item["invocation_id"],
                run_id=item["run_id"],
                step_run_id=item["step_run_id"],
                deadline_at=item["deadline_at"],
                completion_digest=item["completion_digest"],
            )
        skipped = result.get("failed") or []
        self.metrics.skipped.inc(len(skipped))
        for item in skipped:
            _log(
                logging.ERROR,
                "invocation_not_recovered",
                invocation_id=item["invocation_id"],
                run_id=item["run_id"],
                step_run_id=item["step_run_id"],
                sqlstate=item["sqlstate"],
                error=item["message"],
            )
        _log(
            logging.INFO if count or skipped else logging.DEBUG,
            "batch_done",
            recovered=count,
            skipped=len(skipped),
        )
        return result

    def drain(self, store: Store) -> int:
        """Batches until one comes back short of ``limit`` or a stop is requested."""
        total = 0
        while True:
            count = int(self.run_batch(store)["count"])
            total += count
            if count < self.config.limit or self._stop.is_set():
                return total

    def observe_unresolved(self, store: Store) -> None:
        """Set the unresolved gauges from one query; a failure is logged and counted, and
        the gauges keep their last values (recovery goes on, D57)."""
        try:
            rows = [
                (row["project"], row["unresolved"], row["oldest_age_seconds"])
                for row in store.unresolved_by_project(UNRESOLVED_PROJECTS_LIMIT)
            ]
        except Exception as exc:
            self.metrics.unresolved_errors.inc()
            _log(logging.WARNING, "unresolved_query_failed", error=describe_error(exc))
            return
        seen = {str(project) for project, _, _ in rows}
        # Projects no longer waiting are removed, never the whole gauge: a scrape between a
        # clear and a set would see no series and reset an alert's ``for``.
        for project in self._unresolved_projects - seen:
            self.metrics.lost_unresolved.remove(project)
            self.metrics.lost_unresolved_oldest_age.remove(project)
        for project, count, oldest_age in rows:
            self.metrics.lost_unresolved.labels(project=str(project)).set(int(count))
            self.metrics.lost_unresolved_oldest_age.labels(project=str(project)).set(
                float(oldest_age)
            )
        self._unresolved_projects = seen

    def maybe_prune(self, store: Store) -> int:
        """With a retention set, a prune round at most once per ``prune_interval``: at most
        ``PRUNE_MAX_BATCHES`` bounded batches (the next round goes on). A failure is logged
        and counted, and recovery goes on (D55). Returns the rows removed."""
        retention = self.config.outbox_retention
        now = time.monotonic()
        if retention is None or (
            self._last_prune is not None and now - self._last_prune < self.config.prune_interval
        ):
            return 0
        self._last_prune = now
        try:
            removed = prune(
                store,
                timedelta(seconds=retention),
                self.config.prune_batch,
                max_batches=PRUNE_MAX_BATCHES,
            )
        except Exception as exc:
            self.metrics.outbox_prune_errors.inc()
            _log(logging.WARNING, "outbox_prune_failed", error=describe_error(exc))
            return 0
        with self._changed:
            self.pruned += removed
            self._changed.notify_all()
        self.metrics.outbox_pruned.inc(removed)
        _log(
            logging.INFO if removed else logging.DEBUG,
            "outbox_pruned",
            removed=removed,
            retention_seconds=retention,
        )
        return removed

    def _record_error(self, exc: Exception) -> float:
        with self._changed:
            self.errors += 1
            self.consecutive_errors += 1
            self.last_error = describe_error(exc)
            failures = self.consecutive_errors
            self._changed.notify_all()
        self.metrics.errors.inc()
        self.metrics.up.set(0)
        delay = backoff_delay(
            failures, initial=self.config.backoff_initial, cap=self.config.backoff_max
        )
        _log(
            logging.WARNING,
            "batch_failed",
            error=self.last_error,
            code=getattr(exc, "code", None),
            attempt=failures,
            retry_in_seconds=round(delay, 3),
        )
        return delay

    # -- health and metrics ------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """What /healthz reports: ``ok`` once a batch committed, none failed since, and the
        last one is recent (``stale``: a batch hangs, e.g. on a stalled connection)."""
        with self._changed:
            age = time.monotonic() - self._last_progress
            reason: str | None = None
            if self.consecutive_errors:
                status, reason = "failing", self.last_error
            elif age > self.config.stale_after:
                status = "stale"
                since = "since the loop started" if self.last_run_at is None else ""
                reason = (
                    f"no batch has committed for {age:.1f} s{since and ' ' + since}, more "
                    f"than interval + statement_timeout + health_margin = "
                    f"{self.config.stale_after:g} s"
                )
            elif self.last_run_at is None:
                status = "starting"
            else:
                status = "ok"
            return {
                "status": status,
                "reason": reason,
                "last_run_at": None
                if self.last_run_at is None
                else format_timestamp(self.last_run_at),
                "recovered": self.recovered,
                "batches": self.batches,
                "errors": self.errors,
                "consecutive_errors": self.consecutive_errors,
                "last_error": self.last_error,
            }

    def _open_http(self) -> None:
        self._http = serve_status(
            self.config.metrics_host,
            self.config.metrics_port,
            self._registry,
            self.health,
            name="ql3-recovery-http",
            log=log,
        )
        self.metrics_port = None if self._http is None else self._http.port
        if self._http is not None and self._registry is None:
            _log(logging.WARNING, "metrics_not_served", detail=NO_PROMETHEUS)

    def _close_http(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


# -- command line ----------------------------------------------------------------------


def _number(value: Any, var: str, environ: Mapping[str, str], default: Any, kind: type) -> Any:
    if value is not None:
        return value
    text = environ.get(var)
    if text in (None, ""):
        return default
    try:
        return kind(text)
    except ValueError:
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: {var}={text!r} is not a number"
        ) from None


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RecoveryConfig:
    """Flags win over QL3_RECOVERY_* environment variables, which win over defaults."""
    env = os.environ if environ is None else environ
    return RecoveryConfig(
        limit=_number(args.limit, "QL3_RECOVERY_LIMIT", env, DEFAULT_LIMIT, int),
        grace_seconds=_number(args.grace, "QL3_RECOVERY_GRACE", env, DEFAULT_GRACE_SECONDS, float),
        interval=_number(
            args.interval, "QL3_RECOVERY_INTERVAL", env, DEFAULT_INTERVAL_SECONDS, float
        ),
        backoff_max=_number(args.backoff_max, "QL3_RECOVERY_BACKOFF_MAX", env, 30.0, float),
        metrics_host=str(args.metrics_host or env.get("QL3_RECOVERY_METRICS_HOST") or "127.0.0.1"),
        metrics_port=_number(args.metrics_port, "QL3_RECOVERY_METRICS_PORT", env, None, int),
        statement_timeout=_number(
            args.statement_timeout,
            "QL3_RECOVERY_STATEMENT_TIMEOUT",
            env,
            DEFAULT_STATEMENT_TIMEOUT_SECONDS,
            float,
        ),
        health_margin=_number(
            args.health_margin,
            "QL3_RECOVERY_HEALTH_MARGIN",
            env,
            DEFAULT_HEALTH_MARGIN_SECONDS,
            float,
        ),
        stop_grace=_number(
            args.stop_grace, "QL3_RECOVERY_STOP_GRACE", env, DEFAULT_STOP_GRACE_SECONDS, float
        ),
        outbox_retention=_retention(args.outbox_retention, env),
        prune_batch=_number(
            args.outbox_prune_batch, "QL3_OUTBOX_PRUNE_BATCH", env, DEFAULT_PRUNE_BATCH, int
        ),
        prune_interval=_number(
            args.outbox_prune_interval,
            "QL3_OUTBOX_PRUNE_INTERVAL",
            env,
            DEFAULT_PRUNE_INTERVAL_SECONDS,
            float,
        ),
    )


def _retention(value: timedelta | None, environ: Mapping[str, str]) -> float | None:
    """``--outbox-retention``, else ``QL3_OUTBOX_RETENTION`` (``7d``), in seconds."""
    if value is None:
        text = environ.get("QL3_OUTBOX_RETENTION")
        if text in (None, ""):
            return None
        value = arguments.parse_duration(text)
    return value.total_seconds()


def owned_store(dsn: str, config: RecoveryConfig) -> PgStore:
    """The one-connection store of the recovery daemon, bounded by
    ``config.statement_timeout``."""
    with needs_postgres("ql3 recover on PostgreSQL", sqlite=True):
        from ql3.db import Timeouts
        from ql3.store import PgStore
    timeouts = Timeouts(statement_ms=limit_ms(config.statement_timeout))
    return PgStore(dsn, max_connections=1, timeouts=timeouts)


# How often the main thread of ``serve`` looks for a signal while the loop runs.
_SIGNAL_POLL_SECONDS = 0.1


def serve(store: Store | str, config: RecoveryConfig) -> int:
    """Run the loop until SIGTERM or SIGINT: 0 after a clean stop, 1 when the batch in
    flight did not return within ``config.stop_grace`` (it is abandoned; the server rolls
    its transaction back when the process is gone).

    The loop runs in a daemon thread, so a batch stuck on a stalled connection cannot hold
    the process. The signal handler only records the signal: it runs on the main thread
    between any two bytecodes, possibly while that thread holds a lock (an Event's), so it
    must take none. The main thread notices the signal within ``_SIGNAL_POLL_SECONDS``.
    """
    loop = RecoveryLoop(store, config)
    received: list[int] = []
    failure: list[BaseException] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)  # no lock, no I/O: see above

    def work() -> None:
        try:
            loop.run()
        except BaseException as exc:
            failure.append(exc)

    worker = threading.Thread(target=work, name="ql3-recovery", daemon=True)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker.start()
        while worker.is_alive() and not received:
            worker.join(_SIGNAL_POLL_SECONDS)
        if received:
            _log(logging.INFO, "stop_requested", signal=signal.Signals(received[0]).name)
            loop.request_stop()
            worker.join(config.stop_grace)
            if worker.is_alive():
                _log(
                    logging.ERROR,
                    "stop_grace_exceeded",
                    stop_grace=config.stop_grace,
                    detail="the batch in flight did not return; exiting without it "
                    "(its transaction is rolled back by the server)",
                )
                return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]
    return 0


def command(args: argparse.Namespace) -> int:
    """``ql3 recover``: one bounded call, or the daemon with ``--loop``; on PostgreSQL, or
    with ``--sqlite`` on an edge device's file."""
    where = "ql3 recover on PostgreSQL"
    dsn = None if args.sqlite is not None else dsn_from_env(args.dsn, where, sqlite=True)
    try:
        config = config_from_args(args)
    except errors.InvalidArgument as exc:
        raise errors.Misconfigured(exc.message) from None
    if args.loop:
        configure_logging(args.log_level or os.environ.get("QL3_LOG_LEVEL") or "info")
        if dsn is not None:
            return serve(dsn, config)
    with open_any_store(args, time_limit=config.statement_timeout) as store:
        if args.loop:  # on an edge file
            return serve(store, config)
        print_json(store.recover_expired(config.limit, config.grace_seconds))
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``recover`` to ``ql3``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "recover",
        help="settle expired invocations as lost/outcome_unknown (once, or --loop)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = parser.add_argument
    add_dsn_or_sqlite(parser, "PostgreSQL conninfo of a ql3_operator member (default: $QL3_DSN)")
    a("--limit", type=int, help=f"invocations per batch, 1..{MAX_LIMIT} (default {DEFAULT_LIMIT})")
    a(
        "--grace",
        type=float,
        help="seconds past deadline_at before a start counts as expired "
        f"(default {DEFAULT_GRACE_SECONDS:g})",
    )
    a("--loop", action="store_true", help="run as a daemon until SIGTERM")
    a(
        "--interval",
        type=float,
        help=f"with --loop: seconds between rounds (default {DEFAULT_INTERVAL_SECONDS:g})",
    )
    a("--backoff-max", type=float, help="with --loop: cap of the error backoff (default 30)")
    a("--metrics-host", help="with --loop: address of /metrics and /healthz (default 127.0.0.1)")
    a("--metrics-port", type=int, help="with --loop: port of /metrics and /healthz; 0 = any")
    a(
        "--statement-timeout",
        type=float,
        help="seconds a recovery batch may run in the database; with --sqlite, how long it "
        f"waits for the file's write lock (default {DEFAULT_STATEMENT_TIMEOUT_SECONDS:g})",
    )
    a(
        "--health-margin",
        type=float,
        help="with --loop: /healthz is stale when no batch committed for interval + "
        f"statement timeout + this many seconds (default {DEFAULT_HEALTH_MARGIN_SECONDS:g})",
    )
    a(
        "--stop-grace",
        type=float,
        help="with --loop: seconds a batch in flight gets after SIGTERM before the process "
        f"exits 1 without it (default {DEFAULT_STOP_GRACE_SECONDS:g})",
    )
    a(
        "--outbox-retention",
        type=arguments.duration_type,
        help="with --loop: prune delivered outbox rows older than this (7d, 12h; default: "
        "$QL3_OUTBOX_RETENTION, else never; D55, D65)",
    )
    a(
        "--outbox-prune-batch",
        type=int,
        help=f"with --outbox-retention: rows per prune batch, 1..{MAX_PRUNE_BATCH} "
        f"(default {DEFAULT_PRUNE_BATCH})",
    )
    a(
        "--outbox-prune-interval",
        type=float,
        help="with --outbox-retention: seconds between prune rounds "
        f"(default {DEFAULT_PRUNE_INTERVAL_SECONDS:g})",
    )
    a("--log-level", help="with --loop: debug, info, warning, error (default info)")
    parser.set_defaults(func=command)
    return parser
