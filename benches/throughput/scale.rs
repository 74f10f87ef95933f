//! `--scale`: the scaling curve. 1, 2, 4 and 8 worker *processes* on one database server, each
//! running `TASKS` tasks of the macro's job (`#[idem::idempotent]` top-up) on a pool of its
//! own, as separately deployed workers would.
//!
//! Every process applies keys of its own, and every `CROSS`-th job it also delivers the key its
//! neighbour process is applying at the same position: a duplicate delivery that races with the
//! first one across processes (with one process, its own key again). The report gives the
//! applied jobs per second of all processes together, how that grows with the processes, the
//! share of the machine's CPU that the database server and the workers used in the timed
//! window (which one is the limit), and the doubled effects, which must be 0: after each step
//! the accounts' credits must equal the markers, or the run fails.
//!
//! The children are this same binary with `--scale-worker`; they connect, say `ready`, wait
//! for `go` on stdin (so connecting is not timed), run for the window and print one line of
//! counts. The tables are the parent's (`IDEM_BENCH_SUFFIX`).
//!
//! `--scale --galera` runs the same curve on a three-node MariaDB Galera cluster it starts for
//! the run and removes after it ([`galera`]): process `i` connects to node `i mod 3`.

use std::collections::HashMap;
use std::io::Write as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use idem::Store;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::config::config;
use crate::setup::{drop_tables, setup_my, setup_pg};
use crate::variants::{Kind, TopUp, job_id, mix, my, pg};
use crate::{ACCOUNTS, Res};

mod galera;

const PROCESSES: [usize; 4] = [1, 2, 4, 8];
/// Tasks per process: each process is a worker of its own with a small pool.
const TASKS: usize = 4;
/// Every `CROSS`-th job of a task also delivers its neighbour process's key.
const CROSS: u64 = 4;
/// A failed job (a deadlock victim, say) is delivered again up to this many times.
const RETRIES: usize = 5;

/// What one child did in the timed window.
#[derive(Default, Clone, Copy)]
struct Counts {
    applied: u64,
    duplicate: u64,
    errors: u64,
    /// Of the errors, the ones MariaDB answered with 1213: a deadlock, or on Galera a
    /// transaction that certification (or another node's writes) aborted.
    conflicts: u64,
    cpu: Duration,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.applied += other.applied;
        self.duplicate += other.duplicate;
        self.errors += other.errors;
        self.conflicts += other.conflicts;
        self.cpu += other.cpu;
    }
}

/// The key a task of process `proc` applies at position `n`: distinct per (proc, task, n).
fn key(proc: usize, task: usize, n: u64) -> TopUp {
    let salt = mix(((proc as u64) << 32) | task as u64);
    let id = job_id(salt, n);
    TopUp {
        account: (mix(salt ^ n) % ACCOUNTS) as i64 + 1,
        id,
        credits: 1,
    }
}

enum Worker {
    Pg(Store<Postgres>),
    My(Store<MySql>),
}

impl Worker {
    async fn job(&self, job: &TopUp) -> Result<bool, sqlx::Error> {
        match self {
            Worker::Pg(s) => Ok(pg::top_up(s, job).await?.is_applied()),
            Worker::My(s) => Ok(my::top_up(s, job).await?.is_applied()),
        }
    }
}

/// Runs one delivery, delivering it again after an error, as a broker would.
async fn deliver(worker: &Worker, job: &TopUp, counts: &mut Counts) {
    for _ in 0..RETRIES {
        match worker.job(job).await {
            Ok(true) => return counts.applied += 1,
            Ok(false) => return counts.duplicate += 1,
            Err(e) => {
                counts.errors += 1;
                // idem's own errors travel inside a `sqlx::Error`: back to one, whose
                // database error (if any) is the server's.
                let number = idem_scale::mariadb_jobs::number_of(&idem::Error::from(e));
                if number == Some(idem_scale::mariadb_jobs::ER_LOCK_DEADLOCK) {
                    counts.conflicts += 1;
                }
            }
        }
    }
}

