-- requires: core 0004
-- ql3_ai 0002 on SQLite: the receipt functions read the pinnable clock
-- (sql/ql3_ai/0002_test_clock.sql). Deliberately (almost) empty: the edge procedures are
-- Python and already take every timestamp from EdgeStore's clock. The file keeps version
-- 0002 meaning the same logical schema on both backends.

SELECT 1;
