"""``ql3 verify`` (D50): a clean database passes, as a read-only role; each kind of
tampering, done as the superuser behind the functions' back, is named and fails; a ledger
that only grew since the snapshot passes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fix_invocations import admission, completion, model_step
from fix_servers import role_dsn
from ql3 import cli, errors
from ql3.invocations import Outcome, Usage
from ql3.migrate import migrate
from ql3.store import PgStore
from ql3.verify import INVARIANTS, take_snapshot, verify_against

PROJECT = "proj"
FAMILY = "policy_routing"


def populate(store: PgStore, pairs: int, *, tag: str = "a") -> None:
    """Pairs (some with usage), one step left running, activations and a revocation."""
    for i in range(pairs):
        run_id, step_id = model_step(store)
        admitted = store.admit_invocation(admission(run_id, step_id))
        usage = Usage(input_tokens=3, output_tokens=5) if i % 2 else None
        store.complete_invocation(completion(admitted, Outcome.SUCCEEDED, usage=usage, output=b"o"))
    run_id, step_id = model_step(store)
    store.admit_invocation(admission(run_id, step_id))
    first = store.put_revision(PROJECT, FAMILY, f"c-{tag}", {"v": 1}, "tester")
    second = store.put_revision(PROJECT, FAMILY, f"c-{tag}", {"v": 2}, "tester")
    store.activate_revision(PROJECT, FAMILY, f"c-{tag}", first["revision_id"], "tester")
    store.activate_revision(PROJECT, FAMILY, f"c-{tag}", second["revision_id"], "tester")
    store.revoke_revision(first["revision_id"], "tester", "superseded")


@pytest.fixture
def populated(db_dsn: str) -> str:
    with PgStore(db_dsn) as store:
        populate(store, 6)
    return db_dsn


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = cli.main(["verify", *argv])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def snapshot_file(dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    path = str(tmp_path / "snapshot.json")
    code, report = run_cli(capsys, "--dsn", role_dsn(dsn, "reader"), "--snapshot", path)
    assert code == 0, report
    assert report["ok"] and report["violations"] == []
    return path


def tamper(dsn: str, *statements: str) -> None:
    """Run statements as the superuser with the guard triggers off (replica role)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        for statement in statements:
            conn.execute(statement)


def differences_after(
    dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], *statements: str
) -> dict[str, Any]:
    path = snapshot_file(dsn, tmp_path, capsys)
    tamper(dsn, *statements)
    code, report = run_cli(capsys, "--dsn", role_dsn(dsn, "reader"), "--against", path)
    assert code == 1, report
    assert not report["ok"]
    return report


