//! PostgreSQL: the marker table's DDL, how its errors read, and its statements by concern
//! (claims in a transaction, leases, the outbox, operators), with the places where its
//! protocol is its own: a `BEGIN` that bounds the claim's lock wait, the claim that reads the
//! marker it meets in the same statement, the commit verified in the same round trip, the
//! relay's take in one statement, and `LISTEN`/`NOTIFY`.

mod claim;
mod lease;
mod operators;
mod outbox;
pub(crate) mod partitions;
#[cfg(feature = "wal-relay")]
pub(crate) use outbox::wal_prefix;

use sqlx::{Pool, Postgres};

use super::Backend;
use super::backend_fns;
use super::sql::Placeholders;
use super::upgrade::Added;

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

/// A time as ISO-8601 UTC text, as every backend reports times to operators.
const ISO: &str = "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'";

super::bind::driver!(
    Postgres,
    Placeholders::Dollar,
    keys: |keys| keys,
    text: |row, i| row.try_get::<String, _>(i),
);

// `key` and `scope` are not reserved words in PostgreSQL. The partial index serves purges of
// completed markers by age without touching in-flight ones.
pub(super) const DDL: &[&str] = &[
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
    // Schema version 5: the operators' audit log, one row per action that changed markers or
    // messages (`idem requeue`, `forget`, `outbox requeue`): when, who, what, on which filter,
    // how many rows. A table of the schema like the others, created by `migrate` (rather than
    // on first use by the tool, which would need DDL rights at an operator's hand and would
    // leave the doctor and the published files unaware of it).
    "CREATE TABLE IF NOT EXISTS {t}_audit (
        id bigserial PRIMARY KEY,
        acted_at timestamptz NOT NULL DEFAULT now(),
        actor text NOT NULL,
        action text NOT NULL,
        target text NOT NULL,
        changed bigint NOT NULL
    )",
    // Schema version 6: the failed markers and the ones in progress, each a few among many
    // completed ones, found without a scan of the table (the operators' failure groups and
    // stuck leases, the console's pages). Partial: a transaction-mode claim, which writes a
    // completed marker without an error, adds no entry to either.
    "CREATE INDEX IF NOT EXISTS {t}_failed ON {t} (scope, completed_at) \
     WHERE state = 'completed' AND error IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS {t}_in_progress ON {t} (scope, key) WHERE state = 'in_progress'",
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

super::own!(
    Postgres,
    /// All of a claim's outbox messages in one statement (`outbox::write`).
    write: crate::backend::sql::Template = outbox::write_template,
);

impl Backend for Postgres {
    super::wiring!(name: "postgres", if_not_exists: true);

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

    fn port(pool: &Pool<Self>) -> Option<u16> {
        Some(pool.connect_options().get_port())
    }

    backend_fns! {
        begin(pool, _, options) => claim::begin(pool, options);
        // Whoever committed knows whether it wrote outbox messages (a claim's hold, a group's
        // generation) and wakes the relays itself: the commit reads nothing more. Its future
        // is the commit's own (a layer awaiting it would copy it once more per call).
        commit(tx, _, _) => claim::commit_checked(tx);
        claim_or_read(conn, sql, c, replay, _) => sql.own.claim.claim_or_read_in(conn, c, replay);
        lease_claim(pool, sql, c, lease_ms) => lease::claim(pool, sql, c, lease_ms);
        outbox_take(pool, sql, limit, lease_ms, sent, sent_hold) => outbox::take(pool, sql, limit, lease_ms, sent, sent_hold);
        migrate(pool, sql) => operators::migrate(pool, sql);
        savepoint(conn, step) => claim::savepoint(conn, step);
        take_over(conn, sql, c) => sql.own.claim.take_over_in(conn, sql, c);
        batch_claimed(conn, sql, options) => sql.own.claim.unbound(conn, options);
        // No statement runs after a failed one in a PostgreSQL transaction: the write needs no
        // fence.
        outbox_write(conn, sql, outbox, _) => outbox::write(conn, sql, outbox);
        listen(pool, sql) => outbox::listen(pool, sql);
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
    use crate::backend::Table;
    use crate::backend::sql::check_backend;

    #[test]
    fn every_text_names_only_its_binds() {
        // The outbox's write binds its arrays by hand, in the order its text numbers them.
        let write = outbox::write_template(&Table::new("jobs").unwrap());
        assert!(write.order.iter().copied().eq(0..8));
        check_backend::<Postgres>(&Own::texts());
    }
}
