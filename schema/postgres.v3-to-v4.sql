-- idem schema version 3 to 4 (PostgreSQL). `Store::migrate()` applies it to a version 3 schema
-- (every statement is `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- Message headers: each outbox message's content type, trace context and user headers, as one
-- JSON object (NULL in the rows written before: no headers, published as they were).
ALTER TABLE idem_processed_outbox ADD COLUMN IF NOT EXISTS headers text;
