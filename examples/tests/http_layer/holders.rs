//! The six ways of holding a key meet on one scope and one marker key: transaction mode
//! (`&store`), joined (`store.join`), a batch of one job, lease mode, and the HTTP layer in
//! transaction mode (`ClaimedTx`) and in lease mode (`ClaimedLease`). A key completed by any of
//! them is a duplicate to every other (an HTTP second gets the stored response of an HTTP
//! first, and 409 "not kept" after a job handler); a key held by one is never a duplicate to
//! another (`holders_held.rs`).
//!
//! The HTTP layer's marker key is `job_id(SINGLE_TENANT, header key)`: the job handlers claim
//! that key, and every delivery writes one effect row whose body is the marker key.

use idem::Outcome;
use idem::http::{ClaimedLease, SINGLE_TENANT};
use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};

use super::*;

/// The scope every holder claims in: the handlers' attribute names it as a literal.
pub(crate) const SCOPE: &str = "tests.http.holders";

/// What a test needs to know of its database besides [`Db`]: how to see a claim waiting on
/// the key, and how a joined caller begins its transaction.
pub(crate) trait Waiters: Db {
    /// Counts the sessions waiting in a claim's `INSERT` into the marker table `{t}`; `None`
    /// on SQLite, whose writers wait in the busy handler, where no query sees them.
    const WAITERS: Option<&'static str>;
    /// The caller's `BEGIN` for a joined claim (SQLite: take the write lock at once, as
    /// `Store::join` asks).
    const BEGIN: Option<&'static str>;
}

impl Waiters for Postgres {
    // A claim queued behind the key waits on the holder's transaction id: a `Lock` wait.
    const WAITERS: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%INSERT INTO {t} %'",
    );
    const BEGIN: Option<&'static str> = None;
}

impl Waiters for MySql {
    // A claim queued behind the key is a session still running its claim `INSERT` (this
    // query's own text matches the pattern too: it is left out).
    const WAITERS: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE INFO LIKE '%INSERT %INTO {t} %' AND ID <> CONNECTION_ID()",
    );
    const BEGIN: Option<&'static str> = None;
}

impl Waiters for Sqlite {
    const WAITERS: Option<&'static str> = None;
    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    Transaction,
    Joined,
    Batch,
    Lease,
    HttpTx,
    HttpLease,
}

pub(crate) const HOLDERS: [Holder; 6] = [
    Holder::Transaction,
    Holder::Joined,
    Holder::Batch,
    Holder::Lease,
    Holder::HttpTx,
    Holder::HttpLease,
];

impl Holder {
    /// Holds the key with a lease rather than an open transaction.
    pub(crate) fn leased(self) -> bool {
        matches!(self, Holder::Lease | Holder::HttpLease)
    }

    fn http(self) -> bool {
        matches!(self, Holder::HttpTx | Holder::HttpLease)
    }
}

/// What a delivery got, compared exactly.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Got {
    Applied,
    Duplicate,
    /// 201 with `Idempotent-Replayed: true`.
    Replayed,
    /// 409: the key was completed, but not by the layer, so no response is stored.
    NotKept,
    /// `InProgress`, or the layer's 409 "still being processed".
    InProgress,
    /// The first delivery's own failure, after it was let go (500 from a handler).
    Failed,
    Other(String),
}

#[derive(Debug)]
pub(crate) enum Fail {
    Idem(idem::Error),
    Refused,
}

impl From<idem::Error> for Fail {
    fn from(e: idem::Error) -> Self {
        Fail::Idem(e)
    }
}

impl From<sqlx::Error> for Fail {
    fn from(e: sqlx::Error) -> Self {
        Fail::Idem(e.into())
    }
}

fn got<T: std::fmt::Debug>(result: Result<Outcome<T>, Fail>) -> Got {
    match result {
        Ok(Outcome::Applied(_)) => Got::Applied,
        Ok(Outcome::Duplicate) => Got::Duplicate,
        Ok(Outcome::Replayed(_)) => Got::Replayed,
        Err(Fail::Idem(idem::Error::InProgress { .. })) => Got::InProgress,
        Err(Fail::Refused) => Got::Failed,
        other => Got::Other(format!("{other:?}")),
    }
}

