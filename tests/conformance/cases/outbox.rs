//! The transactional outbox: the messages a handler sends exist exactly when its effect does,
//! with ids derived from its scope and key, and the relay publishes each of them once per
//! lease, marks it sent after the publisher confirmed, retries and parks the ones that fail.
//!
//! The relay publishes here to a table of the same database (a `Publisher` of the test's own:
//! the trait is how idem meets brokers it does not ship); RabbitMQ's and JetStream's
//! publishers are tested against the real brokers in `examples/tests/outbox.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::Outbox;
use idem::outbox::{Message, PublishError, Publisher, Relay, Relayed};
use sqlx::{Pool, Transaction};

use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::{Support, TestDb};

/// The effect, and `messages` messages to `shipping`, each the job's id and its position.
#[idem::idempotent(key = "job.key", scope = "orders.ship")]
pub(super) async fn ship<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    outbox: &mut Outbox,
    messages: usize,
    then: Then,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "ship").await?;
    for n in 0..messages {
        outbox.send("shipping", &(job.id, n))?;
    }
    match then {
        Then::Commit => Ok(job.amount),
        _ => Err(TestError::Refused),
    }
}

/// Lease mode: `messages` messages to `notifications`, written as the lease completes.
#[idem::idempotent(key = "job.key", scope = "orders.notify", lease = "30s")]
pub(super) async fn notify(
    lease: &idem::Lease,
    job: &Job,
    outbox: &mut Outbox,
    messages: usize,
    then: Then,
) -> Result<i64, TestError> {
    for n in 0..messages {
        outbox.send("notifications", &(lease.idempotency_key(), n))?;
    }
    match then {
        Then::Commit => Ok(job.amount),
        _ => Err(TestError::Refused),
    }
}

/// Publishes into the table `received (id, destination, payload)`, one autocommit insert per
/// message; fails instead while `failures` is above zero.
pub(super) struct TablePublisher<DB: TestDb> {
    pool: Pool<DB>,
    table: String,
    failures: AtomicUsize,
}

impl<DB: TestDb> Publisher for TablePublisher<DB> {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        if self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err("the broker is down (on purpose)".into());
        }
        let mut conn = self.pool.acquire().await?;
        let sql = format!(
            "INSERT INTO {} (id, destination, body) VALUES ($1, $2, $3)",
            self.table
        );
        let body = String::from_utf8(message.payload.clone())?;
        let binds = [
            Bind::Str(message.id.clone()),
            Bind::Str(message.destination.clone()),
            Bind::Str(body),
        ];
        DB::execute(&mut conn, &sql, &binds).await?;
        Ok(())
    }
}

pub(super) async fn received_table<S: Support>(ctx: &mut Ctx<S>) -> String {
    ctx.create_table(
        "r",
        "(id VARCHAR(255) NOT NULL, destination VARCHAR(255) NOT NULL, body VARCHAR(255) NOT NULL)",
    )
    .await
}

pub(super) fn outbox_table<S: Support>(ctx: &Ctx<S>) -> String {
    format!("{}_outbox", ctx.store.table())
}

pub(super) fn publisher<S: Support>(
    ctx: &Ctx<S>,
    table: &str,
    failures: usize,
) -> TablePublisher<S::Db> {
    TablePublisher {
        pool: ctx.pool.clone(),
        table: table.to_owned(),
        failures: AtomicUsize::new(failures),
    }
}

fn id_of(key: &str, n: u32) -> String {
    idem::job_id("orders.ship", &(key, n))
        .expect("a valid id")
        .into_string()
}

/// A body that fails leaves no message; one that commits leaves exactly its messages, with
/// the ids its scope, key and positions give; a redelivery (a duplicate) adds none, and a body
/// run again after a rollback sends the same ids.
pub(crate) async fn outbox_messages_exist_exactly_when_the_effect_does<S: Support>() {
    let ctx = Ctx::<S>::new("outbox", 2).await;
    let job = ctx.job("order-7", 7, 70);
    let outbox = outbox_table(&ctx);
    let count = format!("SELECT COUNT(*) FROM {outbox}");
    match ship(&ctx.store, &job, 2, Then::Fail).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's error, got {other:?}"),
    }
    assert_eq!(ctx.scalar(&count).await, 0);
    assert_eq!(applied(ship(&ctx.store, &job, 2, Then::Commit).await), 70);
    duplicate(ship(&ctx.store, &job, 2, Then::Commit).await);
    assert_eq!(ctx.scalar(&count).await, 2);
    for n in 0..2 {
        let sql = format!(
            "SELECT COUNT(*) FROM {outbox} WHERE id = $1 AND seq = {n} AND sent_at IS NULL"
        );
        let found = ctx
            .scalar_with(&sql, &[Bind::Str(id_of(&job.key, n))])
            .await;
        assert_eq!(found, 1, "message {n}");
    }
    assert_eq!((ctx.markers().await, ctx.effects(7).await), (1, 1));
    ctx.cleanup().await;
}

