//! What the WAL relay's cases share: the shared RabbitMQ, stores through the WAL, jobs that
//! send, the relay as a process of its own, and what arrived.

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem::outbox::{RabbitMq, WalRelay};
use idem::{Claimed, Outcome, Store};
use idem_scale::jobs::unique;
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use sqlx::{AssertSqlSafe, PgPool};

pub(crate) fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

pub(crate) async fn channel() -> lapin::Channel {
    let url = amqp_url();
    let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("cannot reach RabbitMQ at {url} (IDEM_AMQP_URL): {e}"));
    connection.create_channel().await.expect("a channel")
}

pub(crate) async fn declare(channel: &lapin::Channel, queue: &str) -> u32 {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("the queue");
    declared.message_count()
}

/// A store of its own table on `url`, migrated, sending through the WAL.
pub(crate) async fn store(pool: &PgPool, prefix: &str) -> Store<sqlx::Postgres> {
    let store = Store::new(pool.clone())
        .with_table(&unique(prefix))
        .expect("a table name")
        .outbox_through_wal();
    store.migrate().await.expect("migrate");
    store
}

/// `n` jobs from `from`, each sending one message to `queue` keyed by one of `keys` keys, its
/// payload the job's number: what `key`'s messages must arrive in.
pub(crate) async fn send_jobs(
    store: &Store<sqlx::Postgres>,
    queue: &str,
    from: u32,
    n: u32,
    keys: u32,
) {
    for job in from..from + n {
        let key = format!("job-{job}");
        let Ok(Claimed::Fresh(mut guard)) = store
            .claim("wal", &idem::Key::new(&key).expect("a key"))
            .await
        else {
            panic!("a fresh claim of {key}");
        };
        guard
            .outbox()
            .send_keyed(&format!("k{}", job % keys), queue, &job)
            .expect("a message");
        let done = guard.finish::<(), idem::Error>(Ok(())).await;
        assert!(matches!(done, Ok(Outcome::Applied(()))), "{key}: {done:?}");
    }
}

/// Every message in `queue` now, as (message id, ordering key, payload), in arrival order.
pub(crate) async fn drain(channel: &lapin::Channel, queue: &str) -> Vec<(String, String, u32)> {
    let mut got = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic_get")
    {
        let id = message
            .properties
            .message_id()
            .as_ref()
            .expect("a message id")
            .to_string();
        let n: u32 = serde_json_number(&message.data);
        got.push((id, format!("k{}", n % KEYS), n));
    }
    got
}

pub(crate) fn serde_json_number(data: &[u8]) -> u32 {
    std::str::from_utf8(data)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a job's number, not {data:?}"))
}

pub(crate) const KEYS: u32 = 20;

/// Waits (with a deadline, failing with what it waited for) until `queue` holds `at_least`.
pub(crate) async fn wait_for(
    channel: &lapin::Channel,
    queue: &str,
    at_least: u32,
    what: &str,
) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let count = declare(channel, queue).await;
        if count >= at_least {
            return count;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {queue} holds {count} messages after 120 s, waited for {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The relay as a process of its own, once its setup is done.
pub(crate) fn relay_process(url: &str, table: &str) -> Child {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem-wal-relay"))
        .args([url, table, &amqp_url()])
        .stderr(Stdio::piped())
        .spawn()
        .expect("the relay's process");
    let stderr = child.stderr.take().expect("its stderr");
    let mut lines = BufReader::new(stderr).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(first, "relaying", "the relay did not start");
    // The rest of its stderr is drained, so that it never blocks writing.
    std::thread::spawn(move || lines.for_each(drop));
    child
}

pub(crate) fn kill(child: &mut Child) {
    // SIGKILL: no chance to confirm or to close the stream cleanly.
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
}

/// The relay's slot made, as its setup makes it, before the first job: a job sent before
/// holds messages no slot decodes.
pub(crate) async fn set_up(store: &Store<sqlx::Postgres>, url: &str) {
    let relay = WalRelay::new(store.clone(), url, RabbitMq::new(channel().await));
    relay.expect("the relay").setup().await.expect("setup");
}

/// Claims every delivery's id in a consumer's store, counting an effect for each `Applied`.
pub(crate) async fn consume_once(pool: &PgPool, got: &[(String, String, u32)]) -> i64 {
    let consumer = Store::new(pool.clone())
        .with_table(&unique("wal_consumer"))
        .expect("a table name");
    consumer.migrate().await.expect("migrate");
    let effects = unique("wal_effects");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {effects} (n int NOT NULL)"
    )))
    .execute(pool)
    .await
    .expect("effects");
    for (id, _, n) in got {
        match consumer
            .claim("consume", &idem::Key::new(id).expect("a key"))
            .await
            .expect("a claim")
        {
            Claimed::Fresh(mut guard) => {
                sqlx::query(AssertSqlSafe(format!("INSERT INTO {effects} VALUES ($1)")))
                    .bind(i64::from(*n) as i32)
                    .execute(&mut **guard.tx())
                    .await
                    .expect("the effect");
                let done = guard.finish::<(), idem::Error>(Ok(())).await;
                assert!(matches!(done, Ok(Outcome::Applied(()))), "{id}: {done:?}");
            }
            Claimed::Duplicate => {}
            other => panic!("{id}: {other:?}"),
        }
    }
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {effects}")))
        .fetch_one(pool)
        .await
        .expect("count")
}

pub(crate) async fn slot_pid(pool: &PgPool, table: &str) -> Option<i32> {
    sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(format!("{table}_relay"))
        .fetch_one(pool)
        .await
        .expect("the slot")
}

/// Asserts that each key's messages first arrived in the order their jobs committed (a copy
/// may come again later, with its id); returns how many messages arrived.
pub(crate) fn first_arrivals_in_commit_order(got: &[(String, String, u32)]) -> usize {
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, u32> = HashMap::new();
    for (id, key, n) in got {
        if seen.insert(id.as_str())
            && let Some(before) = last.insert(key.as_str(), *n)
        {
            assert!(before < *n, "{key}: {n} arrived after {before}");
        }
    }
    seen.len()
}

/// Deletes a case's queue, so that the broker keeps nothing of the run.
pub(crate) async fn delete(channel: &lapin::Channel, queue: &str) {
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .expect("the queue deleted");
}
