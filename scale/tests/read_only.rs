//! A read-only server refuses every mode with [`idem::Error::ReadOnly`], which says so and
//! what to do, and never reports `Applied`: PostgreSQL with `default_transaction_read_only`
//! on (what a hot standby answers too: SQLSTATE 25006; the standby itself is in
//! `tests/standby.rs`), and MariaDB in a read-only session.

use std::time::Duration;

use idem::{Key, LeaseOptions, Outcome, Store};
use idem_scale::bouncer::postgres_url;
use idem_scale::jobs::{self, AppError, Job};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor as _, MySql, PgPool};

/// The error of a refused call: `ReadOnly`, saying so, transient (a redelivery lands once the
/// pool reaches the primary).
fn assert_read_only(what: &str, err: idem::Error) {
    let msg = err.to_string();
    assert!(
        matches!(err, idem::Error::ReadOnly(_)),
        "{what}: expected ReadOnly, got {err:?}"
    );
    assert!(
        msg.contains("read-only") && msg.contains("primary"),
        "{what}: the message says why and what to do: {msg}"
    );
    assert!(err.is_transient(), "{what}: {msg}");
}

fn refused<T: std::fmt::Debug>(what: &str, result: Result<Outcome<T>, AppError>) {
    match result {
        Err(e) => assert_read_only(what, e.idem()),
        Ok(outcome) => panic!("{what}: a read-only server answered {outcome:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_on_a_read_only_postgresql_is_refused_with_read_only() {
    let url = postgres_url();
    let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    let writable = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.clone())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
    let markers = jobs::unique("scale_ro_markers");
    let effects = jobs::unique("scale_ro_effects");
    Store::new(writable.clone())
        .with_table(&markers)
        .expect("a name")
        .migrate()
        .await
        .expect("migrate");
    jobs::create_effects(&writable, &effects).await;

    // Every session of this pool is read-only, as every session on a hot standby is.
    let read_only: PgPool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.options([("default_transaction_read_only", "on")]))
        .await
        .expect("connect read-only");
    let store = Store::new(read_only.clone())
        .with_table(&markers)
        .expect("a name");
    let job = Job {
        key: "job-1".into(),
        amount: 1,
        effects: effects.clone(),
    };

    refused("transaction", jobs::in_transaction(&store, &job).await);
    refused("replay", jobs::replayed(&store, &job).await);
    refused("wait", jobs::waiting(&store, &job).await);
    refused("lease", jobs::leased(&store, &job, &read_only).await);
    let mut tx = read_only.begin().await.expect("begin");
    refused("joined", jobs::joined(store.join(&mut tx), &job).await);
    drop(tx);
    match jobs::batch(&store, std::slice::from_ref(&job)).await {
        Err(e) => assert_read_only("batch", e.idem()),
        Ok(done) => panic!("batch: a read-only server answered {:?}", done.outcomes()),
    }

    // Nothing was written: no marker, no effect.
    assert_eq!(jobs::rows(&writable, &markers).await, 0, "markers");
    assert_eq!(jobs::rows(&writable, &effects).await, 0, "effects");
    jobs::drop_tables(&writable, &[&markers, &effects]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_read_only_mariadb_session_is_refused_with_read_only() {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let writable = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url} (IDEM_MYSQL_URL): {e}"));
    let markers = jobs::unique("scale_ro");
    let store = Store::<MySql>::new(writable.clone())
        .with_table(&markers)
        .expect("a name");
    store.migrate().await.expect("migrate");

    let read_only = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION READ ONLY").await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .expect("connect read-only");
    let store = store_on(read_only, &markers);
    let key = Key::new("job-1").expect("a key");
    match store.claim("scale.read_only", &key).await {
        Err(e) => assert_read_only("MariaDB transaction claim", e),
        Ok(claimed) => panic!("MariaDB: a read-only session claimed: {claimed:?}"),
    }
    let lease = LeaseOptions::new(Duration::from_secs(30));
    match store.lease("scale.read_only", &key, lease).await {
        Err(e) => assert_read_only("MariaDB lease", e),
        Ok(claimed) => panic!("MariaDB: a read-only session leased: {claimed:?}"),
    }
    let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {markers}"
    )))
    .fetch_one(&writable)
    .await
    .expect("count markers");
    assert_eq!(count, 0, "no marker written");
    for suffix in ["", "_outbox", "_retention", "_steps", "_offsets"] {
        drop(
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP TABLE IF EXISTS {markers}{suffix}"
            )))
            .execute(&writable)
            .await,
        );
    }
}

fn store_on(pool: sqlx::MySqlPool, table: &str) -> Store<MySql> {
    Store::new(pool).with_table(table).expect("a name")
}
