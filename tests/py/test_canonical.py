"""Canonical JSON, digests and identities (SPEC section 2), in Python and in PL/pgSQL.

Every vector (tests/vectors) runs through ``ql3.canonical`` and through the SQL functions of
``sql/core/0001_canonical.sql``; hypothesis then checks the JCS properties and that the two
implementations agree byte for byte on generated values.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fix_servers
from ql3 import canonical
from ql3.canonical import JSON, MAX_DEPTH, MAX_SAFE_INTEGER
from ql3.errors import IdentifierTooLong, InvalidArgument, RecordTooLarge

REPO = Path(__file__).resolve().parents[2]
MIGRATION = REPO / "sql" / "core" / "0001_canonical.sql"
ROLES = ("ql3_owner", "ql3_runtime", "ql3_relay", "ql3_operator", "ql3_reader")
PHASES = ("admission", "completion", "resolution")

Conn = psycopg.Connection[tuple[Any, ...]]


def vectors_dir() -> Path:
    """The vendored vectors (tests/vectors), or the folder QL3_VECTORS_DIR names."""
    configured = os.environ.get("QL3_VECTORS_DIR")
    if configured:
        return Path(configured)
    return REPO / "tests" / "vectors"


def load_vectors(name: str) -> list[dict[str, Any]]:
    # A missing vector file fails the run (at collection); it must never skip silently.
    path = vectors_dir() / name
    if not path.is_file():
        pytest.fail(f"vectors not found: {path} (QL3_VECTORS_DIR)", pytrace=False)
    loaded = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, list) and loaded, f"{path} holds no vectors"
    return cast(list[dict[str, Any]], loaded)


JCS_VECTORS = load_vectors("jcs.json")
JCS_OK = [v for v in JCS_VECTORS if not v.get("error")]
JCS_ERRORS = [v for v in JCS_VECTORS if v.get("error")]
DIGEST_VECTORS = load_vectors("digest.json")
IDENTITY_CASES = [
    (v["invocation_id"], phase, v[phase]) for v in load_vectors("identity.json") for phase in PHASES
]


@dataclass(frozen=True)
class Rfc8785Case:
    """One file of the RFC 8785 reference test data (tests/vectors/rfc8785)."""

    name: str
    input: str
    """The input file's text."""
    expected: bytes
    """The output file's bytes, less one trailing newline if it ends with one."""


RFC8785_REFUSED = "values.json"
"""Holds 1E30, outside ql3's safe range: refused with QL3_INVALID_ARGUMENT (rfc8785/README.md)."""


def load_rfc8785() -> list[Rfc8785Case]:
    """Every input file with its output file; a missing or unpaired file fails the run."""
    folder = vectors_dir() / "rfc8785"
    inputs = sorted(p.name for p in (folder / "input").glob("*.json"))
    outputs = sorted(p.name for p in (folder / "output").glob("*.json"))
    if not inputs or inputs != outputs or RFC8785_REFUSED not in inputs:
        pytest.fail(f"RFC 8785 test data missing or unpaired in {folder}", pytrace=False)
    cases = []
    for name in inputs:
        expected = (folder / "output" / name).read_bytes()
        cases.append(
            Rfc8785Case(
                name,
                (folder / "input" / name).read_bytes().decode("utf-8"),
                expected[:-1] if expected.endswith(b"\n") else expected,
            )
        )
    return cases


def without_1e30(case: Rfc8785Case) -> Rfc8785Case:
    """values.json with 1E30 taken out of the input and of the expected output.

    The edit is textual, so the input still goes through each implementation's own parser:
    the input loses ``" 1E30,"`` and the output ``",1e+30"``, each exactly once. Each edited
    text must parse (leniently) to its original less ``numbers[1]``, which must be 1E30 in
    both, so nothing else moved.
    """
    edited = Rfc8785Case(
        "values.json less 1E30",
        case.input.replace(" 1E30,", ""),
        case.expected.replace(b",1e+30", b""),
    )
    for before, after in ((case.input, edited.input), (case.expected, edited.expected)):
        original = json.loads(before)
        assert original["numbers"][1] == 1e30, before
        del original["numbers"][1]
        assert json.loads(after) == original, after
    assert case.input.count(" 1E30,") == 1 and case.expected.count(b",1e+30") == 1
    return edited


