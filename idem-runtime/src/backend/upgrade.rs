//! What a schema version added to a table that an earlier version created, so that `migrate`
//! brings a table made by an earlier version of idem up to the current one.
//!
//! Each backend's DDL creates its tables whole, at the current version, with `IF NOT EXISTS`: a
//! new table gets every column and index there, and an existing one is left as it is. A column
//! added to an existing table needs an `ALTER TABLE`, which not every backend can write
//! `IF NOT EXISTS` (SQLite and MySQL 8 cannot; MySQL 8 cannot for `CREATE INDEX` either), so
//! each addition is also listed once as an [`Added`] in the backend's `ADDED`, and `migrate`
//! adds what a table lacks, asking the catalog first where the statement cannot ask itself,
//! under the same lock as the DDL. The published upgrade files (`schema/<db>.v2-to-v3.sql`,
//! `schema/<db>.v3-to-v4.sql`) hold the same statements.
//!
//! A column added this way must be valid for the rows already there: nullable, or `NOT NULL`
//! with a constant default (SQLite refuses any other `ADD COLUMN`), and never part of a
//! primary key.

use sqlx::SqlStr;

use super::sql::Table;
use super::{Backend, Sql};

/// A column or an index that a schema version added to a table an earlier version created.
/// `{t}` in a table name stands for the marker table's name (`{t}_outbox`).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code, reason = "only MySQL's list has an index")]
pub(crate) enum Added {
    /// `ALTER TABLE <table> ADD COLUMN <name> <definition>`.
    Column {
        table: &'static str,
        name: &'static str,
        /// The column's type, default and constraints, as `ADD COLUMN` takes them.
        definition: &'static str,
    },
    /// `CREATE INDEX <name> ON <table> <definition>`: only where the backend's indexes are
    /// part of its `CREATE TABLE` (MySQL), since `CREATE INDEX IF NOT EXISTS` in the DDL
    /// serves the others.
    Index {
        table: &'static str,
        name: &'static str,
        /// The indexed columns, in parentheses.
        definition: &'static str,
    },
}

/// What kind of object an [`Addition`] adds: what a catalog is asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Column,
    Index,
}

/// One [`Added`] for one marker table: its table's name and its own, and the statement that
/// adds it.
#[derive(Debug)]
pub(crate) struct Addition {
    pub(crate) kind: Kind,
    pub(crate) table: String,
    pub(crate) name: String,
    pub(crate) statement: SqlStr,
}

impl Added {
    /// The addition for `table`; `if_not_exists` where the backend's `ALTER TABLE ... ADD
    /// COLUMN` and `CREATE INDEX` can skip what exists (PostgreSQL), so that no catalog query
    /// is needed.
    pub(crate) fn fill(&self, table: &Table, if_not_exists: bool) -> Addition {
        let guard = if if_not_exists { " IF NOT EXISTS" } else { "" };
        let (kind, on, name, template) = match *self {
            Added::Column {
                table: on,
                name,
                definition,
            } => (
                Kind::Column,
                on,
                name,
                format!("ALTER TABLE {on} ADD COLUMN{guard} {name} {definition}"),
            ),
            Added::Index {
                table: on,
                name,
                definition,
            } => (
                Kind::Index,
                on,
                name,
                format!("CREATE INDEX{guard} {name} ON {on} {definition}"),
            ),
        };
        Addition {
            kind,
            table: on.replace("{t}", table.as_str()),
            name: name.replace("{t}", table.as_str()),
            statement: table.fill(&template),
        }
    }
}

/// The schema on `conn`, under the lock its backend's `migrate` holds: the `CREATE TABLE`s,
/// then what later versions added to tables an earlier one made, then the rest of the DDL
/// (its `CREATE INDEX`es), since an index of the current version may be on a column added
/// only in between. An addition whose statement cannot skip what exists (SQLite's and MySQL
/// 8's `ADD COLUMN`) is asked of the catalog first. The statements go unprepared: each runs
/// once, and a named statement left on a server connection that a pooler in transaction mode
/// hands to another client would collide with that client's own.
pub(crate) async fn run<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
) -> Result<(), sqlx::Error> {
    let (tables, indexes): (Vec<_>, Vec<_>) = sql
        .ddl
        .iter()
        .partition(|s| s.as_str().trim_start().starts_with("CREATE TABLE"));
    for stmt in tables {
        sqlx::raw_sql(stmt.clone()).execute(DB::exec(conn)).await?;
    }
    for added in &sql.added {
        let ask = match added.kind {
            Kind::Column => sql.ops.has_column(&added.table, &added.name),
            Kind::Index => sql.ops.has_index(&added.table, &added.name),
        };
        if let Some(ask) = ask {
            let (there,): (i64,) = ask
                .fetch_optional(&mut *conn)
                .await?
                .ok_or(sqlx::Error::RowNotFound)?;
            if there > 0 {
                continue;
            }
        }
        sqlx::raw_sql(added.statement.clone())
            .execute(DB::exec(conn))
            .await?;
    }
    for stmt in indexes {
        sqlx::raw_sql(stmt.clone()).execute(DB::exec(conn)).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_addition_names_the_table_it_adds_to() {
        let table = Table::new("jobs").unwrap();
        let column = Added::Column {
            table: "{t}_outbox",
            name: "headers",
            definition: "bytea",
        };
        let filled = column.fill(&table, true);
        assert_eq!(filled.kind, Kind::Column);
        assert_eq!(filled.table, "jobs_outbox");
        assert_eq!(filled.name, "headers");
        assert_eq!(
            filled.statement.as_str(),
            "ALTER TABLE jobs_outbox ADD COLUMN IF NOT EXISTS headers bytea"
        );
        let index = Added::Index {
            table: "{t}",
            name: "idem_failed",
            definition: "(state, completed_at)",
        };
        assert_eq!(
            index.fill(&table, false).statement.as_str(),
            "CREATE INDEX idem_failed ON jobs (state, completed_at)"
        );
    }
}
