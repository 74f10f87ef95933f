//! A relay SIGKILLed in the middle of a round: 20 messages taken in one round, the broker has
//! confirmed the first five, and the relay is killed before the round's mark. A second relay
//! publishes what the first did not mark, the unmarked confirmed ones again with their ids.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem::outbox::{Message, PublishError, Publisher};
use sqlx::AssertSqlSafe;

use crate::support::{Lines, Worker, child_env};
use crate::{Pipeline, id_after};

/// How many confirms the first relay gets before it stops (for the kill).
pub(crate) const CHILD_PAUSE_AT: &str = "IDEM_PIPELINE_PAUSE_AT";
const ORDERS: usize = 20;
const PAUSE_AT: usize = 5;

/// Tells each confirmed message (`CONFIRMED id`), and from the `at`-th confirm on stops for
/// good (`PAUSED id` once): every publish after it waits too, so a round whose time runs out
/// cannot go on to another.
pub(crate) struct PauseAt<P> {
    inner: P,
    at: usize,
    confirmed: AtomicUsize,
}

impl<P> PauseAt<P> {
    pub(crate) fn from_env(inner: P) -> PauseAt<P> {
        PauseAt {
            inner,
            at: child_env(CHILD_PAUSE_AT).parse().expect("a count"),
            confirmed: AtomicUsize::new(0),
        }
    }
}

impl<P: Publisher> Publisher for PauseAt<P> {
    async fn publish(&self, message: &Message) -> Result<(), PublishError> {
        if self.confirmed.load(Ordering::SeqCst) >= self.at {
            std::future::pending::<()>().await;
        }
        self.inner.publish(message).await?;
        println!("CONFIRMED {}", message.id);
        if self.confirmed.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            println!("PAUSED {}", message.id);
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// The outbox's ids, and how many are marked sent.
async fn outbox(p: &Pipeline) -> (BTreeSet<String>, i64) {
    let sql = format!("SELECT id, sent_at IS NOT NULL FROM {}", p.names.outbox());
    let rows: Vec<(String, bool)> = sqlx::query_as(AssertSqlSafe(sql))
        .fetch_all(&p.pool)
        .await
        .unwrap();
    let sent = rows.iter().filter(|(_, sent)| *sent).count() as i64;
    (rows.into_iter().map(|(id, _)| id).collect(), sent)
}

/// The first relay's run up to its kill: the ids it had confirmed, and how many of them the
/// round had marked by then (none, or all but the paused one if its time ran out first).
async fn kill_mid_round(p: &Pipeline, lines: &mut Lines, mode: &str) -> (Vec<String>, i64) {
    for i in 0..ORDERS {
        p.place(&format!("order-{i}")).await;
    }
    let mut env = p.env(ORDERS as u32);
    env.push((CHILD_PAUSE_AT, PAUSE_AT.to_string()));
    let first = Worker::spawn(0, mode, &env, lines.tx.clone());
    lines.expect("PAUSED", 60).await;
    assert!(!first.kill().await.success(), "SIGKILLed");
    let confirmed: Vec<String> = lines
        .seen
        .iter()
        .filter(|(worker, line)| *worker == 0 && line.starts_with("CONFIRMED"))
        .map(|(_, line)| id_after(line, "CONFIRMED").to_owned())
        .collect();
    assert_eq!(confirmed.len(), PAUSE_AT, "{}", lines.dump());
    let (ids, marked) = outbox(p).await;
    assert_eq!(ids.len(), ORDERS);
    assert!(
        marked == 0 || marked == PAUSE_AT as i64 - 1,
        "a round marks what was confirmed when its time ran out, or nothing: {marked}"
    );
    (confirmed, marked)
}

/// The second relay, until every message is marked: the ids it confirmed.
async fn second_relay(p: &Pipeline, lines: &mut Lines, mode: &str) -> BTreeSet<String> {
    let mut again = Worker::spawn(1, mode, &p.env(ORDERS as u32), lines.tx.clone());
    p.until(60, "every message marked sent", |c| c.sent == ORDERS as i64)
        .await;
    again.stop().await;
    // Its lines up to its last, so that every confirm it printed is read.
    lines.expect("STOPPED", 60).await;
    again.succeed().await;
    lines
        .seen
        .iter()
        .filter(|(worker, line)| *worker == 1 && line.starts_with("CONFIRMED"))
        .map(|(_, line)| id_after(line, "CONFIRMED").to_owned())
        .collect()
}

/// JetStream: the stream drops the copies inside its duplicate window, so it holds each of the
/// 20 messages once, by id, though the paused message (and any other confirmed one the round
/// had not marked) was published twice.
#[tokio::test(flavor = "multi_thread")]
async fn relay_killed_mid_round_jetstream_holds_each_message_once() {
    let p = Pipeline::create("mid_nats").await;
    let (js, stream_name, mut stream) = p.email_stream().await;
    let mut lines = Lines::new();
    let (first, marked) = kill_mid_round(&p, &mut lines, "relay_nats_midround").await;
    assert_eq!(stream.info().await.unwrap().state.messages, PAUSE_AT as u64);

    let second = second_relay(&p, &mut lines, "relay_nats").await;
    let (ids, _) = outbox(&p).await;
    let unmarked: BTreeSet<String> = first[marked as usize..].iter().cloned().collect();
    assert!(
        unmarked.iter().all(|id| second.contains(id)),
        "the confirmed messages the round had not marked are published again: {unmarked:?}"
    );
    let state = stream.info().await.unwrap().state.clone();
    assert_eq!(
        state.messages, ORDERS as u64,
        "JetStream dropped the copies"
    );
    let mut in_stream = BTreeSet::new();
    for seq in state.first_sequence..=state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        let id = m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned());
        assert!(in_stream.insert(id.expect("an id")), "one copy per id");
    }
    assert_eq!(in_stream, ids, "every outbox message in the stream, by id");
    js.delete_stream(&stream_name).await.unwrap();
    p.drop().await;
}

