//! Throughput of the seed's top-up job with and without idem, and against pgbench.
//!
//! ```text
//! cargo bench --bench throughput                  # full, ~13 min
//! cargo bench --bench throughput -- --quick      # < 60 s
//! cargo bench --bench throughput -- --instructions  # client instructions per job, gated
//! cargo bench --bench throughput -- --http       # idem::http's layer against a hand-written claim
//! cargo bench --bench throughput -- --outbox     # the outbox: handler cost, relay vs direct
//! cargo bench --bench throughput -- --outbox --wal        # the WAL relay: handler, relay vs direct, latency, backlog
//! cargo bench --bench throughput -- --outbox --wal-floor  # pgbench: outbox rows against
//!                                                # logical decoding messages (a server of its own)
//! cargo bench --bench throughput -- --runner     # idem's consumer loop against one by hand
//! cargo bench --bench throughput -- --group      # group commit, and a poisoned batch
//! cargo bench --bench throughput -- --group --each  # the poisoned batch alone
//! cargo bench --bench throughput -- --group --floor # pgbench on each group design's statements
//! cargo bench --bench throughput -- --group --standby  # the same with a synchronous standby
//!                                                     # 0 to 2 ms away (a server of its own)
//! cargo bench --bench throughput -- --steps      # lease steps: 3 steps vs 3 lease jobs
//! cargo bench --bench throughput -- --scale      # 1, 2, 4, 8 worker processes on one server
//! cargo bench --bench throughput -- --scale --galera  # the same on a 3-node Galera cluster
//! cargo bench --bench throughput -- --partitions # a claim at 10M markers, partitioned by day
//! cargo bench --bench throughput -- --console    # the web console's pages at 10M markers
//! ```
//! Other arguments: `--plot PATH` (default `target/tmp/throughput.png`), `--only postgres|
//! sqlite|mysql`, `--rounds N`, `--run-ms N`, `--pool lean|sqlx` (the pool settings the docs
//! recommend, the default, or sqlx's own; see [`measure::PoolMode`]), `--observe` (a
//! `tracing` subscriber and a `metrics` recorder installed, see [`observe`]).
//!
//! Against PostgreSQL (`IDEM_POSTGRES_URL`), a temporary SQLite file (WAL) and MariaDB
//! (`IDEM_MYSQL_URL`), the local servers by default (see [`config`]), the job
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
//! exactly once. Tables are the run's own (`idem_bench_*_p<pid>`), dropped at start and at the
//! end.
//!
//! Progress goes to stderr; the Markdown report goes to stdout and ends with
//! `ratio macro/handwritten: X.XX` (PostgreSQL, 8 workers).

// One file per concern; `main` only parses the arguments, runs each database in turn, checks
// its effects and prints the report.
mod batch;
mod config;
mod console;
mod each;
mod group;
mod group_floor;
mod growth;
mod http;
mod instructions;
mod measure;
mod observe;
mod outbox;
mod partitions;
mod pgbench;
mod plot;
mod report;
mod runner;
mod scale;
mod setup;
mod standby;
mod steps;
mod variants;
mod wire;

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::AssertSqlSafe;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqlitePoolOptions;

use config::config;
use growth::measure_growth;
use measure::{PoolMode, Results, bench_kind, sqlite_options};
use pgbench::Pgbench;
use plot::draw;
use report::report;
use setup::{drop_tables, setup_lite, setup_my, setup_pg};
use variants::{KINDS, Keys, Kind};

type BoxError = Box<dyn StdError + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// Enough accounts that concurrent jobs rarely touch the same row.
const ACCOUNTS: u64 = 10_000;
const WORKERS: [usize; 3] = [1, 8, 32];
const SCOPE: &str = "bench.top_up";
/// How long a pgbench run of `--quick` aims to last (see [`pgbench::PgbenchLength`]).
const PGBENCH_QUICK_RUN: Duration = Duration::from_millis(250);
/// Upper bound of every worker loop, whatever the clock says.
const MAX_JOBS_PER_WORKER: u64 = 1_000_000;

/// How long and how often each variant runs, set by `--quick`, `--rounds` and `--run-ms`.
#[derive(Clone, Copy)]
struct Settings {
    quick: bool,
    rounds: usize,
    run: Duration,
    warmup: Duration,
}

struct Args {
    quick: bool,
    observe: bool,
    plot: Option<PathBuf>,
    only: Option<Kind>,
    rounds: Option<usize>,
    run_ms: Option<u64>,
    pool: PoolMode,
}

