//! `examples/order_pipeline.rs` as real processes (copies of this test binary running its
//! `child_process` test as the worker, the relay or the consumer), SIGKILLed where it hurts,
//! on PostgreSQL, RabbitMQ and NATS JetStream. What counts is in the database: orders, outbox
//! messages and emails, each once per order.

#[path = "order_pipeline/broker_down.rs"]
mod broker_down;
#[path = "order_pipeline/mid_round.rs"]
mod mid_round;
#[allow(dead_code)]
#[path = "../order_pipeline.rs"]
mod order_pipeline;
#[allow(dead_code)]
#[path = "../send_invoice.rs"]
mod send_invoice;
#[path = "order_pipeline/soak.rs"]
mod soak;
mod support;

use std::sync::Arc;
use std::time::Duration;

use idem::outbox::{JetStream, RabbitMq};
use idem::{Outcome, Store};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use order_pipeline::{
    Counts, Names, Order, Telling, confirming_channel, connect_amqp, connect_postgres, counts,
    create, drop_all, place_order, relay, run_consumer, run_worker,
};
use sqlx::{PgPool, Postgres};
use support::{CHILD_MODE, Lines, Worker, child_env, stop_signal, within};

/// The pipeline's name prefix, for the processes (`Names::new`).
const CHILD_PREFIX: &str = "IDEM_PIPELINE_PREFIX";
/// The relay's batch size, for the relay processes.
const CHILD_BATCH: &str = "IDEM_PIPELINE_BATCH";

/// A process of the pipeline, until told to stop. Modes: `worker`, `consumer`; `relay` and
/// `relay_nats` (to RabbitMQ, to JetStream), and both with `_pause`: the relay prints
/// `CONFIRMED id` once the broker confirmed a message and, paused, waits there to be killed,
/// before its mark; `relay_midround` and `relay_nats_midround` pause at a later confirm of a
/// round (`mid_round.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a pipeline process that the tests start themselves"]
async fn child_process() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        panic!("child_process is a pipeline process that the tests start with {CHILD_MODE} set")
    };
    let names = Names::new(&child_env(CHILD_PREFIX));
    let pool = connect_postgres(&order_pipeline::postgres_url(), 18)
        .await
        .unwrap();
    let store = Store::new(pool).with_table(&names.markers).unwrap();
    let print = |line: &str| println!("{line}");
    let pause = mode.ends_with("_pause");
    let on_line: Arc<dyn Fn(&str) + Send + Sync> = Arc::new(|line: &str| println!("{line}"));
    let poll = Duration::from_millis(20);
    match mode.trim_end_matches("_pause") {
        role @ ("worker" | "consumer") => {
            let conn = connect_amqp(&order_pipeline::amqp_url()).await.unwrap();
            let ch = conn.create_channel().await.unwrap();
            println!("READY");
            let done = if role == "worker" {
                run_worker(&store, &ch, &names, stop_signal(), print).await
            } else {
                run_consumer(&store, &ch, &names, stop_signal(), print).await
            };
            done.unwrap();
        }
        "relay" => {
            let conn = connect_amqp(&order_pipeline::amqp_url()).await.unwrap();
            let inner = RabbitMq::new(confirming_channel(&conn).await.unwrap());
            let batch = child_env(CHILD_BATCH).parse().unwrap();
            let relay = relay(
                &store,
                Telling {
                    inner,
                    pause,
                    on_line,
                },
                batch,
            );
            println!("READY");
            relay.run(poll, stop_signal()).await.unwrap();
        }
        // The first relay of the mid-round kill (`mid_round.rs`), to RabbitMQ or JetStream.
        "relay_midround" => {
            let conn = connect_amqp(&order_pipeline::amqp_url()).await.unwrap();
            let inner = RabbitMq::new(confirming_channel(&conn).await.unwrap());
            let batch = child_env(CHILD_BATCH).parse().unwrap();
            let relay = relay(&store, mid_round::PauseAt::from_env(inner), batch);
            println!("READY");
            relay.run(poll, stop_signal()).await.unwrap();
        }
        "relay_nats_midround" => {
            let js = send_invoice::connect(&send_invoice::nats_url())
                .await
                .unwrap();
            let batch = child_env(CHILD_BATCH).parse().unwrap();
            let relay = relay(
                &store,
                mid_round::PauseAt::from_env(JetStream::new(js)),
                batch,
            );
            println!("READY");
            relay.run(poll, stop_signal()).await.unwrap();
        }
        "relay_nats" => {
            let js = send_invoice::connect(&send_invoice::nats_url())
                .await
                .unwrap();
            let inner = JetStream::new(js);
            let batch = child_env(CHILD_BATCH).parse().unwrap();
            let relay = relay(
                &store,
                Telling {
                    inner,
                    pause,
                    on_line,
                },
                batch,
            );
            println!("READY");
            relay.run(poll, stop_signal()).await.unwrap();
        }
        other => panic!("unknown mode {other}"),
    }
    println!("STOPPED");
}

