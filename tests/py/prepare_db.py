"""Creates a test database from QL3_TEST_DSN, migrates it, and prints its DSN.

Used by scripts/run-tests for the pgTAP databases: ``--with-ai`` migrates the AI stream
too, ``--pgtap`` installs the pgtap and dblink extensions (dblink lets a pgTAP file drive
a second session, for NOTIFY and SKIP LOCKED tests).
"""

from __future__ import annotations

import argparse
import os
import sys

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ql3.migrate import migrate


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--with-ai", action="store_true")
    parser.add_argument("--pgtap", action="store_true")
    args = parser.parse_args()
    base = os.environ["QL3_TEST_DSN"]
    params = conninfo_to_dict(base)
    # pg_prove splits --dbname on "=", so hand it a URI rather than key=value pairs.
    dsn = "postgresql://{}@{}:{}/{}".format(
        params.get("user", "postgres"), params.get("host", "127.0.0.1"),
        params.get("port", "5432"), args.name,
    )  # fmt: skip
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{args.name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{args.name}"')
    migrate(dsn, with_ai=args.with_ai)
    if args.pgtap:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgtap")
            conn.execute("CREATE EXTENSION IF NOT EXISTS dblink")
            conn.execute("CREATE SCHEMA IF NOT EXISTS tests")
    print(dsn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
