-- idem schema version 2 to 3 (MySQL and MariaDB). `Store::migrate()` applies it (every statement is
-- `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

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
