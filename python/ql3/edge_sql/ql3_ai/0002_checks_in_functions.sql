-- ql3_ai 0002 on SQLite: the completion table's CHECK as a call of a function, and the
-- lost-step trigger's WHEN cut to its first test (sql/ql3_ai/0002_checks_in_functions.sql,
-- D67).
--
-- Deliberately (almost) empty, as core 0006: PostgreSQL plans a table's CHECK and a
-- trigger's WHEN again for every statement that writes the table, SQLite compiles them
-- into each prepared statement, which the shim keeps. The file keeps version 0002 meaning
-- the same logical schema on both backends.

SELECT 1;
