//! The kit on the server databases: the `top_up` example's handler on PostgreSQL (with a
//! joined call and a broken copy that writes in autocommit), and the same top-up on MySQL.

use idem::Store;
use idem::testing::{Got, deliver_concurrently, deliver_twice, fail_before_commit};
use idem_examples::top_up;
use sqlx::{MySql, MySqlPool, PgPool, Postgres, Transaction};

use crate::panic_of;

// --- The classic top-up, PostgreSQL ---------------------------------------------------------

/// A fresh account with 100 credits, and the top-up job of 50 for it.
async fn postgres_account() -> (PgPool, Store<Postgres>, top_up::TopUp) {
    let url = top_up::database_url();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url} (IDEM_POSTGRES_URL): {e}"));
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (id bigserial PRIMARY KEY, credits bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let account_id: i64 =
        sqlx::query_scalar("INSERT INTO accounts (credits) VALUES (100) RETURNING id")
            .fetch_one(&pool)
            .await
            .unwrap();
    let job = top_up::TopUp {
        id: format!("kit-top-up-{account_id}"),
        account_id,
        credits: 50,
    };
    (pool, store, job)
}

async fn credits(pool: &PgPool, account_id: i64) -> i64 {
    sqlx::query_scalar("SELECT credits FROM accounts WHERE id = $1")
        .bind(account_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn top_up_twice_applies_once() {
    let (pool, store, job) = postgres_account().await;
    let report = deliver_twice(
        || top_up::apply_top_up(&store, &job),
        || credits(&pool, job.account_id),
        150,
    )
    .await;
    assert_eq!(report.got(), [Got::Applied, Got::Duplicate], "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_up_eight_at_once_apply_once() {
    let (pool, store, job) = postgres_account().await;
    let report = deliver_concurrently(
        8,
        || top_up::apply_top_up(&store, &job),
        || credits(&pool, job.account_id),
        150,
    )
    .await;
    // No `wait`: the others queue on the marker's row lock, then see it committed.
    let mut got = report.got();
    got.sort_by_key(|g| *g != Got::Applied);
    assert_eq!(
        got,
        [&[Got::Applied][..], &[Got::Duplicate; 7]].concat(),
        "{report}"
    );
}

#[tokio::test]
async fn top_up_failed_commit_is_rolled_back_and_redelivered() {
    let (pool, store, job) = postgres_account().await;
    let report = fail_before_commit(
        || top_up::apply_top_up(&store, &job),
        || credits(&pool, job.account_id),
        150,
    )
    .await;
    assert_eq!(
        report.got(),
        [Got::Injected, Got::Applied, Got::Duplicate],
        "{report}"
    );
}

#[tokio::test]
async fn top_up_joined_to_the_callers_transaction() {
    let (pool, store, job) = postgres_account().await;
    let (pool_ref, store, job_ref) = (&pool, &store, &job);
    // The worker's own transaction around the call: the claim is a savepoint in it, and the
    // kit fails the call right before that savepoint is released.
    let joined = move || async move {
        let mut tx = pool_ref.begin().await?;
        let outcome = top_up::apply_top_up(store.join(&mut tx), job_ref).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(outcome)
    };
    let report = fail_before_commit(joined, || credits(&pool, job.account_id), 150).await;
    assert_eq!(
        report.got(),
        [Got::Injected, Got::Applied, Got::Duplicate],
        "{report}"
    );
    assert!(
        report.deliveries()[0]
            .idem_error()
            .is_some_and(|e| e.contains("right before its savepoint release")),
        "{report}"
    );
}

/// Broken on purpose: the `UPDATE` runs on the pool, in autocommit, not on `tx`.
#[idem::idempotent(key = "job.id", scope = "billing.top_up_autocommit")]
async fn top_up_outside_tx(
    tx: &mut Transaction<'_, Postgres>,
    job: &top_up::TopUp,
    pool: &PgPool,
) -> Result<(), sqlx::Error> {
    let _ = tx;
    sqlx::query("UPDATE accounts SET credits = credits + $1 WHERE id = $2")
        .bind(job.credits)
        .bind(job.account_id)
        .execute(pool)
        .await?;
    Ok(())
}

#[tokio::test]
async fn an_effect_outside_the_transaction_is_caught() {
    let (pool, store, job) = postgres_account().await;
    // Delivered twice it looks fine: the marker skips the second delivery.
    let twice = deliver_twice(
        || top_up_outside_tx(&store, &job, &pool),
        || credits(&pool, job.account_id),
        150,
    )
    .await;
    assert_eq!(twice.got(), [Got::Applied, Got::Duplicate], "{twice}");

    let (pool, store, job) = postgres_account().await;
    let message = panic_of(fail_before_commit(
        || top_up_outside_tx(&store, &job, &pool),
        || credits(&pool, job.account_id),
        150,
    ))
    .await;
    assert!(
        message.starts_with(
            "idem::testing::fail_before_commit: after delivery 1 was rolled back, the check \
             read 150, not 100 as before it: its effect outlived the rollback.\nthe handler \
             writes outside the transaction it is given"
        ),
        "{message}"
    );
    // The kit ran every delivery before it judged: the broken handler applied twice.
    assert!(
        message.contains("the check read 200 after delivery 2"),
        "{message}"
    );
    assert_eq!(credits(&pool, job.account_id).await, 200);
}

// --- The same top-up on MySQL / MariaDB ---------------------------------------------------

#[idem::idempotent(key = "job.id", scope = "billing.top_up_mysql")]
async fn top_up_mysql(
    tx: &mut Transaction<'_, MySql>,
    job: &top_up::TopUp,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE kit_accounts SET credits = credits + ? WHERE id = ?")
        .bind(job.credits)
        .bind(job.account_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn mysql_account() -> (MySqlPool, Store<MySql>, top_up::TopUp) {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach MySQL at {url} (IDEM_MYSQL_URL): {e}"));
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS kit_accounts \
         (id BIGINT AUTO_INCREMENT PRIMARY KEY, credits BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let done = sqlx::query("INSERT INTO kit_accounts (credits) VALUES (100)")
        .execute(&pool)
        .await
        .unwrap();
    let account_id = i64::try_from(done.last_insert_id()).unwrap();
    let job = top_up::TopUp {
        id: format!("kit-top-up-{account_id}"),
        account_id,
        credits: 50,
    };
    (pool, store, job)
}

async fn mysql_credits(pool: &MySqlPool, account_id: i64) -> i64 {
    sqlx::query_scalar("SELECT credits FROM kit_accounts WHERE id = ?")
        .bind(account_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_top_up_eight_at_once_apply_once() {
    let (pool, store, job) = mysql_account().await;
    let report = deliver_concurrently(
        8,
        || top_up_mysql(&store, &job),
        || mysql_credits(&pool, job.account_id),
        150,
    )
    .await;
    let mut got = report.got();
    got.sort_by_key(|g| *g != Got::Applied);
    assert_eq!(
        got,
        [&[Got::Applied][..], &[Got::Duplicate; 7]].concat(),
        "{report}"
    );
}

#[tokio::test]
async fn mysql_top_up_failed_commit_is_rolled_back_and_redelivered() {
    let (pool, store, job) = mysql_account().await;
    let report = fail_before_commit(
        || top_up_mysql(&store, &job),
        || mysql_credits(&pool, job.account_id),
        150,
    )
    .await;
    assert_eq!(
        report.got(),
        [Got::Injected, Got::Applied, Got::Duplicate],
        "{report}"
    );
}
