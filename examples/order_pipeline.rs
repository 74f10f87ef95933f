//! An order pipeline on PostgreSQL and RabbitMQ, exactly once in effect from end to end:
//!
//! 1. **The worker** consumes order jobs. Its `#[idempotent]` handler writes the order row and
//!    sends an email message through its outbox: the order, the marker and the message commit
//!    together, or none of them does.
//! 2. **The relay** publishes the committed messages to the `emails` queue, each with its
//!    outbox id as the AMQP `message_id`, and marks a message sent once RabbitMQ confirmed it.
//! 3. **The consumer** consumes the emails. Its `#[idempotent]` handler claims the message's
//!    id and writes one email row.
//!
//! Kill any of them anywhere and start it again: every order has one order row, one outbox
//! message and one email row. A job delivered twice is a duplicate at the worker's claim; a
//! message published twice (the relay died between the broker's confirm and its mark) is a
//! duplicate at the consumer's claim. `examples/tests/order_pipeline.rs` runs the three as
//! processes and SIGKILLs them on a schedule.
//!
//! ```text
//! cargo run --example order_pipeline
//! ```
//! It needs PostgreSQL at `IDEM_POSTGRES_URL` (else `postgres://postgres@127.0.0.1:5432/test`)
//! and RabbitMQ at `IDEM_AMQP_URL` (else `amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use idem::outbox::{PublishError, Publisher, RabbitMq, Relay};
use idem::{Message, Outbox, Outcome, Store};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use tokio::sync::Mutex;

/// Deliveries each consumer handles at once.
const PREFETCH: u16 = 16;

/// `IDEM_AMQP_URL`, else the local broker.
pub fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// `IDEM_POSTGRES_URL`, else the local server.
pub fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// The names one pipeline uses: its tables and its two queues, all from one prefix, so that
/// pipelines side by side never share anything.
#[derive(Debug, Clone)]
pub struct Names {
    /// The marker table (`Store::with_table`); its outbox is `{markers}_outbox`.
    pub markers: String,
    pub orders: String,
    pub emails: String,
    pub order_queue: String,
    pub email_queue: String,
}

impl Names {
    pub fn new(prefix: &str) -> Names {
        Names {
            markers: format!("{prefix}_markers"),
            orders: format!("{prefix}_orders"),
            emails: format!("{prefix}_emails"),
            order_queue: format!("{prefix}.orders"),
            email_queue: format!("{prefix}.emails"),
        }
    }

    pub fn outbox(&self) -> String {
        format!("{}_outbox", self.markers)
    }
}

/// An order job as the shop publishes it: `id` is the same on every delivery.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    pub id: String,
    pub customer: String,
}

/// The email the order's handler sends through its outbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Email {
    pub order: String,
    pub to: String,
}

/// The handlers' error: idem's own, or the database's.
#[derive(Debug)]
pub enum JobError {
    Database(sqlx::Error),
    Idem(idem::Error),
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        JobError::Database(e)
    }
}

impl From<idem::Error> for JobError {
    fn from(e: idem::Error) -> Self {
        JobError::Idem(e)
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Database(e) => write!(f, "database: {e}"),
            JobError::Idem(e) => write!(f, "idem: {e}"),
        }
    }
}

/// The worker's handler: the order row and its email message, in one transaction.
#[idem::idempotent(key = "order.id", scope = "orders.place")]
pub async fn place_order(
    tx: &mut Transaction<'_, Postgres>,
    order: &Order,
    names: &Names,
    outbox: &mut Outbox,
) -> Result<(), JobError> {
    // The table names come from `Names`, never from a message.
    let insert = format!(
        "INSERT INTO {} (id, customer) VALUES ($1, $2)",
        names.orders
    );
    sqlx::query(AssertSqlSafe(insert))
        .bind(&order.id)
        .bind(&order.customer)
        .execute(&mut **tx)
        .await?;
    let email = Email {
        order: order.id.clone(),
        to: order.customer.clone(),
    };
    outbox.send(&names.email_queue, &email)?;
    Ok(())
}

