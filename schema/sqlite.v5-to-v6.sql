-- idem schema version 5 to 6 (SQLite). `Store::migrate()` applies it to a version 5 schema
-- (every statement is `IF NOT EXISTS`); copy it into your own migrations if you manage the schema yourself.

-- Schema version 6: the failed markers and the ones in progress, each a few among many
-- completed ones, found without a scan of the table (`idem failed --group-by error`, `idem
-- stuck`, the web console). Partial: a transaction-mode claim adds no entry to either.
CREATE INDEX IF NOT EXISTS idem_processed_failed ON idem_processed (scope, completed_at) WHERE state = 'completed' AND error IS NOT NULL;

CREATE INDEX IF NOT EXISTS idem_processed_in_progress ON idem_processed (scope, key) WHERE state = 'in_progress';
