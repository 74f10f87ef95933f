-- idem schema version 4 to 5 (PostgreSQL). `Store::migrate()` applies it to a version 4 schema
-- (every statement is `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- The operators' audit log (`idem audit`): one row per `idem` action that
-- changed markers or messages (requeue, forget, outbox requeue): when, who, what, on which
-- key or filter, how many rows.
CREATE TABLE IF NOT EXISTS idem_processed_audit (
        id bigserial PRIMARY KEY,
        acted_at timestamptz NOT NULL DEFAULT now(),
        actor text NOT NULL,
        action text NOT NULL,
        target text NOT NULL,
        changed bigint NOT NULL
    );
