//! What `Store::doctor` reads of a deployment: the schema's tables and indexes in the catalog,
//! how much of the marker table is dead space, the markers and messages that need an
//! operator, and what the server says of itself (its clock, its connection limit, its port),
//! where it is a server.

use sqlx::Pool;

use super::bind::statements;
use super::sql::Text;
use super::{Backend, Sql};

/// Counts past this are reported as "at least": each count reads at most this many rows.
pub(crate) const COUNT_CAP: i64 = 10_000;

/// The schema's tables (named like the marker table, or with its name and `_` as prefix),
/// their indexes as `(table, index)` and their columns as `(table, column)`.
pub(crate) type Catalog = (Vec<String>, Vec<(String, String)>, Vec<(String, String)>);

/// Dead space in the marker table, as the database measures it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bloat {
    /// PostgreSQL: dead and live row versions (`pg_stat_user_tables`).
    Rows { dead: i64, live: i64 },
    /// MySQL / MariaDB: free bytes in the table's space, and bytes in use (data and indexes).
    Bytes { free: i64, used: i64 },
    /// SQLite: free pages and all pages of the database file.
    Pages { free: i64, total: i64 },
}

/// `old_in_scope`, `old` and `stuck`, each counting at most `:cap` markers, with `count` as
/// the backend reads `COUNT(*)` and `ago` the instant `:age_ms` ago.
pub(super) fn counts(count: &str, ago: &str) -> [Text; 3] {
    let capped = |which: String| -> Text {
        format!("SELECT {count} FROM (SELECT 1 FROM {{t}} WHERE {which} LIMIT :cap) s").into()
    };
    [
        capped(format!(
            "scope = :scope AND state = 'completed' AND completed_at < {ago}"
        )),
        capped(format!(
            "state = 'completed' AND completed_at < {ago} \
             AND scope NOT IN (SELECT scope FROM {{t}}_retention)"
        )),
        capped(format!(
            "state = 'in_progress' AND COALESCE(locked_until, created_at) < {ago}"
        )),
    ]
}

statements! {
    /// The doctor's reads. `name` is the marker table's name, as the catalog compares it.
    pub(crate) struct HealthSql, HealthText {
        /// The tables of the current schema named like the marker table or with its name and
        /// `_` as prefix.
        tables(name: &str);
        /// `(table, index)` of those tables' indexes.
        indexes(name: &str);
        /// `(table, column)` of those tables' columns.
        columns(name: &str);
        /// The tables of the current schema that have a marker table's columns.
        marker_tables();
        /// Completed markers of `scope` older than `age_ms`, at most `cap`.
        old_in_scope(scope: &str, age_ms: i64, cap: i64);
        /// Completed markers older than `age_ms` of the scopes without a window, at most `cap`.
        old(age_ms: i64, cap: i64);
        /// Markers in progress whose lease ran out (or, released, that were claimed) more
        /// than `age_ms` ago, at most `cap`.
        stuck(age_ms: i64, cap: i64);
        /// `(parked, pending and due more than age_ms ago)` outbox messages.
        outbox(age_ms: i64);
        /// The marker table's dead space: two counts and their unit (`rows`: dead and live
        /// rows; `bytes`: free and used; `pages`: free and all).
        bloat(name: &str);
    } optional {
        // What a server says of itself; an embedded database (SQLite) is no server.
        /// The database's clock in milliseconds since 1970.
        clock();
        /// The server's connection limit.
        max_connections();
        /// The port the server listens on, as it says (PostgreSQL).
        server_port();
        /// The database's logical replication slots of pgoutput, the WAL relay's (PostgreSQL):
        /// `(name, unconfirmed bytes, retained bytes, active, wal_status)`.
        slots();
    }
}

impl<DB: Backend> Sql<DB> {
    /// `(tables, (table, index), (table, column))` of the schema, as the catalog names them.
    pub(crate) async fn catalog(&self, pool: &Pool<DB>) -> Result<Catalog, sqlx::Error> {
        let name = self.table.as_str();
        let tables: Vec<(String,)> = self.health.tables(name).fetch_all(pool).await?;
        let indexes = self.health.indexes(name).fetch_all(pool).await?;
        let columns = self.health.columns(name).fetch_all(pool).await?;
        Ok((tables.into_iter().map(|(t,)| t).collect(), indexes, columns))
    }