/// The relay publishes every committed message once, in each job's order, marks it sent,
/// and finds nothing left the next round.
pub(crate) async fn relay_publishes_each_message_once_and_marks_it_sent<S: Support>() {
    let mut ctx = Ctx::<S>::new("relay", 3).await;
    let received = received_table(&mut ctx).await;
    for id in 1..=3 {
        let job = ctx.job(&format!("order-{id}"), id, 10);
        applied(ship(&ctx.store, &job, 2, Then::Commit).await);
    }
    let relay = Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0));
    let first = relay.relay_once().await.expect("a round");
    assert_eq!((first.sent, first.failed, first.parked), (6, 0, 0));
    let again = relay.relay_once().await.expect("a round");
    assert_eq!((again.sent, again.failed, again.parked), (0, 0, 0));
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {received}"))
            .await,
        6
    );
    for id in 1..=3 {
        for n in 0..2 {
            let sql = format!("SELECT COUNT(*) FROM {received} WHERE id = $1 AND body = $2");
            let binds = [
                Bind::Str(id_of(&format!("order-{id}"), n)),
                Bind::Str(format!("[{id},{n}]")),
            ];
            assert_eq!(ctx.scalar_with(&sql, &binds).await, 1, "order-{id} #{n}");
        }
    }
    let unsent = format!(
        "SELECT COUNT(*) FROM {} WHERE sent_at IS NULL",
        outbox_table(&ctx)
    );
    assert_eq!(ctx.scalar(&unsent).await, 0);
    // Sent rows go with the purge, once older than the retention.
    assert_eq!(
        ctx.store
            .purge_outbox(Duration::from_secs(3600))
            .await
            .unwrap(),
        0
    );
    assert_eq!(ctx.store.purge_outbox(Duration::ZERO).await.unwrap(), 6);
    ctx.cleanup().await;
}

/// A publisher that fails: the message is tried again after its backoff, then parked after
/// `max_attempts`, and never published; its row says why.
pub(crate) async fn relay_retries_a_failing_message_then_parks_it<S: Support>() {
    let mut ctx = Ctx::<S>::new("relayfail", 3).await;
    let received = received_table(&mut ctx).await;
    let job = ctx.job("order-9", 9, 10);
    applied(ship(&ctx.store, &job, 1, Then::Commit).await);
    let relay = Relay::new(ctx.store.clone(), publisher(&ctx, &received, usize::MAX))
        .backoff(Duration::ZERO)
        .max_attempts(2);
    let round = |r: Relayed| (r.sent, r.failed, r.parked);
    assert_eq!(round(relay.relay_once().await.unwrap()), (0, 1, 0));
    assert_eq!(round(relay.relay_once().await.unwrap()), (0, 0, 1));
    assert_eq!(round(relay.relay_once().await.unwrap()), (0, 0, 0));
    let sql = format!(
        "SELECT COUNT(*) FROM {} WHERE parked = TRUE AND attempts = 2 AND sent_at IS NULL \
         AND last_error = 'the broker is down (on purpose)'",
        outbox_table(&ctx)
    );
    assert_eq!(ctx.scalar(&sql).await, 1);
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {received}"))
            .await,
        0
    );
    ctx.cleanup().await;
}

/// Two relays at once over 40 messages: each message is published once (the take skips the
/// rows another relay holds), and all of them are.
pub(crate) async fn two_relays_publish_each_message_once<S: Support>() {
    let mut ctx = Ctx::<S>::new("relaytwo", 6).await;
    let received = received_table(&mut ctx).await;
    for id in 1..=20 {
        let job = ctx.job(&format!("order-{id}"), id, 1);
        applied(ship(&ctx.store, &job, 2, Then::Commit).await);
    }
    let relay = |batch| Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0)).batch(batch);
    let (a, b) = (relay(7), relay(7));
    let mut sent = 0;
    for _ in 0..10 {
        let (x, y) = tokio::join!(a.relay_once(), b.relay_once());
        sent += x.unwrap().sent + y.unwrap().sent;
    }
    assert_eq!(sent, 40);
    let distinct = format!("SELECT COUNT(DISTINCT id) FROM {received}");
    assert_eq!(ctx.scalar(&distinct).await, 40);
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {received}"))
            .await,
        40
    );
    ctx.cleanup().await;
}

