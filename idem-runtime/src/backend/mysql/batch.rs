//! Batch claims on MySQL and MariaDB, one message each. MySQL has no `RETURNING` (MariaDB has,
//! from 10.5), so the rows a statement of this transaction wrote are found again by the
//! claim's nonce, which each of them holds as its `token`: no committed marker of another
//! claim can.
//!
//! The messages carry no binds (a multi-statement message cannot), so scope and keys are
//! written as hex literals, which leave nothing to escape.

use sqlx::{AssertSqlSafe, MySql, Row as _};

use super::{LEASE_OVER, MySqlSql, bounded};
use crate::backend::{Claimant, Found};

type Conn = <MySql as sqlx::Database>::Connection;

/// `value` as a MySQL hex literal (`X'6a6f62'`): its bytes, with nothing to escape.
pub(super) fn hex(value: &str) -> String {
    hex_bytes(value.as_bytes())
}

pub(super) fn hex_bytes(value: &[u8]) -> String {
    let mut out = String::with_capacity(3 + 2 * value.len());
    push_hex(&mut out, value);
    out
}

/// Appends `value` as a hex literal to `out`. Every claim's commit probe writes its scope and
/// key this way: a table lookup per nibble, where `write!` with `{:02x}` cost a formatter call
/// per byte.
pub(super) fn push_hex(out: &mut String, value: &[u8]) {
    out.reserve(3 + 2 * value.len());
    out.push_str("X'");
    for &b in value {
        let at = 2 * usize::from(b);
        out.push_str(&HEX[at..at + 2]);
    }
    out.push('\'');
}

/// Every byte's two hex digits, at twice its value.
const HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\
    202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f\
    404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f\
    606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f\
    808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f\
    a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf\
    c0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d1d2d3d4d5d6d7d8d9dadbdcdddedf\
    e0e1e2e3e4e5e6e7e8e9eaebecedeeeff0f1f2f3f4f5f6f7f8f9fafbfcfdfeff";

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
    sql: &MySqlSql,
    c: Claimant<'_>,
    keys: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    let t = sql.table.as_str();
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

/// The status of each marker of `keys` that exists.
pub(super) async fn markers(
    conn: &mut Conn,
    sql: &MySqlSql,
    scope: &str,
    keys: &[&str],
) -> Result<Vec<(String, Found)>, sqlx::Error> {
    let query = format!(
        "SELECT `key`, state, {LEASE_OVER} FROM {} WHERE scope = {} AND `key` IN ({})",
        sql.table.as_str(),
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
            Ok((key, Found::of_status(&state, over)))
        })
        .collect()
}

/// One message: the free leases among `keys` become this transaction's completed markers,
/// holding its nonce, which then finds them.
pub(super) async fn take_over(
    conn: &mut Conn,
    sql: &MySqlSql,
    c: Claimant<'_>,
    keys: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    let t = sql.table.as_str();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_literals_spell_every_byte() {
        assert_eq!(hex_bytes(&[0x00, 0x0f, 0xa5, 0xff]), "X'000fa5ff'");
        assert_eq!(hex("job"), "X'6a6f62'");
        assert_eq!(hex(""), "X''");
        let every: Vec<u8> = (0..=255).collect();
        let spelled: String = every.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex_bytes(&every), format!("X'{spelled}'"));
    }
}
