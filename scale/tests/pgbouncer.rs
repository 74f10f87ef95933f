//! idem through PgBouncer in transaction pooling mode (Debian's `pgbouncer`, started by the
//! test in front of `IDEM_POSTGRES_URL` with fewer server connections than the clients open,
//! so that every transaction may land on another one). One PgBouncer serves every case, which
//! run one after the other; it is killed and its directory removed at the end, or when a case
//! fails.
//!
//! Every case counts effects in the database, read over a direct connection: each key's effect
//! exactly once, whatever the deliveries raced.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::outbox::{PublishError, Publisher, Relay};
use idem::{Checkup, Message, Outcome, Severity, Store};
use idem_scale::bouncer::{Bouncer, SERVER_CONNECTIONS, postgres_url};
use idem_scale::jobs::{self, AppError, Hold, Job};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Postgres};
use tokio::sync::watch;

/// A pool of `max` connections to `url`, with sqlx's statement cache of `cache` statements.
async fn pool(url: &str, max: u32, cache: usize) -> PgPool {
    let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options.statement_cache_capacity(cache))
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

/// The tables of one case: a marker table and an effects table, made through PgBouncer by a
/// store told it is there.
struct Case {
    direct: PgPool,
    store: Store<Postgres>,
    markers: String,
    effects: String,
}

impl Case {
    async fn new(bounced: &PgPool, direct: &PgPool) -> Case {
        let markers = jobs::unique("scale_markers");
        let effects = jobs::unique("scale_effects");
        let store = Store::new(bounced.clone())
            .behind_transaction_pooler()
            .with_table(&markers)
            .expect("a plain table name");
        assert!(
            store.is_behind_transaction_pooler(),
            "with_table keeps the pooler setting"
        );
        store.migrate().await.expect("migrate through PgBouncer");
        jobs::create_effects(bounced, &effects).await;
        Case {
            direct: direct.clone(),
            store,
            markers,
            effects,
        }
    }

    fn jobs(&self, n: usize) -> Vec<Job> {
        jobs::jobs(n, &self.effects)
    }

    /// Each of `n` keys has exactly one effect.
    async fn assert_once_each(&self, n: usize, what: &str) {
        let (keys, doubled) = jobs::counts(&self.direct, &self.effects).await;
        assert_eq!(
            (keys, doubled),
            (n as i64, 0),
            "{what}: (keys with an effect, keys with more than one)"
        );
    }

    async fn markers_of(&self, scope: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {} WHERE scope = $1",
            self.markers
        )))
        .bind(scope)
        .persistent(false)
        .fetch_one(&self.direct)
        .await
        .expect("count markers")
    }

    async fn drop(self) {
        jobs::drop_tables(&self.direct, &[&self.markers, &self.effects]).await;
    }
}

/// Runs `deliveries` copies of `call` per job at once, each on a task of its own, and returns
/// every result with its job's index.
async fn race<T, F, Fut>(jobs: &[Job], deliveries: usize, call: F) -> Vec<(usize, T)>
where
    T: Send + 'static,
    F: Fn(Job) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let mut tasks = Vec::new();
    for _ in 0..deliveries {
        for (i, job) in jobs.iter().enumerate() {
            let task = tokio::spawn(call(job.clone()));
            tasks.push((i, task));
        }
    }
    let mut out = Vec::new();
    for (i, task) in tasks {
        out.push((i, task.await.expect("a delivery panicked")));
    }
    out
}

