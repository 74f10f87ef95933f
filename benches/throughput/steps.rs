//! `--steps`: what a lease's steps cost. A checkout of three outside calls, written as one
//! lease job of three steps, against the same three calls as three lease jobs of their own,
//! and one lease job of one call (the floor), at `WORKERS` workers on PostgreSQL, MariaDB and
//! SQLite. The calls themselves cost nothing, so what is measured is idem's statements: a
//! lease job is its claim and its completing statement, and each step one statement more (its
//! record), so three steps should cost 5 statements to the three jobs' 6.
//!
//! Each round runs every variant once, every other round in reverse order, each on keys of its
//! own; the report gives the medians of checkouts (three calls) per second, and the ratio of
//! the steps to the three jobs within the run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{Backend, Lease, Store};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::SqlitePoolOptions;

use crate::Res;
use crate::config::config;
use crate::measure::sqlite_options;

const WORKERS: usize = 8;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// One lease job, one call.
    OneCall,
    /// One lease job, three calls as steps.
    ThreeSteps,
    /// Three lease jobs, one call each.
    ThreeJobs,
}

const VARIANTS: [Variant; 3] = [Variant::OneCall, Variant::ThreeSteps, Variant::ThreeJobs];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::OneCall => "1 lease job, 1 call (the floor)",
            Variant::ThreeSteps => "1 lease job, 3 steps",
            Variant::ThreeJobs => "3 lease jobs, 1 call each",
        }
    }
}

/// The outside call: nothing, so that only idem's statements are measured.
async fn call(key: &str) -> Result<usize, idem::Error> {
    Ok(key.len())
}

#[idem::idempotent(key = "id", scope = "bench.steps.one", lease = "30s")]
async fn one_call(lease: &Lease, id: &str) -> Result<usize, idem::Error> {
    let _ = id;
    call(lease.idempotency_key()).await
}

#[idem::idempotent(key = "id", scope = "bench.steps.three", lease = "30s")]
async fn three_steps(lease: &Lease, id: &str) -> Result<usize, idem::Error> {
    let _ = id;
    let a = lease
        .step("charge", |s| async move { call(s.idempotency_key()).await })
        .await?;
    let b = lease
        .step("mail", |s| async move { call(s.idempotency_key()).await })
        .await?;
    let c = lease
        .step("ledger", |s| async move { call(s.idempotency_key()).await })
        .await?;
    Ok(a + b + c)
}

#[idem::idempotent(key = "id", scope = "bench.steps.job", lease = "30s")]
async fn one_job(lease: &Lease, id: &str) -> Result<usize, idem::Error> {
    let _ = id;
    call(lease.idempotency_key()).await
}

/// One lease job, delivered again while the database says another claim held a lock it
/// waited for (`InProgress`: SQLite's one writer, InnoDB's locks under load), as a broker
/// would; anything but `Applied` in the end is an error.
async fn deliver<F, Fut>(id: &str, mut job: F) -> Res<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<idem::Outcome<usize>, idem::Error>>,
{
    loop {
        match job().await {
            Ok(outcome) if outcome.is_applied() => return Ok(()),
            Ok(other) => return Err(format!("{id} was not applied: {other:?}").into()),
            Err(idem::Error::InProgress { .. }) => {
                REDELIVERED.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Deliveries made again after `InProgress`, reported with the figures.
static REDELIVERED: AtomicU64 = AtomicU64::new(0);

/// One checkout of `variant`, job `n`.
async fn checkout<DB: Backend>(store: &Store<DB>, variant: Variant, n: u64) -> Res<()> {
    let id = format!("c{n}");
    match variant {
        Variant::OneCall => deliver(&id, || one_call(store, &id)).await,
        Variant::ThreeSteps => deliver(&id, || three_steps(store, &id)).await,
        Variant::ThreeJobs => {
            for part in ["charge", "mail", "ledger"] {
                let id = format!("{id}-{part}");
                deliver(&id, || one_job(store, &id)).await?;
            }
            Ok(())
        }
    }
}

/// Checkouts per second of `variant` over `run`, keys from `next` on.
async fn measure<DB: Backend>(
    store: &Store<DB>,
    variant: Variant,
    run: Duration,
    next: &Arc<AtomicU64>,
) -> Res<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + run;
    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (store, next, done) = (store.clone(), next.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    checkout(&store, variant, n).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, crate::BoxError>(())
            })
        })
        .collect();
    for w in workers {
        w.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Rounds of every variant on `store`; returns the medians in `VARIANTS`' order.
async fn rounds<DB: Backend>(store: &Store<DB>, quick: bool) -> Res<[f64; 3]> {
    let (rounds, run) = if quick {
        (3, Duration::from_millis(300))
    } else {
        (9, Duration::from_secs(2))
    };
    let next = Arc::new(AtomicU64::new(0));
    let mut seen: [Vec<f64>; 3] = Default::default();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..VARIANTS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            seen[i].push(measure(store, VARIANTS[i], run, &next).await?);
        }
    }
    let [a, b, c] = seen;
    Ok([median(a), median(b), median(c)])
}

fn table(name: &str, medians: [f64; 3]) -> String {
    let mut out =
        format!("\n#### {name} ({WORKERS} workers)\n\n| variant | checkouts/s |\n|---|---:|\n");
    for (v, m) in VARIANTS.iter().zip(medians) {
        out.push_str(&format!("| {} | {m:.0} |\n", v.name()));
    }
    out.push_str(&format!(
        "\nratio 3 steps / 3 jobs: {:.2} (checkouts/s; above 1 = the steps are cheaper)\n",
        medians[1] / medians[2]
    ));
    out
}

/// Runs the comparison on every database; prints a Markdown report.
pub(crate) async fn run(quick: bool) -> Res<()> {
    let name = format!("idem_bench_steps_p{}", std::process::id());
    let mut report = String::from("### Lease steps: a checkout of three calls\n");

    let pg = PgPoolOptions::new()
        .max_connections(WORKERS as u32 + 1)
        .connect(&config().pg_url)
        .await?;
    let store = Store::new(pg.clone()).with_table(&name)?;
    store.migrate().await?;
    let measured = rounds(&store, quick).await;
    drop_tables(&pg, &name).await;
    report.push_str(&table("PostgreSQL", measured?));

    let my = MySqlPoolOptions::new()
        .max_connections(WORKERS as u32 + 1)
        .connect(&config().my_url)
        .await?;
    let store = Store::new(my.clone()).with_table(&name)?;
    store.migrate().await?;
    let measured = rounds(&store, quick).await;
    drop_tables(&my, &name).await;
    report.push_str(&table("MariaDB", measured?));

    let dir = std::env::temp_dir().join(format!("idem-bench-steps-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let lite = SqlitePoolOptions::new()
        .max_connections(WORKERS as u32 + 1)
        .connect_with(sqlite_options(&dir.join("steps.db")))
        .await?;
    let store = Store::new(lite.clone()).with_table(&name)?;
    store.migrate().await?;
    let measured = rounds(&store, quick).await;
    lite.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    report.push_str(&table("SQLite", measured?));

    report.push_str(&format!(
        "\n({} deliveries made again after `InProgress`)\n",
        REDELIVERED.load(Ordering::Relaxed)
    ));
    print!("{report}");
    Ok(())
}

async fn drop_tables<DB: Backend>(pool: &sqlx::Pool<DB>, name: &str)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    for t in [
        name.to_owned(),
        format!("{name}_outbox"),
        format!("{name}_steps"),
    ] {
        let sql = format!("DROP TABLE IF EXISTS {t}");
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await;
    }
    pool.close().await;
}
