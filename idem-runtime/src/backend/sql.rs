//! How a backend writes its statements: each one's text, `{t}` standing for the table, beside
//! the binds it takes in the order of its placeholders ([`statements!`]). The order is written
//! once, where the text is; callers pass the binds by name, and a unit test per backend counts
//! each statement's placeholders against its binds. The texts are filled once per
//! [`Store`](crate::store::Store), so every call reuses the same strings and hits sqlx's
//! prepared-statement cache.

use std::sync::Arc;

use sqlx::error::BoxDynError;
use sqlx::{Database, SqlSafeStr as _, SqlStr};

use super::wake::Wake;
use crate::error::Error;

/// The longest table name a store accepts: the names derived from it (the index
/// `{table}_completed_at`) must fit PostgreSQL's 63-byte identifiers, which it would otherwise
/// cut silently, merging the index names of tables with a long common prefix.
pub const MAX_TABLE_LEN: usize = 47;

/// A marker table's name, checked to be a plain identifier: the only way a name reaches SQL.
/// It also says how the statements filled with it are sent: prepared once per connection and
/// kept (sqlx's statement cache), or unnamed, prepared again at each execution, which is what
/// survives a pooler in transaction mode (see [`Table::unnamed`]).
///
/// It also carries the commits of the store's outbox messages that its relays wait on
/// ([`Wake`]), shared by the store's clones: a statement's check (`Check`) names the table,
/// and so reaches them after the commit it checked.
#[derive(Debug, Clone)]
pub struct Table {
    name: String,
    unnamed: bool,
    wake: Arc<Wake>,
}

impl PartialEq for Table {
    fn eq(&self, other: &Table) -> bool {
        self.name == other.name && self.unnamed == other.unnamed
    }
}

impl Eq for Table {}

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
        Ok(Table {
            name: name.to_owned(),
            unnamed: false,
            wake: Wake::new(),
        })
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.name
    }

    /// The same table, its statements sent as unnamed prepared statements. A pooler in
    /// transaction mode (PgBouncer before 1.21, or without `max_prepared_statements`) hands
    /// each transaction (and each statement outside one) whichever server connection is free:
    /// a statement prepared under a name on one is missing on the next, and two clients'
    /// names collide on a server connection they share. The unnamed statement lives only
    /// until the next one on the same server connection, within the same message sequence.
    ///
    /// The table it returns has commits of its own ([`Table::wake`]): a store's relays are
    /// woken by the commits of the store they were given, not of the one it was made from.
    pub(crate) fn unnamed(mut self, unnamed: bool) -> Self {
        self.unnamed = unnamed;
        self.wake = Wake::new();
        self
    }

    /// The commits of the store's outbox messages, which its relays wait on.
    pub(crate) fn wake(&self) -> &Arc<Wake> {
        &self.wake
    }

    /// Whether the statements are sent unnamed ([`Table::unnamed`]).
    pub(crate) fn is_unnamed(&self) -> bool {
        self.unnamed
    }

    /// `template` with `{t}` replaced by this name, which [`Table::new`] checked to be a plain
    /// identifier: formatting it into SQL is then safe.
    pub(crate) fn fill(&self, template: &str) -> SqlStr {
        sqlx::AssertSqlSafe(template.replace("{t}", self.as_str())).into_sql_str()
    }
}

/// A statement with its binds, to run as a query, a query of rows or of one column.
pub(crate) struct Bound<DB: Database> {
    sql: SqlStr,
    args: Result<DB::Arguments, BoxDynError>,
    /// Kept prepared on the connection (sqlx's default), or sent unnamed ([`Table::unnamed`]).
    persistent: bool,
}

impl<DB: Database + sqlx::database::HasStatementCache> Bound<DB>
where
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    pub(crate) fn new(
        sql: SqlStr,
        args: Result<DB::Arguments, BoxDynError>,
        persistent: bool,
    ) -> Self {
        Bound {
            sql,
            args,
            persistent,
        }
    }

    pub(crate) fn query(self) -> sqlx::query::Query<'static, DB, DB::Arguments> {
        sqlx_core::query::query_with_result(self.sql, self.args).persistent(self.persistent)
    }

    pub(crate) fn rows<O>(self) -> sqlx::query::QueryAs<'static, DB, O, DB::Arguments>
    where
        O: for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        sqlx_core::query_as::query_as_with_result(self.sql, self.args).persistent(self.persistent)
    }

    pub(crate) fn scalar<O>(self) -> sqlx::query::QueryScalar<'static, DB, O, DB::Arguments>
    where
        (O,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        sqlx_core::query_scalar::query_scalar_with_result(self.sql, self.args)
            .persistent(self.persistent)
    }

    /// The same binds on another text with the same placeholders (MariaDB's statement with
    /// its lock wait bounded).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn on(mut self, sql: SqlStr) -> Self {
        self.sql = sql;
        self
    }

    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn text(&self) -> &str {
        self.sql.as_str()
    }
}

