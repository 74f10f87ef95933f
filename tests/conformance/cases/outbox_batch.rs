//! A batch handler's outbox (`outbox: &mut idem::BatchOutbox`): each message names its job,
//! gets the id that job would give it alone, and commits with the batch, or not at all.

use idem::outbox::Relay;
use idem::{BatchOutbox, Outcome};
use sqlx::Transaction;

use super::outbox::{outbox_table, publisher, received_table, ship};
use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::db::{Bind, TestDb};
use crate::conformance::handlers::*;
use crate::conformance::util::within;
use crate::conformance::worker::{self, Worker};

const A: Outcome<()> = Outcome::Applied(());
const D: Outcome<()> = Outcome::Duplicate;

/// [`ship`] for a batch, in its scope: each fresh job's effect and two messages to
/// `shipping`; then one more message for `also` (a key that may be no fresh job's).
#[idem::idempotent(key = "job.key", scope = "orders.ship", batch = "jobs")]
pub(super) async fn ship_batch<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    jobs: &[Job],
    outbox: &mut BatchOutbox,
    also: Option<&str>,
    then: Then,
) -> Result<usize, TestError> {
    for job in jobs {
        insert_effect(tx, job, "ship").await?;
        for n in 0..2 {
            outbox.send(&job.key, "shipping", &(job.id, n))?;
        }
    }
    if let Some(key) = also {
        outbox.send(key, "shipping", &0)?;
    }
    match then {
        Then::Commit => Ok(jobs.len()),
        Then::Panic => panic!("the batch's body panics after its sends"),
        Then::Hang => match hang_in_body().await {},
        Then::Fail => Err(TestError::Refused),
    }
}

fn id_of(key: &str, n: u32) -> String {
    idem::job_id("orders.ship", &(key, n))
        .expect("a valid id")
        .into_string()
}

/// A batch whose body fails leaves no message; one that commits leaves exactly its fresh
/// jobs' messages, with the ids and keys a handler of one job gives them, so that either mode
/// reads the other's: a job applied alone is a duplicate in the batch (and sends nothing
/// again), a job applied in the batch is a duplicate alone. The relay then publishes each
/// message once.
pub(crate) async fn batch_outbox_messages_commit_with_the_batch<S: Support>() {
    let mut ctx = Ctx::<S>::new("outboxbatch", 2).await;
    let received = received_table(&mut ctx).await;
    let jobs: Vec<Job> = (1..=3)
        .map(|i| ctx.job(&format!("order-{i}"), i, 10 * i))
        .collect();
    let count = format!("SELECT COUNT(*) FROM {}", outbox_table(&ctx));
    applied(ship(&ctx.store, &jobs[1], 2, Then::Commit).await);
    assert_eq!(ctx.scalar(&count).await, 2);

    match ship_batch(&ctx.store, &jobs, None, Then::Fail).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's error, got {other:?}"),
    }
    assert_eq!(ctx.scalar(&count).await, 2, "a failed batch sends nothing");
    assert_eq!(ctx.markers().await, 1);

    let done = ship_batch(&ctx.store, &jobs, None, Then::Commit)
        .await
        .expect("the batch commits");
    assert_eq!(done.outcomes(), [A, D, A]);
    assert_eq!(done.value(), Some(&2));
    assert_eq!(ctx.scalar(&count).await, 6);
    for job in &jobs {
        for n in 0..2 {
            let id = id_of(&job.key, n);
            let entry = ctx
                .store
                .outbox_message(&id)
                .await
                .expect("read the outbox")
                .unwrap_or_else(|| panic!("{} #{n} was written", job.key));
            assert_eq!(
                (entry.scope.as_str(), entry.key.as_str(), entry.seq),
                ("orders.ship", job.key.as_str(), i64::from(n)),
            );
        }
    }

    // Redelivered as a batch, or one job alone: duplicates, nothing sent again.
    let again = ship_batch(&ctx.store, &jobs, None, Then::Fail)
        .await
        .expect("all duplicates");
    assert_eq!(again.outcomes(), [D, D, D]);
    duplicate(ship(&ctx.store, &jobs[2], 2, Then::Commit).await);
    assert_eq!(ctx.scalar(&count).await, 6);
    for id in 1..=3 {
        assert_eq!(ctx.effects(id).await, 1, "order-{id}");
    }

    let relay = Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0));
    let round = relay.relay_once().await.expect("a round");
    assert_eq!((round.sent, round.failed, round.parked), (6, 0, 0));
    for job in &jobs {
        for n in 0..2 {
            let sql = format!("SELECT COUNT(*) FROM {received} WHERE id = $1 AND body = $2");
            let binds = [
                Bind::Str(id_of(&job.key, n)),
                Bind::Str(format!("[{},{n}]", job.id)),
            ];
            assert_eq!(ctx.scalar_with(&sql, &binds).await, 1, "{} #{n}", job.key);
        }
    }
    ctx.cleanup().await;
}