/// The child: `--scale-worker KIND PROC PROCS RUN_MS`.
pub(crate) async fn child(argv: &[String]) -> Res<()> {
    let [kind, proc, procs, run_ms] = argv else {
        return Err("--scale-worker takes KIND PROC PROCS RUN_MS".into());
    };
    let (proc, procs): (usize, usize) = (proc.parse()?, procs.parse()?);
    let run = Duration::from_millis(run_ms.parse()?);
    let n = TASKS as u32 + 1;
    let worker = match kind.as_str() {
        "postgres" => Worker::Pg(
            Store::new(
                PgPoolOptions::new()
                    .test_before_acquire(false)
                    .max_connections(n)
                    .min_connections(n)
                    .connect(&config().pg_url)
                    .await?,
            )
            .with_table(&config().markers)?,
        ),
        "mysql" => Worker::My(
            Store::new(
                MySqlPoolOptions::new()
                    .test_before_acquire(false)
                    .max_connections(n)
                    .min_connections(n)
                    .connect(&config().my_url)
                    .await?,
            )
            .with_table(&config().markers)?,
        ),
        other => return Err(format!("--scale-worker: no database {other}").into()),
    };
    let worker = std::sync::Arc::new(worker);
    // Blocking reads and writes of the standard streams: nothing else runs in this process
    // while it waits, and tokio's `io-std` feature would rebuild the workspace's tokio.
    let mut stdout = std::io::stdout();
    stdout.write_all(b"ready\n")?;
    stdout.flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    if line.trim() != "go" {
        return Err(format!("--scale-worker: expected `go`, got {line:?}").into());
    }
    let cpu = cpu_time::ProcessTime::now();
    let deadline = Instant::now() + run;
    let neighbour = (proc + 1) % procs;
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let worker = worker.clone();
            tokio::spawn(async move {
                let mut counts = Counts::default();
                let mut n = 0;
                while Instant::now() < deadline && n < crate::MAX_JOBS_PER_WORKER {
                    deliver(&worker, &key(proc, task, n), &mut counts).await;
                    if n % CROSS == 0 {
                        deliver(&worker, &key(neighbour, task, n), &mut counts).await;
                    }
                    n += 1;
                }
                counts
            })
        })
        .collect();
    let mut counts = Counts::default();
    for task in tasks {
        counts.add(task.await?);
    }
    let cpu = cpu.elapsed();
    let line = format!(
        "{} {} {} {} {}\n",
        counts.applied,
        counts.duplicate,
        counts.errors,
        counts.conflicts,
        cpu.as_micros()
    );
    stdout.write_all(line.as_bytes())?;
    stdout.flush()?;
    // The parent reads the server's CPU before this process's connections close (their
    // backends' counts go with them): it closes stdin when it has.
    let _ = std::io::stdin().read_line(&mut String::new());
    Ok(())
}

/// CPU time used so far by each process whose command is `comm` (the database server's
/// processes: PostgreSQL's backends, or MariaDB's one), by pid, from /proc; with `pids`, only
/// those processes (a Galera cluster's nodes, not the local MariaDB).
pub(crate) fn server_cpu(comm: &str, pids: Option<&[u32]>) -> HashMap<u32, Duration> {
    // Clock ticks per second: 100 on every Linux this runs on (`getconf CLK_TCK`).
    const TICK: u64 = 100;
    let mut cpu = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return cpu;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        if pids.is_some_and(|pids| !pids.contains(&pid)) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: comm may hold spaces, so split at the last `)`.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if &stat[open + 1..close] != comm {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        // utime and stime are fields 14 and 15 of stat, 12 and 13 after `state`.
        if let (Some(u), Some(s)) = (fields.get(11), fields.get(12)) {
            let ticks = u.parse::<u64>().unwrap_or(0) + s.parse::<u64>().unwrap_or(0);
            cpu.insert(pid, Duration::from_millis(ticks * 1000 / TICK));
        }
    }
    cpu
}

/// The CPU the server's processes used between two readings; a process that started in
/// between counts whole.
pub(crate) fn server_used(
    before: &HashMap<u32, Duration>,
    after: &HashMap<u32, Duration>,
) -> Duration {
    after
        .iter()
        .map(|(pid, t)| t.saturating_sub(before.get(pid).copied().unwrap_or_default()))
        .sum()
}

/// The server a step's children work on.
struct Server<'a> {
    /// The children's `KIND`: `postgres` or `mysql`.
    kind: &'a str,
    /// Empty: the configured server. Else process `i` connects to `urls[i % urls.len()]` (a
    /// Galera cluster's nodes), through the variable the configuration reads.
    urls: &'a [String],
    /// The server's processes, when other processes of the same name are not its own.
    pids: Option<&'a [u32]>,
}

/// One step of the curve: `procs` children at once; what they did and what the server used.
async fn step(
    server: &Server<'_>,
    procs: usize,
    run: Duration,
) -> Res<(Counts, Duration, Duration)> {
    let kind = server.kind;
    let exe = std::env::current_exe()?;
    let suffix = config().suffix.clone();
    let mut children = Vec::new();
    for proc in 0..procs {
        let mut command = tokio::process::Command::new(&exe);
        if !server.urls.is_empty() {
            let url = &server.urls[proc % server.urls.len()];
            command
                .env("IDEM_MYSQL_URL", url)
                .env("IDEM_POSTGRES_URL", url);
        }
        let mut child = command
            .args(["--scale-worker", kind])
            .arg(proc.to_string())
            .arg(procs.to_string())
            .arg(run.as_millis().to_string())
            .env("IDEM_BENCH_SUFFIX", &suffix)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped")).lines();
        match stdout.next_line().await? {
            Some(line) if line == "ready" => {}
            other => return Err(format!("a --scale-worker said {other:?}, not `ready`").into()),
        }
        children.push((child, stdin, stdout));
    }
    let comm = if kind == "postgres" {
        "postgres"
    } else {
        "mariadbd"
    };
    let pids = server.pids;
    let server = server_cpu(comm, pids);
    let wall = Instant::now();
    for (_, stdin, _) in &mut children {
        stdin.write_all(b"go\n").await?;
        stdin.flush().await?;
    }
    let mut total = Counts::default();
    let mut finished = Vec::new();
    for (child, stdin, mut stdout) in children {
        let line = stdout
            .next_line()
            .await?
            .ok_or("a --scale-worker ended without its counts")?;
        let n: Vec<u64> = line
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("a --scale-worker's counts {line:?}: {e}"))?;
        let [applied, duplicate, errors, conflicts, cpu] = n[..] else {
            return Err(format!("a --scale-worker's counts {line:?}").into());
        };
        total.add(Counts {
            applied,
            duplicate,
            errors,
            conflicts,
            cpu: Duration::from_micros(cpu),
        });
        finished.push((child, stdin));
    }
    let wall = wall.elapsed();
    let server = server_used(&server, &server_cpu(comm, pids));
    for (mut child, stdin) in finished {
        drop(stdin);
        let status = child.wait().await?;
        if !status.success() {
            return Err(format!("a --scale-worker failed: {status}").into());
        }
    }
    Ok((total, server, wall))
}

