//! The relay's hold, enforced: a relay whose broker stalls gives up its round well within its
//! hold and publishes nothing more from it, so that the relays that take the messages over
//! never publish one beside it; `forget` lets a re-run's messages out; a publisher's error
//! text is stored bounded.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem::Outbox;
use idem::outbox::{Message, PublishError, Publisher, Relay};
use sqlx::Transaction;
use tokio::sync::Notify;

use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::{until, within};
use crate::conformance::{Support, TestDb};

use super::outbox::{TablePublisher, outbox_table, publisher, received_table, ship};

/// A broker that stalls: the first publish waits until `release`, then publishes; every
/// other goes through at once. `stalled` says when the first one is waiting.
struct Stalling<DB: TestDb> {
    inner: TablePublisher<DB>,
    first: AtomicBool,
    stalled: Arc<Notify>,
    release: Arc<Notify>,
}

impl<DB: TestDb> Publisher for Stalling<DB> {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        if self.first.swap(false, Ordering::SeqCst) {
            self.stalled.notify_one();
            self.release.notified().await;
        }
        self.inner.publish(message).await
    }
}

/// Three relays on one outbox, one of them on a broker that stalls on its first message for
/// longer than the hold. The stalled relay gives its round up within the hold (nothing of it
/// is marked), the two others take the messages once the hold ran out and publish each once,
/// and releasing the stalled publish afterwards publishes nothing: every message is in the
/// broker exactly once.
pub(crate) async fn relays_beside_a_stalled_one_publish_each_message_once<S: Support>() {
    let mut ctx = Ctx::<S>::new("relaystall", 6).await;
    let received = received_table(&mut ctx).await;
    for id in 1..=4 {
        let job = ctx.job(&format!("order-{id}"), id, 1);
        applied(ship(&ctx.store, &job, 2, Then::Commit).await);
    }
    // The stalled round gives up at three quarters of the lease, the others take over at its
    // end: the quarter between is what a loaded machine may take to run the stalled relay's
    // timer, and is long.
    let lease = Duration::from_secs(3);
    let (stalled, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let stalling = Relay::new(
        ctx.store.clone(),
        Stalling {
            inner: publisher(&ctx, &received, 0),
            first: AtomicBool::new(true),
            stalled: stalled.clone(),
            release: release.clone(),
        },
    )
    .lease(lease);
    let others = [0, 1].map(|_| Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0)));

    let round = tokio::spawn(async move { stalling.relay_once().await });
    // The stalled relay holds every message: the others find none until its hold runs out.
    within(60, "the first publish stalling", stalled.notified()).await;
    let sent = std::sync::atomic::AtomicUsize::new(0);
    until(60, "the other relays publishing every message", || async {
        let (a, b) = tokio::join!(others[0].relay_once(), others[1].relay_once());
        let n = a.expect("a round").sent + b.expect("a round").sent;
        sent.fetch_add(n, Ordering::SeqCst) + n == 8
    })
    .await;
    // The broker answers again. The stalled relay gave its round up within its hold, before
    // the others could take a message: its publish was dropped with it, and publishes nothing.
    release.notify_one();
    let stalled_round = within(60, "the stalled round", round)
        .await
        .expect("the round's task")
        .expect("the stalled round ends without error");
    assert_eq!(
        (stalled_round.sent, stalled_round.left),
        (0, 8),
        "{stalled_round:?}"
    );
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {received}"))
            .await,
        8
    );
    let distinct = format!("SELECT COUNT(DISTINCT id) FROM {received}");
    assert_eq!(ctx.scalar(&distinct).await, 8);
    let unsent = format!(
        "SELECT COUNT(*) FROM {} WHERE sent_at IS NULL",
        outbox_table(&ctx)
    );
    assert_eq!(ctx.scalar(&unsent).await, 0);
    ctx.cleanup().await;
}

/// One message with the text it is given.
#[idem::idempotent(key = "job.key", scope = "orders.ship")]
async fn ship_text<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    outbox: &mut Outbox,
    text: &str,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "ship").await?;
    outbox.send("shipping", &text)?;
    Ok(job.amount)
}

/// A job whose message was parked (its broker refused it) is forgotten and run again with
/// another payload: the old message goes with the marker, and the re-run's message, which has
/// the same id, is written and published with the new payload.
pub(crate) async fn forget_lets_a_rerun_publish_its_new_message<S: Support>() {
    let mut ctx = Ctx::<S>::new("relayforget", 3).await;
    let received = received_table(&mut ctx).await;
    let job = ctx.job("order-5", 5, 10);
    applied(ship_text(&ctx.store, &job, "first").await);
    let refusing =
        Relay::new(ctx.store.clone(), publisher(&ctx, &received, usize::MAX)).max_attempts(1);
    let round = refusing.relay_once().await.expect("a round");
    assert_eq!((round.sent, round.parked), (0, 1));

    assert!(ctx.store.forget("orders.ship", "order-5").await.unwrap());
    let outbox = outbox_table(&ctx);
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {outbox}")).await,
        0,
        "the parked message goes with the marker"
    );
    applied(ship_text(&ctx.store, &job, "second").await);
    let relay = Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0));
    assert_eq!(relay.relay_once().await.expect("a round").sent, 1);
    let bodies = format!("SELECT COUNT(*) FROM {received} WHERE body = '\"second\"'");
    assert_eq!(ctx.scalar(&bodies).await, 1);
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {received}"))
            .await,
        1
    );
    ctx.cleanup().await;
}

/// Fails every publish with an error text of a megabyte.
struct Verbose;

impl Publisher for Verbose {
    async fn publish<'a>(&'a self, _: &'a Message) -> Result<(), PublishError> {
        Err("x".repeat(1 << 20).into())
    }
}

/// A publisher's error of a megabyte is stored cut to 2,000 bytes, on every backend (MySQL's
/// `TEXT` would refuse it whole).
pub(crate) async fn a_megabyte_of_error_text_is_stored_bounded<S: Support>() {
    let ctx = Ctx::<S>::new("relayverbose", 3).await;
    let job = ctx.job("order-6", 6, 10);
    applied(ship(&ctx.store, &job, 1, Then::Commit).await);
    let relay = Relay::new(ctx.store.clone(), Verbose);
    assert_eq!(relay.relay_once().await.expect("a round").failed, 1);
    let sql = format!(
        "SELECT COUNT(*) FROM {} WHERE LENGTH(last_error) BETWEEN 1000 AND 2000",
        outbox_table(&ctx)
    );
    assert_eq!(ctx.scalar(&sql).await, 1);
    ctx.cleanup().await;
}
