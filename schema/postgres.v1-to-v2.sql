-- idem schema version 1 to 2 (PostgreSQL): adds the outbox table. `Store::migrate()`
-- applies it (every statement is `IF NOT EXISTS`); copy it into your own migrations if you
-- manage the schema yourself.

CREATE TABLE IF NOT EXISTS idem_processed_outbox (
        id text PRIMARY KEY,
        destination text NOT NULL,
        payload bytea NOT NULL,
        scope text NOT NULL,
        key text NOT NULL,
        seq integer NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        attempts integer NOT NULL DEFAULT 0,
        next_attempt_at timestamptz NOT NULL DEFAULT now(),
        last_error text,
        parked boolean NOT NULL DEFAULT false,
        sent_at timestamptz
    );

CREATE INDEX IF NOT EXISTS idem_processed_outbox_due ON idem_processed_outbox (next_attempt_at) WHERE sent_at IS NULL AND NOT parked;

CREATE INDEX IF NOT EXISTS idem_processed_outbox_sent_at ON idem_processed_outbox (sent_at) WHERE sent_at IS NOT NULL;
