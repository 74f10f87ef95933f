//! `--outbox`: what the transactional outbox costs, on PostgreSQL and RabbitMQ, in one run.
//!
//! - **The handler.** The top-up job under `#[idem::idempotent]` without an outbox, and with
//!   one sending 0, 1 and 10 messages (each message one more `INSERT` in the claim's
//!   transaction): jobs/s at `WORKERS` workers. Each run checks its effects and its messages
//!   (one per job and message), then empties the outbox, so that every run starts alike.
//!   Beside them, the floor (`outbox/floor.rs`): pgbench running the same statements by hand,
//!   each ratio to pgbench without an outbox.
//! - **Batches** (`outbox/batch.rs`): a batch handler of 100 jobs without an outbox and with
//!   one message a job, in jobs/s.
//! - **The relay.** `Relay::relay_once` until `MESSAGES` committed messages are sent, by batch
//!   size, against the same `RabbitMq` publisher publishing them directly (no database) in
//!   rounds of 100, as the relay does: every message of a round sent, then their publisher
//!   confirms awaited together. Messages are persistent, to a durable queue purged after
//!   each run. `Relay::run` at batch 100 with two rounds in flight, three and four (its default),
//!   timed until every message is confirmed and marked, and the direct publish with two
//!   rounds in flight. The rows at batch 100 and the direct ones again through the
//!   `JetStream` publisher, to a stream of their own (`outbox/jetstream.rs`), in the same
//!   rounds. And the relay rows at batch 100 to no broker at all (a publisher that confirms
//!   every message as it is given): the database's share of the relay, its ceiling here.
//!   `--outbox --relay-only` runs these rows alone (and the three databases' rows);
//!   `--outbox --handler-only` the rows before them alone.
//! - **The three databases** (`outbox/backends.rs`): the relay rows again with MariaDB and
//!   SQLite beside PostgreSQL, and (`outbox/latency.rs`) each one's latency from a job's
//!   commit to its message's confirm at a steady 1,000 jobs/s.
//!
//! Each round runs every variant once, every other round in reverse order; the report gives
//! the medians.
//!
//! `--outbox --wal-floor` runs none of these: pgbench on the handler's statements on a
//! PostgreSQL of its own with `wal_level = logical`, the messages as outbox rows and as
//! logical decoding messages (`outbox/wal_floor.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::outbox::{Publisher, RabbitMq, Relay};
use idem::{Message, Store};
use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use sqlx::{AssertSqlSafe, PgPool, Postgres};

use crate::Res;
use crate::config::config;

use handler::{Job, effect, finish_run, handler_run, workers};

mod backends;
mod batch;
mod floor;
mod handler;
mod jetstream;
mod latency;
mod wake;
pub(crate) mod wal;
pub(crate) mod wal_floor;

const WORKERS: usize = 8;
const ACCOUNTS: i64 = 1_000;
const BATCHES: [u32; 3] = [1, 10, 100];

/// How the relay rows publish: `relay_once` in a loop at a batch size, `Relay::run` at a batch
/// size with this many rounds in flight, or the publisher directly in rounds of 100, with this
/// many rounds in flight.
#[derive(Clone, Copy, PartialEq)]
enum Publishing {
    Once(u32),
    Run(u32, usize),
    Direct(usize),
}

/// The bench's tables and queue, this process's own.
struct Names {
    accounts: String,
    markers: String,
    queue: String,
}

/// The brokers the relay rows publish to; `Nowhere` confirms every message at once, which
/// leaves the relay's database work alone.
#[derive(Clone, Copy, PartialEq)]
enum Broker {
    RabbitMq,
    JetStream,
    Nowhere,
}

/// A publisher with no broker behind it: every message confirmed as it is given.
#[derive(Clone)]
struct Nowhere;

impl Publisher for Nowhere {
    async fn publish<'a>(&'a self, _: &'a Message) -> Result<(), idem::outbox::PublishError> {
        Ok(())
    }
}

