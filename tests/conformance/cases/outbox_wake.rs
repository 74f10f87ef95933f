//! A relay waiting between rounds wakes at the commit of a new message instead of sleeping
//! out its poll: at a commit through its own store, in the process, on every database; at a
//! commit through another store (another process), on PostgreSQL, at the store's
//! announcement (`NOTIFY`, sent after the commit, for several commits at once).

use std::time::Duration;

use idem::GroupOptions;
use idem::outbox::{Publisher, Relay};

use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::{backend, until, within};
use crate::conformance::{Server, Support, TestDb};

use super::group::futures_join;
use super::outbox::{notify, outbox_table, publisher, received_table, ship};
use super::outbox_batch::ship_batch;
use crate::conformance::group_handlers::apply_grouped_sending;

/// How long a test waits for a message its relay is woken for: far below the relay's poll
/// (an hour), so that only a wake publishes it in time.
const WOKEN_WITHIN: u64 = 30;

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

/// A relay of the store the jobs commit through (a clone of it) is woken in the process at
/// each commit of messages, in each mode, on every database. Its poll is an hour: only the
/// wake publishes a message within the test's bound. Each message is committed once the one
/// before it was received, by which time the relay is past the round that published it (a
/// first message, committed before the relay starts, is published by its first round), so
/// that a round already under way cannot be what finds it.
pub(crate) async fn relay_of_its_own_store_wakes_at_each_commit_of_messages<S: Support>() {
    let mut ctx = Ctx::<S>::new("wakeown", 6).await;
    let received = received_table(&mut ctx).await;
    let sent = format!("SELECT COUNT(*) FROM {received}");
    let published = async |ctx: &Ctx<S>, n: i64, what: &str| {
        until(WOKEN_WITHIN, what, || async {
            ctx.scalar(&sent).await == n
        })
        .await;
    };
    applied(ship(&ctx.store, &ctx.job("order-0", 100, 1), 1, Then::Commit).await);
    let relay = Relay::new(ctx.store.clone(), publisher(&ctx, &received, 0));
    let running = Running::start(relay, Duration::from_secs(3600));
    published(&ctx, 1, "the message committed before the relay started").await;

    applied(ship(&ctx.store, &ctx.job("order-1", 1, 10), 1, Then::Commit).await);
    published(&ctx, 2, "a transaction claim's message").await;
    applied(notify(&ctx.store, &ctx.job("order-2", 2, 20), 1, Then::Commit).await);
    published(&ctx, 3, "a lease's message").await;
    let batch = [ctx.job("order-3", 3, 30)];
    let _ = ship_batch(&ctx.store, &batch, None, Then::Commit)
        .await
        .expect("the batch commits");
    published(&ctx, 5, "a batch's two messages").await;
    let mut expected = 5;
    // Group commit wakes the relay where the commit reads the transaction's own mark of its
    // messages (PostgreSQL); on MySQL and SQLite its messages wait for the poll.
    if backend::<S::Db>() == "postgres" {
        let group = ctx.store.group(GroupOptions::new()).expect("valid options");
        let job = ctx.job("order-4", 4, 40);
        applied(apply_grouped_sending(&group, &job).await);
        expected += 1;
        published(&ctx, expected, "a group member's message").await;
    }
    // Many jobs committing at once: each is published, none waits for the poll.
    let jobs: Vec<_> = (10..30)
        .map(|i| ctx.job(&format!("order-{i}"), i, i))
        .collect();
    let done = futures_join(
        jobs.iter()
            .map(|job| ship(&ctx.store, job, 1, Then::Commit)),
    )
    .await;
    for outcome in done {
        applied(outcome);
    }
    expected += 20;
    published(&ctx, expected, "twenty concurrent jobs' messages").await;

    running.stop().await;
    ctx.cleanup().await;
}

/// A relay of another store (another pool, as another process has) is woken by the
/// announcement the committing store sends after its commits, on PostgreSQL. The relay has
/// listened and finished its first round before the commit (both seen in `pg_stat_activity`),
/// and its poll is an hour: only the announcement can end its wait in time. Then twenty jobs
/// commit at once, announced together or in a few announcements, and each is published.
pub(crate) async fn relay_of_another_store_wakes_at_its_announcement<S: Server>() {
    let mut ctx = Ctx::<S>::new("wakeother", 6).await;
    let received = received_table(&mut ctx).await;
    let outbox = outbox_table(&ctx);
    let other = S::connect(&ctx.url, 3).await;
    let store = idem::Store::new(other.clone())
        .with_table(ctx.store.table())
        .expect("the same table");
    let relay = Relay::new(store, publisher(&ctx, &received, 0));
    let running = Running::start(relay, Duration::from_secs(3600));

    let watch = Ctx::<S>::new("wakeotherwatch", 1).await;
    let waiting = format!(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE state = 'idle' \
         AND (query = 'LISTEN \"{outbox}\"' \
         OR query LIKE '%FROM {outbox} o WHERE o.sent_at IS NULL%SKIP LOCKED%')"
    );
    until(60, "the relay listening, its first round done", || async {
        watch.scalar(&waiting).await == 2
    })
    .await;

    applied(ship(&ctx.store, &ctx.job("order-1", 1, 10), 1, Then::Commit).await);
    let sent = format!("SELECT COUNT(*) FROM {received}");
    until(
        WOKEN_WITHIN,
        "the message, at the store's announcement",
        || async { ctx.scalar(&sent).await == 1 },
    )
    .await;
    let jobs: Vec<_> = (10..30)
        .map(|i| ctx.job(&format!("order-{i}"), i, i))
        .collect();
    let done = futures_join(
        jobs.iter()
            .map(|job| ship(&ctx.store, job, 1, Then::Commit)),
    )
    .await;
    for outcome in done {
        applied(outcome);
    }
    until(WOKEN_WITHIN, "twenty concurrent jobs' messages", || async {
        ctx.scalar(&sent).await == 21
    })
    .await;

    running.stop().await;
    other.close().await;
    watch.cleanup().await;
    ctx.cleanup().await;
}
