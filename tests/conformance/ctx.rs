//! One test's world: a connected pool, a migrated marker table and an effects table, all new,
//! and the counts the assertions read back from the database.

use idem::Store;
use sqlx::Pool;

use super::Support;
use super::db::{Bind, TestDb};
use super::handlers::Job;
use super::util::unique_name;

pub(crate) struct Ctx<S: Support> {
    pub(crate) url: String,
    pub(crate) pool: Pool<S::Db>,
    pub(crate) store: Store<S::Db>,
    pub(crate) effects: String,
    pub(crate) tag: String,
    pub(crate) tables: Vec<String>,
}

impl<S: Support> Ctx<S> {
    pub(crate) async fn new(tag: &str, connections: u32) -> Ctx<S> {
        let url = S::url();
        let pool = S::connect(&url, connections).await;
        let markers = unique_name("m", tag);
        let store = Store::new(pool.clone())
            .with_table(&markers)
            .expect("generated table names are identifiers");
        S::migrate(&store).await;
        let mut ctx = Ctx {
            url,
            pool,
            store,
            effects: String::new(),
            tag: tag.to_owned(),
            tables: vec![markers],
        };
        ctx.effects = ctx
            .create_table(
                "e",
                "(id BIGINT NOT NULL, amount BIGINT NOT NULL, origin VARCHAR(32) NOT NULL)",
            )
            .await;
        ctx
    }

    /// `CREATE TABLE <new name> <columns>`; the name is returned.
    pub(crate) async fn create_table(&mut self, kind: &str, columns: &str) -> String {
        let name = unique_name(kind, &self.tag);
        self.exec(&format!("CREATE TABLE {name} {columns}")).await;
        self.tables.push(name.clone());
        name
    }

    pub(crate) fn job(&self, key: &str, id: i64, amount: i64) -> Job {
        Job {
            key: key.to_owned(),
            id,
            amount,
            effects: self.effects.clone(),
        }
    }

    pub(crate) async fn exec(&self, sql: &str) {
        let mut conn = self.pool.acquire().await.expect("a connection");
        S::Db::execute(&mut conn, sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    pub(crate) async fn scalar(&self, sql: &str) -> i64 {
        self.scalar_with(sql, &[]).await
    }

    pub(crate) async fn scalar_with(&self, sql: &str, binds: &[Bind]) -> i64 {
        let mut conn = self.pool.acquire().await.expect("a connection");
        S::Db::fetch_i64(&mut conn, sql, binds)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Rows in the marker table.
    pub(crate) async fn markers(&self) -> i64 {
        self.scalar(&format!("SELECT COUNT(*) FROM {}", self.store.table()))
            .await
    }

    /// Effect rows of job `id` (from any handler).
    pub(crate) async fn effects(&self, id: i64) -> i64 {
        self.scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE id = {id}",
            self.effects
        ))
        .await
    }

    /// Effect rows of job `id` written by the handler `origin`.
    pub(crate) async fn effects_from(&self, id: i64, origin: &str) -> i64 {
        self.scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE id = {id} AND origin = '{origin}'",
            self.effects
        ))
        .await
    }

    pub(crate) async fn effects_total(&self) -> i64 {
        self.scalar(&format!("SELECT COUNT(*) FROM {}", self.effects))
            .await
    }

    /// The keys stored in the marker table, sorted.
    pub(crate) async fn stored_keys(&self) -> Vec<String> {
        let sql = format!("SELECT {} FROM {}", S::KEY_TEXT, self.store.table());
        let mut conn = self.pool.acquire().await.expect("a connection");
        let mut keys = S::Db::fetch_strings(&mut conn, &sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        keys.sort();
        keys
    }

    /// Sessions blocked on a row lock while running a statement on this test's marker table
    /// (the claims queued behind the key), or `None` where SQL cannot see them.
    pub(crate) async fn claims_waiting(&self) -> Option<i64> {
        let sql = S::LOCK_WAITERS?;
        // The query filters on the marker table, whose name is unique to this test, so waiters
        // of other tests (and of other engineers' runs on the same server) do not count.
        let table = self.store.table().to_owned();
        Some(self.scalar_with(sql, &[Bind::Str(table)]).await)
    }

    /// Drops the test's tables (a failing test keeps them for inspection).
    pub(crate) async fn cleanup(self) {
        for t in &self.tables {
            self.exec(&format!("DROP TABLE {t}")).await;
            // A marker table's `migrate` made its outbox too (schema version 2), and its
            // steps (version 3).
            self.exec(&format!("DROP TABLE IF EXISTS {t}_outbox")).await;
            // And its retention and steps tables (schema version 3).
            self.exec(&format!("DROP TABLE IF EXISTS {t}_retention"))
                .await;
            self.exec(&format!("DROP TABLE IF EXISTS {t}_steps")).await;
            // And its offset watermarks (schema version 3).
            self.exec(&format!("DROP TABLE IF EXISTS {t}_offsets"))
                .await;
            // And its operators' audit log (schema version 5).
            self.exec(&format!("DROP TABLE IF EXISTS {t}_audit")).await;
        }
        self.pool.close().await;
        S::remove(&self.url);
    }
}
