-- The step table's CHECK and its state machine's WHEN clause as calls of two small
-- functions (issue 23, D67).
--
-- PostgreSQL keeps a table's CHECK constraints and a trigger's WHEN clause as node text,
-- and every statement that writes the table reads that text back, plans it and builds its
-- expression state again. For step_runs' CHECK (a CASE over seven statuses, 5 KB of node
-- text) and the state machine's WHEN (a row NOT IN over eight pairs, 7.7 KB) that was
-- about 27 µs of every step INSERT and UPDATE, each transition of every admission and
-- completion. A function's body is parsed and planned once per session: the same two
-- expressions, moved into functions, leave a call of a few arguments to each statement.
--
-- Same rules, same answers: each function returns what its expression returned, NULLs
-- included, and the constraint and the trigger keep their names, so errors read as
-- before (23514 step_runs_check, Q3S01 from ql3._refuse_step_transition).
--
-- No SET search_path on either function: it would cost a configuration change on every
-- row. Instead every operator is schema-qualified, so a body compiled under any
-- search_path means the same (the only writers run with a pinned one anyway, D46).
--
-- The new CHECK is added NOT VALID, so this file takes its table lock only for a moment;
-- 0007 validates the existing rows without blocking writes.

CREATE FUNCTION ql3._step_state_valid(
    p_status text, p_current_invocation_id text, p_output_ref text, p_result_code text
) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    RETURN CASE
        WHEN p_status OPERATOR(pg_catalog.=) 'ready'
            THEN p_current_invocation_id IS NULL AND p_output_ref IS NULL AND p_result_code IS NULL
        WHEN p_status OPERATOR(pg_catalog.=) 'running'
            THEN p_current_invocation_id IS NOT NULL AND p_output_ref IS NULL AND p_result_code IS NULL
        WHEN p_status OPERATOR(pg_catalog.=) 'succeeded' THEN TRUE
        WHEN p_status OPERATOR(pg_catalog.=) ANY ('{failed,timed_out,lost,cancelled}'::pg_catalog.text [])
            THEN p_output_ref IS NULL
        ELSE FALSE
    END;
END;
$$;

COMMENT ON FUNCTION ql3._step_state_valid(text, text, text, text) IS
'CHECK of ql3.step_runs: which columns each status requires empty or set.';

-- SPEC section 4's transitions. NOT of an OR of (from = a AND to = b) is the row NOT IN
-- it replaces, with the same NULLs: a NULL target is NULL (no refusal) where some
-- transition leaves from_status, true where none does.
CREATE FUNCTION ql3._step_transition_refused(p_from_status text, p_to_status text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    RETURN NOT (
        p_from_status OPERATOR(pg_catalog.=) 'ready' AND p_to_status OPERATOR(pg_catalog.=) 'running'
        OR p_from_status OPERATOR(pg_catalog.=) 'running'
        AND p_to_status OPERATOR(pg_catalog.=) ANY ('{succeeded,failed,timed_out,lost}'::pg_catalog.text [])
        OR p_from_status OPERATOR(pg_catalog.=) 'lost'
        AND p_to_status OPERATOR(pg_catalog.=) ANY ('{ready,failed,cancelled}'::pg_catalog.text [])
    );
END;
$$;

COMMENT ON FUNCTION ql3._step_transition_refused(text, text) IS
'WHEN of ql3.step_runs_state_machine: true for a status change outside SPEC section 4.';

REVOKE ALL ON FUNCTION ql3._step_state_valid(text, text, text, text),
ql3._step_transition_refused(text, text) FROM PUBLIC;  -- noqa: CP02

ALTER TABLE ql3.step_runs
DROP CONSTRAINT step_runs_check,
ADD CONSTRAINT step_runs_check
CHECK (ql3._step_state_valid(status, current_invocation_id, output_ref, result_code)) NOT VALID;

CREATE OR REPLACE TRIGGER step_runs_state_machine
BEFORE UPDATE OF status ON ql3.step_runs
FOR EACH ROW
WHEN (old.status IS DISTINCT FROM new.status AND ql3._step_transition_refused(old.status, new.status))
EXECUTE FUNCTION ql3._refuse_step_transition();
