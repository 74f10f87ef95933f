//! Throughput of the seed's top-up job with and without idem, and against pgbench.
//!
//! ```text
//! cargo bench --bench throughput                  # full, ~13 min
//! cargo bench --bench throughput -- --quick      # < 60 s
//! ```
//! Other arguments: `--plot PATH` (default `target/tmp/throughput.png`), `--only postgres|
//! sqlite|mysql`, `--rounds N`, `--run-ms N`.
//!
//! Against the local PostgreSQL, a temporary SQLite file (WAL) and the local MariaDB, the job
//! `UPDATE accounts SET credits = credits + $1 WHERE id = $2` (10 000 accounts, so concurrent
//! jobs rarely meet on a row) runs at 1, 8 and 32 workers (tokio tasks over a pool of as many
//! connections) in these variants:
//!
//! - `plain`: the effect alone in a transaction (the floor);
//! - `handwritten`: the claim written by hand with sqlx, on a marker table made by
//!   `Store::with_table(..).migrate()` so it has idem's schema;
//! - `macro`: the same handler under `#[idem::idempotent]`;
//! - `duplicate`: `macro` re-delivering jobs it already applied;
//! - `pgbench`: the handwritten transaction through `pgbench -M prepared` (PostgreSQL only).
//!
//! Each round runs every variant once, every other round in reverse order, so that whatever
//! else the machine does weighs on all of them alike: only ratios measured within one run mean
//! anything here. Full mode also measures claim latency against 0, 1M and 10M markers and the
//! rate of `Store::purge` (PostgreSQL). Every run checks that each committed effect landed
//! exactly once. Tables are the bench's own (`idem_bench_*`), dropped at start and at the end.
//!
//! Progress goes to stderr; the Markdown report goes to stdout and ends with
//! `ratio macro/handwritten: X.XX` (PostgreSQL, 8 workers).

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{Claim, Key, Store};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres, Sqlite, Transaction};

type BoxError = Box<dyn StdError + Send + Sync>;
type Res<T> = Result<T, BoxError>;

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const MY_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// Enough accounts that concurrent jobs rarely touch the same row.
const ACCOUNTS: u64 = 10_000;
const WORKERS: [usize; 3] = [1, 8, 32];
const SCOPE: &str = "bench.top_up";
/// How long a pgbench run of `--quick` aims to last (see [`PgbenchLength`]).
const PGBENCH_QUICK_RUN: Duration = Duration::from_millis(250);
/// Upper bound of every worker loop, whatever the clock says.
const MAX_JOBS_PER_WORKER: u64 = 1_000_000;

const T_ACCOUNTS: &str = "idem_bench_accounts";
const T_MACRO: &str = "idem_bench_markers";
const T_HAND: &str = "idem_bench_hand";
const T_PGBENCH: &str = "idem_bench_pgbench";
const T_GROWTH: [&str; 3] = [
    "idem_bench_growth_0",
    "idem_bench_growth_1m",
    "idem_bench_growth_10m",
];
const ALL_TABLES: [&str; 7] = [
    T_ACCOUNTS,
    T_MACRO,
    T_HAND,
    T_PGBENCH,
    T_GROWTH[0],
    T_GROWTH[1],
    T_GROWTH[2],
];

// ---------------------------------------------------------------------------------------------
// The job, written once per backend: the effect, the hand-written claim, the macro handler.
// ---------------------------------------------------------------------------------------------

/// The seed's job: add `credits` to `account`; `id` is its stable key.
struct TopUp {
    id: String,
    account: i64,
    credits: i64,
}

/// The three variants on a backend whose claim is `INSERT ... ON CONFLICT DO NOTHING`, written
/// as a user would by hand. Every variant begins with the statement idem uses there (`BEGIN`;
/// `BEGIN IMMEDIATE` on SQLite), so the only difference between them is the marker.
macro_rules! on_conflict_variants {
    ($db:ty, begin: $begin:literal, update: $update:literal, claim: $claim:literal) => {
        use super::*;

        pub(super) const UPDATE: &str = $update;
        const CLAIM: &str = $claim;

        pub(super) async fn plain(pool: &Pool<$db>, job: &TopUp) -> Result<bool, sqlx::Error> {
            let mut tx = pool.begin_with($begin).await?;
            sqlx::query(UPDATE)
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        }

        pub(super) async fn handwritten(
            pool: &Pool<$db>,
            job: &TopUp,
        ) -> Result<bool, sqlx::Error> {
            let mut tx = pool.begin_with($begin).await?;
            let claimed = sqlx::query(CLAIM)
                .bind(SCOPE)
                .bind(job.id.as_str())
                .execute(&mut *tx)
                .await?;
            if claimed.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            sqlx::query(UPDATE)
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        }

        #[idem::idempotent(key = "job.id", scope = "bench.top_up")]
        pub(super) async fn top_up(
            tx: &mut Transaction<'_, $db>,
            job: &TopUp,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(UPDATE)
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }
    };
}

