//! Claims in a transaction on MySQL and MariaDB: an `INSERT` whose answer says whether it
//! met a marker (in a transaction of the claim's own, its insert id; in one that goes on,
//! duplicate-key error 1062), each claim statement's lock wait bounded on MariaDB, and the
//! verified commit, which counts the marker holding the claim's nonce.

use sqlx::{AssertSqlSafe, MySql, Pool, Row as _, SqlSafeStr as _, Transaction};

use super::batch::push_hex;
use super::{ER_DUP_ENTRY, LEASE_OVER, bounded, number, seconds};
use crate::backend::bind::Bound;
use crate::backend::bind::statements;
use crate::backend::claim::{ClaimText, Words};
use crate::backend::{Check, Claimant, Found, Sql};
use crate::options::ClaimOptions;

/// MySQL 8 only (a no-op on MariaDB, which bounds each claim statement instead): puts the
/// session's lock wait back to the server's default after a claim that set it.
const RESTORE_WAIT: &str = "SET @@SESSION.innodb_lock_wait_timeout = IF(/*M! 1 OR */ 0, \
    @@SESSION.innodb_lock_wait_timeout, @@GLOBAL.innodb_lock_wait_timeout)";

/// The claim statements every backend runs (a batch's are written per batch: `batch.rs`).
pub(super) fn text() -> ClaimText {
    // A take-over's token, the claim's nonce, is what the commit finds the marker by.
    ClaimText::of(Words {
        key: "`key`",
        now: "UTC_TIMESTAMP(6)",
        lease_over: "(locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6))",
        lease_over_int: LEASE_OVER,
        result: "CAST(result AS CHAR)",
        json: ":json",
        same_payload: "(fingerprint IS NULL OR fingerprint = COALESCE(:fingerprint, fingerprint))",
        batch: None,
    })
}

statements! {
    /// The claim: an insert whose answer says whether it met a marker.
    pub(super) struct Statements {
        // In a transaction that goes on (a caller's, a group's): a plain INSERT, whose
        // duplicate-key error 1062 locks the marker it met for reading only, as long as the
        // transaction lasts. `INSERT IGNORE` would turn every error into a warning. Times are
        // UTC whatever the session's time zone: `DATETIME` holds no zone, and workers in
        // different zones must agree when a lease runs out.
        claim(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) =
            "INSERT INTO {t} (scope, `key`, fingerprint, token, created_at, completed_at) \
             VALUES (:scope, :key, :fingerprint, :nonce, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))";
        // In a transaction of the claim's own: a duplicate answers in the OK packet, not with
        // an error. On an existing marker the no-op `UPDATE` sets `LAST_INSERT_ID(code)`,
        // which the server returns as the packet's insert id (the table has no
        // AUTO_INCREMENT, so an insert returns 0); the code says what the marker holds
        // ([`plain_duplicate`]), so a plain duplicate takes no statement more. It locks the
        // marker for writing, until the rollback that follows at once. The rows it counts
        // would not tell (1 for a duplicate under sqlx's CLIENT_FOUND_ROWS).
        claim_own(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) =
            "INSERT INTO {t} (scope, `key`, fingerprint, token, created_at, completed_at) \
             VALUES (:scope, :key, :fingerprint, :nonce, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)) \
             ON DUPLICATE KEY UPDATE token = IF(LAST_INSERT_ID(1 \
             | (state = 'completed') << 1 | (error IS NOT NULL) << 2 \
             | (result IS NOT NULL) << 3 | COALESCE(fingerprint <> :fingerprint, 0) << 4), \
             token, token)";
    }
}

/// The bits of the code a claim that met a marker answers with (its `LAST_INSERT_ID`).
const COMPLETED: u64 = 1 << 1;
const FAILED: u64 = 1 << 2;
const RESULT: u64 = 1 << 3;
const OTHER_FINGERPRINT: u64 = 1 << 4;

/// Whether the marker a claim met is, from its code alone, what the claim core's `decide` answers with a
/// plain duplicate: completed, not failed, holding this payload's fingerprint (or either has
/// none), and with no value to replay. Anything else is read whole and decided as ever.
fn plain_duplicate(code: u64, replay: bool) -> bool {
    code & (COMPLETED | FAILED | OTHER_FINGERPRINT) == COMPLETED && (!replay || code & RESULT == 0)
}

/// `statement` with its lock waits bounded by the claim's `wait`, if it has one.
fn within(statement: Bound<MySql>, c: &Claimant<'_>) -> Bound<MySql> {
    match c.wait {
        None => statement,
        Some(_) => {
            let text = bounded(statement.text(), c.wait);
            statement.on(text)
        }
    }
}

