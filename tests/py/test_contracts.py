"""PgStore's contract methods against a real, fully migrated PostgreSQL database."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from fix_servers import role_dsn
from fix_tcp_proxy import PgProxy, pg_proxy  # noqa: F401  (pg_proxy is a fixture)
from ql3 import canonical, errors
from ql3.store import PgStore

FAMILY = "policy_routing"


@pytest.fixture
def store(db_dsn: str) -> Iterator[PgStore]:
    with PgStore(role_dsn(db_dsn, "operator")) as s:
        yield s


def _count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM ql3.{table}").fetchone()
        assert row is not None
        return int(row[0])


def test_put_revision_numbers_revisions_and_hashes_the_canonical_body(store: PgStore) -> None:
    first = store.put_revision("p1", FAMILY, "sre", {"temperature": 0.2, "routes": ["a"]}, "alice")
    second = store.put_revision("p1", FAMILY, "sre", {"temperature": 0.3}, "alice")
    assert (first["revision_no"], second["revision_no"]) == (1, 2)
    expected = canonical.digest("ql3/contract-body@v1", {"routes": ["a"], "temperature": 0.2})
    assert first["body_hash"] == expected


def test_put_revision_with_the_same_body_returns_the_existing_revision(
    store: PgStore, db_dsn: str
) -> None:
    first = store.put_revision("p1", FAMILY, "sre", {"b": 1, "a": 2}, "alice")
    again = store.put_revision("p1", FAMILY, "sre", {"a": 2, "b": 1}, "bob")
    assert again["revision_id"] == first["revision_id"]
    assert _count(db_dsn, "contract_revisions") == 1


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("p1", "no_such_family", "c", {}), errors.InvalidArgument),
        (("p1", FAMILY, "c", [1, 2]), errors.InvalidArgument),
        (("p1", FAMILY, "c", {"n": 2**53}), errors.InvalidArgument),
        (("p" * 129, FAMILY, "c", {}), errors.IdentifierTooLong),
        (("p1", FAMILY, "c" * 129, {}), errors.IdentifierTooLong),
        (("p1", FAMILY, "c", {"x": "y" * 25000}), errors.RecordTooLarge),
    ],
    ids=["unknown-family", "non-object", "number-range", "long-project", "long-contract", "size"],
)
def test_put_revision_rejects_bad_input_and_writes_nothing(
    store: PgStore, db_dsn: str, args: tuple[str, str, str, object], error: type[errors.Ql3Error]
) -> None:
    with pytest.raises(error) as caught:
        store.put_revision(*args, "alice")
    assert caught.value.code == error.code
    assert _count(db_dsn, "contract_revisions") == 0
    assert _count(db_dsn, "active_revisions") == 0


def test_activation_moves_the_pointer_and_returns_the_outbox_event(store: PgStore) -> None:
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    r2 = store.put_revision("p1", FAMILY, "sre", {"v": 2}, "alice")
    e1 = store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
    e2 = store.activate_revision("p1", FAMILY, "sre", r2["revision_id"], "alice")
    assert e1 is not None and e2 is not None
    assert (e1["event_type"], e1["old_revision_id"], e1["pointer_version"]) == (
        "revision_activated", None, 1,
    )  # fmt: skip
    assert (e2["old_revision_id"], e2["new_revision_id"], e2["pointer_version"]) == (
        r1["revision_id"], r2["revision_id"], 2,
    )  # fmt: skip
    active = store.active_revision("p1", FAMILY, "sre")
    assert active is not None
    assert (active["revision_id"], active["pointer_version"]) == (r2["revision_id"], 2)


def test_activating_the_active_revision_again_writes_no_event(store: PgStore, db_dsn: str) -> None:
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    assert store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice") is not None
    assert store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice") is None
    assert _count(db_dsn, "contract_outbox") == 1


def test_activating_the_active_revision_again_returns_no_row_to_any_client(
    store: PgStore, db_dsn: str
) -> None:
    """Zero rows, not one row of NULLs (D3), in FROM and in the select list, and None
    from a PgStore on a transactional pool of the caller's own."""
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
    call = "ql3.activate_revision('p1', %s, 'sre', %s::uuid, 'alice')"
    with psycopg.connect(role_dsn(db_dsn, "operator"), autocommit=True) as conn:
        assert conn.execute(f"SELECT * FROM {call}", (FAMILY, r1["revision_id"])).fetchall() == []
        assert conn.execute(f"SELECT {call}", (FAMILY, r1["revision_id"])).fetchall() == []
    with ConnectionPool(role_dsn(db_dsn, "operator"), min_size=1, open=True) as pool:
        own = PgStore(pool)
        assert own.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice") is None
    assert _count(db_dsn, "contract_outbox") == 1


def test_compare_and_set_mismatch_is_a_conflict_and_writes_nothing(
    store: PgStore, db_dsn: str
) -> None:
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    r2 = store.put_revision("p1", FAMILY, "sre", {"v": 2}, "alice")
    store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
    with pytest.raises(errors.Conflict):
        store.activate_revision("p1", FAMILY, "sre", r2["revision_id"], "alice", r2["revision_id"])
    assert _count(db_dsn, "contract_outbox") == 1
    ok = store.activate_revision("p1", FAMILY, "sre", r2["revision_id"], "alice", r1["revision_id"])
    assert ok is not None and ok["pointer_version"] == 2


