"""``PgStore``: the store interface of SPEC section 10 over PostgreSQL.

Each method is one call of the SQL function of the same name (the SQL functions are the
contract); rows come back as dicts with uuids as strings. Errors are ``ql3.errors``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from psycopg import Connection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from ql3.db import Timeouts, make_pool, translated

Row = dict[str, Any]
ContractKey = tuple[str, str, str]


def _plain(row: Row | None) -> Row | None:
    """The row with uuids as strings, so results compare equal across stores."""
    if row is None:
        return None
    return {k: str(v) if isinstance(v, uuid.UUID) else v for k, v in row.items()}


def _null_row(row: Row | None) -> Row | None:
    """A composite-typed SQL NULL comes back as a row of NULLs: make it None."""
    if row is None or all(v is None for v in row.values()):
        return None
    return _plain(row)


class PgStore:
    """The ql3 store on PostgreSQL. Pass a conninfo string or an open ConnectionPool."""

    def __init__(
        self,
        conninfo_or_pool: str | ConnectionPool,
        *,
        timeouts: Timeouts | None = None,
        max_connections: int = 8,
    ) -> None:
        if isinstance(conninfo_or_pool, ConnectionPool):
            self.pool = conninfo_or_pool
            self._owns_pool = False
        else:
            self.pool = make_pool(conninfo_or_pool, timeouts=timeouts, max_size=max_connections)
            self._owns_pool = True

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> PgStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated(), self.pool.connection() as conn:
            return self._rows_on(conn, sql, params)

    @staticmethod
    def _rows_on(conn: Connection[Any], sql: str, params: Sequence[Any]) -> list[Row]:
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def _row(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self._rows(sql, params)
        return rows[0] if rows else None

    def _value(self, sql: str, params: Sequence[Any] = ()) -> Any:
        with translated(), self.pool.connection() as conn:
            found = conn.execute(sql, params).fetchone()
            return None if found is None else found[0]

    # -- contract revisions ---------------------------------------------------------------

    def put_revision(
        self, project_id: str, contract_family: str, contract_id: str, body: Any, actor: str
    ) -> Row:
        """Stores an immutable revision, or returns the one with the same body."""
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
        """Makes the revision active; the outbox event, or None when it already was."""
        return _null_row(
            self._row(
                "SELECT * FROM ql3.activate_revision(%s, %s, %s, %s::uuid, %s, %s::uuid)",
                (project_id, contract_family, contract_id, revision_id, actor,
                 expected_active_revision_id),
            )
        )  # fmt: skip

    def revoke_revision(self, revision_id: str, actor: str, reason: str) -> Row | None:
        """Revokes for good; the outbox event, or None when it was already revoked."""
        return _null_row(
            self._row(
                "SELECT * FROM ql3.revoke_revision(%s::uuid, %s, %s)", (revision_id, actor, reason)
            )
        )

    def active_revision(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> Row | None:
        """The active revision with its pointer_version, or None."""
        return _plain(
            self._row(
                "SELECT * FROM ql3.active_revision(%s, %s, %s)",
                (project_id, contract_family, contract_id),
            )
        )

    def active_pointers(self, keys: Iterable[ContractKey]) -> list[Row]:
        """One row per key (revision_id None when none is active), in one round trip."""
        rows = self._rows(
            "SELECT * FROM ql3.active_pointers(%s)", (Jsonb([list(k) for k in keys]),)
        )
        return [r for r in map(_plain, rows) if r is not None]

    def revision(self, revision_id: str) -> Row | None:
        """One stored revision by id (active or not), or None."""
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
