"""``pip install ql3`` with no extras serves the SQLite edge shim, with and without AI, and
loads nothing beyond what it needs (issue 19, part 3; the seed: an edge build without AI
loads no model adapter and no PostgreSQL driver).

The import checks run in a fresh interpreter of this venv, where every extra is installed:
they prove the shim, and the ``ql3`` commands with ``--sqlite``, do not *load* the server
side. The wheel checks install the built wheel into a throwaway venv with no extras: they
prove the shim, the demo and the edge operations commands (``ql3 recover``, ``invocations``,
``resolve`` and ``usage`` with ``--sqlite``, D58) do not *need* it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_invocations_cli import LineReader, fetch

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


ADMIT_EXPIRED = """
import sys
from datetime import UTC, datetime

from ql3.edge import EdgeStore
from ql3.invocations import admission_command, request_digest

store = EdgeStore(sys.argv[1])  # the application creates and migrates its file
run_id = store.create_run("proj", "trace-1")
step = store.add_step_run(run_id, "model")
store.admit_invocation(
    admission_command(
        invocation_id="inv-crashed", request_id="req-crashed", project_id="proj",
        run_id=run_id, step_run_id=step, trace_id="trace-1", expected_step_run_version=1,
        provider="stub", model="m", policy=None, request_digest=request_digest(b"hi"),
        input_bytes=2, deadline_at=datetime(2020, 1, 1, tzinfo=UTC),
    )
)
store.close()
"""
"""An edge file at ``argv[1]``, as an application leaves it when its worker crashes after
admitting ``inv-crashed``: a Start receipt whose deadline has long passed."""

EDGE_COMMANDS = """
import contextlib, io, json, sys

from ql3 import cli

path = sys.argv[1]
for argv in (
    ["recover", "--grace", "0"],
    ["invocations", "list"],
    ["invocations", "list", "--unresolved", "--json"],
    ["invocations", "show", "inv-crashed"],
    ["resolve", "inv-crashed", "--decision", "fail", "--user", "u", "--reason", "r"],
    ["usage", "--project", "proj"],
):
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main([*argv, "--sqlite", path])
    assert code == 0, (argv, code)
print(json.dumps(sorted(sys.modules)))
"""


def test_the_edge_commands_load_no_driver(tmp_path: Path) -> None:
    # ql3.cli and the commands that run with --sqlite, in a fresh interpreter of this
    # venv (every extra installed): none loads a driver, nor ql3's PostgreSQL modules.
    path = tmp_path / "edge.db"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QL3_REDIS_URL")}
    for script, args in ((ADMIT_EXPIRED, [path]), (EDGE_COMMANDS, [path])):
        done = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                              capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    assert {"ql3.cli", "ql3.invocations_cli", "ql3.recovery"} <= set(modules)
    assert loaded(modules, DRIVERS) == []
    assert loaded(modules, SERVER_SIDE) == []
    assert loaded(modules, ("ql3.verify", "ql3.pooler")) == []


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
    # the ql3 commands, on the demo's file (D58)
    r"\$ ql3 recover --grace 0 --sqlite ",
    r"\$ ql3 invocations list --unresolved --sqlite ",
    r"1 of 1 resolved as fail by carol",
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


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the built wheel and rfc8785, nothing else: its ``bin`` directory."""
    root = tmp_path_factory.mktemp("bare")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", root / "dist", REPO_ROOT])  # fmt: skip
    (wheel,) = (root / "dist").glob("ql3-*.whl")
    base = getattr(sys, "_base_executable", None) or sys.executable
    run([base, "-m", "venv", root / "venv"])
    python = root / "venv" / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", wheel, f"rfc8785=={locked_version('rfc8785')}"])

    listed = json.loads(run([python, "-m", "pip", "list", "--format=json"]).stdout)
    names = {re.sub(r"[-_.]+", "-", item["name"]).lower() for item in listed}
    assert "ql3" in names and "rfc8785" in names
    assert names & set(EXTRAS_DISTRIBUTIONS) == set()
    return root / "venv" / "bin"


