//! `idem::testing::all_cases`: every case that applies to the handler's mode, each on a fresh
//! job. A sound transaction handler and a sound lease handler pass it (the lease one through
//! `expire_lease` too); a handler that writes its effect on the pool instead of the
//! transaction it is given passes `deliver_twice` and `deliver_concurrently`, and `all_cases`
//! fails it at `fail_before_commit`.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::str::FromStr as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::Poll;
use std::time::Duration;

use idem::testing::{CONCURRENT_DELIVERIES, Got, all_cases, deliver_concurrently, deliver_twice};
use idem::{Error, Store};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Sqlite, SqlitePool, Transaction};

fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A top-up of one account; each case gets a job and an account of its own.
struct TopUp {
    id: String,
    account: i64,
}

async fn lite() -> (Store<Sqlite>, SqlitePool) {
    let file = std::env::temp_dir().join(format!("{}.db", unique("idem_kit")));
    let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", file.display()))
        .unwrap()
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .unwrap();
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE accounts (id INTEGER PRIMARY KEY, credits INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    (store, pool)
}

/// A job for case `n`, on an account of its own with 100 credits.
async fn fresh_top_up(pool: &SqlitePool, n: usize) -> TopUp {
    let account = i64::try_from(n).unwrap();
    sqlx::query("INSERT INTO accounts (id, credits) VALUES (?1, 100)")
        .bind(account)
        .execute(pool)
        .await
        .unwrap();
    TopUp {
        id: format!("top-up-{n}"),
        account,
    }
}

/// The credits of `job`'s account.
async fn balance_of(pool: &SqlitePool, job: &TopUp) -> i64 {
    sqlx::query_scalar("SELECT credits FROM accounts WHERE id = ?1")
        .bind(job.account)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// What a sound top-up handler's three cases report, and each case's account topped up once.
async fn sound_top_up(reports: &[(&str, idem::testing::Report)], pool: &SqlitePool) {
    assert_eq!(reports[0].1.got(), [Got::Applied, Got::Duplicate]);
    let racing = reports[1].1.got();
    assert_eq!(racing.len(), CONCURRENT_DELIVERIES);
    assert_eq!(racing.iter().filter(|g| **g == Got::Applied).count(), 1);
    assert_eq!(
        reports[2].1.got(),
        [Got::Injected, Got::Applied, Got::Duplicate]
    );
    for n in 1..=3 {
        let job = TopUp {
            id: String::new(),
            account: n,
        };
        assert_eq!(balance_of(pool, &job).await, 150, "account {n}");
    }
}

#[idem::idempotent(key = "job.id", scope = "kit.top_up")]
async fn top_up(tx: &mut Transaction<'_, Sqlite>, job: &TopUp) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET credits = credits + 50 WHERE id = ?1")
        .bind(job.account)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_sound_transaction_handler_passes_every_case() {
    let (store, pool) = lite().await;
    let fresh = async |n: usize| fresh_top_up(&pool, n).await;
    let balance = async |job: &TopUp| balance_of(&pool, job).await;

    let reports = all_cases(fresh, async |job| top_up(&store, job).await, balance, 150).await;
    let ran: Vec<_> = reports.iter().map(|(case, _)| *case).collect();
    assert_eq!(
        ran,
        [
            "deliver_twice",
            "deliver_concurrently",
            "fail_before_commit"
        ],
        "a transaction-mode handler has no lease to expire"
    );
    sound_top_up(&reports, &pool).await;
}

/// An outside system that honours idempotency keys: a repeated key sends nothing again.
#[derive(Default)]
struct Mailer {
    sent: Mutex<HashMap<String, String>>,
}

impl Mailer {
    fn send(&self, idempotency_key: &str, to: &str) {
        let mut sent = self.sent.lock().unwrap();
        sent.entry(idempotency_key.to_owned())
            .or_insert_with(|| to.to_owned());
    }

    /// Mails sent to `to`.
    fn sent_to(&self, to: &str) -> usize {
        self.sent
            .lock()
            .unwrap()
            .values()
            .filter(|t| *t == to)
            .count()
    }
}

struct Welcome {
    id: String,
    to: String,
}

#[idem::idempotent(key = "job.id", scope = "kit.welcome", lease = "30s")]
async fn welcome(lease: &idem::Lease, job: &Welcome, mailer: &Mailer) -> Result<(), Error> {
    mailer.send(lease.idempotency_key(), &job.to);
    Ok(())
}

#[tokio::test]
async fn a_sound_lease_handler_passes_every_case_expire_lease_included() {
    let (store, _pool) = lite().await;
    let mailer = Mailer::default();
    let fresh = async |n: usize| Welcome {
        id: format!("welcome-{n}"),
        to: format!("user-{n}@example.com"),
    };
    let sent = async |job: &Welcome| mailer.sent_to(&job.to);

    let reports = all_cases(
        fresh,
        async |job| welcome(&store, job, &mailer).await,
        sent,
        1,
    )
    .await;
    let ran: Vec<_> = reports.iter().map(|(case, _)| *case).collect();
    assert_eq!(
        ran,
        [
            "deliver_twice",
            "deliver_concurrently",
            "fail_before_commit",
            "expire_lease"
        ]
    );
    assert_eq!(
        reports[3].1.got(),
        [Got::LeaseLost, Got::Applied, Got::Duplicate]
    );
    assert_eq!(
        mailer.sent.lock().unwrap().len(),
        4,
        "one mail per case's job"
    );
}

// --- The broken handler, on PostgreSQL (SQLite's one writer would make its pool write wait
// for its own transaction) ------------------------------------------------------------------

struct Pg {
    store: Store<Postgres>,
    pool: PgPool,
    accounts: String,
}

impl Pg {
    async fn new() -> Pg {
        let url = std::env::var("IDEM_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} (set IDEM_POSTGRES_URL): {e}"));
        let markers = unique("idem_kit");
        let accounts = format!("{markers}_accounts");
        let store = Store::new(pool.clone()).with_table(&markers).unwrap();
        store.migrate().await.unwrap();
        let ddl =
            format!("CREATE TABLE {accounts} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL)");
        sqlx::query(AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .unwrap();
        Pg {
            store,
            pool,
            accounts,
        }
    }

    async fn open(&self, n: usize) -> PgJob {
        let account = i64::try_from(n).unwrap();
        let sql = format!(
            "INSERT INTO {} (id, credits) VALUES ($1, 100)",
            self.accounts
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(account)
            .execute(&self.pool)
            .await
            .unwrap();
        PgJob {
            id: format!("top-up-{n}"),
            account,
            accounts: self.accounts.clone(),
        }
    }

    async fn balance(&self, job: &PgJob) -> i64 {
        let sql = format!("SELECT credits FROM {} WHERE id = $1", self.accounts);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(job.account)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn drop_tables(self) {
        for table in [self.store.table(), &self.accounts] {
            let sql = format!("DROP TABLE {table}");
            sqlx::query(AssertSqlSafe(sql))
                .execute(&self.pool)
                .await
                .unwrap();
        }
    }
}

struct PgJob {
    id: String,
    account: i64,
    accounts: String,
}

/// Broken on purpose: the effect goes on the pool, outside the transaction it is given.
#[idem::idempotent(key = "job.id", scope = "kit.outside")]
async fn top_up_outside(
    tx: &mut Transaction<'_, Postgres>,
    job: &PgJob,
    pool: &PgPool,
) -> Result<(), sqlx::Error> {
    let _ = tx;
    let sql = format!(
        "UPDATE {} SET credits = credits + 50 WHERE id = $1",
        job.accounts
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(job.account)
        .execute(pool)
        .await?;
    Ok(())
}

#[tokio::test]
async fn all_cases_catches_a_handler_that_writes_outside_its_transaction() {
    let pg = Pg::new().await;
    let pool = pg.pool.clone();
    let deliver = async |job: &PgJob| top_up_outside(&pg.store, job, &pool).await;
    let check = async |job: &PgJob| pg.balance(job).await;

    // The two cases without a fault pass it: its effect and its marker both land.
    let job = pg.open(101).await;
    deliver_twice(|| deliver(&job), || check(&job), 150).await;
    let job = pg.open(102).await;
    deliver_concurrently(8, || deliver(&job), || check(&job), 150).await;

    // `all_cases` runs `fail_before_commit` too, which fails it.
    let message = panic_of(all_cases(async |n| pg.open(n).await, deliver, check, 150)).await;
    assert!(
        message.starts_with(
            "idem::testing::fail_before_commit: after delivery 1 was rolled back, the check \
             read 150, not 100 as before it: its effect outlived the rollback.\nthe handler \
             writes outside the transaction it is given (on the pool, another connection, or \
             in autocommit)"
        ),
        "{message}"
    );
    // Cases 1 and 2 passed first, on accounts 1 and 2; case 3 kept its effect twice.
    for (account, credits) in [(1, 150), (2, 150), (3, 200)] {
        let job = PgJob {
            id: String::new(),
            account,
            accounts: pg.accounts.clone(),
        };
        assert_eq!(pg.balance(&job).await, credits, "account {account}");
    }
    pg.drop_tables().await;
}

/// Polls `case` to its end and returns the message it panicked with; fails if it did not.
async fn panic_of<T>(case: impl Future<Output = T>) -> String {
    let mut case = pin!(case);
    let caught =
        poll_fn(
            |cx| match std::panic::catch_unwind(AssertUnwindSafe(|| case.as_mut().poll(cx))) {
                Ok(Poll::Pending) => Poll::Pending,
                Ok(Poll::Ready(_)) => Poll::Ready(None),
                Err(payload) => Poll::Ready(Some(payload)),
            },
        )
        .await;
    let payload = caught.expect("the kit must refuse the handler");
    match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => match payload.downcast::<&str>() {
            Ok(message) => (*message).to_owned(),
            Err(_) => "a panic without a message".to_owned(),
        },
    }
}

#[idem::idempotent(key = "job.id", scope = "kit.group_top_up", group)]
async fn group_top_up(tx: &mut Transaction<'_, Sqlite>, job: &TopUp) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET credits = credits + 50 WHERE id = ?1")
        .bind(job.account)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A `group` handler on its defaults: the racing deliveries queue in one lane (one key, one
/// lane), and the kit counts each as in flight from its start, before it waits for its turn.
#[tokio::test]
async fn a_sound_group_handler_passes_every_case() {
    let (store, pool) = lite().await;
    let group = store.group(idem::GroupOptions::new()).unwrap();
    let fresh = async |n: usize| fresh_top_up(&pool, n).await;
    let balance = async |job: &TopUp| balance_of(&pool, job).await;
    let cases = all_cases(
        fresh,
        async |job| group_top_up(&group, job).await,
        balance,
        150,
    );
    let reports = tokio::time::timeout(Duration::from_secs(120), cases)
        .await
        .expect("the kit's cases on a group handler did not end within 120 s");
    let ran: Vec<_> = reports.iter().map(|(case, _)| *case).collect();
    assert_eq!(
        ran,
        [
            "deliver_twice",
            "deliver_concurrently",
            "fail_before_commit"
        ]
    );
    sound_top_up(&reports, &pool).await;
}
