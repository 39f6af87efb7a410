"""``AsyncPgStore``: the invocation half of the store interface for asyncio callers.

The same SQL function calls as ``ql3.store.PgStore`` on psycopg's asyncio connections, so
an asyncio service (``ql3.gateway.ModelGateway`` above all) waits for the database on its
event loop instead of handing every call to a worker thread and back (D24). The pool is
autocommit like PgStore's: each call is one statement, one transaction, one round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg_pool import AsyncConnectionPool

from ql3 import arguments, pooler
from ql3.db import Timeouts, make_async_pool, translated
from ql3.db_guard import bounded_async, checked_out_async
from ql3.invocations import recovery_arguments
from ql3.store import (
    ADD_STEP_RUN_SQL,
    CREATE_RUN_SQL,
    RECOVER_EXPIRED_SQL,
    Row,
    command_json,
    command_sql,
)


class AsyncPgStore:
    """``async with AsyncPgStore(dsn) as store: await store.admit_invocation(command)``.

    Pass a conninfo string or an ``AsyncConnectionPool`` of your own (used as it is). The
    store's own pool opens on first use (or ``open()``) and closes with ``close()``.
    """

    def __init__(
        self,
        conninfo_or_pool: str | AsyncConnectionPool,
        *,
        timeouts: Timeouts | None = None,
        max_connections: int = 8,
    ) -> None:
        arguments.check_count("max_connections", max_connections, 1)
        self._call_limit = (timeouts or Timeouts()).call_limit()
        if isinstance(conninfo_or_pool, AsyncConnectionPool):
            self.pool = conninfo_or_pool
            self._owns_pool = False
        else:
            self.pool = make_async_pool(
                conninfo_or_pool, timeouts=timeouts, max_size=max_connections
            )
            self._owns_pool = True
        self._opened = not self._owns_pool

    async def open(self) -> None:
        """Open the store's own pool (its first call does it anyway; opening an open pool
        is a no-op, so concurrent first calls are safe)."""
        if not self._opened:
            await self.pool.open()
            self._opened = True

    async def close(self) -> None:
        if self._owns_pool:
            await self.pool.close()

    async def __aenter__(self) -> AsyncPgStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _value(self, sql: str, params: tuple[Any, ...]) -> Any:
        if not self._opened:
            await self.open()
        with translated(self.pool):
            async with checked_out_async(self.pool.connection) as conn:
                async with bounded_async(self._call_limit):
                    cur = conn.cursor()
                    await pooler.execute_async(conn, cur, sql, params)
                    found = await cur.fetchone()
                    if not conn.autocommit:  # a transactional pool passed in
                        await conn.commit()
                return None if found is None else found[0]

    async def _command(self, function: str, command: Mapping[str, Any]) -> Row:
        result = await self._value(command_sql(function), (command_json(command),))
        assert isinstance(result, dict)
        return result

    # -- runs and steps -------------------------------------------------------------------

    async def create_run(self, project_id: str, trace_id: str, run_id: str | None = None) -> str:
        """Creates a run (idempotent on the same run_id and content); its run_id."""
        arguments.check_text_args(project_id, trace_id)
        arguments.check_uuid_args(run_id)
        return str(await self._value(CREATE_RUN_SQL, (project_id, trace_id, run_id)))

    async def add_step_run(self, run_id: str, kind: str, step_run_id: str | None = None) -> str:
        """Adds a ready step (version 1, attempt_count 0) to a run; its step_run_id."""
        arguments.check_text_args(kind)
        arguments.check_uuid_args(run_id, step_run_id)
        return str(await self._value(ADD_STEP_RUN_SQL, (run_id, kind, step_run_id)))

    # -- model invocations (stream ql3_ai) ------------------------------------------------

    async def admit_invocation(self, command: Mapping[str, Any]) -> Row:
        """Admission: {"status": "created"|"existing", "start", "start_digest"}."""
        return await self._command("admit_invocation", command)

    async def admit_in_new_run(self, command: Mapping[str, Any]) -> Row:
        """``PgStore.admit_in_new_run``: the run, its model step and the admission in one
        transaction (D59)."""
        return await self._command("admit_in_new_run", command)

    async def complete_invocation(self, command: Mapping[str, Any]) -> Row:
        """Completion: {"status", "completion", "completion_digest"}."""
        return await self._command("complete_invocation", command)

    async def resolve_invocation(self, command: Mapping[str, Any]) -> Row:
        """Human resolution of a lost outcome: {"status", "resolution", "resolution_digest"}."""
        return await self._command("resolve_invocation", command)

    async def recover_expired(self, limit: int = 100, grace_seconds: float = 0.0) -> Row:
        """Settles expired starts without completion as lost: {"count", "recovered", "failed"}
        (a start that could not be settled is skipped and listed in "failed")."""
        result = await self._value(RECOVER_EXPIRED_SQL, recovery_arguments(limit, grace_seconds))
        assert isinstance(result, dict)
        return result


__all__ = ["AsyncPgStore"]
