-- idem schema version 2 to 3 (SQLite). `Store::migrate()` applies it (every statement is
-- `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

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
