"""activations/s against pgbench single-insert TPS, both driven by pgbench itself.

Each pgbench client owns one contract and flips it between its two revisions, so every
transaction changes the pointer and appends one outbox row (checked by counting rows). The
baseline inserts one row into a plain logged table with an identity primary key. Same
client count, same threads, same duration, same protocol, same server settings.

Two ways to activate are measured (D17). The figure judged against the target is what
ql3's Python driver (``PgStore.activate_revision``) sends: the activation in a transaction
with ``ql3.outbox_notify = deferred``, then ``ql3.wake_relays()`` after its COMMIT, all in
one pipeline (BEGIN, the call, COMMIT, the wake: one round trip, two transactions, D25). The
diagnostic row is a bare ``SELECT ql3.activate_revision(...)`` as from psql, whose outbox
trigger NOTIFYs inside the transaction: PostgreSQL then holds its notification lock through
the WAL flush, so those commits cannot share a group commit (D16).
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
from psycopg.conninfo import make_conninfo

from bench.common import (
    ACTOR,
    FAMILY,
    PROJECT,
    PgbenchRun,
    Result,
    Row,
    Settings,
    against,
    alternating,
    contract_pair,
    diagnostic_row,
    fresh_database,
    judged_row,
    median,
    pgbench,
)
from ql3.db import DEFERRED_NOTIFY_OPTION

TARGET_RATIO = 0.5
CLIENT_COUNTS = (8, 1)
ROUNDS = 5
ROUND_SECONDS = 4

INSERT_SCRIPT = "INSERT INTO bench_insert (v) VALUES (1);\n"

# Each client alternates between its two revisions with a pgbench variable of its own
# (``-D flip=0``, every run starts from rev1 active), so the harness adds no read of the
# pointer to what is measured: only the client's row of bench_clients, by primary key.
FLIP = "\\set flip 1 - :flip\n"
ACTIVATE_CALL = f"""\
SELECT ql3.activate_revision(
    '{PROJECT}', '{FAMILY}', c.contract_id, CASE WHEN :flip = 1 THEN c.rev2 ELSE c.rev1 END,
    '{ACTOR}')
FROM bench_clients AS c WHERE c.client_id = :client_id;
"""

# As psql or any client calling the SQL function: NOTIFY inside the transaction.
ACTIVATE_SCRIPT = FLIP + ACTIVATE_CALL

# As PgStore.activate_revision, on a connection opened with DEFERRED_NOTIFY_OPTION: the
# activation commits without a NOTIFY, then one wake in a transaction of its own, both in
# one pipeline as PgStore sends them (D25).
DRIVER_SCRIPT = f"""\
{FLIP}\\startpipeline
BEGIN;
{ACTIVATE_CALL}COMMIT;
SELECT ql3.wake_relays();
\\endpipeline
"""

# The floor (diagnostic): the writes SPEC section 3 requires of an activation -- the pointer
# UPDATE and the outbox INSERT, with their foreign keys, indexes and triggers -- as one plain
# SQL statement in the driver's pipeline, without any of the function's checks (the
# revision's contract, revocation, the expected revision, a no-op when already active).
# What the schema alone costs; no activation function can be cheaper.
FLOOR_SCRIPT = f"""\
{FLIP}\\startpipeline
BEGIN;
WITH c AS (
    SELECT contract_id, CASE WHEN :flip = 1 THEN rev2 ELSE rev1 END AS rev,
           CASE WHEN :flip = 1 THEN rev1 ELSE rev2 END AS old
    FROM bench_clients WHERE client_id = :client_id
), u AS (
    UPDATE ql3.active_revisions AS a
    SET active_revision_id = c.rev, pointer_version = a.pointer_version + 1,
        updated_at = now(), updated_by = '{ACTOR}'
    FROM c
    WHERE a.project_id = '{PROJECT}' AND a.contract_family = '{FAMILY}'
      AND a.contract_id = c.contract_id
    RETURNING a.contract_id, a.active_revision_id, a.pointer_version, c.old
)
INSERT INTO ql3.contract_outbox
    (event_type, project_id, contract_family, contract_id, old_revision_id, new_revision_id,
     pointer_version)
