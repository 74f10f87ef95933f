//! `--outbox`'s rows on the three databases, after the PostgreSQL-only rows, on a store, a
//! queue and a RabbitMQ connection of their own:
//!
//! - **The relay by database.** `Relay::relay_once` until `count` committed messages are sent,
//!   from PostgreSQL, MariaDB and SQLite at each of `BATCHES`, against the same publisher
//!   publishing them directly in rounds of 100 (the relay rows of `outbox.rs`, with the other
//!   two databases beside PostgreSQL). All of them run in each round, every other round in
//!   reverse order: each ratio is against the direct rate of the same rounds.
//! - **The latency at a steady rate** (`latency.rs`): jobs of one message each committed at
//!   `latency::RATE` a second while a relay runs as it runs in production, each message timed
//!   from its job's `Applied` to the relay's publisher having its confirm.

use std::time::Instant;

use idem::outbox::{Publisher as _, RabbitMq, Relay};
use idem::{Backend, Store};
use lapin::options::{QueueDeleteOptions, QueuePurgeOptions};
use sqlx::{AssertSqlSafe, MySql, Postgres, Sqlite};

use super::latency::{self, Latency};
use super::{BATCHES, WORKERS, median};
use crate::Res;
use crate::config::config;

/// One database's store, on this run's table.
pub(super) enum Db {
    Pg(Store<Postgres>),
    My(Store<MySql>),
    Lite(Store<Sqlite>),
}

impl Db {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Db::Pg(_) => "PostgreSQL",
            Db::My(_) => "MariaDB",
            Db::Lite(_) => "SQLite",
        }
    }

    async fn execute(&self, sql: String) -> Res<()> {
        let sql = AssertSqlSafe(sql);
        match self {
            Db::Pg(s) => {
                sqlx::raw_sql(sql).execute(s.pool()).await?;
            }
            Db::My(s) => {
                sqlx::raw_sql(sql).execute(s.pool()).await?;
            }
            Db::Lite(s) => {
                sqlx::raw_sql(sql).execute(s.pool()).await?;
            }
        }
        Ok(())
    }

    /// `count` committed messages to `queue`, as handlers leave them: each its job's one
    /// message, the job's key its ordering key. One statement of literal rows on every
    /// database (the ids are the bench's own).
    async fn fill(&self, table: &str, queue: &str, count: usize, round: usize) -> Res<()> {
        let rows: Vec<String> = (0..count)
            .map(|n| {
                let id = format!("'r{round}-{n}'");
                match self {
                    // MariaDB's timestamps have no default: the runtime writes the server's.
                    Db::My(_) => format!(
                        "({id}, '{queue}', '{{}}', 'bench.outbox', {id}, 0, {id}, \
                         UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
                    ),
                    Db::Pg(_) => {
                        format!("({id}, '{queue}', '{{}}', 'bench.outbox', {id}, 0, {id})")
                    }
                    // A blob literal: a text literal would be stored as text.
                    Db::Lite(_) => {
                        format!("({id}, '{queue}', X'7B7D', 'bench.outbox', {id}, 0, {id})")
                    }
                }
            })
            .collect();
        let (key, stamps) = match self {
            Db::My(_) => ("`key`", ", created_at, next_attempt_at"),
            _ => ("key", ""),
        };
        self.execute(format!(
            "INSERT INTO {table}_outbox (id, destination, payload, scope, {key}, seq, \
             ordering_key{stamps}) VALUES {}",
            rows.join(", ")
        ))
        .await
    }

    async fn clear(&self, table: &str) -> Res<()> {
        self.execute(format!("DELETE FROM {table}_outbox")).await
    }

    /// Relays `count` messages at `batch` a round; returns messages/s.
    async fn relay(&self, publisher: &RabbitMq, batch: u32, count: usize) -> Res<f64> {
        match self {
            Db::Pg(s) => relay_all(s, publisher, batch, count).await,
            Db::My(s) => relay_all(s, publisher, batch, count).await,
            Db::Lite(s) => relay_all(s, publisher, batch, count).await,
        }
    }

    pub(super) async fn latency(
        &self,
        publisher: &RabbitMq,
        queue: &str,
        first_id: u64,
        quick: bool,
    ) -> Res<Latency> {
        let publisher = publisher.clone();
        match self {
            Db::Pg(s) => latency::measure(s, s.clone(), publisher, queue, first_id, quick).await,
            Db::My(s) => latency::measure(s, s.clone(), publisher, queue, first_id, quick).await,
            Db::Lite(s) => latency::measure(s, s.clone(), publisher, queue, first_id, quick).await,
        }
    }

    /// Drops the run's tables and closes the pool.
    async fn close(&self, table: &str) {
        self.drop_tables(table).await;
        match self {
            Db::Pg(s) => s.pool().close().await,
            Db::My(s) => s.pool().close().await,
            Db::Lite(s) => s.pool().close().await,
        }
    }

    /// Every table `migrate` makes, one statement each (SQLite drops one a statement).
    /// Best effort: a table left behind carries this process's id and harms no other run.
    async fn drop_tables(&self, table: &str) {
        for t in ["", "_outbox", "_retention", "_steps", "_offsets"] {
            let _ = self
                .execute(format!("DROP TABLE IF EXISTS {table}{t}"))
                .await;
        }
    }
}

