-- Validates the rows written before 0006 against its CHECK, in a transaction of its own:
-- VALIDATE CONSTRAINT takes a lock that lets admissions and completions go on meanwhile
-- (D67). The rule is the one those rows were already held to.

ALTER TABLE ql3.step_runs VALIDATE CONSTRAINT step_runs_check;
