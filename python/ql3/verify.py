"""``ql3 verify``: the promotion gate (D50). A snapshot of one database, and the check of a
live database against it, for a failover, a restore or an upgrade of the servers.

What a snapshot holds (``SNAPSHOT_FORMAT``), all read in one ``REPEATABLE READ, READ
ONLY`` transaction, so the parts agree with each other:

- **history**: the rows (version, name, checksum) of ``ql3.schema_history`` and
  ``ql3_ai.feature_history``;
- **catalog**: one entry per object of the ql3 schemas, named by kind and qualified name
  (``function ql3.put_revision(text, ...)``, ``column ql3.runs.status``, ``trigger
  ql3.run_events.run_events_immutable``...), each holding the object's definition as
  PostgreSQL prints it, or the sha256 of a function's whole ``pg_get_functiondef`` and
  owner: functions, relations, columns, constraints, triggers (with whether they are
  enabled), indexes, row-level security policies, domains and sequences;
- **acl**: every ACL of the schemas, their relations, columns, functions and types, and
  every default ACL of the schemas and of ql3's roles (items sorted, NULL as ``default``);
  and each of ql3's roles: its attributes, its members (a login granted ``ql3_owner``
  writes every table) and the roles it is a member of;
- **ledgers**: per table of the ql3 schemas, its row count, a key-ordered sha256 of its
  full rows, and one md5 per row keyed by its primary key, over the columns that never
  change once written. The four tables whose rows change by design (runs and steps,
  pointers, the outbox's delivery columns) carry each row's progress as well (version,
  pointer_version, delivered), which may only grow;
- **invariants**: the ledger's own rules (``INVARIANTS``), each a query for the rows that
  break it.

``--against`` re-reads all of it live and names each difference: history, catalog and
ACLs must be equal; each ledger must be a superset of the snapshot's (every row present
with the same unchanging columns, its progress not gone back; new rows allowed), or, with
``--exact``, equal. The invariants are checked live in every mode; a violation fails.

Only SELECT is needed: ``ql3_reader`` reads every ledger but ``ql3.project_grants`` and
``ql3_ai.resolver_identities`` (operator tables), which are recorded as unreadable. Under
project isolation (D47) the role must see every project (``ql3.grant_project(role,
NULL)``), or the ledgers would be partial: verify refuses to run otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ql3 import errors
from ql3.db import Timeouts, connect, dsn_from_env, translated
from ql3.safe_text import json_text

SNAPSHOT_FORMAT = "ql3/verify-snapshot@v1"
SCHEMAS = ("ql3", "ql3_ai")
#: The migration ledgers: compared as history, not as ledger tables.
HISTORY_TABLES = {"ql3.schema_history": "core", "ql3_ai.feature_history": "ql3_ai"}
#: Roles whose cluster-wide default ACLs shape what the ql3 schemas' objects grant.
QL3_ROLES = ("ql3_owner", "ql3_runtime", "ql3_relay", "ql3_operator", "ql3_reader")
#: How many rows of a violated invariant, or of a ledger's differences, are named.
EXAMPLES = 5
#: Verification reads whole ledgers: a statement may take this long (ms).
STATEMENT_TIMEOUT_MS = 600_000


@dataclass(frozen=True)
class Mutable:
    """A table whose rows change by design: ``fixed`` are the columns that never change
    once the row exists; ``progress`` an integer expression that may only grow."""

    fixed: tuple[str, ...]
    progress: str


MUTABLE_TABLES: Mapping[str, Mutable] = {
    "ql3.runs": Mutable(("run_id", "project_id", "trace_id", "created_at"), "version"),
    "ql3.step_runs": Mutable(("step_run_id", "run_id", "kind", "created_at"), "version"),
    "ql3.active_revisions": Mutable(
        ("project_id", "contract_family", "contract_id"), "pointer_version"
    ),
    "ql3.contract_outbox": Mutable(
        (
            "seq",
            "event_id",
            "event_type",
            "project_id",
            "contract_family",
            "contract_id",
            "old_revision_id",
            "new_revision_id",
            "pointer_version",
            "created_at",
        ),
        "(delivered_at IS NOT NULL)::integer",
    ),
}


@dataclass(frozen=True)
class Invariant:
    """A rule of the ledger: ``query`` returns one text per row that breaks it.
    ``needs_ai``: only when ql3_ai is installed; ``optional``: only when asked for."""

    name: str
    description: str
    query: str
    needs_ai: bool = True
    optional: bool = False


_RECEIPT_RECORDED = """
SELECT format('%s %s has no %s run event or no %s mutation', {what}, r.invocation_id,
              {event_type}, {to_status})
  FROM {table} AS r
 WHERE NOT EXISTS (SELECT 1 FROM ql3.run_events AS e
                    WHERE e.event_id = r.event_id AND e.run_id = r.run_id
                      AND e.step_run_id = r.step_run_id AND e.event_type = {event_type})
    OR NOT EXISTS (SELECT 1 FROM ql3.step_run_mutations AS m
                    WHERE m.mutation_id = r.mutation_id AND m.dedupe_key = r.dedupe_key
                      AND m.step_run_id = r.step_run_id AND {mutation})