RFC8785_CASES = load_rfc8785()
RFC8785_VALUES = next(c for c in RFC8785_CASES if c.name == RFC8785_REFUSED)
RFC8785_OK = [c for c in RFC8785_CASES if c is not RFC8785_VALUES] + [without_1e30(RFC8785_VALUES)]


def _name(vector: dict[str, Any]) -> str:
    return str(vector["name"])


def _identity_name(case: tuple[str, str, dict[str, str]]) -> str:
    return f"{case[0][:12]}-{case[1]}"


# -- Python: shared vectors ---------------------------------------------------------------


def test_every_vector_file_is_present_and_has_both_kinds_of_jcs_vector() -> None:
    assert JCS_OK and JCS_ERRORS and DIGEST_VECTORS and IDENTITY_CASES


@pytest.mark.parametrize("vector", JCS_OK, ids=_name)
def test_jcs_vector(vector: dict[str, Any]) -> None:
    encoded = canonical.jcs_bytes(canonical.parse_json(vector["input"]))
    assert encoded.decode("utf-8") == vector["canonical"]
    assert canonical.jcs(canonical.parse_json(vector["input"])) == vector["canonical"]
    assert hashlib.sha256(encoded).hexdigest() == vector["sha256"]


@pytest.mark.parametrize("vector", JCS_ERRORS, ids=_name)
def test_jcs_error_vector_is_invalid_argument(vector: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as raised:
        canonical.jcs(canonical.parse_json(vector["input"]))
    assert raised.type is InvalidArgument
    assert raised.value.sqlstate == "Q3V01"


@pytest.mark.parametrize("vector", DIGEST_VECTORS, ids=lambda v: str(v["domain"]))
def test_digest_vector(vector: dict[str, Any]) -> None:
    assert canonical.digest(vector["domain"], vector["value"]) == vector["digest"]


@pytest.mark.parametrize("case", IDENTITY_CASES, ids=_identity_name)
def test_identity_vector(case: tuple[str, str, dict[str, str]]) -> None:
    invocation_id, phase, expected = case
    assert canonical.mutation_id(invocation_id, phase) == expected["mutation_id"]
    assert canonical.event_id(invocation_id, phase) == expected["event_id"]
    assert canonical.dedupe_key(invocation_id, phase) == expected["dedupe_key"]


@pytest.mark.parametrize("case", RFC8785_OK, ids=lambda c: c.name)
def test_rfc8785_test_data(case: Rfc8785Case) -> None:
    assert canonical.jcs_bytes(canonical.parse_json(case.input)) == case.expected


def test_rfc8785_test_data_is_all_there() -> None:
    names = [c.name for c in RFC8785_OK]
    assert len(names) == 6 and names[-1] == "values.json less 1E30", names


def test_rfc8785_values_with_1e30_is_refused_as_invalid_argument() -> None:
    with pytest.raises(InvalidArgument) as raised:
        canonical.parse_json(RFC8785_VALUES.input)
    assert raised.type is InvalidArgument and raised.value.sqlstate == "Q3V01"
    assert "1E30" in str(raised.value)
    # Parsed leniently (1E30 as a float), the encoder refuses it too.
    with pytest.raises(InvalidArgument):
        canonical.jcs_bytes(json.loads(RFC8785_VALUES.input))


# -- Python: the ql3 rules beyond RFC 8785 --------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        MAX_SAFE_INTEGER + 1,
        -MAX_SAFE_INTEGER - 1,
        1e20,
        -1.5e300,
        float("nan"),
        float("inf"),
        "a\x00b",
        {"a\x00": 1},
        "\ud800",
        {"\udfff": 1},
        {1: "non-string key"},
        b"bytes",
        {"a": [1, {"b": 2**60}]},
    ],
    ids=repr,
)
def test_jcs_refuses_values_outside_the_ql3_rules(value: Any) -> None:
    with pytest.raises(InvalidArgument):
        canonical.jcs(value)


