-- idem marker table, schema version 1 (MySQL / MariaDB).
--
-- This is what `Store::migrate()` runs (`Store::ddl()` returns the same statements for another
-- table name). Copy it into your own migrations if you manage the schema yourself; a test keeps
-- this file and the code in step. The meaning of every column is in docs/schema.md.

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
