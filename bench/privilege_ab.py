"""The cost of D46's privilege switch: the same figures on the SQL before and after it.

Issue 20 made every writing function SECURITY DEFINER (it runs as ``ql3_owner``, its
search_path pinned with ``pg_temp`` last), added a shared advisory lock to a policy-bound
admission and an exclusive one to activation and revocation, wrapped the writes of
complete and resolve in a subtransaction, put an O(1) size check before every command and
made canonicalisation linear (commit 589615b). This benchmark measures what that costs, in
one run on one server: two databases, ``before`` migrated with the ``sql/`` of the
commit before the change (``BEFORE_COMMIT``, taken from git into a temporary directory)
and ``after`` migrated with the working tree's ``sql/``, and on each

- admit+complete pairs/s: ``bench.pairs``'s ``PAIR_SCRIPT``, its ``SETUP_SQL`` and its
  batches of ready steps, run by pgbench as ``ql3_runtime``, as the pairs benchmark runs
  them (no policy bound: ``"policy": null``);
- activations/s: ``bench.activations``'s driver script (the activation, then
  ``ql3.wake_relays()`` after its COMMIT, in one pipeline, outbox NOTIFYs deferred), its
  contracts and its checked runs (one outbox row per transaction), run by pgbench as
  ``ql3_operator``, the role that activates in production (the activations benchmark runs
  them as the superuser; so a ``before`` caller goes through the table grants);

at 8 clients and at 1, in rounds of the sides back to back with the order reversed every
other round (before, after, after, before, ...), so that a drift in the machine's speed
reaches every side alike. The figures are the medians over the rounds; each ratio
(after / before) is the median of the per-round ratios. Target: ratio >= 0.95 for both at
8 clients. When git or the commit is not available, the section says "not measured" and
why instead of failing the run.

The working tree's SQL may hold later changes than D46's (D47's project isolation came
next), so a third, diagnostic side ``d46`` is migrated with the SQL of ``CHANGE_COMMIT``
itself: its ratio is D46's own cost, and after / d46 what came since.

Roles are the cluster's, grants the database's: both migrations create the same group
roles (``CREATE ROLE`` only when missing) and grant on their own database's objects, so
neither database changes the other's privileges; the run checks each database's catalogue
after both are migrated (``checks``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from bench import activations, pairs
from bench.common import (
    REPO_ROOT,
    PgbenchRun,
    Result,
    Row,
    Settings,
    alternating,
    median,
    ratio,
    verdict,
    with_dbname,
)
from ql3.db import DEFERRED_NOTIFY_OPTION
from ql3.migrate import migrate

#: The parent of 589615b (issue 20, D46): the SQL before the privilege switch.
BEFORE_COMMIT = "417ed32"
CHANGE_COMMIT = "589615b"
TARGET_RATIO = 0.95
TARGET_CLIENTS = 8
CLIENT_COUNTS = (8, 1)
ROUNDS = 6  # even: each side runs first in as many rounds as the other
ROUND_SECONDS = 4
OPERATOR_OPTION = "-c role=ql3_operator"
METRICS = ("pairs", "activations")
LABELS = {"pairs": "admit+complete pairs/s", "activations": "activations/s (driver)"}


class NotMeasured(Exception):
    """The ``before`` SQL cannot be had here (no git, no such commit)."""


def _git(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``git -C REPO_ROOT ARGS``; ``NotMeasured`` when git cannot run or (``check``) fails."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise NotMeasured(f"git cannot run: {exc}") from None
    if check and done.returncode != 0:
        raise NotMeasured(f"git {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def extract_sql(commit: str, dest: Path) -> str:
    """Writes the ``sql/`` tree of ``commit`` under ``dest`` (``dest/sql/...``); the
    commit's full id. ``NotMeasured`` when git or the commit is not available."""
    found = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", check=False)
    if found.returncode != 0:
        raise NotMeasured(
            found.stderr.strip() or f"commit {commit} is not in the git repository at {REPO_ROOT}"
        )
    full = found.stdout.strip()
    names = _git("ls-tree", "-r", "--name-only", full, "--", "sql").stdout.split()
    if not names:
        raise NotMeasured(f"commit {commit} has no sql/ directory")
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_git("show", f"{full}:{name}").stdout)
    return full


