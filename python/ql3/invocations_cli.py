"""The ``ql3 invocations``, ``ql3 resolve`` and ``ql3 usage`` commands, on PostgreSQL
(``--dsn``) or on an edge device's SQLite file (``--sqlite``).

Everything goes through the store interface, so both stores run the same code: writes
through ``resolve_invocation`` (the SQL function, or its SQLite twin), reads through the
operator reads ``list_invocations``, ``unresolved_invocations`` and ``invocation``
(``ql3.invocation_reads`` and ``ql3.edge.invocation_reads``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ql3 import arguments, errors
from ql3.cli import add_dsn_or_sqlite, open_any_store, print_json
from ql3.invocations import Decision, parse_timestamp, resolution_command
from ql3.safe_text import command_secrets, error_text, escape_controls, redact

if TYPE_CHECKING:
    from ql3.cli import Store

Row = dict[str, Any]

DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10000
MAX_RESOLVE_IDS = MAX_LIST_LIMIT
"""At most this many invocations per ``ql3 resolve``: a full page of the queue."""


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: limit must be 1..{MAX_LIST_LIMIT}")


def list_invocations(
    store: Store,
    *,
    projects: Sequence[str] | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
) -> list[Row]:
    """Invocations with their outcome and resolution, newest first (all of the login's
    projects, or only ``projects``)."""
    _check_limit(limit)
    return store.list_invocations(projects, limit)


@dataclass(frozen=True)
class Queue:
    """A page of the resolution queue: the oldest ``rows``, and whether more wait."""

    rows: list[Row]
    more: bool


def unresolved_invocations(
    store: Store,
    *,
    projects: Sequence[str] | None = None,
    older_than: timedelta = timedelta(0),
    limit: int = DEFAULT_LIST_LIMIT,
) -> Queue:
    """The lost (outcome_unknown) invocations no human has resolved yet, oldest first:
    age is the time since the lost completion, when the call entered the queue. Only the
    login's projects (row-level security), and of those only ``projects`` when given.
    One bounded read of ``limit + 1`` rows tells whether more are waiting."""
    _check_limit(limit)
    rows = store.unresolved_invocations(projects, older_than, limit + 1)
    return Queue(rows=rows[:limit], more=len(rows) > limit)


def invocation_detail(store: Store, invocation_id: str) -> Row:
    """Start, completion, resolution (records and digests), the step as it is now, and
    the usage ledger row of one invocation; ``NotFound`` when it was never admitted."""
    row = store.invocation(invocation_id)
    if row is None:
        raise errors.NotFound(f"QL3_NOT_FOUND: invocation {invocation_id} was never admitted")
    return {"invocation_id": invocation_id, **row}


def resolve(
    store: Store,
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


def format_age(seconds: float) -> str:
    """``45s``, ``12m``, ``3h05m``, ``2d04h``: the two largest units, rounded down."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m"
    return f"{secs}s"


_QUEUE_HEADER = ("AGE", "PROJECT", "PROVIDER/MODEL", "ATTEMPT", "DEADLINE", "POLICY REVISION",
                 "INVOCATION")  # fmt: skip


def queue_table(rows: Sequence[Row]) -> list[str]:
    """The queue as aligned text lines, every value's control characters escaped."""
    cells = [_QUEUE_HEADER] + [
        tuple(
            escape_controls(str(value))
            for value in (
                format_age(float(row["age_seconds"])),
                row["project_id"],
                f"{row['provider']}/{row['model']}",
                row["attempt"],
                row["deadline_at"],
                row["policy_revision_id"] or "-",
                row["invocation_id"],
            )
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_QUEUE_HEADER) - 1)]
    return [
        "  ".join([*(cell.ljust(w) for cell, w in zip(line, widths, strict=False)), line[-1]])
        for line in cells
    ]


def _projects(args: argparse.Namespace) -> list[str] | None:
    projects = args.project or None
    # argparse (3.11) appends [] for --project=--, past its type check (see cli.main).
    if projects is not None and not all(isinstance(p, str) for p in projects):
        raise errors.Misconfigured(
            "QL3_INVALID_ARGUMENT: argument --project: expected one argument"
        )
    return projects


