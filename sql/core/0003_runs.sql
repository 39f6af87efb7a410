-- Runs and steps (SPEC section 3): the state a durable model invocation fences.
--
-- runs and step_runs are mutable and versioned; run_events and step_run_mutations are
-- their immutable history. Every step transition bumps the step version and the run
-- version, and appends exactly one run event (the next run event_seq, gap-free because
-- the run row is locked by the UPDATE that allocates it) and one step mutation, in the
-- transaction of the receipt that caused it (ql3_ai functions).

-- Constraints guard invariants, not formats: create_run, add_step_run and the ql3_ai
-- functions validate their input, and every CHECK or FK here is paid by each of the
-- several writes of every step transition. Identifier lengths are bounded by the domain
-- ql3.identifier instead, as defence in depth (D46): a domain's check is prepared once per
-- session, a table's CHECK again by every statement that writes the table.

CREATE TABLE ql3.runs (
    run_id uuid PRIMARY KEY,
    project_id ql3.identifier NOT NULL,
    trace_id ql3.identifier NOT NULL,
    -- A run is 'open' for its whole life in this version; outcomes live on its steps.
    status text NOT NULL DEFAULT 'open' CHECK (status = 'open'),
    version bigint NOT NULL DEFAULT 1,
    event_seq bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE ql3.runs IS
'Runs: version grows by one per step transition; event_seq is the seq of the last run event (0 = none).';

CREATE TABLE ql3.step_runs (
    step_run_id uuid PRIMARY KEY,
    run_id uuid NOT NULL REFERENCES ql3.runs (run_id),
    kind text NOT NULL,
    status text NOT NULL DEFAULT 'ready',
    version bigint NOT NULL DEFAULT 1,
    attempt_count integer NOT NULL DEFAULT 0,
    current_invocation_id ql3.identifier,
    output_ref text,
    result_code ql3.identifier,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CHECK (
        CASE status
            WHEN 'ready' THEN current_invocation_id IS NULL AND output_ref IS NULL AND result_code IS NULL
            WHEN 'running' THEN current_invocation_id IS NOT NULL AND output_ref IS NULL AND result_code IS NULL
            WHEN 'succeeded' THEN TRUE
            WHEN 'failed' THEN output_ref IS NULL
            WHEN 'timed_out' THEN output_ref IS NULL
            WHEN 'lost' THEN output_ref IS NULL
            WHEN 'cancelled' THEN output_ref IS NULL
            ELSE FALSE
        END
    )
);

COMMENT ON TABLE ql3.step_runs IS
'Steps of a run; a new step is ready at version 1 with attempt_count 0. Model steps move only through ql3_ai.';

CREATE INDEX step_runs_run ON ql3.step_runs (run_id);

-- Recovery looks for running steps only; they are few, whatever the history holds.
CREATE INDEX step_runs_running ON ql3.step_runs (step_run_id) WHERE status = 'running';

CREATE TABLE ql3.run_events (
    run_id uuid NOT NULL,
    seq bigint NOT NULL,
    event_id text NOT NULL UNIQUE,
    event_type text NOT NULL,
    step_run_id uuid,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq)
);

COMMENT ON TABLE ql3.run_events IS
'Immutable run history, seq 1..n per run without gaps. Payloads carry ids and digests, never prompt or output bodies.';

CREATE TABLE ql3.step_run_mutations (
    mutation_id text PRIMARY KEY,
    dedupe_key text NOT NULL UNIQUE,
    step_run_id uuid NOT NULL,
    from_status text NOT NULL,
    to_status text NOT NULL,
    from_version bigint NOT NULL,
    to_version bigint NOT NULL CHECK (to_version = from_version + 1),
    command_digest text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- One transition per step version: two writers can never both move the same version.
    UNIQUE (step_run_id, to_version)
);

COMMENT ON TABLE ql3.step_run_mutations IS
'Immutable log of step transitions: one row per transition, keyed by identities derived from the command.';

