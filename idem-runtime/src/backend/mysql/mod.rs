//! MySQL and MariaDB: one code path serves both servers. Where they differ, the statement
//! text carries both, in MariaDB's executable comments (`/*M! .. */`, run by MariaDB only).
//! The statements by concern (claims in a transaction, leases, the outbox, operators), with
//! the places where the protocol is its own: no array to bind and no `RETURNING` (a batch's
//! keys are written into one multi-statement message), a claim whose insert id says what it
//! met, the commit verified by a probe in the same message, a lock wait bounded per statement
//! (MariaDB) or per transaction (MySQL 8), and migrations whose DDL commits on its own.

mod batch;
mod claim;
mod lease;
mod operators;
mod outbox;

use std::time::Duration;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, MySql, SqlSafeStr as _, SqlStr};

use super::Backend;
use super::backend_fns;
use super::sql::Placeholders;
use super::upgrade::Added;

const ER_DUP_ENTRY: u16 = 1062;
const ER_LOCK_DEADLOCK: u16 = 1213;
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// The largest `innodb_lock_wait_timeout` MariaDB accepts (MySQL accepts more).
const MAX_LOCK_WAIT_SECONDS: u64 = 100_000_000;

/// Whether a lease is over, on the server's clock.
const LEASE_OVER: &str = "CAST(locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6) AS SIGNED)";

/// A fencing token from the server's clock: its microseconds since 1970 (UTC, whatever the
/// session's time zone). A key forgotten and claimed again gets a token larger than any it
/// had, as long as the clock moved on.
const CLOCK_TOKEN: &str =
    "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS SIGNED)";

// Keys and ids are byte strings (`VARBINARY`), which sqlx reads as bytes: text is read as
// bytes and checked to be UTF-8, as idem wrote it. A list of keys has no array to bind as:
// the statements that take one are written per call (`batch.rs`), and JSON is what the
// binding would be.
super::bind::driver!(
    MySql,
    Placeholders::Question,
    keys: |keys| serde_json::to_string(keys).expect("strings always serialise"),
    text: |row, i| row
        .try_get::<Vec<u8>, _>(i)
        .and_then(|b| String::from_utf8(b).map_err(|e| sqlx::Error::Decode(Box::new(e)))),
);

// `key` is a reserved word in MySQL. `scope` and `key` are byte strings (the `binary`
// collation), compared byte for byte: keys that differ in case or in trailing spaces stay
// distinct. `utf8mb4_bin` would not do: it is a PAD SPACE collation in MariaDB and MySQL 5.7,
// so `x` and `x ` collide on the primary key. 255 bytes is `MAX_KEY_LEN`; the bytes are the
// UTF-8 that sqlx sends. Index names are per table in MySQL, so the index needs no table
// prefix (which made a 63-character table name exceed the 64-character identifier limit).
const DDL: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {t} (
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        state VARCHAR(16) NOT NULL DEFAULT 'completed',
        fingerprint VARBINARY(64) NULL,
        result JSON NULL,
        locked_until DATETIME(6) NULL,
        token BIGINT NULL,
        attempts INT NOT NULL DEFAULT 1,
        created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
        completed_at DATETIME(6) NULL,
        error TEXT NULL,
        PRIMARY KEY (scope, `key`),
        KEY idem_completed_at (state, completed_at),
        CHECK (state IN ('in_progress', 'completed'))
    ) ENGINE = InnoDB",
    // Schema version 2: the outbox, written in the claim's transaction, read by the relay.
    // Times are UTC, written by the statements (as the markers' are).
    "CREATE TABLE IF NOT EXISTS {t}_outbox (
        id VARBINARY(255) NOT NULL,
        destination VARBINARY(255) NOT NULL,
        payload LONGBLOB NOT NULL,
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        seq INT NOT NULL,
        created_at DATETIME(6) NOT NULL,
        attempts INT NOT NULL DEFAULT 0,
        next_attempt_at DATETIME(6) NOT NULL,
        last_error TEXT NULL,
        parked BOOLEAN NOT NULL DEFAULT FALSE,
        sent_at DATETIME(6) NULL,
        ordering_key VARBINARY(255) NULL,
        headers BLOB NULL,
        PRIMARY KEY (id),
        KEY idem_outbox_due (sent_at, parked, next_attempt_at),
        KEY idem_outbox_sent_at (sent_at),
        KEY idem_outbox_key (ordering_key, sent_at, created_at, seq),
        KEY idem_outbox_order (sent_at, parked, created_at, seq, id)
    ) ENGINE = InnoDB",
    // Schema version 3: per-scope retention, the window `purge` keeps each scope's markers.
    "CREATE TABLE IF NOT EXISTS {t}_retention (
        scope VARBINARY(255) NOT NULL,
        keep_ms BIGINT NOT NULL,
        updated_at DATETIME(6) NOT NULL,
        PRIMARY KEY (scope),
        CHECK (keep_ms > 0)
    ) ENGINE = InnoDB",
    // Schema version 3: lease steps, each step's value recorded (fenced by its holder's token)
    // until its marker is forgotten or purged.
    "CREATE TABLE IF NOT EXISTS {t}_steps (
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        name VARBINARY(255) NOT NULL,
        seq INT NOT NULL,
        token BIGINT NOT NULL,
        result JSON NOT NULL,
        created_at DATETIME(6) NOT NULL,
        PRIMARY KEY (scope, `key`, name)
    ) ENGINE = InnoDB",
    // Schema version 3: the offset watermarks (the Kafka consumer's offset-watermark mode):
    // per consumer group, topic and partition, the next offset to process. Group and topic
    // are byte strings, compared byte for byte, as the markers' scope and key.
    "CREATE TABLE IF NOT EXISTS {t}_offsets (
        consumer_group VARBINARY(255) NOT NULL,
        topic VARBINARY(255) NOT NULL,
        partition_id INT NOT NULL,
        next_offset BIGINT NOT NULL,
        token BIGINT NULL,
        updated_at DATETIME(6) NOT NULL,
        PRIMARY KEY (consumer_group, topic, partition_id)
    ) ENGINE = InnoDB",
    // Schema version 5: the operators' audit log, one row per action that changed markers or
    // messages (`idem requeue`, `forget`, `outbox requeue`): when, who, what, on which filter,
    // how many rows. A table of the schema like the others, created by `migrate` (rather than
    // on first use by the tool, which would need DDL rights at an operator's hand and would
    // leave the doctor and the published files unaware of it).
    // Its times are UTC, written by the statement (as the markers' are).
    "CREATE TABLE IF NOT EXISTS {t}_audit (
        id BIGINT NOT NULL AUTO_INCREMENT,
        acted_at DATETIME(6) NOT NULL,
        actor VARCHAR(255) NOT NULL,
        action VARCHAR(64) NOT NULL,
        target TEXT NOT NULL,
        changed BIGINT NOT NULL,
        PRIMARY KEY (id)
    ) ENGINE = InnoDB",
];