/// `count` committed messages to `destination`, as a handler's outbox leaves them: each job's
/// one message, under the job's key as its ordering key; their ids are `relayed_ids`'.
async fn fill(
    pool: &PgPool,
    names: &Names,
    destination: &str,
    count: usize,
    round: usize,
) -> Res<()> {
    let sql = format!(
        "INSERT INTO {}_outbox (id, destination, payload, scope, key, seq, ordering_key) \
         SELECT 'r{round}-' || g, $1, '{{}}'::bytea, 'bench.outbox', 'r{round}-' || g, 0, \
         'r{round}-' || g FROM generate_series(1, $2) g",
        names.markers
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(destination)
        .bind(count as i64)
        .execute(pool)
        .await?;
    Ok(())
}

/// The ids of the messages a run of `publishing` in `round` publishes: `fill`'s, or
/// `direct_messages`'.
fn relayed_ids(publishing: Publishing, round: usize, count: usize) -> Vec<String> {
    match publishing {
        Publishing::Direct(_) => (0..count).map(|n| format!("direct-{round}-{n}")).collect(),
        _ => (1..=count).map(|g| format!("r{round}-{g}")).collect(),
    }
}

/// Counts the messages its publisher confirmed, to tell `Relay::run` when to stop.
struct Counting<P> {
    inner: P,
    confirmed: Arc<AtomicU64>,
}

impl<P: Publisher> Publisher for Counting<P> {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), idem::outbox::PublishError> {
        let answer = self.inner.publish(message).await;
        if answer.is_ok() {
            self.confirmed.fetch_add(1, Ordering::Relaxed);
        }
        answer
    }

    async fn publish_all<'a>(
        &'a self,
        messages: &'a [Message],
        done: &'a mut Vec<Result<(), idem::outbox::PublishError>>,
    ) {
        let start = done.len();
        self.inner.publish_all(messages, done).await;
        let ok = done[start..].iter().filter(|a| a.is_ok()).count();
        self.confirmed.fetch_add(ok as u64, Ordering::Relaxed);
    }
}

/// Messages/s of the relay, or of publishing directly, to `destination` through `publisher`;
/// the caller checks the broker got them.
async fn relay_run<P: Publisher + Clone + 'static>(
    store: &Store<Postgres>,
    publisher: &P,
    destination: &str,
    names: &Names,
    publishing: Publishing,
    count: usize,
    round: usize,
) -> Res<f64> {
    let started;
    match publishing {
        Publishing::Run(batch, in_flight) => {
            fill(store.pool(), names, destination, count, round).await?;
            let confirmed = Arc::new(AtomicU64::new(0));
            let counting = Counting {
                inner: publisher.clone(),
                confirmed: confirmed.clone(),
            };
            let relay = Relay::new(store.clone(), counting)
                .batch(batch)
                .rounds_in_flight(in_flight)
                .listen(false);
            let outbox = format!("{}_outbox", names.markers);
            // Done once every message is confirmed and marked: the count is read only once
            // the broker confirmed them all, not while the relay works.
            let done = async {
                loop {
                    if confirmed.load(Ordering::Relaxed) as usize >= count {
                        let unsent: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                            "SELECT COUNT(*) FROM {outbox} WHERE sent_at IS NULL"
                        )))
                        .fetch_one(store.pool())
                        .await
                        .unwrap_or(1);
                        if unsent == 0 {
                            return;
                        }
                    }
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
            };
            started = Instant::now();
            let stopped = tokio::time::timeout(
                Duration::from_secs(60),
                relay.run(Duration::from_secs(60), done),
            )
            .await;
            match stopped {
                Ok(ran) => ran?,
                Err(_) => return Err("Relay::run did not send every message in 60 s".into()),
            }
        }
        Publishing::Once(batch) => {
            fill(store.pool(), names, destination, count, round).await?;
            let relay = Relay::new(store.clone(), publisher.clone()).batch(batch);
            started = Instant::now();
            relay_rounds(&relay, count).await?;
        }
        Publishing::Direct(in_flight) => {
            let messages = direct_messages(destination, round, count);
            let rounds: Arc<Vec<Vec<Message>>> =
                Arc::new(messages.chunks(100).map(<[Message]>::to_vec).collect());
            started = Instant::now();
            // As the relay publishes a round of 100: all sent, then their confirms together;
            // each lane's rounds one after another, the lanes side by side.
            let mut lanes = Vec::new();
            for lane in 0..in_flight {
                let (publisher, rounds) = (publisher.clone(), rounds.clone());
                lanes.push(tokio::spawn(async move {
                    for round in rounds.iter().skip(lane).step_by(in_flight) {
                        let mut done = Vec::with_capacity(round.len());
                        publisher.publish_all(round, &mut done).await;
                        if let Some(Err(e)) = done.into_iter().find(Result::is_err) {
                            return Err(e.to_string());
                        }
                    }
                    Ok(())
                }));
            }
            for lane in lanes {
                lane.await??;
            }
        }
    }
    let rate = count as f64 / started.elapsed().as_secs_f64();
    sqlx::query(AssertSqlSafe(format!("TRUNCATE {}_outbox", names.markers)))
        .execute(store.pool())
        .await?;
    Ok(rate)
}

