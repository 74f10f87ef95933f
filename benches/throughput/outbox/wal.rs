//! `--outbox --wal [--quick]`: the relay fed by the write-ahead log (`WalRelay`) on a
//! PostgreSQL of the bench's own with `wal_level = logical` (`fsync` and `synchronous_commit`
//! on), against the shared RabbitMQ and JetStream:
//!
//! - the handler's cost: jobs/s of 8 workers sending 0, 1 and 10 messages through the WAL
//!   against no outbox, while a relay streams the slot (to no broker);
//! - the relay against publishing directly: a backlog of messages drained by the relay, and
//!   the same number published by the same publisher in rounds of the relay's batch, each
//!   round's confirms awaited together (RabbitMQ, JetStream), every run once a round, every
//!   other round in reverse order, medians;
//! - commit to confirm: jobs of one message committed at about 1,000 a second, one at a time,
//!   each message's time from its job's commit to its broker's confirm (RabbitMQ);
//! - a backlog of `BACKLOG` messages over 1,000 ordering keys drained to RabbitMQ: messages/s,
//!   each key's messages checked to be published in the order their jobs committed, and the
//!   process's peak resident memory before and after.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::outbox::{PublishError, Publisher, RabbitMq, WalRelay};
use idem::{Claimed, Key, Message, Store};
use idem_scale::standby::Server;
use lapin::options::QueueDeleteOptions;
use sqlx::{AssertSqlSafe, PgPool, Postgres};

use super::{ACCOUNTS, WORKERS, backends, confirming_channel, jetstream, median};
use crate::Res;

/// Ordering keys of the backlog's messages.
const KEYS: u64 = 1_000;
/// Messages a backlog's job sends (one statement of emitted messages).
const PER_JOB: u64 = 100;

/// Counts, times and checks what the broker confirmed: per ordering key, the jobs' numbers in
/// the payloads must come in increasing order.
struct Watch<P> {
    inner: P,
    confirmed: Arc<AtomicU64>,
    out_of_order: Arc<AtomicBool>,
    last: Arc<Mutex<HashMap<String, u64>>>,
    /// Each message's confirm, by id, when timing.
    at: Option<Arc<Mutex<HashMap<String, Instant>>>>,
}

impl<P: Publisher> Watch<P> {
    fn new(inner: P, timed: bool) -> Self {
        Watch {
            inner,
            confirmed: Arc::default(),
            out_of_order: Arc::default(),
            last: Arc::default(),
            at: timed.then(Arc::default),
        }
    }
}

impl<P: Publisher> Publisher for Watch<P> {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        let mut done = Vec::new();
        self.publish_all(std::slice::from_ref(message), &mut done)
            .await;
        done.pop().unwrap_or(Ok(()))
    }

    async fn publish_all<'a>(
        &'a self,
        messages: &'a [Message],
        done: &'a mut Vec<Result<(), PublishError>>,
    ) {
        let start = done.len();
        self.inner.publish_all(messages, done).await;
        let now = Instant::now();
        let mut last = self.last.lock().expect("no panic");
        for (message, answer) in messages.iter().zip(&done[start..]) {
            if answer.is_err() {
                continue;
            }
            self.confirmed.fetch_add(1, Ordering::Relaxed);
            let n: u64 = serde_json::from_slice::<(u64, u64)>(&message.payload).map_or(0, |p| p.1);
            let before = last.insert(message.ordering_key.clone(), n);
            if before.is_some_and(|before| before > n) {
                self.out_of_order.store(true, Ordering::Relaxed);
            }
            if let Some(at) = &self.at {
                at.lock().expect("no panic").insert(message.id.clone(), now);
            }
        }
    }
}

/// `--outbox --wal [--quick]`: the Markdown report.
pub(crate) async fn run(quick: bool) -> Res<String> {
    eprintln!("wal relay: starting a PostgreSQL of its own, wal_level = logical");
    let server = Server::start("wal_level = logical\nmax_wal_size = 4GB\n");
    let url = server.url();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(WORKERS as u32 + 2)
        .connect(&url)
        .await
        .map_err(|e| format!("the bench's own PostgreSQL at {url}: {e}"))?;
    let measured = measure(&server, &pool, &url, quick).await;
    pool.close().await;
    drop(server);
    measured
}

