//! `--group`: group commit against the single-job macro and the hand-written transaction per
//! job, and a batch run job by job with one poisoned job against a clean one (`each.rs`;
//! `--group --each` runs only those).
//!
//! The top-up job of the other rows, at 1, 8 and 32 workers: `handwritten` (one transaction
//! per job, by hand), `macro` (`#[idem::idempotent]`), `group` (the same handler with
//! `group`, called with an `idem::Group` of the default options). Variants alternate round by
//! round, every other round in reverse. For `macro` and `group` the bench also times each
//! job's wait from the end of its body to its answer: the commit for the macro, the group's
//! gathering and commit for `group`. `IDEM_BENCH_GROUP_ACCOUNTS=10` runs them on hot rows
//! (every job tops up one of 10 accounts).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::{Group, GroupOptions};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{AssertSqlSafe, MySql, Postgres, Sqlite, Transaction};

use crate::config::config;
use crate::measure::{Agg, Run, connect, sqlite_options};
use crate::report::{median, percentile_ms};
use crate::scale::{server_cpu, server_used};
use crate::setup::{drop_tables, setup_lite, setup_my, setup_pg};
use crate::variants::{Conn, KINDS, Kind, TopUp, job_id, mix};
use crate::{ACCOUNTS, BoxError, MAX_JOBS_PER_WORKER, Res, each, variants};

const WORKERS: [usize; 3] = [1, 8, 32];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum V {
    Hand,
    Macro,
    /// Group commit with this many lanes, a call's lane by its key.
    Group(usize),
    /// Group commit with this many lanes, a call's lane by its account (`lane = ..`).
    ByAccount(usize),
    /// `#[idem::idempotent(batch = ..)]` with batches of this many jobs.
    Batch(usize),
}

impl V {
    fn name(self) -> String {
        match self {
            V::Hand => "handwritten".to_owned(),
            V::Macro => "macro".to_owned(),
            V::Group(lanes) => format!("group, {lanes} lanes"),
            V::ByAccount(lanes) => format!("group, {lanes} lanes by account"),
            V::Batch(size) => format!("batch of {size}"),
        }
    }
}

/// How many accounts the jobs of these rows top up: `IDEM_BENCH_GROUP_ACCOUNTS`, else the
/// other rows' (cold rows). A few (10) is the hot-row workload, where calls of different keys
/// update the same rows.
fn accounts() -> u64 {
    std::env::var("IDEM_BENCH_GROUP_ACCOUNTS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(ACCOUNTS)
}

/// What the single-job rows run besides the macro and the hand-written code.
#[derive(Clone)]
pub(crate) struct Rows {
    /// A group of each of these lane counts.
    pub(crate) lanes: Vec<usize>,
    /// A group of each of these lane counts, the calls' lanes chosen by their accounts.
    pub(crate) by_account: Vec<usize>,
    /// Batches of this size, if any.
    pub(crate) batch: Option<usize>,
    /// The poisoned batch's rows (`each.rs`) too.
    pub(crate) each: bool,
}

impl Rows {
    /// Every lane count a group of these rows is made with.
    fn all_lanes(&self) -> Vec<usize> {
        let mut lanes: Vec<usize> = self.lanes.iter().chain(&self.by_account).copied().collect();
        lanes.sort_unstable();
        lanes.dedup();
        lanes
    }

    /// `--group`'s rows: the lanes of [`lane_counts`], no batch.
    fn group() -> Rows {
        Rows {
            lanes: lane_counts(),
            by_account: by_account_lanes(),
            batch: None,
            each: true,
        }
    }
}

/// The lanes of the group rows: `IDEM_BENCH_GROUP_LANES` (a comma list), else the default
/// options' and twice as many.
fn lane_counts() -> Vec<usize> {
    let default = GroupOptions::new().get_lanes();
    std::env::var("IDEM_BENCH_GROUP_LANES")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|n| n.trim().parse().ok())
                .collect::<Vec<usize>>()
        })
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| vec![default, 2 * default])
}

