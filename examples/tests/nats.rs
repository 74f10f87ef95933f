//! The `send_invoice` example's pieces against the real NATS JetStream: deduplication of
//! publishes inside the window, a publish after it stopped by the handler's claim, and a
//! consumer process SIGKILLed between its commit and its ack. Emails are counted in the
//! outbox table.

#[allow(dead_code)]
#[path = "../send_invoice.rs"]
mod send_invoice;

mod support;

use std::time::Duration;

use async_nats::jetstream;
use futures_util::StreamExt as _;
use idem::{Disposition, Outcome, Store};
use send_invoice::{Handled, SendInvoice, connect, nats_url};
use support::{CHILD_MODE, Lines, Worker, child_env, within};

const CHILD_STREAM: &str = "IDEM_NATS_STREAM";
const CHILD_DB: &str = "IDEM_NATS_DB";

/// A stream (and its SQLite file) of one test, deleted at the end, also when the test fails.
struct Fixture {
    js: jetstream::Context,
    stream: String,
    subject: String,
    dir: std::path::PathBuf,
}

impl Fixture {
    /// A stream of its own whose duplicate window is `window`.
    async fn create(test: &str, window: Duration) -> (Fixture, jetstream::stream::Stream) {
        let url = nats_url();
        let js = connect(&url).await.unwrap_or_else(|e| panic!("{e}"));
        let id = format!("{test}-{}", std::process::id());
        let fixture = Fixture {
            js,
            stream: format!("idem-test-{id}"),
            subject: format!("idem.test.{id}"),
            dir: std::env::temp_dir().join(format!("idem-test-nats-{id}")),
        };
        std::fs::create_dir_all(&fixture.dir).unwrap();
        // Left over by a killed run of the same process id: start clean.
        drop(fixture.js.delete_stream(&fixture.stream).await);
        let stream =
            send_invoice::create_stream(&fixture.js, &fixture.stream, &fixture.subject, window)
                .await
                .unwrap();
        (fixture, stream)
    }

    fn db(&self) -> std::path::PathBuf {
        self.dir.join("jobs.db")
    }

    /// The example's loop until `n` deliveries are settled, bounded.
    async fn handle(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
        store: &Store<sqlx::Sqlite>,
        n: usize,
    ) -> Vec<Handled> {
        let handling = send_invoice::handle(consumer, &self.js, &self.subject, store, n);
        within(60, "the deliveries", handling).await.unwrap()
    }
}

fn acked(delivered: u32, outcome: &'static str) -> Handled {
    Handled {
        delivered,
        outcome,
        disposition: Disposition::Ack,
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let (js, stream) = (self.js.clone(), std::mem::take(&mut self.stream));
        // Drop cannot await; a runtime of its own on another thread can, also while the test
        // unwinds from a failed assertion.
        drop(
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(async { drop(js.delete_stream(&stream).await) })
            })
            .join(),
        );
        drop(std::fs::remove_dir_all(&self.dir));
    }
}

fn invoice(order: &str) -> SendInvoice {
    SendInvoice {
        order_id: order.to_owned(),
        email: "alice@example.com".to_owned(),
        amount: 4200,
    }
}

