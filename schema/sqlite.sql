-- idem marker table, schema version 1 (SQLite).
--
-- This is what `Store::migrate()` runs (`Store::ddl()` returns the same statements for another
-- table name). Copy it into your own migrations if you manage the schema yourself; a test keeps
-- this file and the code in step. The meaning of every column is in docs/schema.md.

CREATE TABLE IF NOT EXISTS idem_processed (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL DEFAULT 'completed' CHECK (state IN ('in_progress', 'completed')),
        fingerprint BLOB,
        result TEXT,
        locked_until TEXT,
        token INTEGER,
        attempts INTEGER NOT NULL DEFAULT 1,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        completed_at TEXT,
        PRIMARY KEY (scope, key)
    ) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idem_processed_completed_at ON idem_processed (completed_at) WHERE state = 'completed';
