//! SQLite: the marker table's DDL, how its errors read, and its statements by concern (claims
//! in a transaction, leases, the outbox, operators), with the places where its protocol is its
//! own. Writers take turns on the database's one write lock, which every claim takes up front
//! (`BEGIN IMMEDIATE`), waiting for it up to the connection's busy timeout; a statement that
//! rolls the whole transaction back ends it, and sqlx's count of open transactions must be
//! brought back in step.

mod claim;
mod lease;
mod operators;
mod outbox;

use sqlx::pool::PoolConnection;
use sqlx::{Pool, SqlSafeStr as _, Sqlite, Transaction};
use sqlx_core::transaction::TransactionManager as _;

use super::Backend;
use super::backend_fns;
use super::sql::Placeholders;
use super::upgrade::Added;

/// `SQLITE_BUSY`: the busy timeout ran out waiting for the write lock.
const SQLITE_BUSY: &str = "5";

/// Whether a lease is over: ISO-8601 text compares in time order.
const LEASE_OVER: &str =
    "(locked_until IS NULL OR locked_until <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))";

/// The time a statement writes, as ISO-8601 UTC text (the markers' format).
const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

/// A fencing token from the database's clock: its microseconds since 1970. SQLite reads its
/// clock to the millisecond, so the last three digits are random: two fresh claims in one
/// millisecond (a completed marker deleted and claimed again) rarely share a token. A key
/// claimed again gets a token larger than any it had, as long as the clock moved on.
const CLOCK_TOKEN: &str = "(CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER) \
    * 1000 + abs(random() % 1000))";

/// The begin of every writer: a deferred transaction that reads first and writes later can
/// deadlock with another one on the lock upgrade; IMMEDIATE takes the write lock up front, and
/// the connection's busy timeout decides how long a second writer waits.
const BEGIN: &str = "BEGIN IMMEDIATE";

super::bind::driver!(
    Sqlite,
    Placeholders::Numbered,
    keys: |keys| serde_json::to_string(keys).expect("strings always serialise"),
    text: |row, i| row.try_get::<String, _>(i),
);

// Text compares with the BINARY collation, so keys differing in case or trailing spaces stay
// distinct. Times are ISO-8601 UTC text, SQLite's own convention.
const DDL: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {t} (
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
    ) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS {t}_completed_at ON {t} (completed_at) WHERE state = 'completed'",
    // Schema version 2: the outbox, written in the claim's transaction, read by the relay.
    "CREATE TABLE IF NOT EXISTS {t}_outbox (
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
    )",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_due ON {t}_outbox (next_attempt_at) \
     WHERE sent_at IS NULL AND parked = 0",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_sent_at ON {t}_outbox (sent_at) \
     WHERE sent_at IS NOT NULL",
    // Schema version 3: a key's unsent messages in their order, for the relay's take.
    "CREATE INDEX IF NOT EXISTS {t}_outbox_key ON {t}_outbox (ordering_key, created_at) \
     WHERE sent_at IS NULL",
    // Schema version 3: the messages to relay in the order they were written, which the take
    // walks until it has its keys (instead of sorting every due message each round).
    "CREATE INDEX IF NOT EXISTS {t}_outbox_order ON {t}_outbox (created_at) \
     WHERE sent_at IS NULL AND parked = 0",
    // Schema version 3: per-scope retention, the window `purge` keeps each scope's markers.
    "CREATE TABLE IF NOT EXISTS {t}_retention (
        scope TEXT PRIMARY KEY,
        keep_ms INTEGER NOT NULL CHECK (keep_ms > 0),
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
    ) WITHOUT ROWID",
    // Schema version 3: lease steps, each step's value recorded (fenced by its holder's token)
    // until its marker is forgotten or purged.
    "CREATE TABLE IF NOT EXISTS {t}_steps (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        name TEXT NOT NULL,
        seq INTEGER NOT NULL,
        token INTEGER NOT NULL,
        result TEXT NOT NULL,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        PRIMARY KEY (scope, key, name)
    ) WITHOUT ROWID",
    // Schema version 3: the offset watermarks (the Kafka consumer's offset-watermark mode):
    // per consumer group, topic and partition, the next offset to process.
    "CREATE TABLE IF NOT EXISTS {t}_offsets (
        consumer_group TEXT NOT NULL,
        topic TEXT NOT NULL,
        partition_id INTEGER NOT NULL,
        next_offset INTEGER NOT NULL,
        token INTEGER,
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        PRIMARY KEY (consumer_group, topic, partition_id)
    ) WITHOUT ROWID",
    // Schema version 5: the operators' audit log, one row per action that changed markers or
    // messages (`idem requeue`, `forget`, `outbox requeue`): when, who, what, on which filter,
    // how many rows. A table of the schema like the others, created by `migrate` (rather than
    // on first use by the tool, which would need DDL rights at an operator's hand and would
    // leave the doctor and the published files unaware of it).
    "CREATE TABLE IF NOT EXISTS {t}_audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        acted_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        changed INTEGER NOT NULL
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
        definition: "TEXT",
    },
    // Schema version 3: each outbox message's ordering key (NULL in the rows written before:
    // each of them a key of its own).
    Added::Column {
        table: "{t}_outbox",
        name: "ordering_key",
        definition: "TEXT",
    },
    // Schema version 4: each outbox message's headers, a JSON object (NULL in the rows written
    // before: no headers).
    Added::Column {
        table: "{t}_outbox",
        name: "headers",
        definition: "TEXT",
    },
];

