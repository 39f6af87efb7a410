"""``python -m bench --quick --only privilege_ab`` produces its figures (issue 20): the A/B
of the SQL before and after D46 (never a timed test: the ratios are not checked)."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from test_bench_smoke import REPO_ROOT, positive, quick_bench


def test_quick_privilege_ab_run_reports_both_sides_at_both_client_counts(
    base_dsn: str, redis_url: str, tmp_path: Path
) -> None:
    ab = quick_bench(base_dsn, redis_url, tmp_path, "privilege_ab")["benchmarks"]["privilege_ab"]
    assert "not_measured" not in ab["figures"], ab["figures"]
    for metric in ("pairs", "activations"):
        for clients in (1, 8):
            key = f"{clients}_clients"
            assert positive(ab["figures"][f"{metric}_per_s_after_{key}"])
            # The diagnostic side: the SQL of the change itself.
            assert positive(ab["figures"][f"{metric}_per_s_d46_{key}"])
            assert positive(ab["ratio"][f"{metric}_d46_{key}"])
            assert positive(ab["baseline"][f"{metric}_per_s_before_{key}"])
            assert positive(ab["ratio"][f"{metric}_{key}"])
            by_round = ab["figures"][f"{metric}_after_over_before_by_round_{key}"]
            assert len(by_round) == 2 and all(positive(r) for r in by_round)  # --quick
            for side in ("before", "d46", "after"):
                assert ab["checks"][f"{metric}_transactions_{side}_{key}"] > 0
                raw = ab["figures"][f"{metric}_per_s_{side}_by_round_{key}"]
                assert len(raw) == 2 and all(positive(r) for r in raw)
    # Each database holds its own side's privileges, read after both were migrated.
    privileges = ab["checks"]["privileges"]
    assert privileges["before"]["runtime_inserts_starts"] is True
    assert privileges["before"]["admit_invocation_security_definer"] is False
    assert privileges["after"]["runtime_inserts_starts"] is False
    assert privileges["after"]["admit_invocation_security_definer"] is True
    assert privileges["d46"] == privileges["after"]
    judged = [row for row in ab["rows"] if row["result"] != "n/a"]
    assert len(judged) == 2 and all("8 clients" in row["label"] for row in judged)
    assert isinstance(ab["pass"], bool)


def _one_pair_as_runtime(dsn: str) -> None:
    """One admit+complete of a fresh ready step, as ql3_runtime (bench.pairs's SQL)."""
    from bench import pairs

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pairs.SETUP_SQL)
        conn.execute("SELECT bench_prepare(%s, 1, 1)", (pairs._BASE0,))
        conn.execute("SET ROLE ql3_runtime")
        row = conn.execute(
            "SELECT ql3_ai.admit_invocation(bench_admission(%s)) ->> 'start_digest'",
            (pairs._BASE0,),
        ).fetchone()
        assert row is not None and row[0]
        done = conn.execute(
            "SELECT ql3_ai.complete_invocation(bench_completion(%s, %s)) ->> 'status'",
            (pairs._BASE0, row[0]),
        ).fetchone()
        assert done is not None and done[0] == "created"


@pytest.mark.parametrize("order", [("after", "before"), ("before", "after")])
def test_before_and_after_databases_keep_their_own_grants_whichever_is_migrated_first(
    base_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: tuple[str, str]
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from contextlib import ExitStack

    from bench import privilege_ab

    privilege_ab.extract_sql(privilege_ab.BEFORE_COMMIT, tmp_path)
    roots = {"before": tmp_path / "sql", "after": REPO_ROOT / "sql"}
    with ExitStack() as stack:
        dsns = {
            side: stack.enter_context(privilege_ab.migrated_database(base_dsn, side, roots[side]))
            for side in order
        }
        for side, dsn in dsns.items():
            privilege_ab.check_privileges(side, privilege_ab.privileges(dsn))
            _one_pair_as_runtime(dsn)


def test_privilege_ab_without_the_before_commit_is_not_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench import privilege_ab
    from bench.common import Settings

    monkeypatch.setattr(privilege_ab, "BEFORE_COMMIT", "0" * 40)
    result = privilege_ab.run(Settings("postgresql://unused", "redis://unused", quick=True))
    assert result.passed is None
    assert result.figures["not_measured"] == (
        f"commit {'0' * 40} is not in the git repository at {REPO_ROOT}"
    )
    (row,) = result.rows
    assert row.figure.startswith("not measured: ") and row.result == "n/a"
