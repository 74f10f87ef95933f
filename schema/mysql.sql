-- idem marker and outbox tables, schema version 6 (MySQL / MariaDB).
--
-- This is what `Store::migrate()` runs (`Store::ddl()` returns the same statements for another
-- table name). Copy it into your own migrations if you manage the schema yourself; a test keeps
-- this file and the code in step. The meaning of every column is in docs/schema.md. Version 2
-- added the outbox table `idem_processed_outbox`, version 3 the tables and columns listed in
-- `schema/mysql.v2-to-v3.sql`, which upgrades a version 2 schema (`schema/mysql.v1-to-v2.sql`
-- a version 1 schema), version 4 the outbox's `headers` (`schema/mysql.v3-to-v4.sql`), version 5
-- the operators' audit log `idem_processed_audit` (`schema/mysql.v4-to-v5.sql`), version 6
-- nothing here (`schema/mysql.v5-to-v6.sql` says why).

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
        error TEXT NULL,
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
        ordering_key VARBINARY(255) NULL,
        headers BLOB NULL,
        PRIMARY KEY (id),
        KEY idem_outbox_due (sent_at, parked, next_attempt_at),
        KEY idem_outbox_sent_at (sent_at),
        KEY idem_outbox_key (ordering_key, sent_at, created_at, seq),
        KEY idem_outbox_order (sent_at, parked, created_at, seq, id)
    ) ENGINE = InnoDB;

-- Schema version 3: per-scope retention, the window `purge` keeps each scope's markers.
CREATE TABLE IF NOT EXISTS idem_processed_retention (
        scope VARBINARY(255) NOT NULL,
        keep_ms BIGINT NOT NULL,
        updated_at DATETIME(6) NOT NULL,
        PRIMARY KEY (scope),
        CHECK (keep_ms > 0)
    ) ENGINE = InnoDB;

-- Schema version 3: lease steps (`Lease::step`), each step's value recorded until its
-- marker is forgotten or purged.

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

-- Schema version 5: the operators' audit log (`idem audit`): one row per `idem` action that
-- changed markers or messages (requeue, forget, outbox requeue): when, who, what, on which
-- key or filter, how many rows.
CREATE TABLE IF NOT EXISTS idem_processed_audit (
        id BIGINT NOT NULL AUTO_INCREMENT,
        acted_at DATETIME(6) NOT NULL,
        actor VARCHAR(255) NOT NULL,
        action VARCHAR(64) NOT NULL,
        target TEXT NOT NULL,
        changed BIGINT NOT NULL,
        PRIMARY KEY (id)
    ) ENGINE = InnoDB;
