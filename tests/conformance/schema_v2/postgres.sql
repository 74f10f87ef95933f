-- The published schema of version 2 (postgres), kept as it was: the test of `migrate` upgrades
-- a table made by it and compares it with one the current version makes.

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
        sent_at timestamptz
    );

CREATE INDEX IF NOT EXISTS idem_processed_outbox_due ON idem_processed_outbox (next_attempt_at) WHERE sent_at IS NULL AND NOT parked;

CREATE INDEX IF NOT EXISTS idem_processed_outbox_sent_at ON idem_processed_outbox (sent_at) WHERE sent_at IS NOT NULL;