/// A message the outbox refuses (an empty destination) fails the body before anything is
/// written.
#[idem::idempotent(key = "job.key", scope = "orders.ship")]
async fn ship_nowhere<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    outbox: &mut Outbox,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "ship").await?;
    outbox.send("", &job.id)?;
    Ok(job.amount)
}

pub(crate) async fn outbox_refuses_a_bad_message_and_nothing_is_kept<S: Support>() {
    let ctx = Ctx::<S>::new("outboxbad", 2).await;
    let job = ctx.job("order-1", 1, 1);
    match ship_nowhere(&ctx.store, &job).await {
        Err(TestError::Idem(idem::Error::Refused(idem::Refusal::Message { reason }))) => {
            assert!(reason.contains("destination is empty"), "{reason}");
        }
        other => panic!("expected Refusal::Message, got {other:?}"),
    }
    let outbox = outbox_table(&ctx);
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {outbox}")).await,
        0
    );
    assert_eq!((ctx.markers().await, ctx.effects(1).await), (0, 0));
    ctx.cleanup().await;
}

/// `migrate()` upgrades a version 1 schema (the marker table alone) with the outbox table,
/// and leaves its markers as they were.
pub(crate) async fn migrate_adds_the_outbox_to_a_version_1_schema<S: Support>() {
    let ctx = Ctx::<S>::new("outboxmigrate", 2).await;
    let job = ctx.job("order-1", 1, 1);
    applied(apply(&ctx.store, &job, Then::Commit).await);
    let outbox = outbox_table(&ctx);
    ctx.exec(&format!("DROP TABLE {outbox}")).await;
    ctx.store
        .migrate()
        .await
        .expect("migrate a version 1 schema");
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {outbox}")).await,
        0
    );
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    let shipped = ctx.job("order-2", 2, 1);
    applied(ship(&ctx.store, &shipped, 1, Then::Commit).await);
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {outbox}")).await,
        1
    );
    ctx.cleanup().await;
}

/// A joined call's messages are the caller's transaction's: kept if it commits, gone if it
/// rolls back.
pub(crate) async fn outbox_of_a_joined_call_goes_with_the_callers_transaction<S: Support>() {
    let ctx = Ctx::<S>::new("outboxjoin", 2).await;
    let job = ctx.job("order-3", 3, 30);
    let count = format!("SELECT COUNT(*) FROM {}", outbox_table(&ctx));
    let mut tx = ctx.pool.begin().await.expect("begin");
    applied(ship(ctx.store.join(&mut tx), &job, 3, Then::Commit).await);
    tx.rollback().await.expect("the caller rolls back");
    assert_eq!(ctx.scalar(&count).await, 0);
    let mut tx = ctx.pool.begin().await.expect("begin");
    applied(ship(ctx.store.join(&mut tx), &job, 3, Then::Commit).await);
    idem::commit(tx).await.expect("the caller commits");
    assert_eq!(ctx.scalar(&count).await, 3);
    ctx.cleanup().await;
}

/// A lease-mode body's messages are written with the completion of its lease, in one
/// transaction: none for a body that failed (its lease is let go), exactly its own for the
/// one that completes, none more for a duplicate.
pub(crate) async fn outbox_of_a_lease_is_written_as_it_completes<S: Support>() {
    let ctx = Ctx::<S>::new("outboxlease", 2).await;
    let job = ctx.job("order-5", 5, 50);
    let outbox = outbox_table(&ctx);
    let count = format!("SELECT COUNT(*) FROM {outbox}");
    match notify(&ctx.store, &job, 2, Then::Fail).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's error, got {other:?}"),
    }
    assert_eq!(
        ctx.scalar(&count).await,
        0,
        "a failed lease body sent nothing"
    );
    assert_eq!(applied(notify(&ctx.store, &job, 2, Then::Commit).await), 50);
    duplicate(notify(&ctx.store, &job, 2, Then::Commit).await);
    assert_eq!(ctx.scalar(&count).await, 2);
    let sql = format!("SELECT COUNT(*) FROM {outbox} WHERE id = $1 AND sent_at IS NULL");
    for n in 0..2u32 {
        let id = idem::job_id("orders.notify", &(job.key.as_str(), n)).expect("a valid id");
        let found = ctx.scalar_with(&sql, &[Bind::Str(id.into_string())]).await;
        assert_eq!(found, 1, "message {n}");
    }
    let marker = ctx.marker(&job.key).await;
    assert!(marker.completed && marker.attempts == 2, "{marker:?}");
    ctx.cleanup().await;
}
