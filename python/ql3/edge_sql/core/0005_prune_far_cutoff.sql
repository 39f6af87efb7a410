-- core 0005 on SQLite: ql3.prune_outbox with a retention longer than recorded time
-- (sql/core/0005_prune_far_cutoff.sql, D65).
--
-- Deliberately (almost) empty. On PostgreSQL this version makes a cut-off before the first
-- representable instant remove nothing instead of failing with 22008. On the edge the
-- prune is Python (ql3.edge.contracts.prune_outbox), which answers 0 for a cut-off before
-- year 1; the file keeps version 0005 meaning the same logical schema on both backends.

SELECT 1;