SELECT 'revision_activated', '{PROJECT}', '{FAMILY}', u.contract_id, u.old,
       u.active_revision_id, u.pointer_version
FROM u;
COMMIT;
SELECT ql3.wake_relays();
\\endpipeline
"""


# The function floor (diagnostic, D61): the floor's statement as the body of a PL/pgSQL
# function made as ql3's functions are (SECURITY DEFINER, owned by ql3_owner, search_path
# pinned, the outbox row returned as activate_revision returns it), called as the driver
# calls activate_revision. What being a function costs before any check.
FUNCTION_FLOOR_SQL = f"""\
CREATE FUNCTION bench_floor_activate(p_contract_id text, p_revision_id uuid, p_old_revision_id uuid)
RETURNS SETOF ql3.contract_outbox
LANGUAGE plpgsql ROWS 1 SECURITY DEFINER SET search_path = pg_catalog, ql3, pg_temp
AS $fn$
DECLARE
    event ql3.contract_outbox;
BEGIN
    WITH u AS (
        UPDATE ql3.active_revisions AS a
        SET active_revision_id = p_revision_id, pointer_version = a.pointer_version + 1,
            updated_at = now(), updated_by = '{ACTOR}'
        WHERE a.project_id = '{PROJECT}' AND a.contract_family = '{FAMILY}'
          AND a.contract_id = p_contract_id
        RETURNING a.contract_id, a.active_revision_id, a.pointer_version
    )
    INSERT INTO ql3.contract_outbox
        (event_type, project_id, contract_family, contract_id, old_revision_id, new_revision_id,
         pointer_version)
    SELECT 'revision_activated', '{PROJECT}', '{FAMILY}', u.contract_id, p_old_revision_id,
           u.active_revision_id, u.pointer_version
    FROM u
    RETURNING * INTO event;
    RETURN NEXT event;
END;
$fn$;
ALTER FUNCTION bench_floor_activate(text, uuid, uuid) OWNER TO ql3_owner;
"""

FUNCTION_FLOOR_SCRIPT = f"""\
{FLIP}\\startpipeline
BEGIN;
SELECT bench_floor_activate(
    c.contract_id, CASE WHEN :flip = 1 THEN c.rev2 ELSE c.rev1 END,
    CASE WHEN :flip = 1 THEN c.rev1 ELSE c.rev2 END)
FROM bench_clients AS c WHERE c.client_id = :client_id;
COMMIT;
SELECT ql3.wake_relays();
\\endpipeline
"""
TARGET_FLOOR_RATIO = 0.95  # issue 23: driver activations/s against the floor's, same rounds


def driver_dsn(dsn: str) -> str:
    """The DSN as PgStore's pool connects: outbox NOTIFYs deferred."""
    return make_conninfo(dsn, options=DEFERRED_NOTIFY_OPTION)