@pytest.mark.parametrize(
    "text",
    [
        "NaN",
        "[Infinity]",
        "-Infinity",
        "{",
        "[1,]",
        '"\\ud800x"',
        '"\\udc00"',
        '"raw \x01 control"',
        "9007199254740991.4",
        "1" + "0" * 5000,
        "1e-400",
        "0e-20000",
        "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
        "[" * 5000 + "]" * 5000,
    ],
    ids=lambda t: t[:24],
)
def test_parse_json_refuses_with_invalid_argument(text: str) -> None:
    with pytest.raises(InvalidArgument):
        canonical.parse_json(text)


def test_parse_json_keeps_the_last_of_duplicate_keys() -> None:
    assert canonical.parse_json('{"a": 1, "b": 0, "a": 2}') == {"a": 2, "b": 0}


def test_jcs_accepts_the_deepest_allowed_nesting() -> None:
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert canonical.jcs(canonical.parse_json(deep)) == deep


def test_numbers_print_as_ecmascript_does() -> None:
    values: list[JSON] = [-0.0, 1.0, 1e15 + 0.5, 1e-5, 1.2e-4, 2.5e-7, 5e-324, MAX_SAFE_INTEGER]
    assert canonical.jcs(values) == (
        "[0,1,1000000000000000.5,0.00001,0.00012,2.5e-7,5e-324,9007199254740991]"
    )


def test_check_identifier_accepts_1_to_128_characters() -> None:
    assert canonical.check_identifier("invocation_id", "x") == "x"
    assert canonical.check_identifier("invocation_id", "\u00e9" * 128) == "\u00e9" * 128


def test_check_identifier_refuses_over_128_characters_as_identifier_too_long() -> None:
    with pytest.raises(IdentifierTooLong, match="invocation_id"):
        canonical.check_identifier("invocation_id", "x" * 129)


@pytest.mark.parametrize("value", ["", None, 7, "a\x00"], ids=repr)
def test_check_identifier_refuses_empty_or_non_text_as_invalid_argument(value: object) -> None:
    with pytest.raises(InvalidArgument) as raised:
        canonical.check_identifier("user_id", value)
    assert raised.type is InvalidArgument


def test_check_size_allows_exactly_24_kib_of_canonical_utf8() -> None:
    value = "a" * (canonical.MAX_RECORD_BYTES - 2)  # the two quotes make 24576 bytes
    assert len(canonical.check_size("record", value)) == canonical.MAX_RECORD_BYTES


def test_check_size_refuses_one_byte_more_as_record_too_large() -> None:
    with pytest.raises(RecordTooLarge, match="record"):
        canonical.check_size("record", "a" * (canonical.MAX_RECORD_BYTES - 1))


def test_check_size_counts_utf8_bytes_not_characters() -> None:
    with pytest.raises(RecordTooLarge):
        canonical.check_size("record", ["\u00e9" * (canonical.MAX_RECORD_BYTES // 2)])


@pytest.mark.parametrize("phase", ["", "retry", "Admission", None])
def test_identities_refuse_an_unknown_phase(phase: Any) -> None:
    with pytest.raises(InvalidArgument):
        canonical.mutation_id("inv-1", phase)


def test_identities_refuse_an_invocation_id_over_128_characters() -> None:
    with pytest.raises(IdentifierTooLong):
        canonical.event_id("r" * 129, "admission")


def test_identities_are_68_characters() -> None:
    assert {len(canonical.dedupe_key("r" * 128, p)) for p in PHASES} == {68}


# -- Python: properties ---------------------------------------------------------------------

_SPECIAL_CHARS = ["\ue000", "\uffff", "\U0001f600", "\U0010ffff", "\x7f", "\u2028", "\x01", '"']
_text = st.text(
    alphabet=st.one_of(
        st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
        st.sampled_from([*_SPECIAL_CHARS, "\\"]),
    ),
    max_size=12,
)
_scalars: st.SearchStrategy[JSON] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER),
    st.floats(
        min_value=-float(MAX_SAFE_INTEGER), max_value=float(MAX_SAFE_INTEGER), allow_nan=False
    ),
    _text,
)


def _containers(children: st.SearchStrategy[JSON]) -> st.SearchStrategy[JSON]:
    return st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(_text, children, max_size=5),
    )