super::own!(Sqlite);

impl Backend for Sqlite {
    super::wiring!(name: "sqlite", if_not_exists: false);

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        err.as_database_error()
            .and_then(|e| e.code())
            .is_some_and(|c| c == SQLITE_BUSY)
    }

    fn is_transient(_: &sqlx::Error) -> bool {
        // Writers are serialised by the write lock taken at BEGIN IMMEDIATE; a busy timeout
        // running out is the configured limit, not a race to retry.
        false
    }

    fn is_aborted(_: &sqlx::Error) -> bool {
        // A statement that rolls the transaction back ends it: later ones run in autocommit
        // (the commit tells, and the outbox's write checks the marker).
        false
    }

    backend_fns! {
        begin(pool, _, options) => claim::begin_bounded(pool, options);
        commit(tx, _, _) => claim::commit(tx);
        claim_or_read(conn, sql, c, _, _) => claim::claim_or_read(conn, sql, c);
        lease_claim(pool, sql, c, lease_ms) => lease::claim(pool, sql, c, lease_ms);
        outbox_take(pool, sql, limit, lease_ms, sent, sent_hold) => outbox::take(pool, sql, limit, lease_ms, sent, sent_hold);
        // `BEGIN IMMEDIATE`: the migrations of concurrent workers take turns.
        migrate(pool, sql) => {
            async move {
                let mut tx = begin(pool).await?;
                super::upgrade::run(&mut *tx, sql).await?;
                tx.commit().await
            }
        };
        // Statements cost no round trip here: no savepoint rides with the begin.
        begin_primed(pool, _) => async move { Ok((begin(pool).await?, false)) };
        rollback(tx, _) => claim::end(tx);
        // The busy timeout was put back at the begin: nothing to restore.
        discard(tx, _) => claim::end(tx);
        savepoint(conn, step) => claim::savepoint(conn, step);
    }
}

/// A pooled connection whose session may hold what a claim set on it (a busy timeout, a
/// transaction sqlx does not know of): dropped before [`disarm`](Armed::disarm) (a cancelled
/// claim), it is closed rather than handed to the pool's next user.
struct Armed(Option<PoolConnection<Sqlite>>);

impl Armed {
    fn new(conn: PoolConnection<Sqlite>) -> Self {
        Armed(Some(conn))
    }

    fn get(&mut self) -> &mut sqlx::SqliteConnection {
        self.0.as_mut().expect("armed until disarmed")
    }

    fn disarm(mut self) -> PoolConnection<Sqlite> {
        self.0.take().expect("armed until disarmed")
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.0 {
            conn.close_on_drop();
        }
    }
}

/// A pooled connection that sqlx counts as outside any transaction. One counted as inside
/// one is out of step with SQLite (code outside idem dropped a transaction that SQLite had
/// already ended), and sqlx would refuse its `BEGIN IMMEDIATE`: it is closed instead of used.
pub(super) async fn acquire(pool: &Pool<Sqlite>) -> Result<PoolConnection<Sqlite>, sqlx::Error> {
    loop {
        let mut conn = pool.acquire().await?;
        if <Sqlite as sqlx::Database>::TransactionManager::get_transaction_depth(&conn) == 0 {
            return Ok(conn);
        }
        conn.close_on_drop();
    }
}

/// `BEGIN IMMEDIATE` on a connection of `pool` that sqlx counts as outside any transaction.
pub(super) async fn begin(
    pool: &Pool<Sqlite>,
) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
    let conn = acquire(pool).await?;
    Transaction::begin(conn, Some(BEGIN.into_sql_str())).await
}

/// The connection's busy timeout, in milliseconds.
async fn busy_timeout(conn: &mut sqlx::SqliteConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(conn)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sql::check_backend;

    #[test]
    fn every_text_names_only_its_binds() {
        check_backend::<Sqlite>(&Own::texts());
    }
}
