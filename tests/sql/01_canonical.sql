-- Canonical JSON, digests and identities (SPEC section 2): every shared vector through
-- ql3.parse_json, ql3.jcs, ql3.digest, ql3.mutation_id, ql3.event_id and ql3.dedupe_key,
-- then the ql3 rules at their edges. pg_prove runs from the repository root, so the
-- vectors are at tests/vectors unless QL3_VECTORS_DIR says otherwise.
BEGIN;

\set jcs_vectors `cat "${QL3_VECTORS_DIR:-tests/vectors}/jcs.json"`
\set digest_vectors `cat "${QL3_VECTORS_DIR:-tests/vectors}/digest.json"`
\set identity_vectors `cat "${QL3_VECTORS_DIR:-tests/vectors}/identity.json"`
-- The RFC 8785 reference implementation's test data. psql drops one trailing newline of
-- a backquoted command's output and keeps every other byte (the output files have none).
\set rfc8785_arrays_in `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/input/arrays.json"`
\set rfc8785_arrays_out `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/output/arrays.json"`
\set rfc8785_french_in `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/input/french.json"`
\set rfc8785_french_out `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/output/french.json"`
\set rfc8785_structures_in `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/input/structures.json"`
\set rfc8785_structures_out `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/output/structures.json"`
\set rfc8785_unicode_in `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/input/unicode.json"`
\set rfc8785_unicode_out `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/output/unicode.json"`
\set rfc8785_values_in `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/input/values.json"`
\set rfc8785_values_out `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/output/values.json"`
\set rfc8785_weird_in `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/input/weird.json"`
\set rfc8785_weird_out `cat "${QL3_VECTORS_DIR:-tests/vectors}/rfc8785/output/weird.json"`

CREATE TEMPORARY TABLE jcs_vectors ON COMMIT DROP AS
SELECT
    v.ord,
    v.vec ->> 'name' AS name,
    v.vec ->> 'input' AS input,
    v.vec ->> 'canonical' AS canonical,
    v.vec ->> 'sha256' AS sha256,
    coalesce((v.vec ->> 'error')::boolean, FALSE) AS error
FROM jsonb_array_elements(:'jcs_vectors'::jsonb) WITH ORDINALITY AS v (vec, ord);

CREATE TEMPORARY TABLE digest_vectors ON COMMIT DROP AS
SELECT
    v.ord,
    v.vec ->> 'domain' AS domain,
    v.vec -> 'value' AS value,
    v.vec ->> 'digest' AS digest
FROM jsonb_array_elements(:'digest_vectors'::jsonb) WITH ORDINALITY AS v (vec, ord);

CREATE TEMPORARY TABLE rfc8785_vectors ON COMMIT DROP AS
SELECT
    v.name,
    v.input,
    v.expected
FROM (
    VALUES
    ('arrays.json', :'rfc8785_arrays_in', :'rfc8785_arrays_out'),
    ('french.json', :'rfc8785_french_in', :'rfc8785_french_out'),
    ('structures.json', :'rfc8785_structures_in', :'rfc8785_structures_out'),
    ('unicode.json', :'rfc8785_unicode_in', :'rfc8785_unicode_out'),
    ('values.json', :'rfc8785_values_in', :'rfc8785_values_out'),
    ('weird.json', :'rfc8785_weird_in', :'rfc8785_weird_out')
) AS v (name, input, expected);

CREATE TEMPORARY TABLE identity_vectors ON COMMIT DROP AS
SELECT
    v.ord,
    p.phase_ord,
    v.vec ->> 'invocation_id' AS invocation_id,
    p.phase,
    v.vec -> p.phase ->> 'mutation_id' AS mutation_id,
    v.vec -> p.phase ->> 'event_id' AS event_id,
    v.vec -> p.phase ->> 'dedupe_key' AS dedupe_key
FROM jsonb_array_elements(:'identity_vectors'::jsonb) WITH ORDINALITY AS v (vec, ord)
CROSS JOIN
    unnest('{admission,completion,resolution}'::text []) WITH ORDINALITY AS p (phase, phase_ord);

SELECT plan(
    (SELECT (2 * count(*) FILTER (WHERE NOT j.error) + count(*) FILTER (WHERE j.error))::integer
        FROM jcs_vectors AS j)
    + (SELECT count(*)::integer FROM digest_vectors)
    + (SELECT 3 * count(*)::integer FROM identity_vectors)
    + 23
    + 11  -- the RFC 8785 test data: a fixed count, so a missing file fails the plan
);

-- Shared vectors -------------------------------------------------------------------------

SELECT is(ql3.jcs(ql3.parse_json(j.input)), j.canonical, 'jcs: ' || j.name)
FROM jcs_vectors AS j
WHERE NOT j.error
ORDER BY j.ord;