async fn relay_all<DB: Backend>(
    store: &Store<DB>,
    publisher: &RabbitMq,
    batch: u32,
    count: usize,
) -> Res<f64> {
    let relay = Relay::new(store.clone(), publisher.clone()).batch(batch);
    let started = Instant::now();
    super::relay_rounds(&relay, count).await?;
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// Publishes `count` messages directly, in rounds of 100 whose confirms are awaited together,
/// as the relay's; returns messages/s.
async fn direct(publisher: &RabbitMq, queue: &str, count: usize, round: usize) -> Res<f64> {
    let messages = super::direct_messages(queue, round, count);
    let started = Instant::now();
    for round in messages.chunks(100) {
        let mut done = Vec::with_capacity(round.len());
        publisher.publish_all(round, &mut done).await;
        if let Some(Err(e)) = done.into_iter().find(Result::is_err) {
            return Err(e);
        }
    }
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// Empties `queue`, checking that it held `count` messages.
pub(super) async fn purge(channel: &lapin::Channel, queue: &str, count: usize) -> Res<()> {
    let purged = channel
        .queue_purge(queue.into(), QueuePurgeOptions::default())
        .await?;
    if purged as usize != count {
        return Err(format!("{purged} messages in the queue after publishing {count}").into());
    }
    Ok(())
}

/// The three stores, migrated, on `table`; SQLite's file in `dir`.
async fn connect(table: &str, dir: &std::path::Path) -> Res<Vec<Db>> {
    let cfg = config();
    let n = WORKERS as u32 + 1;
    let pg = sqlx::postgres::PgPoolOptions::new()
        .max_connections(n)
        .test_before_acquire(false)
        .connect(&cfg.pg_url)
        .await?;
    let my = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(n)
        .test_before_acquire(false)
        .connect(&cfg.my_url)
        .await
        .map_err(|e| {
            format!(
                "cannot reach MariaDB at {} (IDEM_MYSQL_URL): {e}",
                cfg.my_url
            )
        })?;
    let lite = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(n)
        .test_before_acquire(false)
        .connect_with(crate::measure::sqlite_options(&dir.join("outbox.db")))
        .await?;
    let dbs = vec![
        Db::Pg(Store::new(pg).with_table(table)?),
        Db::My(Store::new(my).with_table(table)?),
        Db::Lite(Store::new(lite).with_table(table)?),
    ];
    for db in &dbs {
        // A table left by an earlier run that died with this process's id.
        db.drop_tables(table).await;
        match db {
            Db::Pg(s) => s.migrate().await?,
            Db::My(s) => s.migrate().await?,
            Db::Lite(s) => s.migrate().await?,
        }
    }
    Ok(dbs)
}

/// `--outbox`'s rows on the three databases: the report on stdout.
pub(super) async fn run(quick: bool) -> Res<()> {
    let (rounds, count) = if quick { (3, 300) } else { (3, 1_000) };
    let pid = std::process::id();
    let table = format!("idem_bench_ob_relay_p{pid}");
    let queue = format!("idem.bench.outbox.rows.p{pid}");
    let dir = std::env::temp_dir().join(format!("idem-bench-outbox-{pid}"));
    std::fs::create_dir_all(&dir)?;
    let (amqp, channel) = super::confirming_channel(&queue).await?;
    let publisher = RabbitMq::new(channel.clone());
    let dbs = connect(&table, &dir).await?;
    let measured = measure(
        &dbs, &publisher, &channel, &table, &queue, rounds, count, quick,
    )
    .await;
    for db in &dbs {
        db.close(&table).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    amqp.close(200, "done".into()).await?;
    let (relayed, direct, latencies) = measured?;
    // Only ratios within one run mean anything on a shared machine: say how busy it was.
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        let load: Vec<&str> = load.split_whitespace().take(3).collect();
        println!(
            "\n(load average after the rows on three databases: {})",
            load.join(" ")
        );
    }

    println!(
        "\n## Outbox: messages/s to RabbitMQ relayed from each database, by batch size, \
         against publishing directly ({count} messages, {rounds} rounds, medians; directly: \
         rounds of 100, each round's confirms awaited together, as the relay's)\n"
    );
    println!("| publisher | messages/s | vs direct |");
    println!("|---|---|---|");
    for (db, rates) in dbs.iter().zip(&relayed) {
        for (batch, rate) in BATCHES.iter().zip(rates) {
            println!(
                "| relay from {}, batch {batch} | {rate:.0} | {:.2} |",
                db.name(),
                rate / direct
            );
        }
    }
    println!("| direct | {direct:.0} | 1.00 |");
    latency::report(&latencies);
    Ok(())
}

type Measured = (Vec<Vec<f64>>, f64, Vec<(&'static str, Latency)>);

#[allow(clippy::too_many_arguments)] // One run's settings, read once.
async fn measure(
    dbs: &[Db],
    publisher: &RabbitMq,
    channel: &lapin::Channel,
    table: &str,
    queue: &str,
    rounds: usize,
    count: usize,
    quick: bool,
) -> Res<Measured> {
    eprintln!("outbox: relaying from PostgreSQL, MariaDB and SQLite, and publishing directly");
    // (database, batch), or publishing directly.
    let variants: Vec<Option<(usize, u32)>> = (0..dbs.len())
        .flat_map(|db| BATCHES.iter().map(move |&batch| Some((db, batch))))
        .chain([None])
        .collect();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for v in order {
            let at = round * variants.len() + v;
            let rate = match variants[v] {
                Some((db, batch)) => {
                    let db = &dbs[db];
                    db.fill(table, queue, count, at).await?;
                    let rate = db.relay(publisher, batch, count).await?;
                    db.clear(table).await?;
                    rate
                }
                None => direct(publisher, queue, count, at).await?,
            };
            purge(channel, queue, count).await?;
            rates[v].push(rate);
        }
    }
    let mut rates: Vec<f64> = rates.into_iter().map(median).collect();
    let direct = rates.pop().expect("the direct variant is the last");
    let relayed = rates.chunks(BATCHES.len()).map(<[f64]>::to_vec).collect();

    let mut latencies = Vec::new();
    let mut first_id = 1;
    for db in dbs {
        eprintln!(
            "outbox: {} jobs/s of one message, relayed from {}",
            latency::RATE,
            db.name()
        );
        let measured = db.latency(publisher, queue, first_id, quick).await?;
        purge(channel, queue, measured.jobs).await?;
        db.clear(table).await?;
        first_id += measured.jobs as u64;
        latencies.push((db.name(), measured));
    }
    if let Some(Db::Pg(store)) = dbs.first() {
        // The relay on a pool of its own, woken by the store's announcements: whether the
        // relay above waits for connections behind the jobs queued for the pool.
        eprintln!("outbox: the same from PostgreSQL, the relay on a pool of its own");
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&config().pg_url)
            .await?;
        let relayed = Store::new(own.clone()).with_table(table)?;
        let measured =
            latency::measure(store, relayed, publisher.clone(), queue, first_id, quick).await;
        own.close().await;
        let measured = measured?;
        purge(channel, queue, measured.jobs).await?;
        dbs[0].clear(table).await?;
        latencies.push(("PostgreSQL, the relay on a pool of its own", measured));
    }
    Ok((relayed, direct, latencies))
}
