"""The README's psql examples run as written, as the role they say they need."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from fix_servers import role_dsn

README = Path(__file__).resolve().parents[2] / "README.md"


def sql_blocks() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", README.read_text(), flags=re.S)


def run_psql(dsn: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        check=False,
    )


def test_readme_contract_walkthrough_runs_in_psql_as_operator(db_dsn: str) -> None:
    block = next(b for b in sql_blocks() if "ql3.put_revision" in b and "ql3_ai" not in b)
    result = run_psql(role_dsn(db_dsn, "operator"), block)
    assert result.returncode == 0, result.stderr
    assert '{"a":[1,0.5],"b":1}' in result.stdout
    assert "revision_revoked" in result.stdout


def test_readme_invocation_walkthrough_runs_in_psql(db_dsn: str) -> None:
    # The superuser login exercises the grants anyway: the block SET ROLEs to each role.
    block = next(b for b in sql_blocks() if "ql3_ai.admit_invocation" in b)
    result = run_psql(db_dsn, block)
    assert result.returncode == 0, result.stderr
    assert "retry admitted as attempt 2" in result.stdout
    assert "model_invocation_resolved" in result.stdout
