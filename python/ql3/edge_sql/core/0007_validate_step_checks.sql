-- core 0007 on SQLite: validates PostgreSQL's rows against 0006's CHECK
-- (sql/core/0007_validate_step_checks.sql, D67). Nothing changed on the edge (its 0006 is
-- empty), so there is nothing to validate; the file keeps the version.

SELECT 1;
