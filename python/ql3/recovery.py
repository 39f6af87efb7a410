"""``ql3 recover``: settle expired model invocations as ``lost/outcome_unknown``.

Recovery is ``ql3_ai.recover_expired`` (SPEC section 4): a bounded scan, by the database's
clock, of starts whose ``deadline_at + grace`` is past and that have no completion. It never
re-invokes a model; every recovered invocation waits for a human resolution
(``ql3 resolve``). This module only decides *when* to call it:

- ``ql3 recover``: one bounded call, its JSON result on stdout.
- ``ql3 recover --loop``: a daemon. Every ``interval`` it calls recover_expired in batches
  of ``limit`` and keeps going while a batch comes back full. Database errors are logged
  and retried with capped exponential backoff; they never end the loop. SIGTERM (or
  SIGINT) lets the batch in flight commit, then exits 0. Logs are JSON lines on stderr;
  ``--metrics-port`` serves Prometheus ``/metrics`` and ``/healthz``.

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
from datetime import UTC, datetime
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from ql3 import errors
from ql3.cli import print_json
from ql3.db import dsn_from_env
from ql3.http_status import StatusServer, serve_status
from ql3.invocations import MAX_RECOVERY_LIMIT, format_timestamp, recovery_arguments
from ql3.logs import backoff_delay, configure_logging, describe_error
from ql3.store import PgStore, Row

MAX_LIMIT = MAX_RECOVERY_LIMIT
DEFAULT_LIMIT = 100
DEFAULT_GRACE_SECONDS = 30.0
DEFAULT_INTERVAL_SECONDS = 5.0

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

    def __post_init__(self) -> None:
        recovery_arguments(self.limit, self.grace_seconds)
        if self.interval <= 0 or self.backoff_initial <= 0 or self.backoff_max <= 0:
            raise errors.InvalidArgument(
                "QL3_INVALID_ARGUMENT: interval and backoff must be positive"
            )


class RecoveryMetrics:
    """The Prometheus series of one recovery loop (own registry, so tests can run several)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.recovered = Counter(
            "ql3_recovery_recovered",
            "Invocations settled as lost/outcome_unknown by recovery.",
            registry=registry,
        )
        self.errors = Counter(
            "ql3_recovery_errors", "Recovery batches that failed.", registry=registry
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


class RecoveryLoop:
    """The recovery daemon: ``run`` until ``request_stop``.

    Pass a ``PgStore`` (kept open) or a conninfo (a one-connection store, closed when
    ``run`` returns). In-process use: ``start()`` runs it in a thread, ``stop()`` ends it;
    ``wait_until`` waits for a condition on its counters without sleeping blindly.
    """

    def __init__(
        self,
        store: PgStore | str,
        config: RecoveryConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config or RecoveryConfig()
        self._store_arg = store
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = RecoveryMetrics(self.registry)
        self.recovered = 0
        self.batches = 0
        self.errors = 0
        self.consecutive_errors = 0
        self.last_error: str | None = None
        self.last_run_at: datetime | None = None
        self.metrics_port: int | None = None
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._http: StatusServer | None = None

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
        if isinstance(self._store_arg, str):
            store, owned = PgStore(self._store_arg, max_connections=1), True
        else:
            store, owned = self._store_arg, False
        _log(
            logging.INFO,
            "recovery_starting",
            limit=self.config.limit,
            grace_seconds=self.config.grace_seconds,
            interval=self.config.interval,
        )
        try:
            self._open_http()
            while not self._stop.is_set():
                try:
                    self.drain(store)
                except Exception as exc:
                    delay = self._record_error(exc)
                    self._stop.wait(delay)
                    continue
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

    def run_batch(self, store: PgStore) -> Row:
        """One ``recover_expired`` call; its result. Errors propagate (as ``ql3.errors``)."""
        result = store.recover_expired(self.config.limit, self.config.grace_seconds)
        count = int(result["count"])
        with self._changed:
            self.batches += 1
            self.recovered += count
            self.consecutive_errors = 0
            self.last_error = None
            self.last_run_at = datetime.now(UTC)
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
        _log(logging.INFO if count else logging.DEBUG, "batch_done", recovered=count)
        return result

    def drain(self, store: PgStore) -> int:
        """Batches until one comes back short of ``limit`` or a stop is requested."""
        total = 0
        while True:
            count = int(self.run_batch(store)["count"])
            total += count
            if count < self.config.limit or self._stop.is_set():
                return total

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
        """What /healthz reports: ``ok`` once a batch committed and none failed since."""
        with self._changed:
            if self.consecutive_errors:
                status = "failing"
            elif self.last_run_at is None:
                status = "starting"
            else:
                status = "ok"
            return {
                "status": status,
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
            self.registry,
            self.health,
            name="ql3-recovery-http",
            log=log,
        )
        self.metrics_port = None if self._http is None else self._http.port

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
    )


def serve(dsn: str, config: RecoveryConfig) -> int:
    """Run the loop in this (main) thread until SIGTERM or SIGINT; 0 after a clean stop."""
    loop = RecoveryLoop(dsn, config)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        _log(logging.INFO, "stop_requested", signal=signal.Signals(signum).name)
        loop.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        loop.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def command(args: argparse.Namespace) -> int:
    """``ql3 recover``: one bounded call, or the daemon with ``--loop``."""
    dsn = dsn_from_env(args.dsn)
    config = config_from_args(args)
    if args.loop:
        configure_logging(args.log_level or os.environ.get("QL3_LOG_LEVEL") or "info")
        return serve(dsn, config)
    with PgStore(dsn, max_connections=1) as store:
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
    a("--dsn", help="PostgreSQL conninfo of a ql3_operator member (default: $QL3_DSN)")
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
    a("--log-level", help="with --loop: debug, info, warning, error (default info)")
    parser.set_defaults(func=command)
    return parser
