//! Full mode only (PostgreSQL): does a claim slow down as the marker table grows (0, 1M and
//! 10M markers), and how fast does `Store::purge` empty it. Apart from the throughput runs
//! because filling the tables takes minutes and is not interleaved with them.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem::{Claimed, Key, Store};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Pool, Postgres};

use crate::config::config;
use crate::setup::exec;
use crate::variants::{Keys, Rng, job_id, pg};
use crate::{MAX_JOBS_PER_WORKER, Res, SCOPE, Settings};

pub(crate) const GROWTH_SIZES: [u64; 3] = [0, 1_000_000, 10_000_000];

pub(crate) struct Growth {
    /// Per table: markers before the first claim, claim latencies, whole-job latencies.
    pub(crate) claims: Vec<(u64, Vec<u64>, Vec<u64>)>,
    /// Per purged table: markers in it, rows deleted, seconds.
    pub(crate) purges: Vec<(u64, u64, f64)>,
}

/// Fills `table` with `n` completed markers of the benchmark's scope in one set-based
/// statement. Keys are md5 hex, spread over the key space like the claims' keys; one marker in
/// `old_every` was completed 30 days ago (what `purge` will delete), the others an hour ago.
pub(crate) async fn fill(admin: &Pool<Postgres>, table: &str, n: u64, old_every: u64) -> Res<()> {
    let t0 = Instant::now();
    exec(
        admin,
        &format!(
            "BEGIN; SET LOCAL work_mem = '512MB';
             INSERT INTO {table} (scope, key, state, created_at, completed_at)
             SELECT '{SCOPE}', md5(g::text), 'completed', ts, ts FROM (
                 SELECT g, CASE WHEN g % {old_every} = 0 THEN now() - interval '30 days'
                                ELSE now() - interval '1 hour' END AS ts
                 FROM generate_series(1, {n}) g) s
             ORDER BY md5(g::text);
             COMMIT;"
        ),
    )
    .await?;
    // Autovacuum would do this eventually; do it now so it does not land in the measurement.
    exec(admin, &format!("VACUUM ANALYZE {table}")).await?;
    eprintln!(
        "growth: {n} markers in {table} in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

pub(crate) async fn measure_growth(
    admin: &Pool<Postgres>,
    set: Settings,
    keys: &Keys,
) -> Res<Growth> {
    const SALT: u64 = 0x67726f77;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .connect(&config().pg_url)
        .await?;
    let mut stores = Vec::new();
    for (table, n) in config().growth.iter().zip(GROWTH_SIZES) {
        let store = Store::new(pool.clone()).with_table(table)?;
        store.migrate().await?;
        match n {
            0 => {}
            1_000_000 => fill(admin, table, n, 1).await?,
            _ => fill(admin, table, n, 10).await?,
        }
        stores.push(store);
    }
    exec(admin, "CHECKPOINT").await?;

    let mut claims: Vec<(u64, Vec<u64>, Vec<u64>)> =
        GROWTH_SIZES.iter().map(|&n| (n, vec![], vec![])).collect();
    let mut counter = 0;
    let mut rng = Rng(SALT);
    // One worker, the three tables interleaved round by round.
    for round in 0..=set.rounds {
        for (store, (_, claim_ns, job_ns)) in stores.iter().zip(&mut claims) {
            let dur = if round == 0 { set.warmup } else { set.run };
            let deadline = Instant::now() + dur;
            for _ in 0..MAX_JOBS_PER_WORKER {
                if Instant::now() >= deadline {
                    break;
                }
                let key = Key::new(&job_id(SALT, counter))?;
                counter += 1;
                let t0 = Instant::now();
                let Claimed::Fresh(mut guard) = store.claim(SCOPE, &key).await? else {
                    return Err(format!("growth: fresh key {key} claimed as a duplicate").into());
                };
                let t1 = Instant::now();
                sqlx::query(pg::update())
                    .bind(1_i64)
                    .bind(rng.account())
                    .execute(&mut **guard.tx())
                    .await?;
                let outcome = guard.finish(Ok::<(), idem::Error>(())).await?;
                let t2 = Instant::now();
                keys.effects
                    .fetch_add(u64::from(outcome.is_applied()), Ordering::Relaxed);
                if round > 0 {
                    claim_ns.push((t1 - t0).as_nanos() as u64);
                    job_ns.push((t2 - t0).as_nanos() as u64);
                }
            }
        }
        if round > 0 {
            eprintln!("growth: round {round} done");
        }
    }

    let mut purges = Vec::new();
    for (store, n) in stores.iter().zip(GROWTH_SIZES).skip(1) {
        let t0 = Instant::now();
        let deleted = store.purge(Duration::from_secs(86_400)).await?;
        let secs = t0.elapsed().as_secs_f64();
        eprintln!(
            "growth: purge deleted {deleted} of {n} markers in {secs:.1} s ({:.0} rows/s)",
            deleted as f64 / secs
        );
        purges.push((n, deleted, secs));
    }
    pool.close().await;
    Ok(Growth { claims, purges })
}
