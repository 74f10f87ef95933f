//! The SQL of one backend for one marker table: templates with `{t}` for the table, filled
//! once per [`Store`](crate::Store) so that every call reuses the same strings and hits sqlx's
//! prepared-statement cache.

use sqlx::{SqlSafeStr as _, SqlStr};

use crate::Error;

/// The longest table name a store accepts: the names derived from it (the index
/// `{table}_completed_at`) must fit PostgreSQL's 63-byte identifiers, which it would otherwise
/// cut silently, merging the index names of tables with a long common prefix.
pub const MAX_TABLE_LEN: usize = 47;

/// A marker table's name, checked to be a plain identifier: the only way a name reaches SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table(String);

impl Table {
    /// A letter or `_`, then letters, digits or `_`, at most [`MAX_TABLE_LEN`] characters;
    /// anything else is [`Error::InvalidTable`].
    pub(crate) fn new(name: &str) -> Result<Table, Error> {
        let mut chars = name.chars();
        let plain = matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
            && name.len() <= MAX_TABLE_LEN;
        if !plain {
            return Err(Error::InvalidTable {
                name: name.to_owned(),
            });
        }
        Ok(Table(name.to_owned()))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// The statements of one backend for one table (see each backend for their binds).
#[derive(Debug)]
pub struct Statements {
    pub(crate) table: Table,
    pub(crate) begin: SqlStr,
    pub(crate) claim: SqlStr,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) claim_or_read: SqlStr,
    pub(crate) marker: SqlStr,
    pub(crate) take_over: SqlStr,
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) claim_batch: SqlStr,
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) batch_markers: SqlStr,
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) take_over_batch: SqlStr,
    pub(crate) record: SqlStr,
    pub(crate) forget: SqlStr,
    pub(crate) purge: SqlStr,
    pub(crate) inspect: SqlStr,
    pub(crate) in_progress: SqlStr,
    pub(crate) in_progress_all: SqlStr,
    pub(crate) lease_claim: SqlStr,
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) lease_takeover: SqlStr,
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) lease_state: SqlStr,
    pub(crate) lease_complete: SqlStr,
    pub(crate) lease_release: SqlStr,
    pub(crate) lease_renew: SqlStr,
    pub(crate) outbox: OutboxStatements,
    pub(crate) ddl: Vec<SqlStr>,
}

/// The outbox table's statements (`{t}_outbox`; see each backend for their binds).
#[derive(Debug)]
pub(crate) struct OutboxStatements {
    /// The claim's messages, in its transaction: one a statement, or all of them in one on
    /// PostgreSQL; an id already there is left as it is.
    pub(crate) write: SqlStr,
    /// The relay's take: due messages, oldest first, locked or skipped.
    pub(crate) due: SqlStr,
    pub(crate) sent: SqlStr,
    pub(crate) failed: SqlStr,
    pub(crate) purge: SqlStr,
    /// Operators' list of unsent messages, one message by id, and a parked one requeued.
    pub(crate) list: SqlStr,
    pub(crate) find: SqlStr,
    pub(crate) requeue: SqlStr,
}

/// The text of a backend's statements, `{t}` standing for the table.
pub(crate) struct Templates<'a> {
    pub(crate) begin: &'static str,
    pub(crate) claim: &'a str,
    pub(crate) claim_or_read: &'a str,
    pub(crate) marker: &'a str,
    pub(crate) take_over: &'a str,
    pub(crate) claim_batch: &'a str,
    pub(crate) batch_markers: &'a str,
    pub(crate) take_over_batch: &'a str,
    pub(crate) record: &'a str,
    pub(crate) forget: &'a str,
    pub(crate) purge: &'a str,
    pub(crate) inspect: &'a str,
    pub(crate) in_progress: &'a str,
    pub(crate) in_progress_all: &'a str,
    pub(crate) lease_claim: &'a str,
    pub(crate) lease_takeover: &'a str,
    pub(crate) lease_state: &'a str,
    pub(crate) lease_complete: &'a str,
    pub(crate) lease_release: &'a str,
    pub(crate) lease_renew: &'a str,
    pub(crate) outbox: [&'a str; 5],
    /// list, find, requeue.
    pub(crate) outbox_ops: [&'a str; 3],
    pub(crate) ddl: &'a [&'a str],
}

impl Templates<'_> {
    /// Fills in `table`, which [`Table::new`] checked to be a plain identifier: formatting it
    /// into SQL is then safe.
    pub(crate) fn fill(self, table: &Table) -> Statements {
        let fill = |s: &str| sqlx::AssertSqlSafe(s.replace("{t}", table.as_str())).into_sql_str();
        Statements {
            table: table.clone(),
            begin: self.begin.into_sql_str(),
            claim: fill(self.claim),
            claim_or_read: fill(self.claim_or_read),
            marker: fill(self.marker),
            take_over: fill(self.take_over),
            claim_batch: fill(self.claim_batch),
            batch_markers: fill(self.batch_markers),
            take_over_batch: fill(self.take_over_batch),
            record: fill(self.record),
            forget: fill(self.forget),
            purge: fill(self.purge),
            inspect: fill(self.inspect),
            in_progress: fill(self.in_progress),
            in_progress_all: fill(self.in_progress_all),
            lease_claim: fill(self.lease_claim),
            lease_takeover: fill(self.lease_takeover),
            lease_state: fill(self.lease_state),
            lease_complete: fill(self.lease_complete),
            lease_release: fill(self.lease_release),
            lease_renew: fill(self.lease_renew),
            outbox: {
                let [write, due, sent, failed, purge] = self.outbox.map(fill);
                let [list, find, requeue] = self.outbox_ops.map(fill);
                OutboxStatements {
                    write,
                    due,
                    sent,
                    failed,
                    purge,
                    list,
                    find,
                    requeue,
                }
            },
            ddl: self.ddl.iter().map(|s| fill(s)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_TABLE_LEN, Table};

    #[test]
    fn only_plain_identifiers_are_table_names() {
        for ok in ["idem_processed", "_t", "Jobs2", &"a".repeat(MAX_TABLE_LEN)] {
            assert!(Table::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "2jobs",
            "jobs; DROP TABLE users",
            "public.jobs",
            "\"jobs\"",
            "jobs-x",
            "jöbs",
            &"a".repeat(MAX_TABLE_LEN + 1),
        ] {
            assert!(Table::new(bad).is_err(), "{bad}");
        }
    }
}
