-- The completion table's CHECK as a call of a small function, and the lost-step trigger's
-- WHEN cut to its first test (issue 23, D67), as core 0006 does for the step table.
--
-- PostgreSQL keeps a table's CHECK constraints and a trigger's WHEN clause as node text,
-- and every statement that writes the table reads that text back, plans it and builds its
-- expression state again:
-- - the completions' CHECK (a CASE over four outcomes, 4.7 KB of node text) was paid by
--   every completion. It is now a call of ql3_ai._completion_valid, whose body is parsed
--   and planned once per session. Same rule, same answers, NULLs included; the constraint
--   keeps its name. Every operator is schema-qualified instead of a SET search_path, which
--   would cost a configuration change per row. Added NOT VALID; 0003 validates the
--   existing rows without blocking completions.
-- - step_runs_lost_needs_resolution's WHEN (a lost step whose status, invocation or
--   attempt count changes, 1.8 KB) was paid by every step UPDATE, though only a lost step
--   can match it. It is now `old.status = 'lost'`, and the trigger function makes the rest
--   of the test first: an update of a lost step that changes none of the three goes
--   through, as the old WHEN let it.

CREATE FUNCTION ql3_ai._completion_valid(p_outcome text, p_result_code text, p_recovered boolean)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    RETURN CASE
        WHEN p_outcome OPERATOR(pg_catalog.=) 'lost' THEN p_result_code OPERATOR(pg_catalog.=) 'outcome_unknown'
        WHEN p_outcome OPERATOR(pg_catalog.=) ANY ('{succeeded,failed,timed_out}'::pg_catalog.text [])
            THEN NOT p_recovered AND p_result_code OPERATOR(pg_catalog.<>) 'outcome_unknown'
        ELSE FALSE
    END;
END;
$$;

COMMENT ON FUNCTION ql3_ai._completion_valid(text, text, boolean) IS
'CHECK of ql3_ai.model_invocation_completions: lost always carries outcome_unknown and only lost may be recovered.';

REVOKE ALL ON FUNCTION ql3_ai._completion_valid(text, text, boolean) FROM PUBLIC;  -- noqa: CP02

ALTER TABLE ql3_ai.model_invocation_completions
DROP CONSTRAINT model_invocation_completions_check,
ADD CONSTRAINT model_invocation_completions_check
CHECK (ql3_ai._completion_valid(outcome, result_code, recovered)) NOT VALID;

CREATE OR REPLACE FUNCTION ql3_ai._require_resolution() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    IF NEW.status IS NOT DISTINCT FROM OLD.status
       AND NEW.current_invocation_id IS NOT DISTINCT FROM OLD.current_invocation_id
       AND NEW.attempt_count IS NOT DISTINCT FROM OLD.attempt_count THEN
        RETURN NEW;  -- the step stays where it is: nothing to resolve
    END IF;
    IF NEW.status <> 'lost' AND EXISTS (
        SELECT 1 FROM ql3_ai.model_invocation_resolutions AS r
        INNER JOIN ql3_ai.model_invocation_starts AS st ON st.invocation_id = r.invocation_id
        WHERE r.invocation_id = OLD.current_invocation_id
          AND r.step_run_id = OLD.step_run_id
          AND r.decision = CASE NEW.status WHEN 'ready' THEN 'retry' WHEN 'failed' THEN 'fail'
                                           WHEN 'cancelled' THEN 'cancel' END
          AND st.attempt = (SELECT max(n.attempt) FROM ql3_ai.model_invocation_starts AS n
                            WHERE n.run_id = OLD.run_id AND n.step_run_id = OLD.step_run_id)
    ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'Q3S01',
        MESSAGE = format('QL3_ILLEGAL_TRANSITION: step run %s is lost; only a resolution of its '
                         'invocation %s moves it', OLD.step_run_id, OLD.current_invocation_id);
END;
$$;

CREATE OR REPLACE TRIGGER step_runs_lost_needs_resolution
BEFORE UPDATE ON ql3.step_runs
FOR EACH ROW
WHEN (old.status = 'lost')
EXECUTE FUNCTION ql3_ai._require_resolution();
