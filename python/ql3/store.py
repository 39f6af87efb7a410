"""``PgStore``: the store interface of SPEC section 10 over PostgreSQL.

Each method is one call of the SQL function of the same name (the SQL functions are the
contract); rows come back as dicts with uuids as strings. Errors are ``ql3.errors``.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import Connection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from ql3 import arguments, errors, invocation_reads, pooler
from ql3.db import Timeouts, connect, make_pool, translated
from ql3.db_guard import bounded, checked_out
from ql3.invocation_reads import check_limit, check_projects
from ql3.invocations import as_utc, recovery_arguments

Row = dict[str, Any]
Params = Sequence[Any] | Mapping[str, Any]
_log = logging.getLogger("ql3.store")
ContractKey = tuple[str, str, str]

# The statements of the run and invocation calls, shared with ``ql3.store_async``.
CREATE_RUN_SQL = "SELECT ql3.create_run(%s, %s, %s::uuid)"
ADD_STEP_RUN_SQL = "SELECT ql3.add_step_run(%s::uuid, %s, %s::uuid)"
RECOVER_EXPIRED_SQL = "SELECT ql3_ai.recover_expired(%s, %s)"
_WAKE_SQL = "SELECT ql3.wake_relays()"


def command_sql(function: str) -> str:
    """The call of one ``ql3_ai`` command function (admit, complete, resolve)."""
    return f"SELECT ql3_ai.{function}(%s)"


def pointer_keys(keys: Iterable[ContractKey]) -> Jsonb:
    """The keys of ``active_pointers`` as its JSON argument; the function checks each key,
    anything that is not an iterable of lists or tuples is refused here (a string is not
    a key: "abc" would otherwise read as the key a/b/c)."""
    refused = errors.InvalidArgument(
        "QL3_INVALID_ARGUMENT: keys must be [project_id, contract_family, contract_id] lists"
    )
    try:
        listed = list(keys)
    except TypeError:
        raise refused from None
    if not all(isinstance(k, list | tuple) for k in listed):
        raise refused
    return Jsonb([list(k) for k in listed])


def command_json(command: Mapping[str, Any]) -> Jsonb:
    """A JSON command as the parameter of its function; anything but a mapping is refused."""
    if not isinstance(command, Mapping):
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: a command must be a JSON object, not {type(command).__name__}"
        )
    return Jsonb(dict(command))


def _plain(row: Row | None) -> Row | None:
    """The row with uuids as strings, so results compare equal across stores."""
    if row is None:
        return None
    return {k: str(v) if isinstance(v, uuid.UUID) else v for k, v in row.items()}


def _null_row(row: Row | None) -> Row | None:
    """No row, or a composite-typed SQL NULL (a row of NULLs: ``revoke_revision`` of a
    revision already revoked), is None. ``activate_revision`` of the active revision
    returns no row at all (D3)."""
    if row is None or all(v is None for v in row.values()):
        return None
    return _plain(row)


def _call_then_wake(conn: Connection[Any], sql: str, params: Sequence[Any]) -> Row | None:
    """One pipeline on an autocommit connection: BEGIN, the call, COMMIT, then
    ``ql3.wake_relays()`` in a transaction of its own (D25); the call's first row, or None.

    A failed call skips the rest of the pipeline (no COMMIT, no wake); its aborted
    transaction is rolled back as the error leaves the pool's connection block. A lost
    connection with the COMMIT queued is ``OutcomeUnknown`` (D49). A failed
    wake after a COMMIT that succeeded is logged and the committed row returned. The wake
    is sent even when the call changes nothing: the relays then find nothing to claim.

    Behind a transaction pooler no pipeline (D64): the call is one Query message with its
    settings (``ql3.pooler``), committed as it ends, and the wake a second one.
    """
    if pooler.local_settings(conn) is not None:
        return _pooled_call_then_wake(conn, sql, params)
    with conn.cursor(row_factory=dict_row) as call:
        commit = None
        try:
            with conn.pipeline():
                conn.execute("BEGIN")
                call.execute(sql, params)
                commit = conn.execute("COMMIT")
                conn.execute(_WAKE_SQL)
        except psycopg.Error as exc:
            if commit is not None and commit.statusmessage != "COMMIT" and not exc.sqlstate:
                # The COMMIT was queued and no server answered the pipeline: the connection
                # failed with it on the way, and it may have committed (D49).
                raise errors.OutcomeUnknown(
                    "QL3_UNAVAILABLE: the connection failed after the call and its COMMIT "
                    f"were sent; the call's outcome is unknown: {str(exc).strip()}"
                ) from exc
            if commit is None or commit.statusmessage != "COMMIT":
                raise  # the call failed (translated), or its COMMIT's outcome is unknown
            _wake_failed(exc)
        return call.fetchone()


def _pooled_call_then_wake(conn: Connection[Any], sql: str, params: Sequence[Any]) -> Row | None:
    """``_call_then_wake`` behind a transaction pooler: the call, then the wake."""
    with conn.cursor(row_factory=dict_row) as call:
        pooler.execute(conn, call, sql, params)  # a lost connection: translated (D49)
        row = call.fetchone()
    try:
        conn.execute(_WAKE_SQL)
    except psycopg.Error as exc:
        _wake_failed(exc)
    return row


def _wake_failed(exc: psycopg.Error) -> None:
    _log.warning("wake_relays failed after COMMIT (the poll delivers): %s", exc)


class PgStore:
    """The ql3 store on PostgreSQL. Pass a conninfo string or an open ConnectionPool.

    Every method is one statement. The store's own pool is autocommit, so each call is
    its own transaction and one round trip; a pool passed in is used as it is (a
    non-autocommit one commits when the call returns the connection)."""

    def __init__(
        self,
        conninfo_or_pool: str | ConnectionPool,
        *,
        timeouts: Timeouts | None = None,
        max_connections: int = 8,
    ) -> None:
        arguments.check_count("max_connections", max_connections, 1)
        self._call_limit = (timeouts or Timeouts()).call_limit()
        if isinstance(conninfo_or_pool, ConnectionPool):
            self.pool = conninfo_or_pool
            self._owns_pool = False
        else:
            self.pool = make_pool(conninfo_or_pool, timeouts=timeouts, max_size=max_connections)
            self._owns_pool = True

    @classmethod
    def checked(
        cls, conninfo: str, *, timeouts: Timeouts | None = None, max_connections: int = 8
    ) -> PgStore:
        """A store whose database first answered one direct connection.

        When it does not, the error is the server's own reason (wrong password, no such
        database, refused), at once: a pool only retries in the background and times out
        saying it got no connection. For one-shot commands such as the CLI's.
        """
        arguments.check_count("max_connections", max_connections, 1)
        connect(conninfo, timeouts=timeouts).close()
        return cls(conninfo, timeouts=timeouts, max_connections=max_connections)

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> PgStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection[Any]]:
        """A live connection of the pool for one call, bounded by the call limit (its COMMIT
        included, on a transactional pool passed in), errors translated (ql3.db_guard)."""
        with (
            translated(self.pool),
            checked_out(self.pool.connection) as conn,
            bounded(conn, self._call_limit),
        ):
            yield conn
            if not conn.autocommit:
                conn.commit()

    def _rows(self, sql: str, params: Params = ()) -> list[Row]:
        with self.connection() as conn:
            return self._rows_on(conn, sql, params)

    @staticmethod
    def _rows_on(conn: Connection[Any], sql: str, params: Params) -> list[Row]:
        with conn.cursor(row_factory=dict_row) as cur:
            pooler.execute(conn, cur, sql, params)
            return list(cur.fetchall())

    def _row(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self._rows(sql, params)
        return rows[0] if rows else None

    def _value(self, sql: str, params: Sequence[Any] = ()) -> Any:
        with self.connection() as conn, conn.cursor() as cur:
            pooler.execute(conn, cur, sql, params)
            found = cur.fetchone()
            return None if found is None else found[0]

    # -- contract revisions ---------------------------------------------------------------

    def put_revision(
        self, project_id: str, contract_family: str, contract_id: str, body: Any, actor: str
    ) -> Row:
        """Stores an immutable revision, or returns the one with the same body."""
        arguments.check_text_args(project_id, contract_family, contract_id, actor)
        row = self._row(
            "SELECT * FROM ql3.put_revision(%s, %s, %s, %s, %s)",
            (project_id, contract_family, contract_id, Jsonb(body), actor),
        )
        result = _plain(row)
        assert result is not None
        return result

    def activate_revision(
        self,
        project_id: str,
        contract_family: str,
        contract_id: str,
        revision_id: str,
        actor: str,
        expected_active_revision_id: str | None = None,
    ) -> Row | None:
        """Makes the revision active; the outbox event, or None when it already was (the
        SQL function then returns no row and writes nothing, D3)."""
        arguments.check_text_args(project_id, contract_family, contract_id, actor)
        arguments.check_uuid_args(revision_id, expected_active_revision_id)
        return self._outbox_write(
            "SELECT * FROM ql3.activate_revision(%s, %s, %s, %s::uuid, %s, %s::uuid)",
            (project_id, contract_family, contract_id, revision_id, actor,
             expected_active_revision_id),
        )  # fmt: skip

    def revoke_revision(self, revision_id: str, actor: str, reason: str) -> Row | None:
        """Revokes for good; the outbox event, or None when it was already revoked."""
        arguments.check_text_args(actor, reason)
        arguments.check_uuid_args(revision_id)
        return self._outbox_write(
            "SELECT * FROM ql3.revoke_revision(%s::uuid, %s, %s)", (revision_id, actor, reason)
        )

    def _outbox_write(self, sql: str, params: Sequence[Any]) -> Row | None:
        """Runs a call that may append an outbox row, then wakes the relays (D17, D25).

        PgStore's own connections set ``ql3.outbox_notify = deferred``, so the call's COMMIT
        does not hold PostgreSQL's notification lock through the WAL flush; once it has
        committed, ``ql3.wake_relays()`` wakes the relays in a transaction of its own. On an
        autocommit connection both go in one pipeline (BEGIN, the call, COMMIT, the wake:
        one round trip, two transactions). A lost wake (the connection drops in between)
        costs latency only: the relays' poll delivers the row. On a pool of your own
        without that setting, the outbox trigger NOTIFYs at COMMIT as well, which is
        correct, only slower under concurrency.
        """
        with self.connection() as conn:
            if conn.autocommit:
                return _null_row(_call_then_wake(conn, sql, params))
            event = _null_row(next(iter(self._rows_on(conn, sql, params)), None))
            conn.commit()  # a transactional pool passed in: the wake must follow the COMMIT
            if event is not None:
                try:
                    conn.execute(_WAKE_SQL)
                except psycopg.Error as exc:
                    _wake_failed(exc)
        return event

    def active_revision(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> Row | None:
        """The active revision with its pointer_version, or None."""
        arguments.check_text_args(project_id, contract_family, contract_id)
        return _plain(
            self._row(
                "SELECT * FROM ql3.active_revision(%s, %s, %s)",
                (project_id, contract_family, contract_id),
            )
        )

    def active_pointers(self, keys: Iterable[ContractKey]) -> list[Row]:
        """One row per key (revision_id None when none is active), in one round trip."""
        rows = self._rows("SELECT * FROM ql3.active_pointers(%s)", (pointer_keys(keys),))
        return [r for r in map(_plain, rows) if r is not None]

    def revision(self, revision_id: str) -> Row | None:
        """One stored revision by id (active or not), or None."""
        arguments.check_uuid_args(revision_id)
        return _plain(
            self._row(
                "SELECT * FROM ql3.contract_revisions WHERE revision_id = %s::uuid", (revision_id,)
            )
        )

    def outbox_backlog(self) -> Row:
        """Undelivered outbox rows, oldest age in seconds, highest seq."""
        row = self._row("SELECT * FROM ql3.outbox_backlog()")
        assert row is not None
        return row

    def prune_outbox(self, delivered_before: timedelta, batch: int) -> int:
        """``ql3.prune_outbox`` (D55), one transaction: removes at most ``batch`` delivered
        outbox rows delivered more than ``delivered_before`` ago, oldest first, never an
        undelivered row or a pointer's newest; how many it removed."""
        arguments.check_prune(delivered_before, batch)
        return int(self._value("SELECT ql3.prune_outbox(%s, %s)", (delivered_before, batch)))

    # -- runs and steps -------------------------------------------------------------------

    def create_run(self, project_id: str, trace_id: str, run_id: str | None = None) -> str:
        """Creates a run (idempotent on the same run_id and content); its run_id."""
        arguments.check_text_args(project_id, trace_id)
        arguments.check_uuid_args(run_id)
        return str(self._value(CREATE_RUN_SQL, (project_id, trace_id, run_id)))

    def add_step_run(self, run_id: str, kind: str, step_run_id: str | None = None) -> str:
        """Adds a ready step (version 1, attempt_count 0) to a run; its step_run_id."""
        arguments.check_text_args(kind)
        arguments.check_uuid_args(run_id, step_run_id)
        return str(self._value(ADD_STEP_RUN_SQL, (run_id, kind, step_run_id)))

    def step_run(self, step_run_id: str) -> Row | None:
        """The step row as it is now, or None."""
        arguments.check_uuid_args(step_run_id)
        return _plain(
            self._row("SELECT * FROM ql3.step_runs WHERE step_run_id = %s::uuid", (step_run_id,))
        )

    def run(self, run_id: str) -> Row | None:
        """The run row as it is now, or None."""
        arguments.check_uuid_args(run_id)
        return _plain(self._row("SELECT * FROM ql3.runs WHERE run_id = %s::uuid", (run_id,)))

    # -- model invocations (stream ql3_ai) ------------------------------------------------

    def _command(self, function: str, command: Mapping[str, Any]) -> Row:
        result = self._value(command_sql(function), (command_json(command),))
        assert isinstance(result, dict)
        return result

    def admit_invocation(self, command: Mapping[str, Any]) -> Row:
        """Admission: {"status": "created"|"existing", "start", "start_digest"}."""
        return self._command("admit_invocation", command)

    def admit_in_new_run(self, command: Mapping[str, Any]) -> Row:
        """Admission whose run and model step (the command's ``run_id``, ``step_run_id``,
        ``project_id``, ``trace_id``) are created in the same transaction, or found the same
        (D59): one transaction instead of ``create_run``, ``add_step_run`` and
        ``admit_invocation``. The answer is ``admit_invocation``'s."""
        return self._command("admit_in_new_run", command)

    def complete_invocation(self, command: Mapping[str, Any]) -> Row:
        """Completion: {"status", "completion", "completion_digest"}."""
        return self._command("complete_invocation", command)

    def resolve_invocation(self, command: Mapping[str, Any]) -> Row:
        """Human resolution of a lost outcome: {"status", "resolution", "resolution_digest"}."""
        return self._command("resolve_invocation", command)

    def recover_expired(self, limit: int = 100, grace_seconds: float = 0.0) -> Row:
        """Settles expired starts without completion as lost: {"count", "recovered", "failed"}
        (a start that could not be settled is skipped and listed in "failed")."""
        result = self._value(RECOVER_EXPIRED_SQL, recovery_arguments(limit, grace_seconds))
        assert isinstance(result, dict)
        return result

    def usage_summary(
        self, project_id: str, since: datetime | None = None, until: datetime | None = None
    ) -> list[Row]:
        """Totals by provider, model and currency over [since, until); unknown cost apart.

        A naive ``since`` or ``until`` is taken as UTC, whatever the session's time zone.
        """
        if not isinstance(project_id, str):
            raise errors.InvalidArgument(
                f"QL3_INVALID_ARGUMENT: project_id must be text, not {type(project_id).__name__}"
            )
        return self._rows(
            "SELECT * FROM ql3_ai.usage_summary(%s, %s, %s)",
            (project_id, as_utc(since), as_utc(until)),
        )

    # -- operator reads (``ql3 invocations``, ``ql3 resolve``, the recovery gauges) -------

    def list_invocations(
        self, projects: Sequence[str] | None = None, limit: int = 100
    ) -> list[Row]:
        """Invocations with their outcome and resolution, newest first: at most ``limit``,
        of the login's projects (row-level security), and of those only ``projects`` when
        given. Timestamps in the record spelling."""
        params = {"projects": check_projects(projects), "limit": check_limit(limit)}
        return self._rows(invocation_reads.RECENT_SQL, params)

    def unresolved_invocations(
        self,
        projects: Sequence[str] | None = None,
        older_than: timedelta = timedelta(0),
        limit: int = 100,
    ) -> list[Row]:
        """The resolution queue: lost invocations no human has resolved, lost at least
        ``older_than`` ago, oldest first, at most ``limit``; ``age_seconds`` runs from the
        lost completion."""
        params = {"projects": check_projects(projects), "older_than": older_than,
                  "limit": check_limit(limit)}  # fmt: skip
        return self._rows(invocation_reads.UNRESOLVED_SQL, params)

    def invocation(self, invocation_id: str) -> Row | None:
        """One invocation: ``start``, ``completion`` and ``resolution`` records with their
        digests, ``resolved_by``, the ``step`` as it is now and its ``usage`` row; None when
        it was never admitted."""
        arguments.check_text_args(invocation_id)
        return self._row(invocation_reads.DETAIL_SQL, (invocation_id,))

    def unresolved_by_project(self, limit: int = 100) -> list[Row]:
        """Lost invocations waiting for a human, by project: ``project``, ``unresolved``
        and ``oldest_age_seconds``, the projects waiting longest first, at most ``limit``."""
        return self._rows(invocation_reads.UNRESOLVED_BY_PROJECT_SQL, (check_limit(limit),))
