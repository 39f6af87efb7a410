"""The operator reads of model invocations on PostgreSQL: the statements behind
``PgStore.list_invocations``, ``unresolved_invocations``, ``invocation`` and
``unresolved_by_project`` (``ql3 invocations``, ``ql3 resolve`` and the recovery
daemon's unresolved gauges). ``ql3.edge.invocation_reads`` is their SQLite twin: the same
keys, orders and value spellings.

They select from the ``ql3_ai`` receipt tables directly, which ``ql3_reader``,
``ql3_operator`` and ``ql3_runtime`` may all do (row-level security shows a login its
projects only). No driver is imported here: the statements are plain text.
"""

from __future__ import annotations

from collections.abc import Sequence

from ql3 import arguments, errors


def check_projects(projects: Sequence[str] | None) -> list[str] | None:
    """The project filter of a read: None (every project) or a list of project_ids; an
    empty list is None too."""
    if projects is None:
        return None
    if isinstance(projects, str):
        raise errors.InvalidArgument(
            "QL3_INVALID_ARGUMENT: projects must be a list of project_ids, not one string"
        )
    listed = list(projects)
    arguments.check_text_args(*listed)
    return listed or None


def check_limit(limit: int) -> int:
    """The row limit of a read: a whole number, at least 1."""
    return arguments.check_count("limit", limit, 1)


_LIST_COLUMNS = """
SELECT st.invocation_id, st.project_id, st.run_id::text AS run_id,
       st.step_run_id::text AS step_run_id, st.attempt, st.provider, st.model,
       st.record ->> 'deadline_at' AS deadline_at, st.record ->> 'admitted_at' AS admitted_at,
       c.outcome, c.result_code, c.recovered, c.record ->> 'completed_at' AS completed_at,
       v.decision, v.user_id AS resolved_as, v.resolved_by::text AS resolved_by,
       v.record ->> 'resolved_at' AS resolved_at
FROM ql3_ai.model_invocation_starts AS st
LEFT JOIN ql3_ai.model_invocation_completions AS c ON c.invocation_id = st.invocation_id
LEFT JOIN ql3_ai.model_invocation_resolutions AS v ON v.invocation_id = st.invocation_id
"""

# The resolution queue: lost and waiting for a human, oldest first (the order a queue is
# worked in). One bounded query: the partial index on lost completions delivers the order
# (and the --older-than range), the anti-join drops the resolved ones. Age runs from the
# lost completion: the moment the call entered the queue, which is what a human has let
# wait.
UNRESOLVED_SQL = """
SELECT st.invocation_id, st.project_id, st.run_id::text AS run_id,
       st.step_run_id::text AS step_run_id, st.attempt, st.provider, st.model,
       st.policy_contract_family, st.policy_contract_id,
       st.policy_revision_id::text AS policy_revision_id,
       st.record ->> 'deadline_at' AS deadline_at, st.record ->> 'admitted_at' AS admitted_at,
       c.outcome, c.result_code, c.recovered, c.record ->> 'completed_at' AS completed_at,
       extract(epoch FROM pg_catalog.now() - c.completed_at)::float8 AS age_seconds
FROM ql3_ai.model_invocation_completions AS c
INNER JOIN ql3_ai.model_invocation_starts AS st ON st.invocation_id = c.invocation_id
WHERE c.outcome = 'lost'
  AND c.completed_at <= pg_catalog.now() - %(older_than)s::interval
  AND (%(projects)s::text[] IS NULL OR c.project_id = any(%(projects)s::text[]))
  AND NOT EXISTS (
      SELECT 1 FROM ql3_ai.model_invocation_resolutions AS v
      WHERE v.invocation_id = c.invocation_id)
ORDER BY c.completed_at, c.invocation_id
LIMIT %(limit)s
"""

# Invocations with their outcome and resolution, newest first.
RECENT_SQL = (
    _LIST_COLUMNS
    + """WHERE %(projects)s::text[] IS NULL OR st.project_id = any(%(projects)s::text[])
ORDER BY st.admitted_at DESC, st.invocation_id DESC
LIMIT %(limit)s"""
)

# One invocation: its receipts and digests, the step as it is now, its usage row.
DETAIL_SQL = """
SELECT st.record AS start, st.start_digest,
       c.record AS completion, c.completion_digest,
       v.record AS resolution, v.resolution_digest, v.resolved_by::text AS resolved_by,
       to_jsonb(s) AS step, to_jsonb(u) AS usage
FROM ql3_ai.model_invocation_starts AS st
INNER JOIN ql3.step_runs AS s ON s.step_run_id = st.step_run_id
LEFT JOIN ql3_ai.model_invocation_completions AS c ON c.invocation_id = st.invocation_id
LEFT JOIN ql3_ai.model_invocation_resolutions AS v ON v.invocation_id = st.invocation_id
LEFT JOIN ql3_ai.usage_ledger AS u ON u.invocation_id = st.invocation_id
WHERE st.invocation_id = %s
"""

# The recovery daemon's gauges, one bounded query per round (D57): the lost completions (a
# partial index) without a resolution, grouped by project, the projects that have waited
# longest first.
UNRESOLVED_BY_PROJECT_SQL = """
SELECT c.project_id AS project,
       count(*) AS unresolved,
       greatest(0, extract(epoch FROM now() - min(c.completed_at)))::float8 AS oldest_age_seconds
FROM ql3_ai.model_invocation_completions AS c
WHERE c.outcome = 'lost'
  AND NOT EXISTS (
      SELECT 1 FROM ql3_ai.model_invocation_resolutions AS v
      WHERE v.invocation_id = c.invocation_id)
GROUP BY c.project_id
ORDER BY min(c.completed_at), c.project_id
LIMIT %s
"""