/// The consumer's handler: claims the message's id (the outbox's), writes one email row.
#[idem::idempotent(key = "message_id", scope = "emails.send")]
pub async fn send_email(
    tx: &mut Transaction<'_, Postgres>,
    message_id: &str,
    email: &Email,
    names: &Names,
) -> Result<(), JobError> {
    // A real consumer would hand the email to its mail service in lease mode; the row is the
    // effect the tests count.
    let insert = format!(
        "INSERT INTO {} (message_id, order_id, recipient) VALUES ($1, $2, $3)",
        names.emails
    );
    sqlx::query(AssertSqlSafe(insert))
        .bind(message_id)
        .bind(&email.order)
        .bind(&email.to)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Connects to RabbitMQ; the error names the URL and the variable that overrides it.
pub async fn connect_amqp(url: &str) -> Result<Connection, String> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot reach RabbitMQ at {url} (set IDEM_AMQP_URL): {e}"))
}

/// Connects to PostgreSQL; the error names the URL and the variable that overrides it.
pub async fn connect_postgres(url: &str, max: u32) -> Result<PgPool, String> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .connect(url)
        .await
        .map_err(|e| format!("cannot reach PostgreSQL at {url} (set IDEM_POSTGRES_URL): {e}"))
}

/// Creates the pipeline's tables (idem's with `migrate`) and its durable queues.
pub async fn create(pool: &PgPool, channel: &Channel, names: &Names) -> Result<(), String> {
    let store = Store::new(pool.clone())
        .with_table(&names.markers)
        .map_err(|e| e.to_string())?;
    store.migrate().await.map_err(|e| e.to_string())?;
    for ddl in [
        format!(
            "CREATE TABLE IF NOT EXISTS {} (id text NOT NULL, customer text NOT NULL)",
            names.orders
        ),
        // No unique constraint: a second email would be a row the tests count.
        format!(
            "CREATE TABLE IF NOT EXISTS {} (message_id text NOT NULL, order_id text NOT NULL, \
             recipient text NOT NULL)",
            names.emails
        ),
    ] {
        sqlx::query(AssertSqlSafe(ddl))
            .execute(pool)
            .await
            .map_err(|e| e.to_string())?;
    }
    for queue in [&names.order_queue, &names.email_queue] {
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("declare {queue}: {e}"))?;
    }
    Ok(())
}

/// Drops what [`create`] made.
pub async fn drop_all(pool: &PgPool, channel: &Channel, names: &Names) -> Result<(), String> {
    for table in [
        names.outbox(),
        names.markers.clone(),
        names.orders.clone(),
        names.emails.clone(),
    ] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(pool)
            .await
            .map_err(|e| e.to_string())?;
    }
    for queue in [&names.order_queue, &names.email_queue] {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(|e| format!("delete {queue}: {e}"))?;
    }
    Ok(())
}

/// A channel with publisher confirms on.
pub async fn confirming_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// Publishes `orders` as persistent order jobs, each with its id as `message_id`, and waits
/// for the broker's confirms.
pub async fn publish_orders(
    channel: &Channel,
    names: &Names,
    orders: &[Order],
) -> Result<(), String> {
    let mut confirms = Vec::with_capacity(orders.len());
    for order in orders {
        let payload = serde_json::to_vec(order).map_err(|e| e.to_string())?;
        let confirm = channel
            .basic_publish(
                "".into(),
                names.order_queue.as_str().into(),
                BasicPublishOptions::default(),
                &payload,
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(order.id.as_str().into()),
            )
            .await
            .map_err(|e| e.to_string())?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        let confirm = confirm.await.map_err(|e| e.to_string())?;
        if !confirm.is_ack() {
            return Err(format!("the broker refused an order: {confirm:?}"));
        }
    }
    Ok(())
}

