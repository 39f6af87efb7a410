-- Helpers shared by the outbox pgTAP files that watch other sessions through dblink,
-- included with \ir inside their transaction (so they roll back with it). Each file then
-- names its own project: INSERT INTO tests.ctx (key, value) VALUES ('project', ...).
CREATE SCHEMA IF NOT EXISTS tests;

CREATE TABLE tests.ctx (key text PRIMARY KEY, value text NOT NULL);

CREATE FUNCTION tests.p() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT c.value FROM tests.ctx AS c WHERE c.key = 'project';
$$;

CREATE FUNCTION tests.dsn() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT format('host=127.0.0.1 port=%s dbname=%s user=postgres', current_setting('port'), current_database());
$$;

-- Over dblink, in p_conn's session (its open transaction, if any): put a revision of
-- p_contract with body {"n": p_n} under the file's project and activate it; the event seq.
CREATE FUNCTION tests.remote_activate(p_conn text, p_contract text, p_n integer) RETURNS bigint
LANGUAGE sql AS $$
    SELECT t.seq
    FROM dblink(
        p_conn,
        format(
            'SELECT (ql3.activate_revision(%1$L, ''policy_routing'', %2$L, r.revision_id, ''tap'')).seq
             FROM ql3.put_revision(%1$L, ''policy_routing'', %2$L, jsonb_build_object(''n'', %3$s), ''tap'') AS r',
            tests.p(), p_contract, p_n
        )
    ) AS t (seq bigint);
$$;

-- A round trip on the listening connection, then whatever notifications it has received.
CREATE FUNCTION tests.poll(p_conn text) RETURNS TABLE (notify_name text, be_pid integer, extra text)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM * FROM dblink(p_conn, 'SELECT 1') AS t (one integer);
    RETURN QUERY SELECT n.notify_name, n.be_pid, n.extra FROM dblink_get_notify(p_conn) AS n;
END;
$$;
