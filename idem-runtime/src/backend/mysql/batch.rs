//! Batch claims on MySQL and MariaDB, one message each. MySQL has no `RETURNING` (MariaDB has,
//! from 10.5), so the rows a statement of this transaction wrote are found again by the
//! claim's nonce, which each of them holds as its `token`: no committed marker of another
//! claim can.
//!
//! The messages carry no binds (a multi-statement message cannot), so scope and keys are
//! written as hex literals, which leave nothing to escape.

use sqlx::{AssertSqlSafe, MySql, Row as _};

use super::{LEASE_OVER, bounded};
use crate::backend::{Claimant, Found, Sql};

type Conn = sqlx::MySqlConnection;

/// `value` as a MySQL hex literal (`X'6a6f62'`): its bytes, with nothing to escape.
pub(super) fn hex(value: &str) -> String {
    hex_bytes(value.as_bytes())
}

pub(super) fn hex_bytes(value: &[u8]) -> String {
    let mut out = String::with_capacity(3 + 2 * value.len());
    push_hex(&mut out, value);
    out
}

/// Appends `value` as a hex literal to `out` (every claim's commit probe writes its scope and
/// key this way), by table lookup rather than a formatter call per byte.
pub(super) fn push_hex(out: &mut String, value: &[u8]) {
    out.reserve(3 + 2 * value.len());
    out.push_str("X'");
    // Up to 64 bytes' digits at a time, into a buffer checked once rather than per byte.
    for chunk in value.chunks(64) {
        let mut digits = [0; 128];
        for (pair, &b) in digits.chunks_exact_mut(2).zip(chunk) {
            pair.copy_from_slice(&HEX[usize::from(b)]);
        }
        let digits = &digits[..2 * chunk.len()];
        out.push_str(std::str::from_utf8(digits).expect("hex digits are ASCII"));
    }
    out.push('\'');
}

/// Every byte's two hex digits.
const HEX: [[u8; 2]; 256] = {
    let digits = b"0123456789abcdef";
    let mut table = [[0; 2]; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = [digits[b >> 4], digits[b & 15]];
        b += 1;
    }
    table
};

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
    sql: &Sql<MySql>,
    c: Claimant<'_>,
    keys: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    mine(conn, sql, c, keys, |t, scope, nonce| {
        let values: Vec<String> = keys
            .iter()
            .map(|key| {
                format!(
                    "({scope},{},{nonce},UTC_TIMESTAMP(6),UTC_TIMESTAMP(6))",
                    hex(key)
                )
            })
            .collect();
        format!(
            "INSERT IGNORE INTO {t} (scope, `key`, token, created_at, completed_at) VALUES {}",
            values.join(",")
        )
    })
    .await
}

/// The statement `write` makes of the table, the scope (a literal) and the claim's nonce (its
/// lock wait bounded by the claim's `wait`), then in the same message the keys among `keys`
/// that hold the nonce, which only the rows it made the claim's can.
async fn mine(
    conn: &mut Conn,
    sql: &Sql<MySql>,
    c: Claimant<'_>,
    keys: &[&str],
    write: impl FnOnce(&str, &str, i64) -> String,
) -> Result<Vec<String>, sqlx::Error> {
    let (t, scope, keys) = (sql.table.as_str(), hex(c.scope), list(keys));
    let message = format!(
        "{}; SELECT `key` FROM {t} WHERE scope = {scope} AND `key` IN ({keys}) AND token = {}",
        bounded(&write(t, &scope, c.nonce), c.wait).as_str(),
        c.nonce
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(message))
        .fetch_all(&mut *conn)
        .await?;
    keys_of(&rows)
}

/// The status of each marker of `keys` that exists.
pub(super) async fn markers(
    conn: &mut Conn,
    sql: &Sql<MySql>,
    scope: &str,
    keys: &[&str],
) -> Result<Vec<(String, Found)>, sqlx::Error> {
    let query = format!(
        "SELECT `key`, state, {LEASE_OVER}, error FROM {} WHERE scope = {} AND `key` IN ({})",
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
            let error: Option<String> = row.try_get(3)?;
            Ok((key, Found::of_status(&state, over, error)))
        })
        .collect()
}

/// One message: the free leases among `keys` become this transaction's completed markers,
/// holding its nonce, which then finds them.
pub(super) async fn take_over(
    conn: &mut Conn,
    sql: &Sql<MySql>,
    c: Claimant<'_>,
    keys: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    let list = list(keys);
    mine(conn, sql, c, keys, |t, scope, nonce| {
        format!(
            "UPDATE {t} SET state = 'completed', completed_at = UTC_TIMESTAMP(6), \
             locked_until = NULL, token = {nonce}, attempts = attempts + 1, result = NULL \
             WHERE scope = {scope} AND `key` IN ({list}) AND state = 'in_progress' \
             AND (locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6))"
        )
    })
    .await
}

/// One message: the markers of jobs that failed alone given back, those this claim inserted
/// deleted, the free leases it took over free again (its attempt counted).
pub(super) async fn unclaim(
    conn: &mut Conn,
    sql: &Sql<MySql>,
    c: Claimant<'_>,
    inserted: &[&str],
    taken: &[&str],
) -> Result<(), sqlx::Error> {
    let t = sql.table.as_str();
    let (scope, nonce) = (hex(c.scope), c.nonce);
    let mut message = Vec::new();
    if !inserted.is_empty() {
        message.push(format!(
            "DELETE FROM {t} WHERE scope = {scope} AND `key` IN ({}) AND token = {nonce}",
            list(inserted)
        ));
    }
    if !taken.is_empty() {
        message.push(format!(
            "UPDATE {t} SET state = 'in_progress', completed_at = NULL, locked_until = NULL, \
             result = NULL WHERE scope = {scope} AND `key` IN ({}) AND token = {nonce}",
            list(taken)
        ));
    }
    if message.is_empty() {
        return Ok(());
    }
    sqlx::raw_sql(AssertSqlSafe(message.join("; ")))
        .execute(&mut *conn)
        .await?;
    Ok(())
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
