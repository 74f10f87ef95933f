//! What runs a statement on any backend: its binds added in the order its text names them, the
//! statement sent (behind a pooler in transaction mode, in a transaction of its own), and its
//! rows read back as plain Rust values.
//!
//! Generic code over sqlx's `Database` would have to repeat, at every call, that each value it
//! binds or reads has an encoding for that database (`for<'q> &'q str: Encode<'q, DB>`, ...):
//! Rust does not carry such bounds along with a trait. [`Driver`] says it once per backend
//! instead, one method per kind of value, and the statement sets and the glue that runs them
//! are written once for all three.

use sqlx::error::BoxDynError;
use sqlx::{Connection as _, Database, Pool};
use sqlx_core::arguments::ImmutableArguments;

use super::sql::{Placeholders, Template};

/// What idem needs of a sqlx database to run its statements, by kind of value.
pub trait Driver: Database + sqlx::database::HasStatementCache {
    /// How the backend writes its placeholders.
    const PLACEHOLDERS: Placeholders;

    /// `conn` as sqlx's executor.
    fn exec<'c>(conn: &'c mut Self::Connection) -> impl sqlx::Executor<'c, Database = Self> + 'c;

    /// The rows a statement changed (for MySQL and MariaDB, under sqlx's `CLIENT_FOUND_ROWS`,
    /// the rows its `WHERE` matched).
    fn affected(done: &Self::QueryResult) -> u64;

    /// Adds one value to a statement's binds.
    fn add(args: &mut Self::Arguments, value: Value<'_>) -> Result<(), BoxDynError>;

    /// Reads column `i` of `row` as one kind of value.
    fn get(row: &Self::Row, i: usize, kind: Kind) -> Result<Got, sqlx::Error>;
}

/// A value bound to a statement.
#[derive(Debug, Clone, Copy)]
pub enum Value<'a> {
    Str(&'a str),
    OptStr(Option<&'a str>),
    Int(i64),
    OptInt(Option<i64>),
    Int32(i32),
    Bool(bool),
    Bytes(&'a [u8]),
    OptBytes(Option<&'a [u8]>),
    /// A list of text values: PostgreSQL binds an array, the others its JSON.
    Keys(&'a [&'a str]),
}

/// A list of text values bound as one value (see [`Value::Keys`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Keys<'a>(pub(crate) &'a [&'a str]);

/// The kinds of values idem reads from a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    OptText,
    Int,
    OptInt,
    Int32,
    Bytes,
    OptBytes,
}

/// A value read from a row, of the [`Kind`] asked for.
#[derive(Debug)]
pub enum Got {
    Text(String),
    OptText(Option<String>),
    Int(i64),
    OptInt(Option<i64>),
    Int32(i32),
    Bytes(Vec<u8>),
    OptBytes(Option<Vec<u8>>),
}

/// A Rust value that binds as a [`Value`].
pub(crate) trait Bind: Sync {
    fn value(&self) -> Value<'_>;
}

macro_rules! bind {
    ($($ty:ty => |$v:ident| $value:expr;)*) => {
        $(impl Bind for $ty {
            fn value(&self) -> Value<'_> {
                let $v = self;
                $value
            }
        })*
    };
}

bind! {
    &str => |v| Value::Str(v);
    Option<&str> => |v| Value::OptStr(*v);
    i64 => |v| Value::Int(*v);
    Option<i64> => |v| Value::OptInt(*v);
    i32 => |v| Value::Int32(*v);
    bool => |v| Value::Bool(*v);
    &[u8] => |v| Value::Bytes(v);
    Option<&[u8]> => |v| Value::OptBytes(*v);
    Keys<'_> => |v| Value::Keys(v.0);
}

/// A Rust value read from one column.
pub(crate) trait Col: Sized {
    fn get<DB: Driver>(row: &DB::Row, i: usize) -> Result<Self, sqlx::Error>;
}

macro_rules! col {
    ($($ty:ty => $kind:ident;)*) => {
        $(impl Col for $ty {
            fn get<DB: Driver>(row: &DB::Row, i: usize) -> Result<Self, sqlx::Error> {
                match DB::get(row, i, Kind::$kind)? {
                    Got::$kind(v) => Ok(v),
                    other => unreachable!("asked for {:?}, got {other:?}", Kind::$kind),
                }
            }
        })*
    };
}

col! {
    String => Text;
    Option<String> => OptText;
    i64 => Int;
    Option<i64> => OptInt;
    i32 => Int32;
    Vec<u8> => Bytes;
    Option<Vec<u8>> => OptBytes;
}

