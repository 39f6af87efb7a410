"""The ``ql3 invocations``, ``ql3 resolve`` and ``ql3 usage`` commands, and the small read
queries behind them.

Writes go through the store (``resolve_invocation``, the SQL function). The reads here
select from the ``ql3_ai`` receipt tables directly, which ``ql3_reader``, ``ql3_operator``
and ``ql3_runtime`` may all do; they are operator views, not part of the store interface.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from psycopg.rows import dict_row

from ql3 import errors
from ql3.cli import open_store, print_json
from ql3.invocations import Decision, parse_timestamp, resolution_command
from ql3.store import PgStore, Row

DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10000

_LIST_COLUMNS = """
SELECT st.invocation_id, st.project_id, st.run_id::text AS run_id,
       st.step_run_id::text AS step_run_id, st.attempt, st.provider, st.model,
       st.record ->> 'deadline_at' AS deadline_at, st.record ->> 'admitted_at' AS admitted_at,
       c.outcome, c.result_code, c.recovered, c.record ->> 'completed_at' AS completed_at,
       v.decision, v.user_id AS resolved_as, v.resolved_by::text AS resolved_by,
       v.record ->> 'resolved_at' AS resolved_at
FROM ql3_ai.model_invocation_starts AS st
LEFT JOIN ql3_ai.model_invocation_completions AS c ON c.invocation_id = st.invocation_id
LEFT JOIN ql3_ai.model_invocation_resolutions AS v ON v.invocation_id = st.invocation_id
"""

# Unresolved = lost and waiting for a human, oldest first (the order a queue is worked in).
_UNRESOLVED_SQL = (
    _LIST_COLUMNS
    + """WHERE c.outcome = 'lost' AND v.invocation_id IS NULL
  AND (%(project)s::text IS NULL OR st.project_id = %(project)s::text)
ORDER BY c.completed_at, c.invocation_id
LIMIT %(limit)s"""
)

_RECENT_SQL = (
    _LIST_COLUMNS
    + """WHERE %(project)s::text IS NULL OR st.project_id = %(project)s::text
ORDER BY st.admitted_at DESC, st.invocation_id DESC
LIMIT %(limit)s"""
)

_SHOW_SQL = """
SELECT st.record AS start, st.start_digest,
       c.record AS completion, c.completion_digest,
       v.record AS resolution, v.resolution_digest, v.resolved_by::text AS resolved_by,
       to_jsonb(s) AS step, to_jsonb(u) AS usage
