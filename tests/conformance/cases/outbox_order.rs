//! The relay's order per ordering key: one key's messages reach the broker in the order they
//! were written, one at a time; a failing message holds back only its own key; two relays on
//! one outbox never publish one key at the same time; and `migrate` gives an outbox made by
//! schema version 2 its ordering keys.
//!
//! The broker is a table of the same database, written by a `Publisher` of the test's own,
//! which numbers what it receives in the order it receives it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::outbox::{Message, PublishError, Publisher, Relay};
use idem::{Claimed, Key, Outbox, Outcome, Store};
use sqlx::{Pool, Transaction};

use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::util::{backend, unique_name, within};
use crate::conformance::{Support, TestDb};

use super::outbox::outbox_table;
use super::upgrade::version_2;

const SCOPE: &str = "orders.keyed";

/// The effect, and one message per entry of `keys`: under that ordering key, or the job's
/// when it is empty. Each message is the job's id and its position.
#[idem::idempotent(key = "job.key", scope = "orders.keyed")]
async fn ship_keyed<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    outbox: &mut Outbox,
    keys: &[String],
) -> Result<i64, TestError> {
    insert_effect(tx, job, "ship").await?;
    for (n, key) in keys.iter().enumerate() {
        match key.as_str() {
            "" => outbox.send("shipping", &(job.id, n))?,
            key => outbox.send_keyed(key, "shipping", &(job.id, n))?,
        };
    }
    Ok(job.amount)
}

fn id_of(key: &str, n: usize) -> String {
    let n = u32::try_from(n).expect("a small position");
    idem::job_id(SCOPE, &(key, n))
        .expect("a valid id")
        .into_string()
}

/// What every relay's publisher shares: the broker's numbering, the keys being published
/// right now, and what was seen of them.
#[derive(Default)]
struct Broker {
    next: AtomicI64,
    publishing: Mutex<HashSet<String>>,
    /// Publishes that began while another of the same key was under way.
    same_key_at_once: AtomicUsize,
    /// Publishes under way now, and the most there were at once (of any keys).
    under_way: AtomicUsize,
    most_at_once: AtomicUsize,
    /// Publishes the broker kept, and a signal at each.
    kept: AtomicUsize,
    kept_one: tokio::sync::Notify,
    /// Set by [`Broker::meeting`]: the first publish waits until a second one is under way, so
    /// that the overlap a test asserts is made rather than left to the scheduler.
    meet: bool,
    met: AtomicBool,
    second: tokio::sync::Notify,
}

impl Broker {
    /// A broker that holds the first publish until a second begins (at most a minute: a
    /// second publish that never comes leaves `most_at_once` at 1, and the test says so).
    fn meeting() -> Self {
        Broker {
            meet: true,
            ..Broker::default()
        }
    }

    /// Where a publish that is under way with `now - 1` others meets the next one.
    async fn meet(&self, now: usize) {
        if !self.meet {
            return;
        }
        if now >= 2 {
            self.met.store(true, Ordering::SeqCst);
            self.second.notify_waiters();
            return;
        }
        let second = self.second.notified();
        let mut second = std::pin::pin!(second);
        second.as_mut().enable();
        if !self.met.load(Ordering::SeqCst) {
            drop(tokio::time::timeout(Duration::from_secs(60), second).await);
        }
    }

    /// Resolves once the broker kept `n` publishes.
    async fn kept(&self, n: usize) {
        loop {
            let next = self.kept_one.notified();
            let mut next = std::pin::pin!(next);
            next.as_mut().enable();
            if self.kept.load(Ordering::SeqCst) >= n {
                return;
            }
            next.await;
        }
    }
}

/// Publishes into `received (n, okey, id, relay)`, `n` numbering the messages in the order
/// their publishing began; refuses the ids in `refuse` as many times as they say.
struct Numbering<DB: TestDb> {
    pool: Pool<DB>,
    table: String,
    relay: &'static str,
    broker: Arc<Broker>,
    refuse: Mutex<HashMap<String, usize>>,
}

/// Ends a publish's entry in the broker's bookkeeping, however the publish ends.
struct UnderWay<'a> {
    broker: &'a Broker,
    key: String,
    first: bool,
}

impl Drop for UnderWay<'_> {
    fn drop(&mut self) {
        self.broker.under_way.fetch_sub(1, Ordering::SeqCst);
        if self.first {
            self.broker.publishing.lock().unwrap().remove(&self.key);
        }
    }
}