/// The rows before the relay's: the handler's cost, the wake-up, batches.
struct Before {
    handler: [f64; 4],
    floor: [f64; 3],
    samples: usize,
    own: (Duration, Duration),
    others: (Duration, Duration),
    batches: [f64; 2],
}

/// Runs the handler, wake-up and batch variants (all but the relay's rows; `--relay-only`
/// leaves them out).
async fn before_relay(
    store: &Store<Postgres>,
    names: &Names,
    pg_url: &str,
    quick: bool,
    rounds: usize,
    run: Duration,
) -> Res<Before> {
    eprintln!("outbox: the handler with 0, 1 and 10 messages");
    let next = Arc::new(AtomicU64::new(1));
    let variants = [None, Some(0), Some(1), Some(10)];
    handler_run(store, names, &next, Some(1), run / 2).await?;
    let mut handler: [Vec<f64>; 4] = Default::default();
    for round in 0..rounds {
        let mut order = [0, 1, 2, 3];
        if round % 2 == 1 {
            order.reverse();
        }
        for v in order {
            handler[v].push(handler_run(store, names, &next, variants[v], run).await?);
        }
    }
    let handler = handler.map(median);
    eprintln!("outbox: pgbench running the handler's statements with 0, 1 and 10 messages");
    let floor = floor::run(store.pool(), names, rounds, run).await?;
    let applied: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT SUM(credits)::int8 FROM {}",
        names.accounts
    )))
    .fetch_one(store.pool())
    .await?;
    let claimed = next.load(Ordering::Relaxed) as i64 - 1;
    if applied != claimed {
        return Err(format!("{applied} credits for {claimed} jobs").into());
    }

    eprintln!("outbox: the relay's wake-up, from a job's commit to its message's publish");
    let samples = if quick { 50 } else { 300 };
    let first = next.fetch_add(2 * samples as u64 + 2, Ordering::Relaxed);
    let own = wake::latency(store, store.clone(), names, first, samples).await?;
    let other_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(pg_url)
        .await?;
    let other = Store::new(other_pool.clone()).with_table(&names.markers)?;
    let first = first + samples as u64 + 1;
    let others = wake::latency(store, other, names, first, samples).await?;
    other_pool.close().await;
    sqlx::query(AssertSqlSafe(format!("TRUNCATE {}_outbox", names.markers)))
        .execute(store.pool())
        .await?;

    eprintln!(
        "outbox: batches of {} without and with a message a job",
        batch::BATCH
    );
    let mut batches: [Vec<f64>; 2] = Default::default();
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for v in order {
            batches[v].push(batch::run(store, names, &next, v == 1, run).await?);
        }
    }
    let batches = batches.map(median);
    Ok(Before {
        handler,
        floor,
        samples,
        own,
        others,
        batches,
    })
}

impl Before {
    fn print(&self) {
        println!(
            "## Outbox: the handler's cost by messages sent (PostgreSQL, {WORKERS} workers)\n"
        );
        println!("| handler | jobs/s | vs no outbox |");
        println!("|---|---|---|");
        let (handler, batches, samples) = (self.handler, self.batches, self.samples);
        rows(
            &[
                "no outbox",
                "outbox, 0 messages",
                "outbox, 1 message",
                "outbox, 10 messages",
            ],
            &handler,
        );
        // The floor: PostgreSQL's own client on the same statements (`outbox/floor.rs`).
        rows(
            &[
                "pgbench, no outbox",
                "pgbench, 1 message",
                "pgbench, 10 messages",
            ],
            &self.floor,
        );
        println!(
            "\n## Outbox: the relay's wake-up, from a job's commit to its message's publish \
             ({samples} jobs one at a time, the relay's poll a minute)\n"
        );
        println!("| relay | p50 | p99 |");
        println!("|---|---|---|");
        for (name, (p50, p99)) in [
            ("of the same store", self.own),
            ("of another store", self.others),
        ] {
            println!(
                "| {name} | {:.2} ms | {:.2} ms |",
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3
            );
        }
        println!(
            "\n## Outbox in batches of {} (PostgreSQL, {WORKERS} workers, jobs/s)\n",
            batch::BATCH
        );
        println!("| batch handler | jobs/s | vs no outbox |");
        println!("|---|---|---|");
        rows(&["no outbox", "outbox, 1 message a job"], &batches);
    }
}

