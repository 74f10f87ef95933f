-- idem schema version 4 to 5 (SQLite). `Store::migrate()` applies it to a version 4 schema
-- (every statement is `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- The operators' audit log (`idem audit`): one row per `idem` action that
-- changed markers or messages (requeue, forget, outbox requeue): when, who, what, on which
-- key or filter, how many rows.
CREATE TABLE IF NOT EXISTS idem_processed_audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        acted_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        changed INTEGER NOT NULL
    );
