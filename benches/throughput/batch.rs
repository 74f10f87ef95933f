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
#[derive(Clone)]
pub(crate) struct Job {
    pub(crate) id: String,
    pub(crate) account: i64,
}

/// The jobs the claim found fresh, in input order.
fn fresh_accounts(jobs: &[Job], fresh: &[String]) -> Vec<i64> {
    let fresh: std::collections::HashSet<&str> = fresh.iter().map(String::as_str).collect();
    jobs.iter()
        .filter(|j| fresh.contains(j.id.as_str()))
        .map(|j| j.account)
        .collect()
}

fn accounts_of(jobs: &[Job]) -> Vec<i64> {
    jobs.iter().map(|j| j.account).collect()
}

pub(crate) mod pg {
    use super::*;

    /// The same batch under the attribute: the body sees only the fresh jobs.
    #[idem::idempotent(key = "job.id", scope = "bench.top_up", batch = "jobs")]
    pub(crate) async fn top_ups(
        tx: &mut Transaction<'_, Postgres>,
        jobs: &[Job],
    ) -> Result<(), sqlx::Error> {
        apply(tx, &accounts_of(jobs)).await
    }

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
        let accounts = fresh_accounts(jobs, &fresh);
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

pub(crate) mod lite {
    use super::*;

    #[idem::idempotent(key = "job.id", scope = "bench.top_up", batch = "jobs")]
    pub(crate) async fn top_ups(
        tx: &mut Transaction<'_, Sqlite>,
        jobs: &[Job],
    ) -> Result<(), sqlx::Error> {
        apply(tx, &accounts_of(jobs)).await
    }

    /// idem's batch claim on SQLite: the keys as one JSON array (no bind limit).
    fn claim() -> &'static str {
        static SQL: OnceLock<String> = OnceLock::new();
        SQL.get_or_init(|| {
            format!(
                "INSERT INTO {} (scope, key, completed_at) \
                 SELECT ?1, value, strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                 FROM json_each(?2) WHERE true ON CONFLICT DO NOTHING RETURNING key",
                config().hand
            )
        })
    }

    fn effects() -> &'static str {
        static SQL: OnceLock<String> = OnceLock::new();
        SQL.get_or_init(|| {
            let accounts = &config().accounts;
            format!(
                "UPDATE {accounts} SET credits = credits + \
                 (SELECT count(*) FROM json_each(?1) WHERE value = {accounts}.id) \
                 WHERE id IN (SELECT value FROM json_each(?1))"
            )
        })
    }

    pub(crate) async fn hand(pool: &Pool<Sqlite>, jobs: &[Job]) -> Result<u64, sqlx::Error> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let keys: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
        let keys = serde_json::to_string(&keys).expect("strings serialise");
        let fresh: Vec<String> = sqlx::query_scalar(claim())
            .bind(SCOPE)
            .bind(keys)
            .fetch_all(&mut *tx)
            .await?;
        if fresh.is_empty() {
            drop(tx);
            return Ok(0);
        }
        let accounts = fresh_accounts(jobs, &fresh);
        apply(&mut tx, &accounts).await?;
        tx.commit().await?;
        Ok(accounts.len() as u64)
    }

    pub(crate) async fn apply(
        tx: &mut Transaction<'_, Sqlite>,
        accounts: &[i64],
    ) -> Result<(), sqlx::Error> {
        let accounts = serde_json::to_string(accounts).expect("integers serialise");
        sqlx::query(effects())
            .bind(accounts)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

pub(crate) mod my {
    use super::*;
    use sqlx::{AssertSqlSafe, Row};

    #[idem::idempotent(key = "job.id", scope = "bench.top_up", batch = "jobs")]
    pub(crate) async fn top_ups(
        tx: &mut Transaction<'_, MySql>,
        jobs: &[Job],
    ) -> Result<(), sqlx::Error> {
        apply(tx, &accounts_of(jobs)).await
    }

    fn hex(s: &str) -> String {
        let mut out = String::with_capacity(3 + 2 * s.len());
        out.push_str("X'");
        for b in s.bytes() {
            out.push_str(&format!("{b:02x}"));
        }
        out.push('\'');
        out
    }

    /// idem's batch claim on MySQL, by hand: `INSERT IGNORE` with a sentinel (`attempts = 0`)
    /// and the read-back of the rows holding it in one message, then the sentinel settled
    /// on the fresh rows.
    pub(crate) async fn hand(pool: &Pool<MySql>, jobs: &[Job]) -> Result<u64, sqlx::Error> {
        let hand = &config().hand;
        let mut tx = pool.begin().await?;
        let mut keys: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
        keys.sort_unstable();
        let scope = hex(SCOPE);
        let values: Vec<String> = keys
            .iter()
            .map(|k| format!("({scope},{},0,UTC_TIMESTAMP(6),UTC_TIMESTAMP(6))", hex(k)))
            .collect();
        let list: Vec<String> = keys.iter().map(|k| hex(k)).collect();
        let claim = format!(
            "INSERT IGNORE INTO {hand} (scope, `key`, attempts, created_at, completed_at) \
             VALUES {}; SELECT `key` FROM {hand} WHERE scope = {scope} AND `key` IN ({}) \
             AND attempts = 0",
            values.join(","),
            list.join(",")
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(claim))
            .fetch_all(&mut *tx)
            .await?;
        let mut fresh = Vec::with_capacity(rows.len());
        for row in &rows {
            let key: Vec<u8> = row.try_get(0)?;
            fresh.push(String::from_utf8(key).expect("the bench's keys are hex digits"));
        }
        if fresh.is_empty() {
            drop(tx);
            return Ok(0);
        }
        let mine: Vec<String> = fresh.iter().map(|k| hex(k)).collect();
        let settle = format!(
            "UPDATE {hand} SET attempts = 1 WHERE scope = {scope} AND `key` IN ({})",
            mine.join(",")
        );
        sqlx::raw_sql(AssertSqlSafe(settle))
            .execute(&mut *tx)
            .await?;
        let accounts = fresh_accounts(jobs, &fresh);
        apply(&mut tx, &accounts).await?;
        tx.commit().await?;
        Ok(accounts.len() as u64)
    }

    fn effects() -> &'static str {
        static SQL: OnceLock<String> = OnceLock::new();
        SQL.get_or_init(|| {
            let accounts = &config().accounts;
            format!(
                "UPDATE {accounts} a JOIN (SELECT id, COUNT(*) AS c FROM \
                 JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j GROUP BY id) v \
                 ON a.id = v.id SET a.credits = a.credits + v.c"
            )
        })
    }

    pub(crate) async fn apply(
        tx: &mut Transaction<'_, MySql>,
        accounts: &[i64],
    ) -> Result<(), sqlx::Error> {
        let accounts = serde_json::to_string(accounts).expect("integers serialise");
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
            (Conn::Pg(s), _) => pg::top_ups(s, jobs).await?.applied() as u64,
            (Conn::Lite(s), BatchVariant::Hand) => lite::hand(s.pool(), jobs).await?,
            (Conn::Lite(s), _) => lite::top_ups(s, jobs).await?.applied() as u64,
            (Conn::My(s), BatchVariant::Hand) => my::hand(s.pool(), jobs).await?,
            (Conn::My(s), _) => my::top_ups(s, jobs).await?.applied() as u64,
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
    let mut variants = vec![BatchVariant::Hand, BatchVariant::Macro];
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