/// Applied exactly once per job, every other delivery a duplicate.
fn once_each_rest_duplicates(results: &[(usize, Result<Outcome<i64>, AppError>)], n: usize) {
    let mut applied = vec![0; n];
    for (i, result) in results {
        match result {
            Ok(Outcome::Applied(_)) => applied[*i] += 1,
            Ok(Outcome::Duplicate) => {}
            other => panic!("job {i}: expected Applied or Duplicate, got {other:?}"),
        }
    }
    assert!(
        applied.iter().all(|&a| a == 1),
        "Applied per job: {applied:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_mode_works_through_pgbouncer_in_transaction_mode() {
    let bouncer = Bouncer::start(&postgres_url()).await;
    let url = bouncer.url();
    let direct = pool(&postgres_url(), 4, 100).await;
    // Four times as many clients as PgBouncer has server connections for them.
    let bounced = pool(&url, 4 * SERVER_CONNECTIONS, 0).await;

    without_the_setting_claims_fail_and_say_why(&url, &bounced, &direct).await;
    transaction_mode(&bounced, &direct).await;
    joined(&bounced, &direct).await;
    replay(&bounced, &direct).await;
    lease(&bounced, &direct).await;
    batch(&bounced, &direct).await;
    wait(&bounced, &direct).await;
    verified_commit(&bounced, &direct).await;
    relay_polls(&bounced, &direct).await;
    drop(bouncer);
}

/// A store not told about the pooler sends sqlx's named statements: the second client whose
/// first statement (`sqlx_s_1`) lands on a server connection that holds another client's
/// fails. One more single-connection client than PgBouncer has server connections makes that
/// certain. The error names the setting; a call that was Applied left its effect.
async fn without_the_setting_claims_fail_and_say_why(url: &str, bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let mut stores = Vec::new();
    for _ in 0..=SERVER_CONNECTIONS {
        let own = pool(url, 1, 100).await;
        let store = Store::new(own).with_table(&case.markers).expect("a name");
        assert!(!store.is_behind_transaction_pooler());
        stores.push(store);
    }
    let jobs = case.jobs(2 * stores.len());
    let (mut applied, mut refused) = (0, 0);
    for (i, job) in jobs.iter().enumerate() {
        match jobs::in_transaction(&stores[i % stores.len()], job).await {
            Ok(Outcome::Applied(_)) => applied += 1,
            Err(e) => {
                let e = e.idem();
                let msg = e.to_string();
                assert!(
                    msg.contains("Store::behind_transaction_pooler()")
                        && msg.contains("pool_mode = transaction"),
                    "the error names the setting: {msg}"
                );
                assert!(!e.is_transient(), "a setting, not a race: {msg}");
                refused += 1;
            }
            other => panic!("{}: {other:?}", job.key),
        }
    }
    assert!(refused > 0, "some claim must fail without the setting");
    // The doctor of a store that was told, its reads through PgBouncer too, sees the pooler
    // and finds it set up (untold, it warns and names the setting: a unit test of its own).
    let told = case.store.doctor(&Checkup::new()).await.expect("doctor");
    let finding = told.finding("pooler").expect("a pooler finding");
    assert_eq!(finding.severity, Severity::Ok, "{}", finding.summary);
    // Every Applied job's effect is there, once; no refused job left one.
    case.assert_once_each(applied, "without the setting").await;
    eprintln!("without the setting: {applied} applied, {refused} refused naming it");
    case.drop().await;
}

async fn transaction_mode(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let jobs = case.jobs(100);
    let store = case.store.clone();
    let results = race(&jobs, 3, move |job| {
        let store = store.clone();
        async move { jobs::in_transaction(&store, &job).await }
    })
    .await;
    once_each_rest_duplicates(&results, jobs.len());
    case.assert_once_each(jobs.len(), "transaction mode").await;
    case.drop().await;
}

async fn joined(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let jobs = case.jobs(40);
    let store = case.store.clone();
    let results = race(&jobs, 2, move |job| {
        let store = store.clone();
        async move {
            let mut tx = store.pool().begin().await?;
            let outcome = jobs::joined(store.join(&mut tx), &job).await?;
            tx.commit().await?;
            Ok::<_, AppError>(outcome)
        }
    })
    .await;
    once_each_rest_duplicates(&results, jobs.len());
    case.assert_once_each(jobs.len(), "joined").await;
    case.drop().await;
}

async fn replay(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let jobs = case.jobs(20);
    for job in &jobs {
        let first = jobs::replayed(&case.store, job).await.expect("first");
        assert_eq!(first, Outcome::Applied(job.amount));
        let again = jobs::replayed(&case.store, job).await.expect("again");
        assert_eq!(again, Outcome::Replayed(job.amount));
    }
    case.assert_once_each(jobs.len(), "replay").await;
    case.drop().await;
}

async fn lease(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let jobs = case.jobs(40);
    let (store, pool) = (case.store.clone(), bounced.clone());
    let results = race(&jobs, 3, move |job| {
        let (store, pool) = (store.clone(), pool.clone());
        async move { jobs::leased(&store, &job, &pool).await }
    })
    .await;
    let mut applied = vec![0; jobs.len()];
    for (i, result) in &results {
        match result {
            Ok(Outcome::Applied(_)) => applied[*i] += 1,
            Ok(Outcome::Duplicate) => {}
            // Another delivery held the lease: nacked, redelivered below.
            Err(AppError::Idem(idem::Error::InProgress { .. })) => {}
            other => panic!("job {i}: {other:?}"),
        }
    }
    assert!(applied.iter().all(|&a| a == 1), "{applied:?}");
    // Every delivery ended: a redelivery is a duplicate.
    for job in &jobs {
        let again = jobs::leased(&case.store, job, bounced)
            .await
            .expect("again");
        assert_eq!(again, Outcome::Duplicate, "{}", job.key);
    }
    case.assert_once_each(jobs.len(), "lease").await;
    case.drop().await;
}

async fn batch(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let all = case.jobs(60);
    // Overlapping batches of 10 (0..10, 5..15, ..., 50..60), each delivered twice at once.
    let batches: Vec<Vec<Job>> = (0..all.len() - 5)
        .step_by(5)
        .map(|start| all[start..(start + 10).min(all.len())].to_vec())
        .collect();
    let mut tasks = Vec::new();
    for _ in 0..2 {
        for batch in &batches {
            let (store, batch) = (case.store.clone(), batch.clone());
            tasks.push(tokio::spawn(async move {
                let done = jobs::batch(&store, &batch).await;
                (batch, done)
            }));
        }
    }
    let mut applied = HashSet::new();
    for task in tasks {
        let (batch, done) = task.await.expect("a batch panicked");
        let done = done.unwrap_or_else(|e| panic!("a batch failed: {e:?}"));
        for (job, outcome) in batch.iter().zip(done.outcomes()) {
            match outcome {
                Outcome::Applied(()) => {
                    assert!(applied.insert(job.key.clone()), "{} applied twice", job.key)
                }
                Outcome::Duplicate => {}
                other => panic!("{}: {other:?}", job.key),
            }
        }
    }
    assert_eq!(applied.len(), all.len(), "every job applied by some batch");
    case.assert_once_each(all.len(), "batch").await;
    case.drop().await;
}

async fn wait(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let jobs = case.jobs(40);
    let store = case.store.clone();
    let results = race(&jobs, 3, move |job| {
        let store = store.clone();
        async move { jobs::waiting(&store, &job).await }
    })
    .await;
    once_each_rest_duplicates(&results, jobs.len());

    // A key held by a parked body: a delivery with a short `wait` gives up, InProgress.
    let held = Job {
        key: "held".into(),
        amount: 7,
        effects: case.effects.clone(),
    };
    let hold = Arc::new(Hold::default());
    let holder = {
        let (store, held, hold) = (case.store.clone(), held.clone(), hold.clone());
        tokio::spawn(async move { jobs::waiting_held(&store, &held, &hold).await })
    };
    hold.entered().await;
    match jobs::waiting_briefly(&case.store, &held).await {
        Err(AppError::Idem(idem::Error::InProgress { .. })) => {}
        other => panic!("a held key with a short wait: {other:?}"),
    }
    hold.release();
    let first = holder
        .await
        .expect("the holder")
        .expect("the holder's call");
    assert_eq!(first, Outcome::Applied(7));
    let again = jobs::waiting(&case.store, &held).await.expect("again");
    assert_eq!(again, Outcome::Duplicate);
    case.assert_once_each(jobs.len() + 1, "wait").await;

    // `wait` is `SET LOCAL`: no server connection kept the claims' lock_timeout. As many
    // transactions at once as PgBouncer has server connections see every one of them.
    let default: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .persistent(false)
        .fetch_one(direct)
        .await
        .expect("the server's lock_timeout");
    let mut open = Vec::new();
    for _ in 0..SERVER_CONNECTIONS {
        let mut tx = bounced.begin().await.expect("begin");
        let (pid, setting): (i32, String) =
            sqlx::query_as("SELECT pg_backend_pid(), current_setting('lock_timeout')")
                .persistent(false)
                .fetch_one(&mut *tx)
                .await
                .expect("read lock_timeout");
        assert_eq!(setting, default, "server connection {pid}");
        open.push((pid, tx));
    }
    let pids: HashSet<i32> = open.iter().map(|(pid, _)| *pid).collect();
    assert_eq!(
        pids.len(),
        SERVER_CONNECTIONS as usize,
        "one per server connection"
    );
    drop(open);
    case.drop().await;
}

/// A body that swallows a failed statement and returns Ok: NotKept::RolledBack, nothing kept.
async fn verified_commit(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    for job in case.jobs(10) {
        match jobs::swallowing(&case.store, &job).await {
            Err(AppError::Idem(idem::Error::NotKept(idem::NotKept::RolledBack { .. }))) => {}
            other => panic!("{}: expected NotKept::RolledBack, got {other:?}", job.key),
        }
    }
    case.assert_once_each(0, "verified commit").await;
    assert_eq!(case.markers_of("scale.verified").await, 0, "no marker kept");
    case.drop().await;
}

/// A publisher that keeps the ids it was given and announces how many it has.
struct Collect {
    ids: Mutex<HashSet<String>>,
    count: watch::Sender<usize>,
}

impl Publisher for Collect {
    async fn publish(&self, message: &Message) -> Result<(), PublishError> {
        let mut ids = self.ids.lock().expect("ids");
        ids.insert(message.id.clone());
        self.count.send_replace(ids.len());
        Ok(())
    }
}

/// The relay of a store behind the pooler polls (its `LISTEN` would hear nothing): it
/// publishes and marks the messages committed before it started, then, polling, the message
/// of a job committed once it had published those.
async fn relay_polls(bounced: &PgPool, direct: &PgPool) {
    let case = Case::new(bounced, direct).await;
    let jobs = case.jobs(21);
    let (first, last) = jobs.split_at(20);
    for job in first {
        let done = jobs::sending(&case.store, job).await.expect("send");
        assert!(matches!(done, Outcome::Applied(_)), "{done:?}");
    }
    let (count, mut published) = watch::channel(0);
    let mut all = published.clone();
    let relay = Relay::new(
        case.store.clone(),
        Collect {
            ids: Mutex::new(HashSet::new()),
            count,
        },
    );
    // Stops once the last job's message was published: a round publishes after it marked
    // the previous round's messages.
    let stop = async move {
        drop(all.wait_for(|n| *n > first.len()).await);
    };
    let feed = async {
        published
            .wait_for(|n| *n == first.len())
            .await
            .expect("the relay runs");
        let done = jobs::sending(&case.store, &last[0]).await.expect("send");
        assert!(matches!(done, Outcome::Applied(_)), "{done:?}");
    };
    // A hang guard only: the relay stops as soon as the publisher has every message.
    let (ran, ()) = tokio::join!(
        tokio::time::timeout(
            Duration::from_secs(120),
            relay.run(Duration::from_millis(20), stop)
        ),
        feed
    );
    ran.expect("the relay published every message")
        .expect("the relay ran");
    let unsent: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {}_outbox WHERE sent_at IS NULL AND key <> $1",
        case.markers
    )))
    .bind(&last[0].key)
    .persistent(false)
    .fetch_one(direct)
    .await
    .expect("count unsent messages");
    assert_eq!(unsent, 0, "every message of the first round marked sent");
    case.assert_once_each(jobs.len(), "outbox").await;
    case.drop().await;
}
