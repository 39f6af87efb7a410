"""The Prometheus rules and the Grafana dashboard users load (deploy/, D57): promtool
accepts the rules, each alert fires on a series that must fire it and stays quiet on one
that must not, and every metric a rule or panel names is one the running daemons export."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fix_invocations import PAST, PROJECT, admission, completion, model_step
from fix_servers import role_dsn
from ql3 import (
    gateway,  # noqa: F401  (registers ql3_gateway_* on the default registry)
    invocations_cli,
)
from ql3.cache import RevisionCache
from ql3.invocations import Outcome
from ql3.recovery import RecoveryConfig, RecoveryLoop
from ql3.relay import Relay, RelayConfig
from ql3.store import PgStore

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "ql3-rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "ql3-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ql3.json"
# Series Prometheus makes itself, not the daemons.
SCRAPE_SERIES = {"up"}
# PromQL words that look like metric names: functions, aggregations, keywords, durations.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "absent", "time", "by",
    "without", "and", "or", "unless", "on", "ignoring", "bool", "vector", "humanizeDuration",
}  # fmt: skip
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.geteuid() != 0:
            pytest.skip(
                "promtool missing (Debian package prometheus; make test installs it as root)"
            )
        pytest.fail("promtool missing: scripts/ensure-system-packages installs it")
    return found


def rule_expressions() -> tuple[list[str], set[str]]:
    """Every rule's expression, and the names the recording rules define."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    return [str(rule["expr"]) for rule in rules], {r["record"] for r in rules if "record" in r}


def panel_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [str(t["expr"]) for panel in dashboard["panels"] for t in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers outside {...}, [...] and
    strings that are not PromQL words or label names of by/without/on clauses."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    return {
        name
        for name in _NAME.findall(text)
        if name not in PROMQL_WORDS and not re.fullmatch(r"[0-9.]+[smhd]?", name)
    }