"""

INVARIANTS: tuple[Invariant, ...] = (
    Invariant(
        "start_recorded",
        "every Start has its run event and its ready -> running mutation",
        _RECEIPT_RECORDED.format(
            what="'start'",
            table="ql3_ai.model_invocation_starts",
            event_type="'model_invocation_admitted'",
            to_status="'ready -> running'",
            mutation="m.from_status = 'ready' AND m.to_status = 'running'",
        ),
    ),
    Invariant(
        "completion_recorded",
        "every Completion has its run event and its running -> outcome mutation",
        _RECEIPT_RECORDED.format(
            what="'completion'",
            table="ql3_ai.model_invocation_completions",
            event_type="'model_invocation_completed'",
            to_status="'running -> ' || r.outcome",
            mutation="m.from_status = 'running' AND m.to_status = r.outcome",
        ),
    ),
    Invariant(
        "resolution_recorded",
        "every Resolution has its run event and its lost -> status mutation",
        _RECEIPT_RECORDED.format(
            what="'resolution'",
            table="ql3_ai.model_invocation_resolutions",
            event_type="'model_invocation_resolved'",
            to_status="'lost -> ...'",
            mutation="m.from_status = 'lost'",
        ),
    ),
    Invariant(
        "history_has_receipt",
        "every run event and every step mutation belongs to a receipt",
        """
        WITH receipts AS (
            SELECT event_id, mutation_id FROM ql3_ai.model_invocation_starts
            UNION ALL SELECT event_id, mutation_id FROM ql3_ai.model_invocation_completions
            UNION ALL SELECT event_id, mutation_id FROM ql3_ai.model_invocation_resolutions
        )
        SELECT format('run event %s (run %s seq %s) has no receipt', e.event_id, e.run_id, e.seq)
          FROM ql3.run_events AS e
         WHERE NOT EXISTS (SELECT 1 FROM receipts AS r WHERE r.event_id = e.event_id)
        UNION ALL
        SELECT format('step mutation %s (step %s) has no receipt', m.mutation_id, m.step_run_id)
          FROM ql3.step_run_mutations AS m
         WHERE NOT EXISTS (SELECT 1 FROM receipts AS r WHERE r.mutation_id = m.mutation_id)
        """,
    ),
    Invariant(
        "running_step_has_open_start",
        "no step is running without an open Start (one without a Completion) of its own",
        """
        SELECT format('step %s is running invocation %s, which has no open start on it',
                      s.step_run_id, s.current_invocation_id)
          FROM ql3.step_runs AS s
         WHERE s.status = 'running'
           AND NOT EXISTS (
               SELECT 1 FROM ql3_ai.model_invocation_starts AS st
                WHERE st.invocation_id = s.current_invocation_id
                  AND st.step_run_id = s.step_run_id
                  AND NOT EXISTS (SELECT 1 FROM ql3_ai.model_invocation_completions AS c
                                   WHERE c.invocation_id = st.invocation_id))
        """,
    ),
    Invariant(
        "step_status_is_last_receipt",
        "each step's status (and running invocation) is what its newest receipt says",
        """
        WITH newest AS (
            SELECT DISTINCT ON (st.step_run_id) st.step_run_id, st.invocation_id
              FROM ql3_ai.model_invocation_starts AS st
             ORDER BY st.step_run_id, st.attempt DESC
        )
        SELECT format('step %s is %s (invocation %s) but its newest receipt says %s '
                      '(invocation %s)',
                      s.step_run_id, s.status, coalesce(s.current_invocation_id, 'none'),
                      x.expected, coalesce(n.invocation_id, 'none'))
          FROM ql3.step_runs AS s
          LEFT JOIN newest AS n ON n.step_run_id = s.step_run_id
          LEFT JOIN ql3_ai.model_invocation_completions AS c ON c.invocation_id = n.invocation_id
          LEFT JOIN ql3_ai.model_invocation_resolutions AS r ON r.invocation_id = n.invocation_id
         CROSS JOIN LATERAL (
               SELECT CASE
                   WHEN n.invocation_id IS NULL THEN 'ready'
                   WHEN c.invocation_id IS NULL THEN 'running'
                   WHEN r.invocation_id IS NULL THEN c.outcome
                   ELSE CASE r.decision WHEN 'retry' THEN 'ready' WHEN 'fail' THEN 'failed'
                                        WHEN 'cancel' THEN 'cancelled' END
               END AS expected) AS x
         WHERE s.status IS DISTINCT FROM x.expected
            OR (s.status = 'running' AND s.current_invocation_id IS DISTINCT FROM n.invocation_id)
        """,
    ),
    Invariant(
        "step_counts",
        "each step's version is 1 + its mutations, its attempt_count its starts",
        """
        SELECT format('step %s is at version %s with %s mutations, attempt_count %s with %s starts',
                      s.step_run_id, s.version, coalesce(m.n, 0), s.attempt_count, coalesce(a.n, 0))
          FROM ql3.step_runs AS s
          LEFT JOIN (SELECT step_run_id, count(*) AS n FROM ql3.step_run_mutations
                      GROUP BY step_run_id) AS m ON m.step_run_id = s.step_run_id
          LEFT JOIN (SELECT step_run_id, count(*) AS n FROM ql3_ai.model_invocation_starts
                      GROUP BY step_run_id) AS a ON a.step_run_id = s.step_run_id
         WHERE s.version <> 1 + coalesce(m.n, 0) OR s.attempt_count <> coalesce(a.n, 0)
        """,
    ),
    Invariant(
        "run_counts",
        "each run's version is 1 + its run events, its event_seq their number",
        """
        SELECT format('run %s is at version %s and event_seq %s with %s run events',
                      r.run_id, r.version, r.event_seq, coalesce(e.n, 0))
          FROM ql3.runs AS r
          LEFT JOIN (SELECT run_id, count(*) AS n FROM ql3.run_events GROUP BY run_id) AS e
            ON e.run_id = r.run_id
         WHERE r.version <> 1 + coalesce(e.n, 0) OR r.event_seq <> coalesce(e.n, 0)
        """,
        needs_ai=False,
    ),
    Invariant(
        "run_event_seqs_gap_free",
        "each run's event seqs are 1..n without a gap",
        """
        SELECT format('run %s has %s run events with seqs %s..%s', e.run_id, count(*),
                      min(e.seq), max(e.seq))
          FROM ql3.run_events AS e
         GROUP BY e.run_id
        HAVING min(e.seq) <> 1 OR max(e.seq) <> count(*)
        """,
        needs_ai=False,
    ),
    Invariant(
        "pointer_is_last_outbox_row",
        "each pointer (revision and pointer_version) is what its last outbox row says",
        """
        WITH last AS (
            SELECT DISTINCT ON (o.project_id, o.contract_family, o.contract_id) o.*
              FROM ql3.contract_outbox AS o
             ORDER BY o.project_id, o.contract_family, o.contract_id, o.seq DESC
        )
        SELECT format('pointer %s/%s/%s is %s at version %s but its last outbox row '
                      '(seq %s) says %s at version %s',
                      coalesce(a.project_id, o.project_id),
                      coalesce(a.contract_family, o.contract_family),
                      coalesce(a.contract_id, o.contract_id),
                      coalesce(a.active_revision_id::text, 'none'),
                      coalesce(a.pointer_version::text, 'none'), coalesce(o.seq::text, 'none'),
                      coalesce(x.revision_id::text, 'none'), x.pointer_version)
          FROM ql3.active_revisions AS a
          FULL JOIN last AS o
            ON (o.project_id, o.contract_family, o.contract_id)
               = (a.project_id, a.contract_family, a.contract_id)
         CROSS JOIN LATERAL (
               SELECT CASE
                   WHEN o.seq IS NULL THEN NULL
                   WHEN o.event_type = 'revision_activated' THEN o.new_revision_id
                   WHEN o.old_revision_id IS NOT DISTINCT FROM o.new_revision_id THEN NULL
                   ELSE o.old_revision_id
               END AS revision_id, coalesce(o.pointer_version, 0) AS pointer_version) AS x
         WHERE a.project_id IS NULL
            OR a.active_revision_id IS DISTINCT FROM x.revision_id
            OR a.pointer_version <> x.pointer_version
        """,
        needs_ai=False,
    ),
    Invariant(
        "active_revision_not_revoked",
        "no pointer names a revoked revision",
        """
        SELECT format('pointer %s/%s/%s names revoked revision %s', a.project_id,
                      a.contract_family, a.contract_id, a.active_revision_id)
          FROM ql3.active_revisions AS a
          JOIN ql3.revision_revocations AS v ON v.revision_id = a.active_revision_id
        """,
        needs_ai=False,
    ),
    Invariant(
        "outbox_delivered",
        "no outbox row is undelivered (--require-delivered)",
        """
        SELECT format('outbox row %s (%s %s/%s/%s version %s) is not delivered', o.seq,
                      o.event_type, o.project_id, o.contract_family, o.contract_id,
                      o.pointer_version)
          FROM ql3.contract_outbox AS o
         WHERE o.delivered_at IS NULL
        """,
        needs_ai=False,
        optional=True,
    ),
)

# -------------------------------------------------------------------------- catalog

# Each query returns (name, definition) rows; the names are unique across all of them.
# The transaction's search_path is pg_catalog alone, so regclass, regprocedure and
# format_type print every ql3 name schema-qualified.
CATALOG_QUERIES: tuple[str, ...] = (
    """
    SELECT 'schema ' || n.nspname, 'owner ' || pg_get_userbyid(n.nspowner)
      FROM pg_namespace AS n WHERE n.nspname = ANY(%(schemas)s)
    """,
    """
    SELECT 'function ' || p.oid::regprocedure::text,
           'sha256:' || encode(sha256(convert_to(
               pg_get_functiondef(p.oid) || E'\\nowner ' || pg_get_userbyid(p.proowner), 'UTF8')),
               'hex')
      FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
     WHERE n.nspname = ANY(%(schemas)s) AND p.prokind IN ('f', 'p', 'w')
    """,
    """
    SELECT format('%%s %%s', CASE c.relkind WHEN 'r' THEN 'table' WHEN 'p' THEN 'table'
                                          WHEN 'v' THEN 'view' WHEN 'm' THEN 'view'
                                          WHEN 'S' THEN 'sequence' WHEN 'c' THEN 'type'
                                          ELSE 'relation' END, c.oid::regclass),
           format('kind %%s owner %%s rls %%s force_rls %%s%%s', c.relkind,
                  pg_get_userbyid(c.relowner), c.relrowsecurity, c.relforcerowsecurity,
                  CASE WHEN c.relkind IN ('v', 'm') THEN ' ' || pg_get_viewdef(c.oid) ELSE '' END)
      FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = ANY(%(schemas)s) AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f', 'c')
    """,
    """
    SELECT format('column %%s.%%I', c.oid::regclass, a.attname),
           concat_ws(' ', format_type(a.atttypid, a.atttypmod),
                     CASE WHEN a.attnotnull THEN 'not null' END,
                     'default ' || pg_get_expr(d.adbin, d.adrelid),
                     CASE a.attidentity WHEN 'a' THEN 'identity always'
                                        WHEN 'd' THEN 'identity by default' END,
                     CASE WHEN a.attgenerated = 's' THEN 'generated' END,
                     'collate ' || NULLIF(a.attcollation, 0)::regcollation::text,
                     'position ' || a.attnum)
      FROM pg_attribute AS a
      JOIN pg_class AS c ON c.oid = a.attrelid
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
      LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
     WHERE n.nspname = ANY(%(schemas)s) AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
       AND a.attnum > 0 AND NOT a.attisdropped
    """,
    """
    SELECT format('constraint %%s.%%I',
                  coalesce(co.conrelid::regclass::text, co.contypid::regtype::text), co.conname),
           pg_get_constraintdef(co.oid) || CASE WHEN co.convalidated THEN '' ELSE ' NOT VALID' END
      FROM pg_constraint AS co JOIN pg_namespace AS n ON n.oid = co.connamespace
     WHERE n.nspname = ANY(%(schemas)s)
    """,
    """
    SELECT format('trigger %%s.%%I', t.tgrelid::regclass, t.tgname),
           pg_get_triggerdef(t.oid) || ' enabled ' || t.tgenabled::text
      FROM pg_trigger AS t
      JOIN pg_class AS c ON c.oid = t.tgrelid
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = ANY(%(schemas)s) AND NOT t.tgisinternal
    """,
    """
    SELECT 'index ' || i.indexrelid::regclass::text,
           pg_get_indexdef(i.indexrelid) || CASE WHEN i.indisvalid THEN '' ELSE ' INVALID' END
      FROM pg_index AS i
      JOIN pg_class AS c ON c.oid = i.indexrelid
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = ANY(%(schemas)s)
    """,
    """
    SELECT format('policy %%s.%%I', p.polrelid::regclass, p.polname),
           format('cmd %%s permissive %%s roles %%s using %%s check %%s', p.polcmd,
                  p.polpermissive,
                  (SELECT array_agg(CASE r WHEN 0 THEN 'public' ELSE pg_get_userbyid(r)::text END
                                    ORDER BY 1) FROM unnest(p.polroles) AS r),
                  pg_get_expr(p.polqual, p.polrelid), pg_get_expr(p.polwithcheck, p.polrelid))
      FROM pg_policy AS p
      JOIN pg_class AS c ON c.oid = p.polrelid
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = ANY(%(schemas)s)
    """,
    """
    SELECT 'type ' || t.oid::regtype::text,
           concat_ws(' ', 'kind ' || t.typtype::text, 'owner ' || pg_get_userbyid(t.typowner),
                     'base ' || format_type(NULLIF(t.typbasetype, 0), t.typtypmod),
                     CASE WHEN t.typnotnull THEN 'not null' END, 'default ' || t.typdefault,
                     'labels ' || (SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                                     FROM pg_enum AS e WHERE e.enumtypid = t.oid))
      FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
     WHERE n.nspname = ANY(%(schemas)s) AND t.typtype IN ('d', 'e', 'b', 'r', 'm')
       AND NOT (t.typcategory = 'A' AND t.typelem <> 0)
    """,
    """
    SELECT 'sequence options ' || s.seqrelid::regclass::text,
           format('type %%s start %%s increment %%s min %%s max %%s cache %%s cycle %%s',
                  format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmin, s.seqmax,
                  s.seqcache, s.seqcycle)
      FROM pg_sequence AS s
      JOIN pg_class AS c ON c.oid = s.seqrelid
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = ANY(%(schemas)s)
    """,
)

# The items of an ACL sorted (a revoke and re-grant may reorder them); NULL is the
# built-in default.
_ACL = "coalesce((SELECT string_agg(x, ' ' ORDER BY x) FROM unnest({}::text[]) AS x), 'default')"

ACL_QUERIES: tuple[str, ...] = (
    f"""
    SELECT 'schema ' || n.nspname, {_ACL.format("n.nspacl")}
      FROM pg_namespace AS n WHERE n.nspname = ANY(%(schemas)s)
    """,
    f"""
    SELECT 'relation ' || c.oid::regclass::text, {_ACL.format("c.relacl")}
      FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = ANY(%(schemas)s) AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
    """,
    f"""
    SELECT format('column %%s.%%I', c.oid::regclass, a.attname), {_ACL.format("a.attacl")}
      FROM pg_attribute AS a
      JOIN pg_class AS c ON c.oid = a.attrelid
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = ANY(%(schemas)s) AND a.attacl IS NOT NULL AND NOT a.attisdropped
    """,
    f"""
    SELECT 'function ' || p.oid::regprocedure::text, {_ACL.format("p.proacl")}
      FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
     WHERE n.nspname = ANY(%(schemas)s)
    """,
    f"""
    SELECT 'type ' || t.oid::regtype::text, {_ACL.format("t.typacl")}
      FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
     WHERE n.nspname = ANY(%(schemas)s) AND t.typtype IN ('d', 'e', 'b', 'r', 'm')
       AND NOT (t.typcategory = 'A' AND t.typelem <> 0)
    """,
    f"""
    SELECT format('default acl of %%s in %%s on %%s', pg_get_userbyid(d.defaclrole),
                  coalesce(n.nspname, 'every schema'),
                  CASE d.defaclobjtype WHEN 'r' THEN 'tables' WHEN 'S' THEN 'sequences'
                                       WHEN 'f' THEN 'functions' WHEN 'T' THEN 'types'
                                       WHEN 'n' THEN 'schemas' ELSE d.defaclobjtype::text END),
           {_ACL.format("d.defaclacl")}
      FROM pg_default_acl AS d LEFT JOIN pg_namespace AS n ON n.oid = d.defaclnamespace
     WHERE n.nspname = ANY(%(schemas)s)
        OR (d.defaclnamespace = 0 AND pg_get_userbyid(d.defaclrole) = ANY(%(roles)s))
    """,
    # ql3's roles themselves: their attributes, who holds them (a login granted ql3_owner
    # writes every table) and what they hold (ql3_runtime made a member of
    # pg_write_all_data would too). Roles are the cluster's, so this reads pg_roles and
    # pg_auth_members, which every role may read.
    """
    SELECT 'role ' || r.rolname,
           format('login %%s superuser %%s createrole %%s createdb %%s replication %%s'
                  ' bypassrls %%s inherit %%s; members: %%s; member of: %%s',
                  r.rolcanlogin, r.rolsuper, r.rolcreaterole, r.rolcreatedb,
                  r.rolreplication, r.rolbypassrls, r.rolinherit,
                  coalesce((SELECT string_agg(x.name, ' ' ORDER BY x.name)
                              FROM (SELECT pg_get_userbyid(m.member)::text
                                           || CASE WHEN m.admin_option THEN ' (admin)'
                                                   ELSE '' END AS name
                                      FROM pg_auth_members AS m
                                     WHERE m.roleid = r.oid) AS x), 'none'),
                  coalesce((SELECT string_agg(x.name, ' ' ORDER BY x.name)
                              FROM (SELECT pg_get_userbyid(m.roleid)::text AS name
                                      FROM pg_auth_members AS m
                                     WHERE m.member = r.oid) AS x), 'none'))
      FROM pg_roles AS r WHERE r.rolname = ANY(%(roles)s)
    """,
)


# -------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class LedgerTable:
    name: str  # schema.table
    schema: str
    table: str
    key: tuple[str, ...]
    columns: tuple[str, ...]
    readable: bool


def _transaction_settings(conn: psycopg.Connection[Any]) -> None:
    """One consistent, read-only view, printed the same way whatever the role's settings:
    every ql3 name qualified, timestamps in UTC, floats exact."""
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    for name, value in (
        ("search_path", "pg_catalog"),
        ("TimeZone", "UTC"),
        ("DateStyle", "ISO, YMD"),
        ("IntervalStyle", "postgres"),
        ("extra_float_digits", "1"),
        ("bytea_output", "hex"),
    ):
        conn.execute("SELECT set_config(%s, %s, true)", [name, value])


def _pairs(conn: psycopg.Connection[Any], queries: Iterable[str]) -> dict[str, str]:
    params = {"schemas": list(SCHEMAS), "roles": list(QL3_ROLES)}
    found: dict[str, str] = {}
    for query in queries:
        for name, value in conn.execute(query, params).fetchall():
            found[str(name)] = str(value)
    return dict(sorted(found.items()))


def _installed(conn: psycopg.Connection[Any]) -> dict[str, bool]:
    rows = conn.execute(
        "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)", [list(SCHEMAS)]
    ).fetchall()
    present = {str(name) for (name,) in rows}
    return {schema: schema in present for schema in SCHEMAS}


def _history(conn: psycopg.Connection[Any], installed: Mapping[str, bool]) -> dict[str, Any]:
    history: dict[str, Any] = {}
    for table, stream in HISTORY_TABLES.items():
        schema = table.split(".")[0]
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table]).fetchone()
        if not installed[schema] or not (exists and exists[0]):
            history[stream] = None
            continue
        where = " WHERE stream = 'ql3_ai'" if stream == "ql3_ai" else ""
        rows = conn.execute(
            f"SELECT version, name, checksum FROM {table}{where} ORDER BY version"
        ).fetchall()
        history[stream] = [[int(v), str(n), str(c)] for v, n, c in rows]
    return history


def ledger_tables(conn: psycopg.Connection[Any]) -> list[LedgerTable]:
    """Every table of the ql3 schemas but the migration ledgers, with its key: the
    primary key, else its first unique index, else every column."""
    rows = conn.execute(
        """
        SELECT n.nspname, c.relname,
               (SELECT array_agg(a.attname::text ORDER BY k.ord)
                  FROM (SELECT i.indkey FROM pg_index AS i
                         WHERE i.indrelid = c.oid AND i.indisunique AND i.indpred IS NULL
                           AND 0 <> ALL(i.indkey)
                         ORDER BY i.indisprimary DESC, i.indexrelid::regclass::text
                         LIMIT 1) AS u
                  CROSS JOIN unnest(u.indkey) WITH ORDINALITY AS k (attnum, ord)
                  JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum = k.attnum),
               (SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute AS a
                 WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
               has_table_privilege(c.oid, 'SELECT')
          FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE n.nspname = ANY(%s) AND c.relkind IN ('r', 'p')
         ORDER BY n.nspname, c.relname
        """,
        [list(SCHEMAS)],
    ).fetchall()
    tables = []
    for schema, table, key, columns, readable in rows:
        name = f"{schema}.{table}"
        if name in HISTORY_TABLES:
            continue
        cols = tuple(columns or ())
        tables.append(LedgerTable(name, schema, table, tuple(key or cols), cols, bool(readable)))
    return tables


def _row_query(table: LedgerTable) -> sql.Composed:
    """key (a JSON array's text), md5 of the unchanging columns, progress, md5 of the row."""
    mutable = MUTABLE_TABLES.get(table.name)
    fixed = mutable.fixed if mutable else table.columns
    progress = sql.SQL(mutable.progress) if mutable else sql.SQL("NULL::integer")
    key = sql.SQL(", ").join(sql.Identifier(c) for c in table.key)
    return sql.SQL(
        "SELECT jsonb_build_array({key})::text, md5(ROW({fixed})::text), {progress},"
        " md5(t::text) FROM {table} AS t"
    ).format(
        key=key,
        fixed=sql.SQL(", ").join(sql.Identifier(c) for c in fixed),
        progress=progress,
        table=sql.Identifier(table.schema, table.table),
    )


def _ledger(conn: psycopg.Connection[Any], table: LedgerTable) -> dict[str, Any]:
    if not table.readable:
        return {"readable": False}
    mutable = table.name in MUTABLE_TABLES
    rows: dict[str, Any] = {}
    full = hashlib.sha256()
    fetched = conn.execute(_row_query(table)).fetchall()
    fetched.sort(key=lambda row: str(row[0]))
    for key, fixed, progress, whole in fetched:
        rows[str(key)] = [str(fixed), int(progress)] if mutable else str(fixed)
        full.update(f"{key}\t{whole}\n".encode())
    return {
        "readable": True,
        "key": list(table.key),
        "count": len(fetched),
        "checksum": full.hexdigest(),
        "rows": rows,
    }


@dataclass(frozen=True)
class Violation:
    invariant: str
    count: int
    examples: tuple[str, ...]

    def describe(self) -> str:
        shown = "; ".join(self.examples)
        more = (
            f" (and {self.count - len(self.examples)} more)"
            if self.count > len(self.examples)
            else ""
        )
        return f"invariant {self.invariant}: {self.count} violation(s): {shown}{more}"


def check_invariants(
    conn: psycopg.Connection[Any], *, ai: bool, require_delivered: bool
) -> list[Violation]:
    """Each invariant that applies, checked in the connection's transaction."""
    found = []
    for invariant in INVARIANTS:
        if (invariant.needs_ai and not ai) or (invariant.optional and not require_delivered):
            continue
        rows = conn.execute(
            f"SELECT count(*) OVER (), v.d FROM ({invariant.query}) AS v (d) LIMIT {EXAMPLES}"
        ).fetchall()
        if rows:
            found.append(Violation(invariant.name, int(rows[0][0]), tuple(str(d) for _, d in rows)))
    return found


def _refuse_partial_view(conn: psycopg.Connection[Any]) -> None:
    row = conn.execute("SELECT ql3.visible_projects()").fetchone()
    if row is not None and row[0] is not None:
        raise errors.PermissionDenied(
            "QL3_PERMISSION_DENIED: this role sees only some projects (project isolation, "
            "D47), so the ledgers it reads are partial: map it to every project with "
            "ql3.grant_project(role, NULL), or verify as a role that is"
        )


@dataclass
class Snapshot:
    """A snapshot document (``to_json``) and the invariants broken when it was taken."""

    document: dict[str, Any]
    violations: list[Violation] = field(default_factory=list)


def take_snapshot(conninfo: str, *, require_delivered: bool = False) -> Snapshot:
    """Read one database's snapshot in one read-only transaction (see the module doc)."""
    with (
        connect(conninfo, timeouts=Timeouts(statement_ms=STATEMENT_TIMEOUT_MS)) as conn,
        translated(),
        conn.transaction(),
    ):
        _transaction_settings(conn)
        installed = _installed(conn)
        if not installed["ql3"]:
            raise errors.DatabaseError(
                "QL3_DATABASE_ERROR: schema ql3 does not exist: is ql3 installed in this "
                "database? Run ql3 migrate (with --with-ai for model invocations)"
            )
        _refuse_partial_view(conn)
        info = conn.execute(
            "SELECT current_database(), current_setting('server_version'), pg_is_in_recovery(),"
            " now()::text"
        ).fetchone()
        assert info is not None
        document: dict[str, Any] = {
            "format": SNAPSHOT_FORMAT,
            "database": {"name": info[0], "server_version": info[1], "in_recovery": info[2]},
            "taken_at": info[3],
            "installed": installed,
            "history": _history(conn, installed),
            "catalog": _pairs(conn, CATALOG_QUERIES),
            "acl": _pairs(conn, ACL_QUERIES),
            "ledgers": {t.name: _ledger(conn, t) for t in ledger_tables(conn)},
        }
        violations = check_invariants(
            conn, ai=installed["ql3_ai"], require_delivered=require_delivered
        )
        document["invariants"] = {v.invariant: v.describe() for v in violations}
    return Snapshot(document, violations)


# -------------------------------------------------------------------------- compare


def _compare_named(kind: str, before: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    found = []
    for name in sorted(before.keys() | now.keys()):
        if name not in now:
            found.append(f"{kind}: {name} is missing (snapshot: {before[name]})")
        elif name not in before:
            found.append(f"{kind}: {name} is new (now: {now[name]})")
        elif before[name] != now[name]:
            found.append(f"{kind}: {name} differs (snapshot: {before[name]}; now: {now[name]})")
    return found


def _examples(kind: str, table: str, keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:EXAMPLES])
    more = f" and {len(keys) - EXAMPLES} more" if len(keys) > EXAMPLES else ""
    return f"ledger {table}: {len(keys)} row(s) {kind}: {shown}{more}"


def _compare_ledger(
    name: str, before: Mapping[str, Any], now: Mapping[str, Any] | None, *, exact: bool
) -> list[str]:
    if now is None:
        return [f"ledger {name}: the table is missing"]
    if not before.get("readable"):
        return []  # the snapshot's role could not read it: nothing to compare with
    if not now.get("readable"):
        return [f"ledger {name}: not readable by this role, but the snapshot covers it"]
    if exact:
        if before["checksum"] == now["checksum"]:
            return []
    elif before["count"] == 0:
        return []
    old_rows: Mapping[str, Any] = before["rows"]
    new_rows: Mapping[str, Any] = now["rows"]
    missing, changed, behind = [], [], []
    for key, value in old_rows.items():
        current = new_rows.get(key)
        if current is None:
            missing.append(key)
        elif isinstance(value, list):
            if current[0] != value[0]:
                changed.append(key)
            elif current[1] < value[1]:
                behind.append(f"{key} ({value[1]} -> {current[1]})")
        elif current != value:
            changed.append(key)
    found = []
    if missing:
        found.append(_examples("missing", name, missing))
    if changed:
        found.append(_examples("changed", name, changed))
    if behind:
        found.append(_examples("gone back", name, behind))
    if exact:
        extra = sorted(new_rows.keys() - old_rows.keys())
        if extra:
            found.append(_examples("new (--exact)", name, extra))
        if not found:  # same keys and hashes, other full rows: a changing column moved
            found.append(
                f"ledger {name}: checksum differs (snapshot {before['checksum']}, now "
                f"{now['checksum']})"
            )
    return found


def compare(before: Mapping[str, Any], now: Mapping[str, Any], *, exact: bool = False) -> list[str]:
    """Every difference between a snapshot and a live reading, each naming what differs:
    history, catalog and ACLs must be equal; ledgers a superset (or equal with ``exact``)."""
    found: list[str] = []
    for stream in sorted(before["history"].keys() | now["history"].keys()):
        old, new = before["history"].get(stream), now["history"].get(stream)
        if old != new:
            found.append(f"history {stream}: snapshot {old}, now {new}")
    found += _compare_named("catalog", before["catalog"], now["catalog"])
    found += _compare_named("acl", before["acl"], now["acl"])
    for name, ledger in sorted(before["ledgers"].items()):
        found += _compare_ledger(name, ledger, now["ledgers"].get(name), exact=exact)
    for name in sorted(now["ledgers"].keys() - before["ledgers"].keys()):
        found.append(f"ledger {name}: the table is new")
    return found


@dataclass
class Report:
    """What ``--against`` found: the differences and the live invariant violations."""

    differences: list[str]
    violations: list[Violation]
    tables: dict[str, dict[str, int | None]]

    @property
    def ok(self) -> bool:
        return not self.differences and not self.violations

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "differences": self.differences,
            "violations": [v.describe() for v in self.violations],
            "tables": self.tables,
        }


def read_snapshot(path: str | Path) -> dict[str, Any]:
    """A snapshot file; ``Misconfigured`` naming the file when it is not one."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: cannot read the snapshot {path}: {reason}"
        ) from None
    if not isinstance(document, dict) or document.get("format") != SNAPSHOT_FORMAT:
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: {path} is not a ql3 verify snapshot ({SNAPSHOT_FORMAT})"
        )
    return document


def write_snapshot(path: str | Path, document: Mapping[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed over the target)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(document, sort_keys=True), encoding="utf-8")
        temporary.replace(target)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise errors.Misconfigured(
            f"QL3_INVALID_ARGUMENT: cannot write the snapshot {path}: {exc.strerror or exc}"
        ) from None


def verify_against(
    conninfo: str,
    snapshot: Mapping[str, Any],
    *,
    exact: bool = False,
    require_delivered: bool = False,
) -> Report:
    """Compare the live database with ``snapshot`` and check its invariants live."""
    live = take_snapshot(conninfo, require_delivered=require_delivered)
    tables: dict[str, dict[str, int | None]] = {}
    for name in sorted(snapshot["ledgers"].keys() | live.document["ledgers"].keys()):
        old = snapshot["ledgers"].get(name) or {}
        new = live.document["ledgers"].get(name) or {}
        tables[name] = {"snapshot": old.get("count"), "now": new.get("count")}
    return Report(compare(snapshot, live.document, exact=exact), live.violations, tables)


# -------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``verify`` to a CLI (``func`` returns the exit code)."""
    parser = subparsers.add_parser(
        "verify",
        help="snapshot a database, or check one against a snapshot (the promotion gate)",
        description="Check the ledger invariants of a database; with --snapshot FILE also "
        "write its schema and feature history, catalog, ACLs and ledger checksums to FILE; "
        "with --against FILE compare it with such a snapshot (ledgers may have grown). "
        "Exits 1 naming each difference or violation. Needs SELECT only (ql3_reader).",
    )
    parser.add_argument("--dsn", help="PostgreSQL conninfo (default: $QL3_DSN)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--snapshot", metavar="FILE", help="write a snapshot of the database")
    mode.add_argument("--against", metavar="FILE", help="compare the database with a snapshot")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="with --against: the ledgers must equal the snapshot's, not only contain them",
    )
    parser.add_argument(
        "--require-delivered",
        action="store_true",
        help="also fail when an outbox row is undelivered",
    )
    parser.set_defaults(func=run_verify_command)


