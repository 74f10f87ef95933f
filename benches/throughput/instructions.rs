//! Instructions per job, counted by callgrind: a cost gate that a loaded machine cannot turn
//! red, since it counts what the client executes, not how long it takes.
//!
//! `cargo bench --bench throughput -- --instructions` runs this binary again under
//! `valgrind --tool=callgrind`, once per database and variant. Each child sets up its own
//! tables, warms its connection up (every statement prepared), then runs [`JOBS`] jobs one at
//! a time on a current-thread runtime inside [`idem_measured_jobs`], the only function
//! callgrind collects in (`--collect-atstart=no --toggle-collect`). So set-up, connecting and
//! the server's work are not counted: only the client's claim, body, commit and the runtime
//! and driver work they cause. The macro runs twice: as every other variant, with no
//! `tracing` subscriber and no `metrics` recorder, and `observed`, with the bench's own
//! (`--observe`), so that what observation costs when it is off and when it is on are both in
//! the table. The parent prints instructions per job and the ratios, and fails when one is
//! above its bound ([`BOUNDS`]).

use std::path::Path;
use std::process::Command;

use tokio::runtime::Runtime;

use crate::Res;
use crate::config::config;
use crate::measure::connect;
use crate::setup::{drop_tables, setup_lite, setup_my, setup_pg};
use crate::variants::{Conn, Kind, Rng, TopUp, Variant, job_id};

/// Jobs per measured run.
pub(crate) const JOBS: u64 = 300;

/// Counted runs per database and variant, of which the smallest count is kept: what varies
/// between runs is how often a read finds the server's answer not there yet (one more trip
/// through the driver), which only ever adds instructions. Five rather than three: the gate
/// takes under a minute, and the least of five moves less between gate runs.
const RUNS: usize = 5;

/// The warm-up before the measured run: prepares every statement, fills sqlx's caches.
const WARMUP: u64 = 20;

/// The gate: (database, what, bound). `macro / hand` is the macro's fresh job against the
/// claim written by hand with sqlx (the same transaction, without the verified commit),
/// `duplicate / hand` a duplicate's against the hand-written fresh job, and `observed / macro`
/// the macro's fresh job with a subscriber and a recorder installed against the same without.
///
/// A macro's fresh job may cost at most 1.25 hand-written ones on PostgreSQL. The least of
/// five runs measured 1.13 to 1.18 there, and 1.08 to 1.12 once the claim's and the finish's
/// futures were no longer wrapped in layers that only await them. SQLite's bound is 1.35: its engine runs on sqlx's
/// worker thread, which is not counted, so how often the counted thread polls while it waits
/// moves with the machine's load (`docs/BENCHMARKS.md`): 1.21 to 1.24 under load, 1.25 to 1.29
/// on an idle machine, where the hand-written job's polls are fewest. A bound of 1.30 there
/// would be a gate that the machine's load turns red. MariaDB measured 1.33 to 1.35:
/// its verified commit sends a probe that answers an OK packet of its own, and sqlx sends the
/// `ROLLBACK` it queues for the transaction it still counts open as a round trip of its own
/// before the release ping; its bound is 1.40 (the floor, and what would lower it, are in
/// `docs/sqlx-upstream.md`). The duplicate and observed bounds are the measured figures plus
/// 25 %, or more. MariaDB's duplicate bound is 1.0: its claim answers a duplicate in its own
/// OK packet (0.69 to 0.78 of a hand-written fresh job), so a marker read on that path again
/// (1.44 to 1.47 before) turns the gate red. A regression the gate is for (a statement, an
/// allocation per call, a copy of the key) costs more than the margin.
const BOUNDS: [(Kind, &str, f64); 9] = [
    (Kind::Postgres, "macro / hand", 1.25),
    (Kind::Postgres, "duplicate / hand", 0.90),
    (Kind::Postgres, "observed / macro", 1.25),
    (Kind::MySql, "macro / hand", 1.40),
    (Kind::MySql, "duplicate / hand", 1.00),
    (Kind::MySql, "observed / macro", 1.25),
    (Kind::Sqlite, "macro / hand", 1.35),
    (Kind::Sqlite, "duplicate / hand", 1.50),
    (Kind::Sqlite, "observed / macro", 1.30),
];

const VARIANTS: [Variant; 3] = [Variant::Handwritten, Variant::Macro, Variant::Duplicate];

/// The macro's variant with observation on.
const OBSERVED: &str = "observed";

fn kind_arg(kind: Kind) -> &'static str {
    match kind {
        Kind::Postgres => "postgres",
        Kind::Sqlite => "sqlite",
        Kind::MySql => "mysql",
    }
}

fn parse_kind(arg: &str) -> Res<Kind> {
    Ok(match arg {
        "postgres" => Kind::Postgres,
        "sqlite" => Kind::Sqlite,
        "mysql" => Kind::MySql,
        other => return Err(format!("unknown database {other:?}").into()),
    })
}

fn parse_variant(arg: &str) -> Res<Variant> {
    VARIANTS
        .into_iter()
        .find(|v| v.name() == arg)
        .ok_or_else(|| format!("unknown variant {arg:?}").into())
}

fn jobs(salt: u64, from: u64, n: u64) -> Vec<TopUp> {
    let mut rng = Rng(salt);
    (from..from + n)
        .map(|i| TopUp {
            id: job_id(salt, i),
            account: rng.account(),
            credits: 1,
        })
        .collect()
}

/// The measured section: callgrind collects only while this function runs.
#[inline(never)]
fn idem_measured_jobs(rt: &Runtime, conn: &Conn, variant: Variant, jobs: &[TopUp]) -> Res<()> {
    rt.block_on(async {
        for job in jobs {
            let applied = conn.job(variant, job).await?;
            if applied != (variant != Variant::Duplicate) {
                return Err(format!("{}: job {} ended otherwise", variant.name(), job.id).into());
            }
        }
        Ok(())
    })
}