/// A row read as a tuple of [`Col`]s.
pub(crate) trait FromRow: Sized {
    fn from_row<DB: Driver>(row: &DB::Row) -> Result<Self, sqlx::Error>;
}

macro_rules! from_row {
    ($(($($t:ident $i:tt),+))*) => {
        $(impl<$($t: Col),+> FromRow for ($($t,)+) {
            fn from_row<DB: Driver>(row: &DB::Row) -> Result<Self, sqlx::Error> {
                Ok(($($t::get::<DB>(row, $i)?,)+))
            }
        })*
    };
}

from_row! {
    (A 0)
    (A 0, B 1)
    (A 0, B 1, C 2)
    (A 0, B 1, C 2, D 3)
    (A 0, B 1, C 2, D 3, E 4)
    (A 0, B 1, C 2, D 3, E 4, F 5)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12)
    (A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13)
}

/// A statement with its binds, to run on a connection or a pool.
pub(crate) struct Bound<DB: Driver> {
    sql: sqlx::SqlStr,
    args: Result<DB::Arguments, BoxDynError>,
    persistent: bool,
}

impl<DB: Driver> Bound<DB> {
    /// `template` with `binds` (the statement's, in its declared order) added in the order
    /// its text names them.
    pub(crate) fn new(template: &Template, binds: &[&dyn Bind]) -> Self {
        let mut args = DB::Arguments::default();
        sqlx::Arguments::reserve(&mut args, template.order.len(), 0);
        let added = template
            .order
            .iter()
            .try_for_each(|&i| DB::add(&mut args, binds[usize::from(i)].value()));
        Bound {
            sql: template.sql.clone(),
            args: added.map(|()| args),
            persistent: template.persistent,
        }
    }

    fn query(self) -> sqlx::query::Query<'static, DB, ImmutableArguments<DB>> {
        sqlx_core::query::query_with_result(self.sql, self.args.map(ImmutableArguments))
            .persistent(self.persistent)
    }

    /// The same binds on another text with the same placeholders (MariaDB's statement with
    /// its lock wait bounded).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn on(mut self, sql: sqlx::SqlStr) -> Self {
        self.sql = sql;
        self
    }

    /// The statement's text.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn text(&self) -> &str {
        self.sql.as_str()
    }

    /// Behind a pooler in transaction mode (the statements are unnamed, see `Table::unnamed`),
    /// a statement with binds outside a transaction runs in one of its own: sqlx sends it in
    /// two steps, which such a pooler may run on two server connections.
    fn pinned(&self, conn: &DB::Connection) -> bool {
        !self.persistent && !conn.is_in_transaction()
    }
}

/// Where a statement runs: a connection (perhaps in a transaction), or any of a pool's.
pub(crate) enum On<'a, DB: Database> {
    Conn(&'a mut DB::Connection),
    Pool(&'a Pool<DB>),
}

impl<'a, DB: Database> From<&'a Pool<DB>> for On<'a, DB> {
    fn from(pool: &'a Pool<DB>) -> Self {
        On::Pool(pool)
    }
}

