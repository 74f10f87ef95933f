//! `idem::testing` on the examples' own handlers, against real databases: the quickstart's
//! top-up on SQLite, the classic top-up on PostgreSQL, and `charge_once` in lease mode with
//! the payments API on loopback. Deliberately broken copies of those handlers show that the
//! kit catches what it claims to catch, with a message that says so.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::time::Duration;

use futures_util::FutureExt as _;
use idem::Store;
use idem::testing::{Got, deliver_concurrently, deliver_twice, expire_lease, fail_before_commit};
use idem_examples::charge::{Api, Charge, ChargeError, charge_once};
use idem_examples::payments::{ChargeRequest, PaymentsApi, Receipt};
use idem_examples::{quickstart, top_up};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{MySql, MySqlPool, PgPool, Postgres, Sqlite, SqlitePool, Transaction};

/// A SQLite file of its own for each test, removed when the test ends.
struct SqliteFile {
    dir: PathBuf,
    pool: SqlitePool,
    store: Store<Sqlite>,
}

impl SqliteFile {
    async fn new(test: &str) -> SqliteFile {
        let dir = std::env::temp_dir().join(format!("idem-kit-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let options = SqliteConnectOptions::new()
            .filename(dir.join("jobs.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .connect_with(options)
            .await
            .unwrap();
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        SqliteFile { dir, pool, store }
    }
}

impl Drop for SqliteFile {
    fn drop(&mut self) {
        drop(std::fs::remove_dir_all(&self.dir));
    }
}

// --- The quickstart's handler, SQLite -------------------------------------------------------

async fn quickstart_db(test: &str) -> SqliteFile {
    let db = SqliteFile::new(test).await;
    sqlx::query("CREATE TABLE accounts (name TEXT PRIMARY KEY, credits INTEGER NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO accounts VALUES ('alice', 100)")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

async fn alice(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT credits FROM accounts WHERE name = 'alice'")
        .fetch_one(pool)
        .await
        .unwrap()
}

const ALICE: quickstart::TopUp = quickstart::TopUp {
    id: "top-up-1",
    account: "alice",
    credits: 50,
};

#[tokio::test]
async fn quickstart_twice_applies_once() {
    let db = quickstart_db("twice").await;
    let (store, pool) = (&db.store, &db.pool);
    let report = deliver_twice(
        || quickstart::apply_top_up(store, &ALICE, false),
        || alice(pool),
        150,
    )
    .await;
    assert_eq!(report.got(), [Got::Applied, Got::Duplicate], "{report}");
}

#[tokio::test]
async fn quickstart_eight_at_once_apply_once() {
    let db = quickstart_db("race").await;
    let (store, pool) = (&db.store, &db.pool);
    let report = deliver_concurrently(
        8,
        || quickstart::apply_top_up(store, &ALICE, false),
        || alice(pool),
        150,
    )
    .await;
    // SQLite's other writers wait for the write lock (30 s busy timeout), then find the marker.
    let mut got = report.got();
    got.sort_by_key(|g| *g != Got::Applied);
    assert_eq!(
        got,
        [&[Got::Applied][..], &[Got::Duplicate; 7]].concat(),
        "{report}"
    );
}

#[tokio::test]
async fn quickstart_failed_commit_is_rolled_back_and_redelivered() {
    let db = quickstart_db("commit").await;
    let (store, pool) = (&db.store, &db.pool);
    let report = fail_before_commit(
        || quickstart::apply_top_up(store, &ALICE, false),
        || alice(pool),
        150,
    )
    .await;
    assert_eq!(
        report.got(),
        [Got::Injected, Got::Applied, Got::Duplicate],
        "{report}"
    );
    assert_eq!(
        report.deliveries()[0].idem_error(),
        Some(
            "idem::testing injected a failure into \"billing.top_up\" / \"top-up-1\" right \
             before its commit, as the test asked: nothing was committed by idem (a redelivery \
             must now apply the job once); this error only comes from tests that use \
             idem::testing"
        ),
        "{report}"
    );
    let marker = store.inspect("billing.top_up", "top-up-1").await.unwrap();
    assert_eq!(marker.map(|m| m.attempts), Some(1));
}

/// The quickstart's top-up with `replay`: a duplicate gets the first delivery's new balance.
#[idem::idempotent(key = "job.id", scope = "billing.top_up_replayed", replay)]
async fn top_up_replayed(
    tx: &mut Transaction<'_, Sqlite>,
    job: &quickstart::TopUp,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE accounts SET credits = credits + ?1 WHERE name = ?2 RETURNING credits",
    )
    .bind(job.credits)
    .bind(job.account)
    .fetch_one(&mut **tx)
    .await
}

#[tokio::test]
async fn replayed_values_are_the_first_deliverys() {
    let db = quickstart_db("replay").await;
    let (store, pool) = (&db.store, &db.pool);
    let report = deliver_twice(|| top_up_replayed(store, &ALICE), || alice(pool), 150).await;
    assert_eq!(report.got(), [Got::Applied, Got::Replayed], "{report}");
    let returned: Vec<_> = report.deliveries().iter().map(|d| d.returned()).collect();
    assert_eq!(returned, ["Ok(Applied(150))", "Ok(Replayed(150))"]);

    let db = quickstart_db("replay-commit").await;
    let (store, pool) = (&db.store, &db.pool);
    let report = fail_before_commit(|| top_up_replayed(store, &ALICE), || alice(pool), 150).await;
    assert_eq!(
        report.got(),
        [Got::Injected, Got::Applied, Got::Replayed],
        "{report}"
    );
}

#[tokio::test]
async fn a_check_that_already_holds_is_refused() {
    let db = quickstart_db("refused").await;
    let (store, pool) = (&db.store, &db.pool);
    let message = panic_of(deliver_twice(
        || quickstart::apply_top_up(store, &ALICE, false),
        || alice(pool),
        100,
    ))
    .await;
    assert_eq!(
        message,
        "idem::testing::deliver_twice: the check already reads 100 before any delivery, so \
         it cannot tell whether the job applied; check something the job changes (a fresh \
         account's balance, a count of the job's rows)"
    );
    // Refused before any delivery: the job never ran.
    assert_eq!(alice(pool).await, 100);
    assert!(
        store
            .inspect("billing.top_up", "top-up-1")
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_job_handled_before_the_case_is_refused() {
    let db = quickstart_db("handled").await;
    let (store, pool) = (&db.store, &db.pool);
    let first = || quickstart::apply_top_up(store, &ALICE, false);
    deliver_twice(first, || alice(pool), 150).await;
    // The same job id again: its marker is there, so nothing can apply.
    let message = panic_of(fail_before_commit(first, || alice(pool), 200)).await;
    assert!(
        message.starts_with(
            "idem::testing::fail_before_commit: delivery 1 got Duplicate, so it never reached \
             its commit, where the kit fails it.\nthe kit expects a job no delivery has handled \
             yet: give each case its own job id"
        ),
        "{message}"
    );
    assert_eq!(alice(pool).await, 150);
}

#[tokio::test]
async fn one_delivery_cannot_race() {
    let db = quickstart_db("one").await;
    let (store, pool) = (&db.store, &db.pool);
    let message = panic_of(deliver_concurrently(
        1,
        || quickstart::apply_top_up(store, &ALICE, false),
        || alice(pool),
        150,
    ))
    .await;
    assert!(
        message.contains("1 delivery cannot race; pass at least 2"),
        "{message}"
    );
    assert_eq!(alice(pool).await, 100);
}

#[tokio::test]
async fn expire_lease_refuses_a_transaction_handler() {
    let db = quickstart_db("not-lease").await;
    let (store, pool) = (&db.store, &db.pool);
    let message = panic_of(expire_lease(
        || quickstart::apply_top_up(store, &ALICE, false),
        || alice(pool),
        150,
    ))
    .await;
    assert!(
        message.starts_with(
            "idem::testing::expire_lease: delivery 1 claimed in a transaction, not a lease.\n\
             expire_lease tests lease-mode handlers"
        ),
        "{message}"
    );
}

#[tokio::test]
async fn a_handler_run_on_another_task_is_refused() {
    let db = quickstart_db("spawned").await;
    let (store, pool) = (db.store.clone(), &db.pool);
    let spawned = move || {
        let store = store.clone();
        async move {
            tokio::spawn(async move { quickstart::apply_top_up(&store, &ALICE, false).await })
                .await
                .unwrap()
        }
    };
    let message = panic_of(deliver_twice(spawned, || alice(pool), 150)).await;
    assert!(
        message.starts_with(
            "idem::testing::deliver_twice: the kit saw no claim in delivery 1, which got \
             Applied.\nthe closure must call an idempotent handler (or claim with the store) on \
             the test's own task"
        ),
        "{message}"
    );
}

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

// --- charge_once, lease mode with the payments API ------------------------------------------

async fn payments() -> Api {
    Api {
        http: reqwest::Client::new(),
        payments: PaymentsApi::start().await.unwrap(),
    }
}

fn charge() -> Charge {
    Charge {
        id: "charge-1".into(),
        customer: "alice".into(),
        amount: 4200,
    }
}

/// How many charges the API made (a replayed answer is not one).
async fn charges(api: &Api) -> u64 {
    api.payments.totals().charges
}

#[tokio::test]
async fn charge_twice_charges_once() {
    let (db, api, job) = (
        SqliteFile::new("charge-twice").await,
        payments().await,
        charge(),
    );
    let report = deliver_twice(|| charge_once(&db.store, &job, &api), || charges(&api), 1).await;
    assert_eq!(report.got(), [Got::Applied, Got::Duplicate], "{report}");
    assert_eq!(api.payments.totals().replayed, 0);
}

#[tokio::test]
async fn charge_four_at_once_charges_once() {
    let (db, api, job) = (
        SqliteFile::new("charge-race").await,
        payments().await,
        charge(),
    );
    let report = deliver_concurrently(
        4,
        || charge_once(&db.store, &job, &api),
        || charges(&api),
        1,
    )
    .await;
    // The holder completes only after the three others asked: each found its live lease and
    // got InProgress at once; redelivered afterwards, each is a duplicate.
    let got = report.got();
    let (racing, redelivered) = got.split_at(4);
    let mut racing = racing.to_vec();
    racing.sort_by_key(|g| *g != Got::Applied);
    assert_eq!(
        racing,
        [
            Got::Applied,
            Got::InProgress,
            Got::InProgress,
            Got::InProgress
        ],
        "{report}"
    );
    assert_eq!(redelivered, [Got::Duplicate; 3], "{report}");
}

#[tokio::test]
async fn charge_failed_completion_is_released_and_retried_with_the_same_key() {
    let (db, api, job) = (
        SqliteFile::new("charge-commit").await,
        payments().await,
        charge(),
    );
    let report =
        fail_before_commit(|| charge_once(&db.store, &job, &api), || charges(&api), 1).await;
    assert_eq!(
        report.got(),
        [Got::Injected, Got::Applied, Got::Duplicate],
        "{report}"
    );
    let attempts: Vec<_> = report.deliveries().iter().map(|d| d.attempt()).collect();
    assert_eq!(attempts, [Some(1), Some(2), None], "{report}");
    // The retry reached the API with the same key and got the first charge back.
    assert_eq!(api.payments.totals().replayed, 1);
    assert!(
        report.deliveries()[0]
            .idem_error()
            .is_some_and(|e| e.contains("right before its completing statement")),
        "{report}"
    );
}

#[tokio::test]
async fn charge_expired_lease_is_taken_over_and_fenced() {
    let (db, api, job) = (
        SqliteFile::new("charge-expire").await,
        payments().await,
        charge(),
    );
    let report = expire_lease(|| charge_once(&db.store, &job, &api), || charges(&api), 1).await;
    assert_eq!(
        report.got(),
        [Got::LeaseLost, Got::Applied, Got::Duplicate],
        "{report}"
    );
    let attempts: Vec<_> = report.deliveries().iter().map(|d| d.attempt()).collect();
    assert_eq!(attempts, [Some(1), Some(2), None], "{report}");
    // Delivery 1 went on after the takeover and called the API with the same key: answered
    // from the API's idempotency store, not charged again.
    assert_eq!(api.payments.totals().replayed, 1);
    let marker = db
        .store
        .inspect("billing.charge", "charge-1")
        .await
        .unwrap();
    assert_eq!(marker.map(|m| (m.token, m.attempts)), Some((Some(2), 2)));
}

/// Broken on purpose: the `Idempotency-Key` changes with each attempt, so the API cannot tell
/// a retry from a new charge.
#[idem::idempotent(
    key = "job.id",
    scope = "billing.charge_unkeyed",
    lease = "30s",
    timeout = "5s"
)]
async fn charge_per_attempt(
    lease: &idem::Lease,
    job: &Charge,
    api: &Api,
) -> Result<Receipt, ChargeError> {
    let request = ChargeRequest {
        customer: job.customer.clone(),
        amount: job.amount,
    };
    let key = format!("{}#{}", lease.idempotency_key(), lease.attempt());
    Ok(api
        .http
        .post(api.payments.charges_url())
        .header("Idempotency-Key", key)
        .timeout(lease.remaining())
        .json(&request)
        .send()
        .await?
        .error_for_status()?
        .json::<Receipt>()
        .await?)
}

#[tokio::test]
async fn an_outside_call_without_a_stable_key_is_caught() {
    let (db, api, job) = (
        SqliteFile::new("unkeyed-expire").await,
        payments().await,
        charge(),
    );
    let message = panic_of(expire_lease(
        || charge_per_attempt(&db.store, &job, &api),
        || charges(&api),
        1,
    ))
    .await;
    assert!(
        message.starts_with(
            "idem::testing::expire_lease: after delivery 2 took the key over and delivery 1 \
             went on, the check read 2, not 1 (before: 0).\nthe outside effect happened more \
             than once"
        ),
        "{message}"
    );
    assert!(message.contains("LeaseLost"), "{message}");
    assert_eq!(api.payments.totals().charges, 2);

    let (db, api, job) = (
        SqliteFile::new("unkeyed-commit").await,
        payments().await,
        charge(),
    );
    let message = panic_of(fail_before_commit(
        || charge_per_attempt(&db.store, &job, &api),
        || charges(&api),
        1,
    ))
    .await;
    assert!(
        message.starts_with(
            "idem::testing::fail_before_commit: after delivery 1 failed and delivery 2 \
             applied, the check read 2, not 1 (before: 0).\nthe outside effect happened more \
             than once"
        ),
        "{message}"
    );
}

/// Runs a case that must fail, and returns its panic message.
async fn panic_of<T>(case: impl Future<Output = T>) -> String {
    match AssertUnwindSafe(case).catch_unwind().await {
        Ok(_) => panic!("the kit accepted what it must refuse"),
        Err(payload) => message(payload),
    }
}

fn message(payload: Box<dyn Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => match payload.downcast::<&str>() {
            Ok(s) => (*s).to_owned(),
            Err(_) => "a panic without a message".to_owned(),
        },
    }
}
