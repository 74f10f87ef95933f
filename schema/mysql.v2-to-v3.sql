-- idem schema version 2 to 3 (MySQL / MariaDB). `Store::migrate()` applies it to a version 2 schema
-- (it asks the catalog before each `ALTER TABLE` and `CREATE INDEX`, which MySQL 8 cannot write `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- Per-scope retention: the window `purge` keeps each scope's markers (`Store::set_retention`,
-- `idem retention set`).
CREATE TABLE IF NOT EXISTS idem_processed_retention (
        scope VARBINARY(255) NOT NULL,
        keep_ms BIGINT NOT NULL,
        updated_at DATETIME(6) NOT NULL,
        PRIMARY KEY (scope),
        CHECK (keep_ms > 0)
    ) ENGINE = InnoDB;

-- Lease steps (`Lease::step`): each step's value, recorded (fenced by its holder's token)
-- until its marker is forgotten or purged.
CREATE TABLE IF NOT EXISTS idem_processed_steps (
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        name VARBINARY(255) NOT NULL,
        seq INT NOT NULL,
        token BIGINT NOT NULL,
        result JSON NOT NULL,
        created_at DATETIME(6) NOT NULL,
        PRIMARY KEY (scope, `key`, name)
    ) ENGINE = InnoDB;

-- Lease error classes: the error a permanent failure completed its marker with (`Lease::permanent`).
ALTER TABLE idem_processed ADD COLUMN error TEXT NULL;

-- Schema version 3: the offset watermarks of the Kafka consumer's offset-watermark mode
-- (docs/kafka.md): per consumer group, topic and partition, the next offset to process.
CREATE TABLE IF NOT EXISTS idem_processed_offsets (
        consumer_group VARBINARY(255) NOT NULL,
        topic VARBINARY(255) NOT NULL,
        partition_id INT NOT NULL,
        next_offset BIGINT NOT NULL,
        token BIGINT NULL,
        updated_at DATETIME(6) NOT NULL,
        PRIMARY KEY (consumer_group, topic, partition_id)
    ) ENGINE = InnoDB;

-- The relay's per-key order: each outbox message's ordering key (NULL in the rows written
-- before: each of them a key of its own), a key's unsent messages in their order, and the
-- messages to relay in the order they were written (walked by the take).
ALTER TABLE idem_processed_outbox ADD COLUMN ordering_key VARBINARY(255) NULL;
CREATE INDEX idem_outbox_key ON idem_processed_outbox (ordering_key, sent_at, created_at, seq);
CREATE INDEX idem_outbox_order ON idem_processed_outbox (sent_at, parked, created_at, seq, id);
