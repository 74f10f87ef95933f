-- idem schema version 3 to 4 (SQLite). `Store::migrate()` applies it to a version 3 schema
-- (it asks the catalog before the `ALTER TABLE`, which SQLite cannot write `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- Message headers: each outbox message's content type, trace context and user headers, as one
-- JSON object (NULL in the rows written before: no headers, published as they were).
ALTER TABLE idem_processed_outbox ADD COLUMN headers TEXT;