def _print(value: Any) -> None:
    print(json_text(value, indent=2, sort_keys=True))


def run_verify_command(args: argparse.Namespace) -> int:
    dsn = dsn_from_env(args.dsn)
    if args.exact and not args.against:
        raise errors.Misconfigured("QL3_INVALID_ARGUMENT: --exact goes with --against FILE")
    if args.against:
        snapshot = read_snapshot(args.against)
        report = verify_against(
            dsn, snapshot, exact=args.exact, require_delivered=args.require_delivered
        )
        _print({"against": args.against, **report.as_json()})
        return 0 if report.ok else 1
    taken = take_snapshot(dsn, require_delivered=args.require_delivered)
    if args.snapshot:
        write_snapshot(args.snapshot, taken.document)
    _print(
        {
            "ok": not taken.violations,
            "snapshot": args.snapshot,
            "violations": [v.describe() for v in taken.violations],
            "tables": {
                name: ledger.get("count") for name, ledger in taken.document["ledgers"].items()
            },
        }
    )
    return 0 if not taken.violations else 1


__all__ = [
    "INVARIANTS",
    "MUTABLE_TABLES",
    "SNAPSHOT_FORMAT",
    "Invariant",
    "LedgerTable",
    "Mutable",
    "Report",
    "Snapshot",
    "Violation",
    "check_invariants",
    "compare",
    "ledger_tables",
    "read_snapshot",
    "register",
    "run_verify_command",
    "take_snapshot",
    "verify_against",
    "write_snapshot",
]
