-- idem schema version 1 to 2 (SQLite): adds the outbox table. `Store::migrate()`
-- applies it (every statement is `IF NOT EXISTS`); copy it into your own migrations if you
-- manage the schema yourself.

CREATE TABLE IF NOT EXISTS idem_processed_outbox (
        id TEXT PRIMARY KEY,
        destination TEXT NOT NULL,
        payload BLOB NOT NULL,
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        last_error TEXT,
        parked INTEGER NOT NULL DEFAULT 0,
        sent_at TEXT
    );

CREATE INDEX IF NOT EXISTS idem_processed_outbox_due ON idem_processed_outbox (next_attempt_at) WHERE sent_at IS NULL AND parked = 0;

CREATE INDEX IF NOT EXISTS idem_processed_outbox_sent_at ON idem_processed_outbox (sent_at) WHERE sent_at IS NOT NULL;