SELECT is(
    encode(sha256(convert_to(ql3.jcs(ql3.parse_json(j.input)), 'UTF8')), 'hex'),
    j.sha256,
    'jcs sha256: ' || j.name
)
FROM jcs_vectors AS j
WHERE NOT j.error
ORDER BY j.ord;

SELECT throws_ok(
    format('SELECT ql3.jcs(ql3.parse_json(%L))', j.input), 'Q3V01', NULL, 'jcs: ' || j.name
)
FROM jcs_vectors AS j
WHERE j.error
ORDER BY j.ord;

SELECT is(ql3.digest(d.domain, d.value), d.digest, 'digest vector ' || d.ord || ': ' || d.domain)
FROM digest_vectors AS d
ORDER BY d.ord;

SELECT is(
    ql3.mutation_id(i.invocation_id, i.phase), i.mutation_id,
    format('mutation_id of vector %s, %s', i.ord, i.phase)
)
FROM identity_vectors AS i
ORDER BY i.ord, i.phase_ord;

SELECT is(
    ql3.event_id(i.invocation_id, i.phase), i.event_id,
    format('event_id of vector %s, %s', i.ord, i.phase)
)
FROM identity_vectors AS i
ORDER BY i.ord, i.phase_ord;

SELECT is(
    ql3.dedupe_key(i.invocation_id, i.phase), i.dedupe_key,
    format('dedupe_key of vector %s, %s', i.ord, i.phase)
)
FROM identity_vectors AS i
ORDER BY i.ord, i.phase_ord;

-- RFC 8785 reference test data (tests/vectors/rfc8785) -------------------------------------

SELECT is(ql3.jcs(ql3.parse_json(r.input)), r.expected, 'rfc8785 ' || r.name)
FROM rfc8785_vectors AS r
WHERE r.name <> 'values.json'
ORDER BY r.name;

-- values.json holds 1E30, outside the safe range: refused (rfc8785/README.md).
SELECT throws_ok(
    format('SELECT ql3.parse_json(%L)', :'rfc8785_values_in'), 'Q3V01', NULL,
    'rfc8785 values.json (1E30) is refused by parse_json'
);
SELECT throws_ok(
    format('SELECT ql3.jcs(%L::jsonb)', :'rfc8785_values_in'), 'Q3V01', NULL,
    'rfc8785 values.json (1E30) is refused by jcs on jsonb built without parse_json'
);

