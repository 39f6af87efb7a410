"""Runs and steps on SQLite: ``ql3.create_run`` and ``ql3.add_step_run`` of
``sql/core/0003_runs.sql`` as Python transactions (same checks, order and codes)."""

from __future__ import annotations

import re
from typing import Final

from ql3 import errors
from ql3.edge.checks import check_identifier, invalid
from ql3.edge.db import Tx, new_uuid

_KIND: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")


def create_run(tx: Tx, project_id: object, trace_id: object, run_id: str | None) -> str:
    project = check_identifier("project_id", project_id)
    trace = check_identifier("trace_id", trace_id)
    new_id = run_id or new_uuid()
    inserted = tx.run(
        "INSERT INTO runs (run_id, project_id, trace_id, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id) DO NOTHING",
        (new_id, project, trace, tx.now_text, tx.now_text),
    )
    if inserted:
        return new_id
    existing = tx.one("SELECT project_id, trace_id FROM runs WHERE run_id = ?", (new_id,))
    assert existing is not None
    if (existing[0], existing[1]) != (project, trace):
        raise errors.Conflict(
            f"QL3_CONFLICT: run {new_id} exists with project_id '{existing[0]}' "
            f"and trace_id '{existing[1]}'"
        )
    return new_id


def add_step_run(tx: Tx, run_id: str | None, kind: object, step_run_id: str | None) -> str:
    if run_id is None:
        invalid("run_id is required")
    if not isinstance(kind, str) or _KIND.fullmatch(kind) is None:
        shown = "NULL" if kind is None else f"'{kind}'"
        invalid(f"kind must match [a-z][a-z0-9_]{{0,63}}, not {shown}")
    if tx.one("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)) is None:
        raise errors.NotFound(f"QL3_NOT_FOUND: run {run_id} does not exist")
    new_id = step_run_id or new_uuid()
    inserted = tx.run(
        "INSERT INTO step_runs (step_run_id, run_id, kind, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (step_run_id) DO NOTHING",
        (new_id, run_id, kind, tx.now_text, tx.now_text),
    )
    if inserted:
        return new_id
    existing = tx.one("SELECT run_id, kind FROM step_runs WHERE step_run_id = ?", (new_id,))
    assert existing is not None
    if (existing[0], existing[1]) != (run_id, kind):
        raise errors.Conflict(
            f"QL3_CONFLICT: step run {new_id} exists in run {existing[0]} with kind '{existing[1]}'"
        )
    return new_id
