"""The ``ql3`` command line. Each command module adds its subcommands with ``register``;
every command reads QL3_DSN (and QL3_REDIS_URL) when no flag is given.

Nothing here imports a driver: ``pip install ql3`` alone runs the commands that take
``--sqlite PATH`` on an edge file (D58). A command's module is imported only when it is
the command given (all of them for ``ql3 --help``), and the PostgreSQL modules
(``ql3.db``, ``ql3.store``) only on a PostgreSQL path; without their driver, that path
is ``Misconfigured`` naming the extra to install (exit 2), and a command whose module
needs a missing extra is left out of the parser, its ``invalid choice`` naming the extra.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ql3 import canonical, errors
from ql3.safe_text import command_secrets, error_text, json_text

if TYPE_CHECKING:
    from ql3.edge import EdgeStore
    from ql3.store import PgStore

    Store = PgStore | EdgeStore
    """What ``open_any_store`` gives: PostgreSQL's, or an edge file's with ``--sqlite``."""


@dataclass(frozen=True)
class CommandModule:
    """A module that contributes subcommands: the commands its ``register`` adds, in
    order, the driver modules it imports, and the extra that brings them."""

    commands: tuple[str, ...]
    drivers: tuple[str, ...] = ()
    extra: str = "postgres"


POSTGRES_DRIVERS = ("psycopg", "psycopg_pool")

COMMANDS: dict[str, CommandModule] = {
    "ql3.migrate": CommandModule(("migrate", "ready"), POSTGRES_DRIVERS),
    "ql3.relay": CommandModule(
        ("relay",), (*POSTGRES_DRIVERS, "redis", "prometheus_client"), "relay"
    ),
    # These import no driver: --sqlite runs on a bare install; --dsn imports it (D58).
    "ql3.invocations_cli": CommandModule(("invocations", "resolve", "usage")),
    "ql3.recovery": CommandModule(("recover",)),
    "ql3.prune": CommandModule(("prune",)),
    "ql3.verify": CommandModule(("verify",), POSTGRES_DRIVERS),
}
"""Modules that contribute subcommands; one whose extra this install lacks is left out."""

COMMAND_MODULES = tuple(COMMANDS)

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


@contextlib.contextmanager
def needs_postgres(what: str, *, sqlite: bool = False) -> Iterator[None]:
    """Around the import of a PostgreSQL module (``ql3.db``, ``ql3.store``): a driver
    missing from this install is ``Misconfigured`` (exit 2) naming the extra to install,
    not an ImportError traceback. ``sqlite``: the command also runs with ``--sqlite``."""
    try:
        yield
    except ModuleNotFoundError as exc:
        driver = (exc.name or "").split(".")[0]
        if driver not in POSTGRES_DRIVERS:
            raise
        instead = (
            "--sqlite PATH runs it on an edge device's file without it"
            if sqlite
            else "pip install ql3 alone is the SQLite edge shim"
        )
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: {what} needs {driver}, which this install lacks: "
            f"pip install 'ql3[postgres]' ({instead})"
        ) from None


def _on_postgresql(args: argparse.Namespace) -> str:
    command = getattr(args, "command", None)
    return f"ql3 {command} on PostgreSQL" if command else "PostgreSQL"


def dsn_from_env(dsn: str | None, what: str = "PostgreSQL", *, sqlite: bool = False) -> str:
    """``ql3.db.dsn_from_env``, its module imported on first use (``needs_postgres``)."""
    with needs_postgres(what, sqlite=sqlite):
        from ql3 import db
    return db.dsn_from_env(dsn)


def limit_ms(seconds: float) -> int:
    """A time limit in seconds as the whole milliseconds of a timeout setting (at least 1)."""
    return max(1, round(seconds * 1000))


def open_store(
    args: argparse.Namespace, *, sqlite: bool = False, time_limit: float | None = None
) -> PgStore:
    """The one-connection store of a one-shot command; a database that cannot be reached
    says why at once (``PgStore.checked``). ``time_limit``: the statement timeout of its
    calls, in seconds (default: ql3's)."""
    what = _on_postgresql(args)
    dsn = dsn_from_env(args.dsn, what, sqlite=sqlite)
    with needs_postgres(what, sqlite=sqlite):
        from ql3.db import Timeouts
        from ql3.store import PgStore
    timeouts = None if time_limit is None else Timeouts(statement_ms=limit_ms(time_limit))
    return PgStore.checked(dsn, max_connections=1, timeouts=timeouts)


def open_any_store(args: argparse.Namespace, *, time_limit: float | None = None) -> Store:
    """``open_store``, or with ``--sqlite PATH`` the ``EdgeStore`` of that file, which
    must exist and be migrated (``EdgeStore.checked``; D58). On the file ``time_limit`` is
    how long a call waits for the write lock (its busy timeout), the bound a call has on
    PostgreSQL."""
    if getattr(args, "sqlite", None) is not None:
        from ql3.edge import EdgeStore

        if time_limit is None:
            return EdgeStore.checked(args.sqlite)
        return EdgeStore.checked(args.sqlite, busy_timeout_ms=limit_ms(time_limit))
    return open_store(args, sqlite=True, time_limit=time_limit)


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


EXTRA_MODULES = frozenset({*POSTGRES_DRIVERS, "redis", "prometheus_client", "httpx"})
"""Libraries of the extras: a command module that needs a missing one is left out."""


class _CommandParser(ArgumentParser):
    """The top-level parser: an ``invalid choice`` of a command left out for a missing
    extra says which extra brings it."""

    left_out: dict[str, str]

    def error(self, message: str) -> NoReturn:
        for command, hint in getattr(self, "left_out", {}).items():
            if f"invalid choice: {command!r}" in message:
                message = f"{message}; {hint}"
                break
        super().error(message)


def _left_out_hint(command: str, driver: str, extra: str) -> str:
    return (
        f"ql3 {command} needs {driver}, which this install lacks: pip install 'ql3[{extra}]' "
        "(pip install ql3 alone runs recover, invocations, resolve and usage with --sqlite)"
    )


def _missing_driver(spec: CommandModule) -> str | None:
    """The first driver of ``spec`` this install lacks, found without importing it."""
    for driver in spec.drivers:
        try:
            if importlib.util.find_spec(driver) is None:
                return driver
        except ValueError:  # in sys.modules without a spec
            continue
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``ql3``. With ``command``, only the module that adds it is imported
    (the others are registered as bare subparsers of the same names, so that usage and
    errors read the same); without, every module is."""
    parser = _CommandParser(
        prog="ql3", description="Durable contract revisions and model invocations on PostgreSQL."
    )
    parser.left_out = {}
    top: argparse.ArgumentParser = parser
    subparsers = top.add_subparsers(dest="command", required=True)
    register_revision(subparsers)
    for name, spec in COMMANDS.items():
        if command is not None and command not in spec.commands:
            if (driver := _missing_driver(spec)) is None:
                for other in spec.commands:
                    subparsers.add_parser(other)
            else:
                for other in spec.commands:
                    parser.left_out[other] = _left_out_hint(other, driver, spec.extra)
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # The module itself, or a library of an extra it needs.
            driver = (exc.name or "").split(".")[0]
            if exc.name != name and driver not in EXTRA_MODULES:
                raise
            for other in spec.commands:
                parser.left_out[other] = _left_out_hint(other, driver, spec.extra)
            continue
        module.register(subparsers)
    if parser.left_out:
        extras = {name: spec.extra for spec in COMMANDS.values() for name in spec.commands}
        parser.epilog = "not in this install: " + ", ".join(
            f"{name} (pip install 'ql3[{extras[name]}]')" for name in parser.left_out
        )
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names, when it names one first (``ql3`` takes no option but
    ``--help`` before it); None otherwise, and every module is loaded."""
    if argv and (argv[0] == "revision" or any(argv[0] in s.commands for s in COMMANDS.values())):
        return argv[0]
    return None


LIST_OPTIONS = frozenset({"target"})
"""Options that take several values (``migrate --target``); every other one takes one."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
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