-- The rest of values.json must match byte for byte. 1E30 is taken out of the texts (the
-- input loses ' 1E30,', the expected output ',1e+30'), so the input still goes through
-- parse_json; the three guards prove each edit removed numbers[1], which is 1E30, and
-- nothing else.
SELECT is(
    ARRAY[:'rfc8785_values_in'::jsonb #> '{numbers,1}', :'rfc8785_values_out'::jsonb #> '{numbers,1}'],
    ARRAY['1e30'::jsonb, '1e30'::jsonb],
    'rfc8785 values.json: numbers[1] is 1E30 in the input and in the output'
);
SELECT is(
    replace(:'rfc8785_values_in', ' 1E30,', '')::jsonb,
    :'rfc8785_values_in'::jsonb #- '{numbers,1}',
    'rfc8785 values.json: the edited input is the input less numbers[1]'
);
SELECT is(
    replace(:'rfc8785_values_out', ',1e+30', '')::jsonb,
    :'rfc8785_values_out'::jsonb #- '{numbers,1}',
    'rfc8785 values.json: the edited output is the output less numbers[1]'
);
SELECT is(
    ql3.jcs(ql3.parse_json(replace(:'rfc8785_values_in', ' 1E30,', ''))),
    replace(:'rfc8785_values_out', ',1e+30', ''),
    'rfc8785 values.json less 1E30 (333333333.33333329 prints as 333333333.3333333, 1e-27 as 1e-27)'
);

-- ql3.jcs on jsonb that did not come through ql3.parse_json ---------------------------------

SELECT throws_ok(
    $$SELECT ql3.jcs('{"a": [1e20]}'::jsonb)$$, 'Q3V01', NULL,
    'jcs refuses a number over 2^53-1 in jsonb built without parse_json'
);
SELECT throws_ok(
    $$SELECT ql3.jcs('9007199254740991.4'::jsonb)$$, 'Q3V01', NULL,
    'jcs decides the safe range on the exact decimal, not on the rounded double'
);
SELECT throws_ok(
    $$SELECT ql3.jcs('[1e-400]'::jsonb)$$, 'Q3V01', NULL,
    'jcs refuses a nonzero number that a double would round to 0'
);
SELECT is(
    ql3.jcs(jsonb_build_array(-0.0, 1.50, 1e15 + 0.5, 0.00001, 1.2e-5 * 10, 2.5e-7)),
    '[0,1.5,1000000000000000.5,0.00001,0.00012,2.5e-7]',
    'jcs prints numbers as ECMAScript does, from numerics of any scale'
);
SELECT is(ql3.jcs(NULL), NULL, 'jcs of SQL NULL is NULL');

SET LOCAL extra_float_digits = 0;
SELECT is(
    ql3.jcs('[0.1, 3.141592653589793, 1.5e-7]'::jsonb), '[0.1,3.141592653589793,1.5e-7]',
    'jcs pins extra_float_digits: shortest round-trip digits whatever the session says'
);
SELECT is(
    ql3.digest('ql3/contract-body@v1', '{"temperature": 0.2, "routes": ["a", "b"]}'),
    '3ebf3f04b951d9dff1c9671e7d4d248928e0015a56919e2a416da061535b06f8',
    'digest pins extra_float_digits too'
);
RESET extra_float_digits;

SELECT is(
    ql3.jcs(('{"b": 1, "' || repeat('a', 200) || '": 2, "\u00e9": 3, "\ud83d\ude00": 4, "\uffff": 5}')::jsonb),
    '{"' || repeat('a', 200) || '":2,"b":1,"é":3,"😀":4,"' || chr(65535) || '":5}',
    'jcs sorts keys by UTF-16 code units, not by jsonb''s length-first order'
);
SELECT lives_ok(
    format('SELECT ql3.jcs(%L::jsonb)', repeat('[', 64) || repeat(']', 64)),
    'jcs accepts 64 nested containers'
);
SELECT throws_ok(
    format('SELECT ql3.jcs(%L::jsonb)', repeat('[', 65) || repeat(']', 65)), 'Q3V01', NULL,
    'jcs refuses 65 nested containers'
);

-- ql3.parse_json ---------------------------------------------------------------------------

SELECT is(
    ql3.parse_json(' {"b": [1.0, "x"], "a": null} '), '{"a": null, "b": [1.0, "x"]}'::jsonb,
    'parse_json returns the jsonb of valid JSON text'
);
SELECT is(ql3.parse_json(NULL), NULL, 'parse_json of SQL NULL is NULL');
SELECT throws_ok(
    $$SELECT ql3.parse_json('{"a": ')$$, 'Q3V01', NULL, 'parse_json refuses truncated JSON'
);
SELECT throws_ok(
    $$SELECT ql3.parse_json('[NaN]')$$, 'Q3V01', NULL, 'parse_json refuses NaN'
);
SELECT throws_ok(
    $$SELECT ql3.parse_json('1e-400')$$, 'Q3V01', NULL,
    'parse_json refuses a nonzero number that a double would round to 0'
);
SELECT throws_ok(
    $$SELECT ql3.parse_json('1e-16384')$$, 'Q3V01', NULL,
    'parse_json maps numeric overflow (22003) to Q3V01'
);
SELECT throws_ok(
    format('SELECT ql3.parse_json(%L)', repeat('[', 65) || repeat(']', 65)), 'Q3V01', NULL,
    'parse_json refuses 65 nested containers'
);

-- Identities -------------------------------------------------------------------------------

SELECT is(
    length(ql3.mutation_id(repeat('r', 128), 'resolution')), 68,
    'an identity is 68 characters even for a 128-character invocation_id'
);
SELECT throws_ok(
    $$SELECT ql3.mutation_id(repeat('r', 129), 'admission')$$, 'Q3V03', NULL,
    'mutation_id refuses an invocation_id over 128 characters'
);
SELECT throws_ok(
    $$SELECT ql3.event_id('', 'admission')$$, 'Q3V01', NULL,
    'event_id refuses an empty invocation_id'
);
SELECT throws_ok(
    $$SELECT ql3.dedupe_key('inv-1', 'retry')$$, 'Q3V01', NULL,
    'dedupe_key refuses a phase other than admission, completion, resolution'
);
SELECT throws_ok(
    $$SELECT ql3.mutation_id(NULL, 'admission')$$, 'Q3V01', NULL,
    'mutation_id refuses a NULL invocation_id'
);

-- A session with standard_conforming_strings = off reads '\x00' as an escape: the digest
-- framing, inlined into its caller and parsed under the caller's settings, must not use
-- one (D33). Every digest vector again, in such a session.
SET LOCAL standard_conforming_strings = off;
SELECT is(
    (SELECT count(*)::integer FROM digest_vectors AS d
     WHERE ql3._framed_digest(d.domain, ql3.jcs(d.value)) = d.digest)
    + (SELECT count(*)::integer FROM identity_vectors AS i
       WHERE ql3.mutation_id(i.invocation_id, i.phase) = i.mutation_id),
    (SELECT count(*)::integer FROM digest_vectors) + (SELECT count(*)::integer FROM identity_vectors),
    'digests and identities hold with standard_conforming_strings = off'
);
SET LOCAL standard_conforming_strings = on;

SELECT * FROM finish();
ROLLBACK;
