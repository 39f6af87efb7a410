-- Validates the completions written before 0002 against its CHECK, in a transaction of
-- its own, under a lock that lets completions go on meanwhile (D67). The rule is the one
-- those rows were already held to.

ALTER TABLE ql3_ai.model_invocation_completions VALIDATE CONSTRAINT model_invocation_completions_check;
