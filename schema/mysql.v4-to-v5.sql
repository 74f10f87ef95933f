-- idem schema version 4 to 5 (MySQL / MariaDB). `Store::migrate()` applies it to a version 4 schema
-- (every statement is `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- The operators' audit log (`idem audit`): one row per `idem` action that
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