/// What a schema version added to a table an earlier version created: each is in the `CREATE
/// TABLE` above as well, and `migrate` adds it where an older table lacks it (`upgrade.rs`).
const ADDED: &[Added] = &[
    // Schema version 3: the error a lease's permanent failure completed its marker with.
    Added::Column {
        table: "{t}",
        name: "error",
        definition: "TEXT NULL",
    },
    // Schema version 3: each outbox message's ordering key (NULL in the rows written before:
    // each of them a key of its own), and a key's unsent messages in their order.
    Added::Column {
        table: "{t}_outbox",
        name: "ordering_key",
        definition: "VARBINARY(255) NULL",
    },
    Added::Index {
        table: "{t}_outbox",
        name: "idem_outbox_key",
        definition: "(ordering_key, sent_at, created_at, seq)",
    },
    // Schema version 3: the messages to relay in the order they were written, which the
    // take walks until it has its keys.
    Added::Index {
        table: "{t}_outbox",
        name: "idem_outbox_order",
        definition: "(sent_at, parked, created_at, seq, id)",
    },
    // Schema version 4: each outbox message's headers, a JSON object in UTF-8 (NULL in the
    // rows written before: no headers). Bytes, as the ids are, so that no table or server
    // character set can change them.
    Added::Column {
        table: "{t}_outbox",
        name: "headers",
        definition: "BLOB NULL",
    },
];

super::own!(MySql);

impl Backend for MySql {
    super::wiring!(name: "mysql", if_not_exists: false);

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        number(err) == Some(ER_LOCK_WAIT_TIMEOUT)
    }

    fn is_transient(err: &sqlx::Error) -> bool {
        // InnoDB may pick a waiter as deadlock victim when the first claimer rolls back.
        number(err) == Some(ER_LOCK_DEADLOCK)
    }

    fn is_aborted(_: &sqlx::Error) -> bool {
        // A deadlock ends the transaction and later statements run in autocommit; nothing
        // fails for it (the commit's probe tells).
        false
    }

    backend_fns! {
        begin(pool, _, options) => claim::begin(pool, options);
        commit(tx, check, options) => claim::commit(tx, check, options);
        claim_or_read(conn, sql, c, replay, own) => claim::claim_or_read(conn, sql, c, replay, own);
        lease_claim(pool, sql, c, lease_ms) => lease::claim(pool, sql, c, lease_ms);
        outbox_take(pool, sql, limit, lease_ms, sent, sent_hold) => outbox::take(pool, sql, limit, lease_ms, sent, sent_hold);
        migrate(pool, sql) => operators::migrate(pool, sql);
        rollback(tx, options) => claim::rollback(tx, options);
        discard(tx, options) => claim::discard(tx, options);
        take_over(conn, sql, c) => claim::take_over(conn, sql, c);
        claim_batch(conn, sql, c, keys) => batch::claim(conn, sql, c, keys);
        take_over_batch(conn, sql, c, keys) => batch::take_over(conn, sql, c, keys);
        batch_markers(conn, sql, scope, keys) => batch::markers(conn, sql, scope, keys);
        unclaim(conn, sql, c, inserted, taken) => batch::unclaim(conn, sql, c, inserted, taken);
        outbox_sent(pool, sql, ids, hold) => outbox::sent(pool, sql, ids, hold);
        outbox_release(pool, sql, ids, hold) => outbox::release(pool, sql, ids, hold);
    }
}

fn number(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// `statement` with its lock waits bounded by `wait`: on MariaDB by `SET STATEMENT .. FOR`,
/// which lasts for this statement only, so nothing is left on the pooled connection whatever
/// happens next (a cancelled future, a panic, a failed claim). MySQL ignores the comment and
/// runs under the session value `begin` set (a lease claim: the session's own).
fn bounded(statement: &str, wait: Option<Duration>) -> SqlStr {
    match wait {
        None => AssertSqlSafe(statement.to_owned()).into_sql_str(),
        Some(wait) => AssertSqlSafe(format!(
            "/*M!100300 SET STATEMENT innodb_lock_wait_timeout = {} FOR */ {statement}",
            seconds(wait)
        ))
        .into_sql_str(),
    }
}

fn seconds(wait: Duration) -> u64 {
    super::whole_seconds(wait).min(MAX_LOCK_WAIT_SECONDS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sql::check_backend;

    #[test]
    fn every_text_names_only_its_binds() {
        check_backend::<MySql>(&Own::texts());
    }
}