/// Consumes `queue` with manual acks until `stop` resolves: each delivery's id and body go to
/// `handle`, and `Ok(applied)` acks (`applied`: this delivery ran the effect; otherwise it was
/// a duplicate), an error nacks with requeue (nothing was kept). `on_line` sees one line per
/// handled delivery: `HANDLED applied|duplicate ID`, printed before the ack, so that a process
/// killed in between has told it (the delivery comes back and is told again).
pub async fn consume<H, Fut>(
    channel: &Channel,
    queue: &str,
    handle: H,
    stop: impl Future<Output = ()>,
    on_line: impl Fn(&str) + Sync,
) -> Result<(), String>
where
    H: Fn(String, Vec<u8>) -> Fut + Sync,
    Fut: Future<Output = Result<bool, String>>,
{
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let (handle, on_line) = (&handle, &on_line);
    consumer
        .take_until(stop)
        .for_each_concurrent(usize::from(PREFETCH), |delivery| async move {
            let Ok(delivery) = delivery else {
                on_line("CONSUMER ERROR");
                return;
            };
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default();
            match handle(id.clone(), delivery.data.clone()).await {
                Ok(applied) => {
                    let what = if applied { "applied" } else { "duplicate" };
                    on_line(&format!("HANDLED {what} {id}"));
                    drop(delivery.acker.ack(BasicAckOptions::default()).await);
                }
                Err(e) => {
                    on_line(&format!("NACKED {id}: {e}"));
                    let requeue = BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    };
                    drop(delivery.acker.nack(requeue).await);
                }
            }
        })
        .await;
    Ok(())
}