/// The worker process of `killed_after_commit_...`: fetches one message, commits the email,
/// prints `COMMITTED`, and waits to be killed before it acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that the tests start themselves"]
async fn child_process() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        panic!("child_process is a worker process that the tests start with {CHILD_MODE} set")
    };
    assert_eq!(mode, "commit_then_hang");
    let pool = send_invoice::open_db(std::path::Path::new(&child_env(CHILD_DB)))
        .await
        .unwrap();
    let store = Store::new(pool);
    let js = connect(&nats_url()).await.unwrap();
    let stream = js.get_stream(child_env(CHILD_STREAM)).await.unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream.get_consumer("mailer").await.unwrap();
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .unwrap();
    let message = batch.next().await.expect("one message").unwrap();
    let delivered = message.info().unwrap().delivered;
    let job: SendInvoice = serde_json::from_slice(&message.payload).unwrap();
    let outcome = send_invoice::send_invoice(&store, &job).await.unwrap();
    assert_eq!(outcome, Outcome::Applied(()));
    println!("COMMITTED {} delivered={delivered}", job.order_id);
    std::future::pending::<()>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn example_runs_the_double_click_and_the_late_publish() {
    let dir = std::env::temp_dir().join(format!("idem-test-send-invoice-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    let url = nats_url();
    let report = within(
        60,
        "the send_invoice example",
        send_invoice::run(&url, &dir.join("jobs.db"), &mut out),
    )
    .await;
    std::fs::remove_dir_all(&dir).unwrap();
    let text = String::from_utf8(out).unwrap();
    let report = report.unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(report.clicks, [false, true], "{text}");
    assert_eq!(report.messages, [1, 2], "{text}");
    let outcomes: Vec<_> = report.handled.iter().map(|h| h.outcome).collect();
    assert_eq!(outcomes, ["applied", "duplicate"], "{text}");
    assert_eq!(report.emails, 1, "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_publishes_in_the_window_make_one_message_and_one_email() {
    // A window far longer than two publishes can take, however loaded the machine.
    let (fx, mut stream) = Fixture::create("window", Duration::from_secs(60)).await;
    let pool = send_invoice::open_db(&fx.db()).await.unwrap();
    let store = Store::new(pool.clone());
    let consumer =
        send_invoice::create_consumer(&stream, &fx.subject, "mailer", Duration::from_secs(30))
            .await
            .unwrap();
    let job = invoice("order-1");
    let first = send_invoice::publish(&fx.js, &fx.subject, &job)
        .await
        .unwrap();
    let second = send_invoice::publish(&fx.js, &fx.subject, &job)
        .await
        .unwrap();
    // The second click is the same message to JetStream: same sequence, flagged duplicate.
    assert_eq!((first, second), ((false, 1), (true, 1)));
    assert_eq!(stream.info().await.unwrap().state.messages, 1);

    let handled = fx.handle(&consumer, &store, 1).await;
    assert_eq!(handled, [acked(1, "applied")]);
    assert_eq!(send_invoice::emails(&pool, "order-1").await.unwrap(), 1);
    let info = consumer.get_info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_publish_after_the_window_is_a_second_message_and_a_duplicate() {
    let (fx, mut stream) = Fixture::create("late", Duration::from_secs(1)).await;
    let pool = send_invoice::open_db(&fx.db()).await.unwrap();
    let store = Store::new(pool.clone());
    let consumer =
        send_invoice::create_consumer(&stream, &fx.subject, "mailer", Duration::from_secs(30))
            .await
            .unwrap();
    let job = invoice("order-2");
    assert!(
        !send_invoice::publish(&fx.js, &fx.subject, &job)
            .await
            .unwrap()
            .0
    );
    let first = fx.handle(&consumer, &store, 1).await;
    assert_eq!(first, [acked(1, "applied")]);

    // A 1 s window: at most 100 publishes 50 ms apart are dropped before one is taken.
    let dropped = within(
        30,
        "the duplicate window to pass",
        send_invoice::publish_after_window(
            &fx.js,
            &fx.subject,
            &job,
            Duration::from_millis(50),
            100,
        ),
    )
    .await
    .unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 2);

    let late = fx.handle(&consumer, &store, 1).await;
    assert_eq!(
        late,
        [acked(1, "duplicate")],
        "after {dropped} dropped publishes"
    );
    assert_eq!(send_invoice::emails(&pool, "order-2").await.unwrap(), 1);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_commit_before_ack_the_redelivery_is_a_duplicate() {
    let (fx, stream) = Fixture::create("killed", Duration::from_secs(1)).await;
    let pool = send_invoice::open_db(&fx.db()).await.unwrap();
    let store = Store::new(pool.clone());
    // Redelivered 1 s after a delivery that was not acked.
    let consumer =
        send_invoice::create_consumer(&stream, &fx.subject, "mailer", Duration::from_secs(1))
            .await
            .unwrap();
    let job = invoice("order-3");
    send_invoice::publish(&fx.js, &fx.subject, &job)
        .await
        .unwrap();

    let mut lines = Lines::new();
    let env = [
        (CHILD_STREAM, fx.stream.clone()),
        (CHILD_DB, fx.db().display().to_string()),
    ];
    let worker = Worker::spawn(0, "commit_then_hang", &env, lines.tx.clone());
    let (_, line) = lines.expect("COMMITTED", 60).await;
    assert_eq!(line, "COMMITTED order-3 delivered=1");
    assert_eq!(send_invoice::emails(&pool, "order-3").await.unwrap(), 1);
    assert!(!worker.kill().await.success());

    // Waits for the redelivery (after `ack_wait`).
    let handled = fx.handle(&consumer, &store, 1).await;
    assert_eq!(handled, [acked(2, "duplicate")]);
    assert_eq!(send_invoice::emails(&pool, "order-3").await.unwrap(), 1);
    let info = consumer.get_info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    pool.close().await;
}
