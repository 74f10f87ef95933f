//! PostgreSQL: the marker table's DDL, how its errors read, and its statements, one file per
//! concern (claims in a transaction, leases, the outbox, operators).

mod claim;
mod failed;
mod health;
mod lease;
mod offsets;
mod operators;
mod outbox;
pub(crate) mod partitions;
mod pinned;
mod retention;
mod steps;

use sqlx::{Postgres, SqlStr};

use super::sealed::Dialect;
use super::upgrade::{Added, Addition};
use super::{Backend, Table};

/// `in_failed_sql_transaction`: a statement after one that failed.
const IN_FAILED_TRANSACTION: &str = "25P02";
/// `lock_not_available`: `lock_timeout` ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Whether a lease is over, on the clock of the statement (not of the transaction, which may be
/// a caller's, begun long before).
const LEASE_OVER: &str = "(locked_until IS NULL OR locked_until <= statement_timestamp())";

/// A fencing token from the database's clock: its microseconds since 1970. A key forgotten
/// and claimed again gets a token larger than any it had, as long as the clock moved on.
const CLOCK_TOKEN: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::int8";

/// The session's lock wait as it was before a claim with `wait` bounded it
/// (`idem.lock_timeout`, set by the claim's begin): what the claim's last statement puts back.
const UNBOUND: &str = "set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";

impl Backend for Postgres {}

// `key` and `scope` are not reserved words in PostgreSQL. The partial index serves purges of
// completed markers by age without touching in-flight ones.
const DDL: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {t} (
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
    )",
    "CREATE INDEX IF NOT EXISTS {t}_completed_at ON {t} (completed_at) WHERE state = 'completed'",
    // Schema version 2: the outbox, written in the claim's transaction, read by the relay.
    "CREATE TABLE IF NOT EXISTS {t}_outbox (
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
    )",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_due ON {t}_outbox (next_attempt_at) \
     WHERE sent_at IS NULL AND NOT parked",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_sent_at ON {t}_outbox (sent_at) \
     WHERE sent_at IS NOT NULL",
    // Schema version 3: a key's unsent messages in their order, for the relay's take.
    "CREATE INDEX IF NOT EXISTS {t}_outbox_key ON {t}_outbox (ordering_key, created_at, seq) \
     WHERE sent_at IS NULL",
    // Schema version 3: the messages to relay in the order they were written, which the take
    // walks until it has its keys (instead of sorting every due message each round).
    "CREATE INDEX IF NOT EXISTS {t}_outbox_order ON {t}_outbox (created_at, seq, id) \
     WHERE sent_at IS NULL AND NOT parked",
    // Schema version 3: per-scope retention, the window `purge` keeps each scope's markers.
    "CREATE TABLE IF NOT EXISTS {t}_retention (
        scope text PRIMARY KEY,
        keep_ms bigint NOT NULL CHECK (keep_ms > 0),
        updated_at timestamptz NOT NULL DEFAULT now()
    )",
    // Schema version 3: lease steps, each step's value recorded (fenced by its holder's token)
    // until its marker is forgotten or purged.
    "CREATE TABLE IF NOT EXISTS {t}_steps (
        scope text NOT NULL,
        key text NOT NULL,
        name text NOT NULL,
        seq integer NOT NULL,
        token bigint NOT NULL,
        result json NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (scope, key, name)
    )",
    // Schema version 3: the offset watermarks (the Kafka consumer's offset-watermark mode):
    // per consumer group, topic and partition, the next offset to process.
    "CREATE TABLE IF NOT EXISTS {t}_offsets (
        consumer_group text NOT NULL,
        topic text NOT NULL,
        partition_id integer NOT NULL,
        next_offset bigint NOT NULL,
        token bigint,
        updated_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (consumer_group, topic, partition_id)
    )",
];

/// What a schema version added to a table an earlier version created: each is in the `CREATE
/// TABLE` above as well, and `migrate` adds it where an older table lacks it (`upgrade.rs`).
const ADDED: &[Added] = &[
    // Schema version 3: the error a lease's permanent failure completed its marker with.
    Added::Column {
        table: "{t}",
        name: "error",
        definition: "text",
    },
    // Schema version 3: each outbox message's ordering key (NULL in the rows written before:
    // each of them a key of its own).
    Added::Column {
        table: "{t}_outbox",
        name: "ordering_key",
        definition: "text",
    },
    // Schema version 4: each outbox message's headers, a JSON object (NULL in the rows written
    // before: no headers).
    Added::Column {
        table: "{t}_outbox",
        name: "headers",
        definition: "text",
    },
];

/// PostgreSQL's statements for one marker table.
#[derive(Debug)]
pub struct PgSql {
    table: Table,
    claim: claim::ClaimSql,
    lease: lease::LeaseSql,
    outbox: outbox::OutboxSql,
    offsets: offsets::OffsetSql,
    ops: operators::OperatorSql,
    steps: steps::StepSql,
    failed: failed::FailedSql,
    ddl: Vec<SqlStr>,
    added: Vec<Addition>,
}

impl Dialect for Postgres {
    const BACKEND: &'static str = "postgres";

    type Sql = PgSql;

    fn statements(table: &Table) -> PgSql {
        PgSql {
            table: table.clone(),
            claim: claim::ClaimSql::new(table),
            lease: lease::LeaseSql::new(table),
            outbox: outbox::OutboxSql::new(table),
            offsets: offsets::OffsetSql::new(table),
            ops: operators::OperatorSql::new(table),
            steps: steps::StepSql::new(table),
            failed: failed::FailedSql::new(table),
            ddl: DDL.iter().map(|s| table.fill(s)).collect(),
            added: ADDED.iter().map(|a| a.fill(table, true)).collect(),
        }
    }

    fn table(sql: &PgSql) -> &Table {
        &sql.table
    }

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        database_code(err).as_deref() == Some(LOCK_NOT_AVAILABLE)
    }

    fn is_transient(err: &sqlx::Error) -> bool {
        // serialization_failure (REPEATABLE READ / SERIALIZABLE) and deadlock_detected.
        matches!(database_code(err).as_deref(), Some("40001" | "40P01"))
    }

    fn is_aborted(err: &sqlx::Error) -> bool {
        database_code(err).as_deref() == Some(IN_FAILED_TRANSACTION)
    }
}

fn database_code(err: &sqlx::Error) -> Option<String> {
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sql::{Placeholders, check_binds};

    #[test]
    fn every_statement_has_as_many_placeholders_as_binds() {
        for templates in [
            claim::ClaimSql::templates(),
            lease::LeaseSql::templates(),
            outbox::OutboxSql::templates(),
            offsets::OffsetSql::templates(),
            operators::OperatorSql::templates(),
            steps::StepSql::templates(),
            failed::FailedSql::templates(),
        ] {
            check_binds(&templates, Placeholders::Dollar);
        }
    }
}
