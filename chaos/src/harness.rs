//! The run: the owned servers, the proxies, the payments API, the workers, the producer and
//! the fault schedule; then the drain and the checker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::{MySqlPool, PgPool};
use tokio::task::JoinSet;

use crate::faults::{self, Target};
use crate::fleet::Fleet;
use crate::jobs::{Broker, EFFECTS, Job};
use crate::payments::Payments;
use crate::proxy::Proxy;
use crate::servers::{My, Nats, Pg, Rabbit, Res, until};
use crate::worker::Config;

pub const QUEUE: &str = "chaos-jobs";
pub const STREAM: &str = "CHAOS";
pub const SUBJECT: &str = "chaos.jobs";
pub const CONSUMER: &str = "workers";
/// Messages a producer publishes back to back.
const BURST: usize = 8;

pub struct Args {
    pub seed: u64,
    pub duration: Duration,
    pub workers: usize,
    /// Jobs published per second of the run (each twice).
    pub rate: u64,
    /// How long the drain may take once the schedule is over.
    pub drain: Duration,
    pub keep: bool,
}

/// What the faults and the checker reach.
pub struct Env {
    pub started: Instant,
    pub pg: Pg,
    pub my: My,
    pub rabbit: Rabbit,
    pub nats: Nats,
    pub pg_admin: PgPool,
    pub my_admin: MySqlPool,
    pub proxies: [Proxy; 3],
    pub fleet: Fleet,
    pub payments: Payments,
    pub js: jetstream::Context,
}

impl Env {
    pub fn log(&self, line: std::fmt::Arguments<'_>) {
        println!("[{:>7.1}s] {line}", self.started.elapsed().as_secs_f64());
    }

    pub fn proxy(&self, target: Target) -> &Proxy {
        &self.proxies[target as usize]
    }

    /// The index of the node leading the stream.
    pub async fn stream_leader(&self) -> Res<usize> {
        let stream = self
            .js
            .get_stream(STREAM)
            .await
            .map_err(|e| e.to_string())?;
        let name = stream
            .cached_info()
            .cluster
            .as_ref()
            .and_then(|c| c.leader.clone())
            .ok_or("the stream has no leader now")?;
        self.nats
            .index_of(&name)
            .ok_or_else(|| format!("unknown leader {name}"))
    }
}

/// Runs the soak; `Ok` holds the violations the checker found (none: passed).
pub async fn run(args: Args) -> Res<Vec<String>> {
    let started = Instant::now();
    let root = std::env::temp_dir().join(format!("idem-chaos-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&root));
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    println!(
        "chaos soak: seed {} (replay with --seed {}), {:?}, {} workers, {} jobs/s published twice; servers in {}",
        args.seed,
        args.seed,
        args.duration,
        args.workers,
        args.rate,
        root.display()
    );
    let (pg, my, rabbit, nats) = tokio::try_join!(
        Pg::create(&root),
        My::create(&root),
        Rabbit::create(&root),
        Nats::create(&root)
    )?;
    println!(
        "[{:>7.1}s] owned servers up: PostgreSQL :{}, MariaDB :{}, RabbitMQ :{}, JetStream {:?}",
        started.elapsed().as_secs_f64(),
        pg.port,
        my.port,
        rabbit.port,
        nats.urls()
    );
    let (pg_admin, my_admin) = prepare_databases(&pg, &my).await?;
    let js = prepare_brokers(&rabbit, &nats).await?;
    let proxies = [
        Proxy::start(format!("127.0.0.1:{}", pg.port))
            .await
            .map_err(|e| e.to_string())?,
        Proxy::start(format!("127.0.0.1:{}", my.port))
            .await
            .map_err(|e| e.to_string())?,
        Proxy::start(format!("127.0.0.1:{}", rabbit.port))
            .await
            .map_err(|e| e.to_string())?,
    ];
    let payments = Payments::start().await.map_err(|e| e.to_string())?;
    let configs = (0..args.workers)
        .map(|index| Config {
            index,
            pg_url: format!(
                "postgres://postgres@{}/postgres?application_name=idem-chaos-worker",
                proxies[0].addr
            ),
            my_url: format!("mysql://chaos@{}/chaos", proxies[1].addr),
            // Heartbeats every 5 s: a connection left half-open is noticed.
            amqp_url: format!("amqp://guest:guest@{}/%2f?heartbeat=5", proxies[2].addr),
            nats_urls: nats.urls(),
            queue: QUEUE.into(),
            stream: STREAM.into(),
            consumer: CONSUMER.into(),
            payments_url: payments.url.clone(),
        })
        .collect();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let env = Arc::new(Env {
        started,
        pg,
        my,
        rabbit,
        nats,
        pg_admin,
        my_admin,
        proxies,
        fleet: Fleet::new(exe, root.clone(), configs),
        payments,
        js,
    });
    let result = soak(&env, &args).await;
    env.fleet.kill_all().await;
    stop_servers(&env).await;
    match &result {
        Ok(v) if v.is_empty() && !args.keep => drop(std::fs::remove_dir_all(&root)),
        _ => println!("logs kept in {}", root.display()),
    }
    result
}

async fn soak(env: &Arc<Env>, args: &Args) -> Res<Vec<String>> {
    for i in 0..env.fleet.len() {
        env.fleet.spawn(i).await?;
    }
    let total = (args.rate * args.duration.as_secs()).max(8);
    let jobs: Vec<Job> = (0..total).map(Job::new).collect();
    let schedule = faults::schedule(args.seed, args.duration, args.workers);
    env.log(format_args!(
        "{} jobs, {} faults scheduled",
        jobs.len(),
        schedule.len()
    ));
    let start = tokio::time::Instant::now();
    let mut repairs = JoinSet::new();
    // One producer per broker, so that a broker being down holds up only its own jobs.
    let split = |b: Broker| jobs.iter().filter(|j| j.broker() == b).cloned().collect();
    let producers = [
        tokio::spawn(produce(env.clone(), split(Broker::Rabbit), args.duration)),
        tokio::spawn(produce(env.clone(), split(Broker::Nats), args.duration)),
    ];
    let progress = tokio::spawn(progress(env.clone()));
    let ran = faults::run(env.clone(), schedule, start, &mut repairs).await;
    let mut published = 0;
    for producer in producers {
        published += producer.await.map_err(|e| e.to_string())??;
    }
    while repairs.join_next().await.is_some() {}
    env.log(format_args!(
        "schedule over, {published} messages published; every worker and server back: draining"
    ));
    for i in 0..env.fleet.len() {
        env.fleet.pause(i, false).await;
        env.fleet.spawn(i).await?;
    }
    let drained_in = drain(env, &jobs, args.drain).await;
    progress.abort();
    env.fleet.kill_all().await;
    let acked = crate::check::all_acked(env).await;
    let report = crate::check::check(env, &jobs, &ran, published, true).await?;
    let mut violations = report.violations;
    if let Err(e) = drained_in {
        violations.push(e);
    }
    if let Err(e) = acked {
        violations.push(e);
    }
    if violations.is_empty() {
        violations = crate::check::self_check(env, &jobs, &ran, published).await?;
    }
    Ok(violations)
}

/// A line every 5 s with what the workers reported so far.
async fn progress(env: Arc<Env>) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let line = {
            let t = env.fleet.tally.lock().unwrap_or_else(|e| e.into_inner());
            format!(
                "progress: {} applied, {} duplicates, {} nacks, {} deliveries",
                t.applied_at.len(),
                t.duplicates,
                t.nacks.values().sum::<u64>(),
                t.deliveries
            )
        };
        env.log(format_args!("{line}"));
    }
}

