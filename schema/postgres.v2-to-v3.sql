-- idem schema version 2 to 3 (PostgreSQL). `Store::migrate()` applies it (every statement is
-- `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

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
