//! `idem::JobError` as the error of real handlers, in every mode: the body's own errors come
//! through `?` and keep nothing, idem's keep their kind, and the consumer loop's decision
//! (`Settle::decide`) is the one the error it holds gets.

use std::sync::{Arc, Mutex};

use idem::settle::{Delivery, Runner, Source};
use idem::{
    Claimed, Classify, Disposition, Error, GroupOptions, JobError, Key, Lease, Outcome, Settle,
};
use sqlx::{Pool, Transaction};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::db::{Bind, TestDb};
use crate::conformance::handlers::{Job, insert_effect};

/// What a body does after its effect statement.
#[derive(Clone, Copy, Debug)]
enum Then {
    Commit,
    /// A statement on a table that does not exist: the body's own database error, one that
    /// fails on every delivery (permanent, as idem classifies it).
    MissingTable,
    /// A payload that never parses, marked permanent by the body.
    Unparsable,
}

async fn finish<DB: TestDb>(
    conn: &mut DB::Connection,
    job: &Job,
    then: Then,
) -> Result<i64, JobError> {
    match then {
        Then::Commit => Ok(job.amount),
        Then::MissingTable => {
            let sql = "INSERT INTO idem_no_such_table (id) VALUES ($1)";
            DB::execute(conn, sql, &[Bind::I64(job.id)]).await?;
            unreachable!("the table does not exist")
        }
        Then::Unparsable => serde_json::from_str("not a job").map_err(JobError::permanent),
    }
}

#[idem::idempotent(
    key = "job.key",
    scope = "job_error.tx",
    replay,
    fingerprint = "job.amount"
)]
async fn in_tx<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    then: Then,
) -> Result<i64, JobError> {
    insert_effect(tx, job, "tx").await?;
    finish::<DB>(&mut **tx, job, then).await
}

#[idem::idempotent(key = "job.key", scope = "job_error.lease", lease = "30s")]
async fn in_lease<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    pool: &Pool<DB>,
    then: Then,
) -> Result<i64, JobError> {
    let mut conn = pool.acquire().await?;
    // The effect, outside any transaction, as a lease body's outside call is.
    let sql = format!(
        "INSERT INTO {} (id, amount, origin) VALUES ($1, $2, 'lease')",
        job.effects
    );
    DB::execute(&mut conn, &sql, &[Bind::I64(job.id), Bind::I64(job.amount)]).await?;
    let result = finish::<DB>(&mut conn, job, then).await;
    match (then, result) {
        // The marker records the failure only if the lease is told it; a database error of
        // the body's is left to the consumer, whose fix (a migration) a redelivery then meets.
        (Then::Unparsable, Err(e)) => Err(lease.permanent(e)),
        (_, result) => result,
    }
}

#[idem::idempotent(key = "job.key", scope = "job_error.batch", batch = "jobs")]
async fn in_batch<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    jobs: &[Job],
) -> Result<usize, JobError> {
    for job in jobs {
        insert_effect(tx, job, "batch").await?;
    }
    Ok(jobs.len())
}

#[idem::idempotent(key = "job.key", scope = "job_error.each", each = "job")]
async fn in_each<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    failing: i64,
) -> Result<i64, JobError> {
    insert_effect(tx, job, "each").await?;
    let then = if job.id == failing {
        Then::MissingTable
    } else {
        Then::Commit
    };
    finish::<DB>(&mut **tx, job, then).await
}

#[idem::idempotent(key = "job.key", scope = "job_error.group", group)]
async fn in_group<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    then: Then,
) -> Result<i64, JobError> {
    insert_effect(tx, job, "group").await?;
    finish::<DB>(&mut **tx, job, then).await
}

fn decide<T>(result: &Result<Outcome<T>, JobError>) -> Disposition {
    Settle::new().decide(result, 1)
}