impl<DB: TestDb> Publisher for Numbering<DB> {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        let broker = &*self.broker;
        let key = message.ordering_key.clone();
        let first = broker.publishing.lock().unwrap().insert(key.clone());
        if !first {
            broker.same_key_at_once.fetch_add(1, Ordering::SeqCst);
        }
        let now = broker.under_way.fetch_add(1, Ordering::SeqCst) + 1;
        broker.most_at_once.fetch_max(now, Ordering::SeqCst);
        let _under_way = UnderWay { broker, key, first };
        broker.meet(now).await;
        let refused = self
            .refuse
            .lock()
            .unwrap()
            .get_mut(&message.id)
            .is_some_and(|left| {
                let refuse = *left > 0;
                *left = left.saturating_sub(1);
                refuse
            });
        if refused {
            return Err("the broker refuses it (on purpose)".into());
        }
        let n = broker.next.fetch_add(1, Ordering::SeqCst);
        let mut conn = self.pool.acquire().await?;
        let sql = format!(
            "INSERT INTO {} (n, okey, id, relay) VALUES ($1, $2, $3, $4)",
            self.table
        );
        let binds = [
            Bind::I64(n),
            Bind::Str(message.ordering_key.clone()),
            Bind::Str(message.id.clone()),
            Bind::Str(self.relay.to_owned()),
        ];
        DB::execute(&mut conn, &sql, &binds).await?;
        broker.kept.fetch_add(1, Ordering::SeqCst);
        broker.kept_one.notify_waiters();
        Ok(())
    }
}

async fn received_table<S: Support>(ctx: &mut Ctx<S>) -> String {
    ctx.create_table(
        "r",
        "(n BIGINT NOT NULL, okey VARCHAR(255) NOT NULL, id VARCHAR(255) NOT NULL, \
         relay VARCHAR(16) NOT NULL)",
    )
    .await
}

fn numbering<S: Support>(
    ctx: &Ctx<S>,
    table: &str,
    relay: &'static str,
    broker: &Arc<Broker>,
    refuse: &[(&str, usize)],
) -> Numbering<S::Db> {
    Numbering {
        pool: ctx.pool.clone(),
        table: table.to_owned(),
        relay,
        broker: broker.clone(),
        refuse: Mutex::new(
            refuse
                .iter()
                .map(|(id, n)| ((*id).to_owned(), *n))
                .collect(),
        ),
    }
}

