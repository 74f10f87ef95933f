-- The published schema of version 2 (sqlite), kept as it was: the test of `migrate` upgrades
-- a table made by it and compares it with one the current version makes.

CREATE TABLE IF NOT EXISTS idem_processed (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL DEFAULT 'completed' CHECK (state IN ('in_progress', 'completed')),
        fingerprint BLOB,
        result TEXT,
        locked_until TEXT,
        token INTEGER,
        attempts INTEGER NOT NULL DEFAULT 1,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        completed_at TEXT,
        PRIMARY KEY (scope, key)
    ) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idem_processed_completed_at ON idem_processed (completed_at) WHERE state = 'completed';

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