fn got_reply(reply: &Reply) -> Got {
    let text = reply.text();
    match (reply.status, reply.replayed()) {
        (201, false) => Got::Applied,
        (201, true) => Got::Replayed,
        (409, false) if text.contains("still being processed") => Got::InProgress,
        (409, false) if text.contains("was completed, but its response was not kept") => {
            Got::NotKept
        }
        (500, false) if text == "the handler failed" => Got::Failed,
        (status, replayed) => Got::Other(format!("{status} (replayed: {replayed}) {text}")),
    }
}

/// One job: the header key a client sends, the marker key the layer claims for it (which the
/// job handlers claim too), and the table its effect goes into.
#[derive(Clone)]
pub(crate) struct Job {
    header: String,
    pub(crate) key: String,
    effects: String,
}

/// With `hold`, parks until the test lets it go, then fails: the key is let go, nothing kept.
async fn park_then_fail(hold: Option<&Hold>) -> Result<(), Fail> {
    let Some(hold) = hold else {
        return Ok(());
    };
    hold.entered.notify_one();
    hold.release.notified().await;
    Err(Fail::Refused)
}

/// Transaction mode (and joined, with `store.join(&mut tx)`): the effect in the claim's
/// transaction, then (with `hold`) parked, holding the key, until it fails.
#[idem::idempotent(key = "job.key", scope = "tests.http.holders")]
async fn in_tx<DB: Db>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    hold: Option<&Hold>,
) -> Result<i64, Fail> {
    let id = DB::write(&mut **tx, &job.effects, job.key.clone()).await?;
    park_then_fail(hold).await?;
    Ok(id)
}

/// A batch handler, given one job.
#[idem::idempotent(key = "job.key", scope = "tests.http.holders", batch = "jobs")]
async fn in_batch<DB: Db>(
    tx: &mut Transaction<'_, DB>,
    jobs: &[Job],
    hold: Option<&Hold>,
) -> Result<usize, Fail> {
    for job in jobs {
        DB::write(&mut **tx, &job.effects, job.key.clone()).await?;
    }
    park_then_fail(hold).await?;
    Ok(jobs.len())
}

/// Lease mode: the effect is an autocommit statement of its own (the outside system's); with
/// `hold` the body parks before it, then fails.
#[idem::idempotent(key = "job.key", scope = "tests.http.holders", lease = "30s")]
async fn in_lease<DB: Db>(
    lease: &idem::Lease,
    job: &Job,
    pool: &Pool<DB>,
    hold: Option<&Hold>,
) -> Result<i64, Fail> {
    assert_eq!(lease.key(), job.key);
    park_then_fail(hold).await?;
    let mut conn = pool.acquire().await?;
    Ok(DB::write(&mut conn, &job.effects, job.key.clone()).await?)
}

/// The HTTP handlers' state: the hold the next request with `x-hold` parks on.
struct Web<DB: Db> {
    pool: Pool<DB>,
    effects: String,
    hold: std::sync::Mutex<Option<Arc<Hold>>>,
}

impl<DB: Db> Web<DB> {
    /// With `x-hold`: parks on the hold the test put there, then answers 500.
    async fn park_then_fail(&self, headers: &HeaderMap) -> bool {
        if !headers.contains_key("x-hold") {
            return false;
        }
        let hold = self.hold.lock().unwrap().take();
        let hold = hold.expect("the test sets a hold before it sends x-hold");
        hold.entered.notify_one();
        hold.release.notified().await;
        true
    }
}

fn failed() -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, "the handler failed").into_response()
}

/// `POST /job` behind the transaction-mode layer: the body is the marker key.
async fn web_tx<DB: Db>(
    State(web): State<Arc<Web<DB>>>,
    mut tx: ClaimedTx<DB>,
    headers: HeaderMap,
    key: String,
) -> Response {
    if let Err(e) = DB::write(tx.conn(), &web.effects, key.clone()).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
    }
    if web.park_then_fail(&headers).await {
        return failed();
    }
    (StatusCode::CREATED, format!("applied {key}")).into_response()
}

