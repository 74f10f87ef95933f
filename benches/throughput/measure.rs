//! The timed runs: one variant at a given number of workers ([`run_variant`]), and every
//! worker count and round of one database ([`bench_kind`]), interleaving variants so that
//! only ratios within one run are compared.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use idem::Store;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use crate::config::config;
use crate::pgbench::{Pgbench, PgbenchLength};
use crate::variants::{Conn, Keys, Kind, Rng, TopUp, VARIANTS, Variant, job_id, mix};
use crate::{BoxError, MAX_JOBS_PER_WORKER, PGBENCH_QUICK_RUN, Res, Settings, WORKERS};

/// One timed run: how many jobs, how long, each job's latency, and the CPU time this process
/// spent on them (`None` for pgbench, another process).
pub(crate) struct Run {
    pub(crate) jobs: u64,
    pub(crate) secs: f64,
    pub(crate) lat_ns: Vec<u64>,
    pub(crate) cpu_ns: Option<u64>,
}

#[derive(Default)]
pub(crate) struct Agg {
    pub(crate) rates: Vec<f64>,
    pub(crate) lat_ns: Vec<u64>,
    pub(crate) cpu_per_job_us: Vec<f64>,
}

impl Agg {
    pub(crate) fn add(&mut self, run: Run) {
        self.rates.push(run.jobs as f64 / run.secs);
        if let Some(cpu) = run.cpu_ns {
            let all_jobs = run.lat_ns.len().max(1) as f64;
            self.cpu_per_job_us.push(cpu as f64 / 1e3 / all_jobs);
        }
        self.lat_ns.extend(run.lat_ns);
    }
}

/// Salt of the hand-written variants' keys, apart from the macro's.
pub(crate) const HAND: u64 = 0x68616e64;

pub(crate) type Results = BTreeMap<(Kind, usize, Variant), Agg>;

pub(crate) async fn run_variant(
    conn: &Arc<Conn>,
    keys: &Arc<Keys>,
    variant: Variant,
    workers: usize,
    dur: Duration,
) -> Res<Run> {
    // `IDEM_BENCH_DUPLICATE=handwritten`: the duplicates are the hand-written claim's keys,
    // redelivered to it, so that its duplicate / fresh ratio stands beside idem's.
    let applied = match config().duplicate_of_hand {
        false => keys.applied.load(Ordering::SeqCst),
        true => keys.hand.load(Ordering::SeqCst),
    };
    let dup_salt = if config().duplicate_of_hand { HAND } else { 0 };
    if variant == Variant::Duplicate && applied == 0 {
        return Err("duplicate: no applied job to re-deliver".into());
    }
    // CPU time of this whole process (every thread, sqlx's SQLite workers included): less
    // noisy than throughput on a shared machine, and where an allocation or a statement that
    // misses sqlx's cache would show.
    let cpu0 = cpu_time::ProcessTime::now();
    let start = Instant::now();
    let deadline = start + dur;
    let mut tasks = Vec::with_capacity(workers);
    for w in 0..workers {
        let conn = conn.clone();
        let keys = keys.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(mix(w as u64 ^ start.elapsed().as_nanos() as u64));
            let mut lat = Vec::with_capacity(1024);
            let mut effects = 0;
            let mut in_window = 0;
            for _ in 0..MAX_JOBS_PER_WORKER {
                if Instant::now() >= deadline {
                    break;
                }
                // The job arrives before the clock starts: only its handling is timed.
                let id = match variant {
                    Variant::Plain => job_id(HAND, keys.plain.fetch_add(1, Ordering::Relaxed)),
                    Variant::Handwritten => job_id(HAND, keys.hand.fetch_add(1, Ordering::Relaxed)),
                    Variant::Macro => job_id(0, keys.applied.fetch_add(1, Ordering::Relaxed)),
                    Variant::Duplicate => {
                        job_id(dup_salt, keys.dup.fetch_add(1, Ordering::Relaxed) % applied)
                    }
                    Variant::Pgbench => unreachable!("pgbench runs on its own"),
                };
                let job = TopUp {
                    id,
                    account: rng.account(),
                    credits: 1,
                };
                let t0 = Instant::now();
                let runs = match variant {
                    Variant::Duplicate if config().duplicate_of_hand => Variant::Handwritten,
                    other => other,
                };
                let done = conn.job(runs, &job).await?;
                let t1 = Instant::now();
                lat.push((t1 - t0).as_nanos() as u64);
                in_window += u64::from(t1 <= deadline);
                if done != (variant != Variant::Duplicate) {
                    return Err(format!(
                        "{}: job {} was {}",
                        variant.name(),
                        job.id,
                        if done { "applied" } else { "a duplicate" }
                    )
                    .into());
                }
                effects += u64::from(done);
            }
            keys.effects.fetch_add(effects, Ordering::Relaxed);
            Ok::<_, BoxError>((lat, in_window))
        }));
    }
    let mut lat_ns = Vec::new();
    let mut jobs = 0;
    for t in tasks {
        let (lat, in_window) = t.await??;
        lat_ns.extend(lat);
        jobs += in_window;
    }
    // The rate counts the jobs done within the window; the jobs in flight at its end are
    // waited for (their latency counts) but not counted, or a slow straggler (SQLite's busy
    // handler sleeps up to 100 ms between tries) would stretch the window.
    let cpu_ns = cpu0.elapsed().as_nanos() as u64;
    Ok(Run {
        jobs,
        secs: dur.as_secs_f64(),
        lat_ns,
        cpu_ns: Some(cpu_ns),
    })
}

