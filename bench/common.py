"""Helpers shared by the benchmarks: databases, timing, percentiles, pgbench, results."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import psycopg
import redis
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ql3.devservers import PG_BIN
from ql3.migrate import migrate

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT = "bench"
FAMILY = "policy_routing"
ACTOR = "bench"


@dataclass(frozen=True)
class Settings:
    """Where the servers are and how long to run."""

    base_dsn: str
    redis_url: str
    quick: bool


# -- databases -----------------------------------------------------------------------------


def with_dbname(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


@contextlib.contextmanager
def fresh_database(base_dsn: str, name: str) -> Iterator[str]:
    """A new database migrated with both streams (superuser DSN), dropped afterwards."""
    dbname = f"bench_{name}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    dsn = with_dbname(base_dsn, dbname)
    try:
        migrate(dsn, with_ai=True)
        yield dsn
    finally:
        with psycopg.connect(base_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def put_revision(conn: psycopg.Connection[Any], contract_id: str, body: dict[str, Any]) -> str:
    """Stores a revision of (bench, policy_routing, contract_id); its revision_id."""
    row = conn.execute(
        "SELECT revision_id FROM ql3.put_revision(%s, %s, %s, %s::jsonb, %s)",
        (PROJECT, FAMILY, contract_id, json.dumps(body), ACTOR),
    ).fetchone()
    assert row is not None
    return str(row[0])


def activate(conn: psycopg.Connection[Any], contract_id: str, revision_id: str) -> int:
    """Activates a revision (autocommit: committed on return); its pointer_version."""
    row = conn.execute(
        "SELECT pointer_version FROM ql3.activate_revision(%s, %s, %s, %s::uuid, %s)",
        (PROJECT, FAMILY, contract_id, revision_id, ACTOR),
    ).fetchone()
    assert row is not None, "activation did not change the pointer (already active: no row)"
    return int(row[0])


def contract_pair(conn: psycopg.Connection[Any], contract_id: str) -> tuple[str, str]:
    """Two revisions of one contract, the first active."""
    first = put_revision(conn, contract_id, {"model": "bench-a", "contract": contract_id})
    second = put_revision(conn, contract_id, {"model": "bench-b", "contract": contract_id})
    activate(conn, contract_id, first)
    return first, second


# -- statistics ----------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


T = TypeVar("T")


def alternating(sides: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """``rounds`` runs of every side back to back, the order reversed every other round, so
    that a drift in the machine's speed reaches every side alike."""
    runs: dict[str, list[T]] = {name: [] for name in sides}
    for n in range(rounds):
        for name in list(sides) if n % 2 == 0 else list(reversed(sides)):
            runs[name].append(sides[name]())
    return runs


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def us(seconds: float) -> float:
    return round(seconds * 1_000_000.0, 1)


# -- pgbench -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PgbenchRun:
    clients: int
    seconds: float
    transactions: int
    failed: int
    tps: float


_PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
_FAILED = re.compile(r"number of failed transactions: (\d+)")
_TPS = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")


