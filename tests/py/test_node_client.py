"""The Node.js client test (tests/clients/node) against a fresh, migrated database.

It runs ``node --test`` in that folder with the DSNs it reads (QL3_NODE_DSN for the
superuser, one per least-privilege login: QL3_NODE_OPERATOR_DSN, QL3_NODE_RUNTIME_DSN,
QL3_NODE_RELAY_DSN, QL3_NODE_READER_DSN) and requires exit code 0. Its packages come from
``npm ci`` (``make test`` runs it); without them this test fails and says so, rather than
skipping, so a run that never exercised the Node client cannot pass as one that did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

from fix_servers import role_dsn

NODE_DIR = Path(__file__).resolve().parents[1] / "clients" / "node"
ROLE_ENV = {
    "operator": "QL3_NODE_OPERATOR_DSN",
    "runtime": "QL3_NODE_RUNTIME_DSN",
    "relay": "QL3_NODE_RELAY_DSN",
    "reader": "QL3_NODE_READER_DSN",
}


def node_url(dsn: str) -> str:
    """A libpq DSN (key=value or URI) as the postgresql:// URL node-postgres parses.

    node-postgres reads URLs only; a socket directory as host is percent-encoded, which
    its parser takes for a socket path."""
    params = conninfo_to_dict(dsn)
    user = quote(str(params.get("user", "postgres")), safe="")
    password = params.get("password")
    auth = f"{user}:{quote(str(password), safe='')}" if password else user
    host = quote(str(params.get("host", "127.0.0.1")), safe="")
    port = params.get("port", "5432")
    dbname = quote(str(params["dbname"]), safe="")
    return f"postgresql://{auth}@{host}:{port}/{dbname}"


def test_node_postgres_client_runs_the_documented_flow(db_dsn: str) -> None:
    node = shutil.which("node")
    assert node, "no node on PATH: make test installs Node.js (scripts/ensure-system-packages)"
    assert (NODE_DIR / "node_modules" / "pg").is_dir(), (
        f"{NODE_DIR / 'node_modules'} is missing: run `make test` (it runs `npm ci` in "
        f"{NODE_DIR.relative_to(NODE_DIR.parents[2])}) or `npm ci` there yourself"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("QL3_NODE_")}
    env["QL3_NODE_DSN"] = node_url(db_dsn)
    for role, name in ROLE_ENV.items():
        env[name] = node_url(role_dsn(db_dsn, role))
    done = subprocess.run(
        [node, "--test"],
        cwd=NODE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"node --test exited {done.returncode}\n"
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
