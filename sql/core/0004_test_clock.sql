-- The clock of the invocation receipts, as one function a test can pin (SPEC sections 10
-- and 11: with a pinned clock the SQLite shim and PostgreSQL write byte-identical records).
--
-- ql3._now() is pg_catalog.now(), the transaction's start time. The ql3_ai functions
-- (which require this migration) read every clock value through it: admitted_at,
-- completed_at, resolved_at and the clock recover_expired compares deadlines with.
--
-- Why a function body and not a setting or a table: any role can SET a custom GUC, and a
-- table would be one more owned table and one more read per call. Pinning replaces the
-- body, in a throwaway test database only:
--
--     CREATE OR REPLACE FUNCTION ql3._now() RETURNS timestamptz
--     LANGUAGE sql STABLE PARALLEL SAFE AS $$ SELECT '2026-12-02T12:00:00Z'::timestamptz $$;
--
-- which only the function's owner (ql3_owner) or a superuser may do. ql3_runtime,
-- ql3_operator, ql3_relay and ql3_reader never own anything in ql3 and have no CREATE on
-- the schema, so no role a worker or an operator logs in with can move the clock.
--
-- LANGUAGE sql, STABLE, no SET clause: the planner inlines the call, so it costs what
-- now() costs, and plans that inlined it are invalidated when a test replaces it.

CREATE FUNCTION ql3._now()
RETURNS timestamptz
LANGUAGE sql
STABLE
PARALLEL SAFE
SECURITY INVOKER
AS $function$
    SELECT pg_catalog.now()
$function$;

REVOKE ALL ON FUNCTION ql3._now() FROM PUBLIC;  -- noqa: CP02
COMMENT ON FUNCTION ql3._now() IS
'The database clock of receipts and recovery: now(); tests pin it by replacing the body as owner.';

-- No grant: the functions that call it run as its owner (D46).