/// The lanes of the group rows whose calls pick their lane by account:
/// `IDEM_BENCH_GROUP_LANES_BY_ACCOUNT` (a comma list; empty for none), else 4.
fn by_account_lanes() -> Vec<usize> {
    match std::env::var("IDEM_BENCH_GROUP_LANES_BY_ACCOUNT") {
        Ok(v) => v.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
        Err(_) => vec![4],
    }
}

/// When the body ended, to time the wait for the commit.
#[derive(Default)]
struct BodyEnd(Mutex<Option<Instant>>);

impl BodyEnd {
    fn mark(&self) {
        *self.0.lock().expect("not poisoned") = Some(Instant::now());
    }

    fn waited(&self) -> Option<u64> {
        let end = self.0.lock().expect("not poisoned").take()?;
        Some(end.elapsed().as_nanos() as u64)
    }
}

macro_rules! handlers {
    ($db:ty, $update:path) => {
        use super::*;

        #[idem::idempotent(key = "job.id", scope = "bench.top_up")]
        pub(super) async fn single(
            tx: &mut Transaction<'_, $db>,
            job: &TopUp,
            end: &BodyEnd,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($update())
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut **tx)
                .await?;
            end.mark();
            Ok(())
        }

        #[idem::idempotent(key = "job.id", scope = "bench.top_up", group, lane = "job.account")]
        pub(super) async fn by_account(
            tx: &mut Transaction<'_, $db>,
            job: &TopUp,
            end: &BodyEnd,
        ) -> Result<(), sqlx::Error> {
            grouped_body(tx, job, end).await
        }

        async fn grouped_body(
            tx: &mut Transaction<'_, $db>,
            job: &TopUp,
            end: &BodyEnd,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($update())
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut **tx)
                .await?;
            end.mark();
            Ok(())
        }

        #[idem::idempotent(key = "job.id", scope = "bench.top_up", group)]
        pub(super) async fn grouped(
            tx: &mut Transaction<'_, $db>,
            job: &TopUp,
            end: &BodyEnd,
        ) -> Result<(), sqlx::Error> {
            grouped_body(tx, job, end).await
        }
    };
}

mod pg {
    handlers!(Postgres, variants::pg::update);
}
mod lite {
    handlers!(Sqlite, variants::lite::update);
}
mod my {
    handlers!(MySql, variants::my::update);
}

enum Grouped {
    Pg(Group<Postgres>),
    Lite(Group<Sqlite>),
    My(Group<MySql>),
}

/// A group for each lane count.
type Groups = Vec<(usize, Grouped)>;

/// One job of `v`; `Ok(Some(wait))` with the wait after its body, where timed.
async fn job(conn: &Conn, groups: &Groups, v: V, job: &TopUp) -> Res<(bool, Option<u64>)> {
    let end = BodyEnd::default();
    let lanes = match v {
        V::Group(lanes) | V::ByAccount(lanes) => lanes,
        _ => 0,
    };
    let group = groups
        .iter()
        .find(|(n, _)| *n == lanes)
        .map_or(&groups[0].1, |(_, g)| g);
    let applied = match (conn, group, v) {
        (_, _, V::Batch(_)) => unreachable!("a batch is run by `batch_job`"),
        (_, _, V::Hand) => conn.job(variants::Variant::Handwritten, job).await?,
        (Conn::Pg(s), _, V::Macro) => pg::single(s, job, &end).await?.is_applied(),
        (Conn::Lite(s), _, V::Macro) => lite::single(s, job, &end).await?.is_applied(),
        (Conn::My(s), _, V::Macro) => my::single(s, job, &end).await?.is_applied(),
        (_, group, v) => grouped_job(group, job, &end, matches!(v, V::ByAccount(_))).await?,
    };
    Ok((applied, end.waited()))
}

