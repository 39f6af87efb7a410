-- Helpers shared by the privilege pgTAP files (06_privileges.sql, 15_ai_privileges.sql),
-- included with \ir inside their transaction (so they roll back with it).
CREATE SCHEMA IF NOT EXISTS tests;

-- The privileges has_any_column_privilege can see for a role with p_table_privs on a
-- table: the table-level ones that apply to columns, plus any column-level extras.
CREATE FUNCTION tests.column_privs(p_table_privs name [], p_extra name []) RETURNS name []
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(array_agg(p.priv ORDER BY p.priv), '{}')
    FROM (
        SELECT unnest(p_table_privs) AS priv
        INTERSECT
        SELECT unnest('{INSERT,REFERENCES,SELECT,UPDATE}'::name [])
        UNION
        SELECT unnest(p_extra)
    ) AS p;
$$;