async fn measure(server: &Server, pool: &PgPool, url: &str, quick: bool) -> Res<String> {
    let pid = std::process::id();
    let names = super::Names {
        accounts: format!("idem_bench_walr_accounts_p{pid}"),
        markers: format!("idem_bench_walr_markers_p{pid}"),
        queue: format!("idem.bench.walr.p{pid}"),
    };
    for sql in [
        format!(
            "CREATE TABLE {} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL)",
            names.accounts
        ),
        format!(
            "INSERT INTO {} SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g",
            names.accounts
        ),
    ] {
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await?;
    }
    let store = Store::new(pool.clone())
        .with_table(&names.markers)?
        .outbox_through_wal();
    store.migrate().await?;
    let (rounds, run, relayed, backlog, timed) = match quick {
        true => (1, Duration::from_millis(500), 2_000, 20_000, 300),
        false => (5, Duration::from_secs(3), 50_000, 500_000, 5_000),
    };
    let (amqp, channel) = confirming_channel(&names.queue).await?;
    let rabbit = RabbitMq::new(channel.clone());
    let js = jetstream::Js::connect(&format!("walr-{pid}")).await?;
    let relay = |publisher| WalRelay::new(store.clone(), url, publisher);
    relay(Watch::new(super::Nowhere, false))?.setup().await?;
    let ctx = Ctx {
        store: &store,
        url,
        next: Arc::new(AtomicU64::new(1)),
    };
    let mut out = String::new();
    let next = ctx.next.clone();

    eprintln!("wal relay: the handler with 0, 1 and 10 messages through the WAL");
    let handler = {
        let streaming = relay(Watch::new(super::Nowhere, false))?;
        let stop = Arc::new(tokio::sync::Notify::new());
        let stopped = stop.clone();
        let background = async move { streaming.run(stopped.notified()).await };
        let background = tokio::spawn(background);
        let mut rates: [Vec<f64>; 3] = Default::default();
        let variants = [None, Some(1), Some(10)];
        for round in 0..rounds {
            let mut order = [0, 1, 2];
            if round % 2 == 1 {
                order.reverse();
            }
            for v in order {
                rates[v].push(jobs(&store, &names.accounts, &next, variants[v], run).await?);
            }
        }
        // Stopped once it confirmed everything: the next runs read only their own messages.
        let lagging = relay(Watch::new(super::Nowhere, false))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while lagging
            .lag()
            .await?
            .is_some_and(|lag| lag.unconfirmed_bytes > 0)
        {
            if Instant::now() > deadline {
                return Err("the handler runs' relay did not catch up in 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.notify_one();
        background.await??;
        rates.map(median)
    };
    out.push_str(&format!(
        "## The WAL relay: the handler's cost (PostgreSQL of its own, {WORKERS} workers, the \
         relay streaming)\n\n| handler | jobs/s | vs no outbox |\n|---|---|---|\n"
    ));
    for (name, rate) in [
        "no outbox",
        "1 message through the WAL",
        "10 messages through the WAL",
    ]
    .iter()
    .zip(handler)
    {
        out.push_str(&format!(
            "| {name} | {rate:.0} | {:.2} |\n",
            rate / handler[0]
        ));
    }

    eprintln!("wal relay: {relayed} messages relayed against published directly");
    let mut rates: [Vec<f64>; 4] = Default::default();
    for round in 0..rounds.min(3) {
        let mut order = [0, 1, 2, 3];
        if round % 2 == 1 {
            order.reverse();
        }
        for v in order {
            let rate = match v {
                0 => direct(&Watch::new(rabbit.clone(), false), &names.queue, relayed).await?,
                1 => ctx.drained(&rabbit, &names.queue, relayed).await?.0,
                2 => {
                    direct(
                        &Watch::new(js.publisher.clone(), false),
                        &js.subject,
                        relayed,
                    )
                    .await?
                }
                _ => ctx.drained(&js.publisher, &js.subject, relayed).await?.0,
            };
            match v {
                0 | 1 => backends::purge(&channel, &names.queue, relayed as usize).await?,
                _ => js.purge().await?,
            }
            rates[v].push(rate);
        }
    }
    let rates = rates.map(median);
    out.push_str(&format!(
        "\n## The WAL relay against publishing directly ({relayed} messages; directly: rounds \
         of 500, each round's confirms awaited together)\n\n| broker | directly: messages/s \
         | WAL relay: messages/s | relay vs direct |\n|---|---|---|---|\n"
    ));
    for (broker, (d, r)) in [
        ("RabbitMQ", (rates[0], rates[1])),
        ("JetStream", (rates[2], rates[3])),
    ] {
        out.push_str(&format!("| {broker} | {d:.0} | {r:.0} | {:.2} |\n", r / d));
    }

    eprintln!("wal relay: commit to confirm, {timed} jobs at about 1,000 a second");
    let (p50, p99) = ctx.latency(&rabbit, &names.queue, timed).await?;
    backends::purge(&channel, &names.queue, timed as usize).await?;
    out.push_str(&format!(
        "\n## The WAL relay: from a job's commit to its message's confirm (RabbitMQ, {timed} \
         jobs of one message, about 1,000 a second)\n\n| p50 | p99 |\n|---|---|\n| {:.2} ms | \
         {:.2} ms |\n",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3
    ));

    eprintln!("wal relay: a backlog of {backlog} messages over {KEYS} keys to RabbitMQ");
    // A second slot of the same publication, made before the backlog: PostgreSQL's own client
    // decodes the same WAL through it afterwards, the floor of any relay on this server.
    let floor_slot = format!("{}_floor", names.markers);
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')::text")
        .bind(&floor_slot)
        .execute(pool)
        .await?;
    let before = peak_rss_kib();
    let (rate, ordered) = ctx.drained(&rabbit, &names.queue, backlog).await?;
    let after = peak_rss_kib();
    backends::purge(&channel, &names.queue, backlog as usize).await?;
    // A record after the backlog for pg_recvlogical to stop at: a message of no transaction,
    // sent at once (an idle server's next keepalive could be half a minute away).
    let end: String =
        sqlx::query_scalar("SELECT pg_logical_emit_message(false, 'floor', 'end')::text")
            .fetch_one(pool)
            .await?;
    let publication = format!("{}_relay", names.markers);
    let decoded = recvlogical(server, &floor_slot, &publication, &end).await?;
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&floor_slot)
        .execute(pool)
        .await?;
    let floor = backlog as f64 / decoded.as_secs_f64();
    out.push_str(&format!(
        "\n## The WAL relay: a backlog of {backlog} messages drained to RabbitMQ ({KEYS} \
         ordering keys; the floor: pg_recvlogical decoding the same WAL from a second slot to \
         /dev/null)\n\n| messages/s | pg_recvlogical: messages/s | relay vs it | each key in \
         commit order | peak RSS before | peak RSS after |\n|---|---|---|---|---|---|\n| \
         {rate:.0} | {floor:.0} | {:.2} | {} | {} MiB | {} MiB |\n",
        rate / floor,
        if ordered { "yes" } else { "NO" },
        before / 1024,
        after / 1024
    ));
    if !ordered {
        return Err(format!("{out}\na key's messages were published out of order").into());
    }
    relay(Watch::new(super::Nowhere, false))?
        .drop_slot()
        .await?;
    js.delete().await;
    channel
        .queue_delete(names.queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    amqp.close(200, "done".into()).await?;
    Ok(out)
}

/// Jobs/s of `WORKERS` workers for `run`, each job sending `messages` (none: no outbox).
async fn jobs(
    store: &Store<Postgres>,
    accounts: &str,
    next: &Arc<AtomicU64>,
    messages: Option<usize>,
    run: Duration,
) -> Res<f64> {
    let started = Instant::now();
    let tasks = super::workers(store, accounts, next, messages, started, run);
    let mut done = 0;
    for task in tasks {
        done += task.await??;
    }
    Ok(done as f64 / started.elapsed().as_secs_f64())
}

/// What the relay's runs share.
struct Ctx<'a> {
    store: &'a Store<Postgres>,
    url: &'a str,
    next: Arc<AtomicU64>,
}

impl Ctx<'_> {
    /// Commits `count` messages to `destination` (jobs of [`PER_JOB`], each message's ordering
    /// key one of [`KEYS`], its payload the key and the message's number), then lets a relay
    /// to `publisher` drain them: messages/s from its start to its last confirm, and whether
    /// each key's were published in order.
    async fn drained<P: Publisher + Clone>(
        &self,
        publisher: &P,
        destination: &str,
        count: u64,
    ) -> Res<(f64, bool)> {
        let jobs = count.div_ceil(PER_JOB);
        let first = self.next.fetch_add(jobs, Ordering::Relaxed);
        for job in 0..jobs {
            let key = Key::new(&format!("backlog-{}", first + job))?;
            let Claimed::Fresh(mut guard) = self.store.claim("bench.wal", &key).await? else {
                return Err(format!("the backlog's job {key:?} was not fresh").into());
            };
            for m in 0..PER_JOB.min(count - job * PER_JOB) {
                let n = (first + job) * PER_JOB + m;
                // Keys of this run's own: a message of an earlier run published again (its
                // relay stopped before the slot heard its last confirm) holds back none.
                let ordering = format!("r{first}-k{}", n % KEYS);
                guard
                    .outbox()
                    .send_keyed(&ordering, destination, &(n % KEYS, n))?;
            }
            let _ = guard.finish::<(), idem::Error>(Ok(())).await?;
        }
        let watch = Watch::new(publisher.clone(), false);
        let (confirmed, out_of_order) = (watch.confirmed.clone(), watch.out_of_order.clone());
        let relay = WalRelay::new(self.store.clone(), self.url, watch)?.batch(500);
        let started = Instant::now();
        let done = async {
            while confirmed.load(Ordering::Relaxed) < count {
                tokio::time::sleep(Duration::from_micros(500)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(600), relay.run(done))
            .await
            .map_err(|_| "the WAL relay did not drain its backlog in 600 s")??;
        let rate = count as f64 / started.elapsed().as_secs_f64();
        Ok((rate, !out_of_order.load(Ordering::Relaxed)))
    }

    /// p50 and p99 of the time from a job's commit to its message's confirm, `count` jobs of
    /// one message committed one at a time about a millisecond apart while a relay streams.
    async fn latency<P: Publisher + Clone + 'static>(
        &self,
        publisher: &P,
        destination: &str,
        count: u64,
    ) -> Res<(Duration, Duration)> {
        let watch = Watch::new(publisher.clone(), true);
        let (confirmed, at) = (watch.confirmed.clone(), watch.at.clone().expect("timed"));
        let relay = WalRelay::new(self.store.clone(), self.url, watch)?.batch(500);
        let stop = Arc::new(tokio::sync::Notify::new());
        let stopped = stop.clone();
        let streaming = async move { relay.run(stopped.notified()).await };
        let streaming = tokio::spawn(streaming);
        let first = self.next.fetch_add(count, Ordering::Relaxed);
        let mut committed = Vec::with_capacity(count as usize);
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        for job in first..first + count {
            tick.tick().await;
            let key = Key::new(&format!("timed-{job}"))?;
            let Claimed::Fresh(mut guard) = self.store.claim("bench.wal", &key).await? else {
                return Err(format!("the timed job {key:?} was not fresh").into());
            };
            let id = guard
                .outbox()
                .send_keyed(
                    &format!("t{first}-k{}", job % KEYS),
                    destination,
                    &(job % KEYS, job),
                )?
                .to_owned();
            let _ = guard.finish::<(), idem::Error>(Ok(())).await?;
            committed.push((id, Instant::now()));
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while confirmed.load(Ordering::Relaxed) < count {
            if Instant::now() > deadline {
                return Err("the WAL relay did not confirm the timed jobs in 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        stop.notify_one();
        streaming.await??;
        let at = at.lock().expect("no panic");
        let mut waits: Vec<Duration> = committed
            .iter()
            .map(|(id, commit)| {
                at.get(id)
                    .map_or(Duration::MAX, |c| c.saturating_duration_since(*commit))
            })
            .collect();
        waits.sort();
        let pick = |q: f64| waits[((waits.len() as f64 * q) as usize).min(waits.len() - 1)];
        Ok((pick(0.5), pick(0.99)))
    }
}

/// Messages/s of publishing `count` messages to `destination` through `publisher` directly,
/// in rounds of 500 (the relay's batch), each round's confirms awaited together.
async fn direct<P: Publisher>(publisher: &P, destination: &str, count: u64) -> Res<f64> {
    let messages: Vec<Message> = (0..count)
        .map(|n| Message {
            id: format!("direct-{n}"),
            destination: destination.to_owned(),
            payload: serde_json::to_vec(&(n % KEYS, n)).expect("numbers are JSON"),
            seq: 0,
            attempts: 0,
            ordering_key: format!("k{}", n % KEYS),
            headers: idem::outbox::Headers::new().with_content_type("application/json"),
        })
        .collect();
    let started = Instant::now();
    for round in messages.chunks(500) {
        let mut done = Vec::with_capacity(round.len());
        publisher.publish_all(round, &mut done).await;
        if let Some(Err(e)) = done.into_iter().find(Result::is_err) {
            return Err(e.to_string().into());
        }
    }
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// How long `pg_recvlogical` takes to decode `slot` (of `publication`, with the logical
/// decoding messages) up to `end`, writing nothing.
async fn recvlogical(server: &Server, slot: &str, publication: &str, end: &str) -> Res<Duration> {
    let program = server.bin().join("pg_recvlogical");
    let conninfo = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        server.port
    );
    let started = Instant::now();
    let status = tokio::process::Command::new(&program)
        .args(["-d", &conninfo, "--slot", slot, "--start", "--no-loop"])
        .args(["--endpos", end])
        .args(["-o", "proto_version=1"])
        .args(["-o", &format!("publication_names={publication}")])
        .args(["-o", "messages=true"])
        .args(["-f", "/dev/null"])
        .stdin(std::process::Stdio::null())
        .status()
        .await
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    if !status.success() {
        return Err(format!("pg_recvlogical ended with {status}").into());
    }
    Ok(started.elapsed())
}

/// The process's peak resident memory so far (`VmHWM`), in KiB.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmHWM:"))
                .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}