json_values: st.SearchStrategy[JSON] = st.recursive(_scalars, _containers, max_leaves=25)
_out_of_range = st.one_of(
    st.integers(min_value=MAX_SAFE_INTEGER + 1),
    st.integers(max_value=-MAX_SAFE_INTEGER - 1),
    st.floats(min_value=MAX_SAFE_INTEGER + 2.0, allow_infinity=False),
    st.floats(max_value=-MAX_SAFE_INTEGER - 2.0, allow_infinity=False),
)


def _reordered(value: JSON) -> JSON:
    """The same JSON value with every object's keys inserted in reverse order."""
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


@given(json_values)
def test_canonical_text_parses_back_to_an_equal_value(value: JSON) -> None:
    assert canonical.parse_json(canonical.jcs(value)) == value


@given(json_values)
def test_canonicalisation_is_idempotent(value: JSON) -> None:
    once = canonical.jcs(value)
    assert canonical.jcs(canonical.parse_json(once)) == once


@given(json_values)
def test_canonical_text_does_not_depend_on_key_order(value: JSON) -> None:
    assert canonical.jcs(_reordered(value)) == canonical.jcs(value)
    assert canonical.digest("d@v1", _reordered(value)) == canonical.digest("d@v1", value)


@given(json_values, _out_of_range)
def test_out_of_range_numbers_are_refused_wherever_they_are(value: JSON, bad: JSON) -> None:
    for holder in ([value, bad], {"k": bad, "v": value}, bad):
        with pytest.raises(InvalidArgument):
            canonical.jcs(holder)
        with pytest.raises(InvalidArgument):
            canonical.parse_json(json.dumps(holder))


# -- PL/pgSQL: the same vectors, and agreement with Python ---------------------------------

_CREATE_ROLES = f"""
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY[{", ".join(f"'{r}'" for r in ROLES)}] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another test session created it first
            END;
        END IF;
    END LOOP;
END
$$
"""


@pytest.fixture(scope="module")
def sql(base_dsn: str) -> Iterator[Conn]:
    """A connection to a fresh database holding only schema ql3 and the canonical migration."""
    dsn = fix_servers.create_database(base_dsn, prefix="canonical")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(_CREATE_ROLES)
            conn.execute("CREATE SCHEMA ql3 AUTHORIZATION ql3_owner")
            with conn.transaction():
                conn.execute("SET LOCAL ROLE ql3_owner")
                conn.execute(MIGRATION.read_text(encoding="utf-8"))
            yield conn
    finally:
        fix_servers.drop_database(base_dsn, dsn)


