"""``python -m bench --quick`` produces its figures (speed itself is never a timed test)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def quick_bench(base_dsn: str, redis_url: str, tmp_path: Path, *names: str) -> dict[str, Any]:
    """``python -m bench --quick --only NAME...`` on the test servers; its results document."""
    results = tmp_path / "latest.json"
    env = dict(os.environ, QL3_TEST_DSN=base_dsn, QL3_TEST_REDIS_URL=redis_url)
    only = [arg for name in names for arg in ("--only", name)]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", *only, "--results", str(results)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(results.read_text())
    return doc


def test_quick_bench_run_reports_activations_and_relay_drain_with_baselines(
    base_dsn: str, redis_url: str, tmp_path: Path
) -> None:
    doc = quick_bench(base_dsn, redis_url, tmp_path, "activations", "relay_drain")
    assert doc["machine"]["nproc"] >= 1
    assert doc["machine"]["postgresql"].startswith("15")
    benches = doc["benchmarks"]
    assert set(benches) == {"activations", "relay_drain"}

    act = benches["activations"]
    for clients in (8, 1):
        assert positive(act["figures"][f"activations_per_s_{clients}_clients"])
        assert positive(act["baseline"][f"pgbench_insert_tps_{clients}_clients"])
        assert positive(act["ratio"][f"{clients}_clients"])
        assert positive(
            act["figures"][f"activations_notify_in_transaction_per_s_{clients}_clients"]
        )
        # The floor (D42): its runs wrote one outbox row per transaction too (checked by
        # the benchmark, which raises otherwise) and report a ratio of their own.
        assert positive(act["figures"][f"floor_writes_per_s_{clients}_clients"])
        assert positive(act["ratio"][f"floor_{clients}_clients"])
        assert act["checks"][f"floor_transactions_{clients}_clients"] > 0
        # The function floor (D61), and the driver's activations against the floor.
        assert positive(act["figures"][f"function_floor_writes_per_s_{clients}_clients"])
        assert act["checks"][f"function_floor_transactions_{clients}_clients"] > 0
        assert positive(act["ratio"][f"function_floor_over_floor_{clients}_clients"])
        assert positive(act["ratio"][f"driver_over_floor_{clients}_clients"])
    assert isinstance(act["pass"], bool)

    drain = benches["relay_drain"]
    assert positive(drain["figures"]["relay_events_per_s"])
    assert positive(drain["baseline"]["raw_publish_per_s"])
    assert positive(drain["ratio"]["relay_over_raw_publish"])
    assert drain["checks"]["outbox_undelivered_after"] == 0
    assert drain["checks"]["subscriber_received_relay"] == drain["figures"]["events"]
    assert isinstance(drain["pass"], bool)


def test_quick_pairs_run_reports_tpcb_ratio_and_dbos_measured_or_why_not(
    base_dsn: str, redis_url: str, tmp_path: Path
) -> None:
    pairs = quick_bench(base_dsn, redis_url, tmp_path, "pairs")["benchmarks"]["pairs"]
    for clients in (1, 8):
        assert positive(pairs["figures"][f"pairs_per_s_{clients}_clients"])
        assert positive(pairs["baseline"][f"pgbench_tpcb_like_tps_{clients}_clients"])
        assert pairs["checks"][f"completions_written_{clients}_clients"] > 0
        by_round = pairs["figures"][f"pairs_over_tpcb_by_round_{clients}_clients"]
        assert len(by_round) == 1 and positive(by_round[0])  # --quick: one round
        assert pairs["ratio"][f"{clients}_clients"] == by_round[0]
        assert positive(pairs["figures"][f"floor_pairs_per_s_{clients}_clients"])
        assert pairs["checks"][f"floor_completions_written_{clients}_clients"] > 0
        floor_by_round = pairs["figures"][f"floor_over_tpcb_by_round_{clients}_clients"]
        assert len(floor_by_round) == 1 and positive(floor_by_round[0])
        # The function floor (D61) wrote pairs too, and both it and the pairs are set
        # against the floor of the same round.
        assert positive(pairs["figures"][f"function_floor_pairs_per_s_{clients}_clients"])
        assert pairs["checks"][f"function_floor_completions_written_{clients}_clients"] > 0
        for side in ("function_floor", "pairs"):
            over = pairs["figures"][f"{side}_over_floor_by_round_{clients}_clients"]
            assert len(over) == 1 and positive(over[0])
            assert pairs["ratio"][f"{side}_over_floor_{clients}_clients"] == over[0]
    judged = [row for row in pairs["rows"] if "against their floor, 8 clients" in row["label"]]
    assert [row["target"] for row in judged] == ["ratio >= 0.85"]
    # The floor was checked to write what a pair writes; per pair:
    per_pair = pairs["checks"]["floor_changes_per_pair_as_pairs"]
    assert per_pair["ql3_ai.model_invocation_starts rows"] == 1
    assert per_pair["ql3_ai.model_invocation_completions rows"] == 1
    assert per_pair["ql3_ai.usage_ledger rows"] == 1
    assert per_pair["ql3.run_events rows"] == 2
    assert per_pair["ql3.step_run_mutations rows"] == 2
    assert per_pair["ql3.step_runs succeeded"] == 1
    assert positive(per_pair["ql3_ai.model_invocation_starts bytes"])
    assert isinstance(pairs["pass"], bool)
    dbos_rows = [row for row in pairs["rows"] if "vs DBOS" in row["label"]]
    assert len(dbos_rows) == 2
    if importlib.util.find_spec("dbos") is None:
        # Not installed here (the `bench` extra): the row says so instead of failing the run.
        for row in dbos_rows:
            assert row["baseline"].startswith("DBOS not measured: ")
            assert row["ratio"] is None
    else:
        for clients in (1, 8):
            assert positive(pairs["baseline"][f"dbos_one_step_workflows_per_s_{clients}_clients"])
            assert positive(pairs["ratio"][f"pairs_over_dbos_{clients}_clients"])
            assert pairs["checks"][f"dbos_workflows_{clients}_clients"] > 0
            by_round = pairs["figures"][f"pairs_over_dbos_by_round_{clients}_clients"]
            assert len(by_round) == 1 and positive(by_round[0])


def test_quick_durable_call_run_reports_calls_per_s_and_dbos_measured_or_why_not(
    base_dsn: str, redis_url: str, tmp_path: Path
) -> None:
    calls = quick_bench(base_dsn, redis_url, tmp_path, "durable_call")["benchmarks"]
    durable = calls["durable_call"]
    # This ql3 starts a run in its admission (ModelCall.in_new_run, D59): that path is the
    # judged one, and create_run + add_step_run + invoke a diagnostic row beside it.
    assert durable["figures"]["judged_side"] == "new_run"
    sides = ("new_run", "four_transactions", "precreated")
    for clients in (1, 8):
        key = f"{clients}_callers"
        for side in sides:
            assert positive(durable["figures"][f"{side}_calls_per_s_{key}"])
            assert durable["checks"][f"{side}_calls_{key}"] > 0
        # CPU per call of this process (and of PostgreSQL, where /proc shows it).
        assert positive(durable["figures"][f"new_run_client_cpu_us_per_call_{key}"])
    # Every call made (warm-ups included) left its Start and its succeeded Completion.
    assert durable["checks"]["starts"] == durable["checks"]["ql3_calls"]
    assert durable["checks"]["succeeded_completions"] == durable["checks"]["ql3_calls"]
    rows = durable["rows"]
    assert len(rows) == 2 * (len(sides) + 1)  # and one CPU row per caller count
    judged = [row for row in rows if row["target"] != "(diagnostic)"]
    assert [row["label"] for row in judged] == [
        f"durable model call/s, {c}, gateway on AsyncPgStore, new run each call"
        for c in ("1 caller", "8 callers")
    ]
    if importlib.util.find_spec("dbos") is None:
        for row in rows:
            if row["label"].startswith("CPU per durable call"):
                continue
            assert row["baseline"].startswith("DBOS not measured: ")
            assert row["ratio"] is None and row["result"] == "n/a"
        assert durable["pass"] is None
    else:
        for clients in (1, 8):
            key = f"{clients}_callers"
            assert positive(durable["baseline"][f"dbos_workflows_per_s_{key}"])
            assert durable["checks"][f"dbos_workflows_{key}"] > 0
            for side in sides:
                by_round = durable["figures"][f"{side}_over_dbos_by_round_{key}"]
                assert len(by_round) == 1 and positive(by_round[0])  # --quick: one round
                assert durable["ratio"][f"{side}_over_dbos_{key}"] == by_round[0]
        assert all(row["result"] in ("pass", "fail") for row in judged)
        assert isinstance(durable["pass"], bool)


def test_a_durable_call_dbos_run_that_fails_marks_the_side_not_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench import dbos_pairs, durable_call

    calls: list[int] = []

    def measure(base_dsn: str, callers: int, seconds: float) -> dict[str, Any]:
        calls.append(callers)
        if len(calls) == 2:
            raise dbos_pairs.NotMeasured("the DBOS child crashed")
        return {"per_s": 20.0, "workflows": 40}

    monkeypatch.setattr(dbos_pairs, "available", lambda: None)
    monkeypatch.setattr(durable_call, "dbos_measure", measure)
    dbos = durable_call.DbosSide("postgresql://unused")
    first, second, third = (dbos.run(8, 2.0) for _ in range(3))
    assert first == durable_call.Sample(20.0, 40) and second is None and third is None
    assert calls == [8, 8]  # no run after the failure
    assert dbos.reason == "the DBOS child crashed"


def test_quick_run_of_the_other_benchmarks_reports_their_figures_and_checks(
    base_dsn: str, redis_url: str, tmp_path: Path
) -> None:
    names = ("propagation", "cache_reads", "edge_pairs", "gateway_overhead")
    benches = quick_bench(base_dsn, redis_url, tmp_path, *names)["benchmarks"]
    assert set(benches) == set(names)

    prop = benches["propagation"]
    assert prop["figures"]["workers"] == 100
    for side, key in (("figures", "p99_ms"), ("baseline", "raw_p99_ms")):
        assert positive(prop[side][key])
    assert positive(prop["baseline"]["raw_reader_p99_ms"])  # the floor of D42
    over_floor = prop["ratio"]["p99_over_floor"]  # judged against the floor (D61)
    assert positive(over_floor)
    (judged,) = [row for row in prop["rows"] if "against its floor" in row["label"]]
    assert judged["target"] == "ratio <= 1.25"
    assert judged["result"] == ("pass" if over_floor <= 1.25 else "fail")
    assert isinstance(prop["pass"], bool)

    reads = benches["cache_reads"]
    assert positive(reads["figures"]["hits"]) and positive(reads["figures"]["hit_p50_us"])
    assert reads["checks"]["round_trips_during_hits"] == 0
    assert reads["checks"]["verifications_during_verified_reads"] > 0

    edge = benches["edge_pairs"]
    for mode in ("wal", "delete"):
        assert positive(edge["figures"][f"pairs_per_s_{mode}"])
        assert positive(edge["baseline"][f"sqlite_insert_commits_per_s_{mode}"])
        assert edge["checks"][f"pairs_{mode}"] > 0

    gateway = benches["gateway_overhead"]
    for kind in ("asyncio", "threads"):
        for clients in (1, 8):
            key = f"{kind}_{clients}_clients"
            # --quick: 200 calls a side, in two rounds; every call succeeded (the benchmark
            # raises on any other outcome).
            assert gateway["checks"][f"gateway_calls_{key}"] == 200
            assert gateway["checks"][f"baseline_pairs_{key}"] == 200
            for pct in ("p50", "p99"):
                assert positive(gateway["figures"][f"gateway_{pct}_ms_{key}"])
                assert positive(gateway["baseline"][f"pair_{pct}_ms_{key}"])
                assert len(gateway["figures"][f"overhead_{pct}_ms_by_round_{key}"]) == 2
    judged = [row for row in gateway["rows"] if row["result"] != "n/a"]
    assert len(judged) == 4 and all("AsyncPgStore" in row["label"] for row in judged)
    assert isinstance(gateway["pass"], bool)
    # The baseline binds the gateway's policy; the pair without one shows the fence's cost
    # (on AsyncPgStore only). The benchmark counted the starts of each kind (it raises
    # when they differ from the calls made, warm-ups included).
    for clients in (1, 8):
        key = f"asyncio_{clients}_clients"
        assert gateway["checks"][f"unfenced_pairs_{key}"] == 200
        assert positive(gateway["baseline"][f"unfenced_pair_p50_ms_{key}"])
        assert isinstance(gateway["figures"][f"policy_fence_p50_ms_{key}"], float)
    warm_ups = 20 * (1 + 8)  # per side and store kind
    assert gateway["checks"]["starts_without_policy"] == 2 * 200 + warm_ups
    assert gateway["checks"]["starts_with_policy"] == 2 * 2 * (2 * 200 + warm_ups)


def test_alternating_rounds_reverse_the_order_every_other_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.common import alternating

    calls: list[str] = []

    def side(name: str) -> Callable[[], str]:
        def once() -> str:
            calls.append(name)
            return f"{name}{len(calls)}"

        return once

    runs = alternating({"a": side("a"), "b": side("b"), "c": side("c")}, 3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert runs == {"a": ["a1", "a6", "a7"], "b": ["b2", "b5", "b8"], "c": ["c3", "c4", "c9"]}


def test_the_pairs_floor_check_refuses_a_floor_that_writes_other_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench import pairs
    from bench.common import PgbenchRun

    pair = PgbenchRun(clients=1, seconds=1.0, transactions=10, failed=0, tps=10.0)
    floor = PgbenchRun(clients=1, seconds=1.0, transactions=20, failed=0, tps=20.0)
    real = {"ql3.run_events rows": 20, "ql3.run_events bytes": 8480}
    same = {"ql3.run_events rows": 40, "ql3.run_events bytes": 16962}  # 2 bytes off in all
    assert pairs._check_floor(pair, real, floor, same) == {
        "ql3.run_events rows": 2,
        "ql3.run_events bytes": 848,
    }
    fewer = {"ql3.run_events rows": 20, "ql3.run_events bytes": 8480}
    with pytest.raises(RuntimeError, match="run_events rows: pairs 2 floor 1 per pair"):
        pairs._check_floor(pair, real, floor, fewer)
    smaller = {"ql3.run_events rows": 40, "ql3.run_events bytes": 16000}
    with pytest.raises(RuntimeError, match="run_events bytes: pairs 848 floor 800 per pair"):
        pairs._check_floor(pair, real, floor, smaller)


def test_a_dbos_round_that_cannot_be_measured_marks_the_side_not_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench import dbos_pairs, pairs

    calls: list[int] = []

    def measure(base_dsn: str, clients: list[int], seconds: float) -> dict[int, Any]:
        calls.append(clients[0])
        if len(calls) == 2:
            raise dbos_pairs.NotMeasured("the DBOS child crashed")
        return {clients[0]: dbos_pairs.DbosRun(clients[0], seconds, 40, 20.0)}

    monkeypatch.setattr(dbos_pairs, "available", lambda: None)
    monkeypatch.setattr(dbos_pairs, "measure", measure)
    dbos = pairs._Dbos("postgresql://unused")
    first, second, third = (dbos.run(8, 2) for _ in range(3))
    assert first == pairs._Sample(20.0, 40) and second is None and third is None
    assert calls == [8, 8]  # no run after the failure
    assert dbos.reason == "the DBOS child crashed"
    assert pairs._every_round([first, second]) is None
    assert pairs._every_round([first, first]) == [first, first]


def test_dbos_baseline_reports_why_it_is_not_measured_when_dbos_is_missing(
    base_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench import dbos_pairs

    monkeypatch.setattr(dbos_pairs, "PACKAGE", "ql3_no_such_package")
    with pytest.raises(dbos_pairs.NotMeasured, match="not installed"):
        dbos_pairs.measure(base_dsn, [1], 1.0)
