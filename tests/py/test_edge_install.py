"""``pip install ql3`` with no extras serves the SQLite edge shim, with and without AI, and
loads nothing beyond what it needs (issue 19, part 3; the seed: an edge build without AI
loads no model adapter and no PostgreSQL driver).

The import checks run in a fresh interpreter of this venv, where every extra is installed:
they prove the shim does not *load* the server side. The wheel check installs the built
wheel into a throwaway venv with no extras: it proves the shim and the demo do not *need*
it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

DRIVERS = ("psycopg", "psycopg_pool", "redis", "hiredis", "httpx", "prometheus_client")
"""Top-level modules of the extras: the edge shim loads none of them, with AI or without."""

MODEL_ADAPTERS = ("ql3.providers", "ql3.gateway", "ql3.edge.invocations", "ql3.stub_provider")
"""ql3's model-invocation modules: an edge store without AI loads none of them."""

SERVER_SIDE = ("ql3.store", "ql3.store_async", "ql3.db", "ql3.migrate", "ql3.relay", "ql3.cache")
"""ql3's PostgreSQL and Redis modules, which import the drivers."""

CHILD = """
import json, sys, tempfile
from pathlib import Path

ai = sys.argv[1] == "ai"
import ql3.edge
from ql3.edge import EdgeStore

with tempfile.TemporaryDirectory() as tmp:
    store = EdgeStore(Path(tmp) / "edge.db", ai=ai)
    put = store.put_revision("p", "policy_routing", "bot", {"routes": [{"model": "m"}]}, "me")
    event = store.activate_revision("p", "policy_routing", "bot", put["revision_id"], "me")
    active = store.active_revision("p", "policy_routing", "bot")
    assert event is not None and active is not None, (event, active)
    assert active["revision_id"] == put["revision_id"], (active, put)
    assert active["body"] == {"routes": [{"model": "m"}]}, active
    if ai:  # the AI side of the shim: the invocation tables and the gateway's types
        import ql3.gateway
        assert store.usage_summary("p") == []
    store.close()
print(json.dumps(sorted(sys.modules)))
"""


def modules_after_round_trip(ai: bool) -> list[str]:
    """``sorted(sys.modules)`` of a fresh interpreter after an EdgeStore round trip."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QL3_REDIS_URL")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "ai" if ai else "no-ai"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    return modules


def loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


def test_an_edge_store_without_ai_loads_no_driver_and_no_model_adapter() -> None:
    modules = modules_after_round_trip(ai=False)
    assert "ql3.edge.store" in modules
    assert loaded(modules, DRIVERS) == []
    assert loaded(modules, MODEL_ADAPTERS) == []
    assert loaded(modules, SERVER_SIDE) == []


def test_an_edge_store_with_ai_and_the_gateway_loads_no_driver() -> None:
    modules = modules_after_round_trip(ai=True)
    assert {"ql3.edge.invocations", "ql3.gateway"} <= set(modules)
    assert loaded(modules, DRIVERS) == []
    assert loaded(modules, SERVER_SIDE) == []
    assert loaded(modules, ("ql3.providers", "ql3.stub_provider")) == []


def test_pgstore_is_still_importable_from_the_package() -> None:
    from ql3 import PgStore
    from ql3.store import PgStore as Defined

    assert PgStore is Defined


# -- the wheel, installed with no extras ----------------------------------------------------

EXTRAS_DISTRIBUTIONS = (
    "psycopg",
    "psycopg-binary",
    "psycopg-pool",
    "redis",
    "hiredis",
    "httpx",
    "prometheus-client",
)

DEMO_STORY = [
    r"== store: SQLite \(wal\)",
    r"provider: an in-process stand-in for the stub HTTP server \(httpx is not installed",
    r"the relay delivered outbox seq \d+ and the worker cache reloaded revision 2",
    r"succeeded v3 attempt 1 result_code=ok",
    r"failed v3 attempt 1 result_code=provider_http_503",
    r"timed_out v3 attempt 1 result_code=deadline_exceeded",
    r"lost v3 attempt 1 result_code=outcome_unknown",
    r"a new invocation on the same step succeeds: attempt 2",
    r"demo finished",
]


def locked_version(name: str) -> str:
    found = re.search(
        rf"^{re.escape(name)}==(\S+)", (REPO_ROOT / "requirements" / "dev.txt").read_text(), re.M
    )
    assert found is not None, name
    return found[1]


def run(
    args: list[str | Path], *, cwd: Path | None = None, ok: bool = True
) -> subprocess.CompletedProcess[str]:
    """``args`` outside this venv's settings (no PYTHONPATH, VIRTUAL_ENV or QL3_*)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("QL3_")
    }
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )
    if ok:
        assert done.returncode == 0, f"{args}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow
def test_the_wheel_without_extras_runs_the_edge_demo(tmp_path: Path) -> None:
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", tmp_path / "dist", REPO_ROOT])  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("ql3-*.whl")
    base = getattr(sys, "_base_executable", None) or sys.executable
    run([base, "-m", "venv", tmp_path / "venv"])
    python = tmp_path / "venv" / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", wheel, f"rfc8785=={locked_version('rfc8785')}"])

    listed = json.loads(run([python, "-m", "pip", "list", "--format=json"]).stdout)
    names = {re.sub(r"[-_.]+", "-", item["name"]).lower() for item in listed}
    assert "ql3" in names and "rfc8785" in names
    assert names & set(EXTRAS_DISTRIBUTIONS) == set()

    demo = run([python, "-m", "ql3.demo"], cwd=tmp_path)
    position = 0
    for line in DEMO_STORY:
        found = re.compile(line).search(demo.stdout, position)
        assert found is not None, f"missing, or out of order: {line}\n{demo.stdout}"
        position = found.end()

    # The server side says what to install instead of failing on an import.
    refused = run([python, "-m", "ql3.demo", "--dsn", "postgresql://x/y"], cwd=tmp_path, ok=False)
    assert refused.returncode == 2
    assert "pip install 'ql3[all]'" in refused.stderr
    missing = run([python, "-c", "from ql3 import PgStore"], cwd=tmp_path, ok=False)
    assert missing.returncode == 1
    assert "pip install 'ql3[postgres]'" in missing.stderr
    command = run([tmp_path / "venv" / "bin" / "ql3", "ready"], cwd=tmp_path, ok=False)
    assert command.returncode == 2 and "Traceback" not in command.stderr
    assert "pip install 'ql3[postgres]'" in command.stderr
