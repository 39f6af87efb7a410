"""Outbox retention (D55): ``ql3.prune_outbox`` beside a relay's open claim, ``ql3 prune``.

tests/sql/18_prune.sql holds the function's rules in one transaction; these tests need
real sessions: a relay claim (rows locked FOR UPDATE by claim_outbox, then marked
delivered, not yet committed) and another lock holder while the prune runs. The prune
must neither wait on them nor remove their rows, and the relay's claim order stays seq.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from fix_servers import role_dsn
from ql3 import cli, errors
from ql3.recovery import RecoveryConfig, RecoveryLoop, config_from_args
from ql3.store import PgStore


def write_events(dsn: str, count: int, contract: str = "prune") -> list[int]:
    """``count`` activations of one contract, flipping between two revisions; their seqs."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        revisions = []
        for n in range(2):
            row = conn.execute(
                "SELECT revision_id FROM ql3.put_revision('p', 'policy_routing', %s,"
                " %s::jsonb, 'test')",
                (contract, Jsonb({"n": n})),
            ).fetchone()
            assert row is not None
            revisions.append(row[0])
        seqs = []
        for i in range(count):
            row = conn.execute(
                "SELECT seq FROM ql3.activate_revision('p', 'policy_routing', %s, %s, 'test')",
                (contract, revisions[i % 2]),
            ).fetchone()
            assert row is not None and row[0] is not None
            seqs.append(int(row[0]))
        return seqs