CREATE TRIGGER run_events_immutable
BEFORE UPDATE OR DELETE ON ql3.run_events
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER run_events_no_truncate
BEFORE TRUNCATE ON ql3.run_events
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER step_run_mutations_immutable
BEFORE UPDATE OR DELETE ON ql3.step_run_mutations
FOR EACH ROW EXECUTE FUNCTION ql3._reject_mutation();

CREATE TRIGGER step_run_mutations_no_truncate
BEFORE TRUNCATE ON ql3.step_run_mutations
FOR EACH STATEMENT EXECUTE FUNCTION ql3._reject_mutation();

-- The step state machine (SPEC section 4) binds direct writes too: ql3_runtime and
-- ql3_operator have UPDATE on step_runs (SPEC section 5), and an UPDATE of theirs must not
-- make a transition the functions never make (failed -> ready, succeeded -> running...).
-- The WHEN clause is an expression, so the functions' own, legal transitions call nothing.
CREATE FUNCTION ql3._refuse_step_transition() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, ql3
AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'Q3S01',
        MESSAGE = format('QL3_ILLEGAL_TRANSITION: step run %s cannot go from %s to %s',
                         OLD.step_run_id, OLD.status, NEW.status);
END;
$$;

COMMENT ON FUNCTION ql3._refuse_step_transition() IS
'Trigger: refuses a step status change outside the state machine of SPEC section 4.';

CREATE TRIGGER step_runs_state_machine
BEFORE UPDATE OF status ON ql3.step_runs
FOR EACH ROW
WHEN (
    old.status IS DISTINCT FROM new.status
    AND (old.status, new.status) NOT IN (
        ('ready', 'running'),
        ('running', 'succeeded'), ('running', 'failed'), ('running', 'timed_out'), ('running', 'lost'),
        ('lost', 'ready'), ('lost', 'failed'), ('lost', 'cancelled')
    )
)
EXECUTE FUNCTION ql3._refuse_step_transition();

CREATE FUNCTION ql3.create_run(p_project_id text, p_trace_id text, p_run_id uuid DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    existing ql3.runs;
    new_id uuid := coalesce(p_run_id, gen_random_uuid());
BEGIN
    PERFORM ql3._check_identifier('project_id', p_project_id);
    PERFORM ql3._check_identifier('trace_id', p_trace_id);
    IF NOT ql3._may_act(p_project_id) THEN
        PERFORM ql3._refuse_project(p_project_id, 'act on');
    END IF;
    INSERT INTO ql3.runs (run_id, project_id, trace_id)
    VALUES (new_id, p_project_id, p_trace_id)
    ON CONFLICT (run_id) DO NOTHING;
    IF found THEN
        RETURN new_id;
    END IF;
    SELECT * INTO existing FROM ql3.runs AS r WHERE r.run_id = new_id;
    IF NOT ql3._may_act(existing.project_id) THEN  -- no word about another project (D47)
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01', MESSAGE = format('QL3_CONFLICT: run %s exists in another project', new_id);
    END IF;
    IF (existing.project_id, existing.trace_id) IS DISTINCT FROM (p_project_id, p_trace_id) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: run %s exists with project_id %L and trace_id %L',
                             new_id, existing.project_id, existing.trace_id);
    END IF;
    RETURN new_id;
END;
$$;

COMMENT ON FUNCTION ql3.create_run(text, text, uuid) IS
'Creates an open run (version 1, no events) or returns the same run_id again; other content is QL3_CONFLICT.';

