-- ql3.prune_outbox with a retention longer than recorded time (D65).
--
-- 0002 computed the cut-off as now() - p_delivered_before inside the statement, so an
-- interval reaching before the first instant PostgreSQL can represent (4714 BC) failed
-- with 22008 (timestamp out of range), an error that is not one of ql3's and says nothing
-- about the call. Nothing can have been delivered before that instant, so such a cut-off
-- now removes nothing and answers 0, as the SQLite shim's prune does. Everything else is
-- 0002's function, unchanged: CREATE OR REPLACE keeps its owner, grants and comment.

CREATE OR REPLACE FUNCTION ql3.prune_outbox(p_delivered_before interval, p_batch integer) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    removed integer;
    cutoff timestamptz;
BEGIN
    IF p_delivered_before IS NULL OR p_delivered_before < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01',
            MESSAGE = 'QL3_INVALID_ARGUMENT: delivered_before must be a non-negative interval';
    END IF;
    IF p_batch IS NULL OR p_batch < 1 OR p_batch > 100000 THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: batch must be 1..100000';
    END IF;
    IF NOT ql3._may_act(NULL) THEN
        PERFORM ql3._refuse_project(NULL, 'prune the outbox of');
    END IF;
    BEGIN
        cutoff := now() - p_delivered_before;
    EXCEPTION WHEN datetime_field_overflow THEN
        RETURN 0;  -- before any representable instant: nothing was delivered then
    END;
    WITH doomed AS (
        SELECT o.seq FROM ql3.contract_outbox AS o
        WHERE o.delivered_at IS NOT NULL
          AND o.delivered_at < cutoff
          AND o.pointer_version < (
              SELECT a.pointer_version FROM ql3.active_revisions AS a
              WHERE (a.project_id, a.contract_family, a.contract_id)
                    = (o.project_id, o.contract_family, o.contract_id))
        ORDER BY o.seq
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM ql3.contract_outbox AS o
        USING doomed AS d
        WHERE o.seq = d.seq AND o.delivered_at IS NOT NULL
        RETURNING 1
    )
    SELECT count(*)::integer INTO removed FROM gone;
    RETURN removed;
END;
$$;
