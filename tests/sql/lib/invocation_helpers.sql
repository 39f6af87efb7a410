-- Helpers shared by the invocation pgTAP files, included with \ir inside their
-- transaction (so they roll back with it): command builders, a footprint of every table
-- the invocation functions write, and a rejection check that also proves nothing was written.
GRANT USAGE ON SCHEMA tests TO PUBLIC;  -- noqa: CP02

CREATE FUNCTION tests.admission(
    p_invocation_id text, p_run_id uuid, p_step_run_id uuid, p_version bigint,
    p_policy jsonb DEFAULT NULL, p_deadline_at text DEFAULT '2999-01-01T00:00:00.000000Z',
    p_project_id text DEFAULT 'proj', p_trace_id text DEFAULT 'trace-1'
) RETURNS jsonb
LANGUAGE sql IMMUTABLE
AS $$
    SELECT jsonb_build_object(
        'schema', 'ql3/model-invocation-admission@v1',
        'invocation_id', p_invocation_id,
        'request_id', 'req-' || left(p_invocation_id, 100),
        'project_id', p_project_id,
        'run_id', p_run_id,
        'step_run_id', p_step_run_id,
        'trace_id', p_trace_id,
        'expected_step_run_version', p_version,
        'provider', 'ollama',
        'model', 'llama3.1:8b',
        'policy', p_policy,
        'request_digest', encode(sha256(convert_to('prompt of ' || p_invocation_id, 'UTF8')), 'hex'),
        'input_bytes', 512,
        'deadline_at', p_deadline_at
    );
$$;

CREATE FUNCTION tests.usage(p_input bigint, p_output bigint, p_cost bigint, p_currency text) RETURNS jsonb
LANGUAGE sql IMMUTABLE
AS $$
    SELECT jsonb_build_object(
        'input_tokens', p_input, 'output_tokens', p_output, 'cost_micros', p_cost, 'currency', p_currency
    );
$$;

CREATE FUNCTION tests.completion(
    p_invocation_id text, p_outcome text DEFAULT 'succeeded', p_result_code text DEFAULT 'ok',
    p_usage jsonb DEFAULT NULL
) RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT jsonb_build_object(
        'schema', 'ql3/model-invocation-completion-command@v1',
        'invocation_id', p_invocation_id,
        'start_digest', coalesce(
            (SELECT s.start_digest FROM ql3_ai.model_invocation_starts AS s WHERE s.invocation_id = p_invocation_id),
            repeat('0', 64)
        ),
        'outcome', p_outcome,
        'result_code', p_result_code,
        'output_bytes', CASE WHEN p_outcome = 'succeeded' THEN 2048 END,
        'output_digest', CASE WHEN p_outcome = 'succeeded' THEN repeat('c', 64) END,
        'usage', p_usage
    );
$$;

CREATE FUNCTION tests.resolution(
    p_invocation_id text, p_decision text, p_user_id text DEFAULT 'alice', p_reason text DEFAULT NULL
) RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT jsonb_build_object(
        'schema', 'ql3/model-invocation-resolution-command@v1',
        'invocation_id', p_invocation_id,
        'completion_digest', coalesce(
            (SELECT c.completion_digest FROM ql3_ai.model_invocation_completions AS c
             WHERE c.invocation_id = p_invocation_id),
            repeat('0', 64)
        ),
        'decision', p_decision,
        'user_id', p_user_id,
        'expected_step_run_version', coalesce(
            (SELECT r.version FROM ql3.step_runs AS r
             INNER JOIN ql3_ai.model_invocation_starts AS s ON s.step_run_id = r.step_run_id
             WHERE s.invocation_id = p_invocation_id),
            1
        ),
        'reason', p_reason
    );
$$;

-- Every row count and version the invocation functions can change, as one text.
CREATE FUNCTION tests.footprint() RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT format(
        'runs=%s/%s/%s steps=%s/%s/%s starts=%s completions=%s resolutions=%s ledger=%s events=%s mutations=%s',
        (SELECT count(*) FROM ql3.runs), (SELECT sum(version) FROM ql3.runs), (SELECT sum(event_seq) FROM ql3.runs),
        (SELECT count(*) FROM ql3.step_runs), (SELECT sum(version) FROM ql3.step_runs),
        (SELECT string_agg(status || attempt_count, ',' ORDER BY step_run_id) FROM ql3.step_runs),
        (SELECT count(*) FROM ql3_ai.model_invocation_starts),
        (SELECT count(*) FROM ql3_ai.model_invocation_completions),
        (SELECT count(*) FROM ql3_ai.model_invocation_resolutions),
        (SELECT count(*) FROM ql3_ai.usage_ledger),
        (SELECT count(*) FROM ql3.run_events),
        (SELECT count(*) FROM ql3.step_run_mutations)
    );
$$;

-- Everything any function can write, as one text: the invocation footprint plus the
-- contracts, the outbox and the project mappings. Read as the test superuser (SECURITY
-- DEFINER: row-level security does not apply), so a role that may read none of it (the
-- relay) is checked too.
CREATE FUNCTION tests.state() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT tests.footprint() || format(
        ' revisions=%s revocations=%s outbox=%s/%s/%s pointers=%s grants=%s identities=%s',
        (SELECT count(*) FROM ql3.contract_revisions), (SELECT count(*) FROM ql3.revision_revocations),
        (SELECT count(*) FROM ql3.contract_outbox), (SELECT count(o.delivered_at) FROM ql3.contract_outbox AS o),
        (SELECT sum(o.relay_attempts) FROM ql3.contract_outbox AS o),
        (SELECT string_agg(a.project_id || ':' || a.contract_id || '=' || coalesce(a.active_revision_id::text, '-')
                           || '@' || a.pointer_version, ',' ORDER BY a.project_id, a.contract_id)
         FROM ql3.active_revisions AS a),
        (SELECT string_agg(g.role_name || ':' || coalesce(g.project_id, '*'), ',' ORDER BY g.role_name, g.project_id)
         FROM ql3.project_grants AS g),
        (SELECT count(*) FROM ql3_ai.resolver_identities)
    );
$$;

-- Two tests: the call fails with p_errcode (and, when given, exactly p_message), and it
-- left no trace. The message tells apart errors that share a code, such as the QL3_CONFLICT
-- of a tampered receipt and that of a conflicting command.
CREATE FUNCTION tests.rejects(
    p_sql text, p_errcode text, p_description text, p_message text DEFAULT NULL
) RETURNS SETOF text
LANGUAGE plpgsql
AS $$
DECLARE
    before text := tests.state();
BEGIN
    RETURN NEXT throws_ok(p_sql, p_errcode, p_message, p_description);
    RETURN NEXT is(tests.state(), before, p_description || ': nothing written');
END;
$$;

-- The SQLSTATE and message of the error p_sql raises ('no error' if none): two calls
-- that must fail alike compare equal.
CREATE FUNCTION tests.failure_of(p_sql text) RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    state text;
    message text;
BEGIN
    EXECUTE p_sql;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, message = MESSAGE_TEXT;
    RETURN state || ' ' || message;
END;
$$;

-- SQLSTATE and DETAIL of a failing statement, for errors whose DETAIL is part of the contract.
CREATE FUNCTION tests.error_of(p_sql text) RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    state text;
    detail text;
BEGIN
    EXECUTE p_sql;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, detail = PG_EXCEPTION_DETAIL;
    RETURN state || ' ' || detail;
END;
$$;