    /// The tables of the current schema that have a marker table's columns.
    pub(crate) async fn marker_tables(&self, pool: &Pool<DB>) -> Result<Vec<String>, sqlx::Error> {
        let tables: Vec<(String,)> = self.health.marker_tables().fetch_all(pool).await?;
        Ok(tables.into_iter().map(|(t,)| t).collect())
    }

    /// Completed markers older than `age_ms`, of `scope` (or of every scope without a window
    /// of its own: `None`), at most [`COUNT_CAP`].
    pub(crate) async fn count_old(
        &self,
        pool: &Pool<DB>,
        scope: Option<&str>,
        age_ms: i64,
    ) -> Result<i64, sqlx::Error> {
        let count = match scope {
            Some(scope) => self.health.old_in_scope(scope, age_ms, COUNT_CAP),
            None => self.health.old(age_ms, COUNT_CAP),
        };
        one(count.fetch_optional(pool).await?)
    }

    /// Markers stuck in progress for more than `age_ms`, at most [`COUNT_CAP`].
    pub(crate) async fn count_stuck(
        &self,
        pool: &Pool<DB>,
        age_ms: i64,
    ) -> Result<i64, sqlx::Error> {
        let count = self.health.stuck(age_ms, COUNT_CAP);
        one(count.fetch_optional(pool).await?)
    }

    /// Outbox messages parked, and pending ones due more than `age_ms` ago.
    pub(crate) async fn count_outbox(
        &self,
        pool: &Pool<DB>,
        age_ms: i64,
    ) -> Result<(i64, i64), sqlx::Error> {
        let counts = self.health.outbox(age_ms).fetch_optional(pool).await?;
        counts.ok_or(sqlx::Error::RowNotFound)
    }

    /// The marker table's dead space, where the database measures it.
    pub(crate) async fn bloat(&self, pool: &Pool<DB>) -> Result<Option<Bloat>, sqlx::Error> {
        let bloat = self.health.bloat(self.table.as_str());
        let row: Option<(i64, i64, String)> = bloat.fetch_optional(pool).await?;
        Ok(row.map(|(a, b, unit)| match unit.as_str() {
            "rows" => Bloat::Rows { dead: a, live: b },
            "bytes" => Bloat::Bytes { free: a, used: b },
            _ => Bloat::Pages { free: a, total: b },
        }))
    }

    /// The database's clock in milliseconds since 1970, where it is a server's (not this
    /// host's, as an embedded database's is).
    pub(crate) async fn clock_ms(&self, pool: &Pool<DB>) -> Result<Option<i64>, sqlx::Error> {
        let Some(clock) = self.health.clock() else {
            return Ok(None);
        };
        one(clock.fetch_optional(pool).await?).map(Some)
    }

    /// The server's connection limit, where it is a server.
    pub(crate) async fn max_connections(
        &self,
        pool: &Pool<DB>,
    ) -> Result<Option<i64>, sqlx::Error> {
        let Some(max) = self.health.max_connections() else {
            return Ok(None);
        };
        one(max.fetch_optional(pool).await?).map(Some)
    }

    /// The port the pool connects to and the port the server says it listens on, where both
    /// are known (PostgreSQL over TCP): a pooler or proxy in between makes them differ.
    pub(crate) async fn ports(&self, pool: &Pool<DB>) -> Result<Option<(u16, i64)>, sqlx::Error> {
        let (Some(ours), Some(server)) = (DB::port(pool), self.health.server_port()) else {
            return Ok(None);
        };
        let server: Option<(Option<i64>,)> = server.fetch_optional(pool).await?;
        Ok(server.and_then(|(port,)| port).map(|port| (ours, port)))
    }
}

/// A logical replication slot as the doctor reads it: its name, the WAL bytes written since
/// its confirmed position and those the server keeps for it, whether a relay streams from it
/// (1) or not (0), and its `wal_status`.
pub(crate) type Slot = (String, i64, i64, i64, String);

impl<DB: Backend> Sql<DB> {
    /// The database's pgoutput slots, where the database has them (PostgreSQL).
    pub(crate) async fn slots(&self, pool: &Pool<DB>) -> Result<Option<Vec<Slot>>, sqlx::Error> {
        let Some(slots) = self.health.slots() else {
            return Ok(None);
        };
        Ok(Some(slots.fetch_all(pool).await?))
    }
}

/// The one value of a one-row answer.
fn one(row: Option<(i64,)>) -> Result<i64, sqlx::Error> {
    row.map(|(n,)| n).ok_or(sqlx::Error::RowNotFound)
}