/// Each single-job row's median jobs/s, as (workers, variant, jobs/s), for `--standby`'s
/// plot and targets.
pub(crate) static MEDIANS: Mutex<Vec<(usize, String, f64)>> = Mutex::new(Vec::new());

/// How many grouped jobs were delivered again, and the most deliveries one job may get.
static REDELIVERED: AtomicU64 = AtomicU64::new(0);
const DELIVERIES: usize = 5;

/// A grouped job, delivered again when its group failed or it lost a deadlock, as a consumer
/// nacks it and the broker redelivers: on MariaDB two lanes' open groups can each hold a row
/// the other's next body updates, and InnoDB rolls one group back whole.
async fn grouped_job(group: &Grouped, job: &TopUp, end: &BodyEnd, by_account: bool) -> Res<bool> {
    let mut delivery = 0;
    loop {
        delivery += 1;
        let done = match (group, by_account) {
            (Grouped::Pg(g), false) => pg::grouped(g, job, end).await,
            (Grouped::Pg(g), true) => pg::by_account(g, job, end).await,
            (Grouped::Lite(g), false) => lite::grouped(g, job, end).await,
            (Grouped::Lite(g), true) => lite::by_account(g, job, end).await,
            (Grouped::My(g), false) => my::grouped(g, job, end).await,
            (Grouped::My(g), true) => my::by_account(g, job, end).await,
        };
        let e = match done {
            Ok(outcome) => return Ok(outcome.is_applied()),
            Err(e) => idem::Error::from(e),
        };
        let again =
            matches!(e, idem::Error::NotKept(idem::NotKept::Group { .. })) || e.is_transient();
        if !again || delivery == DELIVERIES {
            return Err(e.into());
        }
        REDELIVERED.fetch_add(1, Ordering::Relaxed);
    }
}

/// Salts of the keys, apart from the other rows' and from each other.
const SALT: u64 = 0x6772_6f75_7000;

/// A batch of `size` fresh jobs; returns how many were applied (all of them, or an error).
/// Each worker tops up accounts of its own (account ≡ worker mod workers), as `batch.rs`'s
/// rows do: two batches' updates never wait on each other's rows.
async fn batch_job(
    conn: &Conn,
    next: &AtomicU64,
    seed: &mut u64,
    (worker, workers): (usize, usize),
    size: usize,
) -> Res<u64> {
    let per_worker = (accounts() / workers as u64).max(1);
    let jobs: Vec<crate::batch::Job> = (0..size)
        .map(|_| {
            *seed = mix(*seed);
            crate::batch::Job {
                id: job_id(SALT, next.fetch_add(1, Ordering::Relaxed)),
                account: ((*seed % per_worker) * workers as u64 + worker as u64 + 1) as i64,
            }
        })
        .collect();
    let applied = conn.batch(crate::batch::BatchVariant::Macro, &jobs).await?;
    if applied != size as u64 {
        return Err(format!("{applied} of a batch of {size} fresh jobs were applied").into());
    }
    Ok(applied)
}

/// The server's processes' command, to read their CPU time from /proc.
fn server_comm(conn: &Conn) -> Option<&'static str> {
    match conn {
        Conn::Pg(_) => Some("postgres"),
        Conn::My(_) => Some("mariadbd"),
        Conn::Lite(_) => None,
    }
}