/// A table's rows: each name, its rate, and its ratio to the first rate.
fn rows(names: &[&str], rates: &[f64]) {
    for (name, rate) in names.iter().zip(rates) {
        println!("| {name} | {rate:.0} | {:.2} |", rate / rates[0]);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `--outbox [--quick]`: the report on stdout.
pub(crate) async fn run(quick: bool) -> Res<()> {
    let cfg = config();
    let (rounds, run, messages) = if quick {
        (3, Duration::from_millis(300), 300)
    } else {
        (7, Duration::from_secs(2), 1_000)
    };
    let pid = std::process::id();
    let names = Names {
        accounts: format!("idem_bench_ob_accounts_p{pid}"),
        markers: format!("idem_bench_ob_markers_p{pid}"),
        queue: format!("idem.bench.outbox.p{pid}"),
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(WORKERS as u32 + 1)
        .test_before_acquire(false)
        .connect(&cfg.pg_url)
        .await
        .map_err(|e| {
            format!(
                "cannot reach PostgreSQL at {} (IDEM_POSTGRES_URL): {e}",
                cfg.pg_url
            )
        })?;
    let drop_tables = format!(
        "DROP TABLE IF EXISTS {a}, {m}, {m}_outbox",
        a = names.accounts,
        m = names.markers
    );
    for sql in [
        drop_tables.clone(),
        format!(
            "CREATE TABLE {} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL)",
            names.accounts
        ),
        format!(
            "INSERT INTO {} SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g",
            names.accounts
        ),
    ] {
        sqlx::query(AssertSqlSafe(sql)).execute(&pool).await?;
    }
    let store = Store::new(pool.clone()).with_table(&names.markers)?;
    store.migrate().await?;

    let relay_only = std::env::args().any(|a| a == "--relay-only");
    let before = if relay_only {
        None
    } else {
        Some(before_relay(&store, &names, &cfg.pg_url, quick, rounds, run).await?)
    };

    if let Some(before) = before
        .as_ref()
        .filter(|_| std::env::args().any(|a| a == "--handler-only"))
    {
        sqlx::query(AssertSqlSafe(drop_tables))
            .execute(&pool)
            .await?;
        before.print();
        return Ok(());
    }

    eprintln!(
        "outbox: relaying to RabbitMQ by batch size and to JetStream, and publishing directly"
    );
    let (amqp, channel) = confirming_channel(&names.queue).await?;
    let publisher = RabbitMq::new(channel.clone());
    let js = jetstream::Js::connect(&cfg.suffix).await?;
    let variants = relay_variants();
    let measured = relay_rows(
        &store, &names, &publisher, &channel, &js, &variants, rounds, messages,
    )
    .await;
    js.delete().await;
    channel
        .queue_delete(names.queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    amqp.close(200, "done".into()).await?;
    sqlx::query(AssertSqlSafe(drop_tables))
        .execute(&pool)
        .await?;
    let relayed = measured?;

    if let Some(before) = &before {
        before.print();
    }
    print_relayed(&variants, &relayed, messages);
    backends::run(quick).await
}

/// The relay rows: every `Publishing` to RabbitMQ, and those at batch 100 and the direct ones
/// to JetStream.
fn relay_variants() -> Vec<(Broker, Publishing)> {
    let at_100 = [
        Publishing::Once(100),
        Publishing::Run(100, 2),
        Publishing::Run(100, 3),
        Publishing::Run(100, 4),
        Publishing::Direct(1),
        Publishing::Direct(2),
    ];
    let rabbit = BATCHES
        .iter()
        .filter(|&&batch| batch < 100)
        .map(|&batch| Publishing::Once(batch))
        .chain(at_100)
        .map(|p| (Broker::RabbitMq, p));
    let nowhere = at_100
        .into_iter()
        .filter(|p| !matches!(p, Publishing::Direct(_)))
        .map(|p| (Broker::Nowhere, p));
    rabbit
        .chain(at_100.map(|p| (Broker::JetStream, p)))
        .chain(nowhere)
        .collect()
}

/// Each variant's median messages/s over `rounds`, every variant once a round, every other
/// round in reverse order; each run checked against its broker, which is emptied after it.
#[allow(clippy::too_many_arguments)] // One run's settings, read once.
async fn relay_rows(
    store: &Store<Postgres>,
    names: &Names,
    publisher: &RabbitMq,
    channel: &lapin::Channel,
    js: &jetstream::Js,
    variants: &[(Broker, Publishing)],
    rounds: usize,
    messages: usize,
) -> Res<Vec<f64>> {
    let mut relayed: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    // Each confirm of a persistent message waits for the broker's disk: a few rounds only.
    let rounds = rounds.min(3);
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for v in order {
            let at = round * variants.len() + v;
            let (broker, publishing) = variants[v];
            let rate = match broker {
                Broker::RabbitMq => {
                    let rate = relay_run(
                        store,
                        publisher,
                        &names.queue,
                        names,
                        publishing,
                        messages,
                        at,
                    )
                    .await?;
                    backends::purge(channel, &names.queue, messages).await?;
                    rate
                }
                Broker::JetStream => {
                    let rate = relay_run(
                        store,
                        &js.publisher,
                        &js.subject,
                        names,
                        publishing,
                        messages,
                        at,
                    )
                    .await?;
                    js.check_and_purge(relayed_ids(publishing, at, messages))
                        .await?;
                    rate
                }
                // Every message marked sent is the check (`relay_run` waits for it).
                Broker::Nowhere => {
                    relay_run(store, &Nowhere, "nowhere", names, publishing, messages, at).await?
                }
            };
            relayed[v].push(rate);
        }
    }
    Ok(relayed.into_iter().map(median).collect())
}

/// The relay rows' table: RabbitMQ's and JetStream's side by side, each ratio to its own
/// broker's direct publish of one round at a time, as `relay_once` publishes.
fn print_relayed(variants: &[(Broker, Publishing)], relayed: &[f64], messages: usize) {
    println!(
        "\n## Outbox: messages/s relayed from PostgreSQL by batch size against publishing \
         directly, to RabbitMQ and to JetStream ({messages} messages; directly: rounds of 100, \
         each round's confirms or acks awaited together, as the relay's)\n"
    );
    println!(
        "| publisher | RabbitMQ: messages/s | vs direct | JetStream: messages/s | vs direct \
         | no broker: messages/s |"
    );
    println!("|---|---|---|---|---|---|");
    let rate = |broker: Broker, publishing: Publishing| {
        variants
            .iter()
            .zip(relayed)
            .find(|(v, _)| **v == (broker, publishing))
            .map(|(_, rate)| *rate)
    };
    let cell = |broker: Broker, publishing: Publishing| {
        let direct = rate(broker, Publishing::Direct(1));
        match (rate(broker, publishing), direct) {
            (Some(r), Some(d)) => format!("{r:.0} | {:.2}", r / d),
            _ => "– | –".to_owned(),
        }
    };
    for &(broker, publishing) in variants {
        if broker != Broker::RabbitMq {
            continue;
        }
        let alone =
            rate(Broker::Nowhere, publishing).map_or("–".to_owned(), |r| format!("{r:.0}"));
        println!(
            "| {} | {} | {} | {alone} |",
            publishing.name(),
            cell(Broker::RabbitMq, publishing),
            cell(Broker::JetStream, publishing)
        );
    }
}

impl Publishing {
    fn name(self) -> String {
        match self {
            Publishing::Once(batch) => format!("relay, batch {batch}"),
            Publishing::Run(batch, n) => format!("Relay::run, batch {batch}, {n} rounds in flight"),
            Publishing::Direct(1) => "direct".to_owned(),
            Publishing::Direct(n) => format!("direct, {n} rounds in flight"),
        }
    }
}

/// A RabbitMQ channel in confirm mode with the durable queue `queue` declared, and its
/// connection, which must outlive it.
async fn confirming_channel(queue: &str) -> Res<(lapin::Connection, lapin::Channel)> {
    let url = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let amqp = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot reach RabbitMQ at {url} (IDEM_AMQP_URL): {e}"))?;
    let channel = amqp.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
    Ok((amqp, channel))
}

/// Runs `relay`'s rounds one after another until it sent `count` messages; an error if a round
/// sends none first.
async fn relay_rounds<DB: idem::Backend, P: Publisher>(
    relay: &Relay<DB, P>,
    count: usize,
) -> Res<()> {
    let mut sent = 0;
    while sent < count {
        let round = relay.relay_once().await?;
        if round.sent == 0 {
            return Err(format!("the relay stopped at {sent} of {count}").into());
        }
        sent += round.sent;
    }
    Ok(())
}

/// `count` messages to `queue` for a direct publish in `round`, each an ordering key of its
/// own, as the relay's rows publish them.
fn direct_messages(queue: &str, round: usize, count: usize) -> Vec<Message> {
    (0..count)
        .map(|n| Message {
            id: format!("direct-{round}-{n}"),
            destination: queue.to_owned(),
            payload: b"{}".to_vec(),
            seq: 0,
            attempts: 0,
            ordering_key: format!("direct-{round}-{n}"),
            headers: idem::outbox::Headers::new().with_content_type("application/json"),
        })
        .collect()
}
