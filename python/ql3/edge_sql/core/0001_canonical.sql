-- core 0001 on SQLite: canonical JSON, digests and identities (SPEC section 2).
--
-- Deliberately (almost) empty. On PostgreSQL this version installs ql3.jcs, ql3.digest
-- and the identity functions in PL/pgSQL; on the edge those live in Python
-- (ql3.canonical, the byte-for-byte twin held to tests/vectors/*.json), which every
-- procedure of ql3.edge calls. The file exists so that version 0001 means the same
-- logical schema on both backends and the ledgers line up version for version.

SELECT 1;
