//! The few statements the cases and their handlers run, behind one trait so that handlers can
//! be generic over the database (`async fn apply<DB: TestDb>(tx: &mut Transaction<'_, DB>, ..)`).
//!
//! Why a trait and not sqlx's generic API: a generic `sqlx::query(..).bind(..).execute(..)`
//! needs a where-clause wall (`for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>`,
//! `i64: Encode<DB> + Type<DB>`, `DB::Arguments: IntoArguments<DB>`, ...) that every generic
//! handler and case would have to repeat, because where-clauses on associated types are not
//! implied by a bound. The trait states them once; the impls below are the same code for each
//! concrete database, written once by a macro that only defines these impls.

use std::future::Future;

use sqlx::{AssertSqlSafe, MySql, Postgres, Sqlite};

/// A bound parameter.
#[derive(Clone, Debug)]
pub(crate) enum Bind {
    I64(i64),
    Str(String),
}

/// A database the suite runs on.
pub(crate) trait TestDb: idem::Backend {
    /// `sql` written with `$1, $2, ...`, in this database's placeholder style.
    fn sql(sql: &str) -> String {
        sql.to_owned()
    }

    /// Runs one statement; returns the rows it affected.
    fn execute<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// The first column of the only row of `sql`, as `i64`.
    fn fetch_i64<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind],
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

    /// The first column of every row of `sql`, as text.
    fn fetch_strings<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 'a;
}

macro_rules! test_db {
    ($($db:ty => $convert:path),* $(,)?) => {$(
        impl TestDb for $db {
            fn sql(sql: &str) -> String {
                $convert(sql)
            }

            async fn execute<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
                binds: &'a [Bind],
            ) -> Result<u64, sqlx::Error> {
                let mut q = sqlx::query::<$db>(AssertSqlSafe(Self::sql(sql)));
                for b in binds {
                    q = match b {
                        Bind::I64(v) => q.bind(*v),
                        Bind::Str(s) => q.bind(s.clone()),
                    };
                }
                Ok(q.execute(conn).await?.rows_affected())
            }

            async fn fetch_i64<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
                binds: &'a [Bind],
            ) -> Result<i64, sqlx::Error> {
                let mut q = sqlx::query_scalar::<$db, i64>(AssertSqlSafe(Self::sql(sql)));
                for b in binds {
                    q = match b {
                        Bind::I64(v) => q.bind(*v),
                        Bind::Str(s) => q.bind(s.clone()),
                    };
                }
                q.fetch_one(conn).await
            }

            async fn fetch_strings<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
            ) -> Result<Vec<String>, sqlx::Error> {
                sqlx::query_scalar::<$db, String>(AssertSqlSafe(Self::sql(sql)))
                    .fetch_all(conn)
                    .await
            }
        }
    )*};
}

fn unchanged(sql: &str) -> String {
    sql.to_owned()
}

test_db!(
    Postgres => unchanged,
    Sqlite => unchanged,
    MySql => crate::conformance::util::question_marks,
);