/// One test's pipeline: its tables and queues, dropped at the end.
pub(crate) struct Pipeline {
    pub(crate) names: Names,
    pub(crate) pool: PgPool,
    pub(crate) store: Store<Postgres>,
    pub(crate) amqp: lapin::Connection,
    pub(crate) channel: lapin::Channel,
}

impl Pipeline {
    pub(crate) async fn create(test: &str) -> Pipeline {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let names = Names::new(&format!("pipe_{test}_{}_{nanos}", std::process::id()));
        let pool = connect_postgres(&order_pipeline::postgres_url(), 10)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let amqp = connect_amqp(&order_pipeline::amqp_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let channel = confirming_channel(&amqp).await.unwrap();
        create(&pool, &channel, &names).await.unwrap();
        let store = Store::new(pool.clone()).with_table(&names.markers).unwrap();
        Pipeline {
            names,
            pool,
            store,
            amqp,
            channel,
        }
    }

    pub(crate) fn env(&self, batch: u32) -> Vec<(&'static str, String)> {
        vec![
            (
                CHILD_PREFIX,
                self.names.markers.trim_end_matches("_markers").to_owned(),
            ),
            (CHILD_BATCH, batch.to_string()),
        ]
    }

    pub(crate) async fn counts(&self) -> Counts {
        counts(&self.pool, &self.names).await.unwrap()
    }

    /// Polls the database until `done` holds, within `secs`.
    pub(crate) async fn until(&self, secs: u64, what: &str, done: impl Fn(&Counts) -> bool) {
        within(secs, what, async {
            while !done(&self.counts().await) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }

    /// Messages ready in `queue`.
    pub(crate) async fn ready(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let q = self
            .channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap();
        q.message_count()
    }

    /// A JetStream stream of this pipeline's emails, with a duplicate window of 120 s: the
    /// context, the stream's name (to delete it) and the stream.
    pub(crate) async fn email_stream(
        &self,
    ) -> (
        async_nats::jetstream::Context,
        String,
        async_nats::jetstream::stream::Stream,
    ) {
        let js = send_invoice::connect(&send_invoice::nats_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let name = self.names.markers.to_uppercase();
        let stream = send_invoice::create_stream(
            &js,
            &name,
            &self.names.email_queue,
            Duration::from_secs(120),
        )
        .await
        .unwrap();
        (js, name, stream)
    }

    pub(crate) async fn place(&self, id: &str) {
        let order = Order {
            id: id.to_owned(),
            customer: format!("{id}@example.com"),
        };
        let outcome = place_order(&self.store, &order, &self.names).await;
        assert!(
            matches!(outcome, Ok(Outcome::Applied(()))),
            "{id}: {outcome:?}"
        );
    }

    pub(crate) async fn drop(self) {
        drop_all(&self.pool, &self.channel, &self.names)
            .await
            .unwrap();
        self.amqp.close(200, "done".into()).await.unwrap();
        self.pool.close().await;
    }
}

/// The id after a line's `prefix` (`CONFIRMED id`, `HANDLED applied id`).
pub(crate) fn id_after<'a>(line: &'a str, prefix: &str) -> &'a str {
    line.strip_prefix(prefix)
        .unwrap_or_else(|| panic!("{line:?} does not start with {prefix:?}"))
        .trim()
}

/// The relay SIGKILLed after RabbitMQ confirmed the message and before its mark: the next
/// relay publishes it again with the same id (two copies in the queue), and the consumer's
/// claim of that id makes the second a duplicate: one email.
#[tokio::test(flavor = "multi_thread")]
async fn relay_killed_after_the_confirm_the_consumer_claims_the_copy_as_a_duplicate() {
    let p = Pipeline::create("kill_rmq").await;
    p.place("order-1").await;
    let mut lines = Lines::new();
    let paused = Worker::spawn(0, "relay_pause", &p.env(10), lines.tx.clone());
    let (_, confirmed) = lines.expect("CONFIRMED", 60).await;
    let id = id_after(&confirmed, "CONFIRMED").to_owned();
    assert!(!paused.kill().await.success());
    let c = p.counts().await;
    assert_eq!((c.messages, c.sent), (1, 0), "killed before its mark");
    assert_eq!(p.ready(&p.names.email_queue).await, 1);

    let mut again = Worker::spawn(1, "relay", &p.env(10), lines.tx.clone());
    let (_, confirmed) = lines.expect("CONFIRMED", 60).await;
    assert_eq!(
        id_after(&confirmed, "CONFIRMED"),
        id,
        "published again, same id"
    );
    p.until(30, "the second relay's mark", |c| c.sent == 1)
        .await;
    assert_eq!(p.ready(&p.names.email_queue).await, 2);

    let mut consumer = Worker::spawn(2, "consumer", &p.env(10), lines.tx.clone());
    let mut handled = vec![
        lines.expect("HANDLED", 60).await.1,
        lines.expect("HANDLED", 60).await.1,
    ];
    handled.sort();
    assert_eq!(
        handled,
        [
            format!("HANDLED applied {id}"),
            format!("HANDLED duplicate {id}")
        ],
        "{}",
        lines.dump()
    );
    let c = p.counts().await;
    assert_eq!(
        (c.orders, c.messages, c.sent, c.emails, c.distinct_emails),
        (1, 1, 1, 1, 1)
    );
    for w in [&mut again, &mut consumer] {
        w.stop().await;
    }
    for w in [again, consumer] {
        w.succeed().await;
    }
    p.drop().await;
}

/// The same kill with JetStream: the stream drops the copy inside its duplicate window and
/// holds one message.
#[tokio::test(flavor = "multi_thread")]
async fn relay_killed_after_the_ack_jetstream_drops_the_copy() {
    let p = Pipeline::create("kill_nats").await;
    let (js, stream_name, mut stream) = p.email_stream().await;
    p.place("order-1").await;
    let mut lines = Lines::new();
    let paused = Worker::spawn(0, "relay_nats_pause", &p.env(10), lines.tx.clone());
    let (_, confirmed) = lines.expect("CONFIRMED", 60).await;
    let id = id_after(&confirmed, "CONFIRMED").to_owned();
    assert!(!paused.kill().await.success());
    assert_eq!(p.counts().await.sent, 0, "killed before its mark");
    assert_eq!(stream.info().await.unwrap().state.messages, 1);

    let mut again = Worker::spawn(1, "relay_nats", &p.env(10), lines.tx.clone());
    let (_, confirmed) = lines.expect("CONFIRMED", 60).await;
    assert_eq!(
        id_after(&confirmed, "CONFIRMED"),
        id,
        "published again, same id"
    );
    p.until(30, "the second relay's mark", |c| c.sent == 1)
        .await;
    let messages = stream.info().await.unwrap().state.messages;
    assert_eq!(messages, 1, "JetStream dropped the copy");
    let kept = stream
        .get_last_raw_message_by_subject(&p.names.email_queue)
        .await
        .unwrap();
    let kept_id = kept
        .headers
        .get("Nats-Msg-Id")
        .map(|v| v.as_str().to_owned());
    assert_eq!(kept_id.as_deref(), Some(id.as_str()));
    again.stop().await;
    again.succeed().await;
    js.delete_stream(&stream_name).await.unwrap();
    p.drop().await;
}

/// The example as `cargo run --example order_pipeline` runs it: 20 orders published twice,
/// one order row, one outbox message and one email each.
#[tokio::test(flavor = "multi_thread")]
async fn example_turns_twenty_orders_published_twice_into_twenty_emails() {
    let counted = order_pipeline::run(
        &order_pipeline::amqp_url(),
        &order_pipeline::postgres_url(),
        20,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        counted,
        Counts {
            orders: 20,
            messages: 20,
            sent: 20,
            emails: 20,
            distinct_emails: 20,
        }
    );
}