def test_a_clean_database_passes_as_the_reader_role(
    populated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = snapshot_file(populated, tmp_path, capsys)
    document = json.loads(Path(path).read_text())
    assert document["history"]["core"] and document["history"]["ql3_ai"]
    assert any(name.startswith("function ql3_ai.admit_invocation") for name in document["catalog"])
    assert "relation ql3.runs" in document["acl"]
    assert document["ledgers"]["ql3.run_events"]["count"] == 6 * 2 + 1
    # The reader has no SELECT on the operators' tables: recorded, not guessed.
    assert document["ledgers"]["ql3.project_grants"] == {"readable": False}
    code, report = run_cli(capsys, "--dsn", role_dsn(populated, "reader"), "--against", path)
    assert code == 0, report
    assert report["ok"] and report["differences"] == [] and report["violations"] == []
    code, report = run_cli(
        capsys, "--dsn", role_dsn(populated, "reader"), "--against", path, "--exact"
    )
    assert code == 0, report


def test_every_invariant_holds_on_real_traffic(populated: str) -> None:
    taken = take_snapshot(role_dsn(populated, "reader"))
    assert taken.violations == []
    assert {i.name for i in INVARIANTS} >= {
        "start_recorded",
        "completion_recorded",
        "running_step_has_open_start",
        "step_status_is_last_receipt",
        "step_counts",
        "run_counts",
        "run_event_seqs_gap_free",
        "pointer_is_last_outbox_row",
    }


def test_a_ledger_that_only_grew_passes_but_not_exactly(
    populated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = snapshot_file(populated, tmp_path, capsys)
    with PgStore(populated) as store:
        populate(store, 3, tag="b")
        # The running step of the first round completes: its rows progress, none is lost.
        with store.connection() as conn:
            row = conn.execute(
                "SELECT s.invocation_id, s.start_digest FROM ql3_ai.model_invocation_starts s"
                " WHERE NOT EXISTS (SELECT 1 FROM ql3_ai.model_invocation_completions c"
                "                    WHERE c.invocation_id = s.invocation_id) LIMIT 1"
            ).fetchone()
        assert row is not None
        admitted = {"start": {"invocation_id": row[0]}, "start_digest": row[1]}
        store.complete_invocation(completion(admitted, Outcome.FAILED))
    reader = role_dsn(populated, "reader")
    code, report = run_cli(capsys, "--dsn", reader, "--against", path)
    assert code == 0, report
    assert report["tables"]["ql3.runs"]["now"] > report["tables"]["ql3.runs"]["snapshot"]
    code, report = run_cli(capsys, "--dsn", reader, "--against", path, "--exact")
    assert code == 1
    assert any("ledger ql3.runs:" in d and "new (--exact)" in d for d in report["differences"])


TAMPERING: dict[str, tuple[tuple[str, ...], str]] = {
    "altered function": (
        (
            "CREATE OR REPLACE FUNCTION ql3._now() RETURNS timestamptz LANGUAGE sql STABLE"
            " PARALLEL SAFE SECURITY INVOKER AS $$ SELECT pg_catalog.now() - interval '1 h' $$",
        ),
        "catalog: function ql3._now() differs",
    ),
    "disabled trigger": (
        ("ALTER TABLE ql3.run_events DISABLE TRIGGER run_events_immutable",),
        "catalog: trigger ql3.run_events.run_events_immutable differs",
    ),
    "dropped index": (
        ("DROP INDEX ql3.step_runs_running",),
        "catalog: index ql3.step_runs_running is missing",
    ),
    "dropped grant": (
        ("REVOKE EXECUTE ON FUNCTION ql3_ai.admit_invocation(jsonb) FROM ql3_runtime",),
        "acl: function ql3_ai.admit_invocation(jsonb) differs",
    ),
    "added grant": (
        ("GRANT INSERT ON ql3.contract_outbox TO ql3_relay",),
        "acl: relation ql3.contract_outbox differs",
    ),
    "default privileges": (
        ("ALTER DEFAULT PRIVILEGES FOR ROLE ql3_owner GRANT EXECUTE ON FUNCTIONS TO PUBLIC",),
        "acl: default acl of ql3_owner in every schema on functions is missing",
    ),
    "changed ledger row": (
        (
            "UPDATE ql3_ai.usage_ledger SET cost_micros = 1"
            " WHERE invocation_id = (SELECT min(invocation_id) FROM ql3_ai.usage_ledger)",
        ),
        "ledger ql3_ai.usage_ledger: 1 row(s) changed",
    ),
    "changed migration history": (
        ("UPDATE ql3.schema_history SET checksum = repeat('0', 64) WHERE version = 1",),
        "history core:",
    ),
}


@pytest.mark.parametrize("kind", sorted(TAMPERING))
def test_tampering_is_named(
    kind: str, populated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    statements, named = TAMPERING[kind]
    report = differences_after(populated, tmp_path, capsys, *statements)
    assert any(d.startswith(named) for d in report["differences"]), report["differences"]


@pytest.mark.parametrize(
    ("grant", "undo", "named"),
    [
        ("GRANT ql3_owner TO {login}", "", "acl: role ql3_owner differs"),
        (
            "GRANT pg_write_all_data TO ql3_runtime",
            "REVOKE pg_write_all_data FROM ql3_runtime",
            "acl: role ql3_runtime differs",
        ),
        (
            "ALTER ROLE ql3_reader BYPASSRLS",
            "ALTER ROLE ql3_reader NOBYPASSRLS",
            "acl: role ql3_reader differs",
        ),
    ],
)
def test_a_changed_ql3_role_is_named(
    grant: str,
    undo: str,
    named: str,
    populated: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Roles are the cluster's, not the database's: a login given ql3_owner, a ql3 role
    given more, or a ql3 role's attributes changed since the snapshot is a difference,
    named by the role."""
    login = f"verify_login_{tmp_path.name[-12:].replace('-', '_').lower()}"
    with psycopg.connect(populated, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {login} LOGIN")
    try:
        report = differences_after(populated, tmp_path, capsys, grant.format(login=login))
        assert any(d.startswith(named) for d in report["differences"]), report["differences"]
        assert len(report["differences"]) == 1, report["differences"]
    finally:
        with psycopg.connect(populated, autocommit=True) as conn:
            if undo:
                conn.execute(undo)
            conn.execute(f"DROP ROLE {login}")


def test_a_deleted_row_is_named_with_its_key_and_breaks_the_invariants(
    populated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(populated) as conn:
        row = conn.execute(
            "SELECT run_id, seq FROM ql3.run_events ORDER BY run_id, seq LIMIT 1"
        ).fetchone()
    assert row is not None
    run_id, seq = row
    report = differences_after(
        populated,
        tmp_path,
        capsys,
        f"DELETE FROM ql3.run_events WHERE run_id = '{run_id}' AND seq = {seq}",
    )
    assert f'ledger ql3.run_events: 1 row(s) missing: ["{run_id}", {seq}]' in report["differences"]
    broken = " ".join(report["violations"])
    assert "invariant start_recorded" in broken and "invariant run_counts" in broken


def test_a_pointer_that_went_back_is_named(
    populated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = differences_after(
        populated,
        tmp_path,
        capsys,
        "UPDATE ql3.active_revisions SET pointer_version = pointer_version - 1",
        "DELETE FROM ql3.contract_outbox WHERE seq = (SELECT max(seq) FROM ql3.contract_outbox)",
    )
    assert any("ql3.active_revisions: 1 row(s) gone back" in d for d in report["differences"])
    assert any("ql3.contract_outbox: 1 row(s) missing" in d for d in report["differences"])


BROKEN_INVARIANTS: dict[str, tuple[str, ...]] = {
    "step_counts": (
        "UPDATE ql3.step_runs SET version = version + 1"
        " WHERE step_run_id = (SELECT min(step_run_id::text)::uuid FROM ql3.step_runs)",
    ),
    "running_step_has_open_start": (
        "UPDATE ql3.step_runs SET current_invocation_id = 'inv-nobody' WHERE status = 'running'",
    ),
    "step_status_is_last_receipt": (
        "UPDATE ql3.step_runs SET status = 'timed_out', output_ref = NULL"
        " WHERE status = 'succeeded' AND step_run_id = (SELECT min(step_run_id::text)::uuid"
        "                     FROM ql3.step_runs WHERE status = 'succeeded')",
    ),
    "run_event_seqs_gap_free": (
        "UPDATE ql3.run_events SET seq = seq + 10"
        " WHERE (run_id, seq) = (SELECT run_id, max(seq) FROM ql3.run_events GROUP BY run_id"
        "                         ORDER BY run_id LIMIT 1)",
    ),
    "pointer_is_last_outbox_row": ("UPDATE ql3.active_revisions SET active_revision_id = NULL",),
    "completion_recorded": (
        "DELETE FROM ql3.step_run_mutations WHERE to_status = 'succeeded'"
        " AND mutation_id = (SELECT min(mutation_id) FROM ql3.step_run_mutations"
        "                     WHERE to_status = 'succeeded')",
    ),
}


@pytest.mark.parametrize("invariant", sorted(BROKEN_INVARIANTS))
def test_a_broken_invariant_fails_the_snapshot_itself(
    invariant: str, populated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tamper(populated, *BROKEN_INVARIANTS[invariant])
    path = str(tmp_path / "broken.json")
    code, report = run_cli(capsys, "--dsn", role_dsn(populated, "reader"), "--snapshot", path)
    assert code == 1
    assert any(v.startswith(f"invariant {invariant}:") for v in report["violations"]), report
    assert Path(path).exists()  # written all the same: evidence of what was found


def test_undelivered_outbox_rows_fail_only_when_asked(populated: str) -> None:
    reader = role_dsn(populated, "reader")
    assert take_snapshot(reader).violations == []
    violations = take_snapshot(reader, require_delivered=True).violations
    assert [v.invariant for v in violations] == ["outbox_delivered"]
    assert violations[0].count == 3


def test_a_role_that_sees_some_projects_is_refused(populated: str) -> None:
    tamper(populated, "SELECT ql3.grant_project('ql3_test_operator', 'proj')")
    with pytest.raises(errors.PermissionDenied, match="sees only some projects"):
        verify_against(role_dsn(populated, "reader"), {})


@pytest.mark.parametrize(
    "content", ["not json", '{"format": "something else"}', None], ids=["text", "format", "absent"]
)
def test_a_file_that_is_not_a_snapshot_is_refused(
    content: str | None, db_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "snap.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["verify", "--dsn", db_dsn, "--against", str(path)]) == 2
    assert "snap.json" in capsys.readouterr().err


def test_exact_needs_against(db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["verify", "--dsn", db_dsn, "--exact"]) == 2
    assert "--exact goes with --against" in capsys.readouterr().err


def test_a_database_without_the_ai_stream_is_verified_as_core(
    fresh_db: Callable[[], str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = fresh_db()
    migrate(dsn)
    path = str(tmp_path / "core.json")
    code, report = run_cli(capsys, "--dsn", dsn, "--snapshot", path)
    assert code == 0, report
    assert "ql3_ai.model_invocation_starts" not in report["tables"]
    assert json.loads(Path(path).read_text())["history"]["ql3_ai"] is None
    assert run_cli(capsys, "--dsn", dsn, "--against", path)[0] == 0


def test_a_database_without_ql3_is_refused(
    fresh_db: Callable[[], str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["verify", "--dsn", fresh_db()]) == 1
    assert "schema ql3 does not exist" in capsys.readouterr().err
