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
use idem_quickstart as quickstart;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool, Transaction};

#[path = "testing_kit/lease.rs"]
mod lease;
#[path = "testing_kit/servers.rs"]
mod servers;

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
