-- Canonical JSON (RFC 8785 / JCS with the ql3 rules), digests and derived identities
-- (SPEC section 2). python/ql3/canonical.py is the byte-for-byte twin of this file and
-- tests/vectors/*.json hold both to the same answers.
--
-- Why the helpers carry no SET clause: they run once per JSON node inside every
-- admission and completion, and a SET clause costs a GUC save/restore per call. They
-- only call pg_catalog built-ins and schema-qualified ql3 helpers, and every public
-- entry point pins search_path and extra_float_digits for the whole call tree.

DO $check_encoding$
BEGIN
    -- Byte order of "C" collation must equal code point order, which holds for UTF-8 only.
    IF pg_catalog.getdatabaseencoding() <> 'UTF8' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: ql3 needs a UTF8 database, this one is '
            || pg_catalog.getdatabaseencoding();
    END IF;
END
$check_encoding$;

CREATE FUNCTION ql3._jcs_sort_key(key text)
RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
PARALLEL SAFE
SECURITY INVOKER
AS $function$
    -- JCS sorts keys by UTF-16 code units; "C" collation sorts by code point. The two
    -- differ only where astral characters (surrogate pairs, 0xD800..) meet U+E000..U+FFFF,
    -- so remap bijectively: astral -> U+E000..U+10DFFF, U+E000..U+FFFF -> U+10E000..U+10FFFF.
    -- (No backslash escapes here or below: they would depend on standard_conforming_strings.)
    SELECT CASE
        WHEN key !~ ('[' || chr(57344) || '-' || chr(1114111) || ']') THEN key
        ELSE (
            SELECT
                string_agg(
                    CASE
                        WHEN ascii(u.c) >= 65536 THEN chr(ascii(u.c) - 8192)
                        WHEN ascii(u.c) >= 57344 THEN chr(ascii(u.c) + 1048576)
                        ELSE u.c
                    END,
                    '' ORDER BY u.i
                )
            FROM unnest(string_to_array(key, NULL)) WITH ORDINALITY AS u (c, i)
        )
    END
$function$;

REVOKE ALL ON FUNCTION ql3._jcs_sort_key(text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3._jcs_sort_key(text) IS
'Sort key whose "C" collation order is the UTF-16 code unit order JCS requires for keys.';

CREATE FUNCTION ql3._jcs_number(num text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SECURITY INVOKER
AS $function$
-- num is numeric_out text (what jsonb prints for a number: plain decimal, no exponent).
-- float8 text is the shortest round-trip form only when extra_float_digits >= 1, which
-- every public entry point pins with a SET clause.
DECLARE
    p integer := strpos(num, '.');
    shortest text;
    sign text := '';
    exp10 integer := 0;
    point integer;
    digits text;
    k integer;
BEGIN
    -- Up to 15 characters before the point (sign included) is always below 2^53-1.
    IF p = 0 AND length(num) <= 15 THEN
        RETURN num;
    END IF;
    IF (p = 0 OR p > 15) AND abs(num::numeric) > 9007199254740991 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: number ' || pg_catalog.left(num, 40)
            || CASE WHEN length(num) > 40 THEN '...' ELSE '' END
            || ' is outside the safe range -(2^53-1)..2^53-1';
    END IF;
    IF p = 0 THEN
        RETURN num;
    END IF;
    IF rtrim(num, '0') LIKE '%.' THEN
        -- Integral value written with a fraction: 1.0 -> 1, -25.00 -> -25.
        IF pg_catalog.left(num, p - 1) = '-0' THEN
            RETURN '0';
        END IF;
        RETURN pg_catalog.left(num, p - 1);
    END IF;

    IF length(num) > 300 THEN
        -- Only a decimal this long can be below half the smallest subnormal, where it would
        -- silently become 0 as a double: refuse it, as python/ql3/canonical.py does.
        BEGIN
            shortest := num::float8::text;
        EXCEPTION WHEN numeric_value_out_of_range THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01',
                MESSAGE = 'QL3_INVALID_ARGUMENT: number ' || pg_catalog.left(num, 40)
                || '... is too close to 0 to be a nonzero double';
        END;
    ELSE
        shortest := num::float8::text;
    END IF;
    -- Without an exponent PostgreSQL and ECMAScript print the same digits the same way.
    IF strpos(shortest, 'e') = 0 THEN
        RETURN shortest;
    END IF;

    -- Split "1.5e-07" / "1.2345678901234565e+15" into digits and a decimal point
    -- position (value = 0.<digits> * 10^point), then print as Number::toString does
    -- (ECMA-262 Number::toString, radix 10).
    IF pg_catalog.left(shortest, 1) = '-' THEN
        sign := '-';
        shortest := substr(shortest, 2);
    END IF;
    p := strpos(shortest, 'e');
    exp10 := substr(shortest, p + 1)::integer;
    shortest := pg_catalog.left(shortest, p - 1);
    p := strpos(shortest, '.');
    IF p > 0 THEN
        point := p - 1 + exp10;
        digits := pg_catalog.left(shortest, p - 1) || substr(shortest, p + 1);
    ELSE
        point := length(shortest) + exp10;
        digits := shortest;
    END IF;
    k := length(digits);
    digits := ltrim(digits, '0');
    point := point - (k - length(digits));
    digits := rtrim(digits, '0');
    k := length(digits);

    IF k <= point AND point <= 21 THEN
        RETURN sign || digits || repeat('0', point - k);
    ELSIF 0 < point AND point <= 21 THEN
        RETURN sign || pg_catalog.left(digits, point) || '.' || substr(digits, point + 1);
    ELSIF -6 < point AND point <= 0 THEN
        RETURN sign || '0.' || repeat('0', -point) || digits;
    END IF;
    RETURN sign || pg_catalog.left(digits, 1)
        || CASE WHEN k > 1 THEN '.' || substr(digits, 2) ELSE '' END
        || 'e' || CASE WHEN point - 1 >= 0 THEN '+' ELSE '-' END
        || abs(point - 1)::text;
END
$function$;

REVOKE ALL ON FUNCTION ql3._jcs_number(text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3._jcs_number(text) IS
'JCS text of one jsonb number (ECMAScript shortest form); rejects |x| > 2^53-1.';

CREATE FUNCTION ql3._jcs_value(node jsonb, depth integer)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SECURITY INVOKER
AS $function$
-- depth is the number of containers from the root down to node, node included.
-- A jsonb string prints through escape_json, which already is the JCS string escaping
-- (\" \\ \b \f \n \r \t, other controls as lowercase \u00xx, everything else literal);
-- jsonb cannot hold U+0000 or lone surrogates at all. Scalars are rendered inline so that
-- only containers cost a call. Objects use one query (its sort beats a PL/pgSQL loop);
-- arrays use a loop of simple expressions, which skips the executor entirely.
DECLARE
    kind text := jsonb_typeof(node);
    child jsonb;
    parts text [];
    n integer;
BEGIN
    IF kind = 'object' OR kind = 'array' THEN
        IF depth > 64 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'Q3V01',
                MESSAGE = 'QL3_INVALID_ARGUMENT: JSON nests deeper than 64 levels';
        END IF;
    END IF;
    IF kind = 'object' THEN
        RETURN '{' || array_to_string(ARRAY(
            SELECT
                to_json(e.key)::text || ':' || CASE jsonb_typeof(e.value)
                    WHEN 'string' THEN e.value::text
                    WHEN 'number' THEN ql3._jcs_number(e.value::text)
                    WHEN 'object' THEN ql3._jcs_value(e.value, depth + 1)
                    WHEN 'array' THEN ql3._jcs_value(e.value, depth + 1)
                    ELSE e.value::text
                END
            FROM jsonb_each(node) AS e
            ORDER BY CASE
                WHEN octet_length(e.key) = length(e.key) THEN e.key
                ELSE ql3._jcs_sort_key(e.key)
            END COLLATE "C"
        ), ',') || '}';
    ELSIF kind = 'array' THEN
        n := jsonb_array_length(node);
        IF n = 0 THEN
            RETURN '[]';
        END IF;
        -- The parts go into an array (an expanded array in PL/pgSQL: each assignment is
        -- amortised O(1)) and are joined once; appending to one text instead copied it
        -- whole per element, quadratic in the array's length.
        IF depth = 1 THEN
            -- A value read from a table may still be compressed or stored out of line, and
            -- node -> i would then fetch and decompress all of it for every element (only
            -- the root can be: what it contains is in memory once it is). One copy instead.
            node := node || '[]'::jsonb;
        END IF;
        FOR i IN 0 .. n - 1 LOOP
            child := node -> i;
            parts[i + 1] := CASE jsonb_typeof(child)
                WHEN 'string' THEN child::text
                WHEN 'number' THEN ql3._jcs_number(child::text)
                WHEN 'object' THEN ql3._jcs_value(child, depth + 1)
                WHEN 'array' THEN ql3._jcs_value(child, depth + 1)
                ELSE child::text
            END;
        END LOOP;
        RETURN '[' || array_to_string(parts, ',') || ']';
    ELSIF kind = 'number' THEN
        RETURN ql3._jcs_number(node::text);
    END IF;
    RETURN node::text;  -- string, true, false, null
END
$function$;

REVOKE ALL ON FUNCTION ql3._jcs_value(jsonb, integer) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3._jcs_value(jsonb, integer) IS
'Recursive body of ql3.jcs; callers must pin extra_float_digits >= 1.';

CREATE FUNCTION ql3.jcs(value jsonb)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
SET extra_float_digits = 1
AS $function$
BEGIN
    RETURN ql3._jcs_value(value, 1);
END
$function$;

REVOKE ALL ON FUNCTION ql3.jcs(jsonb) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3.jcs(jsonb) IS
'RFC 8785 canonical JSON text of value under the ql3 rules (SPEC section 2).';

-- The digest framing of SPEC 2, once: lowercase hex SHA-256 of UTF-8(domain) || 0x00 ||
-- UTF-8(canonical text). One SELECT of one expression, no SET clause, STABLE (as
-- convert_to is): the planner inlines it into its callers, hot paths included. Inlined, its
-- body is parsed under the caller's settings, so the zero byte is decode('00', 'hex'), not
-- a '\x00' literal, which standard_conforming_strings = off would read as an escape.
CREATE FUNCTION ql3._framed_digest(domain text, canonical text)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
SECURITY INVOKER
AS $function$
    SELECT encode(
        sha256(convert_to(domain, 'UTF8') || decode('00', 'hex') || convert_to(canonical, 'UTF8')), 'hex'
    )
$function$;

REVOKE ALL ON FUNCTION ql3._framed_digest(text, text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3._framed_digest(text, text) IS
'Hex SHA-256 of UTF-8(domain) || 0x00 || UTF-8(canonical): the digest framing of SPEC 2.';

CREATE FUNCTION ql3.digest(domain text, value jsonb)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
SET extra_float_digits = 1
AS $function$
BEGIN
    RETURN ql3._framed_digest(domain, ql3._jcs_value(value, 1));
END
$function$;

REVOKE ALL ON FUNCTION ql3.digest(text, jsonb) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3.digest(text, jsonb) IS
'Lowercase hex SHA-256 of UTF-8(domain) || 0x00 || UTF-8(ql3.jcs(value)).';

CREATE FUNCTION ql3.parse_json(doc text)
RETURNS jsonb
LANGUAGE plpgsql
IMMUTABLE
STRICT
PARALLEL SAFE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $function$
-- Clients that send JSON as text get Q3V01 for anything ql3.jcs would refuse, instead
-- of whatever SQLSTATE the jsonb parser happens to use (22P02, 22P05, 22003, 54001...).
DECLARE
    parsed jsonb;
    reason text;
    detail text;
BEGIN
    BEGIN
        parsed := doc::jsonb;
    EXCEPTION WHEN data_exception OR program_limit_exceeded THEN
        GET STACKED DIAGNOSTICS reason = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL;
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: not valid JSON: ' || reason
            || CASE WHEN detail <> '' THEN ' (' || detail || ')' ELSE '' END;
    END;
    -- The same rules as ql3.jcs, checked in C by jsonpath: nesting first, which bounds
    -- how deep the unbounded number search below can recurse.
    IF jsonb_path_exists(
        parsed, 'strict $.**{64} ? (@.type() == "object" || @.type() == "array")'
    ) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: JSON nests deeper than 64 levels';
    END IF;
    IF jsonb_path_exists(
        parsed,
        'strict $.** ? (@.type() == "number"'
        ' && (@ > 9007199254740991 || @ < -9007199254740991))'
    ) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: JSON holds a number outside the safe range '
            || '-(2^53-1)..2^53-1';
    END IF;
    IF jsonb_path_exists(
        parsed, 'strict $.** ? (@.type() == "number" && @ != 0 && @ < 1e-300 && @ > -1e-300)'
    ) THEN
        -- Rare: let the real encoder decide whether a tiny number underflows a double.
        PERFORM ql3._jcs_value(parsed, 1);
    END IF;
    RETURN parsed;
END
$function$;

REVOKE ALL ON FUNCTION ql3.parse_json(text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3.parse_json(text) IS
'Parse JSON text into jsonb that ql3.jcs accepts; any rejection is Q3V01.';

CREATE FUNCTION ql3._identity(
    prefix text, domain text, invocation_id text, phase text
)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SECURITY INVOKER
AS $function$
-- Identities are digests of [invocation_id, phase], never concatenations (SPEC 2).
BEGIN
    IF invocation_id IS NULL OR invocation_id = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: invocation_id must be 1..128 characters';
    END IF;
    IF length(invocation_id) > 128 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V03',
            MESSAGE = 'QL3_IDENTIFIER_TOO_LONG: invocation_id has '
            || length(invocation_id) || ' characters, at most 128 are allowed';
    END IF;
    IF phase IS NULL OR phase NOT IN ('admission', 'completion', 'resolution') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: phase must be admission, completion or '
            || 'resolution, not ' || coalesce(quote_literal(phase), 'NULL');
    END IF;
    RETURN prefix || ql3._framed_digest(domain, ql3._jcs_value(jsonb_build_array(invocation_id, phase), 1));
END
$function$;

REVOKE ALL ON FUNCTION ql3._identity(text, text, text, text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3._identity(text, text, text, text) IS
'prefix || digest(domain, [invocation_id, phase]) after checking both arguments.';

CREATE FUNCTION ql3.mutation_id(invocation_id text, phase text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $function$
    SELECT ql3._identity('mut_', 'ql3/mutation-id@v1', invocation_id, phase)
$function$;

REVOKE ALL ON FUNCTION ql3.mutation_id(text, text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3.mutation_id(text, text) IS
'Mutation id of an invocation phase: mut_ || digest(''ql3/mutation-id@v1'', [id, phase]).';

CREATE FUNCTION ql3.event_id(invocation_id text, phase text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $function$
    SELECT ql3._identity('evt_', 'ql3/run-event-id@v1', invocation_id, phase)
$function$;

REVOKE ALL ON FUNCTION ql3.event_id(text, text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3.event_id(text, text) IS
'Run event id of an invocation phase: evt_ || digest(''ql3/run-event-id@v1'', [id, phase]).';

CREATE FUNCTION ql3.dedupe_key(invocation_id text, phase text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $function$
    SELECT ql3._identity('ddp_', 'ql3/dedupe-key@v1', invocation_id, phase)
$function$;

REVOKE ALL ON FUNCTION ql3.dedupe_key(text, text) FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3.dedupe_key(text, text) IS
'Dedupe key of an invocation phase: ddp_ || digest(''ql3/dedupe-key@v1'', [id, phase]).';

-- Every role may compute canonical JSON, digests and identities. These six run as their
-- owner (SECURITY DEFINER, search_path pinned, pg_temp last), so the `_` helpers they call
-- stay the owner's alone (D46).
GRANT EXECUTE ON FUNCTION
ql3.jcs(jsonb),
ql3.digest(text, jsonb),
ql3.parse_json(text),
ql3.mutation_id(text, text),
ql3.event_id(text, text),
ql3.dedupe_key(text, text)
TO ql3_runtime, ql3_relay, ql3_operator, ql3_reader;
