//! The relay fed by the write-ahead log, on a PostgreSQL of the test's own with `wal_level =
//! logical` (started once for every case here) and the shared RabbitMQ: the relay, a process of
//! its own (`idem-wal-relay`), SIGKILLed mid-stream and started again delivers every message
//! (copies only with their id, each applied once by a consumer's claim, each key's in order);
//! a standby relay takes over from a killed one; a rolled-back job's messages never leave; a
//! message the broker refuses parks with its key's later ones, and a requeue sends them in
//! order; a server or role not set up is refused before anything is published.

#[path = "wal_relay/kit.rs"]
mod kit;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use idem::outbox::{RabbitMq, WalRelay};
use idem::{Claimed, Outcome, Store};
use idem_scale::jobs::unique;
use idem_scale::standby::Server;
use kit::{
    KEYS, channel, consume_once, declare, delete, drain, first_arrivals_in_commit_order, kill,
    relay_process, send_jobs, set_up, slot_pid, store, wait_for,
};
use lapin::options::QueueDeleteOptions;
use sqlx::{AssertSqlSafe, PgPool};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_wal_relay_on_a_server_of_its_own() {
    let server =
        Server::start("wal_level = logical\nmax_replication_slots = 10\nmax_wal_senders = 10\n");
    let url = server.url();
    let pool = PgPool::connect(&url).await.expect("the server");
    a_job_sent_with_no_slot_fails_and_writes_nothing(&pool).await;
    a_killed_relay_loses_nothing_and_its_copies_keep_their_ids(&url, &pool).await;
    a_standby_relay_takes_over_from_a_killed_one(&url, &pool).await;
    a_relay_restarted_after_the_server_crashed_sends_everything(&server, &url, &pool).await;
    every_mode_sends_through_the_wal_only_what_it_kept(&url, &pool).await;
    a_rolled_back_job_sends_nothing_and_a_refused_message_parks_with_its_key(&url, &pool).await;
    a_server_or_role_not_set_up_is_refused_before_anything_is_published(&url, &pool).await;
}

async fn a_job_sent_with_no_slot_fails_and_writes_nothing(pool: &PgPool) {
    let store = store(pool, "wal_no_slot").await;
    let key = idem::Key::new("early").expect("a key");
    let Ok(Claimed::Fresh(mut guard)) = store.claim("wal", &key).await else {
        panic!("a fresh claim");
    };
    guard.outbox().send("q", &1).expect("a message");
    let done = guard.finish::<(), idem::Error>(Ok(())).await;
    assert!(
        matches!(done, Err(idem::Error::Wal(idem::WalError::NoSlot))),
        "{done:?}"
    );
    let markers: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {}",
        store.table()
    )))
    .fetch_one(pool)
    .await
    .expect("markers");
    assert_eq!(
        markers, 0,
        "the job's marker was not kept: its redelivery runs it"
    );
}

async fn a_killed_relay_loses_nothing_and_its_copies_keep_their_ids(url: &str, pool: &PgPool) {
    let store = store(pool, "wal_kill").await;
    let table = store.table().to_owned();
    let channel = channel().await;
    let queue = unique("wal_kill");
    declare(&channel, &queue).await;
    let (before, after) = (2000, 300);
    set_up(&store, url).await;
    send_jobs(&store, &queue, 0, before, KEYS).await;
    let mut relay = relay_process(url, &table);
    let at_kill = wait_for(&channel, &queue, 200, "the relay's first batches").await;
    kill(&mut relay);
    let published = declare(&channel, &queue).await;
    assert!(
        published < before,
        "the relay was killed mid-stream: {published} of {before} published"
    );
    // Jobs committed while no relay runs wait in the slot.
    send_jobs(&store, &queue, before, after, KEYS).await;
    let mut relay = relay_process(url, &table);
    let got = async {
        let mut got = drain(&channel, &queue).await;
        let mut distinct: HashSet<String> = got.iter().map(|m| m.0.clone()).collect();
        let deadline = Instant::now() + Duration::from_secs(120);
        while distinct.len() < (before + after) as usize {
            assert!(
                Instant::now() < deadline,
                "{} of {} arrived",
                distinct.len(),
                before + after
            );
            wait_for(&channel, &queue, 1, "the rest").await;
            let more = drain(&channel, &queue).await;
            distinct.extend(more.iter().map(|m| m.0.clone()));
            got.extend(more);
        }
        got
    }
    .await;
    kill(&mut relay);
    // One id a job, each the same in every copy of it.
    let mut ids: HashMap<u32, HashSet<&str>> = HashMap::new();
    for (id, _, n) in &got {
        ids.entry(*n).or_default().insert(id.as_str());
    }
    assert_eq!(
        ids.len(),
        (before + after) as usize,
        "every job's message arrived"
    );
    assert!(
        ids.values().all(|set| set.len() == 1),
        "a job's copies carry one id"
    );
    first_arrivals_in_commit_order(&got);
    // A consumer's claim applies each once.
    let effects = consume_once(pool, &got).await;
    assert_eq!(
        effects,
        i64::from(before + after),
        "effects applied by the consumer"
    );
    eprintln!(
        "killed at {at_kill}+ published, {} deliveries for {} messages",
        got.len(),
        before + after
    );
    delete(&channel, &queue).await;
}