async fn stop_servers(env: &Env) {
    drop(env.pg.stop_immediate().await);
    env.my.kill().await;
    env.rabbit.kill().await;
    for i in 0..3 {
        env.nats.kill(i).await;
    }
}

pub(crate) async fn prepare_databases(pg: &Pg, my: &My) -> Res<(PgPool, MySqlPool)> {
    let pg_admin = PgPoolOptions::new()
        .max_connections(4)
        .connect(&pg.url())
        .await
        .map_err(|e| format!("the owned PostgreSQL at {}: {e}", pg.url()))?;
    // `began`: the start of the transaction that wrote the row (`now()`), shared by every job
    // of one group's transaction, so that the checker can count the groups that held several.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {EFFECTS} (job text NOT NULL, via text NOT NULL, \
         began timestamptz NOT NULL DEFAULT now())"
    )))
    .execute(&pg_admin)
    .await
    .map_err(|e| e.to_string())?;
    idem::Store::new(pg_admin.clone())
        .migrate()
        .await
        .map_err(|e| e.to_string())?;
    let root = format!("mysql://root@127.0.0.1:{}/mysql", my.port);
    let boot = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&root)
        .await
        .map_err(|e| format!("the owned MariaDB at {root}: {e}"))?;
    for sql in [
        "CREATE DATABASE chaos",
        "CREATE USER 'chaos'@'%'",
        "GRANT ALL ON chaos.* TO 'chaos'@'%'",
    ] {
        sqlx::query(sql)
            .execute(&boot)
            .await
            .map_err(|e| format!("{sql}: {e}"))?;
    }
    boot.close().await;
    let my_admin = MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&my.url("root"))
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {EFFECTS} (job VARCHAR(64) NOT NULL, via VARCHAR(16) NOT NULL) ENGINE=InnoDB"
    )))
    .execute(&my_admin)
    .await
    .map_err(|e| e.to_string())?;
    idem::Store::new(my_admin.clone())
        .migrate()
        .await
        .map_err(|e| e.to_string())?;
    Ok((pg_admin, my_admin))
}

