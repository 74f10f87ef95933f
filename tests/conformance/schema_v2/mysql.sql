-- The published schema of version 2 (mysql), kept as it was: the test of `migrate` upgrades
-- a table made by it and compares it with one the current version makes.

CREATE TABLE IF NOT EXISTS idem_processed (
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        state VARCHAR(16) NOT NULL DEFAULT 'completed',
        fingerprint VARBINARY(64) NULL,
        result JSON NULL,
        locked_until DATETIME(6) NULL,
        token BIGINT NULL,
        attempts INT NOT NULL DEFAULT 1,
        created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
        completed_at DATETIME(6) NULL,
        PRIMARY KEY (scope, `key`),
        KEY idem_completed_at (state, completed_at),
        CHECK (state IN ('in_progress', 'completed'))
    ) ENGINE = InnoDB;

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