/// The ids the broker received under `key`, in the order it received them.
async fn received_of<S: Support>(ctx: &Ctx<S>, table: &str, key: &str) -> Vec<String> {
    let sql = format!("SELECT id FROM {table} WHERE okey = '{key}' ORDER BY n");
    let mut conn = ctx.pool.acquire().await.expect("a connection");
    S::Db::fetch_strings(&mut conn, &sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// What the broker received: every message, and each once.
async fn received_counts<S: Support>(ctx: &Ctx<S>, table: &str) -> (i64, i64) {
    let all = ctx.scalar(&format!("SELECT COUNT(*) FROM {table}")).await;
    let distinct = format!("SELECT COUNT(DISTINCT id) FROM {table}");
    (all, ctx.scalar(&distinct).await)
}

/// Jobs writing `keys` each, one after the other; returns the ids of every ordering key, in
/// the order they were written.
async fn write_jobs<S: Support>(
    ctx: &Ctx<S>,
    store: &Store<S::Db>,
    jobs: impl IntoIterator<Item = (i64, Vec<String>)>,
    written: &mut HashMap<String, Vec<String>>,
) {
    for (id, keys) in jobs {
        let job = ctx.job(&format!("order-{id}"), id, 1);
        applied(ship_keyed(store, &job, &keys).await);
        for (n, key) in keys.iter().enumerate() {
            let key = if key.is_empty() { &job.key } else { key };
            let ids = written.entry(key.clone()).or_default();
            ids.push(id_of(&job.key, n));
        }
    }
}

/// 30 jobs write 90 messages under 5 keys of their own and 30 of their jobs, interleaved;
/// a relay taking 50 at a time (every key's first, and some keys' second), whose broker
/// refuses one message in four once, publishes each key's messages in exactly the order they
/// were written, each once.
pub(crate) async fn relay_keeps_each_keys_order_across_interleaved_jobs<S: Support>() {
    let mut ctx = Ctx::<S>::new("relayorder", 3).await;
    let received = received_table(&mut ctx).await;
    let customer = |k: i64| format!("customer-{}", k % 5);
    let jobs = (1..=30).map(|id| {
        let keys = vec![customer(id), String::new(), customer(id * 3 + 1)];
        (id, keys)
    });
    let mut written = HashMap::new();
    write_jobs(&ctx, &ctx.store, jobs, &mut written).await;
    let mut every: Vec<&String> = written.values().flatten().collect();
    every.sort();
    let refuse: Vec<(&str, usize)> = every.iter().step_by(4).map(|id| (id.as_str(), 1)).collect();
    let broker = Arc::new(Broker::default());
    let relay = Relay::new(
        ctx.store.clone(),
        numbering(&ctx, &received, "one", &broker, &refuse),
    )
    .batch(50)
    .backoff(Duration::ZERO)
    .max_attempts(100);
    let (mut sent, mut failed, mut waiting) = (0, 0, 0);
    for _ in 0..100 {
        let round = relay.relay_once().await.expect("a round");
        (sent, failed, waiting) = (
            sent + round.sent,
            failed + round.failed,
            waiting + round.waiting,
        );
        if sent == 90 {
            break;
        }
    }
    assert_eq!((sent, failed), (90, refuse.len()), "waiting: {waiting}");
    assert!(
        waiting > 0,
        "a refused message held its key's later ones back"
    );
    assert_eq!(received_counts(&ctx, &received).await, (90, 90));
    assert_eq!(written.len(), 35);
    for (key, ids) in &written {
        assert_eq!(&received_of(&ctx, &received, key).await, ids, "key {key}");
    }
    ctx.cleanup().await;
}

/// Key A's first message is refused twice and parked; key B's messages go on meanwhile,
/// those written before and after; A's later messages wait until an operator requeues A's
/// first, and then all of A's leave in their order.
pub(crate) async fn failing_message_holds_back_only_its_own_key<S: Support>() {
    let mut ctx = Ctx::<S>::new("relayhold", 3).await;
    let received = received_table(&mut ctx).await;
    let (a, b) = ("key-a".to_owned(), "key-b".to_owned());
    let mut written = HashMap::new();
    let jobs = (1..=6).map(|id| {
        let key = if id % 2 == 1 { &a } else { &b };
        (id, vec![key.clone()])
    });
    write_jobs(&ctx, &ctx.store, jobs, &mut written).await;
    let a_first = written[&a][0].clone();
    let broker = Arc::new(Broker::default());
    let relay = Relay::new(
        ctx.store.clone(),
        numbering(&ctx, &received, "one", &broker, &[(&a_first, 2)]),
    )
    .backoff(Duration::ZERO)
    .max_attempts(2);

    let round = relay.relay_once().await.expect("a round");
    assert_eq!(
        (round.sent, round.failed, round.waiting, round.left),
        (3, 1, 2, 0),
        "{round:?}"
    );
    assert_eq!(received_of(&ctx, &received, &b).await, written[&b]);
    assert!(received_of(&ctx, &received, &a).await.is_empty());

    // B goes on while A's first is refused again, and parked.
    write_jobs(&ctx, &ctx.store, [(7, vec![b.clone()])], &mut written).await;
    let round = relay.relay_once().await.expect("a round");
    assert_eq!(
        (round.sent, round.parked, round.waiting),
        (1, 1, 2),
        "{round:?}"
    );
    // A parked message holds its key back; B still goes on.
    write_jobs(&ctx, &ctx.store, [(8, vec![b.clone()])], &mut written).await;
    let round = relay.relay_once().await.expect("a round");
    assert_eq!((round.sent, round.failed, round.parked), (1, 0, 0));
    assert!(received_of(&ctx, &received, &a).await.is_empty());
    let outbox = outbox_table(&ctx);
    let unsent_a =
        format!("SELECT COUNT(*) FROM {outbox} WHERE ordering_key = '{a}' AND sent_at IS NULL");
    assert_eq!(ctx.scalar(&unsent_a).await, 3);

    assert!(ctx.store.requeue_outbox(&a_first).await.expect("requeue"));
    let round = relay.relay_once().await.expect("a round");
    assert_eq!((round.sent, round.failed, round.waiting), (3, 0, 0));
    assert_eq!(received_of(&ctx, &received, &a).await, written[&a]);
    assert_eq!(received_of(&ctx, &received, &b).await, written[&b]);
    assert_eq!(received_counts(&ctx, &received).await, (8, 8));
    assert_eq!(ctx.scalar(&unsent_a).await, 0);
    ctx.cleanup().await;
}

/// 24 jobs of two messages each over 8 ordering keys, 6 messages a key, interleaved; the ids
/// of every key in the order they were written.
async fn eight_keys_of_six<S: Support>(ctx: &Ctx<S>) -> HashMap<String, Vec<String>> {
    let mut written = HashMap::new();
    let jobs = (1..=24).map(|id| {
        let keys = vec![format!("k{}", id % 8), format!("k{}", (id + 3) % 8)];
        (id, keys)
    });
    write_jobs(ctx, &ctx.store, jobs, &mut written).await;
    written
}

/// Two relays at once, round after round, over 8 keys of 6 messages each: both take rounds
/// and publish side by side (the broker sees publishes of both under way at once), yet no
/// key is ever published by both at the same time, and each key's messages arrive in order,
/// each once.
pub(crate) async fn two_relays_never_publish_one_key_at_once<S: Support>() {
    let mut ctx = Ctx::<S>::new("relaykeys", 8).await;
    let received = received_table(&mut ctx).await;
    let written = eight_keys_of_six(&ctx).await;
    let broker = Arc::new(Broker::meeting());
    let relay = |name| {
        Relay::new(
            ctx.store.clone(),
            numbering(&ctx, &received, name, &broker, &[]),
        )
        .batch(5)
    };
    let (one, two) = (relay("one"), relay("two"));
    let mut sent = 0;
    for _ in 0..100 {
        let (x, y) = tokio::join!(one.relay_once(), two.relay_once());
        sent += x.expect("a round").sent + y.expect("a round").sent;
        if sent == 48 {
            break;
        }
    }
    assert_eq!(sent, 48);
    assert_eq!(received_counts(&ctx, &received).await, (48, 48));
    for relay in ["one", "two"] {
        let sql = format!("SELECT COUNT(*) FROM {received} WHERE relay = '{relay}'");
        assert!(
            ctx.scalar(&sql).await > 0,
            "relay {relay} published nothing"
        );
    }
    assert!(
        broker.most_at_once.load(Ordering::SeqCst) >= 2,
        "the two relays never published at the same time"
    );
    assert_eq!(broker.same_key_at_once.load(Ordering::SeqCst), 0);
    for (key, ids) in &written {
        assert_eq!(&received_of(&ctx, &received, key).await, ids, "key {key}");
    }
    ctx.cleanup().await;
}

/// One relay's `run` over a backlog of 8 keys of 6 messages each, four rounds in flight (the
/// default): its rounds publish side by side (the broker sees publishes of both under way at
/// once), yet no key is ever published by two rounds at the same time, and each key's
/// messages arrive in order, each once.
pub(crate) async fn rounds_in_flight_never_publish_one_key_at_once<S: Support>() {
    let mut ctx = Ctx::<S>::new("relayrounds", 8).await;
    let received = received_table(&mut ctx).await;
    let written = eight_keys_of_six(&ctx).await;
    let broker = Arc::new(Broker::meeting());
    let relay = Relay::new(
        ctx.store.clone(),
        numbering(&ctx, &received, "one", &broker, &[]),
    )
    .batch(5)
    .listen(false);
    // A poll of an hour: the backlog is there before `run` starts, so its rounds alone
    // publish it; the run stops once the broker kept all 48.
    let run = relay.run(Duration::from_secs(3600), broker.kept(48));
    within(120, "the relay's run over the backlog", run)
        .await
        .expect("the relay runs");
    assert_eq!(received_counts(&ctx, &received).await, (48, 48));
    assert!(
        broker.most_at_once.load(Ordering::SeqCst) >= 2,
        "the rounds never published at the same time"
    );
    assert_eq!(broker.same_key_at_once.load(Ordering::SeqCst), 0);
    for (key, ids) in &written {
        assert_eq!(&received_of(&ctx, &received, key).await, ids, "key {key}");
    }
    ctx.cleanup().await;
}

/// An outbox made by schema version 2, with an unsent message: `migrate` gives it the
/// `ordering_key` column (the old message has none, and is a key of its own), new messages
/// are written with theirs, and the relay publishes both.
pub(crate) async fn migrate_gives_an_old_outbox_its_ordering_keys<S: Support>() {
    let mut ctx = Ctx::<S>::new("relayold", 3).await;
    let received = received_table(&mut ctx).await;
    let old = unique_name("m", "relayold");
    version_2(&mut ctx, &old, "before-migrate").await;
    let payload = match backend::<S::Db>() {
        "postgres" => "'\\x7b7d'::bytea",
        _ => "X'7b7d'",
    };
    let at = S::TWO_HOURS_AGO;
    ctx.exec(&format!(
        "INSERT INTO {old}_outbox (id, destination, payload, scope, {key}, seq, created_at, \
         next_attempt_at) VALUES ('old-message', 'shipping', {payload}, 'apply', \
         'before-migrate', 0, {at}, {at})",
        key = if backend::<S::Db>() == "mysql" {
            "`key`"
        } else {
            "key"
        },
    ))
    .await;
    let store = Store::new(ctx.pool.clone())
        .with_table(&old)
        .expect("a generated table name");
    store.migrate().await.expect("migrate a version 2 schema");
    let without = format!("SELECT COUNT(*) FROM {old}_outbox WHERE ordering_key IS NULL");
    assert_eq!(ctx.scalar(&without).await, 1);

    let mut written = HashMap::new();
    write_jobs(
        &ctx,
        &store,
        [(1, vec!["customer-1".to_owned()])],
        &mut written,
    )
    .await;
    let with = format!("SELECT COUNT(*) FROM {old}_outbox WHERE ordering_key = 'customer-1'");
    assert_eq!(ctx.scalar(&with).await, 1);
    let broker = Arc::new(Broker::default());
    let relay = Relay::new(store, numbering(&ctx, &received, "one", &broker, &[]));
    assert_eq!(relay.relay_once().await.expect("a round").sent, 2);
    assert_eq!(received_counts(&ctx, &received).await, (2, 2));
    // The old message's ordering key, as the relay shows it to a publisher, is its job's.
    assert_eq!(
        received_of(&ctx, &received, "before-migrate").await,
        ["old-message"]
    );
    ctx.cleanup().await;
}

/// Across keys the relay's order is the order messages became visible: a job that began first
/// and committed last is published after one that began later and committed first, though one
/// round takes both (a job's messages are written at its end, with its commit). It needs two
/// writers at once: on SQLite writers take turns, so the order begun is the order committed.
pub(crate) async fn job_begun_first_and_committed_last_is_published_second<S: Support>() {
    let mut ctx = Ctx::<S>::new("relayvisible", 3).await;
    let received = received_table(&mut ctx).await;
    let fresh = |key: &'static str| {
        let store = ctx.store.clone();
        async move {
            match store.claim(SCOPE, &Key::new(key).expect("a key")).await {
                Ok(Claimed::Fresh(guard)) => guard,
                other => panic!("expected a fresh claim of {key}, got {other:?}"),
            }
        }
    };
    let mut first = fresh("began-first").await;
    first
        .outbox()
        .send("shipping", &"first")
        .expect("a message");
    let mut second = fresh("began-second").await;
    second
        .outbox()
        .send("shipping", &"second")
        .expect("a message");
    let done = second.finish::<(), idem::Error>(Ok(())).await;
    assert!(matches!(done, Ok(Outcome::Applied(()))), "{done:?}");
    let done = first.finish::<(), idem::Error>(Ok(())).await;
    assert!(matches!(done, Ok(Outcome::Applied(()))), "{done:?}");

    let broker = Arc::new(Broker::default());
    let relay = Relay::new(
        ctx.store.clone(),
        numbering(&ctx, &received, "one", &broker, &[]),
    )
    .batch(10);
    let round = relay.relay_once().await.expect("a round");
    assert_eq!((round.sent, round.failed), (2, 0), "one round takes both");
    let sql = format!("SELECT okey FROM {received} ORDER BY n");
    let mut conn = ctx.pool.acquire().await.expect("a connection");
    let order = S::Db::fetch_strings(&mut conn, &sql)
        .await
        .expect("the order");
    assert_eq!(order, ["began-second", "began-first"], "commit order");
    drop(conn);
    ctx.cleanup().await;
}
