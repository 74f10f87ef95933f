//! PostgreSQL only: a relay waiting between rounds wakes at the commit of a new message
//! (`LISTEN`/`NOTIFY`), instead of sleeping out its poll.

use std::time::Duration;

use idem::outbox::{Publisher, Relay};

use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::{until, within};
use crate::conformance::{Server, TestDb};

use super::outbox::{outbox_table, publisher, received_table, ship};

/// A relay's `run` in a task of its own, until [`Running::stop`].
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), idem::Error>>,
}

impl Running {
    fn start<DB: TestDb, P: Publisher + 'static>(relay: Relay<DB, P>, poll: Duration) -> Running {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stopped.await;
            };
            relay.run(poll, stopped).await
        });
        Running { stop, task }
    }

    /// Stops the relay and checks that it ran without error.
    async fn stop(self) {
        self.stop.send(()).expect("the relay is running");
        within(60, "the relay stopping", self.task)
            .await
            .expect("the relay's task")
            .expect("the relay ran without error");
    }
}

/// The relay's poll is an hour, so only the commit's notification can end its wait within
/// the test's bound. The message is committed once the relay has listened and finished its
/// first round (both seen in `pg_stat_activity` from a session of the test's own), so no
/// round that was already running can have taken it.
pub(crate) async fn waiting_relay_wakes_at_the_commit_of_a_message<S: Server>() {
    let mut ctx = Ctx::<S>::new("wake", 3).await;
    let received = received_table(&mut ctx).await;
    let outbox = outbox_table(&ctx);
    let relay = Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0));
    let running = Running::start(relay, Duration::from_secs(3600));

    // The relay's sessions are watched from another pool: a query of the store's own pool
    // could run on the relay's connection and overwrite what it last ran.
    let watch = Ctx::<S>::new("wakewatch", 1).await;
    let waiting = format!(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE state = 'idle' \
         AND (query = 'LISTEN \"{outbox}\"' \
         OR query LIKE '%FROM {outbox} o WHERE o.sent_at IS NULL%SKIP LOCKED%')"
    );
    until(60, "the relay listening, its first round done", || async {
        watch.scalar(&waiting).await == 2
    })
    .await;

    let job = ctx.job("order-1", 1, 10);
    applied(ship(&ctx.store, &job, 1, Then::Commit).await);
    let sent = format!("SELECT COUNT(*) FROM {received}");
    until(
        60,
        "the message, published at the commit's notification",
        || async { ctx.scalar(&sent).await == 1 },
    )
    .await;

    running.stop().await;
    watch.cleanup().await;
    ctx.cleanup().await;
}

/// A relay told not to listen (behind a transaction-mode pooler) opens no `LISTEN` session
/// and still publishes a message committed while it waits, at its next poll.
pub(crate) async fn relay_that_does_not_listen_polls<S: Server>() {
    let mut ctx = Ctx::<S>::new("poll", 3).await;
    let received = received_table(&mut ctx).await;
    let outbox = outbox_table(&ctx);
    let relay = Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0)).listen(false);
    let running = Running::start(relay, Duration::from_millis(50));

    let watch = Ctx::<S>::new("pollwatch", 1).await;
    let rounds = format!(
        "SELECT COUNT(*) FROM pg_stat_activity \
         WHERE query LIKE '%FROM {outbox} o WHERE o.sent_at IS NULL%SKIP LOCKED%'"
    );
    until(60, "the relay's first round", || async {
        watch.scalar(&rounds).await >= 1
    })
    .await;
    let job = ctx.job("order-1", 1, 10);
    applied(ship(&ctx.store, &job, 1, Then::Commit).await);
    let sent = format!("SELECT COUNT(*) FROM {received}");
    until(60, "the message, published at a poll", || async {
        ctx.scalar(&sent).await == 1
    })
    .await;
    let listening =
        format!("SELECT COUNT(*) FROM pg_stat_activity WHERE query = 'LISTEN \"{outbox}\"'");
    assert_eq!(watch.scalar(&listening).await, 0, "no LISTEN session");

    running.stop().await;
    watch.cleanup().await;
    ctx.cleanup().await;
}