mod pg {
    on_conflict_variants!(
        Postgres,
        begin: "BEGIN",
        update: "UPDATE idem_bench_accounts SET credits = credits + $1 WHERE id = $2",
        // The claim statement idem uses, on the hand-written marker table.
        claim: "INSERT INTO idem_bench_hand (scope, key, completed_at) \
                VALUES ($1, $2, now()) ON CONFLICT DO NOTHING"
    );
}

mod lite {
    on_conflict_variants!(
        Sqlite,
        begin: "BEGIN IMMEDIATE",
        update: "UPDATE idem_bench_accounts SET credits = credits + ?1 WHERE id = ?2",
        claim: "INSERT INTO idem_bench_hand (scope, key, completed_at) \
                VALUES (?1, ?2, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) ON CONFLICT DO NOTHING"
    );
}

mod my {
    use super::*;

    const UPDATE: &str = "UPDATE idem_bench_accounts SET credits = credits + ? WHERE id = ?";
    // MySQL has no ON CONFLICT DO NOTHING: a plain INSERT whose duplicate-key error is the
    // duplicate signal, as idem does it (a plain INSERT; `INSERT IGNORE` would hide every error).
    const CLAIM: &str = "INSERT INTO idem_bench_hand (scope, `key`, completed_at) \
                         VALUES (?, ?, CURRENT_TIMESTAMP(6))";

    pub(super) async fn plain(pool: &Pool<MySql>, job: &TopUp) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query(UPDATE)
            .bind(job.credits)
            .bind(job.account)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(super) async fn handwritten(pool: &Pool<MySql>, job: &TopUp) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin().await?;
        let claimed = sqlx::query(CLAIM)
            .bind(SCOPE)
            .bind(job.id.as_str())
            .execute(&mut *tx)
            .await;
        match claimed {
            Ok(_) => {}
            Err(e)
                if e.as_database_error()
                    .is_some_and(|d| d.is_unique_violation()) =>
            {
                tx.rollback().await?;
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        sqlx::query(UPDATE)
            .bind(job.credits)
            .bind(job.account)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    #[idem::idempotent(key = "job.id", scope = "bench.top_up")]
    pub(super) async fn top_up(
        tx: &mut Transaction<'_, MySql>,
        job: &TopUp,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(UPDATE)
            .bind(job.credits)
            .bind(job.account)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Variants and backends.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    Plain,
    Handwritten,
    Macro,
    Duplicate,
    Pgbench,
}

const VARIANTS: [Variant; 4] = [
    Variant::Plain,
    Variant::Handwritten,
    Variant::Macro,
    Variant::Duplicate,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Handwritten => "handwritten",
            Variant::Macro => "macro",
            Variant::Duplicate => "duplicate",
            Variant::Pgbench => "pgbench",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Postgres,
    Sqlite,
    MySql,
}

const KINDS: [Kind; 3] = [Kind::Postgres, Kind::Sqlite, Kind::MySql];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Postgres => "PostgreSQL",
            Kind::Sqlite => "SQLite (WAL)",
            Kind::MySql => "MariaDB",
        }
    }
}

/// The macro's store; its pool (sized to the worker count) serves every variant.
enum Conn {
    Pg(Store<Postgres>),
    Lite(Store<Sqlite>),
    My(Store<MySql>),
}

impl Conn {
    /// Runs one job; `Ok(true)` if its effect was applied.
    async fn job(&self, variant: Variant, job: &TopUp) -> Result<bool, sqlx::Error> {
        match (self, variant) {
            (Conn::Pg(s), Variant::Plain) => pg::plain(s.pool(), job).await,
            (Conn::Pg(s), Variant::Handwritten) => pg::handwritten(s.pool(), job).await,
            (Conn::Pg(s), _) => Ok(pg::top_up(s, job).await?.is_applied()),
            (Conn::Lite(s), Variant::Plain) => lite::plain(s.pool(), job).await,
            (Conn::Lite(s), Variant::Handwritten) => lite::handwritten(s.pool(), job).await,
            (Conn::Lite(s), _) => Ok(lite::top_up(s, job).await?.is_applied()),
            (Conn::My(s), Variant::Plain) => my::plain(s.pool(), job).await,
            (Conn::My(s), Variant::Handwritten) => my::handwritten(s.pool(), job).await,
            (Conn::My(s), _) => Ok(my::top_up(s, job).await?.is_applied()),
        }
    }

