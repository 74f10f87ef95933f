-- idem marker and outbox tables, schema version 6 (SQLite).
--
-- This is what `Store::migrate()` runs (`Store::ddl()` returns the same statements for another
-- table name). Copy it into your own migrations if you manage the schema yourself; a test keeps
-- this file and the code in step. The meaning of every column is in docs/schema.md. Version 2
-- added the outbox table `idem_processed_outbox`, version 3 the tables and columns listed in
-- `schema/sqlite.v2-to-v3.sql`, which upgrades a version 2 schema (`schema/sqlite.v1-to-v2.sql`
-- a version 1 schema), version 4 the outbox's `headers` (`schema/sqlite.v3-to-v4.sql`), version 5
-- the operators' audit log `idem_processed_audit` (`schema/sqlite.v4-to-v5.sql`), version 6
-- the indexes of the failed markers and of those in progress (`schema/sqlite.v5-to-v6.sql`).

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
        error TEXT,
        PRIMARY KEY (scope, key)
    ) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idem_processed_completed_at ON idem_processed (completed_at) WHERE state = 'completed';

CREATE TABLE IF NOT EXISTS idem_processed_outbox (
        id TEXT PRIMARY KEY,
        destination TEXT NOT NULL,
        payload BLOB NOT NULL,
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        last_error TEXT,
        parked INTEGER NOT NULL DEFAULT 0,
        sent_at TEXT,
        ordering_key TEXT,
        headers TEXT
    );

CREATE INDEX IF NOT EXISTS idem_processed_outbox_due ON idem_processed_outbox (next_attempt_at) WHERE sent_at IS NULL AND parked = 0;

CREATE INDEX IF NOT EXISTS idem_processed_outbox_sent_at ON idem_processed_outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Schema version 3: a key's unsent messages in their order, for the relay's take.
CREATE INDEX IF NOT EXISTS idem_processed_outbox_key ON idem_processed_outbox (ordering_key, created_at) WHERE sent_at IS NULL;

-- Schema version 3: the messages to relay in the order they were written, which the take
-- walks until it has its keys (instead of sorting every due message each round).
CREATE INDEX IF NOT EXISTS idem_processed_outbox_order ON idem_processed_outbox (created_at) WHERE sent_at IS NULL AND parked = 0;

-- Schema version 3: per-scope retention, the window `purge` keeps each scope's markers.
CREATE TABLE IF NOT EXISTS idem_processed_retention (
        scope TEXT PRIMARY KEY,
        keep_ms INTEGER NOT NULL CHECK (keep_ms > 0),
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
    ) WITHOUT ROWID;

-- Schema version 3: lease steps (`Lease::step`), each step's value recorded until its
-- marker is forgotten or purged.

CREATE TABLE IF NOT EXISTS idem_processed_steps (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        name TEXT NOT NULL,
        seq INTEGER NOT NULL,
        token INTEGER NOT NULL,
        result TEXT NOT NULL,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        PRIMARY KEY (scope, key, name)
    ) WITHOUT ROWID;

-- Schema version 3: the offset watermarks of the Kafka consumer's offset-watermark mode
-- (docs/kafka.md): per consumer group, topic and partition, the next offset to process.
CREATE TABLE IF NOT EXISTS idem_processed_offsets (
        consumer_group TEXT NOT NULL,
        topic TEXT NOT NULL,
        partition_id INTEGER NOT NULL,
        next_offset INTEGER NOT NULL,
        token INTEGER,
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        PRIMARY KEY (consumer_group, topic, partition_id)
    ) WITHOUT ROWID;

-- Schema version 5: the operators' audit log (`idem audit`): one row per `idem` action that
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

-- Schema version 6: the failed markers and the ones in progress, each a few among many
-- completed ones, found without a scan of the table (`idem failed --group-by error`, `idem
-- stuck`, the web console). Partial: a transaction-mode claim adds no entry to either.
CREATE INDEX IF NOT EXISTS idem_processed_failed ON idem_processed (scope, completed_at) WHERE state = 'completed' AND error IS NOT NULL;

CREATE INDEX IF NOT EXISTS idem_processed_in_progress ON idem_processed (scope, key) WHERE state = 'in_progress';
