-- idem marker and outbox tables, schema version 6 (PostgreSQL).
--
-- This is what `Store::migrate()` runs (`Store::ddl()` returns the same statements for another
-- table name). Copy it into your own migrations if you manage the schema yourself; a test keeps
-- this file and the code in step. The meaning of every column is in docs/schema.md. Version 2
-- added the outbox table `idem_processed_outbox`, version 3 the tables and columns listed in
-- `schema/postgres.v2-to-v3.sql`, which upgrades a version 2 schema (`schema/postgres.v1-to-v2.sql`
-- a version 1 schema), version 4 the outbox's `headers` (`schema/postgres.v3-to-v4.sql`), version 5
-- the operators' audit log `idem_processed_audit` (`schema/postgres.v4-to-v5.sql`), version 6
-- the indexes of the failed markers and of those in progress (`schema/postgres.v5-to-v6.sql`).

CREATE TABLE IF NOT EXISTS idem_processed (
        scope text NOT NULL,
        key text NOT NULL,
        state text NOT NULL DEFAULT 'completed' CHECK (state IN ('in_progress', 'completed')),
        fingerprint bytea,
        result json,
        locked_until timestamptz,
        token bigint,
        attempts integer NOT NULL DEFAULT 1,
        created_at timestamptz NOT NULL DEFAULT now(),
        completed_at timestamptz,
        error text,
        PRIMARY KEY (scope, key)
    );

CREATE INDEX IF NOT EXISTS idem_processed_completed_at ON idem_processed (completed_at) WHERE state = 'completed';

CREATE TABLE IF NOT EXISTS idem_processed_outbox (
        id text PRIMARY KEY,
        destination text NOT NULL,
        payload bytea NOT NULL,
        scope text NOT NULL,
        key text NOT NULL,
        seq integer NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        attempts integer NOT NULL DEFAULT 0,
        next_attempt_at timestamptz NOT NULL DEFAULT now(),
        last_error text,
        parked boolean NOT NULL DEFAULT false,
        sent_at timestamptz,
        ordering_key text,
        headers text
    );

CREATE INDEX IF NOT EXISTS idem_processed_outbox_due ON idem_processed_outbox (next_attempt_at) WHERE sent_at IS NULL AND NOT parked;

CREATE INDEX IF NOT EXISTS idem_processed_outbox_sent_at ON idem_processed_outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Schema version 3: a key's unsent messages in their order, for the relay's take.
CREATE INDEX IF NOT EXISTS idem_processed_outbox_key ON idem_processed_outbox (ordering_key, created_at, seq) WHERE sent_at IS NULL;

-- Schema version 3: the messages to relay in the order they were written, which the take
-- walks until it has its keys (instead of sorting every due message each round).
CREATE INDEX IF NOT EXISTS idem_processed_outbox_order ON idem_processed_outbox (created_at, seq, id) WHERE sent_at IS NULL AND NOT parked;

-- Schema version 3: per-scope retention, the window `purge` keeps each scope's markers.
CREATE TABLE IF NOT EXISTS idem_processed_retention (
        scope text PRIMARY KEY,
        keep_ms bigint NOT NULL CHECK (keep_ms > 0),
        updated_at timestamptz NOT NULL DEFAULT now()
    );

-- Schema version 3: lease steps (`Lease::step`), each step's value recorded until its
-- marker is forgotten or purged.

CREATE TABLE IF NOT EXISTS idem_processed_steps (
        scope text NOT NULL,
        key text NOT NULL,
        name text NOT NULL,
        seq integer NOT NULL,
        token bigint NOT NULL,
        result json NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (scope, key, name)
    );

-- Schema version 3: the offset watermarks of the Kafka consumer's offset-watermark mode
-- (docs/kafka.md): per consumer group, topic and partition, the next offset to process.
CREATE TABLE IF NOT EXISTS idem_processed_offsets (
        consumer_group text NOT NULL,
        topic text NOT NULL,
        partition_id integer NOT NULL,
        next_offset bigint NOT NULL,
        token bigint,
        updated_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (consumer_group, topic, partition_id)
    );

-- Schema version 5: the operators' audit log (`idem audit`): one row per `idem` action that
-- changed markers or messages (requeue, forget, outbox requeue): when, who, what, on which
-- key or filter, how many rows.
CREATE TABLE IF NOT EXISTS idem_processed_audit (
        id bigserial PRIMARY KEY,
        acted_at timestamptz NOT NULL DEFAULT now(),
        actor text NOT NULL,
        action text NOT NULL,
        target text NOT NULL,
        changed bigint NOT NULL
    );

-- Schema version 6: the failed markers and the ones in progress, each a few among many
-- completed ones, found without a scan of the table (`idem failed --group-by error`, `idem
-- stuck`, the web console). Partial: a transaction-mode claim adds no entry to either.
CREATE INDEX IF NOT EXISTS idem_processed_failed ON idem_processed (scope, completed_at) WHERE state = 'completed' AND error IS NOT NULL;

CREATE INDEX IF NOT EXISTS idem_processed_in_progress ON idem_processed (scope, key) WHERE state = 'in_progress';