/// The ways a statement's answer is read, each run on a connection of [`On`], in a
/// transaction of its own where [`Bound::pinned`] says so.
macro_rules! runs {
    ($(
        $(#[$meta:meta])*
        $name:ident$(<$r:ident>)? -> $out:ty = |$q:ident, $e:ident| $run:expr;
    )*) => {
        impl<DB: Driver> Bound<DB> {
            $(
                $(#[$meta])*
                pub(crate) async fn $name<'a, $($r: FromRow)?>(
                    self,
                    on: impl Into<On<'a, DB>>,
                ) -> Result<$out, sqlx::Error> {
                    let mut acquired;
                    let conn: &mut DB::Connection = match on.into() {
                        On::Conn(conn) => conn,
                        On::Pool(pool) => {
                            acquired = pool.acquire().await?;
                            &mut acquired
                        }
                    };
                    if !self.pinned(conn) {
                        let ($q, $e) = (self.query(), DB::exec(conn));
                        return $run;
                    }
                    let mut tx = conn.begin().await?;
                    let out = {
                        let ($q, $e) = (self.query(), DB::exec(&mut tx));
                        $run
                    }?;
                    tx.commit().await?;
                    Ok(out)
                }
            )*
        }
    };
}

runs! {
    /// Runs it; returns the rows it changed.
    execute -> u64 = |q, e| q.execute(e).await.map(|done| DB::affected(&done));
    /// Runs it; returns what the database answered (MySQL's insert id).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    result -> DB::QueryResult = |q, e| q.execute(e).await;
    /// Runs it; returns every row it answered.
    fetch_all<R> -> Vec<R> =
        |q, e| q.fetch_all(e).await?.iter().map(R::from_row::<DB>).collect::<Result<_, _>>();
    /// Runs it; returns the first row it answered, if any.
    fetch_optional<R> -> Option<R> =
        |q, e| q.fetch_optional(e).await?.as_ref().map(R::from_row::<DB>).transpose();
}

/// [`Driver`] for one sqlx database: every kind of value bound and read as sqlx encodes and
/// decodes it, but for a list of keys (`keys`) and text read from a byte string (`text`).
macro_rules! driver {
    (
        $db:ty, $placeholders:expr,
        keys: |$keys:ident| $list:expr,
        text: |$row:ident, $i:ident| $text:expr $(,)?
    ) => {
        impl $crate::backend::bind::Driver for $db {
            const PLACEHOLDERS: $crate::backend::sql::Placeholders = $placeholders;

            fn exec<'c>(
                conn: &'c mut Self::Connection,
            ) -> impl ::sqlx::Executor<'c, Database = Self> + 'c {
                conn
            }

            fn affected(done: &Self::QueryResult) -> u64 {
                done.rows_affected()
            }

            fn add(
                args: &mut Self::Arguments,
                value: $crate::backend::bind::Value<'_>,
            ) -> ::core::result::Result<(), ::sqlx::error::BoxDynError> {
                use ::sqlx::Arguments as _;
                use $crate::backend::bind::Value;
                match value {
                    Value::Str(v) => args.add(v),
                    Value::OptStr(v) => args.add(v),
                    Value::Int(v) => args.add(v),
                    Value::OptInt(v) => args.add(v),
                    Value::Int32(v) => args.add(v),
                    Value::Bool(v) => args.add(v),
                    Value::Bytes(v) => args.add(v),
                    Value::OptBytes(v) => args.add(v),
                    Value::Keys($keys) => args.add($list),
                }
            }

            fn get(
                $row: &Self::Row,
                $i: usize,
                kind: $crate::backend::bind::Kind,
            ) -> ::core::result::Result<$crate::backend::bind::Got, ::sqlx::Error> {
                use ::sqlx::Row as _;
                use $crate::backend::bind::{Got, Kind};
                Ok(match kind {
                    Kind::Text => Got::Text($text?),
                    Kind::OptText => Got::OptText(match $row.try_get_raw($i)? {
                        raw if ::sqlx::ValueRef::is_null(&raw) => None,
                        _ => Some($text?),
                    }),
                    Kind::Int => Got::Int($row.try_get($i)?),
                    Kind::OptInt => Got::OptInt($row.try_get($i)?),
                    Kind::Int32 => Got::Int32($row.try_get($i)?),
                    Kind::Bytes => Got::Bytes($row.try_get($i)?),
                    Kind::OptBytes => Got::OptBytes($row.try_get($i)?),
                })
            }
        }
    };
}
pub(crate) use driver;

impl<'a, DB: Database> From<&'a mut DB::Connection> for On<'a, DB> {
    fn from(conn: &'a mut DB::Connection) -> Self {
        On::Conn(conn)
    }
}