/// The body's own database error, as it returned it, dead-lettered with its text.
fn missing_table<T: std::fmt::Debug>(result: Result<Outcome<T>, JobError>) {
    let error = result.as_ref().expect_err("the statement fails");
    assert!(error.as_idem().is_none(), "the body's own error: {error}");
    let sqlx = error.downcast_ref::<sqlx::Error>().expect("a sqlx::Error");
    assert!(sqlx.as_database_error().is_some(), "{sqlx}");
    assert!(
        Classify::is_permanent(sqlx),
        "a missing table fails again: {sqlx}"
    );
    let reason = error.to_string();
    assert_eq!(reason, sqlx.to_string());
    assert_eq!(decide(&result), Disposition::DeadLetter { reason });
}

pub(crate) async fn job_error_handlers_keep_idem_kinds_and_settle_as_them<S: Support>() {
    let ctx = Ctx::<S>::new("joberr", 3).await;
    let job = ctx.job("job-1", 1, 10);

    // Transaction mode: applied once, replayed after.
    let first = in_tx(&ctx.store, &job, Then::Commit).await;
    assert_eq!(first.as_ref().ok(), Some(&Outcome::Applied(10)));
    assert_eq!(decide(&first), Disposition::Ack);
    let again = in_tx(&ctx.store, &job, Then::Commit).await;
    assert_eq!(again.as_ref().ok(), Some(&Outcome::Replayed(10)));
    assert_eq!(ctx.effects_from(1, "tx").await, 1);
    // The same key for another payload: idem's own error, its kind kept.
    let reused = in_tx(&ctx.store, &ctx.job("job-1", 1, 11), Then::Commit).await;
    let error = reused.as_ref().expect_err("a reused key");
    assert!(
        matches!(error.as_idem(), Some(Error::KeyReused { .. })),
        "{error:?}"
    );
    assert!(!error.as_idem().unwrap().is_transient());
    let reason = error.to_string();
    assert_eq!(decide(&reused), Disposition::DeadLetter { reason });
    assert_eq!(ctx.effects_from(1, "tx").await, 1);
    // The body's own errors: nothing kept, neither the effect nor the marker.
    missing_table(in_tx(&ctx.store, &ctx.job("job-2", 2, 20), Then::MissingTable).await);
    let unparsable = in_tx(&ctx.store, &ctx.job("job-3", 3, 30), Then::Unparsable).await;
    let error = unparsable.as_ref().expect_err("the payload does not parse");
    assert!(
        error.downcast_ref::<serde_json::Error>().is_some(),
        "{error:?}"
    );
    let reason = error.to_string();
    assert_eq!(decide(&unparsable), Disposition::DeadLetter { reason });
    assert_eq!((ctx.effects(2).await, ctx.effects(3).await), (0, 0));
    assert_eq!(ctx.markers().await, 1);
    // Redelivered once the body can succeed, each applies once.
    let fixed = in_tx(&ctx.store, &ctx.job("job-2", 2, 20), Then::Commit).await;
    assert_eq!(fixed.ok(), Some(Outcome::Applied(20)));
    assert_eq!(ctx.effects(2).await, 1);

    // By hand: `?` takes the claim's `idem::Error`, `finish` the body's `JobError`.
    let by_hand = ctx.job("job-13", 13, 130);
    let key = Key::new(&by_hand.key)
        .map_err(JobError::from)
        .expect("a key");
    for then in [Then::MissingTable, Then::Commit, Then::Commit] {
        let done: Result<Outcome<i64>, JobError> = async {
            match ctx.store.claim("job_error.by_hand", &key).await? {
                Claimed::Fresh(mut guard) => {
                    let result = async {
                        insert_effect(guard.tx(), &by_hand, "hand").await?;
                        finish::<S::Db>(&mut **guard.tx(), &by_hand, then).await
                    }
                    .await;
                    guard.finish(result).await
                }
                Claimed::Duplicate => Ok(Outcome::Duplicate),
                other => panic!("a transaction-mode claim: {other:?}"),
            }
        }
        .await;
        match then {
            Then::MissingTable => missing_table(done),
            _ => assert!(
                matches!(done, Ok(Outcome::Applied(130) | Outcome::Duplicate)),
                "{done:?}"
            ),
        }
    }
    assert_eq!(ctx.effects_from(13, "hand").await, 1);

    // Batch mode: the fresh jobs only.
    let batch = [ctx.job("job-4", 4, 40), ctx.job("job-5", 5, 50)];
    let done = in_batch(&ctx.store, &batch[..1])
        .await
        .expect("the batch commits");
    assert_eq!(done.outcomes(), &[Outcome::Applied(())]);
    let done = in_batch(&ctx.store, &batch)
        .await
        .expect("the batch commits");
    assert_eq!(done.outcomes(), &[Outcome::Duplicate, Outcome::Applied(())]);
    assert_eq!(done.value(), Some(&1));
    assert_eq!(
        (
            ctx.effects_from(4, "batch").await,
            ctx.effects_from(5, "batch").await
        ),
        (1, 1)
    );

    // Each mode: the failing job alone, with its own error.
    let jobs = [
        ctx.job("job-6", 6, 60),
        ctx.job("job-7", 7, 70),
        ctx.job("job-8", 8, 80),
    ];
    let each = in_each(&ctx.store, &jobs, 7)
        .await
        .expect("the batch commits");
    let mut results = each.into_results().into_iter();
    assert_eq!(
        results.next().map(Result::ok),
        Some(Some(Outcome::Applied(60)))
    );
    missing_table(results.next().expect("job 7's result"));
    assert_eq!(
        results.next().map(Result::ok),
        Some(Some(Outcome::Applied(80)))
    );
    assert_eq!(
        (
            ctx.effects(6).await,
            ctx.effects(7).await,
            ctx.effects(8).await
        ),
        (1, 0, 1)
    );

    // Group mode, on a pool of twice its lane.
    let group = ctx.store.group(GroupOptions::new()).expect("a group");
    let grouped = ctx.job("job-9", 9, 90);
    let applied = in_group(&group, &grouped, Then::Commit).await;
    assert_eq!(applied.ok(), Some(Outcome::Applied(90)));
    let duplicate = in_group(&group, &grouped, Then::Commit).await;
    assert_eq!(duplicate.ok(), Some(Outcome::Duplicate));
    missing_table(in_group(&group, &ctx.job("job-10", 10, 100), Then::MissingTable).await);
    assert_eq!((ctx.effects(9).await, ctx.effects(10).await), (1, 0));

    // Lease mode: a permanent error told to the lease is recorded, and acked.
    let declined = ctx.job("job-11", 11, 110);
    let failed = in_lease(&ctx.store, &declined, &ctx.pool, Then::Unparsable).await;
    let text = serde_json::from_str::<i64>("not a job")
        .unwrap_err()
        .to_string();
    match &failed {
        Ok(Outcome::Failed(failure)) => assert_eq!(failure.error(), text),
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(decide(&failed), Disposition::Ack);
    let again = in_lease(&ctx.store, &declined, &ctx.pool, Then::Commit).await;
    assert!(matches!(again, Ok(Outcome::Failed(_))), "{again:?}");
    // The body's database error is not told to the lease: the key is released, and the
    // consumer dead-letters it.
    missing_table(
        in_lease(
            &ctx.store,
            &ctx.job("job-12", 12, 120),
            &ctx.pool,
            Then::MissingTable,
        )
        .await,
    );
    let retried = in_lease(
        &ctx.store,
        &ctx.job("job-12", 12, 120),
        &ctx.pool,
        Then::Commit,
    )
    .await;
    assert_eq!(retried.ok(), Some(Outcome::Applied(120)));
    // Outside a transaction, each delivery that ran made its effect: once for the failed job
    // (the redelivery did not run), twice for the one retried.
    assert_eq!(
        (
            ctx.effects_from(11, "lease").await,
            ctx.effects_from(12, "lease").await
        ),
        (1, 2)
    );

    ctx.cleanup().await;
}

/// A broker in memory: its deliveries in order, and how each was settled.
struct Queue {
    pending: std::collections::VecDeque<Message>,
    settled: Arc<Mutex<Vec<Disposition>>>,
}

struct Message {
    payload: Vec<u8>,
    count: u32,
    settled: Arc<Mutex<Vec<Disposition>>>,
}

impl Source for Queue {
    type Delivery = Message;
    type Error = std::io::Error;

    async fn next(&mut self) -> Option<Result<Message, std::io::Error>> {
        self.pending.pop_front().map(Ok)
    }

    async fn stop(&mut self) -> Result<(), std::io::Error> {
        Ok(())
    }

    async fn close(self) -> Result<(), std::io::Error> {
        Ok(())
    }
}

impl Delivery for Message {
    type Error = std::io::Error;

    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn count(&self) -> u32 {
        self.count
    }

    async fn settle(self, disposition: &Disposition) -> Result<(), std::io::Error> {
        let mut settled = self.settled.lock().expect("the settlements");
        settled.push(disposition.clone());
        Ok(())
    }
}

/// A delivery's payload: the job, and what its body does.
#[derive(Debug, serde::Deserialize)]
struct Payload {
    key: String,
    id: i64,
    amount: i64,
    unparsable: bool,
}

pub(crate) async fn runner_settles_job_errors_as_the_errors_they_hold<S: Support>() {
    let ctx = Ctx::<S>::new("joberr_run", 3).await;
    let settled = Arc::new(Mutex::new(Vec::new()));
    let message = |payload: String, count: u32| Message {
        payload: payload.into_bytes(),
        count,
        settled: settled.clone(),
    };
    let job = |key: &str, id: i64, amount: i64, unparsable: bool| {
        format!(r#"{{"key":"{key}","id":{id},"amount":{amount},"unparsable":{unparsable}}}"#)
    };
    let queue = Queue {
        pending: [
            message(job("job-1", 1, 10, false), 1),
            // Its redelivery: replayed, acked.
            message(job("job-1", 1, 10, false), 2),
            // The same key for another payload: idem's `KeyReused`.
            message(job("job-1", 1, 11, false), 1),
            // The body's own error, marked permanent.
            message(job("job-2", 2, 20, true), 1),
            message("not a job".to_owned(), 1),
        ]
        .into(),
        settled: settled.clone(),
    };
    let store = &ctx.store;
    let effects = &ctx.effects;
    let handler = |payload: Payload| async move {
        let job = Job {
            key: payload.key,
            id: payload.id,
            amount: payload.amount,
            effects: effects.clone(),
        };
        let then = if payload.unparsable {
            Then::Unparsable
        } else {
            Then::Commit
        };
        in_tx(store, &job, then).await
    };
    let tally = Runner::new()
        .in_flight(1)
        .run(queue, handler, std::future::pending())
        .await
        .expect("the queue in memory never fails");
    let reused = Error::KeyReused {
        scope: "job_error.tx".into(),
        key: "job-1".into(),
    };
    let unparsable = serde_json::from_str::<i64>("not a job").unwrap_err();
    let not_a_job = serde_json::from_str::<Payload>("not a job").unwrap_err();
    let settled = settled.lock().expect("the settlements").clone();
    assert_eq!(
        settled,
        [
            Disposition::Ack,
            Disposition::Ack,
            Disposition::DeadLetter {
                reason: reused.to_string()
            },
            Disposition::DeadLetter {
                reason: unparsable.to_string()
            },
            Disposition::unparsable(not_a_job),
        ]
    );
    assert_eq!(
        (
            tally.applied,
            tally.acked_otherwise,
            tally.retried,
            tally.dead_lettered
        ),
        (1, 1, 0, 3)
    );
    assert_eq!((ctx.effects(1).await, ctx.effects(2).await), (1, 0));
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}