CREATE FUNCTION ql3.add_step_run(p_run_id uuid, p_kind text, p_step_run_id uuid DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, ql3, pg_temp
AS $$
DECLARE
    existing ql3.step_runs;
    new_id uuid := coalesce(p_step_run_id, gen_random_uuid());
BEGIN
    IF p_run_id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'Q3V01', MESSAGE = 'QL3_INVALID_ARGUMENT: run_id is required';
    END IF;
    IF p_kind IS NULL OR p_kind !~ '^[a-z][a-z0-9_]{0,63}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3V01',
            MESSAGE = format('QL3_INVALID_ARGUMENT: kind must match [a-z][a-z0-9_]{0,63}, not %s',
                             coalesce(quote_literal(p_kind), 'NULL'));
    END IF;
    -- Another project's run is as absent as one that never existed (D47).
    IF NOT EXISTS (SELECT 1 FROM ql3.runs AS r WHERE r.run_id = p_run_id AND ql3._may_act(r.project_id)) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3N01',
            MESSAGE = format('QL3_NOT_FOUND: run %s does not exist', p_run_id);
    END IF;
    INSERT INTO ql3.step_runs (step_run_id, run_id, kind)
    VALUES (new_id, p_run_id, p_kind)
    ON CONFLICT (step_run_id) DO NOTHING;
    IF found THEN
        RETURN new_id;
    END IF;
    SELECT * INTO existing FROM ql3.step_runs AS s WHERE s.step_run_id = new_id;
    IF existing.run_id <> p_run_id
       AND NOT EXISTS (SELECT 1 FROM ql3.runs AS r
                       WHERE r.run_id = existing.run_id AND ql3._may_act(r.project_id)) THEN
        RAISE EXCEPTION USING  -- no word about another project's run (D47)
            ERRCODE = 'Q3C01', MESSAGE = format('QL3_CONFLICT: step run %s exists in another project', new_id);
    END IF;
    IF (existing.run_id, existing.kind) IS DISTINCT FROM (p_run_id, p_kind) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'Q3C01',
            MESSAGE = format('QL3_CONFLICT: step run %s exists in run %s with kind %L',
                             new_id, existing.run_id, existing.kind);
    END IF;
    RETURN new_id;
END;
$$;

COMMENT ON FUNCTION ql3.add_step_run(uuid, text, uuid) IS
'Adds a ready step (version 1, attempt_count 0) to a run, or returns the same step_run_id again; other content is QL3_CONFLICT.';

-- Grants (SPEC section 5, D46): reads only; create_run, add_step_run and the ql3_ai
-- functions are the writers, running as ql3_owner.

REVOKE ALL ON FUNCTION ql3.create_run(text, text, uuid), ql3.add_step_run(uuid, text, uuid) FROM PUBLIC;  -- noqa: CP02

GRANT SELECT ON ql3.runs, ql3.step_runs, ql3.run_events, ql3.step_run_mutations TO ql3_runtime;
GRANT EXECUTE ON FUNCTION ql3.create_run(text, text, uuid), ql3.add_step_run(uuid, text, uuid)
TO ql3_runtime;

GRANT SELECT ON ql3.runs, ql3.step_runs, ql3.run_events, ql3.step_run_mutations TO ql3_operator;

GRANT SELECT ON ql3.runs, ql3.step_runs, ql3.run_events, ql3.step_run_mutations TO ql3_reader;

-- Row-level security (D47, see 0002): the rows of the projects the session may act on.
ALTER TABLE ql3.runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3.step_runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3.run_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE ql3.step_run_mutations ENABLE ROW LEVEL SECURITY;

CREATE POLICY project_rows ON ql3.runs FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR project_id = any((SELECT ql3.visible_projects())::text []));
CREATE POLICY project_rows ON ql3.step_runs FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR EXISTS (
    SELECT 1 FROM ql3.runs AS r WHERE r.run_id = step_runs.run_id));
CREATE POLICY project_rows ON ql3.run_events FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR EXISTS (
    SELECT 1 FROM ql3.runs AS r WHERE r.run_id = run_events.run_id));
CREATE POLICY project_rows ON ql3.step_run_mutations FOR SELECT
USING ((SELECT ql3.visible_projects()) IS NULL OR EXISTS (
    SELECT 1 FROM ql3.step_runs AS s WHERE s.step_run_id = step_run_mutations.step_run_id));