/// Runs `v` at `workers` for `dur`: jobs in the window (with this process's CPU time),
/// latencies, waits, and the database server's CPU µs a job (`None` for SQLite, which runs in
/// this process).
async fn run(
    conn: &Arc<Conn>,
    group: &Arc<Groups>,
    next: &Arc<AtomicU64>,
    v: V,
    workers: usize,
    dur: Duration,
) -> Res<(Run, Vec<u64>, u64, Option<f64>)> {
    let server = server_comm(conn).map(|comm| (comm, server_cpu(comm, None)));
    let cpu = cpu_time::ProcessTime::now();
    let start = Instant::now();
    let deadline = start + dur;
    let mut tasks = Vec::new();
    let accounts = accounts();
    for w in 0..workers {
        let (conn, group, next) = (conn.clone(), group.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut waits) = (Vec::new(), Vec::new());
            let (mut in_window, mut effects) = (0, 0);
            let mut seed = mix(w as u64 ^ start.elapsed().as_nanos() as u64);
            for _ in 0..MAX_JOBS_PER_WORKER {
                if Instant::now() >= deadline {
                    break;
                }
                seed = mix(seed);
                let t0 = Instant::now();
                if let V::Batch(size) = v {
                    let applied = batch_job(&conn, &next, &mut seed, (w, workers), size).await?;
                    let t1 = Instant::now();
                    lat.push((t1 - t0).as_nanos() as u64);
                    effects += applied;
                    if t1 <= deadline {
                        in_window += applied;
                    }
                    continue;
                }
                let top_up = TopUp {
                    id: job_id(SALT, next.fetch_add(1, Ordering::Relaxed)),
                    account: (seed % accounts + 1) as i64,
                    credits: 1,
                };
                let (applied, waited) = job(&conn, &group, v, &top_up).await?;
                waits.extend(waited);
                let applied = u64::from(applied);
                let t1 = Instant::now();
                lat.push((t1 - t0).as_nanos() as u64);
                effects += applied;
                if t1 <= deadline {
                    in_window += applied;
                }
            }
            Ok::<_, BoxError>((lat, waits, in_window, effects))
        }));
    }
    let (mut lat_ns, mut waits, mut jobs, mut effects) = (Vec::new(), Vec::new(), 0, 0);
    for t in tasks {
        let (lat, wait, in_window, done) = t.await??;
        lat_ns.extend(lat);
        waits.extend(wait);
        jobs += in_window;
        effects += done;
    }
    let cpu_ns = cpu.elapsed().as_nanos() as u64;
    let server_ns = server
        .map(|(comm, before)| server_used(&before, &server_cpu(comm, None)).as_nanos() as u64);
    let secs = dur.as_secs_f64();
    // A batch's latency is the batch's; its CPU is shared by its jobs.
    let per = match v {
        V::Batch(size) => size as u64,
        _ => 1,
    };
    let server_per_job =
        server_ns.map(|ns| ns as f64 / 1e3 / (lat_ns.len().max(1) as u64 * per) as f64);
    let run = Run {
        jobs,
        secs,
        lat_ns,
        cpu_ns: Some(cpu_ns / per),
    };
    Ok((run, waits, effects, server_per_job))
}

/// The credits the accounts hold, as a signed 64-bit sum.
macro_rules! credits {
    ($pool:expr, $sql:literal) => {{
        let sql = format!($sql, accounts = config().accounts);
        sqlx::query_as::<_, (i64,)>(AssertSqlSafe(sql))
            .fetch_one($pool)
            .await
            .map(|(sum,)| sum)
            .map_err(BoxError::from)
    }};
}

/// `cargo bench --bench throughput -- --group [--each] [--quick] [--only DB] [--rounds N]
/// [--run-ms N]`; with `--each`, only the batch rows.
pub(crate) async fn bench(
    only: Option<Kind>,
    rounds: usize,
    run_for: Duration,
    each_only: bool,
) -> Res<String> {
    bench_with(only, rounds, run_for, each_only, &Rows::group()).await
}

