"""activations/s against pgbench single-insert TPS, both driven by pgbench itself.

Each pgbench client owns one contract and flips it between its two revisions, so every
transaction changes the pointer and appends one outbox row (checked by counting rows). The
baseline inserts one row into a plain logged table with an identity primary key. Same
client count, same threads, same duration, same protocol, same server settings.

Two ways to activate are measured (D17). The figure judged against the target is what
ql3's Python driver (``PgStore.activate_revision``) sends: the activation in a transaction
with ``ql3.outbox_notify = deferred``, then ``ql3.wake_relays()`` after its COMMIT. The
diagnostic row is a bare ``SELECT ql3.activate_revision(...)`` as from psql, whose outbox
trigger NOTIFYs inside the transaction: PostgreSQL then holds its notification lock through
the WAL flush, so those commits cannot share a group commit (D16).
"""

from __future__ import annotations

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
    contract_pair,
    fresh_database,
    pgbench,
    ratio,
    verdict,
)
from ql3.db import DEFERRED_NOTIFY_OPTION

TARGET_RATIO = 0.5
CLIENT_COUNTS = (8, 1)

INSERT_SCRIPT = "INSERT INTO bench_insert (v) VALUES (1);\n"

ACTIVATE_CALL = f"""\
SELECT ql3.activate_revision(
    '{PROJECT}', '{FAMILY}', c.contract_id,
    CASE WHEN a.active_revision_id = c.rev1 THEN c.rev2 ELSE c.rev1 END,
    '{ACTOR}')
FROM bench_clients AS c
INNER JOIN ql3.active_revisions AS a
    ON a.project_id = '{PROJECT}' AND a.contract_family = '{FAMILY}'
   AND a.contract_id = c.contract_id
WHERE c.client_id = :client_id;
"""

# As psql or any client calling the SQL function: NOTIFY inside the transaction.
ACTIVATE_SCRIPT = ACTIVATE_CALL

# As PgStore.activate_revision, on a connection opened with DEFERRED_NOTIFY_OPTION: the
# activation commits without a NOTIFY, then one wake in a transaction of its own.
DRIVER_SCRIPT = f"""\
{ACTIVATE_CALL}SELECT ql3.wake_relays();
"""


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
        conn.execute("VACUUM ANALYZE")


def _measured(
    dsn: str, script: str, table: str, clients: int, seconds: int, *, connect: str | None = None
) -> PgbenchRun:
    """One pgbench run; raises unless every transaction wrote exactly one row."""
    before = _count(dsn, f"SELECT count(*) FROM {table}")
    run = pgbench(connect or dsn, script, clients=clients, seconds=seconds)
    written = _count(dsn, f"SELECT count(*) FROM {table}") - before
    if run.failed or written != run.transactions:
        raise RuntimeError(
            f"{table}: pgbench processed {run.transactions} transactions ({run.failed} failed)"
            f" but {written} rows were written"
        )
    return run


def run(settings: Settings) -> Result:
    seconds = 2 if settings.quick else 10
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
            pgbench(driver_dsn(dsn), DRIVER_SCRIPT, clients=clients, seconds=1)
            pgbench(dsn, ACTIVATE_SCRIPT, clients=clients, seconds=1)
            insert = _measured(dsn, INSERT_SCRIPT, "bench_insert", clients, seconds)
            driver = _measured(
                dsn, DRIVER_SCRIPT, "ql3.contract_outbox", clients, seconds, connect=driver_dsn(dsn)
            )
            plain = _measured(dsn, ACTIVATE_SCRIPT, "ql3.contract_outbox", clients, seconds)
            key = f"{clients}_clients"
            plural = "s" if clients > 1 else ""
            figures[f"activations_per_s_{key}"] = round(driver.tps, 1)
            figures[f"activations_notify_in_transaction_per_s_{key}"] = round(plain.tps, 1)
            baseline[f"pgbench_insert_tps_{key}"] = round(insert.tps, 1)
            ratios[key] = ratio(driver.tps, insert.tps)
            ratios[f"notify_in_transaction_{key}"] = ratio(plain.tps, insert.tps)
            checks[f"activation_transactions_{key}"] = driver.transactions
            checks[f"outbox_rows_written_{key}"] = driver.transactions
            checks[f"notify_in_transaction_transactions_{key}"] = plain.transactions
            ok = ratios[key] >= TARGET_RATIO
            passed = passed and ok
            base_text = f"{insert.tps:,.0f} /s pgbench single INSERT"
            rows.append(
                Row(
                    label=f"activations/s, {clients} client{plural} (driver: NOTIFY after COMMIT)",
                    figure=f"{driver.tps:,.0f} /s",
                    baseline=base_text,
                    ratio=ratios[key],
                    target=f"ratio >= {TARGET_RATIO}",
                    result=verdict(ok),
                )
            )
            rows.append(
                Row(
                    label=f"activations/s, {clients} client{plural}, NOTIFY in transaction (psql)",
                    figure=f"{plain.tps:,.0f} /s",
                    baseline=base_text,
                    ratio=ratios[f"notify_in_transaction_{key}"],
                    target="(diagnostic)",
                    result="n/a",
                )
            )
    return Result(
        name="activations",
        figures=figures,
        baseline=baseline,
        ratio=ratios,
        target=(
            f"activations/s (as the Python driver sends them) >= {TARGET_RATIO} x pgbench"
            " single-insert TPS, at 8 and 1 clients"
        ),
        passed=passed,
        rows=rows,
        checks=checks,
        notes=[
            f"pgbench -n -f SCRIPT -c C -j C -T {seconds} for every side, after 1 s warm-ups",
            "driver: connection option -c ql3.outbox_notify=deferred (as PgStore's pool);"
            " script: SELECT ql3.activate_revision(...); SELECT ql3.wake_relays()",
            "every activation transaction wrote one outbox row (row count = transaction count)",
        ],
    )