async fn a_standby_relay_takes_over_from_a_killed_one(url: &str, pool: &PgPool) {
    let store = store(pool, "wal_standby").await;
    let table = store.table().to_owned();
    let channel = channel().await;
    let queue = unique("wal_standby");
    declare(&channel, &queue).await;
    set_up(&store, url).await;
    let mut active = relay_process(url, &table);
    let mut standby = relay_process(url, &table);
    send_jobs(&store, &queue, 0, 50, KEYS).await;
    wait_for(&channel, &queue, 50, "the active relay").await;
    let active_pid: i32 = slot_pid(pool, &table).await.expect("a relay streams");
    kill(&mut active);
    send_jobs(&store, &queue, 50, 50, KEYS).await;
    let got = wait_for(
        &channel,
        &queue,
        100,
        "the standby, after the active one died",
    )
    .await;
    let standby_pid = slot_pid(pool, &table).await.expect("a relay streams");
    assert_ne!(
        standby_pid, active_pid,
        "another walsender streams the slot"
    );
    kill(&mut standby);
    let got = drain(&channel, &queue).await.len().max(got as usize);
    assert!(got >= 100, "{got} of 100");
    delete(&channel, &queue).await;
}

/// The server crashes (stopped `immediate`) while the relay streams, and starts again: the
/// relay's run ends with a transient error, its supervisor runs it again, and every message
/// arrives, each key's first arrivals in commit order.
async fn a_relay_restarted_after_the_server_crashed_sends_everything(
    server: &Server,
    url: &str,
    pool: &PgPool,
) {
    let store = store(pool, "wal_restart").await;
    let channel = channel().await;
    let queue = unique("wal_restart");
    declare(&channel, &queue).await;
    set_up(&store, url).await;
    let total = 1500;
    send_jobs(&store, &queue, 0, total, KEYS).await;
    let relay = WalRelay::new(store.clone(), url, RabbitMq::new(channel.clone()))
        .expect("the relay")
        .batch(50);
    let (ended, errors) = (
        tokio::sync::Notify::new(),
        std::sync::Mutex::new(Vec::new()),
    );
    // What a supervisor does: runs it again after a transient error.
    let supervised = async {
        loop {
            match relay.run(ended.notified()).await {
                Ok(()) => return,
                Err(e) if e.is_transient() => {
                    errors.lock().unwrap().push(e.to_string());
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("the relay failed for good: {e}"),
            }
        }
    };
    let crash_and_collect = async {
        let at_crash = wait_for(&channel, &queue, 100, "the relay's first batches").await;
        tokio::task::block_in_place(|| server.restart());
        let mut got = Vec::new();
        let mut distinct = HashSet::new();
        while distinct.len() < total as usize {
            wait_for(&channel, &queue, 1, "the rest, after the restart").await;
            let more = drain(&channel, &queue).await;
            distinct.extend(more.iter().map(|m| m.0.clone()));
            got.extend(more);
        }
        ended.notify_one();
        (at_crash, got)
    };
    let ((), (at_crash, got)) = tokio::join!(supervised, crash_and_collect);
    assert!(
        at_crash < total,
        "the crash came mid-stream: {at_crash} of {total} sent"
    );
    assert!(
        !errors.lock().unwrap().is_empty(),
        "the relay saw the crash"
    );
    let arrived = first_arrivals_in_commit_order(&got);
    assert_eq!(arrived, total as usize, "every message arrived");
    delete(&channel, &queue).await;
}

/// A lease, a batch and claims joined to the caller's transaction send through the WAL as a
/// claim does: what they kept arrives, what they did not keep (a lease released, a joined
/// claim whose caller rolled back) never does.
async fn every_mode_sends_through_the_wal_only_what_it_kept(url: &str, pool: &PgPool) {
    use idem::LeaseOptions;
    let store = store(pool, "wal_modes").await;
    let channel = channel().await;
    let queue = unique("wal_modes");
    declare(&channel, &queue).await;
    set_up(&store, url).await;
    let key = |k: &str| idem::Key::new(k).expect("a key");
    let options = LeaseOptions::new(Duration::from_secs(30));
    // A lease kept, and one released.
    for (k, n, keep) in [("lease-kept", 1, true), ("lease-released", 101, false)] {
        let Ok(Claimed::Fresh(mut lease)) = store.lease("wal", &key(k), options).await else {
            panic!("a fresh lease");
        };
        lease.outbox().send(&queue, &n).expect("a message");
        if keep {
            let done = lease.finish::<(), idem::Error>(Ok(())).await;
            assert!(matches!(done, Ok(Outcome::Applied(()))), "{done:?}");
        } else {
            lease.release().await;
        }
    }
    // A batch of two jobs, each with a message.
    let keys = [key("batch-a"), key("batch-b")];
    let mut batch = store.claim_batch("wal", &keys).await.expect("a batch");
    for (k, n) in [(&keys[0], 2), (&keys[1], 3)] {
        batch.outbox().send(k, &queue, &n).expect("a message");
    }
    let done = batch.finish::<(), idem::Error>(Ok(())).await;
    assert!(done.is_ok(), "{done:?}");
    // Joined to the caller's transaction: committed, and rolled back.
    for (k, n, commit) in [("joined-kept", 4, true), ("joined-rolled-back", 104, false)] {
        let mut tx = pool.begin().await.expect("begin");
        let Ok(Claimed::Fresh(mut joined)) = store.join(&mut tx).claim("wal", &key(k)).await else {
            panic!("a fresh joined claim");
        };
        joined.outbox().send(&queue, &n).expect("a message");
        let done = joined.finish::<(), idem::Error>(Ok(())).await;
        assert!(matches!(done, Ok(Outcome::Applied(()))), "{done:?}");
        match commit {
            true => tx.commit().await.expect("commit"),
            false => tx.rollback().await.expect("rollback"),
        }
    }
    // A last job, after every one not kept: the stream is in commit order, so a message not
    // kept would arrive before this one.
    send_jobs(&store, &queue, 5, 1, KEYS).await;
    let relay =
        WalRelay::new(store.clone(), url, RabbitMq::new(channel.clone())).expect("the relay");
    let arrived = async {
        let mut got = Vec::new();
        while !got.contains(&5) {
            wait_for(&channel, &queue, 1, "the kept modes' messages").await;
            got.extend(drain(&channel, &queue).await.into_iter().map(|m| m.2));
        }
        got
    };
    let mut got = tokio::select! {
        ended = relay.run(std::future::pending()) => panic!("the relay ended: {ended:?}"),
        got = arrived => got,
    };
    got.sort_unstable();
    got.dedup();
    assert_eq!(got, [1, 2, 3, 4, 5], "what each mode kept, once each id");
    delete(&channel, &queue).await;
}

async fn a_rolled_back_job_sends_nothing_and_a_refused_message_parks_with_its_key(
    url: &str,
    pool: &PgPool,
) {
    let store = store(pool, "wal_park").await;
    let channel = channel().await;
    let (good, missing) = (unique("wal_good"), unique("wal_missing"));
    declare(&channel, &good).await;
    set_up(&store, url).await;
    // Rolled back: a failed body's messages are in the WAL, never decoded.
    let Ok(Claimed::Fresh(mut guard)) = store
        .claim("wal", &idem::Key::new("rolled-back").expect("a key"))
        .await
    else {
        panic!("a fresh claim");
    };
    guard.outbox().send(&good, &999).expect("a message");
    let failed = guard
        .finish::<(), idem::Error>(Err(idem::Error::Serialize("no".into())))
        .await;
    assert!(failed.is_err());
    // k1: its first message to a queue that does not exist, then one to the good queue.
    // k2: to the good queue.
    for (job, key, queue) in [(1, "k1", &missing), (2, "k1", &good), (3, "k2", &good)] {
        let Ok(Claimed::Fresh(mut guard)) = store
            .claim("wal", &idem::Key::new(&format!("p{job}")).expect("a key"))
            .await
        else {
            panic!("a fresh claim");
        };
        guard
            .outbox()
            .send_keyed(key, queue, &job)
            .expect("a message");
        let done = guard.finish::<(), idem::Error>(Ok(())).await;
        assert!(matches!(done, Ok(Outcome::Applied(()))), "p{job}: {done:?}");
    }
    let relay = WalRelay::new(store.clone(), url, RabbitMq::new(channel.clone()))
        .expect("the relay")
        .backoff(Duration::from_millis(5))
        .max_attempts(2);
    let table = store.table().to_owned();
    let parked = async {
        // Until k1's first message, refused twice, is parked, its second behind it in the
        // table.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let rows: Vec<(String, bool)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT destination, parked FROM {table}_outbox ORDER BY created_at"
            )))
            .fetch_all(pool)
            .await
            .expect("the outbox");
            if rows.len() == 2 && rows[0].1 {
                return rows;
            }
            assert!(Instant::now() < deadline, "parked rows: {rows:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let rows = tokio::select! {
        ended = relay.run(std::future::pending()) => panic!("the relay ended: {ended:?}"),
        rows = parked => rows,
    };
    assert_eq!(rows, [(missing.clone(), true), (good.clone(), false)]);
    let got: Vec<u32> = drain(&channel, &good)
        .await
        .into_iter()
        .map(|m| m.2)
        .collect();
    assert_eq!(
        got,
        [3],
        "k2 went on; k1's second waits behind its first; 999 never left"
    );
    // The queue made, the parked message requeued: k1's two leave in their order.
    declare(&channel, &missing).await;
    let requeued = store
        .requeue_parked(&idem::outbox::ParkedFilter::new(), 10)
        .await;
    assert!(requeued.is_ok(), "{requeued:?}");
    // Until k1's two arrived; k2's may arrive again, a copy with its id, from the position
    // the first run had confirmed.
    let sent = async {
        let (mut first, mut second) = (Vec::new(), Vec::new());
        while first.is_empty() || second.is_empty() {
            wait_for(&channel, &good, 1, "k1's second, after its first").await;
            first.extend(drain(&channel, &missing).await.into_iter().map(|m| m.2));
            second.extend(drain(&channel, &good).await.into_iter().map(|m| m.2));
            second.retain(|&n| n != 3);
        }
        (first, second)
    };
    let arrived = tokio::select! {
        ended = relay.run(std::future::pending()) => panic!("the relay ended: {ended:?}"),
        arrived = sent => arrived,
    };
    assert_eq!(arrived, (vec![1], vec![2]));
    for queue in [&good, &missing] {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .expect("delete");
    }
}

