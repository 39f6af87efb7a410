"""``ql3 prune``: remove delivered contract outbox rows older than a retention (D55, D65).

Each batch is one ``prune_outbox(delivered_before, batch)`` call, its own transaction: it
deletes at most ``batch`` delivered rows whose ``delivered_at`` is older than
``now - delivered_before``, oldest seq first. It never removes an undelivered row, nor a
pointer's newest row (``ql3 verify`` checks each pointer against it). On PostgreSQL
(``ql3.prune_outbox``) it skips rows a relay holds (``FOR UPDATE SKIP LOCKED``): a prune
neither waits on a relay nor changes its claim order. With ``--sqlite`` it prunes an edge
device's file the same way (D65). Batches repeat until one removes fewer than ``batch``
rows; the total is printed as JSON. The ledgers (receipts, usage, run events, mutations)
are never pruned.

After a prune, take a new ``ql3 verify`` snapshot: the removed rows are missing from the
old one (D50).
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ql3 import arguments, errors
from ql3.cli import add_dsn_or_sqlite, open_any_store, print_json

if TYPE_CHECKING:  # imported on use: ``ql3.recovery`` imports this module on a bare install
    from ql3.edge import EdgeStore
    from ql3.store import PgStore

#: The SQL function's bounds of one batch.
MAX_BATCH = arguments.PRUNE_MAX_BATCH
DEFAULT_BATCH = 10_000
#: ``ql3 prune``'s bound on one batch (one DELETE of up to ``batch`` rows); with
#: ``--sqlite``, how long a batch waits for the file's write lock.
DEFAULT_STATEMENT_TIMEOUT_SECONDS = 60.0


def prune(
    store: PgStore | EdgeStore,
    delivered_before: timedelta,
    batch: int = DEFAULT_BATCH,
    *,
    max_batches: int | None = None,
) -> int:
    """Batches until one removes fewer than ``batch`` rows (or ``max_batches`` ran): the
    total removed."""
    total = 0
    done = 0
    while True:
        removed = store.prune_outbox(delivered_before, batch)
        total += removed
        done += 1
        if removed < batch or (max_batches is not None and done >= max_batches):
            return total


def command(args: argparse.Namespace) -> int:
    """``ql3 prune``: prune the outbox, print ``{"removed": n}``."""
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    try:
        arguments.check_count("--batch", batch, 1, MAX_BATCH)
        arguments.check_seconds("statement_timeout", args.statement_timeout, most=86400.0)
    except errors.InvalidArgument as exc:
        raise errors.Misconfigured(exc.message) from None
    with open_any_store(args, time_limit=args.statement_timeout) as store:
        removed = prune(store, args.delivered_before, batch)
    print_json(
        {"removed": removed, "delivered_before_seconds": args.delivered_before.total_seconds()}
    )
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``prune`` to ``ql3``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "prune",
        help="remove delivered contract outbox rows older than a retention (D55)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = parser.add_argument
    add_dsn_or_sqlite(parser, "PostgreSQL conninfo of a ql3_operator member (default: $QL3_DSN)")
    a(
        "--delivered-before",
        type=arguments.duration_type,
        required=True,
        help="remove rows delivered longer ago than this: 30s, 10m, 2h, 7d, 1w",
    )
    a("--batch", type=int, help=f"rows per batch, 1..{MAX_BATCH} (default {DEFAULT_BATCH})")
    a(
        "--statement-timeout",
        type=float,
        default=DEFAULT_STATEMENT_TIMEOUT_SECONDS,
        help="seconds one batch may run in the database; with --sqlite, how long it waits "
        f"for the file's write lock (default {DEFAULT_STATEMENT_TIMEOUT_SECONDS:g})",
    )
    parser.set_defaults(func=command)
    return parser
