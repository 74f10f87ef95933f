//! What the SQS tests share: their handlers on PostgreSQL, the queue and tables of one test,
//! and the worker process that the tests start and SIGKILL (a copy of the test binary running
//! its `#[ignore]`d `child_process` test, as for the RabbitMQ and NATS tests).

#![allow(dead_code)]

#[path = "../../../tests/support/mod.rs"]
pub mod support;

use std::time::Duration;

use idem::{Lease, Outcome, Store};
use idem_example_sqs::{
    Event, JobError, Options, Queue, Received, TopUp, Verdict, Worker, batch_verdicts, connect,
    create_queue, delete_queue, messages_left, sqs_url, verdict,
};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use support::{CHILD_MODE, child_env, postgres, stop_signal};

const CHILD_QUEUE: &str = "IDEM_SQS_QUEUE";
const CHILD_DLQ: &str = "IDEM_SQS_DLQ";
const CHILD_MARKERS: &str = "IDEM_SQS_MARKERS";
const CHILD_EFFECTS: &str = "IDEM_SQS_EFFECTS";
const CHILD_GATE: &str = "IDEM_SQS_GATE";
const CHILD_VISIBILITY: &str = "IDEM_SQS_VISIBILITY";

/// A retried message's visibility in these tests (seconds).
pub const RETRY_AFTER: i32 = 1;

/// The batch handler of these tests: one row per job applied in `effects`, a table without a
/// unique index, so that a job applied twice shows. `wait` is below every test queue's
/// visibility timeout.
#[idem::idempotent(key = "job.id", scope = "sqs.top_up", batch = "jobs", wait = "1s")]
pub async fn apply_batch(
    tx: &mut Transaction<'_, Postgres>,
    jobs: &[TopUp],
    effects: &str,
) -> Result<usize, JobError> {
    for job in jobs {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {effects} (job, credits) VALUES ($1, $2)"
        )))
        .bind(&job.id)
        .bind(job.credits)
        .execute(&mut **tx)
        .await?;
    }
    Ok(jobs.len())
}

/// The lease-mode handler: its effect is a row written outside idem's statements (autocommit,
/// as a call to another system would be), then it waits for the test to open the gate (a file)
/// while either the full heartbeat (`extend`: renew the lease, then extend the message's
/// visibility) or the lease renewal alone runs beside it. The lease (3 s, cut off 2 s after the
/// claim or the last renewal) is shorter than the test's wait: only the renewals keep it.
#[idem::idempotent(key = "job.id", scope = "sqs.notify", lease = "3s", timeout = "2s")]
pub async fn notify(
    lease: &Lease,
    job: &TopUp,
    outside: &Outside<'_>,
    worker: &Worker<'_>,
    received: &Received,
    extend: bool,
) -> Result<(), JobError> {
    let call = async {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (job, credits) VALUES ($1, $2)",
            outside.effects
        )))
        .bind(&job.id)
        .bind(job.credits)
        .execute(outside.pool)
        .await?;
        say(&format!("IN BODY {} token={}", job.id, lease.token()));
        while !std::path::Path::new(outside.gate).exists() {
            // Bounded by the lease's timeout: a body the renewals do not keep is cut off.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    };
    let renew_only = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if let Err(e) = lease.renew().await {
                return JobError::from(e);
            }
        }
    };
    tokio::select! {
        done = call => done,
        lost = worker.keep_invisible(lease, received), if extend => Err(lost),
        lost = renew_only, if !extend => Err(lost),
    }
}

/// Where the lease-mode handler's effect goes, and the gate it waits for.
pub struct Outside<'a> {
    pub pool: &'a PgPool,
    pub effects: &'a str,
    pub gate: &'a str,
}

/// Prints one line at once (the parent reads the worker's stdout line by line).
pub fn say(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").expect("stdout");
    out.flush().expect("stdout");
}

/// A queue (with its dead-letter queue) and two tables of one test, named after it and this
/// process; dropped at the end, also when the test fails.
pub struct Names {
    pub queue: Queue,
    pub markers: String,
    pub effects: String,
    pub visibility: i32,
}

