"""The operator reads of model invocations on SQLite: the twins of the statements in
``ql3.invocation_reads`` (``ql3 invocations``, ``ql3 resolve`` and the recovery daemon's
unresolved gauges, with ``--sqlite``).

Rows have the keys, orders and value spellings of PostgreSQL's: record timestamps as the
record spells them, ``recovered`` a boolean, ages in seconds by the store's clock; the
``step`` and ``usage`` of a detail are what PostgreSQL's ``to_jsonb`` makes of the row
(its timestamps in ISO 8601 with ``+00:00``, trailing zeros of the fraction dropped). One
device has no logins: ``resolved_by`` is always None (section 12.1).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final

from ql3.edge.db import Row, Tx, parse_utc, utc_text

_PROJECTS: Final = "(?{n} IS NULL OR {column} IN (SELECT value FROM json_each(?{n})))"

_LIST_COLUMNS: Final = """
SELECT st.invocation_id, st.project_id, st.run_id, st.step_run_id, st.attempt, st.provider,
       st.model, json_extract(st.record, '$.deadline_at') AS deadline_at,
       json_extract(st.record, '$.admitted_at') AS admitted_at,
       c.outcome, c.result_code, c.recovered,
       json_extract(c.record, '$.completed_at') AS completed_at,
       v.decision, v.user_id AS resolved_as, NULL AS resolved_by,
       json_extract(v.record, '$.resolved_at') AS resolved_at
FROM model_invocation_starts AS st
LEFT JOIN model_invocation_completions AS c ON c.invocation_id = st.invocation_id
LEFT JOIN model_invocation_resolutions AS v ON v.invocation_id = st.invocation_id
"""

RECENT_SQL: Final = (
    _LIST_COLUMNS
    + "WHERE "
    + _PROJECTS.format(n=1, column="st.project_id")
    + "\nORDER BY st.admitted_at DESC, st.invocation_id DESC\nLIMIT ?2"
)

# The lost completions' partial index (model_invocation_completions_lost) gives the order
# and the --older-than range, as on PostgreSQL; age is computed from completed_at.
UNRESOLVED_SQL: Final = (
    """
SELECT st.invocation_id, st.project_id, st.run_id, st.step_run_id, st.attempt, st.provider,
       st.model, st.policy_contract_family, st.policy_contract_id, st.policy_revision_id,
       json_extract(st.record, '$.deadline_at') AS deadline_at,
       json_extract(st.record, '$.admitted_at') AS admitted_at,
       c.outcome, c.result_code, c.recovered,
       json_extract(c.record, '$.completed_at') AS completed_at, c.completed_at AS _lost_at
FROM model_invocation_completions AS c
INNER JOIN model_invocation_starts AS st ON st.invocation_id = c.invocation_id
WHERE c.outcome = 'lost'
  AND c.completed_at <= ?2
  AND """
    + _PROJECTS.format(n=1, column="c.project_id")
    + """
  AND NOT EXISTS (
      SELECT 1 FROM model_invocation_resolutions AS v
      WHERE v.invocation_id = c.invocation_id)
ORDER BY c.completed_at, c.invocation_id
LIMIT ?3"""
)

DETAIL_SQL: Final = """
SELECT st.record AS start, st.start_digest, st.step_run_id,
       c.record AS completion, c.completion_digest,
       v.record AS resolution, v.resolution_digest
FROM model_invocation_starts AS st
LEFT JOIN model_invocation_completions AS c ON c.invocation_id = st.invocation_id
LEFT JOIN model_invocation_resolutions AS v ON v.invocation_id = st.invocation_id
WHERE st.invocation_id = ?
"""

UNRESOLVED_BY_PROJECT_SQL: Final = """
SELECT c.project_id AS project, count(*) AS unresolved, min(c.completed_at) AS _oldest
FROM model_invocation_completions AS c
WHERE c.outcome = 'lost'
  AND NOT EXISTS (
      SELECT 1 FROM model_invocation_resolutions AS v
      WHERE v.invocation_id = c.invocation_id)
GROUP BY c.project_id
ORDER BY min(c.completed_at), c.project_id
LIMIT ?
"""

_STEP_SQL: Final = "SELECT * FROM step_runs WHERE step_run_id = ?"
_STEP_TIMESTAMPS: Final = ("created_at", "updated_at")
_USAGE_SQL: Final = "SELECT * FROM usage_ledger WHERE invocation_id = ?"
_USAGE_TIMESTAMPS: Final = ("recorded_at",)


def pg_json_timestamp(text: str) -> str:
    """A stored timestamp as PostgreSQL's ``to_jsonb`` spells a timestamptz in UTC:
    ``2026-12-02T12:00:00.5+00:00`` (no fraction when it is zero)."""
    moment = parse_utc(text)
    spelled = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if moment.microsecond:
        spelled += f".{moment.microsecond:06d}".rstrip("0")
    return spelled + "+00:00"


def _projects(projects: Sequence[str] | None) -> str | None:
    return None if projects is None else json.dumps(list(projects))


def _listed(row: sqlite3.Row) -> Row:
    out = dict(zip(row.keys(), tuple(row), strict=True))
    if out["recovered"] is not None:
        out["recovered"] = bool(out["recovered"])
    return out


def list_invocations(tx: Tx, projects: Sequence[str] | None, limit: int) -> list[Row]:
    return [_listed(row) for row in tx.all(RECENT_SQL, (_projects(projects), limit))]


def unresolved_invocations(
    tx: Tx, projects: Sequence[str] | None, older_than: timedelta, limit: int
) -> list[Row]:
    try:
        cutoff = utc_text(tx.now - older_than)
    except OverflowError:  # before year 1: nothing was lost that long ago
        return []
    rows = []
    for row in tx.all(UNRESOLVED_SQL, (_projects(projects), cutoff, limit)):
        out = _listed(row)
        lost_at = parse_utc(out.pop("_lost_at"))
        out["age_seconds"] = (tx.now - lost_at).total_seconds()
        rows.append(out)
    return rows


def _json_row(tx: Tx, sql: str, key: str, timestamps: Sequence[str]) -> dict[str, Any] | None:
    row = tx.one(sql, (key,))
    if row is None:
        return None
    out = dict(zip(row.keys(), tuple(row), strict=True))
    for column in timestamps:
        out[column] = pg_json_timestamp(out[column])
    return out


def invocation(tx: Tx, invocation_id: str) -> Row | None:
    row = tx.one(DETAIL_SQL, (invocation_id,))
    if row is None:
        return None

    def parsed(column: str) -> Any:
        return None if row[column] is None else json.loads(row[column])

    return {
        "start": parsed("start"),
        "start_digest": row["start_digest"],
        "completion": parsed("completion"),
        "completion_digest": row["completion_digest"],
        "resolution": parsed("resolution"),
        "resolution_digest": row["resolution_digest"],
        "resolved_by": None,
        "step": _json_row(tx, _STEP_SQL, row["step_run_id"], _STEP_TIMESTAMPS),
        "usage": _json_row(tx, _USAGE_SQL, invocation_id, _USAGE_TIMESTAMPS),
    }


def unresolved_by_project(tx: Tx, limit: int) -> list[Row]:
    return [
        {
            "project": row["project"],
            "unresolved": row["unresolved"],
            "oldest_age_seconds": max(0.0, (tx.now - parse_utc(row["_oldest"])).total_seconds()),
        }
        for row in tx.all(UNRESOLVED_BY_PROJECT_SQL, (limit,))
    ]