/// Credits in the accounts and markers in the scope: equal unless an effect was doubled.
async fn doubled_pg(pool: &Pool<Postgres>) -> Res<i64> {
    let c = config();
    let sql = format!(
        "SELECT (SELECT COALESCE(SUM(credits), 0)::bigint FROM {}) - \
                (SELECT COUNT(*) FROM {})",
        c.accounts, c.markers
    );
    Ok(sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(pool)
        .await?)
}

async fn doubled_my<'c, E>(conn: E) -> Res<i64>
where
    E: sqlx::Executor<'c, Database = MySql>,
{
    let c = config();
    let sql = format!(
        "SELECT CAST((SELECT COALESCE(SUM(credits), 0) FROM {}) - \
                (SELECT COUNT(*) FROM {}) AS SIGNED)",
        c.accounts, c.markers
    );
    Ok(sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(conn)
        .await?)
}

/// `--scale [--quick] [--only postgres|mysql] [--run-ms N] [--galera]`: the curve on
/// PostgreSQL and MariaDB, or with `--galera` on a Galera cluster of the bench's own.
pub(crate) async fn run(quick: bool, only: Option<Kind>, run_ms: Option<u64>) -> Res<()> {
    let run = Duration::from_millis(run_ms.unwrap_or(if quick { 500 } else { 3000 }));
    if config().galera {
        return galera::run(run).await;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = String::from(
        "| database | processes | jobs/s | vs 1 process | database CPU | workers' CPU | \
         duplicates met | errors retried | doubled effects |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for kind in [Kind::Postgres, Kind::MySql] {
        if only.is_some_and(|o| o != kind) {
            continue;
        }
        let arg = if kind == Kind::Postgres {
            "postgres"
        } else {
            "mysql"
        };
        let pg = PgPoolOptions::new().max_connections(2);
        let my = MySqlPoolOptions::new().max_connections(2);
        let (pgp, myp) = match kind {
            Kind::Postgres => (Some(pg.connect(&config().pg_url).await?), None),
            _ => (None, Some(my.connect(&config().my_url).await?)),
        };
        let mut first = None;
        for procs in PROCESSES {
            // Fresh tables per step, so each step's markers and credits are its own.
            match (&pgp, &myp) {
                (Some(p), _) => setup_pg(p).await?,
                (_, Some(p)) => setup_my(p).await?,
                _ => unreachable!("one pool per database"),
            }
            eprintln!("scale: {} with {procs} processes", kind.name());
            let server = Server {
                kind: arg,
                urls: &[],
                pids: None,
            };
            let (counts, server, wall) = step(&server, procs, run).await?;
            let doubled = match (&pgp, &myp) {
                (Some(p), _) => doubled_pg(p).await?,
                (_, Some(p)) => doubled_my(p).await?,
                _ => unreachable!("one pool per database"),
            };
            let rate = counts.applied as f64 / wall.as_secs_f64();
            let base = *first.get_or_insert(rate);
            let share = |d: Duration| d.as_secs_f64() / (wall.as_secs_f64() * cores as f64);
            report.push_str(&format!(
                "| {} | {procs} | {rate:.0} | {:.2} | {:.0} % | {:.0} % | {} | {} | {doubled} |\n",
                kind.name(),
                rate / base,
                share(server) * 100.0,
                share(counts.cpu) * 100.0,
                counts.duplicate,
                counts.errors,
            ));
            if doubled != 0 {
                print!("{report}");
                return Err(format!(
                    "{} with {procs} processes: {doubled} effects were doubled",
                    kind.name()
                )
                .into());
            }
            if counts.duplicate == 0 {
                return Err(format!(
                    "{} with {procs} processes: no duplicate delivery met a marker",
                    kind.name()
                )
                .into());
            }
        }
        match (&pgp, &myp) {
            (Some(p), _) => drop_tables(p).await?,
            (_, Some(p)) => drop_tables(p).await?,
            _ => unreachable!("one pool per database"),
        }
    }
    println!("CPU shares are of the whole machine ({cores} cores) over the timed window.\n");
    print!("{report}");
    Ok(())
}