    /// Between worker counts, never during a timed run: the PostgreSQL here runs with
    /// autovacuum off, so the bench vacuums its own tables where autovacuum would have.
    async fn maintain(&self) -> Res<()> {
        if let Conn::Pg(s) = self {
            exec(
                s.pool(),
                &format!("VACUUM ANALYZE {T_ACCOUNTS}, {T_MACRO}, {T_HAND}, {T_PGBENCH}"),
            )
            .await?;
        }
        Ok(())
    }

    async fn close(&self) {
        match self {
            Conn::Pg(s) => s.pool().close().await,
            Conn::Lite(s) => s.pool().close().await,
            Conn::My(s) => s.pool().close().await,
        }
    }
}

/// Key counters of one database: keys are never reused within a marker table, except by
/// `duplicate`, which re-delivers keys `macro` has applied.
#[derive(Default)]
struct Keys {
    hand: AtomicU64,
    applied: AtomicU64,
    dup: AtomicU64,
    /// Effects committed to the accounts table, checked against its sum at the end.
    effects: AtomicU64,
}

/// splitmix64's finaliser: a bijection on u64, so distinct counters give distinct keys.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A job id shaped like a UUID or an md5: 32 hex digits spread over the whole key space.
fn job_id(salt: u64, n: u64) -> String {
    format!("{:016x}{:016x}", mix(n ^ salt), mix(!n))
}

struct Rng(u64);

impl Rng {
    fn account(&mut self) -> i64 {
        self.0 = self.0.wrapping_add(1);
        (mix(self.0) % ACCOUNTS) as i64 + 1
    }
}

// ---------------------------------------------------------------------------------------------
// Measurement.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Settings {
    quick: bool,
    rounds: usize,
    run: Duration,
    warmup: Duration,
}

/// One timed run: how many jobs, how long, each job's latency, and the CPU time this process
/// spent on them (`None` for pgbench, another process).
struct Run {
    jobs: u64,
    secs: f64,
    lat_ns: Vec<u64>,
    cpu_ns: Option<u64>,
}

#[derive(Default)]
struct Agg {
    rates: Vec<f64>,
    lat_ns: Vec<u64>,
    cpu_per_job_us: Vec<f64>,
}

impl Agg {
    fn add(&mut self, run: Run) {
        self.rates.push(run.jobs as f64 / run.secs);
        if let Some(cpu) = run.cpu_ns {
            let all_jobs = run.lat_ns.len().max(1) as f64;
            self.cpu_per_job_us.push(cpu as f64 / 1e3 / all_jobs);
        }
        self.lat_ns.extend(run.lat_ns);
    }
}

type Results = BTreeMap<(Kind, usize, Variant), Agg>;

async fn run_variant(
    conn: &Arc<Conn>,
    keys: &Arc<Keys>,
    variant: Variant,
    workers: usize,
    dur: Duration,
) -> Res<Run> {
    const HAND: u64 = 0x68616e64;
    let applied = keys.applied.load(Ordering::SeqCst);
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
                    Variant::Plain | Variant::Handwritten => {
                        job_id(HAND, keys.hand.fetch_add(1, Ordering::Relaxed))
                    }
                    Variant::Macro => job_id(0, keys.applied.fetch_add(1, Ordering::Relaxed)),
                    Variant::Duplicate => {
                        job_id(0, keys.dup.fetch_add(1, Ordering::Relaxed) % applied)
                    }
                    Variant::Pgbench => unreachable!("pgbench runs on its own"),
                };
                let job = TopUp {
                    id,
                    account: rng.account(),
                    credits: 1,
                };
                let t0 = Instant::now();
                let done = conn.job(variant, &job).await?;
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

// ---------------------------------------------------------------------------------------------
// pgbench.
// ---------------------------------------------------------------------------------------------

/// How long a pgbench run lasts. A duration (`-T`) is what the other variants do, but pgbench
/// counts it in whole seconds and spends some 0.2 s connecting around it; `--quick` runs a
/// number of transactions per client instead (`-t`), aimed at its short runs, at the price of
/// a short tail where the first clients to finish leave the others alone.
#[derive(Clone, Copy)]
enum PgbenchLength {
    Secs(u64),
    PerClient(u64),
}

struct Pgbench {
    bin: PathBuf,
    dir: PathBuf,
    script: PathBuf,
}

fn find_pgbench() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("pgbench"));
    let versioned = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/pgbench"));
    on_path.chain(versioned).find(|p| p.is_file())
}

