-- core 0006 on SQLite: the step table's CHECK and its state machine's WHEN clause as calls
-- of two functions (sql/core/0006_step_checks_in_functions.sql, D67).
--
-- Deliberately (almost) empty. On PostgreSQL this version moves the same rules into
-- functions because PostgreSQL plans a table's CHECK and a trigger's WHEN again for every
-- statement that writes the table. SQLite compiles them into each prepared statement,
-- which the shim keeps, so its 0003 rules stay as they are; the file keeps version 0006
-- meaning the same logical schema on both backends.

SELECT 1;