/// A struct of statements for one table, and one method per statement that binds its
/// arguments in the order of its placeholders:
///
/// ```text
/// statements! {
///     pub(super) struct LeaseSql<Postgres> {
///         /// Binds: scope, key, token.
///         release(scope: &str, key: &str, token: i64) = "UPDATE {t} SET ... WHERE scope = $1 ...";
///     }
/// }
/// ```
///
/// gives `LeaseSql::new(&table)`, `sql.release(scope, key, token) -> Bound<Postgres>`, and, for
/// the placeholder test, `LeaseSql::templates()`: each statement's name, text and bind count.
macro_rules! statements {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident<$db:ty> {
            $(
                $(#[$fmeta:meta])*
                $field:ident($($arg:ident: $ty:ty),* $(,)?) = $sql:expr;
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        $vis struct $name {
            $($field: ::sqlx::SqlStr,)*
            /// Whether the statements are kept prepared on the connection.
            persistent: bool,
        }

        impl $name {
            $vis fn new(table: &$crate::backend::sql::Table) -> Self {
                $name {
                    $($field: table.fill(&$sql),)*
                    persistent: !table.is_unnamed(),
                }
            }

            $(
                $(#[$fmeta])*
                #[allow(clippy::too_many_arguments, reason = "one statement's binds")]
                #[allow(unused_labels, reason = "a statement without binds")]
                $vis fn $field(&self, $($arg: $ty),*) -> $crate::backend::sql::Bound<$db> {
                    #[allow(unused_mut)]
                    let mut args = <<$db as ::sqlx::Database>::Arguments as ::core::default::Default>::default();
                    // Sized once: growing the buffer bind by bind cost a reallocation each.
                    ::sqlx::Arguments::reserve(
                        &mut args,
                        <[&str]>::len(&[$(stringify!($arg)),*]),
                        0 $(+ ::sqlx::Encode::<'_, $db>::size_hint(&$arg))*,
                    );
                    let added: ::core::result::Result<(), ::sqlx::error::BoxDynError> = 'add: {
                        $(
                            if let ::core::result::Result::Err(e) = ::sqlx::Arguments::add(&mut args, $arg) {
                                break 'add ::core::result::Result::Err(e);
                            }
                        )*
                        ::core::result::Result::Ok(())
                    };
                    $crate::backend::sql::Bound::new(
                        self.$field.clone(),
                        added.map(|()| args),
                        self.persistent,
                    )
                }
            )*

            /// Each statement's name, text and number of binds.
            #[cfg(test)]
            pub(crate) fn templates() -> ::std::vec::Vec<(&'static str, ::std::string::String, usize)> {
                ::std::vec![$((
                    stringify!($field),
                    ::std::string::String::from(&*$sql),
                    <[&str]>::len(&[$(stringify!($arg)),*]),
                ),)*]
            }
        }
    };
}
pub(crate) use statements;

/// How a backend writes its placeholders.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Placeholders {
    /// PostgreSQL's `$1`, `$2`: each bind once, used as often as the text likes.
    Dollar,
    /// SQLite's `?1`, `?2`.
    Numbered,
    /// MySQL's `?`: one bind per mark, in order.
    Question,
}

/// How many binds `sql` takes: the highest number for numbered placeholders (which must then
/// all appear), the count of marks for `?`. Quoted text and comments are skipped.
#[cfg(test)]
pub(crate) fn placeholders(sql: &str, style: Placeholders) -> usize {
    let bytes = sql.as_bytes();
    let mut seen = std::collections::BTreeSet::new();
    let mut marks = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\'' | b'"' | b'`' => {
                let quote = bytes[i];
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                    i += 1;
                }
            }
            c @ (b'$' | b'?') => {
                let digits = bytes[i + 1..]
                    .iter()
                    .take_while(|b| b.is_ascii_digit())
                    .count();
                match (style, c, digits) {
                    (Placeholders::Dollar, b'$', 1..) | (Placeholders::Numbered, b'?', 1..) => {
                        let n: usize = sql[i + 1..i + 1 + digits].parse().expect("digits");
                        seen.insert(n);
                    }
                    (Placeholders::Question, b'?', 0) => marks += 1,
                    (_, _, _) => panic!("a placeholder of another backend's kind in {sql:?}"),
                }
                i += digits;
            }
            _ => {}
        }
        i += 1;
    }
    match style {
        Placeholders::Question => marks,
        _ => {
            let n = seen.len();
            assert!(
                seen.iter().copied().eq(1..=n),
                "placeholders of {sql:?} skip a number: {seen:?}"
            );
            n
        }
    }
}

/// Checks every statement of `templates` (from [`statements!`]) against its binds.
#[cfg(test)]
pub(crate) fn check_binds(templates: &[(&str, String, usize)], style: Placeholders) {
    for (name, sql, binds) in templates {
        assert_eq!(
            placeholders(sql, style),
            *binds,
            "statement `{name}` has another number of placeholders than of binds: {sql}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn placeholders_are_counted_outside_quotes_and_comments() {
        let pg = "SELECT $1, '$9', $2::text FROM t WHERE a = $1 /* $7 */";
        assert_eq!(placeholders(pg, Placeholders::Dollar), 2);
        let lite = "SELECT ?1, ?3, ?2, '?4'";
        assert_eq!(placeholders(lite, Placeholders::Numbered), 3);
        let my = "/*M! SET STATEMENT x = 1 FOR */ SELECT ?, '?', `a?`, ?";
        assert_eq!(placeholders(my, Placeholders::Question), 2);
    }

    #[test]
    #[should_panic(expected = "skip a number")]
    fn a_skipped_placeholder_is_a_mistake() {
        placeholders("SELECT $1, $3", Placeholders::Dollar);
    }
}
