"""``EdgeStore``: the store interface of SPEC section 10 on one SQLite file.

Method for method what ``PgStore`` offers, with the same arguments, results (rows as
dicts, uuids as strings, commands and results as the SQL JSON) and errors; each write is
one ``BEGIN IMMEDIATE`` transaction. Opening a store migrates the file (core, and
``ql3_ai`` when ``ai``) and then requires exact readiness, the order the seed asks for:
migrate, check, only then serve.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ql3 import arguments, errors, invocation_reads
from ql3.edge import contracts, runs, schema
from ql3.edge.db import Clock, CrashHook, Database, JournalMode, Row, parse_uuid, plain
from ql3.migration_files import Applied

ContractKey = tuple[str, str, str]


class EdgeStore:
    """The ql3 store on SQLite (the edge shim).

    ``journal_mode`` ``"wal"`` runs with ``synchronous=FULL``, ``"delete"`` with
    ``synchronous=EXTRA`` (FULL is not durable on power loss in DELETE mode). ``ai`` turns
    the model-invocation feature on: its tables and ledger exist only then.

    ``clock`` is for tests only: it replaces the database clock (every ``created_at``,
    ``admitted_at``... and the clock recovery compares deadlines with) so that records can
    be compared byte for byte with PostgreSQL's under a pinned ``ql3._now()``. ``clock``
    may also be assigned later. ``_crash_point`` is the crash-window test hook: when set,
    it is called with ``"<procedure>:<boundary>"`` at every statement boundary inside a
    procedure and with ``"<procedure>:after_commit"`` after COMMIT.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        journal_mode: JournalMode = "wal",
        ai: bool = True,
        busy_timeout_ms: int = 5000,
        clock: Clock | None = None,
        *,
        migrate: bool = True,
        _crash_point: CrashHook | None = None,
    ) -> None:
        self.path = str(Path(path))
        self.journal_mode: JournalMode = journal_mode
        self.ai = ai
        self.busy_timeout_ms = arguments.check_count("busy_timeout_ms", busy_timeout_ms, 0)
        self._db = Database(
            self.path, journal_mode=journal_mode, busy_timeout_ms=busy_timeout_ms, clock=clock
        )
        self.applied: list[Applied] = []
        """The migrations this constructor applied (empty when the file was up to date)."""
        try:
            if migrate:
                self.applied = self.migrate()
            report = self.ready()
            if not report.ok:
                raise errors.MigrationError(
                    f"{self.path} is not ready for ql3 (ai={ai}):\n{report.describe()}"
                )
        except BaseException:
            self._db.close()
            raise
        self._crash_point = _crash_point

    @classmethod
    def checked(
        cls, path: str | os.PathLike[str], *, ai: bool = True, busy_timeout_ms: int = 5000
    ) -> EdgeStore:
        """A store on a ql3 edge file that already exists and is migrated, in the journal
        mode the file already has: what the ``ql3`` commands open for ``--sqlite``.

        Unlike the constructor it creates nothing, migrates nothing and changes no
        setting of the file: a mistyped path, a file some other program uses, or one that
        its application has not migrated yet is refused as ``Misconfigured``.
        """
        where = Path(path)
        if not where.is_file():
            raise errors.Misconfigured(
                f"QL3_INVALID_ARGUMENT: no SQLite file at {where} (ql3 creates edge files "
                "only when an application opens them with ql3.edge.EdgeStore)"
            )
        mode = schema.file_journal_mode(where)
        if mode != "wal" and mode != "delete":
            raise errors.Misconfigured(
                f"QL3_INVALID_ARGUMENT: {where} is in journal_mode {mode}; a ql3 edge file "
                "is in wal or delete"
            )
        try:
            journal: JournalMode = "wal" if mode == "wal" else "delete"
            return cls(where, journal, ai=ai, busy_timeout_ms=busy_timeout_ms, migrate=False)
        except errors.MigrationError as exc:
            raise errors.Misconfigured(
                f"QL3_INVALID_ARGUMENT: {exc.message} (the application migrates its edge file "
                "when it opens it with ql3.edge.EdgeStore)"
            ) from None

    # -- lifecycle and test hooks ---------------------------------------------------------

    @property
    def clock(self) -> Clock:
        return self._db.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._db.clock = clock

    @property
    def _crash_point(self) -> CrashHook | None:
        return self._db.crash_point

    @_crash_point.setter
    def _crash_point(self, hook: CrashHook | None) -> None:
        self._db.crash_point = hook

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> EdgeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def migrate(self) -> list[Applied]:
        """Apply pending migrations (core, then ql3_ai when ``ai``); what was applied."""
        return schema.migrate_edge(self._db, ai=self.ai)

    def ready(self) -> schema.EdgeReadyReport:
        """Exact readiness of the file: ledgers, pending files, owned tables."""
        return schema.ready_report(self._db, ai=self.ai)

    def on_outbox_commit(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after each COMMIT that wrote outbox rows; returns a remover.

        The edge twin of the outbox trigger's NOTIFY: it fires at COMMIT only, so a rolled
        back activation wakes nobody. ``EdgeRelay`` uses it.
        """
        return self._db.on_outbox_commit(listener)

    def contract_families(self) -> dict[str, float]:
        """Max staleness in seconds of each known contract family."""
        with self._db.read() as tx:
            return contracts.contract_families(tx)

    # -- contract revisions ---------------------------------------------------------------

    def put_revision(
        self, project_id: str, contract_family: str, contract_id: str, body: Any, actor: str
    ) -> Row:
        """Stores an immutable revision, or returns the one with the same body."""
        arguments.check_text_args(project_id, contract_family, contract_id, actor)
        with self._db.write("put_revision") as tx:
            return contracts.put_revision(tx, project_id, contract_family, contract_id, body, actor)

    def activate_revision(
        self,
        project_id: str,
        contract_family: str,
        contract_id: str,
        revision_id: str,
        actor: str,
        expected_active_revision_id: str | None = None,
    ) -> Row | None:
        """Makes the revision active; the outbox event, or None when it already was (as
        PgStore: nothing is written, D3)."""
        arguments.check_text_args(project_id, contract_family, contract_id, actor)
        revision = parse_uuid(revision_id)
        expected = parse_uuid(expected_active_revision_id)
        with self._db.write("activate_revision") as tx:
            return contracts.activate_revision(
                tx, project_id, contract_family, contract_id, revision, actor, expected
            )

    def revoke_revision(self, revision_id: str, actor: str, reason: str) -> Row | None:
        """Revokes for good; the outbox event, or None when it was already revoked."""
        arguments.check_text_args(actor, reason)
        revision = parse_uuid(revision_id)
        with self._db.write("revoke_revision") as tx:
            return contracts.revoke_revision(tx, revision, actor, reason)

    def active_revision(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> Row | None:
        """The active revision with its pointer_version, or None."""
        with self._db.read() as tx:
            return contracts.active_revision(tx, project_id, contract_family, contract_id)

    def active_pointers(self, keys: Iterable[ContractKey]) -> list[Row]:
        """One row per key (revision_id None when none is active), from one snapshot."""
        with self._db.read() as tx:
            return contracts.active_pointers(tx, keys)

    def active_revisions(self, keys: Iterable[ContractKey]) -> list[Row]:
        """``active_pointers`` rows with ``revision_no``, ``body`` and ``body_hash`` of the
        active revision (None when none is active), all from one snapshot.

        What a revision cache loads (on PostgreSQL ``ql3.cache`` reads the same in one
        statement): with two reads, an activation committed between them would pair "none
        active" with the pointer_version of the activation.
        """
        with self._db.read() as tx:
            rows = contracts.active_pointers(tx, keys)
            for row in rows:
                found = None
                if row["revision_id"] is not None:
                    found = contracts.active_revision(
                        tx, row["project_id"], row["contract_family"], row["contract_id"]
                    )
                for column in ("revision_no", "body", "body_hash"):
                    row[column] = None if found is None else found[column]
            return rows

    def revision(self, revision_id: str) -> Row | None:
        """One stored revision by id (active or not), or None."""
        revision = parse_uuid(revision_id)
        with self._db.read() as tx:
            return plain(
                tx.one("SELECT * FROM contract_revisions WHERE revision_id = ?", (revision,))
            )

    # -- the outbox (what ql3.claim_outbox and friends do for the PostgreSQL relay) -------

    def claim_outbox(self, limit: int) -> list[Row]:
        """Up to ``limit`` undelivered outbox rows in seq order."""
        with self._db.read() as tx:
            return contracts.claim_outbox(tx, limit)

    def outbox_after(self, after: int, limit: int) -> list[Row]:
        """Up to ``limit`` outbox rows with a seq above ``after``, delivered or not, in seq
        order: what an ``EdgeRelay``'s local subscribers follow."""
        with self._db.read() as tx:
            return contracts.outbox_after(tx, after, limit)

    def mark_outbox_delivered(self, seqs: Sequence[int]) -> int:
        """Marks rows delivered (already delivered ones are left alone); how many changed."""
        with self._db.write("mark_outbox_delivered") as tx:
            return contracts.mark_outbox_delivered(tx, seqs)

    def mark_outbox_failed(self, seqs: Sequence[int], error: str | None) -> int:
        """Records a failed delivery attempt; the rows stay undelivered."""
        with self._db.write("mark_outbox_failed") as tx:
            return contracts.mark_outbox_failed(tx, seqs, error)

    def prune_outbox(self, delivered_before: timedelta, batch: int) -> int:
        """``ql3.prune_outbox`` (D55, D65), one transaction: removes at most ``batch``
        delivered outbox rows delivered more than ``delivered_before`` ago, oldest first,
        never an undelivered row or a pointer's newest; how many it removed."""
        with self._db.write("prune_outbox") as tx:
            return contracts.prune_outbox(tx, delivered_before, batch)

    def outbox_backlog(self) -> Row:
        """Undelivered outbox rows, oldest age in seconds, highest seq."""
        with self._db.read() as tx:
            return contracts.outbox_backlog(tx)

    # -- runs and steps -------------------------------------------------------------------

    def create_run(self, project_id: str, trace_id: str, run_id: str | None = None) -> str:
        """Creates a run (idempotent on the same run_id and content); its run_id."""
        arguments.check_text_args(project_id, trace_id)
        run = parse_uuid(run_id)
        with self._db.write("create_run") as tx:
            return runs.create_run(tx, project_id, trace_id, run)

    def add_step_run(self, run_id: str, kind: str, step_run_id: str | None = None) -> str:
        """Adds a ready step (version 1, attempt_count 0) to a run; its step_run_id."""
        arguments.check_text_args(kind)
        run, step = parse_uuid(run_id), parse_uuid(step_run_id)
        with self._db.write("add_step_run") as tx:
            return runs.add_step_run(tx, run, kind, step)

    def step_run(self, step_run_id: str) -> Row | None:
        """The step row as it is now, or None."""
        step = parse_uuid(step_run_id)
        with self._db.read() as tx:
            return plain(tx.one("SELECT * FROM step_runs WHERE step_run_id = ?", (step,)))

    def run(self, run_id: str) -> Row | None:
        """The run row as it is now, or None."""
        run = parse_uuid(run_id)
        with self._db.read() as tx:
            return plain(tx.one("SELECT * FROM runs WHERE run_id = ?", (run,)))

    # -- model invocations (stream ql3_ai) ------------------------------------------------
    # ql3.edge.invocations is imported by these methods only: a store opened with ai=False
    # never loads it (the seed: an edge build without AI loads no model-invocation code).

    def _require_ai(self, name: str) -> None:
        if not self.ai:
            # PostgreSQL without the feature has no ql3_ai functions at all (SQLSTATE 42883).
            raise errors.DatabaseError(
                f"{name} needs the ql3_ai feature, which this store was opened without (ai=False)"
            )

    def admit_invocation(self, command: Mapping[str, Any]) -> Row:
        """Admission: {"status": "created"|"existing", "start", "start_digest"}."""
        self._require_ai("admit_invocation")
        from ql3.edge import invocations

        with self._db.write("admission") as tx:
            return invocations.admit_invocation(tx, command)

    def admit_in_new_run(self, command: Mapping[str, Any]) -> Row:
        """``ql3_ai.admit_in_new_run``: the run, its model step and the admission in one
        transaction (D59)."""
        self._require_ai("admit_in_new_run")
        from ql3.edge import invocations

        with self._db.write("admission") as tx:
            return invocations.admit_in_new_run(tx, command)

    def complete_invocation(self, command: Mapping[str, Any]) -> Row:
        """Completion: {"status", "completion", "completion_digest"}."""
        self._require_ai("complete_invocation")
        from ql3.edge import invocations

        with self._db.write("completion") as tx:
            return invocations.complete_invocation(tx, command)

    def resolve_invocation(self, command: Mapping[str, Any]) -> Row:
        """Human resolution of a lost outcome: {"status", "resolution", "resolution_digest"}."""
        self._require_ai("resolve_invocation")
        from ql3.edge import invocations

        with self._db.write("resolution") as tx:
            return invocations.resolve_invocation(tx, command)

    def recover_expired(self, limit: int = 100, grace_seconds: float = 0.0) -> Row:
        """Settles expired starts without completion as lost: {"count", "recovered", "failed"}
        (a start that could not be settled is skipped and listed in "failed")."""
        self._require_ai("recover_expired")
        from ql3.edge import invocations

        with self._db.write("recovery") as tx:
            return invocations.recover_expired(tx, limit, grace_seconds)

    def usage_summary(
        self, project_id: str, since: datetime | None = None, until: datetime | None = None
    ) -> list[Row]:
        """Totals by provider, model and currency over [since, until); unknown cost apart."""
        self._require_ai("usage_summary")
        from ql3.edge import invocations

        with self._db.read() as tx:
            return invocations.usage_summary(tx, project_id, since, until)

    # -- operator reads (``ql3 invocations``, ``ql3 resolve``, the recovery gauges) -------
    # The same rows as PgStore's (ql3.invocation_reads), by the store's clock.

    def list_invocations(
        self, projects: Sequence[str] | None = None, limit: int = 100
    ) -> list[Row]:
        """Invocations with their outcome and resolution, newest first: at most ``limit``,
        only ``projects`` when given. Timestamps in the record spelling."""
        self._require_ai("list_invocations")
        from ql3.edge import invocation_reads as reads

        chosen = invocation_reads.check_projects(projects)
        limit = invocation_reads.check_limit(limit)
        with self._db.read() as tx:
            return reads.list_invocations(tx, chosen, limit)

    def unresolved_invocations(
        self,
        projects: Sequence[str] | None = None,
        older_than: timedelta = timedelta(0),
        limit: int = 100,
    ) -> list[Row]:
        """The resolution queue: lost invocations no human has resolved, lost at least
        ``older_than`` ago, oldest first, at most ``limit``; ``age_seconds`` runs from the
        lost completion."""
        self._require_ai("unresolved_invocations")
        from ql3.edge import invocation_reads as reads

        chosen = invocation_reads.check_projects(projects)
        limit = invocation_reads.check_limit(limit)
        if not isinstance(older_than, timedelta):
            raise errors.InvalidArgument("QL3_INVALID_ARGUMENT: older_than must be a timedelta")
        with self._db.read() as tx:
            return reads.unresolved_invocations(tx, chosen, older_than, limit)

    def invocation(self, invocation_id: str) -> Row | None:
        """One invocation: ``start``, ``completion`` and ``resolution`` records with their
        digests, ``resolved_by`` (None: a device has no logins), the ``step`` as it is now
        and its ``usage`` row; None when it was never admitted."""
        self._require_ai("invocation")
        from ql3.edge import invocation_reads as reads

        arguments.check_text_args(invocation_id)
        with self._db.read() as tx:
            return reads.invocation(tx, invocation_id)

    def unresolved_by_project(self, limit: int = 100) -> list[Row]:
        """Lost invocations waiting for a human, by project: ``project``, ``unresolved``
        and ``oldest_age_seconds``, the projects waiting longest first, at most ``limit``."""
        self._require_ai("unresolved_by_project")
        from ql3.edge import invocation_reads as reads

        limit = invocation_reads.check_limit(limit)
        with self._db.read() as tx:
            return reads.unresolved_by_project(tx, limit)
