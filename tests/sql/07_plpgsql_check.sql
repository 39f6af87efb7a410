-- plpgsql_check over every PL/pgSQL function ql3 installs: no error and no warning.
-- Trigger functions are checked against the first table that fires them.
BEGIN;
SELECT plan(2);

CREATE EXTENSION IF NOT EXISTS plpgsql_check;

CREATE TEMPORARY TABLE findings ON COMMIT DROP AS
SELECT
    p.oid::regprocedure::text AS func,
    c.level,
    c.lineno,
    c.message
FROM pg_proc AS p
INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
INNER JOIN pg_language AS l ON p.prolang = l.oid
CROSS JOIN LATERAL plpgsql_check_function_tb(
    p.oid,
    relid => CASE
        WHEN p.prorettype = 'trigger'::regtype
            THEN coalesce((SELECT t.tgrelid FROM pg_trigger AS t WHERE t.tgfoid = p.oid ORDER BY t.oid LIMIT 1), 0)
        ELSE 0
    END
) AS c
WHERE n.nspname IN ('ql3', 'ql3_ai') AND l.lanname = 'plpgsql';

SELECT cmp_ok(
    (
        SELECT count(*)::integer FROM pg_proc AS p
        INNER JOIN pg_namespace AS n ON p.pronamespace = n.oid
        INNER JOIN pg_language AS l ON p.prolang = l.oid
        WHERE n.nspname = 'ql3' AND l.lanname = 'plpgsql'
    ),
    '>',
    10,
    'the PL/pgSQL functions of schema ql3 are there to be checked'
);

SELECT is_empty(
    $$SELECT func, level, lineno, message FROM findings WHERE level IN ('error', 'warning')$$,
    'plpgsql_check finds no error and no warning in ql3 and ql3_ai'
);

SELECT * FROM finish();
ROLLBACK;