/// A message for a job that is no fresh job of the batch (a duplicate, or a key not in it) is
/// refused at `send`; the body returns the error and nothing of the batch is kept.
pub(crate) async fn batch_outbox_refuses_a_job_that_is_not_fresh<S: Support>() {
    let ctx = Ctx::<S>::new("outboxbatchbad", 2).await;
    let jobs: Vec<Job> = (1..=2)
        .map(|i| ctx.job(&format!("order-{i}"), i, i))
        .collect();
    let count = format!("SELECT COUNT(*) FROM {}", outbox_table(&ctx));
    applied(ship(&ctx.store, &jobs[0], 1, Then::Commit).await);
    for also in ["order-1", "order-9"] {
        match ship_batch(&ctx.store, &jobs, Some(also), Then::Commit).await {
            Err(TestError::Idem(idem::Error::Refused(idem::Refusal::Message { reason }))) => {
                assert!(
                    reason.contains("not one of this batch's fresh jobs"),
                    "{reason}"
                );
                assert!(reason.contains(also), "{reason}");
            }
            other => panic!("expected Refusal::Message for {also}, got {other:?}"),
        }
    }
    assert_eq!(ctx.scalar(&count).await, 1);
    assert_eq!((ctx.markers().await, ctx.effects(2).await), (1, 0));
    ctx.cleanup().await;
}

/// A batch whose body panics after its sends keeps nothing: no marker, no effect, no message;
/// the redelivery applies every job and sends each message once.
pub(crate) async fn batch_outbox_of_a_panicking_body_keeps_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("outboxbatchpanic", 2).await;
    let jobs: Vec<Job> = (1..=3)
        .map(|i| ctx.job(&format!("order-{i}"), i, i))
        .collect();
    let count = format!("SELECT COUNT(*) FROM {}", outbox_table(&ctx));
    let (store, batch) = (ctx.store.clone(), jobs.clone());
    let joined =
        tokio::spawn(async move { ship_batch(&store, &batch, None, Then::Panic).await }).await;
    match joined {
        Err(e) if e.is_panic() => {}
        other => panic!("expected the task to panic, got {other:?}"),
    }
    assert_eq!(ctx.scalar(&count).await, 0);
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (0, 0));
    let next = ship_batch(&ctx.store, &jobs, None, Then::Commit);
    let done = within(60, "the batch after a panic", next)
        .await
        .expect("the batch commits");
    assert_eq!(done.outcomes(), [A, A, A]);
    assert_eq!(ctx.scalar(&count).await, 6);
    let distinct = format!("SELECT COUNT(DISTINCT id) FROM {}", outbox_table(&ctx));
    assert_eq!(ctx.scalar(&distinct).await, 6);
    ctx.cleanup().await;
}

/// The jobs of the batch a killed worker hangs in.
fn killed_batch(effects: &str) -> Vec<Job> {
    (1..=3)
        .map(|i| Job {
            key: format!("order-{i}"),
            id: i,
            amount: i,
            effects: effects.to_owned(),
        })
        .collect()
}

/// A worker process SIGKILLed in a batch's body after its sends keeps nothing; the
/// redelivery applies the batch and sends each message once.
pub(crate) async fn worker_killed_in_a_batch_with_an_outbox_keeps_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("outboxbatchkill", 2).await;
    let mut w = Worker::spawn(
        "batch_outbox_hang",
        &[
            (worker::CHILD_MODE, "batch_outbox_hang".to_owned()),
            (worker::CHILD_URL, ctx.url.clone()),
            (worker::CHILD_MARKERS, ctx.store.table().to_owned()),
            (worker::CHILD_EFFECTS, ctx.effects.clone()),
        ],
    );
    w.expect_line("IN_BODY").await;
    assert_eq!(w.kill().await.code(), None, "killed by the signal");
    let count = format!("SELECT COUNT(*) FROM {}", outbox_table(&ctx));
    assert_eq!(ctx.scalar(&count).await, 0);
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (0, 0));
    let jobs = killed_batch(&ctx.effects);
    let next = ship_batch(&ctx.store, &jobs, None, Then::Commit);
    let done = within(120, "the batch after a killed worker", next)
        .await
        .expect("the redelivery commits");
    assert_eq!(done.outcomes(), [A, A, A]);
    assert_eq!(ctx.scalar(&count).await, 6);
    assert_eq!(ctx.effects_total().await, 3);
    ctx.cleanup().await;
}

/// The worker process's side: the batch, hanging in its body after its sends.
pub(crate) async fn batch_outbox_child<S: Support>(url: &str, markers: &str, effects: &str) {
    let store = idem::Store::new(S::connect(url, 1).await)
        .with_table(markers)
        .expect("table name");
    let r = ship_batch(&store, &killed_batch(effects), None, Then::Hang).await;
    panic!("the handler returned {r:?}; it should have hung in its body");
}