FROM ql3_ai.model_invocation_starts AS st
INNER JOIN ql3.step_runs AS s ON s.step_run_id = st.step_run_id
LEFT JOIN ql3_ai.model_invocation_completions AS c ON c.invocation_id = st.invocation_id
LEFT JOIN ql3_ai.model_invocation_resolutions AS v ON v.invocation_id = st.invocation_id
LEFT JOIN ql3_ai.usage_ledger AS u ON u.invocation_id = st.invocation_id
WHERE st.invocation_id = %s
"""


def _query(store: PgStore, sql: str, params: Sequence[Any] | dict[str, Any]) -> list[Row]:
    with store.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, params)
        return list(cur.fetchall())


def list_invocations(
    store: PgStore,
    *,
    unresolved: bool = False,
    project_id: str | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
) -> list[Row]:
    """Invocations with their outcome and resolution, newest first; or, with
    ``unresolved``, the lost ones that no human has resolved yet, oldest first."""
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: limit must be 1..{MAX_LIST_LIMIT}")
    sql = _UNRESOLVED_SQL if unresolved else _RECENT_SQL
    return _query(store, sql, {"project": project_id, "limit": limit})


def invocation_detail(store: PgStore, invocation_id: str) -> Row:
    """Start, completion, resolution (records and digests), the step as it is now, and
    the usage ledger row of one invocation; ``NotFound`` when it was never admitted."""
    rows = _query(store, _SHOW_SQL, (invocation_id,))
    if not rows:
        raise errors.NotFound(f"QL3_NOT_FOUND: invocation {invocation_id} was never admitted")
    return {"invocation_id": invocation_id, **rows[0]}


def resolve(
    store: PgStore,
    invocation_id: str,
    *,
    decision: Decision | str,
    user_id: str,
    reason: str | None = None,
) -> Row:
    """Resolve a lost invocation, reading its completion digest and step version from the
    database: the result of ``resolve_invocation``.

    When the invocation is already resolved, the command is rebuilt against the version
    that resolution moved, so repeating the same resolution replays as ``existing`` and
    another decision, user or reason is ``QL3_CONFLICT`` (the SQL function decides both).
    """
    detail = invocation_detail(store, invocation_id)
    if detail["completion"] is None:
        raise errors.IllegalTransition(
            f"QL3_ILLEGAL_TRANSITION: invocation {invocation_id} has no completion yet; "
            "only lost/outcome_unknown is resolved"
        )
    resolution = detail["resolution"]
    if resolution is not None:
        expected_version = int(resolution["step_run_version"]) - 1
    else:
        expected_version = int(detail["step"]["version"])
    command = resolution_command(
        invocation_id=invocation_id,
        completion_digest=str(detail["completion_digest"]),
        decision=decision,
        user_id=user_id,
        expected_step_run_version=expected_version,
        reason=reason,
    )
    return store.resolve_invocation(command)


# -- command line ----------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        rows = list_invocations(
            store, unresolved=args.unresolved, project_id=args.project, limit=args.limit
        )
    print_json(rows)
    return 0


def _show(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        print_json(invocation_detail(store, args.invocation_id))
    return 0


def _resolve(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        result = resolve(
            store, args.invocation_id, decision=args.decision, user_id=args.user, reason=args.reason
        )
    print_json(result)
    return 0


def _usage(args: argparse.Namespace) -> int:
    since = None if args.since is None else parse_timestamp(args.since)
    until = None if args.until is None else parse_timestamp(args.until)
    with open_store(args) as store:
        rows = store.usage_summary(args.project, since, until)
    print_json(rows)
    return 0


def _add_dsn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help="PostgreSQL conninfo (default: $QL3_DSN)")


def register(subparsers: Any) -> None:
    """Add ``invocations list|show``, ``resolve`` and ``usage`` to ``ql3``."""
    invocations = subparsers.add_parser("invocations", help="list and show model invocations")
    verbs = invocations.add_subparsers(dest="verb", required=True)

    listing = verbs.add_parser(
        "list", help="recent invocations, newest first (JSON)", description=list_invocations.__doc__
    )
    listing.add_argument(
        "--unresolved", action="store_true", help="only lost ones waiting for a resolution"
    )
    listing.add_argument("--project", help="only this project_id")
    listing.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIST_LIMIT,
        help=f"at most N rows (default {DEFAULT_LIST_LIMIT})",
    )
    listing.set_defaults(func=_list)

    show = verbs.add_parser("show", help="one invocation's receipts, step and usage (JSON)")
    show.add_argument("invocation_id")
    show.set_defaults(func=_show)

    resolve_cmd = subparsers.add_parser(
        "resolve",
        help="resolve a lost/outcome_unknown invocation (retry, fail or cancel)",
        description=resolve.__doc__,
    )
    resolve_cmd.add_argument("invocation_id")
    resolve_cmd.add_argument(
        "--decision", required=True, choices=[d.value for d in Decision], help="what to do"
    )
    resolve_cmd.add_argument("--user", required=True, help="user_id of the person deciding")
    resolve_cmd.add_argument("--reason", help="why (recorded with the resolution)")
    resolve_cmd.set_defaults(func=_resolve)

    usage = subparsers.add_parser(
        "usage", help="usage totals of a project by provider, model and currency (JSON)"
    )
    usage.add_argument("--project", required=True, help="project_id")
    usage.add_argument("--since", help="from this ISO 8601 instant, inclusive (no offset = UTC)")
    usage.add_argument("--until", help="to this ISO 8601 instant, exclusive (no offset = UTC)")
    usage.set_defaults(func=_usage)

    for parser in (listing, show, resolve_cmd, usage):
        _add_dsn(parser)
