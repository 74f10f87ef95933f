//! The databases of the layer's tests: an effects table to write in the claimed transaction,
//! counts, pools, and each test's own tables.

use std::pin::Pin;

use idem::Store;
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres, Sqlite};

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What the tests need of a database besides idem's store: an effects table to write in the
/// claimed transaction, and counts.
pub(crate) trait Db: idem::Backend + sqlx::Database {
    fn create<'a>(pool: &'a Pool<Self>, table: &'a str) -> BoxFuture<'a, ()>;
    fn write<'a>(
        conn: &'a mut Self::Connection,
        table: &'a str,
        body: String,
    ) -> BoxFuture<'a, sqlx::Result<i64>>;
    fn run<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, ()>;
    fn scalar<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, i64>;
    fn count<'a>(pool: &'a Pool<Self>, table: &'a str) -> BoxFuture<'a, i64> {
        Self::scalar(pool, format!("SELECT COUNT(*) FROM {table}"))
    }
}

macro_rules! db {
    ($db:ty, $conn:ty, $id:literal, $ph:literal) => {
        impl Db for $db {
            fn create<'a>(pool: &'a Pool<Self>, table: &'a str) -> BoxFuture<'a, ()> {
                Box::pin(async move {
                    for sql in [
                        format!("DROP TABLE IF EXISTS {table}"),
                        format!("CREATE TABLE {table} (id {}, body TEXT NOT NULL)", $id),
                    ] {
                        sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
                    }
                })
            }
            fn write<'a>(
                conn: &'a mut $conn,
                table: &'a str,
                body: String,
            ) -> BoxFuture<'a, sqlx::Result<i64>> {
                let sql = format!("INSERT INTO {table} (body) VALUES ({}) RETURNING id", $ph);
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(body)
                        .fetch_one(conn)
                        .await
                })
            }
            fn run<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, ()> {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
                })
            }
            fn scalar<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, i64> {
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .fetch_one(pool)
                        .await
                        .unwrap()
                })
            }
        }
    };
}

db!(Postgres, sqlx::PgConnection, "BIGSERIAL PRIMARY KEY", "$1");
db!(Sqlite, sqlx::SqliteConnection, "INTEGER PRIMARY KEY", "?");
db!(
    MySql,
    sqlx::MySqlConnection,
    "BIGINT AUTO_INCREMENT PRIMARY KEY",
    "?"
);

pub(crate) fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

pub(crate) async fn postgres() -> Pool<Postgres> {
    crate::support::postgres(40).await
}

pub(crate) async fn mariadb() -> Pool<MySql> {
    let url = mysql_url();
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(40)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach MariaDB at {url} (IDEM_MYSQL_URL): {e}"))
}

pub(crate) async fn sqlite(path: &std::path::Path) -> Pool<Sqlite> {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap()
}

pub(crate) fn temp_db(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-test-http-{name}-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&dir));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("app.db")
}

/// The test's own tables: markers and effects.
pub(crate) struct Tables<DB: Db> {
    pub(crate) pool: Pool<DB>,
    pub(crate) store: Store<DB>,
    pub(crate) effects: String,
    /// The tables' suffix, with this process's id: runs at once against one server (two
    /// worktrees) never share a table.
    pub(crate) name: String,
}

impl<DB: Db> Tables<DB> {
    pub(crate) async fn new(pool: Pool<DB>, name: &str) -> Self {
        let name = format!("{name}_p{}", std::process::id());
        let markers = format!("http_markers_{name}");
        let effects = format!("http_effects_{name}");
        DB::run(&pool, format!("DROP TABLE IF EXISTS {markers}")).await;
        let store = Store::new(pool.clone()).with_table(&markers).unwrap();
        store.migrate().await.unwrap();
        DB::create(&pool, &effects).await;
        Tables {
            pool,
            store,
            effects,
            name,
        }
    }

    /// Drops the test's tables once it passed.
    pub(crate) async fn drop_all(self) {
        for table in [self.store.table(), &self.effects] {
            DB::run(&self.pool, format!("DROP TABLE IF EXISTS {table}")).await;
        }
    }

    /// (markers, effects)
    pub(crate) async fn counts(&self) -> (i64, i64) {
        (
            DB::count(&self.pool, self.store.table()).await,
            DB::count(&self.pool, &self.effects).await,
        )
    }
}

impl<DB: Db> Tables<DB> {
    /// The tables the parent test made.
    pub(crate) fn open(pool: Pool<DB>, name: &str) -> Self {
        let store = Store::new(pool.clone())
            .with_table(&format!("http_markers_{name}"))
            .unwrap();
        Tables {
            pool,
            store,
            effects: format!("http_effects_{name}"),
            name: name.to_owned(),
        }
    }
}