/// `POST /job` behind the lease-mode layer: parks (and fails) before its outside effect.
async fn web_lease<DB: Db>(
    State(web): State<Arc<Web<DB>>>,
    lease: ClaimedLease<DB>,
    headers: HeaderMap,
    key: String,
) -> Response {
    if lease.key() != key {
        let why = format!("the lease holds {:?}, not {key:?}", lease.key());
        return (StatusCode::INTERNAL_SERVER_ERROR, why).into_response();
    }
    if web.park_then_fail(&headers).await {
        return failed();
    }
    let written = match web.pool.acquire().await {
        Ok(mut conn) => DB::write(&mut conn, &web.effects, key.clone()).await,
        Err(e) => Err(e),
    };
    match written {
        Ok(_) => (StatusCode::CREATED, format!("charged {key}")).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The tables, and both layers on one scope, each on a server of its own with the same route
/// (the fingerprint covers the path, so an HTTP first and an HTTP second of another mode send
/// the same request).
pub(crate) struct Ctx<DB: Waiters> {
    pub(crate) tables: Tables<DB>,
    web: Arc<Web<DB>>,
    tx_url: String,
    lease_url: String,
    servers: Vec<Server>,
    jobs: std::sync::atomic::AtomicU32,
}

impl<DB: Waiters> Ctx<DB> {
    pub(crate) async fn new(tables: Tables<DB>) -> Self {
        let web = Arc::new(Web {
            pool: tables.pool.clone(),
            effects: tables.effects.clone(),
            hold: std::sync::Mutex::new(None),
        });
        // A transaction-mode request waits behind any holder's transaction, as a claim of a
        // job handler does. A lease-mode one does not wait behind a transaction on the servers
        // (MariaDB rounds the wait up to 1 s); on SQLite every writer waits for the write lock.
        let lease_wait = match DB::WAITERS {
            Some(_) => Duration::from_millis(100),
            None => Duration::from_secs(30),
        };
        let tx_layer = IdempotencyLayer::new(tables.store.clone(), SCOPE)
            .single_tenant()
            .wait(Duration::from_secs(30));
        let lease = idem::LeaseOptions::new(Duration::from_secs(30));
        let lease_layer = IdempotencyLayer::new(tables.store.clone(), SCOPE)
            .single_tenant()
            .wait(lease_wait)
            .lease(lease);
        let tx_app = Router::new()
            .route("/job", post(web_tx::<DB>))
            .layer(tx_layer)
            .with_state(web.clone());
        let lease_app = Router::new()
            .route("/job", post(web_lease::<DB>))
            .layer(lease_layer)
            .with_state(web.clone());
        let (tx_server, lease_server) = (serve(tx_app).await, serve(lease_app).await);
        Ctx {
            tx_url: format!("{}/job", tx_server.url),
            lease_url: format!("{}/job", lease_server.url),
            servers: vec![tx_server, lease_server],
            tables,
            web,
            jobs: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// A new job: its own header key, and the marker key the layer makes of it.
    pub(crate) fn job(&self) -> Job {
        let n = self.jobs.fetch_add(1, Ordering::Relaxed);
        let header = format!("job-{n}");
        let key = idem::job_id(SINGLE_TENANT, header.as_str())
            .unwrap()
            .into_string();
        assert!(!key.contains('\''), "{key:?} goes into SQL as a literal");
        Job {
            header: format!("\"{header}\""),
            key,
            effects: self.tables.effects.clone(),
        }
    }

    /// The job's effect rows.
    pub(crate) async fn effects(&self, job: &Job) -> i64 {
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE body = '{}'",
            self.tables.effects, job.key
        );
        DB::scalar(&self.tables.pool, sql).await
    }

    /// The claims waiting on the marker table's row locks; `None` on SQLite.
    pub(crate) async fn claims_waiting(&self) -> Option<i64> {
        let sql = DB::WAITERS?.replace("{t}", self.tables.store.table());
        Some(DB::scalar(&self.tables.pool, sql).await)
    }

    /// One delivery of `job` by `holder`. With `hold`, its body parks on it, holding the key,
    /// then fails.
    pub(crate) async fn deliver(
        &self,
        holder: Holder,
        job: &Job,
        hold: Option<&Arc<Hold>>,
    ) -> (Got, Option<Bytes>) {
        let store = &self.tables.store;
        let parked = hold.map(|h| &**h);
        let answer = match holder {
            Holder::Transaction => got(in_tx(store, job, parked).await),
            Holder::Joined => {
                let pool = &self.tables.pool;
                let mut tx = match DB::BEGIN {
                    Some(begin) => pool.begin_with(begin).await,
                    None => pool.begin().await,
                }
                .expect("the caller's begin");
                let answer = in_tx(store.join(&mut tx), job, parked).await;
                if answer.is_ok() {
                    idem::commit(tx).await.expect("the caller's commit");
                }
                got(answer)
            }
            Holder::Batch => match in_batch(store, std::slice::from_ref(job), parked).await {
                Ok(batch) => match batch.outcomes() {
                    [Outcome::Applied(())] => Got::Applied,
                    [Outcome::Duplicate] => Got::Duplicate,
                    other => Got::Other(format!("{other:?}")),
                },
                Err(e) => got::<()>(Err(e)),
            },
            Holder::Lease => got(in_lease(store, job, &self.tables.pool, parked).await),
            Holder::HttpTx | Holder::HttpLease => {
                let url = match holder {
                    Holder::HttpTx => &self.tx_url,
                    _ => &self.lease_url,
                };
                let mut extra = Vec::new();
                if let Some(hold) = hold {
                    *self.web.hold.lock().unwrap() = Some(hold.clone());
                    extra.push(("x-hold", "1"));
                }
                let reply = send(url, Some(&job.header), None, &job.key, &extra).await;
                return (got_reply(&reply), Some(reply.body));
            }
        };
        (answer, None)
    }

    pub(crate) async fn drop_all(self) {
        drop(self.servers);
        let outbox = format!("{}_outbox", self.tables.store.table());
        DB::run(&self.tables.pool, format!("DROP TABLE IF EXISTS {outbox}")).await;
        self.tables.drop_all().await;
    }
}

/// Every ordered pair of holders, 36: the first completes the job, the second never runs its
/// body and reports a duplicate (an HTTP second: the stored response of an HTTP first, 409
/// "not kept" after a job handler); one effect.
async fn completed_key_is_a_duplicate_to_every_holder<DB: Waiters>(tables: Tables<DB>) {
    let ctx = Ctx::new(tables).await;
    for first in HOLDERS {
        for second in HOLDERS {
            let job = ctx.job();
            let (once, first_body) =
                within(60, "the first delivery", ctx.deliver(first, &job, None)).await;
            assert_eq!(once, Got::Applied, "{first:?}");
            let (again, body) =
                within(60, "the second delivery", ctx.deliver(second, &job, None)).await;
            let expected = match (first.http(), second.http()) {
                (_, false) => Got::Duplicate,
                (true, true) => Got::Replayed,
                (false, true) => Got::NotKept,
            };
            assert_eq!(again, expected, "{first:?} then {second:?}");
            if expected == Got::Replayed {
                assert_eq!(body, first_body, "{first:?} then {second:?}: the replay");
            }
            assert_eq!(
                ctx.effects(&job).await,
                1,
                "effects of {first:?} then {second:?}"
            );
        }
    }
    ctx.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_key_completed_by_any_holder_is_a_duplicate_to_every_holder() {
    let tables = Tables::new(postgres().await, "pg_holders_done").await;
    completed_key_is_a_duplicate_to_every_holder(tables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_a_key_completed_by_any_holder_is_a_duplicate_to_every_holder() {
    let tables = Tables::new(mariadb().await, "my_holders_done").await;
    completed_key_is_a_duplicate_to_every_holder(tables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_a_key_completed_by_any_holder_is_a_duplicate_to_every_holder() {
    let pool = sqlite(&temp_db("holders_done")).await;
    completed_key_is_a_duplicate_to_every_holder(Tables::new(pool, "holders_done").await).await;
}