/// [`bench`] with other single-job rows.
pub(crate) async fn bench_with(
    only: Option<Kind>,
    rounds: usize,
    run_for: Duration,
    each_only: bool,
    rows: &Rows,
) -> Res<String> {
    let mut out = String::new();
    let dir = std::env::temp_dir().join(format!("idem-bench-group-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sqlite = dir.join("group.db");
    for kind in KINDS {
        if only.is_some_and(|o| o != kind) {
            continue;
        }
        let t0 = Instant::now();
        let measured = match kind {
            Kind::Postgres => {
                let admin = PgPoolOptions::new().connect(&config().pg_url).await?;
                setup_pg(&admin).await?;
                let done = bench_kind(kind, &sqlite, rounds, run_for, each_only, rows).await;
                let sum = credits!(
                    &admin,
                    "SELECT COALESCE(SUM(credits), 0)::bigint FROM {accounts}"
                );
                drop_tables(&admin).await?;
                admin.close().await;
                check(done, sum?)?
            }
            Kind::Sqlite => {
                let admin = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(sqlite_options(&sqlite))
                    .await?;
                setup_lite(&admin).await?;
                let done = bench_kind(kind, &sqlite, rounds, run_for, each_only, rows).await;
                let sum = credits!(&admin, "SELECT COALESCE(SUM(credits), 0) FROM {accounts}");
                admin.close().await;
                check(done, sum?)?
            }
            Kind::MySql => {
                let admin = MySqlPoolOptions::new().connect(&config().my_url).await?;
                setup_my(&admin).await?;
                let done = bench_kind(kind, &sqlite, rounds, run_for, each_only, rows).await;
                let sum = credits!(
                    &admin,
                    "SELECT CAST(COALESCE(SUM(credits), 0) AS SIGNED) FROM {accounts}"
                );
                drop_tables(&admin).await?;
                admin.close().await;
                check(done, sum?)?
            }
        };
        out.push_str(&measured);
        eprintln!("{}: {:.1} s", kind.name(), t0.elapsed().as_secs_f64());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}

/// The report of one database, once its accounts hold exactly the credits of the applied
/// jobs.
fn check(done: Res<(String, u64)>, sum: i64) -> Res<String> {
    let (report, effects) = done?;
    if sum as u64 != effects {
        return Err(
            format!("the accounts hold {sum} credits, but {effects} jobs were applied").into(),
        );
    }
    let again = REDELIVERED.swap(0, Ordering::Relaxed);
    eprintln!("{effects} jobs applied, each exactly once ({again} grouped deliveries again)");
    Ok(report)
}

/// The report of one database (its group rows unless `each_only`, then its batch rows), and
/// the jobs it applied.
async fn bench_kind(
    kind: Kind,
    sqlite: &std::path::Path,
    rounds: usize,
    dur: Duration,
    each_only: bool,
    single: &Rows,
) -> Res<(String, u64)> {
    let mut report = String::new();
    writeln!(
        report,
        "\n#### {} (rounds {rounds}, runs of {} ms)",
        kind.name(),
        dur.as_millis()
    )?;
    let mut effects = 0;
    if !each_only {
        let (rows, applied) = group_rows(kind, sqlite, rounds, dur, single).await?;
        report.push_str(&rows);
        effects += applied;
    }
    if single.each {
        let (rows, applied) = each::rows(kind, sqlite, rounds, dur).await?;
        report.push_str(&rows);
        effects += applied;
    }
    Ok((report, effects))
}

/// The single-job rows: group commit against the macro and the hand-written code.
async fn group_rows(
    kind: Kind,
    sqlite: &std::path::Path,
    rounds: usize,
    dur: Duration,
    single: &Rows,
) -> Res<(String, u64)> {
    let next = Arc::new(AtomicU64::new(0));
    let mut effects = 0;
    let mut rows = String::new();
    let warm = Duration::from_millis(100);
    let mut singles = Vec::new();
    for workers in WORKERS {
        let conn = Arc::new(
            connect(
                kind,
                workers + 2 * single.all_lanes().into_iter().max().unwrap_or(1),
                sqlite,
            )
            .await?,
        );
        // The PostgreSQL here runs without autovacuum: vacuum between worker counts, as the
        // main rows do, never during a timed run.
        conn.maintain().await?;
        let group = Arc::new(grouped(&conn, &single.all_lanes())?);
        let variants = [V::Hand, V::Macro].into_iter();
        let mut aggs: Vec<(V, Agg, Vec<u64>, Vec<f64>)> = variants
            .chain(single.lanes.iter().copied().map(V::Group))
            .chain(single.by_account.iter().copied().map(V::ByAccount))
            .chain(single.batch.map(V::Batch))
            .map(|v| (v, Agg::default(), Vec::new(), Vec::new()))
            .collect();
        for (v, ..) in &aggs {
            effects += run(&conn, &group, &next, *v, workers, warm).await?.2;
        }
        for round in 0..rounds {
            let order: Vec<usize> = match round % 2 {
                0 => (0..aggs.len()).collect(),
                _ => (0..aggs.len()).rev().collect(),
            };
            for i in order {
                let (v, agg, waits, server) = &mut aggs[i];
                let (r, w, e, cpu) = run(&conn, &group, &next, *v, workers, dur).await?;
                effects += e;
                waits.extend(w);
                server.extend(cpu);
                agg.add(r);
            }
        }
        let rate = |v: V| {
            aggs.iter()
                .find(|a| a.0 == v)
                .map(|a| median(&a.1.rates))
                .unwrap_or(0.0)
        };
        for (v, agg, waits, server) in &aggs {
            let server = match server.is_empty() {
                true => "–".to_owned(),
                false => format!("{:.0}", median(server)),
            };
            let wait = match waits.is_empty() {
                true => "–".to_owned(),
                false => format!(
                    "{:.3} / {:.3}",
                    percentile_ms(waits, 50.0),
                    percentile_ms(waits, 99.0)
                ),
            };
            writeln!(
                rows,
                "| {} | {workers} | {} | {:.0} | {:.3} | {:.3} | {wait} | {:.0} | {server} |",
                kind.name(),
                v.name(),
                median(&agg.rates),
                percentile_ms(&agg.lat_ns, 50.0),
                percentile_ms(&agg.lat_ns, 99.0),
                median(&agg.cpu_per_job_us),
            )?;
        }
        let medians = aggs
            .iter()
            .map(|(v, agg, ..)| (workers, v.name(), median(&agg.rates)));
        MEDIANS.lock().expect("not poisoned").extend(medians);
        let grouped = (single.lanes.iter().copied().map(V::Group))
            .chain(single.by_account.iter().copied().map(V::ByAccount));
        for v in grouped {
            let lanes = match v {
                V::ByAccount(lanes) => format!("{lanes} by account"),
                V::Group(lanes) => lanes.to_string(),
                _ => unreachable!("group variants only"),
            };
            let group = rate(v);
            singles.push((
                workers,
                lanes,
                group / rate(V::Macro),
                group / rate(V::Hand),
            ));
        }
        conn.close().await;
    }
    let mut report = String::new();
    writeln!(
        report,
        "\n| database | workers | variant | jobs/s | p50 ms | p99 ms | wait after the body p50 / p99 ms \
         | CPU µs a job: bench | server |"
    )?;
    writeln!(report, "|---|---:|---|---:|---:|---:|---:|---:|---:|")?;
    report.push_str(&rows);
    writeln!(
        report,
        "\n| database | workers | lanes | group / macro | group / handwritten |"
    )?;
    writeln!(report, "|---|---:|---:|---:|---:|")?;
    for (workers, lanes, over_macro, over_hand) in singles {
        writeln!(
            report,
            "| {} | {workers} | {lanes} | {over_macro:.2} | {over_hand:.2} |",
            kind.name()
        )?;
    }
    Ok((report, effects))
}

fn grouped(conn: &Conn, lanes: &[usize]) -> Res<Groups> {
    let mut groups = Vec::new();
    for &lanes in lanes {
        let options = GroupOptions::new().lanes(lanes);
        let group = match conn {
            Conn::Pg(s) => Grouped::Pg(s.group(options)?),
            Conn::Lite(s) => Grouped::Lite(s.group(options)?),
            Conn::My(s) => Grouped::My(s.group(options)?),
        };
        groups.push((lanes, group));
    }
    Ok(groups)
}