impl Pgbench {
    fn new(dir: &Path) -> Option<Pgbench> {
        let bin = find_pgbench()?;
        let script = dir.join("top_up.sql");
        // The handwritten transaction, statement for statement. Every key is fresh, so the
        // script needs no branch on the claim's row count.
        let text = format!(
            "\\set aid random(1, {ACCOUNTS})\n\
             \\set k random(1, 9000000000000000000)\n\
             BEGIN;\n\
             INSERT INTO {T_PGBENCH} (scope, key, completed_at) VALUES ('{SCOPE}', :k, now()) \
             ON CONFLICT DO NOTHING;\n\
             UPDATE {T_ACCOUNTS} SET credits = credits + 1 WHERE id = :aid;\n\
             COMMIT;\n"
        );
        std::fs::write(&script, text).ok()?;
        Some(Pgbench {
            bin,
            dir: dir.to_owned(),
            script,
        })
    }

    /// `clients` connections for a length of run; the run's rate is pgbench's own `tps`
    /// (without connection time), latencies come from its per-transaction log.
    async fn run(&self, clients: usize, length: PgbenchLength, tag: &str) -> Res<Run> {
        let prefix = format!("pgbench-{tag}");
        let threads = clients.min(2);
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.args(["-h", "127.0.0.1", "-p", "5432", "-U", "postgres", "-n"])
            .args(["-M", "prepared", "-f"])
            .arg(&self.script)
            .args(["-c", &clients.to_string(), "-j", &threads.to_string()])
            .args(match length {
                PgbenchLength::Secs(secs) => ["-T".to_owned(), secs.to_string()],
                PgbenchLength::PerClient(n) => ["-t".to_owned(), n.to_string()],
            })
            .args(["-l", "--log-prefix"])
            .arg(self.dir.join(&prefix))
            .arg("test")
            .current_dir(&self.dir)
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
            .await
            .map_err(|_| "pgbench ran for more than 120 s")??;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!(
                "pgbench failed ({}): {}{}",
                out.status,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        let field = |name: &str| -> Res<f64> {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(name))
                .ok_or_else(|| format!("no `{name}` in pgbench's output: {stdout}"))?;
            let value = line[name.len()..]
                .trim_start_matches([' ', '=', ':'])
                .split(['/', ' '])
                .next()
                .unwrap_or_default();
            Ok(value.parse::<f64>()?)
        };
        let tps = field("tps")?;
        let jobs = field("number of transactions actually processed")? as u64;
        let mut lat_ns = Vec::with_capacity(jobs as usize);
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let is_log = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{prefix}.")));
            if !is_log {
                continue;
            }
            // client_id transaction_no time_us script_no epoch epoch_us
            for line in std::fs::read_to_string(&path)?.lines() {
                if let Some(us) = line.split(' ').nth(2) {
                    lat_ns.push(us.parse::<u64>()? * 1_000);
                }
            }
            std::fs::remove_file(&path)?;
        }
        Ok(Run {
            jobs,
            secs: jobs as f64 / tps,
            lat_ns,
            cpu_ns: None,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Setup of each database.
// ---------------------------------------------------------------------------------------------

async fn exec<'c, E>(conn: E, sql: &str) -> Res<()>
where
    E: sqlx::Executor<'c>,
{
    conn.execute(sqlx::raw_sql(AssertSqlSafe(sql.to_owned())))
        .await?;
    Ok(())
}

/// `INSERT ... VALUES` of the accounts in batches (MySQL and SQLite).
fn account_batches() -> Vec<String> {
    (0..ACCOUNTS)
        .collect::<Vec<_>>()
        .chunks(1_000)
        .map(|ids| {
            let mut sql = format!("INSERT INTO {T_ACCOUNTS} (id, credits) VALUES ");
            for (i, id) in ids.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                let _ = write!(sql, "{sep}({}, 0)", id + 1);
            }
            sql
        })
        .collect()
}

async fn setup_pg(pool: &Pool<Postgres>) -> Res<()> {
    exec(
        pool,
        &format!("DROP TABLE IF EXISTS {}", ALL_TABLES.join(", ")),
    )
    .await?;
    exec(
        pool,
        &format!("CREATE TABLE {T_ACCOUNTS} (id bigint PRIMARY KEY, credits bigint NOT NULL)"),
    )
    .await?;
    exec(
        pool,
        &format!(
            "INSERT INTO {T_ACCOUNTS} (id, credits) SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g"
        ),
    )
    .await?;
    for t in [T_MACRO, T_HAND, T_PGBENCH] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    exec(pool, &format!("VACUUM ANALYZE {T_ACCOUNTS}")).await
}

async fn setup_lite(pool: &Pool<Sqlite>) -> Res<()> {
    exec(
        pool,
        &format!("CREATE TABLE {T_ACCOUNTS} (id INTEGER PRIMARY KEY, credits INTEGER NOT NULL)"),
    )
    .await?;
    for sql in account_batches() {
        exec(pool, &sql).await?;
    }
    for t in [T_MACRO, T_HAND] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    Ok(())
}

async fn setup_my(pool: &Pool<MySql>) -> Res<()> {
    exec(
        pool,
        &format!("DROP TABLE IF EXISTS {}", ALL_TABLES.join(", ")),
    )
    .await?;
    exec(
        pool,
        &format!(
            "CREATE TABLE {T_ACCOUNTS} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL) \
             ENGINE = InnoDB"
        ),
    )
    .await?;
    for sql in account_batches() {
        exec(pool, &sql).await?;
    }
    for t in [T_MACRO, T_HAND] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The main loop.
// ---------------------------------------------------------------------------------------------

async fn connect(kind: Kind, workers: usize, sqlite: &Path) -> Res<Conn> {
    let n = workers as u32;
    Ok(match kind {
        Kind::Postgres => {
            let pool = PgPoolOptions::new()
                .max_connections(n)
                .min_connections(n)
                .connect(PG_URL)
                .await?;
            Conn::Pg(Store::new(pool).with_table(T_MACRO)?)
        }
        Kind::Sqlite => {
            let pool = SqlitePoolOptions::new()
                .max_connections(n)
                .min_connections(n)
                .connect_with(sqlite_options(sqlite))
                .await?;
            Conn::Lite(Store::new(pool).with_table(T_MACRO)?)
        }
        Kind::MySql => {
            let pool = MySqlPoolOptions::new()
                .max_connections(n)
                .min_connections(n)
                .connect(MY_URL)
                .await?;
            Conn::My(Store::new(pool).with_table(T_MACRO)?)
        }
    })
}

fn sqlite_options(path: &Path) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(30))
}

/// All worker counts of one database, rounds interleaved within each worker count.
async fn bench_kind(
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

struct Args {
    quick: bool,
    plot: Option<PathBuf>,
    only: Option<Kind>,
    rounds: Option<usize>,
    run_ms: Option<u64>,
}

fn parse_args() -> Res<Args> {
    let mut parsed = Args {
        quick: false,
        plot: None,
        only: None,
        rounds: None,
        run_ms: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => parsed.quick = true,
            "--plot" => parsed.plot = Some(args.next().ok_or("--plot needs a path")?.into()),
            "--only" => {
                parsed.only = Some(match args.next().as_deref() {
                    Some("postgres") => Kind::Postgres,
                    Some("sqlite") => Kind::Sqlite,
                    Some("mysql") => Kind::MySql,
                    _ => return Err("--only takes postgres, sqlite or mysql".into()),
                })
            }
            "--rounds" => parsed.rounds = Some(args.next().ok_or("--rounds needs N")?.parse()?),
            "--run-ms" => parsed.run_ms = Some(args.next().ok_or("--run-ms needs N")?.parse()?),
            // `cargo bench` passes `--bench` to every harness-less bench.
            "--bench" => {}
            other => eprintln!("ignoring argument {other:?}"),
        }
    }
    Ok(parsed)
}

#[tokio::main]
async fn main() -> Res<()> {
    let wall = Instant::now();
    let args = parse_args()?;
    let quick = args.quick;
    let set = if quick {
        Settings {
            quick,
            rounds: 5,
            run: Duration::from_millis(100),
            warmup: Duration::from_millis(50),
        }
    } else {
        Settings {
            quick,
            rounds: 12,
            run: Duration::from_secs(1),
            warmup: Duration::from_millis(500),
        }
    };
    let set = Settings {
        rounds: args.rounds.unwrap_or(set.rounds).max(1),
        run: args.run_ms.map_or(set.run, Duration::from_millis),
        ..set
    };
    let dir = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let result = bench(set, &dir, &args).await;
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("wall time: {:.1} s", wall.elapsed().as_secs_f64());
    result
}

async fn bench(set: Settings, dir: &Path, args: &Args) -> Res<()> {
    let mut results = Results::new();
    let pgbench = Pgbench::new(dir);
    if pgbench.is_none() {
        eprintln!("pgbench not found (PATH, /usr/lib/postgresql/*/bin): its rows are left out");
    }
    let sqlite = dir.join("bench.db");
    let mut growth = None;
    for kind in KINDS {
        if args.only.is_some_and(|only| only != kind) {
            continue;
        }
        let t0 = Instant::now();
        let keys = Arc::new(Keys::default());
        let sum = match kind {
            Kind::Postgres => {
                let admin = PgPoolOptions::new()
                    .max_connections(2)
                    .connect(PG_URL)
                    .await?;
                setup_pg(&admin).await?;
                bench_kind(kind, set, &keys, &sqlite, pgbench.as_ref(), &mut results).await?;
                if !set.quick {
                    growth = Some(measure_growth(&admin, set, &keys).await?);
                }
                let sum: (i64,) = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT COALESCE(SUM(credits), 0)::bigint FROM {T_ACCOUNTS}"
                )))
                .fetch_one(&admin)
                .await?;
                exec(
                    &admin,
                    &format!("DROP TABLE IF EXISTS {}", ALL_TABLES.join(", ")),
                )
                .await?;
                admin.close().await;
                sum.0
            }
            Kind::Sqlite => {
                let admin = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(sqlite_options(&sqlite))
                    .await?;
                setup_lite(&admin).await?;
                bench_kind(kind, set, &keys, &sqlite, None, &mut results).await?;
                let sum: (i64,) = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT COALESCE(SUM(credits), 0) FROM {T_ACCOUNTS}"
                )))
                .fetch_one(&admin)
                .await?;
                admin.close().await;
                sum.0
            }
            Kind::MySql => {
                let admin = MySqlPoolOptions::new()
                    .max_connections(2)
                    .connect(MY_URL)
                    .await?;
                setup_my(&admin).await?;
                bench_kind(kind, set, &keys, &sqlite, None, &mut results).await?;
                let sum: (i64,) = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT CAST(COALESCE(SUM(credits), 0) AS SIGNED) FROM {T_ACCOUNTS}"
                )))
                .fetch_one(&admin)
                .await?;
                exec(
                    &admin,
                    &format!("DROP TABLE IF EXISTS {}", ALL_TABLES.join(", ")),
                )
                .await?;
                admin.close().await;
                sum.0
            }
        };
        verify(kind, sum, &keys)?;
        eprintln!("{}: {:.1} s", kind.name(), t0.elapsed().as_secs_f64());
    }

    let report = report(set, &results, growth.as_ref());
    let path = args
        .plot
        .clone()
        .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("throughput.png"));
    match draw(&path, &results) {
        Ok(()) => eprintln!("plot written to {}", path.display()),
        Err(e) => eprintln!("plot not written: {e}"),
    }
    print!("{report}");
    Ok(())
}

