"""``python -m bench [--only NAME]... [--quick] [--results PATH]``: run the benchmarks.

Uses ``QL3_TEST_DSN`` (superuser) and ``QL3_TEST_REDIS_URL`` when set, otherwise starts
throwaway servers with PostgreSQL's durable defaults (fsync and synchronous_commit on, as
in production; the tests run with them off). Writes ``bench/results/latest.json`` and the
table in ``bench/README.md`` (only the JSON when ``--results`` names another file, unless
``--readme`` is given too).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import (
    activations,
    cache_reads,
    durable_call,  # issue 23: durable model calls as a Python application makes them, vs DBOS
    edge_pairs,
    gateway_overhead,
    pairs,
    prepared,  # issue 21: what the pooler-safe default (no prepared statements) costs
    privilege_ab,  # issue 20: the cost of D46's privilege switch, A/B
    propagation,
    relay_drain,
)
from bench.common import REPO_ROOT, Result, Settings, machine_info, now_rfc3339
from ql3.devservers import test_servers

BENCHMARKS: Mapping[str, Callable[[Settings], Result]] = {
    "activations": activations.run,
    "relay_drain": relay_drain.run,
    "propagation": propagation.run,
    "cache_reads": cache_reads.run,
    "pairs": pairs.run,
    "durable_call": durable_call.run,
    "edge_pairs": edge_pairs.run,
    "gateway_overhead": gateway_overhead.run,
    "prepared": prepared.run,
    # A/B of the SQL before and after D46 (issue 20), in one run on one server.
    "privilege_ab": privilege_ab.run,
}

DEFAULT_RESULTS = REPO_ROOT / "bench" / "results" / "latest.json"
DEFAULT_README = REPO_ROOT / "bench" / "README.md"
START_MARK = "<!-- bench-results:start -->"
END_MARK = "<!-- bench-results:end -->"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        help="run only this benchmark (repeatable); results of the others are kept",
    )
    parser.add_argument("--quick", action="store_true", help="short durations: a smoke run")
    parser.add_argument("--results", type=Path, help=f"JSON output (default {DEFAULT_RESULTS})")
    parser.add_argument("--readme", type=Path, help="markdown file whose table is rewritten")
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite any README")
    return parser.parse_args(argv)


def run_all(names: Sequence[str], settings: Settings) -> tuple[dict[str, Any], bool]:
    """Each benchmark's result document, and whether all of them ran."""
    docs: dict[str, Any] = {}
    ok = True
    for name in names:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            result = BENCHMARKS[name](settings)
        except Exception as exc:
            traceback.print_exc()
            ok = False
            docs[name] = {"measured_at": now_rfc3339(), "error": f"{type(exc).__name__}: {exc}"}
            continue
        result.seconds = time.monotonic() - started
        docs[name] = result.as_dict()
        for row in result.rows:
            print(
                f"  {row.label}: {row.figure} | baseline {row.baseline} | ratio {row.ratio}"
                f" | {row.target} -> {row.result}",
                file=sys.stderr,
                flush=True,
            )
    return docs, ok


def merged(path: Path, fresh: dict[str, Any], partial: bool) -> dict[str, Any]:
    """With ``--only``, keep the other benchmarks' results already in the file."""
    if not partial or not path.exists():
        return fresh
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return fresh
    kept = {k: v for k, v in old.get("benchmarks", {}).items() if k in BENCHMARKS}
    kept.update(fresh)
    return {name: kept[name] for name in BENCHMARKS if name in kept}


def _partial_note(doc: Mapping[str, Any]) -> str:
    """With ``--only``: which benchmarks this run measured (the other rows are older)."""
    run = [name for name in doc.get("benchmarks_run", []) if name in doc["benchmarks"]]
    if not run or set(run) == set(doc["benchmarks"]):
        return ""
    return f" This run measured only {', '.join(run)}; the other rows are kept from earlier runs."


def markdown_table(doc: Mapping[str, Any]) -> str:
    machine = doc["machine"]
    lines = [
        f"Measured {doc['generated_at']} on {machine['nproc']} cores ({machine['cpu']}), "
        f"PostgreSQL {machine['postgresql']}, Redis {machine['redis']}"
        + (" — **quick smoke run, not representative**" if doc.get("quick") else "")
        + f"; this run took {doc['run_seconds']:.0f} s; 1-minute load average "
        f"{machine['load_average_at_start'][0]} at start, {machine['load_average_at_end'][0]} "
        "at end." + _partial_note(doc),
        "",
        "| Benchmark | Figure | Baseline (same run) | Ratio | Target | Result |",
        "| --- | --- | --- | ---: | --- | --- |",
    ]
    for name, bench in doc["benchmarks"].items():
        if "error" in bench:
            lines.append(f"| {name} | error: {bench['error']} | | | | fail |")
            continue
        for row in bench["rows"]:
            ratio = "" if row["ratio"] is None else f"{row['ratio']:.3g}"
            lines.append(
                f"| {row['label']} | {row['figure']} | {row['baseline']} | {ratio} "
                f"| {row['target']} | {row['result']} |"
            )
    return "\n".join(lines)


def rewrite_readme(path: Path, table: str) -> None:
    text = path.read_text() if path.exists() else ""
    block = f"{START_MARK}\n{table}\n{END_MARK}"
    if START_MARK in text and END_MARK in text:
        head, rest = text.split(START_MARK, 1)
        tail = rest.split(END_MARK, 1)[1]
        text = f"{head}{block}{tail}"
    else:
        text = f"{text.rstrip()}\n\n{block}\n" if text else f"{block}\n"
    path.write_text(text)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ql3.cache").setLevel(logging.ERROR)  # degraded mode is on purpose here
    names = args.only or list(BENCHMARKS)
    results_path: Path = args.results or DEFAULT_RESULTS
    readme: Path | None = args.readme
    if readme is None and args.results is None:
        readme = DEFAULT_README
    if args.no_readme:
        readme = None
    started = time.monotonic()
    with test_servers(durable=True) as (dsn, redis_url):
        settings = Settings(base_dsn=dsn, redis_url=redis_url, quick=args.quick)
        machine = machine_info(settings)
        docs, ok = run_all(names, settings)
    doc: dict[str, Any] = {
        "generated_at": now_rfc3339(),
        "quick": args.quick,
        "run_seconds": round(time.monotonic() - started, 1),
        "benchmarks_run": names,
        "machine": machine,
        "benchmarks": merged(results_path, docs, partial=bool(args.only)),
    }
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"bench: wrote {results_path}", file=sys.stderr)
    if readme is not None:
        rewrite_readme(readme, markdown_table(doc))
        print(f"bench: rewrote the table in {readme}", file=sys.stderr)
    print(f"bench: done in {doc['run_seconds']:.0f} s", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