@pytest.mark.slow
def test_the_wheel_without_extras_runs_the_edge_demo(bare: Path, tmp_path: Path) -> None:
    python = bare / "python"
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
    command = run([bare / "ql3", "ready"], cwd=tmp_path, ok=False)
    assert command.returncode == 2 and "Traceback" not in command.stderr
    assert "pip install 'ql3[postgres]'" in command.stderr


@pytest.mark.slow
def test_the_wheel_without_extras_runs_the_edge_operations_commands(
    bare: Path, tmp_path: Path
) -> None:
    # D58: recover (once and --loop), invocations, resolve and usage with --sqlite need
    # no extra; the commands that need PostgreSQL say which extra to install.
    ql3 = bare / "ql3"
    edge = tmp_path / "edge.db"
    run([bare / "python", "-c", ADMIT_EXPIRED, edge], cwd=tmp_path)

    recovered = json.loads(run([ql3, "recover", "--grace", "0", "--sqlite", edge]).stdout)
    assert recovered["count"] == 1, recovered
    assert [r["invocation_id"] for r in recovered["recovered"]] == ["inv-crashed"]
    queue = json.loads(
        run([ql3, "invocations", "list", "--unresolved", "--sqlite", edge, "--json"]).stdout
    )
    assert [(r["invocation_id"], r["outcome"]) for r in queue] == [("inv-crashed", "lost")]
    shown = json.loads(run([ql3, "invocations", "show", "inv-crashed", "--sqlite", edge]).stdout)
    assert shown["completion"]["result_code"] == "outcome_unknown", shown
    resolved = run([ql3, "resolve", "inv-crashed", "--decision", "fail", "--user", "u",
                    "--reason", "r", "--sqlite", edge])  # fmt: skip
    assert resolved.stdout.startswith("created   inv-crashed"), resolved.stdout
    queue = json.loads(
        run([ql3, "invocations", "list", "--unresolved", "--sqlite", edge, "--json"]).stdout
    )
    assert queue == []
    assert json.loads(run([ql3, "usage", "--project", "proj", "--sqlite", edge]).stdout) == []

    # The daemon without prometheus-client: /healthz is served, /metrics answers 501 and
    # the log says why; SIGTERM ends it with 0.
    run([bare / "python", "-c", ADMIT_EXPIRED, tmp_path / "second.db"], cwd=tmp_path)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("QL3_")
    }
    argv = [ql3, "recover", "--loop", "--grace", "0", "--interval", "0.1", "--metrics-port",
            "0", "--sqlite", tmp_path / "second.db"]  # fmt: skip
    proc = subprocess.Popen([str(a) for a in argv], env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    logs = LineReader(proc.stderr)
    try:
        port = int(logs.until("metrics_listening")["port"])
        assert "prometheus-client is not installed" in logs.until("metrics_not_served")["detail"]
        logs.until("invocation_recovered", invocation_id="inv-crashed")
        status, body = fetch(port, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok", body
        status, body = fetch(port, "/metrics")
        assert status == 501 and "pip install prometheus-client" in body, body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        logs.until("recovery_stopped", recovered=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        logs.close()

    # PostgreSQL's side names the extra: exit 2, no traceback.
    for argv_pg in (["migrate", "--dsn", "postgresql://x/y"],
                    ["recover", "--dsn", "postgresql://x/y"],
                    ["invocations", "list", "--dsn", "postgresql://x/y"]):  # fmt: skip
        refused = run([ql3, *argv_pg], cwd=tmp_path, ok=False)
        assert refused.returncode == 2, (argv_pg, refused.stderr)
        assert "Traceback" not in refused.stderr, refused.stderr
        assert "needs psycopg" in refused.stderr and "pip install 'ql3[postgres]'" in (
            refused.stderr
        ), refused.stderr
