"""``ql3.canonical``'s fast path: ``json.dumps`` text where it is provably the JCS text.

``canonical.jcs_bytes`` takes C-speed ``json.dumps`` for containers whose JSON text it can
prove is their RFC 8785 text and hands everything else to the exact encoder (rfc8785 after
ql3's validation); these tests hold both paths to the same bytes (or the same error) on the
shared vectors, on the cases where ``json.dumps`` and JCS part ways, and on generated
values, and check that ordinary bodies really take the fast path.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ql3 import canonical
from ql3.errors import InvalidArgument
from test_canonical import RFC8785_CASES, Rfc8785Case, load_vectors

MAX_SAFE = canonical.MAX_SAFE_INTEGER
JCS_VECTORS = load_vectors("jcs.json")


def same_as_canonical(value: Any) -> None:
    """jcs_bytes (fast path when it applies) equals the exact encoder, or both raise."""
    try:
        expected = canonical._jcs_bytes_exact(value)
    except InvalidArgument:
        with pytest.raises(InvalidArgument):
            canonical.jcs_bytes(value)
        return
    assert canonical.jcs_bytes(value) == expected


def fast_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any fall back to the exact encoder fail the test."""

    def refuse(value: object) -> bytes:
        raise AssertionError(f"slow path taken for {value!r}")

    monkeypatch.setattr(canonical, "_jcs_bytes_exact", refuse)


@pytest.mark.parametrize("vector", JCS_VECTORS, ids=lambda v: v["name"])
def test_the_shared_jcs_vectors_inside_a_container(vector: dict[str, Any]) -> None:
    # json.loads, not canonical.parse_json: the error vectors must reach the encoder.
    value = json.loads(vector["input"])
    same_as_canonical({"value": value})
    same_as_canonical([value])


@pytest.mark.parametrize("case", RFC8785_CASES, ids=lambda c: c.name)
def test_the_rfc8785_test_data_takes_either_path_to_the_same_bytes(case: Rfc8785Case) -> None:
    value = json.loads(case.input)  # values.json (1E30) must reach the encoder, and fail
    same_as_canonical(value)
    same_as_canonical({"value": value})


@pytest.mark.parametrize(
    "body",
    [
        {"integral float": 1.0},  # JCS "1", json.dumps "1.0"
        {"zero": 0.0, "negative zero": -0.0},
        {"small": 1e-5, "smaller": 1.5e-7, "tiny": 5e-324},  # exponents differ
        {"edge": 1e-4, "just below": 0.00009999999999999999},
        {"fractions": [0.1, -2.5, 123.456, 4503599627370495.5]},
        {"largest safe float": 9007199254740991.0, "over": 9007199254740992.0},
        {"ints": [MAX_SAFE, -MAX_SAFE]},
        {"over": MAX_SAFE + 1},
        {"under": [-MAX_SAFE - 1]},
        {"nan": float("nan")},
        {"inf": float("inf")},
        {"\ue000": 1, "\U0001f600": 2, "a": 3},  # UTF-16 order is not code point order
        {"value": "astral \U0001f600"},
        {"escaped nul": "\\u0000"},  # a literal backslash: json.dumps looks like an escape
        {"nul": "a\x00b"},
        {"\x00": 1},
        {"lone surrogate": "\ud800"},
        {"\udfff": 1},
        {"controls": '\x01\x1f\x7f\b\f\n\r\t"\\/\u2028\u2029'},
        {"literals": [True, False, None, [], {}]},
        {1: "not a string key"},
        {"tuple": (1, 2)},
        {"set": {1}},
        {"bool subclass is not int": [True, 1]},
    ],
)
def test_the_cases_where_json_dumps_and_jcs_part_ways(body: dict[Any, Any]) -> None:
    same_as_canonical(body)


def nested(depth: int) -> dict[str, Any]:
    body: Any = []
    for _ in range(depth - 2):
        body = [body]
    return {"n": body}


@pytest.mark.parametrize("depth", [canonical.MAX_DEPTH - 1, canonical.MAX_DEPTH, 65, 200])
def test_nesting_limits_are_those_of_canonical(depth: int) -> None:
    same_as_canonical(nested(depth))


def test_ordinary_policy_bodies_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    body: dict[str, Any] = {
        "routes": [
            {"provider": f"p{i}", "model": f"m-{i}", "weight": 0.25, "enabled": i % 2 == 0}
            for i in range(20)
        ],
        "default": "p1",
        "limits": {"rpm": 600, "tpm": 90000, "note": "漢字 é \u2028"},
        "fallback": None,
    }
    expected = canonical._jcs_bytes_exact(body)
    fast_only(monkeypatch)
    assert canonical.jcs_bytes(body) == expected


# Characters that matter here: U+0000, a lone surrogate, a backslash, the private use and
# astral ranges where UTF-16 order and code point order disagree.
_text = st.text(
    st.characters() | st.sampled_from(["\x00", "\ud800", "\\", "\ue000", "\U0001f600"]),
    max_size=6,
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**60), max_value=2**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e3, max_value=1e3),
    st.floats(min_value=-1e-3, max_value=1e-3),
    _text,
)
_values = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(_text, children, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_text, _values, max_size=5))
def test_generated_bodies_agree_with_canonical(body: dict[str, Any]) -> None:
    same_as_canonical(body)