fn verify(kind: Kind, sum: i64, keys: &Keys) -> Res<()> {
    let expected = keys.effects.load(Ordering::SeqCst);
    if sum as u64 != expected {
        return Err(format!(
            "{}: the accounts hold {sum} credits, but {expected} effects were committed",
            kind.name()
        )
        .into());
    }
    eprintln!(
        "{}: {expected} effects committed, each exactly once",
        kind.name()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Growth: claim latency against a full marker table, and the purge rate (PostgreSQL).
// ---------------------------------------------------------------------------------------------

const GROWTH_SIZES: [u64; 3] = [0, 1_000_000, 10_000_000];

struct Growth {
    /// Per table: markers before the first claim, claim latencies, whole-job latencies.
    claims: Vec<(u64, Vec<u64>, Vec<u64>)>,
    /// Per purged table: markers in it, rows deleted, seconds.
    purges: Vec<(u64, u64, f64)>,
}

/// Fills `table` with `n` completed markers of the benchmark's scope in one set-based
/// statement. Keys are md5 hex, spread over the key space like the claims' keys; one marker in
/// `old_every` was completed 30 days ago (what `purge` will delete), the others an hour ago.
async fn fill(admin: &Pool<Postgres>, table: &str, n: u64, old_every: u64) -> Res<()> {
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

async fn measure_growth(admin: &Pool<Postgres>, set: Settings, keys: &Keys) -> Res<Growth> {
    const SALT: u64 = 0x67726f77;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .connect(PG_URL)
        .await?;
    let mut stores = Vec::new();
    for (table, n) in T_GROWTH.into_iter().zip(GROWTH_SIZES) {
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
                let Claim::Fresh(mut guard) = store.claim(SCOPE, &key).await? else {
                    return Err(format!("growth: fresh key {key} claimed as a duplicate").into());
                };
                let t1 = Instant::now();
                sqlx::query(pg::UPDATE)
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

// ---------------------------------------------------------------------------------------------
// Report and plot.
// ---------------------------------------------------------------------------------------------

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Nearest-rank percentile of latencies in nanoseconds, in milliseconds.
fn percentile_ms(lat_ns: &[u64], p: f64) -> f64 {
    let mut v = lat_ns.to_vec();
    v.sort_unstable();
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1] as f64 / 1e6
}

fn rate(results: &Results, kind: Kind, workers: usize, v: Variant) -> Option<f64> {
    results.get(&(kind, workers, v)).map(|a| median(&a.rates))
}

fn ratio(results: &Results, kind: Kind, workers: usize, a: Variant, b: Variant) -> Option<f64> {
    Some(rate(results, kind, workers, a)? / rate(results, kind, workers, b)?)
}

/// macro / handwritten round by round (each pair ran back to back): median, min and max.
fn paired(results: &Results, kind: Kind, workers: usize) -> Option<(f64, f64, f64)> {
    let m = &results.get(&(kind, workers, Variant::Macro))?.rates;
    let h = &results.get(&(kind, workers, Variant::Handwritten))?.rates;
    let r: Vec<f64> = m.iter().zip(h).map(|(m, h)| m / h).collect();
    let min = r.iter().copied().fold(f64::INFINITY, f64::min);
    let max = r.iter().copied().fold(0.0, f64::max);
    Some((median(&r), min, max))
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "–".to_owned(), |r| format!("{r:.2}"))
}

fn report(set: Settings, results: &Results, growth: Option<&Growth>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Throughput\n\n\
         jobs/s: median of {} runs of {:.1} s each (min–max beside it); latency: p50 and p99 of \
         every job of those runs; client CPU: CPU time of the bench process per job (for SQLite \
         it includes the database engine, which runs in the process). Variants interleaved run \
         by run, every other round in reverse order.\n",
        set.rounds,
        set.run.as_secs_f64()
    );
    out.push_str(
        "| database | workers | variant | jobs/s | min–max | p50 ms | p99 ms | client CPU µs/job |\n\
         |---|---:|---|---:|---:|---:|---:|---:|\n",
    );
    for ((kind, workers, v), agg) in results {
        let min = agg.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = agg.rates.iter().copied().fold(0.0, f64::max);
        let cpu = if agg.cpu_per_job_us.is_empty() {
            "–".to_owned()
        } else {
            format!("{:.0}", median(&agg.cpu_per_job_us))
        };
        let _ = writeln!(
            out,
            "| {} | {workers} | {} | {:.0} | {min:.0}–{max:.0} | {:.3} | {:.3} | {cpu} |",
            kind.name(),
            v.name(),
            median(&agg.rates),
            percentile_ms(&agg.lat_ns, 50.0),
            percentile_ms(&agg.lat_ns, 99.0),
        );
    }

    out.push_str(
        "\n## Ratios of the medians\n\n\
         | database | workers | macro / handwritten | same, per round: median (min–max) | \
         handwritten / plain | duplicate / macro | macro / pgbench |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for kind in KINDS {
        for workers in WORKERS {
            let r = |a, b| fmt_ratio(ratio(results, kind, workers, a, b));
            let per_round = paired(results, kind, workers).map_or_else(
                || "–".to_owned(),
                |(med, min, max)| format!("{med:.2} ({min:.2}–{max:.2})"),
            );
            let _ = writeln!(
                out,
                "| {} | {workers} | {} | {per_round} | {} | {} | {} |",
                kind.name(),
                r(Variant::Macro, Variant::Handwritten),
                r(Variant::Handwritten, Variant::Plain),
                r(Variant::Duplicate, Variant::Macro),
                r(Variant::Macro, Variant::Pgbench),
            );
        }
    }

    if let Some(g) = growth {
        out.push_str(
            "\n## Growth (PostgreSQL, 1 worker, fresh random keys, tables interleaved)\n\n\
             | markers in the table | claim p50 ms | claim p99 ms | job p50 ms | job p99 ms | \
             claim p50 / empty table |\n|---:|---:|---:|---:|---:|---:|\n",
        );
        let base = percentile_ms(&g.claims[0].1, 50.0);
        for (n, claim, job) in &g.claims {
            let p50 = percentile_ms(claim, 50.0);
            let _ = writeln!(
                out,
                "| {n} | {p50:.3} | {:.3} | {:.3} | {:.3} | {:.2} |",
                percentile_ms(claim, 99.0),
                percentile_ms(job, 50.0),
                percentile_ms(job, 99.0),
                p50 / base
            );
        }
        out.push_str(
            "\n| `Store::purge` on a table of | rows deleted | seconds | rows/s |\n\
             |---:|---:|---:|---:|\n",
        );
        for (n, deleted, secs) in &g.purges {
            let _ = writeln!(
                out,
                "| {n} | {deleted} | {secs:.1} | {:.0} |",
                *deleted as f64 / secs
            );
        }
    }

    out.push_str("\n## Targets\n\n| target | measured | met |\n|---|---|---|\n");
    let mut target = |name: &str, values: Vec<(String, Option<f64>)>, ok: &dyn Fn(f64) -> bool| {
        let measured: Vec<String> = values
            .iter()
            .map(|(label, v)| format!("{label} {}", fmt_ratio(*v)))
            .collect();
        let met = values.iter().all(|(_, v)| v.is_some_and(ok));
        let _ = writeln!(
            out,
            "| {name} | {} | {} |",
            measured.join(", "),
            if met { "yes" } else { "**no**" }
        );
    };
    for kind in KINDS {
        target(
            &format!("{}: macro / handwritten ≥ 0.98", kind.name()),
            WORKERS
                .iter()
                .map(|&w| {
                    let r = ratio(results, kind, w, Variant::Macro, Variant::Handwritten);
                    (format!("{w}w"), r)
                })
                .collect(),
            &|r| r >= 0.98,
        );
    }
    for kind in KINDS {
        target(
            &format!("{}: duplicate / macro ≥ 3", kind.name()),
            WORKERS
                .iter()
                .map(|&w| {
                    let r = ratio(results, kind, w, Variant::Duplicate, Variant::Macro);
                    (format!("{w}w"), r)
                })
                .collect(),
            &|r| r >= 3.0,
        );
    }
    target(
        "PostgreSQL: macro / pgbench ≥ 0.85 at 8 clients",
        vec![(
            "8w".to_owned(),
            ratio(results, Kind::Postgres, 8, Variant::Macro, Variant::Pgbench),
        )],
        &|r| r >= 0.85,
    );
    if let Some(g) = growth {
        let at = |i: usize| percentile_ms(&g.claims[i].1, 50.0);
        target(
            "PostgreSQL: claim p50 at 10M markers / at 0 ≤ 1.2",
            vec![("".to_owned(), Some(at(2) / at(0)))],
            &|r| r <= 1.2,
        );
    }

    let _ = writeln!(
        out,
        "\nratio macro/handwritten: {}",
        fmt_ratio(ratio(
            results,
            Kind::Postgres,
            8,
            Variant::Macro,
            Variant::Handwritten
        ))
    );
    out
}

/// A font for the plot's text: plotters' `ab_glyph` feature needs no system font library, only
/// the bytes of a TrueType font (Debian's fonts-dejavu-core).
fn register_font() -> Res<()> {
    const FONTS: [&str; 2] = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ];
    let bytes = FONTS
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or("no DejaVuSans.ttf found (apt-get install fonts-dejavu-core)")?;
    plotters::style::register_font(
        "sans-serif",
        plotters::style::FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| "DejaVuSans.ttf is not a usable font")?;
    Ok(())
}

/// jobs/s by workers, one panel per database, one line per variant.
fn draw(path: &Path, results: &Results) -> Res<()> {
    use plotters::prelude::*;

    register_font()?;
    let (width, height) = (1500_u32, 520_u32);
    let mut buf = vec![255_u8; (width * height * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (title, body) = root.split_vertically(40);
        title.draw(&Text::new(
            "idem: top-up jobs/s by concurrent workers (median of the runs)",
            (20, 10),
            ("sans-serif", 22).into_font(),
        ))?;
        let styles: [(Variant, RGBColor, bool); 5] = [
            (Variant::Plain, RGBColor(120, 120, 120), false),
            (Variant::Handwritten, RGBColor(31, 119, 180), true),
            (Variant::Macro, RGBColor(214, 39, 40), false),
            (Variant::Duplicate, RGBColor(44, 160, 44), false),
            (Variant::Pgbench, RGBColor(255, 127, 14), false),
        ];
        for (panel, kind) in body.split_evenly((1, 3)).iter().zip(KINDS) {
            let ymax = results
                .iter()
                .filter(|((k, _, _), _)| *k == kind)
                .map(|(_, a)| median(&a.rates))
                .fold(1.0, f64::max)
                * 1.45; // headroom for the legend
            let mut chart = ChartBuilder::on(panel)
                .caption(kind.name(), ("sans-serif", 20))
                .margin(15)
                .x_label_area_size(45)
                .y_label_area_size(70)
                .build_cartesian_2d(-0.4_f64..5.4_f64, 0.0..ymax)?;
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .x_labels(6)
                .x_label_formatter(&|x| match x.round() as i64 {
                    0 => "1".to_owned(),
                    3 => "8".to_owned(),
                    5 => "32".to_owned(),
                    _ => String::new(),
                })
                .y_label_formatter(&|y| format!("{y:.0}"))
                .x_desc("workers (log scale)")
                .y_desc("jobs/s")
                .label_style(("sans-serif", 14))
                .draw()?;
            for (variant, color, dashed) in styles {
                let points: Vec<(f64, f64)> = WORKERS
                    .iter()
                    .filter_map(|&w| {
                        rate(results, kind, w, variant).map(|r| ((w as f64).log2(), r))
                    })
                    .collect();
                if points.is_empty() {
                    continue;
                }
                let style = color.stroke_width(if dashed { 4 } else { 2 });
                let series = if dashed {
                    chart.draw_series(DashedLineSeries::new(points.clone(), 10, 6, style))?
                } else {
                    chart.draw_series(LineSeries::new(points.clone(), style))?
                };
                series.label(variant.name()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(3))
                });
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()?;
        }
        root.present()?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header()?.write_image_data(&buf)?;
    Ok(())
}
