"""The ``ql3`` command line. Each command module adds its subcommands with ``register``;
every command reads QL3_DSN (and QL3_REDIS_URL) when no flag is given."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ql3 import canonical, errors
from ql3.db import dsn_from_env
from ql3.safe_text import command_secrets, error_text, json_text
from ql3.store import PgStore

if TYPE_CHECKING:
    from ql3.edge import EdgeStore

    Store = PgStore | EdgeStore
    """What ``open_any_store`` gives: PostgreSQL's, or an edge file's with ``--sqlite``."""

# Modules that contribute subcommands; a module missing from this install is skipped.
COMMAND_MODULES = (
    "ql3.migrate",
    "ql3.relay",
    "ql3.invocations_cli",
    "ql3.recovery",
    "ql3.verify",
    "ql3.prune",
)

Handler = Callable[[argparse.Namespace], int]


def print_json(value: Any) -> None:
    """The JSON of a command's result; C1 controls and U+2028/U+2029 in its texts (a
    project_id or a model name may hold any character) are escaped as JSON escapes."""
    print(json_text(value, indent=2, sort_keys=True, default=str))


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors redact connection passwords and escape
    control characters: argparse quotes the argument it could not place, which may be a
    ``--dsn`` value given before the subcommand, or text holding ESC. Subcommands get
    this class too (``add_subparsers`` makes parsers of the parent's type)."""

    def error(self, message: str) -> NoReturn:
        super().error(error_text(message))


def _actor(args: argparse.Namespace) -> str:
    return str(args.actor or os.environ.get("QL3_ACTOR") or os.environ.get("USER") or "ql3-cli")