async fn a_server_or_role_not_set_up_is_refused_before_anything_is_published(
    url: &str,
    pool: &PgPool,
) {
    // The shared server runs with wal_level = replica.
    let shared = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let shared_pool = PgPool::connect(&shared)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {shared} (IDEM_POSTGRES_URL): {e}"));
    let level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&shared_pool)
        .await
        .expect("wal_level");
    let channel = channel().await;
    if level != "logical" {
        let relay = WalRelay::new(
            Store::new(shared_pool),
            &shared,
            RabbitMq::new(channel.clone()),
        )
        .expect("the relay");
        let error = relay.setup().await.expect_err("refused").to_string();
        assert!(
            error.contains("ALTER SYSTEM SET wal_level = logical"),
            "{error}"
        );
    }
    let role = unique("norepl");
    sqlx::query(AssertSqlSafe(format!("CREATE ROLE {role} LOGIN")))
        .execute(pool)
        .await
        .expect("a role");
    let without = url.replace("postgres@", &format!("{role}@"));
    let store = store(pool, "wal_role").await;
    let relay = WalRelay::new(store.clone(), &without, RabbitMq::new(channel)).expect("the relay");
    let error = relay
        .run(std::future::pending())
        .await
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains(&format!("ALTER ROLE \"{role}\" REPLICATION")),
        "{error}"
    );
    let slots: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM pg_replication_slots WHERE slot_name = $1")
            .bind(relay.slot_name())
            .fetch_one(pool)
            .await
            .expect("slots");
    assert_eq!(slots, 0, "nothing was made for a relay that may not stream");
    for bad in ["", "Upper", "has-dash", &"x".repeat(64)] {
        let refused = WalRelay::new(store.clone(), url, RabbitMq::new(self::channel().await))
            .expect("the relay")
            .slot(bad);
        assert!(
            matches!(
                refused,
                Err(idem::Error::Wal(idem::WalError::Refused { .. }))
            ),
            "{bad:?}"
        );
    }
}