@contextlib.contextmanager
def migrated_database(base_dsn: str, name: str, sql_root: Path) -> Iterator[str]:
    """A new database migrated (both streams) with the SQL under ``sql_root``, dropped
    afterwards; its superuser DSN."""
    dbname = f"bench_ab_{name}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    dsn = with_dbname(base_dsn, dbname)
    try:
        migrate(dsn, with_ai=True, sql_root=sql_root)
        yield dsn
    finally:
        with psycopg.connect(base_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


# What D46 changed in the catalogue, read from each database after both were migrated: the
# writers run as their owner, and the runtime and the operator lost their table writes.
PRIVILEGES_SQL = """\
SELECT
    (SELECT prosecdef FROM pg_proc WHERE oid = 'ql3_ai.admit_invocation(jsonb)'::regprocedure),
    (SELECT prosecdef FROM pg_proc
     WHERE oid = 'ql3.activate_revision(text, text, text, uuid, text, uuid)'::regprocedure),
    has_table_privilege('ql3_runtime', 'ql3_ai.model_invocation_starts', 'INSERT'),
    has_table_privilege('ql3_operator', 'ql3.active_revisions', 'UPDATE'),
    has_function_privilege('ql3_runtime', 'ql3_ai.admit_invocation(jsonb)', 'EXECUTE'),
    has_function_privilege(
        'ql3_operator', 'ql3.activate_revision(text, text, text, uuid, text, uuid)', 'EXECUTE')
"""
PRIVILEGE_NAMES = (
    "admit_invocation_security_definer",
    "activate_revision_security_definer",
    "runtime_inserts_starts",
    "operator_updates_pointers",
    "runtime_executes_admit",
    "operator_executes_activate",
)
#: What each side must show (``before`` is SECURITY INVOKER with table grants).
EXPECTED_PRIVILEGES = {
    "before": (False, False, True, True, True, True),
    "d46": (True, True, False, False, True, True),
    "after": (True, True, False, False, True, True),
}


def privileges(dsn: str) -> dict[str, bool]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(PRIVILEGES_SQL).fetchone()
    assert row is not None
    return dict(zip(PRIVILEGE_NAMES, (bool(v) for v in row), strict=True))


def check_privileges(side: str, found: Mapping[str, bool]) -> None:
    """Raises unless a database holds its side's privileges (``EXPECTED_PRIVILEGES``)."""
    expected = dict(zip(PRIVILEGE_NAMES, EXPECTED_PRIVILEGES[side], strict=True))
    if dict(found) != expected:
        raise RuntimeError(f"{side}: privileges {dict(found)}, expected {expected}")


class _Side:
    """One database: the pairs (``pairs._Pairs``) and the activations of
    ``bench.activations``, both prepared as those benchmarks prepare them."""

    def __init__(self, name: str, dsn: str, pair_script: str) -> None:
        self.name = name
        self.dsn = dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(pairs.SETUP_SQL)
        activations._prepare(dsn, max(CLIENT_COUNTS))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("GRANT SELECT ON bench_clients TO ql3_operator")
        bases = itertools.count(pairs._BASE0 + pairs._BATCH, pairs._BATCH)
        self.pairs = pairs._Pairs(f"{name} pairs", dsn, pair_script, bases, pairs.RUNTIME_ENV)
        # As PgStore's pool connects (NOTIFYs deferred), as the operator.
        self.driver = make_conninfo(dsn, options=f"{DEFERRED_NOTIFY_OPTION} {OPERATOR_OPTION}")
        self.per_client = 1000

    def warm(self, clients: int, seconds: int) -> None:
        """1-second runs of both (plans, buffers); the pairs' rate sizes their batches."""
        warm = self.pairs.run(clients, 1, 5000)
        self.per_client = math.ceil(warm.tps / clients * seconds * 3) + 1000
        self.activations(clients, 1)

    def pair_run(self, clients: int, seconds: int) -> PgbenchRun:
        return self.pairs.run(clients, seconds, self.per_client)

    def activations(self, clients: int, seconds: int) -> PgbenchRun:
        return activations._measured_activations(
            self.dsn, activations.DRIVER_SCRIPT, clients, seconds, self.driver
        )


@dataclass(frozen=True)
class Compared:
    """One metric at one client count: each side's runs, in round order."""

    runs: dict[str, list[PgbenchRun]]

    def tps(self, side: str) -> float:
        return median([r.tps for r in self.runs[side]])

    def by_round(self, side: str, reference: str = "before") -> list[float]:
        return [
            ratio(a.tps, b.tps) for a, b in zip(self.runs[side], self.runs[reference], strict=True)
        ]


def compare(
    sides: Mapping[str, _Side], clients: int, rounds: int, seconds: int
) -> dict[str, Compared]:
    """Each metric's alternating rounds over the sides, after a warm-up of each side."""
    for side in sides.values():
        side.warm(clients, seconds)

    def runner(side: _Side, metric: str) -> Callable[[], PgbenchRun]:
        if metric == "pairs":
            return lambda: side.pair_run(clients, seconds)
        return lambda: side.activations(clients, seconds)

    return {
        metric: Compared(
            alternating({name: runner(side, metric) for name, side in sides.items()}, rounds)
        )
        for metric in METRICS
    }


def measure(
    base_dsn: str,
    sql_roots: Mapping[str, Path],
    *,
    rounds: int,
    seconds: int,
    client_counts: tuple[int, ...] = CLIENT_COUNTS,
) -> tuple[dict[int, dict[str, Compared]], dict[str, dict[str, bool]]]:
    """Every metric on one database per named SQL root (migrated in that order), at each
    client count; and each database's privileges, read after all were migrated."""
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "pair.pgbench"
        script.write_text(pairs.PAIR_SCRIPT)
        dsns = {
            name: stack.enter_context(migrated_database(base_dsn, name, root))
            for name, root in sql_roots.items()
        }
        found = {name: privileges(dsn) for name, dsn in dsns.items()}
        for name in found.keys() & EXPECTED_PRIVILEGES.keys():
            check_privileges(name, found[name])
        sides = {name: _Side(name, dsn, str(script)) for name, dsn in dsns.items()}
        results = {clients: compare(sides, clients, rounds, seconds) for clients in client_counts}
    return results, found


def _not_measured(reason: str) -> Result:
    return Result(
        name="privilege_ab",
        figures={"not_measured": reason},
        baseline={},
        ratio={},
        target=None,
        passed=None,
        rows=[
            Row(
                label="privilege switch (D46) A/B",
                figure=f"not measured: {reason}",
                baseline=f"SQL of {BEFORE_COMMIT} (before {CHANGE_COMMIT})",
                ratio=None,
                target=f"ratio >= {TARGET_RATIO}",
                result="n/a",
            )
        ],
    )


def _row(
    metric: str, clients: int, side: str, compared: Compared, ok: bool | None, diagnostic: bool
) -> Row:
    figure, before = compared.tps(side), compared.tps("before")
    per_round = compared.by_round(side)
    plural = "s" if clients > 1 else ""
    role = "ql3_runtime" if metric == "pairs" else "ql3_operator"
    what = f"SQL of {CHANGE_COMMIT} (D46 alone)" if diagnostic else "working tree SQL"
    return Row(
        label=(
            f"privilege switch (D46): {LABELS[metric]}, {clients} client{plural}, as {role}, {what}"
        ),
        figure=(f"{figure:,.0f} /s (ratio per round {min(per_round):.3f} to {max(per_round):.3f})"),
        baseline=f"{before:,.0f} /s SQL of {BEFORE_COMMIT} (before D46)",
        ratio=round(median(per_round), 3),
        target="(diagnostic)"
        if diagnostic
        else (f"ratio >= {TARGET_RATIO}" if ok is not None else "none"),
        result="n/a" if diagnostic else verdict(ok),
    )


def run(settings: Settings) -> Result:
    rounds, seconds = (2, 1) if settings.quick else (ROUNDS, ROUND_SECONDS)
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ql3-sql-ab-") as tmp:
        try:
            before_commit = extract_sql(BEFORE_COMMIT, Path(tmp) / "before")
        except NotMeasured as exc:
            return _not_measured(str(exc))
        roots = {"before": Path(tmp) / "before" / "sql"}
        # Diagnostic: the SQL of the change itself, so that a later SQL change in the
        # working tree is told apart from D46's own cost.
        try:
            change_commit = extract_sql(CHANGE_COMMIT, Path(tmp) / "d46")
            roots["d46"] = Path(tmp) / "d46" / "sql"
            checks["d46_sql"] = f"{change_commit} (git show {CHANGE_COMMIT}:sql/...)"
        except NotMeasured as exc:
            checks["d46_sql"] = f"not measured: {exc}"
        roots["after"] = REPO_ROOT / "sql"
        sql_changed = _git("status", "--porcelain", "--", "sql", check=False).stdout.strip()
        head = _git("rev-parse", "HEAD", check=False).stdout.strip() or "unknown"
        checks["before_sql"] = f"{before_commit} (git show {BEFORE_COMMIT}:sql/...)"
        checks["after_sql"] = f"working tree sql/ at HEAD {head}" + (
            " with uncommitted changes" if sql_changed else ""
        )
        results, found = measure(settings.base_dsn, roots, rounds=rounds, seconds=seconds)
    checks["privileges"] = found
    figures: dict[str, Any] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    rows: list[Row] = []
    passed = True
    for clients in CLIENT_COUNTS:
        key = f"{clients}_clients"
        for metric in METRICS:
            compared = results[clients][metric]
            baseline[f"{metric}_per_s_before_{key}"] = round(compared.tps("before"), 1)
            for side in roots:
                figures[f"{metric}_per_s_{side}_by_round_{key}"] = [
                    round(r.tps, 1) for r in compared.runs[side]
                ]
                checks[f"{metric}_transactions_{side}_{key}"] = sum(
                    r.transactions for r in compared.runs[side]
                )
            for side in [s for s in roots if s != "before"]:
                per_round = compared.by_round(side)
                figures[f"{metric}_per_s_{side}_{key}"] = round(compared.tps(side), 1)
                figures[f"{metric}_{side}_over_before_by_round_{key}"] = per_round
                ratios[f"{metric}_{side}_{key}" if side != "after" else f"{metric}_{key}"] = round(
                    median(per_round), 3
                )
            ok: bool | None = None
            if clients == TARGET_CLIENTS:
                ok = ratios[f"{metric}_{key}"] >= TARGET_RATIO
                passed = passed and ok
            rows.append(_row(metric, clients, "after", compared, ok, diagnostic=False))
            if "d46" in roots:
                rows.append(_row(metric, clients, "d46", compared, None, diagnostic=True))
    return Result(
        name="privilege_ab",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"admit+complete pairs/s and activations/s on the working tree's SQL (D46 and"
            f" after) >= {TARGET_RATIO} x the same on the SQL of {BEFORE_COMMIT}, at"
            f" {TARGET_CLIENTS} clients"
        ),
        passed=passed,
        rows=rows,
        checks=checks,
        notes=[
            f"databases on one server: 'before' migrated with sql/ of {BEFORE_COMMIT} (the"
            f" parent of {CHANGE_COMMIT}), 'd46' (diagnostic) with sql/ of {CHANGE_COMMIT},"
            " 'after' with the working tree's sql/",
            f"pgbench -M prepared -c C -j C -T {seconds}, {rounds} rounds of the sides back to"
            " back, the order reversed every other round, after 1 s warm-ups; figures are"
            " medians over the rounds, ratios (side / before) the medians of the per-round"
            " ratios",
            "pairs: bench.pairs.PAIR_SCRIPT as ql3_runtime, no policy bound; activations:"
            " bench.activations.DRIVER_SCRIPT as ql3_operator (outbox NOTIFY deferred)",
        ],
    )
