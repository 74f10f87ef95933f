//! A batch run job by job: a job that fails is rolled back alone (its effect, its messages,
//! its marker) and reported with its own error, while the others commit; a failure that takes
//! the transaction with it fails the batch as a whole. The attribute's handler (`apply_each`)
//! and the hand-written one (`apply_each_by_hand`) run the same body.

use std::time::Duration;

use idem::{Claimed, Each, Error, Key, LeaseOptions, MarkerState, NotKept, Outcome};

use crate::conformance::ctx::Ctx;
use crate::conformance::each_handlers::*;
use crate::conformance::handlers::*;
use crate::conformance::util::within;
use crate::conformance::{Server, Support};

fn jobs<S: Support>(ctx: &Ctx<S>, ids: impl IntoIterator<Item = i64>) -> Vec<Job> {
    ids.into_iter()
        .map(|i| ctx.job(&format!("job-{i}"), i, 10 * i))
        .collect()
}

/// The table a poisoned job inserts id 0 into a second time.
async fn poison_table<S: Support>(ctx: &mut Ctx<S>) -> String {
    let table = ctx
        .create_table("p", "(id BIGINT NOT NULL PRIMARY KEY)")
        .await;
    ctx.exec(&format!("INSERT INTO {table} (id) VALUES (0)"))
        .await;
    table
}

/// `Ok(Applied(10 * id))` for each job but the failed ones, whose results must be `Err`.
fn assert_each(done: &Each<i64, TestError>, jobs: &[Job], failed: &[i64], dup: &[i64]) {
    for (result, job) in done.results().iter().zip(jobs) {
        match result {
            Ok(Outcome::Applied(v)) if !failed.contains(&job.id) && !dup.contains(&job.id) => {
                assert_eq!(*v, job.amount);
            }
            Ok(Outcome::Duplicate) if dup.contains(&job.id) => {}
            Err(_) if failed.contains(&job.id) => {}
            other => panic!("job {}: unexpected {other:?}", job.id),
        }
    }
}