def _read_body(args: argparse.Namespace) -> Any:
    """The JSON of --body or --body-file; an unreadable or non-UTF-8 file is InvalidArgument."""
    if args.body_file:
        source = "stdin" if args.body_file == "-" else args.body_file
        try:
            if args.body_file == "-":
                text = sys.stdin.read()
            else:
                text = Path(args.body_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise errors.InvalidArgument(
                f"QL3_INVALID_ARGUMENT: cannot read the body from {source}: {reason}"
            ) from None
    else:
        text = args.body
    return canonical.parse_json(text)


def open_store(args: argparse.Namespace) -> PgStore:
    """The one-connection store of a one-shot command; a database that cannot be reached
    says why at once (``PgStore.checked``)."""
    return PgStore.checked(dsn_from_env(args.dsn), max_connections=1)


def open_any_store(args: argparse.Namespace) -> Store:
    """``open_store``, or with ``--sqlite PATH`` the ``EdgeStore`` of that file, which
    must exist and be migrated (``EdgeStore.checked``; D58)."""
    if getattr(args, "sqlite", None) is not None:
        from ql3.edge import EdgeStore

        return EdgeStore.checked(args.sqlite)
    return open_store(args)


def _revision_put(args: argparse.Namespace) -> int:
    body = _read_body(args)  # bad input is refused before any connection
    with open_store(args) as store:
        print_json(store.put_revision(args.project, args.family, args.contract,
                                      body, _actor(args)))  # fmt: skip
    return 0


def _revision_activate(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        event = store.activate_revision(
            args.project, args.family, args.contract, args.revision, _actor(args), args.expect
        )
    print_json(event if event is not None else {"status": "already active"})
    return 0


def _revision_revoke(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        event = store.revoke_revision(args.revision, _actor(args), args.reason)
    print_json(event if event is not None else {"status": "already revoked"})
    return 0


def _revision_show(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        if args.revision:
            row = store.revision(args.revision)
            if row is None:
                raise errors.NotFound(f"QL3_NOT_FOUND: revision {args.revision} does not exist")
        else:
            row = store.active_revision(args.project, args.family, args.contract)
            if row is None:
                raise errors.NotFound(
                    f"QL3_NOT_FOUND: no active revision of {args.project}/{args.family}/"
                    f"{args.contract}"
                )
    print_json(row)
    return 0


def add_dsn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help="PostgreSQL conninfo (default: $QL3_DSN)")


SQLITE_HELP = (
    "instead of PostgreSQL, the SQLite file of an edge device (ql3.edge); it must exist and "
    "be migrated"
)


def add_dsn_or_sqlite(parser: argparse.ArgumentParser, dsn_help: str | None = None) -> None:
    """``--dsn`` or ``--sqlite PATH``, not both: the commands that run on either store."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--dsn", help=dsn_help or "PostgreSQL conninfo (default: $QL3_DSN)")
    where.add_argument("--sqlite", metavar="PATH", help=SQLITE_HELP)


def _contract_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--project", required=required, help="project_id")
    parser.add_argument("--family", required=required, help="contract family, e.g. policy_routing")
    parser.add_argument("--contract", required=required, help="contract_id")


def register_revision(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    revision = subparsers.add_parser("revision", help="put, activate, revoke and show revisions")
    verbs = revision.add_subparsers(dest="verb", required=True)

    put = verbs.add_parser("put", help="store a revision (idempotent on the same body)")
    _contract_args(put)
    source = put.add_mutually_exclusive_group(required=True)
    source.add_argument("--body", help="the JSON object")
    source.add_argument("--body-file", help="a file holding the JSON object, or - for stdin")
    put.set_defaults(func=_revision_put)

    activate = verbs.add_parser("activate", help="make a revision the active one")
    _contract_args(activate)
    activate.add_argument("--revision", required=True, help="revision_id")
    activate.add_argument("--expect", help="compare-and-set: the revision_id expected active now")
    activate.set_defaults(func=_revision_activate)

    revoke = verbs.add_parser("revoke", help="revoke a revision for good")
    revoke.add_argument("revision", help="revision_id")
    revoke.add_argument("--reason", required=True)
    revoke.set_defaults(func=_revision_revoke)

    show = verbs.add_parser("show", help="the active revision of a contract, or one by id")
    _contract_args(show, required=False)
    show.add_argument("--revision", help="show this revision_id instead of the active one")
    show.set_defaults(func=_revision_show)

    for verb in (put, activate, revoke, show):
        add_dsn(verb)
        if verb is not show:
            verb.add_argument("--actor", help="who acts (default: $QL3_ACTOR or $USER)")


EXTRA_MODULES = frozenset({"redis", "prometheus_client", "httpx"})
"""Libraries of the extras beyond ``postgres``: a command that needs one is left out."""


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = ArgumentParser(
        prog="ql3", description="Durable contract revisions and model invocations on PostgreSQL."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_revision(subparsers)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # The module itself, or a library of an extra it needs (the relay and recover
            # commands need ql3[relay]; ql3[postgres] serves the others).
            if exc.name != name and (exc.name or "").split(".")[0] not in EXTRA_MODULES:
                raise
            continue
        module.register(subparsers)
    return parser


LIST_OPTIONS = frozenset({"target"})
"""Options that take several values (``migrate --target``); every other one takes one."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in vars(args).items():
        # argparse (3.11) gives an option written ``--name=--`` an empty list as its value
        # instead of refusing it, past its type check too (``--limit=--`` is not an int).
        if value == [] and name not in LIST_OPTIONS:
            parser.error(f"argument --{name.replace('_', '-')}: expected one argument")
    showing_active = args.command == "revision" and args.verb == "show" and not args.revision
    if showing_active and not (args.project and args.family and args.contract):
        parser.error("revision show needs --revision, or --project, --family and --contract")
    func: Handler = args.func
    try:
        return func(args)
    except errors.Misconfigured as exc:
        report(exc, command_secrets(args))
        return 2
    except errors.Ql3Error as exc:
        report(exc, command_secrets(args))
        return 1
    except KeyboardInterrupt:
        return 130


def report(exc: errors.Ql3Error, secrets: Iterable[str] = ()) -> None:
    """``error: QL3_CODE: message`` on one line (libpq's messages span several), and the
    detail, if any, on the next; passwords redacted (``secrets`` too), controls escaped."""
    text = exc.message if exc.message.startswith(exc.code) else f"{exc.code}: {exc.message}"
    print(f"error: {error_text(text, secrets)}", file=sys.stderr)
    if exc.detail:
        print(f"detail: {error_text(exc.detail, secrets)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