/// A set of statements for one table, declared once for every backend: each statement's binds
/// by name and type, in the order callers pass them. Each backend writes the texts
/// (`$text`, a struct with one field per statement; an `optional` statement is one that only
/// some backends run, an `Option` there):
///
/// ```text
/// statements! {
///     /// The lease holder's statements.
///     pub(crate) struct LeaseSql, LeaseText {
///         release(scope: &str, key: &str, token: i64);
///     } optional {
///         claim(scope: &str, key: &str, lease_ms: i64);
///     }
/// }
/// ```
///
/// gives `LeaseSql::<DB>::new(&table, text)`, and `sql.release(scope, key, token) ->
/// Bound<DB>` (`Option<Bound<DB>>` for an optional one) binding its values in the order the
/// backend's text names them.
macro_rules! statements {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident, $text:ident {
            $(
                $(#[$fmeta:meta])*
                $field:ident($($arg:ident: $ty:ty),* $(,)?);
            )*
        }
        $(
            optional {
                $(
                    $(#[$ometa:meta])*
                    $ofield:ident($($oarg:ident: $oty:ty),* $(,)?);
                )*
            }
        )?
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        $vis struct $name<DB> {
            $($field: $crate::backend::sql::Template,)*
            $($($ofield: ::core::option::Option<$crate::backend::sql::Template>,)*)?
            _db: ::core::marker::PhantomData<fn() -> DB>,
        }

        #[doc = concat!("What a backend writes for [`", stringify!($name), "`]: each \
            statement's text, `{t}` for the table and `:name` for a bind.")]
        $vis struct $text {
            $($(#[$fmeta])* $vis $field: $crate::backend::sql::Text,)*
            $($($(#[$ometa])* $vis $ofield: ::core::option::Option<$crate::backend::sql::Text>,)*)?
        }

        impl $text {
            /// Each statement's name, text and binds, for the backends' unit tests.
            #[cfg(test)]
            #[allow(dead_code, unused_mut, reason = "a backend without optional statements")]
            pub(crate) fn each(&self) -> ::std::vec::Vec<(&'static str, &str, &'static [&'static str])> {
                let mut each = ::std::vec![$((
                    stringify!($field),
                    &*self.$field,
                    &[$(stringify!($arg)),*][..],
                ),)*];
                $($(
                    if let ::core::option::Option::Some(text) = &self.$ofield {
                        each.push((stringify!($ofield), &**text, &[$(stringify!($oarg)),*][..]));
                    }
                )*)?
                each
            }
        }

        impl<DB: $crate::backend::bind::Driver> $name<DB> {
            $vis fn new(table: &$crate::backend::sql::Table, text: &$text) -> Self {
                let style = <DB as $crate::backend::bind::Driver>::PLACEHOLDERS;
                $name {
                    $($field: $crate::backend::sql::Template::new(
                        table, &text.$field, &[$(stringify!($arg)),*], style,
                    ),)*
                    $($($ofield: text.$ofield.as_ref().map(|text| {
                        $crate::backend::sql::Template::new(
                            table, text, &[$(stringify!($oarg)),*], style,
                        )
                    }),)*)?
                    _db: ::core::marker::PhantomData,
                }
            }

            $(
                $(#[$fmeta])*
                #[allow(clippy::too_many_arguments, reason = "one argument per bind of the statement")]
                $vis fn $field(&self, $($arg: $ty),*) -> $crate::backend::bind::Bound<DB> {
                    $crate::backend::bind::Bound::new(&self.$field, &[$(&$arg),*])
                }
            )*
            $($(
                $(#[$ometa])*
                #[allow(clippy::too_many_arguments, reason = "one argument per bind of the statement")]
                $vis fn $ofield(
                    &self,
                    $($oarg: $oty),*
                ) -> ::core::option::Option<$crate::backend::bind::Bound<DB>> {
                    let template = self.$ofield.as_ref()?;
                    ::core::option::Option::Some(
                        $crate::backend::bind::Bound::new(template, &[$(&$oarg),*]),
                    )
                }
            )*)?
        }
    };
    // A backend's own statements, their texts inline: `name(binds) = text;`.
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$fmeta:meta])*
                $field:ident($($arg:ident: $ty:ty),* $(,)?) = $sql:expr;
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        $vis struct $name<DB> {
            $($field: $crate::backend::sql::Template,)*
            _db: ::core::marker::PhantomData<fn() -> DB>,
        }

        impl<DB: $crate::backend::bind::Driver> $name<DB> {
            $vis fn new(table: &$crate::backend::sql::Table) -> Self {
                let style = <DB as $crate::backend::bind::Driver>::PLACEHOLDERS;
                $name {
                    $($field: $crate::backend::sql::Template::new(
                        table, &$sql, &[$(stringify!($arg)),*], style,
                    ),)*
                    _db: ::core::marker::PhantomData,
                }
            }

            $(
                $(#[$fmeta])*
                #[allow(clippy::too_many_arguments, reason = "one argument per bind of the statement")]
                $vis fn $field(&self, $($arg: $ty),*) -> $crate::backend::bind::Bound<DB> {
                    $crate::backend::bind::Bound::new(&self.$field, &[$(&$arg),*])
                }
            )*

            /// Each statement's name, text and binds, for the backend's unit test.
            #[cfg(test)]
            pub(crate) fn each() -> ::std::vec::Vec<(&'static str, ::std::string::String, &'static [&'static str])> {
                ::std::vec![$((
                    stringify!($field),
                    ::std::string::String::from(&*$sql),
                    &[$(stringify!($arg)),*][..],
                ),)*]
            }
        }
    };
}
pub(crate) use statements;
