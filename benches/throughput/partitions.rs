//! `--partitions` (PostgreSQL): a claim on a marker table of 10M markers (300,000 with
//! `--quick`) spread over 30 days, one table against one partitioned by day
//! (`Store::partitions`), and what removing the oldest days costs in each: `purge`, row by
//! row, against dropping their partitions. Keys are UUIDv7s, as the partitioned table needs;
//! both tables hold the same keys, and the claims' fresh keys are made now (today's
//! partition). One worker; the two tables interleaved round by round.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem::partitions::KeyTime;
use idem::{Claimed, Key, Store};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Pool, Postgres};

use crate::Res;
use crate::config::config;
use crate::report::percentile_ms;
use crate::setup::exec;

const DAYS: u64 = 30;
const SCOPE: &str = "bench.days";
const TABLES: [&str; 2] = ["idem_bench_days_one", "idem_bench_days_parted"];

/// A UUIDv7 of now, unique by `n`.
fn key(n: u64) -> Res<Key> {
    let ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
    Ok(Key::new(&format!(
        "{:08x}-{:04x}-7{:03x}-8{:03x}-{:012x}",
        ms >> 16,
        ms & 0xffff,
        (n >> 48) & 0xfff,
        (n >> 36) & 0xfff,
        n & 0xffff_ffff_ffff
    ))?)
}

/// `n` completed markers, their keys UUIDv7s of the last `DAYS` days (each completed when its
/// key was made), in one statement ordered by key.
async fn fill(admin: &Pool<Postgres>, table: &str, n: u64) -> Res<()> {
    let t0 = Instant::now();
    exec(
        admin,
        &format!(
            "BEGIN; SET LOCAL work_mem = '512MB';
             INSERT INTO {table} (scope, key, state, created_at, completed_at)
             SELECT '{SCOPE}', k, 'completed', ts, ts FROM (
                 SELECT ts, lpad(to_hex(ms >> 16), 8, '0') || '-' || lpad(to_hex(ms & 65535), 4, '0')
                     || '-7' || substr(h, 1, 3) || '-8' || substr(h, 4, 3) || '-' || substr(h, 7, 12) AS k
                 FROM (SELECT ts, (extract(epoch FROM ts) * 1000)::bigint AS ms, md5(g::text) AS h
                       FROM (SELECT g, now() - interval '1 hour' - (g % {DAYS}) * interval '1 day'
                                 - (g % 3600) * interval '1 second' AS ts
                             FROM generate_series(1, {n}) g) a) b) c
             ORDER BY k;
             COMMIT;"
        ),
    )
    .await?;
    // Apart: VACUUM refuses to run in the implicit transaction of a multi-statement message.
    exec(admin, &format!("VACUUM ANALYZE {table}")).await?;
    eprintln!(
        "partitions: {n} markers in {table} in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

pub(crate) async fn run(quick: bool) -> Res<()> {
    let n: u64 = if quick { 300_000 } else { 10_000_000 };
    let (rounds, run) = if quick { (2, 500) } else { (5, 2_000) };
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&config().pg_url)
        .await?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .connect(&config().pg_url)
        .await?;
    for table in TABLES {
        exec(&admin, &format!("DROP TABLE IF EXISTS {table}, {table}_outbox, {table}_retention, {table}_steps, {table}_offsets CASCADE")).await?;
    }
    let one = Store::new(pool.clone()).with_table(TABLES[0])?;
    one.migrate().await?;
    let parted = Store::new(pool.clone()).with_table(TABLES[1])?;
    let days = parted.partitions(KeyTime::UuidV7);
    days.migrate(1).await?;
    let now = SystemTime::now();
    days.add(now - Duration::from_secs((DAYS + 1) * 86_400), now)
        .await?;
    for table in TABLES {
        fill(&admin, table, n).await?;
    }
    exec(&admin, "CHECKPOINT").await?;

    let stores = [&one, &parted];
    let mut claims: [Vec<u64>; 2] = [vec![], vec![]];
    let mut jobs: [Vec<u64>; 2] = [vec![], vec![]];
    let mut counter = 0;
    for round in 0..=rounds {
        for (i, store) in stores.iter().enumerate() {
            let deadline = Instant::now() + Duration::from_millis(run);
            while Instant::now() < deadline {
                counter += 1;
                let key = key(counter)?;
                let t0 = Instant::now();
                let Claimed::Fresh(guard) = store.claim(SCOPE, &key).await? else {
                    return Err(format!("partitions: fresh key {key} was a duplicate").into());
                };
                let t1 = Instant::now();
                if !guard.finish(Ok::<(), idem::Error>(())).await?.is_applied() {
                    return Err(format!("partitions: {key} was not applied").into());
                }
                if round > 0 {
                    claims[i].push((t1 - t0).as_nanos() as u64);
                    jobs[i].push(t0.elapsed().as_nanos() as u64);
                }
            }
        }
    }

    // The oldest days go: those that ended more than DAYS - 2 days ago.
    let keep = Duration::from_secs((DAYS - 2) * 86_400);
    let count = async |table: &str| -> Res<i64> {
        Ok(
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
                .fetch_one(&admin)
                .await?,
        )
    };
    let before = count(TABLES[1]).await?;
    let t0 = Instant::now();
    let dropped = days.drop_older_than(keep).await?;
    let drop_secs = t0.elapsed().as_secs_f64();
    let dropped_rows = before - count(TABLES[1]).await?;
    // The same cut by time in the one table: every marker completed before the first day kept.
    let cut = dropped.last().map(|p| p.to).unwrap_or(now);
    let age = SystemTime::now().duration_since(cut)?;
    let t0 = Instant::now();
    let purged = one.purge(age).await?;
    let purge_secs = t0.elapsed().as_secs_f64();

    let (p_one, p_parted) = (
        percentile_ms(&claims[0], 50.0),
        percentile_ms(&claims[1], 50.0),
    );
    println!(
        "\n## Markers at scale (PostgreSQL, {n} markers over {DAYS} days, 1 worker, \
         rounds {rounds} of {run} ms)\n"
    );
    println!("| table | claims | claim p50 ms | claim p99 ms | job p50 ms |");
    println!("|---|---:|---:|---:|---:|");
    for (i, name) in ["one table", "partitioned by day"].iter().enumerate() {
        println!(
            "| {name} | {} | {:.3} | {:.3} | {:.3} |",
            claims[i].len(),
            percentile_ms(&claims[i], 50.0),
            percentile_ms(&claims[i], 99.0),
            percentile_ms(&jobs[i], 50.0)
        );
    }
    println!(
        "\nclaim p50, partitioned / one table: {:.2}\n",
        p_parted / p_one
    );
    println!("| removing the oldest days | markers | seconds | markers/s |");
    println!("|---|---:|---:|---:|");
    println!(
        "| one table, `purge` | {purged} | {purge_secs:.2} | {:.0} |",
        purged as f64 / purge_secs
    );
    println!(
        "| partitioned, `drop_older_than` ({} days) | {dropped_rows} | {drop_secs:.2} | {:.0} |",
        dropped.len(),
        dropped_rows as f64 / drop_secs
    );
    for table in TABLES {
        exec(&admin, &format!("DROP TABLE IF EXISTS {table}, {table}_outbox, {table}_retention, {table}_steps, {table}_offsets CASCADE")).await?;
    }
    pool.close().await;
    Ok(())
}
