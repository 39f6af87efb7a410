-- The daemons' logins, for docker-compose.yml's one-shot `logins` service (after
-- `migrate`, which creates the group roles): the relay logs in as ql3_relay_login, a
-- member of ql3_relay only, and recovery as ql3_recovery_login, a member of ql3_operator
-- only. Neither is a superuser, so a compromised daemon holds its own grants and no more.
--
-- Idempotent: each run creates a login that is missing, sets the password of each (so a
-- changed password takes effect at the next `docker compose up`) and leaves each a member
-- of exactly its group role.
--
-- The passwords come from the environment, never from the command line (where `ps` and
-- `docker inspect` would show them):
--
--   QL3_RELAY_DB_PASSWORD=... QL3_RECOVERY_DB_PASSWORD=... \
--     psql -X -v ON_ERROR_STOP=1 -d ql3 -f deploy/compose/logins.sql
\set ON_ERROR_STOP on
\getenv relay_password QL3_RELAY_DB_PASSWORD
\getenv recovery_password QL3_RECOVERY_DB_PASSWORD

\if :{?relay_password}
\else
DO $$ BEGIN RAISE EXCEPTION 'QL3_RELAY_DB_PASSWORD is not set: the relay login needs a password'; END $$;
\endif
\if :{?recovery_password}
\else
DO $$ BEGIN RAISE EXCEPTION 'QL3_RECOVERY_DB_PASSWORD is not set: the recovery login needs a password'; END $$;
\endif
-- PostgreSQL takes an empty password as none: the login could never authenticate.
SELECT :'relay_password' = '' OR :'recovery_password' = '' AS empty_password \gset
\if :empty_password
DO $$ BEGIN RAISE EXCEPTION 'QL3_RELAY_DB_PASSWORD and QL3_RECOVERY_DB_PASSWORD must not be empty'; END $$;
\endif

BEGIN;

-- \gexec runs each statement the query returns: none when the login exists already.
SELECT format('CREATE ROLE %I', login)
  FROM (VALUES ('ql3_relay_login'), ('ql3_recovery_login')) AS logins (login)
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = login)
\gexec

-- INHERIT: the daemons use their group's grants without SET ROLE.
ALTER ROLE ql3_relay_login WITH LOGIN INHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE
    NOREPLICATION NOBYPASSRLS PASSWORD :'relay_password';
ALTER ROLE ql3_recovery_login WITH LOGIN INHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE
    NOREPLICATION NOBYPASSRLS PASSWORD :'recovery_password';

-- Exactly one group role each: any other membership (granted by hand since) goes.
SELECT format('REVOKE %I FROM %I', grp.rolname, login.rolname)
  FROM pg_catalog.pg_auth_members AS m
  JOIN pg_catalog.pg_roles AS grp ON grp.oid = m.roleid
  JOIN pg_catalog.pg_roles AS login ON login.oid = m.member
 WHERE login.rolname IN ('ql3_relay_login', 'ql3_recovery_login')
   AND (login.rolname, grp.rolname) NOT IN (VALUES ('ql3_relay_login', 'ql3_relay'),
                                                   ('ql3_recovery_login', 'ql3_operator'))
\gexec

GRANT ql3_relay TO ql3_relay_login;
GRANT ql3_operator TO ql3_recovery_login;

COMMIT;