/// One text-protocol message. MySQL 8 has no per-statement lock wait, so there `wait` sets the
/// session's for the transaction, and `commit` and `rollback` put it back; MariaDB keeps its
/// session value (the comment turns the assignment into a no-op) and bounds the claim's
/// statements instead.
fn begin_sql(options: &ClaimOptions) -> String {
    let mut begin = String::new();
    if let Some(wait) = options.wait {
        begin.push_str(&format!(
            "SET @@SESSION.innodb_lock_wait_timeout = \
             /*M! @@SESSION.innodb_lock_wait_timeout + 0 * */ {}; ",
            seconds(wait)
        ));
    }
    if let Some(level) = options.isolation {
        // Without SESSION, for the next transaction only.
        begin.push_str(&format!(
            "SET TRANSACTION ISOLATION LEVEL {}; ",
            level.sql()
        ));
    }
    begin.push_str("BEGIN");
    begin
}

/// The probe `UPDATE`'s head, up to the table's name.
const PROBE: &str = "/*M! SET STATEMENT innodb_lock_wait_timeout = 1 FOR */ UPDATE ";

/// A piece of the probe after its head: text as it is, bytes as a hex literal, or an integer.
enum Part<'a> {
    Text(&'a str),
    Hex(&'a [u8]),
    Int(i64),
}

/// The commit's message: the probe of `check`, then `COMMIT` (and with a `wait`, the lock
/// wait put back).
fn commit_message(check: &Check<'_>, wait: bool) -> String {
    use Part::{Hex, Int, Text};
    let mut message = match check {
        Check::Marker(table, c) => probe(
            &[
                Text(table.as_str()),
                Text(" SET token = token WHERE scope = "),
                Hex(c.scope.as_bytes()),
                Text(" AND `key` = "),
                Hex(c.key.as_bytes()),
                Text(" AND token = "),
                Int(c.nonce),
            ],
            wait,
        ),
        Check::Watermark(table, at, nonce) => probe(
            &[
                Text(table.as_str()),
                Text("_offsets SET token = token WHERE consumer_group = "),
                Hex(at.group.as_bytes()),
                Text(" AND topic = "),
                Hex(at.topic.as_bytes()),
                Text(" AND partition_id = "),
                Int(i64::from(at.partition)),
                Text(" AND token = "),
                Int(*nonce),
            ],
            wait,
        ),
        Check::Session => String::from("SELECT CAST(1 /*M! * @@in_transaction */ AS SIGNED)"),
    };
    message.push_str("; COMMIT");
    if wait {
        message.push_str("; ");
        message.push_str(RESTORE_WAIT);
    }
    message
}

/// [`PROBE`] and `parts`, in one buffer sized up front for the whole message (never copied
/// as it grows).
fn probe(parts: &[Part<'_>], wait: bool) -> String {
    let tail = "; COMMIT".len() + if wait { 2 + RESTORE_WAIT.len() } else { 0 };
    // A literal's quotes and prefix, and an `i64`'s longest decimal form.
    let size = |part: &Part<'_>| match part {
        Part::Text(text) => text.len(),
        Part::Hex(bytes) => 3 + 2 * bytes.len(),
        Part::Int(_) => 20,
    };
    let mut message =
        String::with_capacity(PROBE.len() + parts.iter().map(size).sum::<usize>() + tail);
    message.push_str(PROBE);
    for part in parts {
        match part {
            Part::Text(text) => message.push_str(text),
            Part::Hex(bytes) => push_hex(&mut message, bytes),
            Part::Int(n) => push_int(&mut message, *n),
        }
    }
    message
}

/// Appends `n` in decimal: what `write!` does, without the formatter's machinery.
fn push_int(out: &mut String, n: i64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut rest = n.unsigned_abs();
    loop {
        at -= 1;
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    if n < 0 {
        out.push('-');
    }
    out.push_str(std::str::from_utf8(&digits[at..]).expect("decimal digits are ASCII"));
}

/// `Backend::begin`.
pub(super) async fn begin(
    pool: &Pool<MySql>,
    options: &ClaimOptions,
) -> Result<Transaction<'static, MySql>, sqlx::Error> {
    if options.is_default() {
        return pool.begin().await;
    }
    pool.begin_with(AssertSqlSafe(begin_sql(options)).into_sql_str())
        .await
}

/// `Backend::take_over`, its lock wait bounded by the claim's `wait` (MariaDB).
pub(super) async fn take_over(
    conn: &mut sqlx::MySqlConnection,
    sql: &Sql<MySql>,
    c: Claimant<'_>,
) -> Result<bool, sqlx::Error> {
    let take = within(
        sql.claim.take_over(c.scope, c.key, c.fingerprint, c.nonce),
        &c,
    );
    // CLIENT_FOUND_ROWS counts the rows the WHERE matched, each of which this changed.
    Ok(take.execute(conn).await? == 1)
}

/// `Backend::commit`.
pub(super) async fn commit(
    mut tx: Transaction<'_, MySql>,
    check: Check<'_>,
    options: &ClaimOptions,
) -> Result<bool, sqlx::Error> {
    // A deadlock inside the body rolls the whole transaction back, marker included, and
    // later statements run in autocommit; `COMMIT` then succeeds with nothing to commit.
    // What the same message finds first tells the two apart: the marker holding this
    // claim's nonce exists only while its transaction does (or once it committed: an
    // implicit commit by DDL in the body kept marker and effect together, which is what
    // `Applied` says). It is looked up by an `UPDATE` that changes nothing, whose count
    // of matched rows (sqlx asks for found rows) comes back in its OK packet: no result
    // set to decode. In its own transaction the row is locked by this claim already; a
    // lock wait there means the transaction is gone and another delivery holds the key,
    // so MariaDB gives up on it after a second. A transaction of the caller's has no
    // marker of ours: there MariaDB reads `@@in_transaction` and MySQL 8, which lacks it,
    // cannot check. sqlx still counts `tx` as open: dropping it queues a `ROLLBACK`, which
    // the pool's ping on release flushes, and which MySQL runs as a no-op outside a
    // transaction (PostgreSQL would warn, so there a `BEGIN` ends the message).
    // An offset claim's probe is the same `UPDATE`, of the watermark holding its nonce.
    let message = commit_message(&check, options.wait.is_some());
    let message = sqlx::raw_sql(AssertSqlSafe(message));
    if matches!(check, Check::Session) {
        let rows = message.fetch_all(&mut *tx).await?;
        let open: i64 = match rows.first() {
            Some(row) => row.try_get(0)?,
            None => 0,
        };
        return Ok(open == 1);
    }
    match message.execute(&mut *tx).await {
        Ok(done) => Ok(done.rows_affected() == 1),
        Err(e) if <MySql as crate::backend::Backend>::is_lock_timeout(&e) => {
            // The message stopped at the probe: put back what a `wait` changed.
            if options.wait.is_some() {
                sqlx::raw_sql(RESTORE_WAIT).execute(&mut *tx).await?;
            }
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// `Backend::rollback`: with a `wait`, the session's lock wait put back in the same message.
pub(super) async fn rollback(
    mut tx: Transaction<'_, MySql>,
    options: &ClaimOptions,
) -> Result<(), sqlx::Error> {
    if options.wait.is_none() {
        return tx.rollback().await;
    }
    let message = format!("ROLLBACK; {RESTORE_WAIT}; BEGIN");
    sqlx::raw_sql(AssertSqlSafe(message))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// `Backend::discard`.
pub(super) async fn discard(
    tx: Transaction<'_, MySql>,
    options: &ClaimOptions,
) -> Result<(), sqlx::Error> {
    // MySQL 8: a `wait` changed the session's lock timeout, which only the rollback
    // message restores.
    if options.wait.is_some() {
        return rollback(tx, options).await;
    }
    drop(tx);
    Ok(())
}

/// `Backend::claim_or_read`: in a transaction of the claim's own, one statement whose insert
/// id says what it met; in one that goes on, a plain insert and, on 1062, a read.
pub(super) async fn claim_or_read(
    conn: &mut sqlx::MySqlConnection,
    sql: &Sql<MySql>,
    c: Claimant<'_>,
    replay: bool,
    own: bool,
) -> Result<(bool, Option<Found>), sqlx::Error> {
    let fp = c.fingerprint;
    if !own {
        let claim = within(sql.own.claim.claim(c.scope, c.key, fp, c.nonce), &c);
        return match claim.execute(&mut *conn).await {
            Ok(_) => Ok((true, None)),
            Err(e) if number(&e) == Some(ER_DUP_ENTRY) => {
                let found = sql.marker(conn, c.scope, c.key).await?;
                Ok((false, found))
            }
            Err(e) => Err(e),
        };
    }
    let claim = within(sql.own.claim.claim_own(c.scope, c.key, fp, c.nonce), &c);
    match claim.result(&mut *conn).await?.last_insert_id() {
        0 => Ok((true, None)),
        code if plain_duplicate(code, replay) => Ok((false, Some(Found::duplicate()))),
        _ => Ok((false, sql.marker(conn, c.scope, c.key).await?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_written_as_write_writes_them() {
        for n in [
            0,
            1,
            -1,
            9,
            10,
            -10,
            1234567890,
            i64::MAX,
            i64::MIN,
            -4_611_686_018_427_387_904,
        ] {
            let mut out = String::from("x");
            push_int(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }

    #[test]
    fn only_a_completed_marker_with_nothing_to_tell_is_a_plain_duplicate() {
        assert!(plain_duplicate(1 | COMPLETED, false));
        assert!(plain_duplicate(1 | COMPLETED, true));
        assert!(plain_duplicate(1 | COMPLETED | RESULT, false));
        assert!(!plain_duplicate(1 | COMPLETED | RESULT, true));
        assert!(!plain_duplicate(1, false));
        assert!(!plain_duplicate(1 | COMPLETED | FAILED, false));
        assert!(!plain_duplicate(1 | COMPLETED | OTHER_FINGERPRINT, false));
    }
}