def _list(args: argparse.Namespace) -> int:
    projects = _projects(args)
    if not args.unresolved:
        if args.older_than is not None:
            raise errors.Misconfigured("QL3_INVALID_ARGUMENT: --older-than needs --unresolved")
        with open_any_store(args) as store:
            rows = list_invocations(store, projects=projects, limit=args.limit)
        print_json(rows)
        return 0
    with open_any_store(args) as store:
        queue = unresolved_invocations(
            store, projects=projects, older_than=args.older_than or timedelta(0), limit=args.limit
        )
    if args.json:
        print_json(queue.rows)
    elif queue.rows:
        print("\n".join(queue_table(queue.rows)))
    else:
        print("no unresolved invocations")
    if queue.more:
        print(
            f"note: more than {args.limit} unresolved invocations; these are the oldest "
            f"{args.limit} (raise --limit, or narrow with --project or --older-than)",
            file=sys.stderr,
        )
    return 0


def _show(args: argparse.Namespace) -> int:
    with open_any_store(args) as store:
        print_json(invocation_detail(store, args.invocation_id))
    return 0


def resolve_many(
    store: Store,
    invocation_ids: Sequence[str],
    *,
    decision: Decision | str,
    user_id: str,
    reason: str | None = None,
) -> list[Row]:
    """One decision for several lost invocations: one ``resolve_invocation`` call, hence
    one Resolution receipt, each. Returns one entry per distinct id, in order:
    ``{"invocation_id", "status": "created" | "existing", "resolution", ...}``, or
    ``{"invocation_id", "status": "refused", "code", "message"}`` (and ``"detail"`` when
    the error has one). After
    ``QL3_UNAVAILABLE`` the rest are ``not_tried``: the connection is gone, and a resolution
    that may or may not have committed replays as ``existing`` when the command is rerun.
    """
    results: list[Row] = []
    unavailable = False
    for invocation_id in dict.fromkeys(invocation_ids):
        if unavailable:
            results.append({"invocation_id": invocation_id, "status": "not_tried"})
            continue
        try:
            result = resolve(
                store, invocation_id, decision=decision, user_id=user_id, reason=reason
            )
        except errors.Ql3Error as exc:
            unavailable = isinstance(exc, errors.Unavailable)
            message = exc.message.removeprefix(exc.code).removeprefix(": ")
            refusal: Row = {"invocation_id": invocation_id, "status": "refused",
                            "code": exc.code, "message": message}  # fmt: skip
            if exc.detail:
                refusal["detail"] = exc.detail
            results.append(refusal)
            continue
        results.append({"invocation_id": invocation_id, **result})
    return results


def resolution_summary(results: Sequence[Row]) -> dict[str, int]:
    """How many of ``resolve_many``'s results are in each status; ``resolved`` is
    ``created`` + ``existing``."""
    counts = {"requested": len(results), "resolved": 0, "created": 0, "existing": 0,
              "refused": 0, "not_tried": 0}  # fmt: skip
    for result in results:
        counts[str(result["status"])] += 1
    counts["resolved"] = counts["created"] + counts["existing"]
    return counts


def _resolve(args: argparse.Namespace) -> int:
    ids: list[str] = args.invocation_ids
    if len(set(ids)) > MAX_RESOLVE_IDS:
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: at most {MAX_RESOLVE_IDS} invocations per command"
        )
    with open_any_store(args) as store:
        results = resolve_many(
            store, ids, decision=args.decision, user_id=args.user, reason=args.reason
        )
    counts = resolution_summary(results)
    secrets = command_secrets(args)
    for result in results:
        if result["status"] != "refused":
            continue
        # A message may quote what a connection error quoted: no password, in either form.
        for key in ("message", "detail"):
            if key in result:
                result[key] = redact(str(result[key]), secrets)
        text = f"{result['code']}: invocation {result['invocation_id']}: {result['message']}"
        print(f"error: {error_text(text, secrets)}", file=sys.stderr)
        if "detail" in result:
            print(f"detail: {error_text(str(result['detail']), secrets)}", file=sys.stderr)
    if args.json:
        print_json({"decision": args.decision, "user_id": args.user, "reason": args.reason,
                    **counts, "results": results})  # fmt: skip
    else:
        for result in results:
            status = str(result["status"])
            line = f"{status:<9} {escape_controls(str(result['invocation_id']))}"
            if status == "refused":
                line += f"  {result['code']}"
            print(line)
        reason = "" if args.reason is None else f", reason: {escape_controls(args.reason)}"
        print(
            f"{counts['resolved']} of {counts['requested']} resolved as {args.decision} by "
            f"{escape_controls(args.user)} ({counts['created']} created, {counts['existing']} "
            f"existing), {counts['refused']} refused, {counts['not_tried']} not tried{reason}"
        )
    return 0 if counts["resolved"] == counts["requested"] else 1


