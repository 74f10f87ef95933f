-- idem schema version 2 to 3 (SQLite). `Store::migrate()` applies it to a version 2 schema
-- (it asks the catalog before each `ALTER TABLE`, which SQLite cannot write `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- Per-scope retention: the window `purge` keeps each scope's markers (`Store::set_retention`,
-- `idem retention set`).
CREATE TABLE IF NOT EXISTS idem_processed_retention (
        scope TEXT PRIMARY KEY,
        keep_ms INTEGER NOT NULL CHECK (keep_ms > 0),
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
    ) WITHOUT ROWID;