def test_activating_a_revision_of_another_contract_is_refused(store: PgStore, db_dsn: str) -> None:
    other = store.put_revision("p1", FAMILY, "other", {"v": 1}, "alice")
    with pytest.raises(errors.InvalidArgument):
        store.activate_revision("p1", FAMILY, "sre", other["revision_id"], "alice")
    assert _count(db_dsn, "contract_outbox") == 0


def test_unknown_revision_is_not_found(store: PgStore) -> None:
    with pytest.raises(errors.NotFound):
        store.activate_revision(
            "p1", FAMILY, "sre", "00000000-0000-0000-0000-000000000000", "alice"
        )


def test_revoke_of_the_active_revision_fails_closed(store: PgStore, db_dsn: str) -> None:
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
    event = store.revoke_revision(r1["revision_id"], "alice", "bad routing")
    assert event is not None
    assert (event["event_type"], event["new_revision_id"], event["pointer_version"]) == (
        "revision_revoked", r1["revision_id"], 2,
    )  # fmt: skip
    assert store.active_revision("p1", FAMILY, "sre") is None
    with pytest.raises(errors.RevisionRevoked):
        store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
    assert store.revoke_revision(r1["revision_id"], "alice", "again") is None
    assert _count(db_dsn, "contract_outbox") == 2


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_an_activation_from_a_snapshot_older_than_a_revocation_is_refused(
    store: PgStore, db_dsn: str, isolation: str
) -> None:
    """D33: revoking a revision that is not active still updates the pointer row, so an
    activation of it whose snapshot predates the revocation fails (40001) instead of
    activating a revoked revision; at READ COMMITTED it sees the revocation (Q3R01)."""
    one = store.put_revision("p1", FAMILY, "race", {"v": 1}, "alice")["revision_id"]
    two = store.put_revision("p1", FAMILY, "race", {"v": 2}, "alice")["revision_id"]
    store.activate_revision("p1", FAMILY, "race", one, "alice")
    with psycopg.connect(role_dsn(db_dsn, "operator")) as late:
        late.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        late.execute("SELECT 1 FROM ql3.active_revisions LIMIT 1")  # the snapshot is taken
        assert store.revoke_revision(two, "bob", "routes to a retired model") is not None
        with pytest.raises(psycopg.errors.SerializationFailure):
            late.execute(
                "SELECT ql3.activate_revision('p1', %s, 'race', %s::uuid, 'alice')", (FAMILY, two)
            )
        late.rollback()
    active = store.active_revision("p1", FAMILY, "race")
    assert active is not None and active["revision_id"] == one


def test_active_pointers_answers_many_keys_in_order(store: PgStore) -> None:
    r1 = store.put_revision("p1", FAMILY, "a", {"v": 1}, "alice")
    store.activate_revision("p1", FAMILY, "a", r1["revision_id"], "alice")
    rows = store.active_pointers([("p1", FAMILY, "missing"), ("p1", FAMILY, "a")])
    assert [(r["contract_id"], r["revision_id"], r["pointer_version"]) for r in rows] == [
        ("missing", None, 0),
        ("a", r1["revision_id"], 1),
    ]


def test_runtime_role_reads_pointers_but_cannot_put_revisions(db_dsn: str) -> None:
    with PgStore(role_dsn(db_dsn, "runtime")) as runtime:
        assert runtime.active_pointers([("p1", FAMILY, "a")])[0]["revision_id"] is None
        with pytest.raises(errors.PermissionDenied):
            runtime.put_revision("p1", FAMILY, "a", {}, "mallory")


def test_failed_activation_sends_no_notification(store: PgStore, db_dsn: str) -> None:
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    with psycopg.connect(db_dsn, autocommit=True) as listener:
        listener.execute("LISTEN ql3_contract_outbox")
        with pytest.raises(errors.Conflict):
            store.activate_revision(
                "p1", FAMILY, "sre", r1["revision_id"], "alice", r1["revision_id"]
            )
        assert list(listener.notifies(timeout=0.2)) == []
        store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
        received = next(listener.notifies(timeout=5))
    assert canonical.parse_json(received.payload) == {"wake": True}


def test_activation_wakes_the_relays_once_after_its_commit(store: PgStore, db_dsn: str) -> None:
    """The driver defers the NOTIFY (D17): one wake, sent once the outbox row is visible."""
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    r2 = store.put_revision("p1", FAMILY, "sre", {"v": 2}, "alice")
    store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
    with psycopg.connect(db_dsn, autocommit=True) as listener:
        listener.execute("LISTEN ql3_contract_outbox")
        event = store.activate_revision("p1", FAMILY, "sre", r2["revision_id"], "alice")
        assert event is not None
        received = list(listener.notifies(timeout=0.5))
        visible = listener.execute(
            "SELECT count(*) FROM ql3.contract_outbox WHERE seq = %s", (event["seq"],)
        ).fetchone()
        again = store.activate_revision("p1", FAMILY, "sre", r2["revision_id"], "alice")
        assert again is None
        # The wake is pipelined before the call's result is known (D25), so a call that
        # changes nothing sends one too; it writes nothing, and the relays claim nothing.
        assert [n.payload for n in listener.notifies(timeout=0.3)] == ['{"wake": true}']
        assert _count(db_dsn, "contract_outbox") == 2
    assert [n.payload for n in received] == ['{"wake": true}']
    assert visible == (1,)


