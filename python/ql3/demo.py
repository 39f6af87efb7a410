"""``make demo``: the contract half of ql3, end to end, narrated.

Puts two revisions, activates them, shows the outbox event and the NOTIFY a relay would
receive, refuses a stale compare-and-set, revokes, and shows callers failing closed.
Without --dsn it starts a throwaway PostgreSQL (the SQLite edge default comes later).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg

from ql3 import errors
from ql3.migrate import migrate
from ql3.store import PgStore

PROJECT, FAMILY, CONTRACT = "demo", "policy_routing", "support-bot"


def say(step: str, detail: Any = None) -> None:
    print(f"\n== {step}")
    if detail is not None:
        print(json.dumps(detail, indent=2, sort_keys=True, default=str))


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from ql3.devservers import create_database, start_postgres

    root = Path(tempfile.mkdtemp(prefix="ql3-demo-"))
    server = start_postgres(root)
    try:
        yield create_database(server, "ql3_demo")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def run(dsn: str) -> None:
    applied = migrate(dsn)
    say(f"migrated the core stream ({len(applied)} migrations applied)")

    with PgStore(dsn, max_connections=2) as store, psycopg.connect(dsn, autocommit=True) as relay:
        relay.execute("LISTEN ql3_contract_outbox")
        qwen = {"routes": [{"model": "qwen2.5:7b", "weight": 1}]}
        llama = {"routes": [{"model": "llama3.1:8b", "weight": 1}]}
        v1 = store.put_revision(PROJECT, FAMILY, CONTRACT, qwen, "alice")
        v2 = store.put_revision(PROJECT, FAMILY, CONTRACT, llama, "alice")
        say("put two immutable revisions", {k: v1[k] for k in ("revision_no", "body_hash")})
        print(f"   revision 2 body_hash {v2['body_hash']}")

        event = store.activate_revision(PROJECT, FAMILY, CONTRACT, v1["revision_id"], "alice")
        say("activated revision 1: pointer swapped and outbox row written in one transaction",
            event)  # fmt: skip
        note = next(relay.notifies(timeout=5))
        say("the relay's LISTEN connection got a NOTIFY at COMMIT", json.loads(note.payload))

        try:
            store.activate_revision(PROJECT, FAMILY, CONTRACT, v2["revision_id"], "bob",
                                    expected_active_revision_id=v2["revision_id"])  # fmt: skip
        except errors.Conflict as exc:
            say(f"a stale compare-and-set is refused: {exc.code}")
        quiet = list(relay.notifies(timeout=0.3))
        print(f"   notifications after the refused activation: {len(quiet)}")

        event = store.activate_revision(PROJECT, FAMILY, CONTRACT, v2["revision_id"], "bob",
                                        expected_active_revision_id=v1["revision_id"])  # fmt: skip
        assert event is not None
        say(
            "activated revision 2 with compare-and-set",
            {k: event[k] for k in ("seq", "old_revision_id", "new_revision_id", "pointer_version")},
        )

        event = store.revoke_revision(v2["revision_id"], "carol", "routes to a retired model")
        assert event is not None
        say(
            "revoked revision 2: the pointer is now empty",
            {k: event[k] for k in ("event_type", "new_revision_id", "pointer_version")},
        )
        print(f"   active revision now: {store.active_revision(PROJECT, FAMILY, CONTRACT)}")
        try:
            store.activate_revision(PROJECT, FAMILY, CONTRACT, v2["revision_id"], "carol")
        except errors.RevisionRevoked as exc:
            print(f"   re-activating it is refused: {exc.code}")
        say("outbox backlog a relay would now deliver to Redis", store.outbox_backlog())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ql3-demo", description=__doc__)
    parser.add_argument("--dsn", help="use this PostgreSQL database instead of a throwaway one")
    args = parser.parse_args(argv)
    with database(args.dsn) as dsn:
        run(dsn)
    print("\ndemo finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