/// The child: `--count DATABASE VARIANT`, run under callgrind by [`gate`]; the variant
/// `observed` is the macro with the bench's subscriber and recorder installed.
pub(crate) fn child(kind: &str, variant: &str, dir: &Path) -> Res<()> {
    let variant = match variant {
        OBSERVED => {
            crate::observe::install();
            Variant::Macro.name()
        }
        other => other,
    };
    let (kind, variant) = (parse_kind(kind)?, parse_variant(variant)?);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let sqlite = dir.join("count.db");
    let conn = rt.block_on(async {
        match kind {
            Kind::Postgres => setup_pg(&sqlx::PgPool::connect(&config().pg_url).await?).await?,
            Kind::MySql => setup_my(&sqlx::MySqlPool::connect(&config().my_url).await?).await?,
            Kind::Sqlite => {
                let pool =
                    sqlx::SqlitePool::connect_with(crate::measure::sqlite_options(&sqlite)).await?;
                setup_lite(&pool).await?;
            }
        }
        connect(kind, 1, &sqlite).await
    })?;
    let run = || -> Res<()> {
        // Fresh jobs for the warm-up of both claims; a duplicate re-delivers what the macro
        // applied before the measured section.
        rt.block_on(async {
            for (v, job) in [Variant::Handwritten, Variant::Macro]
                .into_iter()
                .flat_map(|v| jobs(7, 0, WARMUP).into_iter().map(move |j| (v, j)))
            {
                conn.job(v, &job).await?;
            }
            Ok::<_, crate::BoxError>(())
        })?;
        let measured = match variant {
            Variant::Duplicate => {
                let applied = jobs(11, 0, JOBS);
                idem_measured_jobs_setup(&rt, &conn, &applied)?;
                applied
            }
            _ => jobs(11, 0, JOBS),
        };
        idem_measured_jobs(&rt, &conn, variant, &measured)
    };
    let result = run();
    rt.block_on(async {
        conn.close().await;
        match kind {
            Kind::Postgres => drop_tables(&sqlx::PgPool::connect(&config().pg_url).await?).await,
            Kind::MySql => drop_tables(&sqlx::MySqlPool::connect(&config().my_url).await?).await,
            Kind::Sqlite => Ok(()),
        }
    })?;
    result
}

/// Applies `jobs` with the macro, outside the measured section.
fn idem_measured_jobs_setup(rt: &Runtime, conn: &Conn, jobs: &[TopUp]) -> Res<()> {
    rt.block_on(async {
        for job in jobs {
            conn.job(Variant::Macro, job).await?;
        }
        Ok(())
    })
}

/// The instructions callgrind counted in one child.
fn count(exe: &Path, dir: &Path, kind: Kind, variant: &str) -> Res<u64> {
    let out = dir.join(format!("{}-{variant}.callgrind", kind_arg(kind)));
    let status = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg("--collect-atstart=no")
        .arg("--toggle-collect=*idem_measured_jobs")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(exe)
        .args(["--count", kind_arg(kind), variant])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("valgrind could not be started (apt-get install valgrind): {e}"))?;
    if !status.success() {
        return Err(format!(
            "{} / {variant}: the counted run failed ({status}); run it by hand: valgrind \
             --tool=callgrind {} --count {} {variant}",
            kind.name(),
            exe.display(),
            kind_arg(kind),
        )
        .into());
    }
    let text = std::fs::read_to_string(&out)?;
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|n| n.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("no instruction total in {}", out.display()).into())
}

/// The parent: counts every database and variant, prints the table, checks [`BOUNDS`].
pub(crate) fn gate(dir: &Path) -> Res<()> {
    let exe = std::env::current_exe()?;
    let mut failures = Vec::new();
    println!("## Client instructions per job (callgrind)\n");
    println!(
        "{JOBS} jobs one at a time after a warm-up, counted in the client only, the least of \
         {RUNS} runs (`cargo bench --bench throughput -- --instructions`).\n"
    );
    println!(
        "| database | handwritten | macro | duplicate | observed | macro / hand | \
         duplicate / hand | observed / macro |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let variants = VARIANTS.map(Variant::name);
    for kind in [Kind::Postgres, Kind::MySql, Kind::Sqlite] {
        let mut per_job = [0u64; 4];
        for (i, variant) in variants.into_iter().chain([OBSERVED]).enumerate() {
            let mut least = u64::MAX;
            for _ in 0..RUNS {
                least = least.min(count(&exe, dir, kind, variant)?);
            }
            per_job[i] = least / JOBS;
            eprintln!(
                "{} / {variant}: {} instructions per job",
                kind.name(),
                per_job[i]
            );
        }
        let [hand, mac, dup, observed] = per_job.map(|n| n as f64);
        let ratios = [
            ("macro / hand", mac / hand),
            ("duplicate / hand", dup / hand),
            ("observed / macro", observed / mac),
        ];
        println!(
            "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} |",
            kind.name(),
            per_job[0],
            per_job[1],
            per_job[2],
            per_job[3],
            ratios[0].1,
            ratios[1].1,
            ratios[2].1
        );
        for (what, ratio) in ratios {
            let bound = BOUNDS
                .iter()
                .find(|(k, w, _)| *k == kind && *w == what)
                .map(|b| b.2)
                .expect("a bound for every ratio");
            if ratio > bound {
                failures.push(format!(
                    "{}: {what} is {ratio:.3}, above its bound {bound}",
                    kind.name()
                ));
            }
        }
    }
    println!();
    if failures.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the client's instructions per job grew past their bounds: {}",
        failures.join("; ")
    )
    .into())
}