def exported(text: str) -> set[str]:
    """The series names of a /metrics page: counters as name_total (and _created)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        names.update(sample.name for sample in family.samples)
    return names


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.fixture
def runtime(db_dsn: str) -> Iterator[PgStore]:
    with PgStore(role_dsn(db_dsn, "runtime")) as store:
        yield store


def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_alert_fires_on_its_series_and_stays_quiet_otherwise() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", RULES_TEST.name],
        cwd=RULES_TEST.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    held = {(a["alertname"], bool(a["exp_alerts"])) for t in tests for a in t["alert_rule_test"]}
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert held == {(a, fires) for a in alerts for fires in (True, False)}


def test_the_dashboard_is_json_with_a_promql_target_on_every_panel() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


def test_metric_names_reads_selectors_and_skips_promql_words() -> None:
    assert metric_names('sum by (target) (rate(ql3_relay_failures_total{job="x"}[5m])) > 0.05') == {
        "ql3_relay_failures_total"
    }
    assert metric_names("time() - ql3_recovery_last_run_timestamp_seconds > 300") == {
        "ql3_recovery_last_run_timestamp_seconds"
    }


def test_every_metric_the_rules_and_dashboard_name_is_in_a_live_scrape(
    db_dsn: str, redis_url: str, runtime: PgStore
) -> None:
    # One lost invocation, so that the unresolved gauge has a series, not only its HELP.
    run_id, step = model_step(runtime)
    runtime.admit_invocation(admission(run_id, step, deadline=PAST))
    config = RecoveryConfig(grace_seconds=0, interval=3600, metrics_port=0)
    recovery = RecoveryLoop(role_dsn(db_dsn, "operator"), config, registry=CollectorRegistry())
    recovery.start()
    try:
        recovery.wait_until(lambda r: r.recovered == 1)
        assert recovery.metrics_port is not None
        # The gauge is set after the round that recovered it: wait for that round's end.
        unresolved = f'ql3_invocations_lost_unresolved{{project="{PROJECT}"}} 1.0'
        deadline = time.monotonic() + 10
        while unresolved not in (recovery_page := fetch(recovery.metrics_port)):
            assert time.monotonic() < deadline, recovery_page
            time.sleep(0.05)
    finally:
        recovery.stop()

    async def scrape_relay_and_app() -> tuple[str, str]:
        """The relay's page, and the application's (the default registry: the gateway's
        counter and a running revision cache's gauges) once the cache heard a heartbeat."""
        prefix = f"test:{uuid.uuid4().hex[:10]}"
        relay = Relay(
            RelayConfig(
                dsn=db_dsn,
                redis_url=redis_url,
                channel_prefix=prefix,
                metrics_port=0,
                heartbeat_interval=0.1,
            ),
            registry=CollectorRegistry(),
        )
        cache = RevisionCache(db_dsn, redis_url, channel_prefix=prefix)
        await relay.start()
        try:
            await relay.wait_ready()
            await cache.start()
            while cache.health().last_heartbeat_at is None:
                await asyncio.sleep(0.05)
            assert relay.metrics_port is not None
            return await asyncio.to_thread(fetch, relay.metrics_port), generate_latest().decode()
        finally:
            await cache.close()
            await relay.stop()

    relay_page, app_page = asyncio.run(asyncio.wait_for(scrape_relay_and_app(), 60))
    live = exported(relay_page) | exported(recovery_page) | exported(app_page) | SCRAPE_SERIES
    expressions, recorded = rule_expressions()
    named = set().union(*(metric_names(e) for e in expressions + panel_expressions()))
    assert named - recorded - live == set()


def test_the_unresolved_gauge_counts_by_project_and_drops_a_resolved_project(
    db_dsn: str, runtime: PgStore
) -> None:
    run_id, step = model_step(runtime)
    start = runtime.admit_invocation(admission(run_id, step))
    lost = runtime.complete_invocation(completion(start, Outcome.LOST))
    loop = RecoveryLoop("unused: observe_unresolved is given its store")
    with PgStore(role_dsn(db_dsn, "operator")) as operator:
        loop.observe_unresolved(operator)
        value = loop.registry.get_sample_value
        assert value("ql3_invocations_lost_unresolved", {"project": PROJECT}) == 1
        age = value("ql3_invocations_lost_unresolved_oldest_age_seconds", {"project": PROJECT})
        assert age is not None and age >= 0
        invocations_cli.resolve(
            operator,
            str(lost["completion"]["invocation_id"]),
            decision="fail",
            user_id="alice",
            reason="checked with the provider",
        )
        loop.observe_unresolved(operator)
    assert value("ql3_invocations_lost_unresolved", {"project": PROJECT}) is None
    assert value("ql3_recovery_unresolved_query_errors_total") == 0


def test_a_failing_unresolved_query_is_counted_and_recovery_goes_on(db_dsn: str) -> None:
    loop = RecoveryLoop("unused: observe_unresolved is given its store")
    closed = PgStore(role_dsn(db_dsn, "operator"))
    closed.close()
    loop.observe_unresolved(closed)  # does not raise
    assert loop.registry.get_sample_value("ql3_recovery_unresolved_query_errors_total") == 1


def cache_series(label: str) -> dict[str, float]:
    """The default registry's samples of one revision cache, by metric name."""
    page = generate_latest().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if family.name.startswith("ql3_cache_") and sample.labels.get("cache") == label
    }


def test_a_cache_exports_its_heartbeat_age_and_degrades_when_heartbeats_stop(
    db_dsn: str, redis_url: str
) -> None:
    async def scenario() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        prefix = f"test:{uuid.uuid4().hex[:10]}"
        config = RelayConfig(
            dsn=db_dsn, redis_url=redis_url, channel_prefix=prefix, heartbeat_interval=0.1
        )
        relay = Relay(config, registry=CollectorRegistry())
        cache = RevisionCache(db_dsn, redis_url, channel_prefix=prefix, heartbeat_timeout=0.5)
        label = cache.metrics_label
        await relay.start()
        try:
            await relay.wait_ready()
            await cache.start()
            while cache.mode != "normal":
                await asyncio.sleep(0.05)
            hearing = cache_series(label)
            await relay.stop()
            await asyncio.sleep(1.2)
            silent = cache_series(label)
        finally:
            await cache.close()
            await relay.stop()
        return hearing, silent, cache_series(label)

    hearing, silent, closed = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert hearing["ql3_cache_degraded"] == 0.0
    assert 0.0 <= hearing["ql3_cache_heartbeat_age_seconds"] < 0.5
    assert silent["ql3_cache_degraded"] == 1.0
    assert silent["ql3_cache_heartbeat_age_seconds"] >= 1.0
    assert closed == {}, "a closed cache exports nothing"
