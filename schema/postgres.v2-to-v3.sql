-- idem schema version 2 to 3 (PostgreSQL). `Store::migrate()` applies it to a version 2 schema
-- (every statement is `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- Per-scope retention: the window `purge` keeps each scope's markers (`Store::set_retention`,
-- `idem retention set`).
CREATE TABLE IF NOT EXISTS idem_processed_retention (
        scope text PRIMARY KEY,
        keep_ms bigint NOT NULL CHECK (keep_ms > 0),
        updated_at timestamptz NOT NULL DEFAULT now()
    );

-- Lease steps (`Lease::step`): each step's value, recorded (fenced by its holder's token)
-- until its marker is forgotten or purged.
CREATE TABLE IF NOT EXISTS idem_processed_steps (
        scope text NOT NULL,
        key text NOT NULL,
        name text NOT NULL,
        seq integer NOT NULL,
        token bigint NOT NULL,
        result json NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (scope, key, name)
    );

-- Lease error classes: the error a permanent failure completed its marker with (`Lease::permanent`).
ALTER TABLE idem_processed ADD COLUMN IF NOT EXISTS error text;

-- Schema version 3: the offset watermarks of the Kafka consumer's offset-watermark mode
-- (docs/kafka.md): per consumer group, topic and partition, the next offset to process.
CREATE TABLE IF NOT EXISTS idem_processed_offsets (
        consumer_group text NOT NULL,
        topic text NOT NULL,
        partition_id integer NOT NULL,
        next_offset bigint NOT NULL,
        token bigint,
        updated_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (consumer_group, topic, partition_id)
    );

-- The relay's per-key order: each outbox message's ordering key (NULL in the rows written
-- before: each of them a key of its own), a key's unsent messages in their order, and the
-- messages to relay in the order they were written (walked by the take).
ALTER TABLE idem_processed_outbox ADD COLUMN IF NOT EXISTS ordering_key text;
CREATE INDEX IF NOT EXISTS idem_processed_outbox_key ON idem_processed_outbox (ordering_key, created_at, seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_processed_outbox_order ON idem_processed_outbox (created_at, seq, id) WHERE sent_at IS NULL AND NOT parked;
