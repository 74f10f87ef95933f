-- idem schema version 2 to 3 (SQLite). `Store::migrate()` applies it to a version 2 schema
-- (it asks the catalog before each `ALTER TABLE`, which SQLite cannot write `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- Per-scope retention: the window `purge` keeps each scope's markers (`Store::set_retention`,
-- `idem retention set`).
CREATE TABLE IF NOT EXISTS idem_processed_retention (
        scope TEXT PRIMARY KEY,
        keep_ms INTEGER NOT NULL CHECK (keep_ms > 0),
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
    ) WITHOUT ROWID;

-- Lease steps (`Lease::step`): each step's value, recorded (fenced by its holder's token)
-- until its marker is forgotten or purged.
CREATE TABLE IF NOT EXISTS idem_processed_steps (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        name TEXT NOT NULL,
        seq INTEGER NOT NULL,
        token INTEGER NOT NULL,
        result TEXT NOT NULL,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        PRIMARY KEY (scope, key, name)
    ) WITHOUT ROWID;

-- Lease error classes: the error a permanent failure completed its marker with (`Lease::permanent`).
ALTER TABLE idem_processed ADD COLUMN error TEXT;

-- Schema version 3: the offset watermarks of the Kafka consumer's offset-watermark mode
-- (docs/kafka.md): per consumer group, topic and partition, the next offset to process.
CREATE TABLE IF NOT EXISTS idem_processed_offsets (
        consumer_group TEXT NOT NULL,
        topic TEXT NOT NULL,
        partition_id INTEGER NOT NULL,
        next_offset INTEGER NOT NULL,
        token INTEGER,
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        PRIMARY KEY (consumer_group, topic, partition_id)
    ) WITHOUT ROWID;

-- The relay's per-key order: each outbox message's ordering key (NULL in the rows written
-- before: each of them a key of its own), a key's unsent messages in their order, and the
-- messages to relay in the order they were written (walked by the take).
ALTER TABLE idem_processed_outbox ADD COLUMN ordering_key TEXT;
CREATE INDEX IF NOT EXISTS idem_processed_outbox_key ON idem_processed_outbox (ordering_key, created_at) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_processed_outbox_order ON idem_processed_outbox (created_at) WHERE sent_at IS NULL AND parked = 0;
