"""The SQL API called as psql would call it: random JSON text for the three command
functions, numbers included that no Python float can carry (``1e400``, 30 digits,
``-0``, ``1.0``), must end in one of ql3's SQLSTATEs (SPEC section 6: the class Q3) or,
for text that is not JSON PostgreSQL can hold, in the ``::jsonb`` cast's own 22P02/22P05.
Never ``22003`` (out of range), ``XX000`` or any other error from inside a function.

The commands are the mutations of ``test_differential``; ``QL3_FUZZ_EXAMPLES=N`` runs
more, with a random seed.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ql3.invocations import RESOLUTION_COMMAND_SCHEMA
from test_differential import admission, completion, mutated

BIG_NUMBERS = [
    "1e400", "-1e400", "1E2", "1.0", "-0", "0.0", "1e-400", "123456789012345678901234567890",
    "9007199254740993", "1000000000000000", "999999999999999", "2.5e15", "1e15", "100e-2", "-1",
]  # fmt: skip
numbers = st.sampled_from(BIG_NUMBERS).map(lambda text: f"@@{text}@@")
FUNCTIONS = {
    "admission": "ql3_ai.admit_invocation",
    "completion": "ql3_ai.complete_invocation",
    "resolution": "ql3_ai.resolve_invocation",
}


def json_text(doc: Any) -> str:
    """JSON text of ``doc`` with each "@@n@@" string written as the bare number n."""
    return re.sub(r'"@@([^@"]*)@@"', r"\1", json.dumps(doc))


def valid(kind: str) -> dict[str, Any]:
    run_id, step_id = "cccccccc-0000-0000-0000-000000000001", "dddddddd-0000-0000-0000-000000000001"
    if kind == "admission":
        return admission(run_id, step_id, 1, None)
    if kind == "completion":
        return completion(1, "a" * 64)
    return {
        "schema": RESOLUTION_COMMAND_SCHEMA,
        "invocation_id": "inv-1",
        "completion_digest": "a" * 64,
        "decision": "retry",
        "user_id": "alice",
        "expected_step_run_version": 3,
        "reason": None,
    }


@settings(
    max_examples=int(os.environ.get("QL3_FUZZ_EXAMPLES", "300")),
    deadline=None,
    derandomize="QL3_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data(), kind=st.sampled_from(sorted(FUNCTIONS)))
def test_every_refusal_is_a_ql3_sqlstate(db_dsn: str, data: st.DataObject, kind: str) -> None:
    doc = data.draw(mutated(valid(kind), ("usage",)))
    for key in list(doc):
        if data.draw(st.integers(0, 6)) == 0:
            doc[key] = data.draw(numbers)
    if isinstance(doc.get("usage"), dict):
        doc["usage"] = {k: data.draw(numbers) if data.draw(st.booleans()) else v
                        for k, v in doc["usage"].items()}  # fmt: skip
    try:
        text = json_text(doc)
    except ValueError:  # NaN or an infinity: not JSON at all
        return
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        try:
            conn.execute(f"SELECT {FUNCTIONS[kind]}(%s::jsonb)", (text,))
        except psycopg.Error as exc:
            state = exc.sqlstate or ""
            at_the_cast = state in ("22P02", "22P05") and "json" in str(exc).lower()
            unicode_at_the_cast = state == "22P05" and "Unicode" in str(exc)
            assert state.startswith("Q3") or at_the_cast or unicode_at_the_cast, (state, exc, text)
