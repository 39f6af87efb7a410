-- core 0004 on SQLite: the receipt clock (sql/core/0004_test_clock.sql).
--
-- Deliberately (almost) empty. On PostgreSQL this version adds ql3._now(), the clock of
-- the invocation receipts that a test can pin. On the edge the database clock is the
-- Python clock of ql3.edge.EdgeStore (its test-only ``clock`` argument pins it), so
-- there is nothing to create; the file keeps version 0004 meaning the same logical
-- schema on both backends.

SELECT 1;