pub(crate) async fn poison_job_rolls_back_alone_and_its_batch_commits<S: Support>() {
    let mut ctx = Ctx::<S>::new("poison", 2).await;
    let table = poison_table(&mut ctx).await;
    let batch = jobs(&ctx, 1..=100);
    let poison = Poison {
        table: &table,
        ids: &[37],
        swallow: false,
    };
    let done = apply_each(&ctx.store, &batch, poison)
        .await
        .expect("the batch commits");
    assert_each(&done, &batch, &[37], &[]);
    match &done.results()[36] {
        Err(TestError::Db(e)) => {
            let kind = e.as_database_error().map(|e| e.kind());
            assert_eq!(kind, Some(sqlx::error::ErrorKind::UniqueViolation), "{e}");
        }
        other => panic!("expected job 37's own error, got {other:?}"),
    }
    assert_eq!(done.applied(), 99);
    assert_eq!(done.acks().count(), 99);
    let failures: Vec<usize> = done.failures().map(|(at, _)| at).collect();
    assert_eq!(failures, [36]);
    assert_eq!(ctx.effects_total().await, 99, "the 99 others' effects");
    assert_eq!(
        ctx.effects(37).await,
        0,
        "the poison job's effect was rolled back"
    );
    assert_eq!(ctx.markers().await, 99, "the 99 others' markers");
    assert!(!ctx.stored_keys().await.contains(&"job-37".to_owned()));
    // Redelivered alone, the failed job runs (a single-job handler of the same scope).
    assert_eq!(
        applied(apply(&ctx.store, &batch[36], Then::Commit).await),
        370
    );
    // The whole batch again: every job a duplicate, no body run.
    let again = apply_each(&ctx.store, &batch, poison)
        .await
        .expect("all duplicates");
    let all: Vec<i64> = (1..=100).collect();
    assert_each(&again, &batch, &[], &all);
    assert_eq!(ctx.effects_total().await, 100);
    for id in [1, 36, 37, 38, 100] {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    ctx.cleanup().await;
}

pub(crate) async fn poison_jobs_by_hand_fail_alone_beside_duplicates<S: Support>() {
    let mut ctx = Ctx::<S>::new("poisonhand", 2).await;
    let table = poison_table(&mut ctx).await;
    let batch = jobs(&ctx, 1..=10);
    for job in [&batch[1], &batch[3]] {
        applied(apply(&ctx.store, job, Then::Commit).await);
    }
    let poison = Poison {
        table: &table,
        ids: &[5, 9],
        swallow: false,
    };
    let done = apply_each_by_hand(&ctx.store, &batch, poison)
        .await
        .expect("the batch commits");
    assert_each(&done, &batch, &[5, 9], &[2, 4]);
    assert_eq!(ctx.effects_total().await, 8, "2 and 4 before, 6 now");
    assert_eq!((ctx.effects(5).await, ctx.effects(9).await), (0, 0));
    assert_eq!(ctx.markers().await, 8);
    // Every job poisoned: nothing to commit, every fresh job its own error.
    let rest = [batch[4].clone(), batch[8].clone()];
    let poison = Poison {
        table: &table,
        ids: &[5, 9],
        swallow: false,
    };
    let none = apply_each_by_hand(&ctx.store, &rest, poison)
        .await
        .expect("the batch ends");
    assert_each(&none, &rest, &[5, 9], &[]);
    assert_eq!(ctx.markers().await, 8);
    let fixed = apply_each_by_hand(&ctx.store, &batch, Poison::none())
        .await
        .expect("the redelivery commits");
    assert_each(&fixed, &batch, &[], &[1, 2, 3, 4, 6, 7, 8, 10]);
    for id in 1..=10 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    ctx.cleanup().await;
}

/// A job whose marker was a free lease the batch took over, and which then fails: the lease is
/// free again (its attempt counted), and the next delivery takes it over.
pub(crate) async fn failed_job_gives_back_the_lease_it_took_over<S: Support>() {
    let mut ctx = Ctx::<S>::new("poisonlease", 2).await;
    let table = poison_table(&mut ctx).await;
    let batch = jobs(&ctx, 1..=3);
    let key = Key::new(&batch[1].key).expect("a key");
    let options = LeaseOptions::new(Duration::from_secs(30));
    let Claimed::Fresh(lease) = ctx
        .store
        .lease("apply", &key, options)
        .await
        .expect("lease")
    else {
        panic!("a fresh key was not fresh")
    };
    lease.release().await;
    let poison = Poison {
        table: &table,
        ids: &[2],
        swallow: false,
    };
    let done = apply_each(&ctx.store, &batch, poison)
        .await
        .expect("the batch commits");
    assert_each(&done, &batch, &[2], &[]);
    let marker = ctx.store.inspect("apply", &key).await.expect("inspect");
    let marker = marker.expect("the lease's marker is still there");
    assert_eq!(marker.state, MarkerState::InProgress);
    assert_eq!(marker.attempts, 2, "the batch's attempt counted");
    assert_eq!(marker.locked_until, None, "free for the next delivery");
    assert_eq!(
        applied(apply(&ctx.store, &batch[1], Then::Commit).await),
        20
    );
    let marker = ctx.store.inspect("apply", &key).await.expect("inspect");
    assert_eq!(marker.expect("a marker").state, MarkerState::Completed);
    assert_eq!(ctx.effects_total().await, 3);
    ctx.cleanup().await;
}

/// A job that swallows a failed statement and returns `Ok`: on PostgreSQL its savepoint is aborted,
/// so the job is rolled back alone and reported `NotKept::RolledBack`; on MySQL and SQLite a failed
/// statement undoes only itself, and the job (its effect included) is applied.
pub(crate) async fn job_that_swallows_a_statement_error<S: Support>() {
    let mut ctx = Ctx::<S>::new("poisonswallow", 2).await;
    let table = poison_table(&mut ctx).await;
    let batch = jobs(&ctx, 1..=4);
    let poison = Poison {
        table: &table,
        ids: &[3],
        swallow: true,
    };
    let done = apply_each(&ctx.store, &batch, poison)
        .await
        .expect("the batch commits");
    if S::FAILED_STATEMENT_ABORTS {
        assert_each(&done, &batch, &[3], &[]);
        match &done.results()[2] {
            Err(TestError::Idem(Error::NotKept(NotKept::RolledBack { key, .. }))) => {
                assert_eq!(key, "job-3")
            }
            other => panic!("expected NotKept::RolledBack for job 3, got {other:?}"),
        }
        assert_eq!((ctx.effects_total().await, ctx.markers().await), (3, 3));
    } else {
        assert_each(&done, &batch, &[], &[]);
        assert_eq!((ctx.effects_total().await, ctx.markers().await), (4, 4));
    }
    ctx.cleanup().await;
}

/// A job that makes the database roll back the whole transaction and swallows the error
/// (MySQL: a deadlock victim; SQLite: `INSERT OR ROLLBACK`) fails the batch as a whole:
/// nothing is applied, and each job's redelivery applies it once. On PostgreSQL the same body
/// (a statement error) stays in its savepoint: the job alone is rolled back.
pub(crate) async fn job_that_takes_the_transaction_with_it_fails_the_batch<S: Support>() {
    // One connection, so that the redelivery runs on the one the failed batch gave back.
    let mut ctx = Ctx::<S>::new("poisonwhole", 1).await;
    let rows = ctx
        .create_table("r", "(id BIGINT NOT NULL PRIMARY KEY, v BIGINT NOT NULL)")
        .await;
    let values: Vec<String> = (1..=100).map(|i| format!("({i}, 0)")).collect();
    ctx.exec(&format!(
        "INSERT INTO {rows} (id, v) VALUES {}",
        values.join(", ")
    ))
    .await;
    let other = S::connect(&ctx.url, 2).await;
    let batch = jobs(&ctx, 1..=4);
    let call = apply_each_swallowing::<S>(&ctx.store, &batch, 2, &other, &rows);
    let done = within(120, "the swallowing job", call).await;
    other.close().await;
    if S::FAILED_STATEMENT_ABORTS {
        let done = done.expect("the others commit");
        assert_each(&done, &batch, &[2], &[]);
        assert_eq!((ctx.effects_total().await, ctx.markers().await), (3, 3));
    } else {
        match done {
            Err(TestError::Idem(Error::NotKept(NotKept::RolledBack { scope, key }))) => {
                assert_eq!((scope.as_str(), key.as_str()), ("apply", "job-2"));
            }
            other => panic!("expected the batch's RolledBack, got {other:?}"),
        }
        assert_eq!((ctx.effects_total().await, ctx.markers().await), (0, 0));
    }
    // sqlx refuses a `BEGIN` on a connection it counts as still in a transaction.
    let tx = ctx.pool.begin_with("BEGIN").await;
    let tx = tx.expect("the batch's connection went back to the pool with no transaction open");
    tx.rollback().await.expect("roll back the probe");
    let again = apply_each_by_hand(&ctx.store, &batch, Poison::none())
        .await
        .expect("the redelivery commits");
    assert_eq!(again.acks().count(), 4);
    for id in 1..=4 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    ctx.cleanup().await;
}

/// A job guard dropped before it finished (a caught panic, a cancelled body): the job is
/// rolled back alone before the next one runs, and reported `JobNotFinished`.
pub(crate) async fn dropped_job_guard_is_rolled_back_alone<S: Support>() {
    let ctx = Ctx::<S>::new("poisondrop", 2).await;
    let batch = jobs(&ctx, 1..=5);
    let done = apply_each_dropping(&ctx.store, &batch, 2)
        .await
        .expect("the batch commits");
    assert_each(&done, &batch, &[3], &[]);
    match &done.results()[2] {
        Err(TestError::Idem(Error::NotKept(NotKept::JobNotFinished { key, .. }))) => {
            assert_eq!(key, "job-3")
        }
        other => panic!("expected JobNotFinished, got {other:?}"),
    }
    assert_eq!((ctx.effects(3).await, ctx.effects_total().await), (0, 4));
    assert_eq!(ctx.markers().await, 4);
    ctx.cleanup().await;
}

/// Each job's messages are written with the batch's commit only if the job ended `Ok`.
pub(crate) async fn job_messages_exist_exactly_for_the_kept_jobs<S: Support>() {
    let mut ctx = Ctx::<S>::new("poisonbox", 2).await;
    let table = poison_table(&mut ctx).await;
    let batch = jobs(&ctx, 1..=4);
    let poison = Poison {
        table: &table,
        ids: &[2],
        swallow: false,
    };
    let done = apply_each_sending(&ctx.store, &batch, poison)
        .await
        .expect("the batch commits");
    assert_each(&done, &batch, &[2], &[]);
    let outbox = format!("{}_outbox", ctx.store.table());
    let count = |key: &str| {
        format!(
            "SELECT COUNT(*) FROM {outbox} WHERE {} = '{key}'",
            S::KEY_TEXT
        )
    };
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {outbox}")).await,
        3
    );
    assert_eq!(ctx.scalar(&count("job-2")).await, 0);
    assert_eq!(ctx.scalar(&count("job-3")).await, 1);
    // The redelivery of job 2 sends its message, under the id it had.
    let again = apply_each_sending(&ctx.store, &batch, Poison::none())
        .await
        .expect("the redelivery commits");
    assert_eq!(again.applied(), 1);
    assert_eq!(ctx.scalar(&count("job-2")).await, 1);
    ctx.cleanup().await;
}