async fn prepare_brokers(rabbit: &Rabbit, nats: &Nats) -> Res<jetstream::Context> {
    let conn = Connection::connect(&rabbit.url(), ConnectionProperties::default())
        .await
        .map_err(|e| e.to_string())?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.queue_declare(
        QUEUE.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    drop(conn.close(200, "ready".into()).await);
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(nats.urls())
        .await
        .map_err(|e| e.to_string())?;
    let js = jetstream::new(client);
    // The cluster elects its meta leader a moment after the nodes are up.
    let config = stream::Config {
        name: STREAM.into(),
        subjects: vec![SUBJECT.into()],
        num_replicas: 3,
        storage: stream::StorageType::File,
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match js.get_or_create_stream(config.clone()).await {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!(
                    "no R3 stream on the JetStream cluster within 60 s: {e}"
                ));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(CONSUMER.into()),
            ack_policy: consumer::AckPolicy::Explicit,
            // A stopped worker's messages come back after this long.
            ack_wait: Duration::from_secs(6),
            max_ack_pending: 1000,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    Ok(js)
}

/// Publishes every job twice, spread over `span`: each job once, and its second copy a
/// moment later with the next ones. A publish is retried until its broker confirmed it, so a
/// lost confirm can make a third copy.
async fn produce(env: Arc<Env>, jobs: Vec<Job>, span: Duration) -> Res<u64> {
    let mut order: Vec<&Job> = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        order.push(job);
        if i >= 5 {
            order.push(&jobs[i - 5]);
        }
    }
    order.extend(jobs.iter().skip(jobs.len().saturating_sub(5)));
    let pace = span / u32::try_from(order.len()).unwrap_or(u32::MAX);
    let start = tokio::time::Instant::now();
    let mut rabbit: Option<(Connection, Channel)> = None;
    let mut published = 0;
    for (i, job) in order.into_iter().enumerate() {
        // Published in bursts, at the same pace on average: a burst reaches the workers as
        // several deliveries at once, which meet in their groups and batches.
        let at = u32::try_from(i - i % BURST).unwrap_or(u32::MAX);
        tokio::time::sleep_until(start + pace * at).await;
        let payload = serde_json::to_vec(job).expect("a job serialises");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let sent = match job.broker() {
                Broker::Rabbit => publish_rabbit(&env, &mut rabbit, &payload).await,
                Broker::Nats => publish_nats(&env.js, &payload).await,
            };
            match sent {
                Ok(()) => break,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("the producer could not publish {}: {e}", job.id));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        published += 1;
    }
    Ok(published)
}

/// One attempt to publish, bounded: a connection that a fault left half-open never answers
/// (no confirm, no error), and an unbounded attempt would hold the producer, and the run,
/// for good. Timed out, the connection is dropped and the caller tries again.
async fn publish_rabbit(
    env: &Env,
    rabbit: &mut Option<(Connection, Channel)>,
    payload: &[u8],
) -> Res<()> {
    let attempt = tokio::time::timeout(
        Duration::from_secs(5),
        publish_rabbit_once(env, rabbit, payload),
    )
    .await;
    attempt.unwrap_or_else(|_| {
        *rabbit = None;
        Err("no publisher confirm within 5 s".to_owned())
    })
}

async fn publish_rabbit_once(
    env: &Env,
    rabbit: &mut Option<(Connection, Channel)>,
    payload: &[u8],
) -> Res<()> {
    if rabbit.as_ref().is_none_or(|(c, _)| !c.status().connected()) {
        let conn = Connection::connect(&env.rabbit.url(), ConnectionProperties::default())
            .await
            .map_err(|e| e.to_string())?;
        let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        *rabbit = Some((conn, ch));
    }
    let (_, ch) = rabbit.as_ref().expect("connected");
    let result = async {
        let confirm = ch
            .basic_publish(
                "".into(),
                QUEUE.into(),
                BasicPublishOptions::default(),
                payload,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?
            .await?;
        Ok::<bool, lapin::Error>(confirm.is_ack())
    }
    .await;
    match result {
        Ok(true) => Ok(()),
        Ok(false) => Err("nacked by the broker".into()),
        Err(e) => {
            *rabbit = None;
            Err(e.to_string())
        }
    }
}

async fn publish_nats(js: &jetstream::Context, payload: &[u8]) -> Res<()> {
    let ack = js
        .publish(SUBJECT, payload.to_vec().into())
        .await
        .map_err(|e| e.to_string())?;
    tokio::time::timeout(Duration::from_secs(5), ack)
        .await
        .map_err(|_| "no publish ack within 5 s".to_owned())?
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Polls until every job's marker is completed, the queue is empty, the consumer has nothing
/// pending and the workers are quiet, or `limit` passed.
async fn drain(env: &Env, jobs: &[Job], limit: Duration) -> Res<()> {
    let started = Instant::now();
    // Quiet: nothing under way at any worker, and no delivery since the last look (a message
    // the broker has just pushed is unacked before its worker tells of it).
    let last = std::sync::atomic::AtomicU64::new(u64::MAX);
    let result = until(limit, "the drain", || async {
        let deliveries = env
            .fleet
            .tally
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .deliveries;
        let quiet = last.swap(deliveries, std::sync::atomic::Ordering::SeqCst) == deliveries
            && env.fleet.in_flight().await == 0;
        quiet && crate::check::drained(env, jobs).await.unwrap_or(false)
    })
    .await;
    env.log(format_args!(
        "drain {} after {:.1}s",
        if result.is_ok() { "done" } else { "NOT done" },
        started.elapsed().as_secs_f64()
    ));
    result
}