/// What a handler's outcome means for the delivery: `Ok(true)` applied, `Ok(false)` a
/// duplicate (done before), an error to retry.
fn settled(outcome: Result<Outcome<()>, JobError>) -> Result<bool, String> {
    match outcome {
        Ok(Outcome::Applied(())) => Ok(true),
        Ok(Outcome::Duplicate | Outcome::Replayed(()) | Outcome::Failed(_)) => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// The worker: order jobs in, orders and outbox messages out.
pub async fn run_worker(
    store: &Store<Postgres>,
    channel: &Channel,
    names: &Names,
    stop: impl Future<Output = ()>,
    on_line: impl Fn(&str) + Sync,
) -> Result<(), String> {
    let handle = |_id: String, body: Vec<u8>| async move {
        let order: Order = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        settled(place_order(store, &order, names).await)
    };
    consume(channel, &names.order_queue, handle, stop, on_line).await
}

/// The consumer: emails in, one email row per outbox message.
pub async fn run_consumer(
    store: &Store<Postgres>,
    channel: &Channel,
    names: &Names,
    stop: impl Future<Output = ()>,
    on_line: impl Fn(&str) + Sync,
) -> Result<(), String> {
    let handle = |id: String, body: Vec<u8>| async move {
        if id.is_empty() {
            return Err("a message without its outbox id".to_owned());
        }
        let email: Email = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        settled(send_email(store, &id, &email, names).await)
    };
    consume(channel, &names.email_queue, handle, stop, on_line).await
}

/// A RabbitMQ publisher that survives the broker going away: a publish that fails drops its
/// connection, and the next one connects again. (`RabbitMq` alone keeps one channel, dead
/// for good once its connection is.)
pub struct Reconnecting {
    url: String,
    current: Mutex<Option<(Connection, RabbitMq)>>,
}

impl Reconnecting {
    pub fn new(url: &str) -> Reconnecting {
        Reconnecting {
            url: url.to_owned(),
            current: Mutex::new(None),
        }
    }
}

impl Publisher for Reconnecting {
    async fn publish(&self, message: &Message) -> Result<(), PublishError> {
        let mut current = self.current.lock().await;
        if current.is_none() {
            let connection = connect_amqp(&self.url).await?;
            let channel = confirming_channel(&connection).await?;
            *current = Some((connection, RabbitMq::new(channel)));
        }
        let (_, publisher) = current.as_ref().expect("connected above");
        let result = publisher.publish(message).await;
        if result.is_err() {
            *current = None;
        }
        result
    }
}

/// Wraps a publisher to tell each confirmed message (`CONFIRMED ID`, before the relay's mark),
/// and, if `pause`, to stop there for good: the point where a crash publishes the message
/// again.
pub struct Telling<P> {
    pub inner: P,
    pub pause: bool,
    pub on_line: Arc<dyn Fn(&str) + Send + Sync>,
}

impl<P: Publisher> Publisher for Telling<P> {
    async fn publish(&self, message: &Message) -> Result<(), PublishError> {
        self.inner.publish(message).await?;
        (self.on_line)(&format!("CONFIRMED {}", message.id));
        if self.pause {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// The relay's settings in this pipeline: a short lease, so that a relay killed with
/// messages in hand holds them up for a second only, and a short backoff.
pub fn relay<P: Publisher>(
    store: &Store<Postgres>,
    publisher: P,
    batch: u32,
) -> Relay<Postgres, P> {
    Relay::new(store.clone(), publisher)
        .batch(batch)
        .lease(Duration::from_secs(1))
        .backoff(Duration::from_millis(100))
        .max_attempts(1_000)
}

/// Counts in the database: orders, outbox messages (and how many of them are sent), emails
/// (and of how many distinct messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub orders: i64,
    pub messages: i64,
    pub sent: i64,
    pub emails: i64,
    pub distinct_emails: i64,
}

pub async fn counts(pool: &PgPool, names: &Names) -> Result<Counts, sqlx::Error> {
    let sql = format!(
        "SELECT (SELECT COUNT(*) FROM {o}), (SELECT COUNT(*) FROM {x}), \
         (SELECT COUNT(*) FROM {x} WHERE sent_at IS NOT NULL), (SELECT COUNT(*) FROM {e}), \
         (SELECT COUNT(DISTINCT message_id) FROM {e})",
        o = names.orders,
        x = names.outbox(),
        e = names.emails
    );
    let (orders, messages, sent, emails, distinct_emails) =
        sqlx::query_as(AssertSqlSafe(sql)).fetch_one(pool).await?;
    Ok(Counts {
        orders,
        messages,
        sent,
        emails,
        distinct_emails,
    })
}

/// The whole pipeline in one process: 20 orders, each published twice (a retried publish),
/// through the worker, the relay and the consumer, until every order has its email.
pub async fn run(amqp: &str, postgres: &str, orders: usize) -> Result<Counts, String> {
    let pool = connect_postgres(postgres, 8).await?;
    let connection = connect_amqp(amqp).await?;
    let channel = confirming_channel(&connection)
        .await
        .map_err(|e| e.to_string())?;
    let names = Names::new(&format!("order_pipeline_{}", std::process::id()));
    create(&pool, &channel, &names).await?;
    let store = Store::new(pool.clone())
        .with_table(&names.markers)
        .map_err(|e| e.to_string())?;
    let jobs: Vec<Order> = (1..=orders)
        .map(|n| Order {
            id: format!("order-{n}"),
            customer: format!("customer{n}@example.com"),
        })
        .collect();
    publish_orders(&channel, &names, &jobs).await?;
    publish_orders(&channel, &names, &jobs).await?;
    println!("published {orders} orders twice to {}", names.order_queue);

    let done = tokio::sync::Notify::new();
    let (work_ch, relay_ch, consume_ch) = (
        connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?,
        confirming_channel(&connection)
            .await
            .map_err(|e| e.to_string())?,
        connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?,
    );
    let relay = relay(&store, RabbitMq::new(relay_ch), 100);
    let quiet = |_: &str| {};
    let watch = async {
        loop {
            let c = counts(&pool, &names).await.map_err(|e| e.to_string())?;
            if c.emails as usize >= orders && c.sent as usize >= orders {
                done.notify_waiters();
                return Ok::<Counts, String>(c);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (worker, relayed, consumer, counted) = tokio::join!(
        run_worker(&store, &work_ch, &names, done.notified(), quiet),
        relay.run(Duration::from_millis(50), done.notified()),
        run_consumer(&store, &consume_ch, &names, done.notified(), quiet),
        watch,
    );
    worker?;
    relayed.map_err(|e| e.to_string())?;
    consumer?;
    let counted = counted?;
    println!(
        "{} orders, {} outbox messages ({} sent), {} emails of {} messages",
        counted.orders, counted.messages, counted.sent, counted.emails, counted.distinct_emails
    );
    drop_all(&pool, &channel, &names).await?;
    connection
        .close(200, "done".into())
        .await
        .map_err(|e| e.to_string())?;
    Ok(counted)
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), String> {
    run(&amqp_url(), &postgres_url(), 20).await.map(|_| ())
}