impl Names {
    pub async fn create(test: &str, visibility: i32, max_receive_count: u32) -> Names {
        let id = format!("{test}_{}", std::process::id());
        let pool = postgres(2).await;
        let (markers, effects) = (format!("sqs_{id}_markers"), format!("sqs_{id}_effects"));
        for sql in [
            format!("DROP TABLE IF EXISTS {effects}"),
            format!("DROP TABLE IF EXISTS {markers}"),
            format!("DROP TABLE IF EXISTS {markers}_outbox"),
            format!("CREATE TABLE {effects} (job text NOT NULL, credits bigint NOT NULL)"),
        ] {
            sqlx::query(AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .unwrap();
        }
        Store::new(pool.clone())
            .with_table(&markers)
            .unwrap()
            .migrate()
            .await
            .unwrap();
        pool.close().await;
        let queue = create_queue(
            &sqs().await,
            &format!("idem-test-{}", id.replace('_', "-")),
            visibility,
            max_receive_count,
        )
        .await
        .unwrap();
        Names {
            queue,
            markers,
            effects,
            visibility,
        }
    }

    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            (CHILD_QUEUE, self.queue.url.clone()),
            (CHILD_DLQ, self.queue.dead_letters.clone()),
            (CHILD_MARKERS, self.markers.clone()),
            (CHILD_EFFECTS, self.effects.clone()),
            (CHILD_VISIBILITY, self.visibility.to_string()),
        ]
    }

    /// (rows, distinct jobs, sum of credits) of the effects table.
    pub async fn effects(&self) -> (i64, i64, i64) {
        let pool = postgres(1).await;
        let row = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT job), coalesce(sum(credits), 0)::bigint FROM {}",
            self.effects
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        pool.close().await;
        row
    }

    /// Messages waiting plus those received and not deleted, in the queue and in its
    /// dead-letter queue.
    pub async fn left(&self) -> (u64, u64) {
        let client = sqs().await;
        let (a, b) = messages_left(&client, &self.queue.url).await.unwrap();
        let (c, d) = messages_left(&client, &self.queue.dead_letters)
            .await
            .unwrap();
        (a + b, c + d)
    }

    /// Polls until the queue and its dead-letter queue hold no message, for at most `secs`.
    pub async fn wait_empty(&self, secs: u64) -> (u64, u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let left = self.left().await;
            if left.0 == 0 || tokio::time::Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Names {
    fn drop(&mut self) {
        let queue = self.queue.clone();
        let tables = [
            self.effects.clone(),
            self.markers.clone(),
            format!("{}_outbox", self.markers),
        ];
        // Drop cannot await; a runtime of its own on another thread can, also while the test
        // unwinds from a failed assertion.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(client) = connect(&sqs_url()).await {
                    drop(delete_queue(&client, &queue).await);
                }
                let pool = postgres(1).await;
                for t in &tables {
                    drop(
                        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
                            .execute(&pool)
                            .await,
                    );
                }
                pool.close().await;
            });
        });
        drop(done.join());
    }
}

/// A client of the tests' SQS; panics naming the URL if it does not answer.
pub async fn sqs() -> aws_sdk_sqs::Client {
    connect(&sqs_url()).await.unwrap_or_else(|e| panic!("{e}"))
}

pub fn job(n: i64) -> TopUp {
    TopUp {
        id: format!("top-up-{n}"),
        account: n,
        credits: n,
    }
}

/// The worker process. Modes: `batch` (the batch handler); `pause_after_commit` (the batch
/// handler, then, once a batch committed with an applied job, prints `COMMITTED id id ..`
/// before the delete and waits to be killed); `lease_heartbeat` and `lease_renew_only` (the
/// lease-mode handler with the full heartbeat, or with the lease renewal alone). Prints `READY`
/// before its first receive and `STOPPED` after a `STOP` line on stdin.
pub async fn child_main() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        panic!("child_process is a worker process that the tests start with {CHILD_MODE} set")
    };
    let queue = Queue {
        url: child_env(CHILD_QUEUE),
        dead_letters: child_env(CHILD_DLQ),
    };
    let (markers, effects) = (child_env(CHILD_MARKERS), child_env(CHILD_EFFECTS));
    let visibility: i32 = child_env(CHILD_VISIBILITY).parse().unwrap();
    let pool = postgres(4).await;
    let store = Store::new(pool.clone()).with_table(&markers).unwrap();
    let client = sqs().await;
    let on_event = |event: &Event| say(&event.to_string());
    let worker = Worker {
        client: &client,
        queue: &queue,
        options: Options {
            wait_seconds: 1,
            visibility,
            retry_after: RETRY_AFTER,
            // Below the visibility timeout and the lease's timeout (2 s), with room for the
            // round trips of a loaded machine.
            heartbeat: Duration::from_millis(700),
        },
        on_event: &on_event,
    };
    say("READY");
    let (store, effects, worker_ref) = (&store, &effects, &worker);
    let result = match mode.as_str() {
        "batch" | "pause_after_commit" => {
            let pause = mode == "pause_after_commit";
            let handle = move |batch: Vec<Received>| async move {
                let jobs: Vec<TopUp> = batch.iter().map(|r| r.job.clone()).collect();
                let result = apply_batch(store, &jobs, effects).await;
                if pause
                    && let Ok(done) = &result
                    && done.outcomes().contains(&Outcome::Applied(()))
                {
                    let ids: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
                    say(&format!("COMMITTED {}", ids.join(" ")));
                    std::future::pending::<()>().await;
                }
                batch_verdicts(&result, jobs.len(), RETRY_AFTER)
            };
            worker.run(handle, stop_signal()).await
        }
        "lease_heartbeat" | "lease_renew_only" => {
            let extend = mode == "lease_heartbeat";
            let gate = child_env(CHILD_GATE);
            let outside = Outside {
                pool: &pool,
                effects,
                gate: &gate,
            };
            let outside = &outside;
            let handle = move |batch: Vec<Received>| async move {
                let calls = batch.iter().map(|r| async move {
                    let result = notify(store, &r.job, outside, worker_ref, r, extend).await;
                    verdict(&result, RETRY_AFTER)
                });
                let verdicts: Vec<Verdict> = futures_util::future::join_all(calls).await;
                verdicts
            };
            worker.run(handle, stop_signal()).await
        }
        other => panic!("unknown worker mode {other}"),
    };
    result.unwrap();
    say("STOPPED");
}

/// The environment of a lease-mode worker: the test's names and the gate file.
pub fn lease_env(names: &Names, gate: &std::path::Path) -> Vec<(&'static str, String)> {
    let mut env = names.env();
    env.push((CHILD_GATE, gate.display().to_string()));
    env
}