/// How the bench's pools are set up: `--pool sqlx` or `--pool lean` (the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolMode {
    /// sqlx's defaults: a ping before each acquire, one connection per worker.
    Sqlx,
    /// What `docs/idempotent.md` recommends: no ping before acquire (a dead connection fails
    /// the claim, and the job is redelivered), and one connection more than the workers, so
    /// that the ping sqlx sends when a connection goes back to the pool (it also flushes a
    /// dropped transaction's `ROLLBACK`) overlaps the next job instead of delaying it.
    Lean,
}

impl PoolMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            PoolMode::Sqlx => "sqlx",
            PoolMode::Lean => "lean",
        }
    }

    pub(crate) fn ping(self) -> bool {
        self == PoolMode::Sqlx
    }

    pub(crate) fn size(self, workers: usize) -> u32 {
        workers as u32 + u32::from(self == PoolMode::Lean)
    }
}

/// Set once from the arguments, before any pool is made.
pub(crate) static POOL: OnceLock<PoolMode> = OnceLock::new();

pub(crate) fn pool_mode() -> PoolMode {
    *POOL.get().unwrap_or(&PoolMode::Lean)
}

pub(crate) async fn connect(kind: Kind, workers: usize, sqlite: &Path) -> Res<Conn> {
    let url = match kind {
        Kind::MySql => &config().my_url,
        _ => &config().pg_url,
    };
    connect_to(kind, workers, sqlite, url).await
}

/// [`connect`] to another address of the server (the wire check's counting proxy).
pub(crate) async fn connect_to(kind: Kind, workers: usize, sqlite: &Path, url: &str) -> Res<Conn> {
    let mode = pool_mode();
    let n = mode.size(workers);
    Ok(match kind {
        Kind::Postgres => {
            let pool = PgPoolOptions::new()
                .test_before_acquire(mode.ping())
                .max_connections(n)
                .min_connections(n)
                .connect(url)
                .await?;
            Conn::Pg(Store::new(pool).with_table(&config().markers)?)
        }
        Kind::Sqlite => {
            let pool = SqlitePoolOptions::new()
                .test_before_acquire(mode.ping())
                .max_connections(n)
                .min_connections(n)
                .connect_with(sqlite_options(sqlite))
                .await?;
            Conn::Lite(Store::new(pool).with_table(&config().markers)?)
        }
        Kind::MySql => {
            let pool = MySqlPoolOptions::new()
                .test_before_acquire(mode.ping())
                .max_connections(n)
                .min_connections(n)
                .connect(url)
                .await?;
            Conn::My(Store::new(pool).with_table(&config().markers)?)
        }
    })
}

pub(crate) fn sqlite_options(path: &Path) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(30))
}

/// All worker counts of one database, rounds interleaved within each worker count.
pub(crate) async fn bench_kind(
    kind: Kind,
    set: Settings,
    keys: &Arc<Keys>,
    sqlite: &Path,
    pgbench: Option<&Pgbench>,
    results: &mut Results,
) -> Res<()> {
    for workers in WORKERS {
        let t0 = Instant::now();
        let conn = Arc::new(connect(kind, workers, sqlite).await?);
        conn.maintain().await?;
        eprintln!("{} / {workers} workers: warming up", kind.name());
        // These two prepare every statement on every connection (plain's UPDATE is theirs
        // too, duplicate's claim is macro's).
        let mut hand_rate = 0.0;
        for v in [Variant::Handwritten, Variant::Macro] {
            let run = run_variant(&conn, keys, v, workers, set.warmup).await?;
            if v == Variant::Handwritten {
                hand_rate = run.jobs as f64 / run.secs;
            }
        }
        let pgbench = if kind == Kind::Postgres {
            pgbench
        } else {
            None
        };
        // Every round runs each variant once, and every other round runs them backwards
        // (A B C D, D C B A, ...): drift over the run, and whatever one variant leaves behind
        // for the next, then weigh on every variant alike instead of always on the later ones.
        let mut order: Vec<Variant> = VARIANTS.to_vec();
        if pgbench.is_some() {
            order.push(Variant::Pgbench);
        }
        for round in 0..set.rounds {
            let mut line = format!("{} / {workers} workers / round {}:", kind.name(), round + 1);
            for &v in &order {
                let run = match (v, pgbench) {
                    (Variant::Pgbench, Some(pgb)) => {
                        let length = if set.quick {
                            let txns = hand_rate * PGBENCH_QUICK_RUN.as_secs_f64() / workers as f64;
                            PgbenchLength::PerClient((txns.ceil() as u64).max(20))
                        } else {
                            PgbenchLength::Secs(set.run.as_secs_f64().ceil().max(1.0) as u64)
                        };
                        let run = pgb
                            .run(workers, length, &format!("{workers}-{round}"))
                            .await?;
                        keys.effects.fetch_add(run.jobs, Ordering::Relaxed);
                        run
                    }
                    _ => run_variant(&conn, keys, v, workers, set.run).await?,
                };
                let rate = run.jobs as f64 / run.secs;
                if v == Variant::Handwritten {
                    hand_rate = rate;
                }
                let _ = write!(line, " {} {rate:.0}", v.name());
                results.entry((kind, workers, v)).or_default().add(run);
            }
            order.reverse();
            eprintln!("{line}");
        }
        conn.close().await;
        eprintln!(
            "{} / {workers} workers: {:.1} s",
            kind.name(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