def pgbench(
    dsn: str,
    script: str,
    *,
    clients: int,
    seconds: int,
    protocol: str = "prepared",
    defines: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> PgbenchRun:
    """Runs ``pgbench -n -M protocol [-D name=value ...] -f script -c C -j C -T secs`` and
    parses its report."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql", prefix="ql3-bench-") as f:
        f.write(script)
        f.flush()
        return run_pgbench(
            dsn,
            ["-n", *(a for d in defines for a in ("-D", d)), "-f", f.name],
            clients=clients,
            seconds=seconds,
            protocol=protocol,
            env=env,
        )


def run_pgbench(
    dsn: str,
    args: Sequence[str],
    *,
    clients: int,
    seconds: int,
    protocol: str = "prepared",
    env: dict[str, str] | None = None,
) -> PgbenchRun:
    """Runs ``pgbench -M protocol -c C -j C -T secs ARGS DSN`` (``env`` added to this
    process's environment) and parses its report."""
    done = subprocess.run(
        [str(PG_BIN / "pgbench"), "-M", protocol, "-c", str(clients), "-j", str(clients),
         "-T", str(seconds), *args, dsn],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr.strip()}")
    out = done.stdout
    processed, tps = _PROCESSED.search(out), _TPS.search(out)
    if processed is None or tps is None:
        raise RuntimeError(f"cannot parse pgbench output:\n{out}")
    failed = _FAILED.search(out)
    return PgbenchRun(
        clients=clients,
        seconds=seconds,
        transactions=int(processed.group(1)),
        failed=int(failed.group(1)) if failed else 0,
        tps=float(tps.group(1)),
    )


# -- helper processes ----------------------------------------------------------------------


class Helper:
    """A ``python -m bench.worker`` subprocess speaking one line per event on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: asyncio.Queue[list[str]] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def spawn(cls, name: str, *args: str) -> Helper:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.worker", *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            cwd=str(REPO_ROOT),
        )  # fmt: skip
        return cls(proc, name)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            await self.lines.put(raw.decode().split())
        await self.lines.put(["eof"])

    async def expect(self, word: str, timeout: float) -> list[str]:
        """The next line, which must start with ``word``."""
        line = await asyncio.wait_for(self.lines.get(), timeout)
        if not line or line[0] != word:
            raise RuntimeError(f"helper {self.name}: expected {word!r}, got {line!r}")
        return line

    async def stop(self) -> int:
        """SIGTERM, then wait (SIGKILL after 15 s); the exit code."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
        try:
            code = await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            self.proc.kill()
            code = await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        return code


@contextlib.asynccontextmanager
async def helpers(name: str, count: int, *args: str) -> AsyncIterator[list[Helper]]:
    """``count`` helper processes, each told its index with ``--index``; stopped afterwards."""
    procs = [await Helper.spawn(f"{name}-{i}", *args, "--index", str(i)) for i in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            await proc.stop()


# -- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the README table: a figure next to its same-run baseline."""

    label: str
    figure: str
    baseline: str
    ratio: float | None
    target: str
    result: Literal["pass", "fail", "n/a"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "figure": self.figure,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "target": self.target,
            "result": self.result,
        }


@dataclass
class Result:
    """What one benchmark measured; ``passed`` is None when it has no target."""

    name: str
    figures: dict[str, Any]
    baseline: dict[str, Any]
    ratio: dict[str, float]
    target: str | None
    passed: bool | None
    rows: list[Row]
    checks: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "measured_at": now_rfc3339(),
            "seconds": round(self.seconds, 1),
            "figures": self.figures,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "target": self.target,
            "pass": self.passed,
            "checks": self.checks,
            "notes": self.notes,
            "rows": [r.as_dict() for r in self.rows],
        }


def verdict(ok: bool | None) -> Literal["pass", "fail", "n/a"]:
    if ok is None:
        return "n/a"
    return "pass" if ok else "fail"


def ratio(figure: float, baseline: float) -> float:
    return round(figure / baseline, 3) if baseline else float("nan")


@dataclass(frozen=True)
class Against:
    """A side's rates against a baseline's, round by round (the sides alternate, so each
    round's two runs share the machine's speed)."""

    per_s: float  # the side's median rate
    by_round: list[float]  # side / baseline, per round (``ratio``)
    ratio: float  # their median, to 3 decimals

    @property
    def text(self) -> str:
        """The figure of a row: the median rate and the range of the per-round ratios."""
        return (
            f"{self.per_s:,.0f} /s (ratio per round {min(self.by_round):.3f}"
            f" to {max(self.by_round):.3f})"
        )


def against(side: Sequence[float], base: Sequence[float]) -> Against:
    """``side``'s rates against ``base``'s of the same rounds."""
    by_round = [ratio(s, b) for s, b in zip(side, base, strict=True)]
    return Against(median(side), by_round, round(median(by_round), 3))


def judged_row(label: str, over: Against, baseline: str, minimum: float, ok: bool | None) -> Row:
    """A side against its baseline, judged (a ratio of at least ``minimum``) when ``ok``
    says how it did, and with the target "none" when it has no verdict (``ok`` None)."""
    return Row(
        label=label,
        figure=over.text,
        baseline=baseline,
        ratio=over.ratio,
        target=f"ratio >= {minimum}" if ok is not None else "none",
        result=verdict(ok),
    )


def diagnostic_row(label: str, over: Against, baseline: str) -> Row:
    """A row without a target: a side against its baseline."""
    return Row(
        label=label,
        figure=over.text,
        baseline=baseline,
        ratio=over.ratio,
        target="(diagnostic)",
        result="n/a",
    )


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def machine_info(settings: Settings) -> dict[str, Any]:
    """nproc, CPU, PostgreSQL and Redis versions and the durability settings both sides share."""
    with psycopg.connect(settings.base_dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        pg_settings = {
            name: str(value)
            for name, value in conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s) ORDER BY name",
                (["fsync", "synchronous_commit", "full_page_writes", "shared_buffers"],),
            ).fetchall()
        }
    client = redis.Redis.from_url(settings.redis_url)
    try:
        redis_version = str(client.info("server").get("redis_version", "?"))
    finally:
        client.close()
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "cpu": cpu,
        "postgresql": None if version is None else str(version[0]),
        "postgresql_settings": pg_settings,
        "redis": redis_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds``."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