def _count(dsn: str, sql: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
        assert row is not None
        return int(row[0])


def _prepare(dsn: str, clients: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench_insert ("
            " id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v integer NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE bench_clients ("
            " client_id integer PRIMARY KEY, contract_id text NOT NULL,"
            " rev1 uuid NOT NULL, rev2 uuid NOT NULL)"
        )
        for client in range(clients):
            contract_id = f"c{client}"
            rev1, rev2 = contract_pair(conn, contract_id)
            conn.execute(
                "INSERT INTO bench_clients VALUES (%s, %s, %s::uuid, %s::uuid)",
                (client, contract_id, rev1, rev2),
            )
        conn.execute(FUNCTION_FLOOR_SQL)
        conn.execute("VACUUM ANALYZE")


def _reset_pointers(dsn: str) -> None:
    """Every client's contract back on its rev1, where the flipping scripts start."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"SELECT ql3.activate_revision('{PROJECT}', '{FAMILY}', c.contract_id, c.rev1,"
            f" '{ACTOR}') FROM bench_clients AS c"
        )


def _activations(
    dsn: str, script: str, clients: int, seconds: int, *, connect: str | None = None
) -> PgbenchRun:
    """A run of a flipping activation script, which starts from rev1 active."""
    return pgbench(connect or dsn, script, clients=clients, seconds=seconds, defines=["flip=0"])


def _measured(dsn: str, table: str, runner: Callable[[], PgbenchRun]) -> PgbenchRun:
    """One pgbench run; raises unless every transaction wrote exactly one row to table."""
    before = _count(dsn, f"SELECT count(*) FROM {table}")
    run = runner()
    written = _count(dsn, f"SELECT count(*) FROM {table}") - before
    if run.failed or written != run.transactions:
        raise RuntimeError(
            f"{table}: pgbench processed {run.transactions} transactions ({run.failed} failed)"
            f" but {written} rows were written"
        )
    return run


def _measured_activations(
    dsn: str, script: str, clients: int, seconds: int, connect: str | None = None
) -> PgbenchRun:
    """A checked activation run from rev1 active (the reset's outbox rows are written
    before ``_measured`` counts)."""
    _reset_pointers(dsn)
    return _measured(
        dsn,
        "ql3.contract_outbox",
        lambda: _activations(dsn, script, clients, seconds, connect=connect),
    )


def _rounds(dsn: str, clients: int, rounds: int, seconds: int) -> dict[str, list[PgbenchRun]]:
    """``rounds`` checked runs of each side, alternating (``bench.common.alternating``)."""
    sides: dict[str, Callable[[], PgbenchRun]] = {
        "insert": lambda: _measured(
            dsn,
            "bench_insert",
            lambda: pgbench(dsn, INSERT_SCRIPT, clients=clients, seconds=seconds),
        ),
        "driver": lambda: _measured_activations(
            dsn, DRIVER_SCRIPT, clients, seconds, driver_dsn(dsn)
        ),
        "plain": lambda: _measured_activations(dsn, ACTIVATE_SCRIPT, clients, seconds),
        "floor": lambda: _measured_activations(
            dsn, FLOOR_SCRIPT, clients, seconds, driver_dsn(dsn)
        ),
        "function_floor": lambda: _measured_activations(
            dsn, FUNCTION_FLOOR_SCRIPT, clients, seconds, driver_dsn(dsn)
        ),
    }
    return alternating(sides, rounds)


def _tps(runs: list[PgbenchRun]) -> list[float]:
    return [r.tps for r in runs]


def _floor_rows(
    runs: dict[str, list[PgbenchRun]],
    clients: int,
    figures: dict[str, float],
    ratios: dict[str, float],
    checks: dict[str, int],
    rows: list[Row],
) -> bool:
    """The rows against the floor of the same rounds (D61): the function floor's, then the
    driver's activations' (issue 23's target); the driver's verdict."""
    key = f"{clients}_clients"
    plural = "s" if clients > 1 else ""
    floor = _tps(runs["floor"])
    base_text = f"{median(floor):,.0f} /s floor (the required writes, plain SQL)"
    function = against(_tps(runs["function_floor"]), floor)
    driver = against(_tps(runs["driver"]), floor)
    figures[f"function_floor_writes_per_s_{key}"] = round(function.per_s, 1)
    checks[f"function_floor_transactions_{key}"] = sum(
        r.transactions for r in runs["function_floor"]
    )
    ratios[f"function_floor_over_floor_{key}"] = function.ratio
    ratios[f"driver_over_floor_{key}"] = driver.ratio
    ok = driver.ratio >= TARGET_FLOOR_RATIO
    label = (
        f"activations/s, {clients} client{plural}, floor in a function: the floor's statement"
        " in a SECURITY DEFINER function"
    )
    rows.append(diagnostic_row(label, function, base_text))
    label = f"activations/s, {clients} client{plural} (driver) against their floor"
    rows.append(judged_row(label, driver, base_text, TARGET_FLOOR_RATIO, ok))
    return ok


def run(settings: Settings) -> Result:
    rounds, seconds = (1, 2) if settings.quick else (ROUNDS, ROUND_SECONDS)
    figures: dict[str, float] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    checks: dict[str, int] = {}
    rows: list[Row] = []
    passed = True
    with fresh_database(settings.base_dsn, "activations") as dsn:
        _prepare(dsn, max(CLIENT_COUNTS))
        for clients in CLIENT_COUNTS:
            # Warm every path (plans, buffers) before the measured runs.
            pgbench(dsn, INSERT_SCRIPT, clients=clients, seconds=1)
            warmups = (
                (DRIVER_SCRIPT, driver_dsn(dsn)),
                (ACTIVATE_SCRIPT, None),
                (FLOOR_SCRIPT, driver_dsn(dsn)),
                (FUNCTION_FLOOR_SCRIPT, driver_dsn(dsn)),
            )
            for script, connect in warmups:
                _reset_pointers(dsn)
                _activations(dsn, script, clients, 1, connect=connect)
            runs = _rounds(dsn, clients, rounds, seconds)
            insert_tps = median([r.tps for r in runs["insert"]])
            key = f"{clients}_clients"
            plural = "s" if clients > 1 else ""
            base_text = f"{insert_tps:,.0f} /s pgbench single INSERT"
            baseline[f"pgbench_insert_tps_{key}"] = round(insert_tps, 1)
            sides = (
                ("driver", key, "activations_per_s", "(driver: NOTIFY after COMMIT)"),
                ("plain", f"notify_in_transaction_{key}",
                 "activations_notify_in_transaction_per_s", ", NOTIFY in transaction (psql)"),
                ("floor", f"floor_{key}", "floor_writes_per_s",
                 ", floor: the required writes alone, plain SQL"),
            )  # fmt: skip
            for side, ratio_key, figure_key, label in sides:
                over = against(_tps(runs[side]), _tps(runs["insert"]))
                figures[f"{figure_key}_{key}"] = round(over.per_s, 1)
                ratios[ratio_key] = over.ratio
                checks[f"{side}_transactions_{key}"] = sum(r.transactions for r in runs[side])
                judged = side == "driver"
                ok = ratios[ratio_key] >= TARGET_RATIO
                passed = passed and (ok or not judged)
                sep = " " if label.startswith("(") else ""
                label = f"activations/s, {clients} client{plural}{sep}{label}"
                rows.append(
                    judged_row(label, over, base_text, TARGET_RATIO, ok)
                    if judged
                    else diagnostic_row(label, over, base_text)
                )
            floor_ok = _floor_rows(runs, clients, figures, ratios, checks, rows)
            passed = passed and floor_ok
    return Result(
        name="activations",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"activations/s (as the Python driver sends them) >= {TARGET_RATIO} x pgbench"
            f" single-insert TPS and >= {TARGET_FLOOR_RATIO} x the floor's, at 8 and 1 clients"
        ),
        passed=passed,
        rows=rows,
        checks=checks,
        notes=[
            f"pgbench -n -f SCRIPT -c C -j C -T {seconds} for every side, {rounds} rounds"
            " (order reversed every other round), after 1 s warm-ups; figures are the medians"
            " over the rounds, ratios the medians of the per-round ratios",
            "driver: connection option -c ql3.outbox_notify=deferred (as PgStore's pool);"
            " script: \\startpipeline BEGIN; SELECT ql3.activate_revision(...); COMMIT;"
            " SELECT ql3.wake_relays(); \\endpipeline",
            "function floor (diagnostic, D61): the floor's statement as the body of a PL/pgSQL"
            " function made as ql3's are (SECURITY DEFINER, owned by ql3_owner, search_path"
            " pinned, returning the outbox row), called in the driver's pipeline: the floor plus"
            " the price of being a function (D46), before any check; against the floor: the"
            " medians of the per-round ratios, issue 23's target for the driver's activations",
            "every activation transaction wrote one outbox row (row count = transaction count);"
            " each activation run starts from rev1 active and flips with pgbench -D flip=0",
        ],
    )