/// The batch's connection killed inside a job: the job's error takes the transaction with
/// it, the batch fails as a whole and keeps nothing, and its redelivery applies each job once.
pub(crate) async fn connection_killed_in_a_job_fails_the_batch_and_keeps_nothing<S: Server>() {
    let ctx = Ctx::<S>::new("poisonkill", 2).await;
    let killer = S::connect(&ctx.url, 1).await;
    let batch = jobs(&ctx, 1..=5);
    let keys = Key::batch(batch.iter().map(|j| j.key.as_str())).expect("keys");
    let run = async {
        let mut each = ctx.store.claim_batch("apply", &keys).await?.each();
        for (position, job) in batch.iter().enumerate() {
            let Some(mut step) = each.job(position).await? else {
                continue;
            };
            let result = async {
                insert_effect(step.tx(), job, "each").await?;
                if job.id == 3 {
                    let id = S::connection_id(&mut **step.tx()).await;
                    S::kill(&killer, id).await;
                    insert_effect(step.tx(), job, "each").await?;
                }
                Ok::<_, TestError>(job.amount)
            };
            let result = result.await;
            step.finish(result).await?;
        }
        each.finish().await
    };
    match within(120, "the batch whose connection is killed", run).await {
        Err(TestError::Db(_) | TestError::Idem(Error::Database(_))) => {}
        other => panic!("expected the batch to fail, got {other:?}"),
    }
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (0, 0));
    let again = apply_each(&ctx.store, &batch, Poison::none())
        .await
        .expect("the redelivery commits");
    assert_eq!(again.applied(), 5);
    for id in 1..=5 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    killer.close().await;
    ctx.cleanup().await;
}
