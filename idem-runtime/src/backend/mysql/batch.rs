//! Batch claims on MySQL and MariaDB, one message each. MySQL has no `RETURNING` (MariaDB has,
//! from 10.5), so the rows a statement of this transaction wrote are found again by the
//! claim's nonce, which each of them holds as its `token`: no committed marker of another
//! claim can.
//!
//! The messages carry no binds (a multi-statement message cannot), so scope and keys are
//! written as hex literals, which leave nothing to escape.

use sqlx::{AssertSqlSafe, MySql, Row as _};

use super::{LEASE_OVER, bounded};
use crate::backend::{Claimant, Hold, Statements};

type Conn = <MySql as sqlx::Database>::Connection;

/// `value` as a MySQL hex literal (`X'6a6f62'`): its bytes, with nothing to escape.
pub(super) fn hex(value: &str) -> String {
    hex_bytes(value.as_bytes())
}

fn hex_bytes(value: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(3 + 2 * value.len());
    out.push_str("X'");
    for b in value {
        let _ = write!(out, "{b:02x}");
    }
    out.push('\'');
    out
}

fn list(keys: &[&str]) -> String {
    keys.iter()
        .map(|key| hex(key))
        .collect::<Vec<_>>()
        .join(",")
}

/// The keys of `rows`' first column, which is `VARBINARY`.
fn keys_of(rows: &[sqlx::mysql::MySqlRow]) -> Result<Vec<String>, sqlx::Error> {
    rows.iter()
        .map(|row| {
            let key: Vec<u8> = row.try_get(0)?;
            String::from_utf8(key).map_err(|e| sqlx::Error::Decode(Box::new(e)))
        })
        .collect()
}

/// One message: a multi-row `INSERT IGNORE` in sorted key order (so overlapping batches queue
/// instead of deadlocking), then the keys holding this claim's nonce, which only its own,
/// uncommitted rows can. Nothing updates the duplicates: `INSERT IGNORE` left them under a
/// shared lock, and two batches upgrading the same shared lock deadlock.
///
/// `INSERT IGNORE` turns errors into warnings, which is why the single claim avoids it; here
/// every value was validated first (keys and scope are 1 to 255 bytes, the columns' size), so
/// the only error left for it to ignore is the duplicate key. Lock waits and deadlocks are
/// not downgraded.
pub(super) async fn claim(
    conn: &mut Conn,
    st: &Statements,
    c: Claimant<'_>,
    keys: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    let t = st.table.as_str();
    let scope = hex(c.scope);
    let nonce = c.nonce;
    let values: Vec<String> = keys
        .iter()
        .map(|key| {
            format!(
                "({scope},{},{nonce},UTC_TIMESTAMP(6),UTC_TIMESTAMP(6))",
                hex(key)
            )
        })
        .collect();
    let insert = format!(
        "INSERT IGNORE INTO {t} (scope, `key`, token, created_at, completed_at) VALUES {}",
        values.join(",")
    );
    let message = format!(
        "{}; SELECT `key` FROM {t} WHERE scope = {scope} AND `key` IN ({}) AND token = {nonce}",
        bounded(&insert, c.wait).as_str(),
        list(keys)
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(message))
        .fetch_all(&mut *conn)
        .await?;
    keys_of(&rows)
}

/// The state of each marker of `keys` that exists.
pub(super) async fn markers(
    conn: &mut Conn,
    st: &Statements,
    scope: &str,
    keys: &[&str],
) -> Result<Vec<(String, Hold)>, sqlx::Error> {
    let query = format!(
        "SELECT `key`, state, {LEASE_OVER} FROM {} WHERE scope = {} AND `key` IN ({})",
        st.table.as_str(),
        hex(scope),
        list(keys)
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(query))
        .fetch_all(&mut *conn)
        .await?;
    let keys = keys_of(&rows)?;
    keys.into_iter()
        .zip(&rows)
        .map(|(key, row)| {
            let state: String = row.try_get(1)?;
            let over: i64 = row.try_get(2)?;
            Ok((key, Hold::of(&state, over != 0)))
        })
        .collect()
}

/// One message: the free leases among `keys` become this transaction's completed markers,
/// holding its nonce, which then finds them.
pub(super) async fn take_over(
    conn: &mut Conn,
    st: &Statements,
    c: Claimant<'_>,
    keys: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    let t = st.table.as_str();
    let scope = hex(c.scope);
    let nonce = c.nonce;
    let keys = list(keys);
    let update = format!(
        "UPDATE {t} SET state = 'completed', completed_at = UTC_TIMESTAMP(6), \
         locked_until = NULL, token = {nonce}, attempts = attempts + 1, result = NULL \
         WHERE scope = {scope} AND `key` IN ({keys}) AND state = 'in_progress' \
         AND (locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6))"
    );
    let message = format!(
        "{}; SELECT `key` FROM {t} WHERE scope = {scope} AND `key` IN ({keys}) \
         AND token = {nonce}",
        bounded(&update, c.wait).as_str()
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(message))
        .fetch_all(&mut *conn)
        .await?;
    keys_of(&rows)
}

/// The relay's take: the due messages, locked (skipping those another relay has locked),
/// then held for the lease, in one short transaction.
pub(super) async fn outbox_take(
    pool: &sqlx::Pool<MySql>,
    st: &Statements,
    limit: i64,
    lease_ms: i64,
) -> Result<Vec<crate::Message>, sqlx::Error> {
    type Row = (Vec<u8>, Vec<u8>, Vec<u8>, i32, i32);
    let mut tx = pool.begin().await?;
    let rows: Vec<Row> = sqlx::query_as(st.outbox.due.clone())
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
    if !rows.is_empty() {
        let ids: Vec<String> = rows.iter().map(|r| hex_bytes(&r.0)).collect();
        let hold = format!(
            "UPDATE {}_outbox SET next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND \
             WHERE id IN ({})",
            st.table.as_str(),
            lease_ms.saturating_mul(1000),
            ids.join(",")
        );
        sqlx::raw_sql(AssertSqlSafe(hold)).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    let text = |b: Vec<u8>| String::from_utf8(b).map_err(|e| sqlx::Error::Decode(Box::new(e)));
    rows.into_iter()
        .map(|(id, destination, payload, seq, attempts)| {
            Ok(crate::backend::shared::message(
                text(id)?,
                text(destination)?,
                payload,
                seq,
                attempts,
            ))
        })
        .collect()
}