/// RabbitMQ: the queue holds the copies (RabbitMQ keeps no ids), each with its message's id,
/// and the consumer's claim of that id makes each copy a duplicate: 20 emails.
#[tokio::test(flavor = "multi_thread")]
async fn relay_killed_mid_round_rabbitmq_copies_carry_their_ids_and_are_duplicates() {
    let p = Pipeline::create("mid_rmq").await;
    let mut lines = Lines::new();
    let (first, marked) = kill_mid_round(&p, &mut lines, "relay_midround").await;
    assert_eq!(p.ready(&p.names.email_queue).await, PAUSE_AT as u32);

    let second = second_relay(&p, &mut lines, "relay").await;
    let copies = first.iter().filter(|id| second.contains(*id)).count();
    assert_eq!(copies, PAUSE_AT - marked as usize, "{}", lines.dump());
    assert_eq!(
        p.ready(&p.names.email_queue).await,
        (ORDERS + copies) as u32,
        "each message, and a copy of each confirmed one the round had not marked"
    );
    let mut consumer = Worker::spawn(2, "consumer", &p.env(10), lines.tx.clone());
    p.until(60, "every email", |c| c.emails == ORDERS as i64)
        .await;
    let mut handled = 0;
    let mut duplicates = BTreeSet::new();
    while handled < ORDERS + copies {
        let (_, line) = lines.expect("HANDLED", 60).await;
        if let Some(id) = line.strip_prefix("HANDLED duplicate ") {
            duplicates.insert(id.trim().to_owned());
        }
        handled += 1;
    }
    let expected: BTreeSet<String> = first[marked as usize..].iter().cloned().collect();
    assert_eq!(
        duplicates, expected,
        "the copies, and only they, are duplicates"
    );
    consumer.stop().await;
    consumer.succeed().await;
    let c = p.counts().await;
    assert_eq!(
        (c.orders, c.messages, c.sent, c.emails, c.distinct_emails),
        (20, 20, 20, 20, 20)
    );
    p.drop().await;
}