@pytest.mark.parametrize("pool", ["own", "transactional"])
def test_a_lost_wake_does_not_fail_a_committed_activation(
    store: PgStore, db_dsn: str, caplog: pytest.LogCaptureFixture, pool: str
) -> None:
    """Also on a transactional pool of the caller's: the activation commits before the
    wake, so a failing wake cannot take the activation down with its transaction."""
    if pool == "transactional":
        store = PgStore(ConnectionPool(role_dsn(db_dsn, "operator"), min_size=1, open=True))
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    caplog.set_level(logging.WARNING, logger="ql3.store")  # other tests may raise root's level
    with psycopg.connect(db_dsn, autocommit=True) as admin:
        admin.execute("REVOKE EXECUTE ON FUNCTION ql3.wake_relays() FROM ql3_operator")
        try:
            event = store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
        finally:
            admin.execute("GRANT EXECUTE ON FUNCTION ql3.wake_relays() TO ql3_operator")
    assert event is not None and event["new_revision_id"] == r1["revision_id"]
    assert store.active_revision("p1", FAMILY, "sre")["revision_id"] == r1["revision_id"]  # type: ignore[index]
    assert _count(db_dsn, "contract_outbox") == 1  # undelivered: the relay's poll finds it
    assert "wake_relays failed after COMMIT" in caplog.text
    if pool == "transactional":
        store.pool.close()


def test_a_lost_reply_to_the_pipelined_commit_is_unavailable_and_the_activation_stands(
    store: PgStore,
    db_dsn: str,
    pg_proxy: PgProxy,  # noqa: F811
) -> None:
    """The proxy forwards the pipeline's COMMIT and drops the connection instead of its
    answer: the outcome is unknown, so the call raises (it must not report a wake failure
    after a COMMIT it never saw), and the activation is committed all the same."""
    r1 = store.put_revision("p1", FAMILY, "sre", {"v": 1}, "alice")
    with PgStore(pg_proxy.dsn(role_dsn(db_dsn, "operator"))) as proxied:
        pg_proxy.arm_commit_loss()
        with pytest.raises(errors.Unavailable):
            proxied.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice")
        assert pg_proxy.commit_lost.is_set()
    assert store.active_revision("p1", FAMILY, "sre")["revision_id"] == r1["revision_id"]  # type: ignore[index]
    assert store.activate_revision("p1", FAMILY, "sre", r1["revision_id"], "alice") is None


def test_concurrent_activations_of_one_contract_form_one_unbroken_chain(
    db_dsn: str, store: PgStore
) -> None:
    """Eight sessions flip one contract among four revisions, some with a compare-and-set
    expectation: every activation that returned an event is one link of one chain (pointer
    versions 1..n without gaps or repeats, each event's old revision the previous event's
    new one), every refusal is a compare-and-set conflict, and the pointer is the chain's
    end."""
    import random
    import threading

    revisions = [
        str(store.put_revision("race", FAMILY, "c", {"v": i}, "alice")["revision_id"])
        for i in range(4)
    ]
    returned: list[dict[str, object]] = []
    failures: list[BaseException] = []
    conflicts = 0
    lock = threading.Lock()

    def worker(seed: int) -> None:
        nonlocal conflicts
        draw = random.Random(seed)
        with PgStore(role_dsn(db_dsn, "operator"), max_connections=1) as mine:
            for _ in range(40):
                target = draw.choice(revisions)
                expected = draw.choice([None, *revisions])
                try:
                    event = mine.activate_revision("race", FAMILY, "c", target, "t", expected)
                except errors.Conflict:
                    with lock:
                        conflicts += 1
                    continue
                except BaseException as exc:  # anything else fails the test below
                    failures.append(exc)
                    return
                if event is not None:
                    with lock:
                        returned.append(dict(event))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []
    with psycopg.connect(db_dsn) as conn:
        rows = conn.execute(
            "SELECT pointer_version, old_revision_id::text, new_revision_id::text"
            " FROM ql3.contract_outbox WHERE project_id = 'race' ORDER BY pointer_version"
        ).fetchall()
    assert len(rows) == len(returned) > 0 and conflicts > 0
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[0][1] is None
    assert all(rows[i][1] == rows[i - 1][2] for i in range(1, len(rows)))
    assert sorted(int(str(e["pointer_version"])) for e in returned) == [r[0] for r in rows]
    active = store.active_revision("race", FAMILY, "c")
    assert active is not None
    assert (str(active["revision_id"]), active["pointer_version"]) == (rows[-1][2], len(rows))