fn parse_args() -> Res<Args> {
    let mut parsed = Args {
        quick: false,
        observe: false,
        plot: None,
        only: None,
        rounds: None,
        run_ms: None,
        pool: PoolMode::Lean,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => parsed.quick = true,
            "--observe" => parsed.observe = true,
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
            "--pool" => {
                parsed.pool = match args.next().as_deref() {
                    Some("sqlx") => PoolMode::Sqlx,
                    Some("lean") => PoolMode::Lean,
                    _ => return Err("--pool takes sqlx or lean".into()),
                }
            }
            "--run-ms" => parsed.run_ms = Some(args.next().ok_or("--run-ms needs N")?.parse()?),
            // `cargo bench` passes `--bench` to every harness-less bench.
            "--bench" => {}
            "--instructions" | "--group" | "--each" | "--floor" | "--standby" | "--scale"
            | "--galera" | "--partitions" | "--outbox" | "--wal-floor" | "--wal" => {}
            other => eprintln!("ignoring argument {other:?}"),
        }
    }
    Ok(parsed)
}

fn main() -> Res<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
    // A child of `--instructions`, run under callgrind: one database, one variant.
    if let Some(at) = argv.iter().position(|a| a == "--count") {
        let (kind, variant) = match (argv.get(at + 1), argv.get(at + 2)) {
            (Some(kind), Some(variant)) => (kind, variant),
            _ => return Err("--count takes a database and a variant".into()),
        };
        std::fs::create_dir_all(&dir)?;
        let counted = instructions::child(kind, variant, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        return counted;
    }
    // A worker process of `--scale`, started by it.
    if let Some(at) = argv.iter().position(|a| a == "--scale-worker") {
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(scale::child(&argv[at + 1..]));
    }
    // The scaling curve: 1, 2, 4 and 8 worker processes on one server (`scale.rs`).
    if argv.iter().any(|a| a == "--scale") {
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(async {
                let args = parse_args()?;
                scale::run(args.quick, args.only, args.run_ms).await
            });
    }
    if argv.iter().any(|a| a == "--http") {
        let quick = argv.iter().any(|a| a == "--quick");
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(http::run(quick));
    }
    if argv.iter().any(|a| a == "--console") {
        let quick = argv.iter().any(|a| a == "--quick");
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(console::run(quick));
    }
    if argv.iter().any(|a| a == "--runner") {
        let quick = argv.iter().any(|a| a == "--quick");
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(runner::run(quick));
    }
    if argv.iter().any(|a| a == "--outbox") && argv.iter().any(|a| a == "--wal") {
        let quick = argv.iter().any(|a| a == "--quick");
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(async {
                print!("{}", outbox::wal::run(quick).await?);
                Ok(())
            });
    }
    if argv.iter().any(|a| a == "--outbox") && argv.iter().any(|a| a == "--wal-floor") {
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(async {
                let args = parse_args()?;
                let rounds = args.rounds.unwrap_or(if args.quick { 1 } else { 5 }).max(1);
                let run = Duration::from_millis(args.run_ms.unwrap_or(5000));
                print!("{}", outbox::wal_floor::run(args.quick, rounds, run).await?);
                Ok(())
            });
    }
    if argv.iter().any(|a| a == "--outbox") {
        let quick = argv.iter().any(|a| a == "--quick");
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(outbox::run(quick));
    }
    // Group commit against the macro and the hand-written code, and a poisoned batch.
    if argv.iter().any(|a| a == "--group") {
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(async {
                let args = parse_args()?;
                let quick = args.quick;
                let rounds = args.rounds.unwrap_or(if quick { 3 } else { 8 });
                let run =
                    Duration::from_millis(args.run_ms.unwrap_or(if quick { 200 } else { 1000 }));
                if argv.iter().any(|a| a == "--standby") {
                    let plot = args
                        .plot
                        .clone()
                        .unwrap_or_else(|| std::env::temp_dir().join("idem-group-standby.png"));
                    print!("{}", standby::run(rounds, run, &plot).await?);
                    return Ok(());
                }
                if argv.iter().any(|a| a == "--floor") {
                    print!("{}", group_floor::run(rounds, run).await?);
                    return Ok(());
                }
                let each_only = argv.iter().any(|a| a == "--each");
                let report = group::bench(args.only, rounds, run, each_only).await?;
                print!("{report}");
                Ok(())
            });
    }
    // A claim at 10M markers, one table against one partitioned by day (`partitions.rs`).
    if argv.iter().any(|a| a == "--partitions") {
        let quick = argv.iter().any(|a| a == "--quick");
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(partitions::run(quick));
    }
    // Lease steps: one job of three steps against three jobs (`steps.rs`).
    if argv.iter().any(|a| a == "--steps") {
        let quick = argv.iter().any(|a| a == "--quick");
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(steps::run(quick));
    }
    if argv.iter().any(|a| a == "--instructions") {
        std::fs::create_dir_all(&dir)?;
        let gated = instructions::gate(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        return gated;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> Res<()> {
    let wall = Instant::now();
    let args = parse_args()?;
    measure::POOL
        .set(args.pool)
        .expect("set once, before any pool");
    if args.observe {
        observe::install();
    }
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
    let mut batches = batch::BatchResults::new();
    let pgbench = Pgbench::new(dir);
    if pgbench.is_none() {
        eprintln!("pgbench not found (PATH, /usr/lib/postgresql/*/bin): its rows are left out");
    }
    let sqlite = dir.join("bench.db");
    let accounts = &config().accounts;
    let mut growth = None;
    let mut wire_report = String::new();
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
                    .connect(&config().pg_url)
                    .await?;
                // The tables go whatever happens: no later run would drop them, their names
                // being this run's.
                let sum = async {
                    setup_pg(&admin).await?;
                    let counted = wire::measure(kind, &keys, &sqlite).await?;
                    counted.check()?;
                    wire_report.push_str(&counted.markdown());
                    bench_kind(kind, set, &keys, &sqlite, pgbench.as_ref(), &mut results).await?;
                    batch::bench_batches(kind, set, &keys, &sqlite, pgbench.as_ref(), &mut batches)
                        .await?;
                    if !set.quick {
                        growth = Some(measure_growth(&admin, set, &keys).await?);
                    }
                    let sum: (i64,) = sqlx::query_as(AssertSqlSafe(format!(
                        "SELECT COALESCE(SUM(credits), 0)::bigint FROM {accounts}"
                    )))
                    .fetch_one(&admin)
                    .await?;
                    Ok::<_, BoxError>(sum.0)
                }
                .await;
                let dropped = drop_tables(&admin).await;
                admin.close().await;
                let sum = sum?;
                dropped?;
                sum
            }
            Kind::Sqlite => {
                let admin = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(sqlite_options(&sqlite))
                    .await?;
                setup_lite(&admin).await?;
                bench_kind(kind, set, &keys, &sqlite, None, &mut results).await?;
                batch::bench_batches(kind, set, &keys, &sqlite, None, &mut batches).await?;
                let sum: (i64,) = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT COALESCE(SUM(credits), 0) FROM {accounts}"
                )))
                .fetch_one(&admin)
                .await?;
                admin.close().await;
                sum.0
            }
            Kind::MySql => {
                let admin = MySqlPoolOptions::new()
                    .max_connections(2)
                    .connect(&config().my_url)
                    .await?;
                // As for PostgreSQL, dropped whatever happens.
                let sum = async {
                    setup_my(&admin).await?;
                    let counted = wire::measure(kind, &keys, &sqlite).await?;
                    counted.check()?;
                    wire_report.push_str(&counted.markdown());
                    bench_kind(kind, set, &keys, &sqlite, None, &mut results).await?;
                    batch::bench_batches(kind, set, &keys, &sqlite, None, &mut batches).await?;
                    let sum: (i64,) = sqlx::query_as(AssertSqlSafe(format!(
                        "SELECT CAST(COALESCE(SUM(credits), 0) AS SIGNED) FROM {accounts}"
                    )))
                    .fetch_one(&admin)
                    .await?;
                    Ok::<_, BoxError>(sum.0)
                }
                .await;
                let dropped = drop_tables(&admin).await;
                admin.close().await;
                let sum = sum?;
                dropped?;
                sum
            }
        };
        verify(kind, sum, &keys)?;
        eprintln!("{}: {:.1} s", kind.name(), t0.elapsed().as_secs_f64());
    }

    let report = report(set, &results, &batches, growth.as_ref());
    let path = args
        .plot
        .clone()
        .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("throughput.png"));
    match draw(&path, &results) {
        Ok(()) => eprintln!("plot written to {}", path.display()),
        Err(e) => eprintln!("plot not written: {e}"),
    }
    print!("{wire_report}{report}");
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