def _usage(args: argparse.Namespace) -> int:
    since = None if args.since is None else parse_timestamp(args.since)
    until = None if args.until is None else parse_timestamp(args.until)
    with open_any_store(args) as store:
        rows = store.usage_summary(args.project, since, until)
    print_json(rows)
    return 0


def register(subparsers: Any) -> None:
    """Add ``invocations list|show``, ``resolve`` and ``usage`` to ``ql3``."""
    invocations = subparsers.add_parser("invocations", help="list and show model invocations")
    verbs = invocations.add_subparsers(dest="verb", required=True)

    listing = verbs.add_parser(
        "list",
        help="recent invocations (JSON), or the resolution queue (--unresolved)",
        description=(
            "Without --unresolved: invocations, newest first, as JSON. With --unresolved: the "
            "resolution queue, the lost (outcome_unknown) invocations no human has resolved, "
            "oldest first, as a table (--json: rows); AGE is the time since the invocation "
            "was settled as lost, which is how long it has waited for a human. Only the "
            "login's projects are shown."
        ),
    )
    listing.add_argument(
        "--unresolved", action="store_true", help="the resolution queue: lost, unresolved"
    )
    listing.add_argument(
        "--project",
        action="append",
        metavar="P",
        help="only this project_id (repeat for several)",
    )
    listing.add_argument(
        "--older-than",
        type=arguments.duration_type,
        metavar="DURATION",
        help="with --unresolved: only those lost at least this long ago (30s, 10m, 2h, 1d, 1w)",
    )
    listing.add_argument(
        "--json",
        action="store_true",
        help="with --unresolved: JSON rows instead of the table (without it, always JSON)",
    )
    listing.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIST_LIMIT,
        help=f"at most N rows, 1..{MAX_LIST_LIMIT} (default {DEFAULT_LIST_LIMIT}); with "
        "--unresolved, a note on stderr says when more are waiting",
    )
    listing.set_defaults(func=_list)

    show = verbs.add_parser("show", help="one invocation's receipts, step and usage (JSON)")
    show.add_argument("invocation_id")
    show.set_defaults(func=_show)

    resolve_cmd = subparsers.add_parser(
        "resolve",
        help="resolve lost/outcome_unknown invocations (retry, fail or cancel)",
        description=(
            "One decision, user and reason for one or more lost invocations: each gets its "
            "own Resolution receipt (one resolve_invocation call each). Prints a line per "
            "invocation (created, existing, refused with its code, not_tried) and a summary "
            "(--json: one document); each refusal is also an error: line on stderr. Exit 0 "
            "when all are resolved, 1 when any is not. Rerunning the same command is safe: "
            "the ones already resolved the same way are existing, and a different decision or "
            "user for one of them is refused as QL3_CONFLICT."
        ),
    )
    resolve_cmd.add_argument(
        "invocation_ids",
        nargs="+",
        metavar="ID",
        help=f"invocation_id (up to {MAX_RESOLVE_IDS}; repeats count once)",
    )
    resolve_cmd.add_argument(
        "--decision", required=True, choices=[d.value for d in Decision], help="what to do"
    )
    resolve_cmd.add_argument("--user", required=True, help="user_id of the person deciding")
    resolve_cmd.add_argument("--reason", help="why (recorded with each resolution)")
    resolve_cmd.add_argument("--json", action="store_true", help="print the summary as JSON")
    resolve_cmd.set_defaults(func=_resolve)

    usage = subparsers.add_parser(
        "usage", help="usage totals of a project by provider, model and currency (JSON)"
    )
    usage.add_argument("--project", required=True, help="project_id")
    usage.add_argument("--since", help="from this ISO 8601 instant, inclusive (no offset = UTC)")
    usage.add_argument("--until", help="to this ISO 8601 instant, exclusive (no offset = UTC)")
    usage.set_defaults(func=_usage)

    for parser in (listing, show, resolve_cmd, usage):
        add_dsn_or_sqlite(parser)
