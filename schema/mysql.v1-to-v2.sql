-- idem schema version 1 to 2 (MySQL / MariaDB): adds the outbox table. `Store::migrate()`
-- applies it (every statement is `IF NOT EXISTS`); copy it into your own migrations if you
-- manage the schema yourself.

CREATE TABLE IF NOT EXISTS idem_processed_outbox (
        id VARBINARY(255) NOT NULL,
        destination VARBINARY(255) NOT NULL,
        payload LONGBLOB NOT NULL,
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        seq INT NOT NULL,
        created_at DATETIME(6) NOT NULL,
        attempts INT NOT NULL DEFAULT 0,
        next_attempt_at DATETIME(6) NOT NULL,
        last_error TEXT NULL,
        parked BOOLEAN NOT NULL DEFAULT FALSE,
        sent_at DATETIME(6) NULL,
        PRIMARY KEY (id),
        KEY idem_outbox_due (sent_at, parked, next_attempt_at),
        KEY idem_outbox_sent_at (sent_at)
    ) ENGINE = InnoDB;
