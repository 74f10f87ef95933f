//! Batches: one transaction claims a whole batch of jobs in one statement and applies the
//! fresh ones' effects in one more, so a commit (and its fsync) serves many jobs.
//!
//! Batch sizes [`SIZES`] at [`BATCH_WORKERS`] workers, in three variants: the claim written by
//! hand (`hand batch`), the same handler under `#[idem::idempotent(batch = ..)]`
//! (`macro batch`), and pgbench running the hand-written transaction (PostgreSQL). Rates are
//! jobs per second, not batches. Each worker tops up its own accounts (account ≡ worker mod
//! workers): two batches then never wait on each other's rows, so the rates measure the
//! claim and the commit, not lock queues between effects.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};
use std::sync::OnceLock;

use crate::config::config;
use crate::measure::{Agg, Run, connect};
use crate::pgbench::{Pgbench, PgbenchLength};
use crate::variants::{Conn, Keys, Kind, job_id, mix};
use crate::{ACCOUNTS, BoxError, MAX_JOBS_PER_WORKER, PGBENCH_QUICK_RUN, Res, SCOPE, Settings};

pub(crate) const SIZES: [usize; 3] = [1, 10, 100];
pub(crate) const BATCH_WORKERS: [usize; 2] = [1, 8];
/// Salt of the hand-written batches' keys.
const HAND_BATCH: u64 = 0x0062_6174_6368;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum BatchVariant {
    Hand,
    Macro,
    Pgbench,
}

impl BatchVariant {
    pub(crate) fn name(self) -> &'static str {
        match self {
            BatchVariant::Hand => "hand batch",
            BatchVariant::Macro => "macro batch",
            BatchVariant::Pgbench => "pgbench batch",
        }
    }
}

/// Rates by (database, workers, batch size, variant).
pub(crate) type BatchResults = BTreeMap<(Kind, usize, usize, BatchVariant), Agg>;

/// One job of a batch.
pub(crate) struct Job {
    pub(crate) id: String,
    pub(crate) account: i64,
}

pub(crate) mod pg {
    use super::*;

    fn claim() -> &'static str {
        static SQL: OnceLock<String> = OnceLock::new();
        SQL.get_or_init(|| {
            format!(
                "INSERT INTO {} (scope, key, completed_at) \
                 SELECT $1, k, now() FROM unnest($2::text[]) AS k ORDER BY k \
                 ON CONFLICT DO NOTHING RETURNING key",
                config().hand
            )
        })
    }

    /// One statement for all the effects: each account gets one credit per job.
    pub(crate) fn effects() -> &'static str {
        static SQL: OnceLock<String> = OnceLock::new();
        SQL.get_or_init(|| {
            let accounts = &config().accounts;
            format!(
                "UPDATE {accounts} SET credits = credits + v.c \
                 FROM (SELECT id, count(*) AS c FROM unnest($1::bigint[]) AS id GROUP BY id) v \
                 WHERE {accounts}.id = v.id"
            )
        })
    }

    /// The batch by hand: claim every key, apply the fresh jobs, commit. Returns how many
    /// jobs were applied.
    pub(crate) async fn hand(pool: &Pool<Postgres>, jobs: &[Job]) -> Result<u64, sqlx::Error> {
        let mut tx = pool.begin().await?;
        let keys: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
        let fresh: Vec<String> = sqlx::query_scalar(claim())
            .bind(SCOPE)
            .bind(&keys)
            .fetch_all(&mut *tx)
            .await?;
        if fresh.is_empty() {
            drop(tx);
            return Ok(0);
        }
        let fresh: std::collections::HashSet<&str> = fresh.iter().map(String::as_str).collect();
        let accounts: Vec<i64> = jobs
            .iter()
            .filter(|j| fresh.contains(j.id.as_str()))
            .map(|j| j.account)
            .collect();
        apply(&mut tx, &accounts).await?;
        tx.commit().await?;
        Ok(accounts.len() as u64)
    }

    pub(crate) async fn apply(
        tx: &mut Transaction<'_, Postgres>,
        accounts: &[i64],
    ) -> Result<(), sqlx::Error> {
        sqlx::query(effects())
            .bind(accounts)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Runs one variant's batches of `size` at `workers` workers for `dur`.
async fn run(
    conn: &Arc<Conn>,
    keys: &Arc<Keys>,
    variant: BatchVariant,
    workers: usize,
    size: usize,
    dur: Duration,
) -> Res<Run> {
    let start = Instant::now();
    let deadline = start + dur;
    let mut tasks = Vec::with_capacity(workers);
    for w in 0..workers {
        let (conn, keys) = (conn.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(256);
            let (mut effects, mut in_window) = (0, 0);
            let per_worker = ACCOUNTS / workers as u64;
            let mut seed = mix(w as u64 ^ start.elapsed().as_nanos() as u64);
            for _ in 0..MAX_JOBS_PER_WORKER {
                if Instant::now() >= deadline {
                    break;
                }
                let batch: Vec<Job> = (0..size)
                    .map(|_| {
                        seed = mix(seed);
                        let n = match variant {
                            BatchVariant::Hand => {
                                job_id(HAND_BATCH, keys.hand.fetch_add(1, Ordering::Relaxed))
                            }
                            _ => job_id(0, keys.applied.fetch_add(1, Ordering::Relaxed)),
                        };
                        Job {
                            id: n,
                            account: ((seed % per_worker) * workers as u64 + w as u64 + 1) as i64,
                        }
                    })
                    .collect();
                let t0 = Instant::now();
                let applied = conn.batch(variant, &batch).await?;
                let t1 = Instant::now();
                lat.push((t1 - t0).as_nanos() as u64);
                if applied != size as u64 {
                    return Err(format!(
                        "{}: {applied} of a batch of {size} fresh jobs were applied",
                        variant.name()
                    )
                    .into());
                }
                effects += applied;
                if t1 <= deadline {
                    in_window += applied;
                }
            }
            keys.effects.fetch_add(effects, Ordering::Relaxed);
            Ok::<_, BoxError>((lat, in_window))
        }));
    }
    let (mut lat_ns, mut jobs) = (Vec::new(), 0);
    for t in tasks {
        let (lat, in_window) = t.await??;
        lat_ns.extend(lat);
        jobs += in_window;
    }
    Ok(Run {
        jobs,
        secs: dur.as_secs_f64(),
        lat_ns,
        cpu_ns: None,
    })
}