def _one(conn: Conn, query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _sqlstate(conn: Conn, query: str, *params: Any) -> str | None:
    try:
        conn.execute(query, params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


@pytest.mark.parametrize("vector", JCS_OK, ids=_name)
def test_sql_jcs_vector(sql: Conn, vector: dict[str, Any]) -> None:
    text = _one(sql, "SELECT ql3.jcs(ql3.parse_json(%s))", vector["input"])
    assert text == vector["canonical"]
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == vector["sha256"]


@pytest.mark.parametrize("vector", JCS_ERRORS, ids=_name)
def test_sql_jcs_error_vector_is_q3v01(sql: Conn, vector: dict[str, Any]) -> None:
    assert _sqlstate(sql, "SELECT ql3.jcs(ql3.parse_json(%s))", vector["input"]) == "Q3V01"


@pytest.mark.parametrize("vector", DIGEST_VECTORS, ids=lambda v: str(v["domain"]))
def test_sql_digest_vector(sql: Conn, vector: dict[str, Any]) -> None:
    got = _one(
        sql, "SELECT ql3.digest(%s, %s::jsonb)", vector["domain"], json.dumps(vector["value"])
    )
    assert got == vector["digest"]


@pytest.mark.parametrize("case", IDENTITY_CASES, ids=_identity_name)
def test_sql_identity_vector(sql: Conn, case: tuple[str, str, dict[str, str]]) -> None:
    invocation_id, phase, expected = case
    row = sql.execute(
        "SELECT ql3.mutation_id(%s, %s), ql3.event_id(%s, %s), ql3.dedupe_key(%s, %s)",
        (invocation_id, phase) * 3,
    ).fetchone()
    assert row == (expected["mutation_id"], expected["event_id"], expected["dedupe_key"])


@pytest.mark.parametrize(
    ("invocation_id", "phase", "error"),
    [
        ("r" * 129, "admission", IdentifierTooLong),
        ("", "admission", InvalidArgument),
        ("inv-1", "retry", InvalidArgument),
    ],
    ids=["too-long", "empty", "bad-phase"],
)
def test_sql_and_python_refuse_the_same_identities_with_the_same_code(
    sql: Conn, invocation_id: str, phase: str, error: type[InvalidArgument]
) -> None:
    with pytest.raises(error) as raised:
        canonical.mutation_id(invocation_id, phase)
    assert raised.type is error
    query = "SELECT ql3.mutation_id(%s, %s)"
    assert _sqlstate(sql, query, invocation_id, phase) == error.sqlstate


def test_sql_jcs_ignores_the_session_extra_float_digits(sql: Conn) -> None:
    with sql.transaction():
        sql.execute("SET LOCAL extra_float_digits = 0")
        text = _one(sql, "SELECT ql3.jcs(%s::jsonb)", "[0.1, 3.141592653589793, 1.5e-7]")
    assert text == "[0.1,3.141592653589793,1.5e-7]"


def test_runtime_role_can_call_the_public_functions(sql: Conn) -> None:
    with sql.transaction():
        sql.execute("GRANT USAGE ON SCHEMA ql3 TO ql3_runtime")
        sql.execute("SET LOCAL ROLE ql3_runtime")
        got = _one(sql, "SELECT ql3.digest('ql3/contract-body@v1', ql3.parse_json('{}'))")
        mut = _one(sql, "SELECT ql3.mutation_id('inv-1', 'admission')")
    assert got == canonical.digest("ql3/contract-body@v1", {})
    assert mut == canonical.mutation_id("inv-1", "admission")


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_sql_and_python_agree_on_jcs_and_digest(sql: Conn, value: JSON) -> None:
    text = json.dumps(value)
    row = sql.execute(
        "SELECT ql3.jcs(ql3.parse_json(%s)), ql3.jcs(%s::jsonb),"
        " ql3.digest('ql3/test@v1', %s::jsonb)",
        (text, text, text),
    ).fetchone()
    assert row == (
        canonical.jcs(value),
        canonical.jcs(value),
        canonical.digest("ql3/test@v1", value),
    )


_number_text = st.builds(
    "{}{}{}{}".format,
    st.sampled_from(["", "-"]),
    st.one_of(st.just("0"), st.from_regex(r"[1-9][0-9]{0,20}", fullmatch=True)),
    st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,25}", fullmatch=True)),
    st.one_of(
        st.just(""),
        st.builds("e{}".format, st.integers(min_value=-340, max_value=25)),
        st.builds("E+{}".format, st.integers(min_value=0, max_value=25)),
    ),
)


@settings(max_examples=300, deadline=None)
@given(_number_text)
def test_sql_and_python_agree_on_every_number_text(sql: Conn, text: str) -> None:
    try:
        expected: str | None = canonical.jcs(canonical.parse_json(text))
    except InvalidArgument:
        expected = None
    try:
        got: str | None = _one(sql, "SELECT ql3.jcs(ql3.parse_json(%s))", text)
    except psycopg.Error as exc:
        assert exc.sqlstate == "Q3V01"
        got = None
    assert got == expected
