"""Contract revisions, active pointers and the outbox on SQLite: the procedures of
``sql/core/0002_contracts.sql`` as Python transactions (same checks, order and codes).

Each function runs inside the caller's ``Tx`` (one ``BEGIN IMMEDIATE`` transaction), so
the pointer row is "locked" by the write lock the transaction already holds.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any, Final

from ql3 import canonical, errors
from ql3.arguments import check_prune, check_text_args
from ql3.edge.checks import check_identifier, checked_digest, invalid, json_type
from ql3.edge.db import Row, Tx, new_uuid, parse_utc, plain, utc_text, uuid_v7

BODY_DOMAIN = canonical.BODY_DOMAIN

_OUTBOX_INSERT: Final = """
INSERT INTO contract_outbox (event_id, event_type, project_id, contract_family, contract_id,
                             old_revision_id, new_revision_id, pointer_version, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
RETURNING *
"""


def check_family(tx: Tx, family: object) -> str:
    """``ql3._check_family``: an identifier that names a row of contract_families."""
    name = check_identifier("contract_family", family)
    if tx.one("SELECT 1 FROM contract_families WHERE contract_family = ?", (name,)) is None:
        invalid(f"unknown contract family '{name}'")
    return name


def _lock_pointer(
    tx: Tx, project_id: str, family: str, contract_id: str, actor: str
) -> sqlite3.Row:
    """The pointer row of a contract, created empty on first use (the write lock is held)."""
    key = (project_id, family, contract_id)
    pointer = tx.one(
        "SELECT * FROM active_revisions"
        " WHERE project_id = ? AND contract_family = ? AND contract_id = ?",
        key,
    )
    if pointer is None:
        pointer = tx.one(
            "INSERT INTO active_revisions (project_id, contract_family, contract_id, updated_at,"
            " updated_by) VALUES (?, ?, ?, ?, ?) RETURNING *",
            (*key, tx.now_text, actor),
        )
    assert pointer is not None
    return pointer


def _revision_of(tx: Tx, revision_id: str | None) -> sqlite3.Row:
    if revision_id is None:
        invalid("revision_id is required")
    revision = tx.one("SELECT * FROM contract_revisions WHERE revision_id = ?", (revision_id,))
    if revision is None:
        raise errors.NotFound(f"QL3_NOT_FOUND: revision {revision_id} does not exist")
    return revision


def _revision_row(row: sqlite3.Row | None) -> Row:
    result = plain(row)
    assert result is not None
    return result


def put_revision(
    tx: Tx, project_id: object, family: object, contract_id: object, body: Any, actor: object
) -> Row:
    project = check_identifier("project_id", project_id)
    family_name = check_family(tx, family)
    contract = check_identifier("contract_id", contract_id)
    actor_name = check_identifier("actor", actor)
    if not isinstance(body, dict):
        invalid(f"body must be a JSON object, not {'NULL' if body is None else json_type(body)}")
    body_hash, body_text = checked_digest("body", BODY_DOMAIN, body)

    _lock_pointer(tx, project, family_name, contract, actor_name)
    key = (project, family_name, contract)
    existing = tx.one(
        "SELECT * FROM contract_revisions WHERE project_id = ? AND contract_family = ?"
        " AND contract_id = ? AND body_hash = ?",
        (*key, body_hash),
    )
    if existing is not None:
        return _revision_row(existing)
    numbered = tx.one(
        "UPDATE active_revisions SET last_revision_no = last_revision_no + 1"
        " WHERE project_id = ? AND contract_family = ? AND contract_id = ?"
        " RETURNING last_revision_no",
        key,
    )
    assert numbered is not None
    return _revision_row(
        tx.one(
            "INSERT INTO contract_revisions (revision_id, project_id, contract_family, contract_id,"
            " revision_no, body, body_hash, created_at, created_by)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING *",
            (new_uuid(), *key, numbered[0], body_text, body_hash, tx.now_text, actor_name),
        )
    )


def _outbox(
    tx: Tx,
    event_type: str,
    key: Sequence[str],
    old_revision_id: str | None,
    new_revision_id: str,
    pointer_version: int,
) -> Row:
    row = tx.one(
        _OUTBOX_INSERT,
        (uuid_v7(), event_type, *key, old_revision_id, new_revision_id, pointer_version,
         tx.now_text),
    )  # fmt: skip
    tx.outbox_rows += 1
    return _revision_row(row)


def activate_revision(
    tx: Tx,
    project_id: object,
    family: object,
    contract_id: object,
    revision_id: str | None,
    actor: object,
    expected_active_revision_id: str | None,
) -> Row | None:
    project = check_identifier("project_id", project_id)
    family_name = check_family(tx, family)
    contract = check_identifier("contract_id", contract_id)
    actor_name = check_identifier("actor", actor)
    revision = _revision_of(tx, revision_id)
    key = (project, family_name, contract)
    owner = (revision["project_id"], revision["contract_family"], revision["contract_id"])
    if owner != key:
        invalid(f"revision {revision_id} belongs to {'/'.join(owner)}, not {'/'.join(key)}")
    pointer = _lock_pointer(tx, *key, actor_name)
    if tx.one("SELECT 1 FROM revision_revocations WHERE revision_id = ?", (revision_id,)):
        raise errors.RevisionRevoked(
            f"QL3_REVISION_REVOKED: revision {revision_id} is revoked and cannot be activated"
        )
    active = pointer["active_revision_id"]
    if expected_active_revision_id is not None and active != expected_active_revision_id:
        raise errors.Conflict(
            f"QL3_CONFLICT: expected active revision {expected_active_revision_id} "
            f"but {active or 'none'} is active",
            detail=active or "",
        )
    if active == revision_id:
        return None
    version = int(pointer["pointer_version"]) + 1
    tx.run(
        "UPDATE active_revisions SET active_revision_id = ?, pointer_version = ?, updated_at = ?,"
        " updated_by = ? WHERE project_id = ? AND contract_family = ? AND contract_id = ?",
        (revision_id, version, tx.now_text, actor_name, *key),
    )
    assert revision_id is not None
    return _outbox(tx, "revision_activated", key, active, revision_id, version)


def revoke_revision(tx: Tx, revision_id: str | None, actor: object, reason: object) -> Row | None:
    actor_name = check_identifier("actor", actor)
    if not isinstance(reason, str) or reason == "" or len(reason) > 1024:
        invalid("reason is required (1..1024 characters)")
    revision = _revision_of(tx, revision_id)
    key = (revision["project_id"], revision["contract_family"], revision["contract_id"])
    pointer = _lock_pointer(tx, *key, actor_name)
    if tx.one("SELECT 1 FROM revision_revocations WHERE revision_id = ?", (revision_id,)):
        return None
    tx.run(
        "INSERT INTO revision_revocations (revision_id, reason, revoked_at, revoked_by)"
        " VALUES (?, ?, ?, ?)",
        (revision_id, reason, tx.now_text, actor_name),
    )
    active = pointer["active_revision_id"]
    version = int(pointer["pointer_version"])
    if active == revision_id:
        version += 1
        tx.run(
            "UPDATE active_revisions SET active_revision_id = NULL, pointer_version = ?,"
            " updated_at = ?, updated_by = ?"
            " WHERE project_id = ? AND contract_family = ? AND contract_id = ?",
            (version, tx.now_text, actor_name, *key),
        )
    assert revision_id is not None
    return _outbox(tx, "revision_revoked", key, active, revision_id, version)


def active_revision(tx: Tx, project_id: object, family: object, contract_id: object) -> Row | None:
    check_text_args(project_id, family, contract_id)
    return plain(
        tx.one(
            "SELECT r.revision_id, r.revision_no, r.body, r.body_hash, a.pointer_version"
            " FROM active_revisions AS a"
            " JOIN contract_revisions AS r ON r.revision_id = a.active_revision_id"
            " WHERE a.project_id = ? AND a.contract_family = ? AND a.contract_id = ?",
            (project_id, family, contract_id),
        )
    )


def active_pointers(tx: Tx, keys: Iterable[Any]) -> list[Row]:
    checked: list[tuple[str, str, str]] = []
    if not isinstance(keys, Iterable):
        invalid("keys must be an array of [project_id, contract_family, contract_id]")
    for key in keys:
        if (
            not isinstance(key, list | tuple)
            or len(key) != 3
            or not all(isinstance(part, str) for part in key)
        ):
            invalid("keys must be an array of [project_id, contract_family, contract_id]")
        check_text_args(*key)
        checked.append((key[0], key[1], key[2]))
    rows: list[Row] = []
    for key in checked:
        found = tx.one(
            "SELECT active_revision_id, pointer_version FROM active_revisions"
            " WHERE project_id = ? AND contract_family = ? AND contract_id = ?",
            key,
        )
        rows.append(
            {
                "project_id": key[0],
                "contract_family": key[1],
                "contract_id": key[2],
                "revision_id": None if found is None else found[0],
                "pointer_version": 0 if found is None else int(found[1]),
            }
        )
    return rows


def claim_outbox(tx: Tx, limit: object) -> list[Row]:
    """Up to ``limit`` undelivered rows in seq order (SQLite has one writer: no SKIP LOCKED)."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10000:
        invalid("limit must be 1..10000")
    rows = tx.all(
        "SELECT * FROM contract_outbox WHERE delivered_at IS NULL ORDER BY seq LIMIT ?", (limit,)
    )
    return [_revision_row(r) for r in rows]


def outbox_after(tx: Tx, after: int, limit: int) -> list[Row]:
    """Up to ``limit`` rows with a seq above ``after``, in seq order, delivered or not (one
    writer at a time: seqs commit in order, so a cursor over them misses none)."""
    rows = tx.all(
        "SELECT * FROM contract_outbox WHERE seq > ? ORDER BY seq LIMIT ?", (int(after), limit)
    )
    return [_revision_row(r) for r in rows]


def mark_outbox_delivered(tx: Tx, seqs: Sequence[int]) -> int:
    changed = 0
    for seq in seqs:
        changed += tx.run(
            "UPDATE contract_outbox SET delivered_at = ?, relay_attempts = relay_attempts + 1,"
            " last_error = NULL WHERE seq = ? AND delivered_at IS NULL",
            (tx.now_text, int(seq)),
        )
    return changed


def mark_outbox_failed(tx: Tx, seqs: Sequence[int], error: str | None) -> int:
    message = (error or "unknown error")[:2000]
    changed = 0
    for seq in seqs:
        changed += tx.run(
            "UPDATE contract_outbox SET relay_attempts = relay_attempts + 1, last_error = ?"
            " WHERE seq = ? AND delivered_at IS NULL",
            (message, int(seq)),
        )
    return changed


def prune_outbox(tx: Tx, delivered_before: object, batch: object) -> int:
    """``ql3.prune_outbox`` (D55, D65): removes at most ``batch`` delivered rows delivered
    before ``now - delivered_before``, oldest seq first, each only while its pointer_version
    is below its pointer's (so each pointer's newest row stays); how many. One writer at a
    time: no relay can hold a row meanwhile, so there is nothing to skip."""
    retention, limit = check_prune(delivered_before, batch)
    try:
        cutoff = tx.now - retention
    except OverflowError:  # before year 1 (a pinned clock): nothing was delivered then
        return 0
    return tx.run(
        "DELETE FROM contract_outbox WHERE seq IN ("
        " SELECT o.seq FROM contract_outbox AS o JOIN active_revisions AS a"
        " ON a.project_id = o.project_id AND a.contract_family = o.contract_family"
        " AND a.contract_id = o.contract_id"
        " WHERE o.delivered_at IS NOT NULL AND o.delivered_at < ?"
        " AND o.pointer_version < a.pointer_version"
        " ORDER BY o.seq LIMIT ?)",
        (utc_text(cutoff), limit),
    )


def outbox_backlog(tx: Tx) -> Row:
    row = tx.one("SELECT count(*), min(created_at) FROM contract_outbox WHERE delivered_at IS NULL")
    top = tx.one("SELECT coalesce(max(seq), 0) FROM contract_outbox")
    assert row is not None and top is not None
    oldest = 0.0
    if row[1] is not None:
        created = parse_utc(row[1])
        oldest = max(0.0, (tx.now - created).total_seconds())
    return {"undelivered": int(row[0]), "oldest_age_seconds": oldest, "max_seq": int(top[0])}


def contract_families(tx: Tx) -> dict[str, float]:
    rows = tx.all("SELECT contract_family, max_staleness_seconds FROM contract_families")
    return {str(r[0]): float(r[1]) for r in rows}