impl Conn {
    /// Runs one batch; returns how many of its jobs were applied.
    pub(crate) async fn batch(&self, variant: BatchVariant, jobs: &[Job]) -> Res<u64> {
        Ok(match (self, variant) {
            (Conn::Pg(s), BatchVariant::Hand) => pg::hand(s.pool(), jobs).await?,
            (_, v) => return Err(format!("{} is not written for this database", v.name()).into()),
        })
    }
}

/// Every batch size and worker count of one database, variants interleaved round by round.
pub(crate) async fn bench_batches(
    kind: Kind,
    set: Settings,
    keys: &Arc<Keys>,
    sqlite: &std::path::Path,
    pgbench: Option<&Pgbench>,
    results: &mut BatchResults,
) -> Res<()> {
    let mut variants = vec![BatchVariant::Hand];
    if kind == Kind::Postgres {
        variants.extend(pgbench.map(|_| BatchVariant::Pgbench));
    }
    for workers in BATCH_WORKERS {
        let conn = Arc::new(connect(kind, workers, sqlite).await?);
        conn.maintain().await?;
        for size in SIZES {
            for &v in &variants {
                if v != BatchVariant::Pgbench {
                    run(&conn, keys, v, workers, size, set.warmup).await?;
                }
            }
            let mut order = variants.clone();
            for round in 0..set.rounds {
                let mut line = format!(
                    "{} / {workers} workers / batch {size} / round {}:",
                    kind.name(),
                    round + 1
                );
                for &v in &order {
                    let r = match (v, pgbench) {
                        (BatchVariant::Pgbench, Some(pgb)) => {
                            let length = if set.quick {
                                PgbenchLength::PerClient(
                                    (2000 / size as u64 / workers as u64).max(5),
                                )
                            } else {
                                PgbenchLength::Secs(set.run.as_secs_f64().ceil().max(1.0) as u64)
                            };
                            let _ = PGBENCH_QUICK_RUN;
                            let mut r = pgb
                                .run_batch(
                                    workers,
                                    size,
                                    length,
                                    &format!("b{size}-{workers}-{round}"),
                                )
                                .await?;
                            keys.effects
                                .fetch_add(r.jobs * size as u64, Ordering::Relaxed);
                            r.jobs *= size as u64;
                            r
                        }
                        _ => run(&conn, keys, v, workers, size, set.run).await?,
                    };
                    let rate = r.jobs as f64 / r.secs;
                    line.push_str(&format!(" {} {rate:.0}", v.name()));
                    results.entry((kind, workers, size, v)).or_default().add(r);
                }
                order.reverse();
                eprintln!("{line}");
            }
        }
        conn.close().await;
    }
    Ok(())
}

#[allow(dead_code)]
fn unused(_: &Pool<Sqlite>, _: &Pool<MySql>) {}