def deliver_long_ago(dsn: str, seqs: list[int], age: str = "2 days") -> None:
    """Mark rows delivered, then move delivered_at back (as the superuser)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ql3.mark_outbox_delivered(%s)", (seqs,))
        conn.execute(
            "UPDATE ql3.contract_outbox SET delivered_at = now() - %s::interval"
            " WHERE seq = ANY(%s)",
            (age, seqs),
        )


def present(dsn: str, seqs: list[int]) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT seq FROM ql3.contract_outbox WHERE seq = ANY(%s) ORDER BY seq", (seqs,)
        ).fetchall()
    return [int(seq) for (seq,) in rows]


def test_prune_neither_waits_on_nor_removes_claimed_rows(db_dsn: str) -> None:
    seqs = write_events(db_dsn, 10)
    deliver_long_ago(db_dsn, seqs[:6])
    relay_dsn, operator_dsn = role_dsn(db_dsn, "relay"), role_dsn(db_dsn, "operator")
    with (
        psycopg.connect(relay_dsn) as relay,
        psycopg.connect(db_dsn) as holder,
        psycopg.connect(operator_dsn, autocommit=True) as operator,
    ):
        # The relay claims the two oldest undelivered rows and marks them delivered, in a
        # transaction it has not committed yet (the relay's publish window).
        claimed = [
            int(seq) for (seq,) in relay.execute("SELECT seq FROM ql3.claim_outbox(2)").fetchall()
        ]
        assert claimed == seqs[6:8]
        relay.execute("SELECT ql3.mark_outbox_delivered(%s)", (claimed,))
        # Another session holds a prunable row.
        holder.execute("SELECT 1 FROM ql3.contract_outbox WHERE seq = %s FOR UPDATE", (seqs[0],))

        operator.execute("SET lock_timeout = '2s'")
        started = time.monotonic()
        removed = operator.execute("SELECT ql3.prune_outbox('0 seconds', 100000)").fetchone()
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, f"the prune waited {elapsed:.2f}s"
        assert removed is not None and removed[0] >= 5
        # The locked row, the claimed rows and the rest of the backlog are all still there.
        assert present(db_dsn, seqs) == [seqs[0], *seqs[6:]]

        relay.commit()
        holder.rollback()

    with psycopg.connect(relay_dsn) as relay:
        # The claim order is still seq: the next claim takes the next undelivered rows.
        after = [int(seq) for (seq,) in relay.execute("SELECT seq FROM ql3.claim_outbox(10)")]
        assert [seq for seq in after if seq in seqs] == seqs[8:]
        relay.rollback()

    with psycopg.connect(operator_dsn, autocommit=True) as operator:
        removed = operator.execute("SELECT ql3.prune_outbox('0 seconds', 100000)").fetchone()
    assert removed is not None and removed[0] >= 3
    # The once-locked row and the relay's delivered rows go now; the undelivered stay,
    # the newest of them being the pointer's last row.
    assert present(db_dsn, seqs) == seqs[8:]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # an argparse usage error
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else out, err


def test_cli_prunes_in_batches_and_keeps_recent_rows(
    db_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seqs = write_events(db_dsn, 8)
    deliver_long_ago(db_dsn, seqs[:5], "3 days")
    deliver_long_ago(db_dsn, seqs[5:7], "1 hour")
    operator_dsn = role_dsn(db_dsn, "operator")

    code, out, _ = run(capsys, "prune", "--dsn", operator_dsn, "--delivered-before", "1d",
                       "--batch", "2")  # fmt: skip
    assert code == 0
    assert out["removed"] >= 5
    # Recently delivered and undelivered rows stay.
    assert present(db_dsn, seqs) == seqs[5:]

    code, out, _ = run(capsys, "prune", "--dsn", operator_dsn, "--delivered-before", "1d")
    assert (code, out["removed"]) == (0, 0)


@pytest.mark.parametrize(
    "argv",
    [
        ("--delivered-before", "7x"),
        ("--delivered-before", "-1d"),
        ("--delivered-before", "9999999999w"),  # no OverflowError: a usage error
        ("--delivered-before", "7d", "--batch", "0"),
        ("--delivered-before", "7d", "--batch", "100001"),
        ("--delivered-before", "7d", "--statement-timeout", "0"),
    ],
)
def test_cli_refuses_bad_settings(
    db_dsn: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    seqs = write_events(db_dsn, 3)
    deliver_long_ago(db_dsn, seqs[:2])
    code, _, _ = run(capsys, "prune", "--dsn", role_dsn(db_dsn, "operator"), *argv)
    assert code == 2
    assert present(db_dsn, seqs) == seqs


@pytest.mark.parametrize("role", ["runtime", "relay", "reader"])
def test_only_operators_may_prune(db_dsn: str, role: str) -> None:
    seqs = write_events(db_dsn, 3)
    deliver_long_ago(db_dsn, seqs[:2])
    with (
        psycopg.connect(role_dsn(db_dsn, role), autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("SELECT ql3.prune_outbox('0 seconds', 10)")
    assert present(db_dsn, seqs) == seqs


def test_recovery_loop_prunes_on_its_schedule(db_dsn: str) -> None:
    seqs = write_events(db_dsn, 6)
    deliver_long_ago(db_dsn, seqs[:4], "3 days")
    config = RecoveryConfig(
        interval=0.05, outbox_retention=86400.0, prune_batch=1, prune_interval=3600.0
    )
    loop = RecoveryLoop(role_dsn(db_dsn, "operator"), config)
    loop.start()
    try:
        loop.wait_until(lambda lp: lp.batches >= 3)
    finally:
        loop.stop()
    # One round (of bounded batches of 1) removed the old delivered rows but the newest.
    assert loop.pruned >= 4
    assert present(db_dsn, seqs) == seqs[4:]
    assert loop.registry.get_sample_value("ql3_outbox_pruned_total") == loop.pruned
    assert loop.registry.get_sample_value("ql3_outbox_prune_errors_total") == 0

    # At most one round per prune_interval: newly prunable rows wait for the next one.
    deliver_long_ago(db_dsn, seqs[4:5], "3 days")
    write_events(db_dsn, 1)
    with PgStore(role_dsn(db_dsn, "operator"), max_connections=1) as store:
        assert loop.maybe_prune(store) == 0
    assert seqs[4] in present(db_dsn, seqs)


def test_recovery_loop_without_retention_never_prunes(db_dsn: str) -> None:
    seqs = write_events(db_dsn, 3)
    deliver_long_ago(db_dsn, seqs[:2], "3 days")
    loop = RecoveryLoop(role_dsn(db_dsn, "operator"), RecoveryConfig(interval=0.05))
    loop.start()
    try:
        loop.wait_until(lambda lp: lp.batches >= 2)
    finally:
        loop.stop()
    assert loop.pruned == 0
    assert present(db_dsn, seqs) == seqs


def test_retention_settings_from_flags_and_environment() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["recover", "--loop"])
    assert config_from_args(args, {}).outbox_retention is None
    config = config_from_args(args, {"QL3_OUTBOX_RETENTION": "7d", "QL3_OUTBOX_PRUNE_BATCH": "50"})
    assert (config.outbox_retention, config.prune_batch) == (7 * 86400.0, 50)
    args = parser.parse_args(["recover", "--loop", "--outbox-retention", "12h"])
    assert config_from_args(args, {"QL3_OUTBOX_RETENTION": "7d"}).outbox_retention == 43200.0
    with pytest.raises(errors.Misconfigured):
        config_from_args(parser.parse_args(["recover"]), {"QL3_OUTBOX_RETENTION": "soon"})
    with pytest.raises(errors.InvalidArgument):
        RecoveryConfig(prune_batch=0)
    with pytest.raises(errors.InvalidArgument):
        RecoveryConfig(outbox_retention=-1.0)
