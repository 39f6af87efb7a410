-- ql3_ai 0003 on SQLite: validates PostgreSQL's rows against 0002's CHECK
-- (sql/ql3_ai/0003_validate_completion_check.sql, D67). Nothing changed on the edge, so
-- there is nothing to validate; the file keeps the version.

SELECT 1;
