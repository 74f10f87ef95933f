//! `--group`'s batch rows (alone with `--group --each`): batches of 100 jobs run job by job
//! (`each = "job"`) at 1 and 8 workers, each worker on accounts of its own, in three kinds:
//!
//! - `clean`: every job's body succeeds;
//! - `poisoned`: one job of the batch (a random position) fails after its effect, so the
//!   batch rolls it back to its savepoint and gives its marker back; it counts the 99 others;
//! - `control`: `clean` again, to show how far two measurements of the same thing differ on
//!   this machine: a poisoned/clean ratio inside the control/clean spread is noise.
//!
//! The kinds alternate within one run, in blocks of a few batches (each worker takes them in
//! turn, the workers out of step), not run by run: a block lasts a tenth of a second, so
//! whatever else the machine does in a second weighs on the three alike, where separate runs of
//! a few seconds each met different loads (on a machine shared with builds, two runs of the
//! same thing differed by up to 2×). The first batch of each block is not counted: what a
//! batch leaves behind for the next one (in one run that took the kinds batch by batch, the
//! batch right after a poisoned one ran slower on PostgreSQL at one worker) is then counted in the poisoned block, whose later
//! batches each follow a poisoned one, as in a stream of poisoned batches, and not in the
//! block after it. Every key is fresh in all three. A kind's jobs/s is its applied jobs
//! over the time its batches took, times the workers: the rate if every worker ran that kind.
//! The ratios are taken over the whole run and round by round (median and range), and from the
//! median batch of each kind (its time per applied job), which a spike of load cannot move.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, MySql, Postgres, Sqlite, Transaction};

use crate::config::config;
use crate::measure::connect;
use crate::report::median;
use crate::variants::{Conn, Kind, job_id, mix};
use crate::{ACCOUNTS, BoxError, Res, variants};

const WORKERS: [usize; 2] = [1, 8];
const SIZE: usize = 100;
/// The scope of the batch handler, whose markers are counted at the end.
const SCOPE: &str = "bench.each";
/// Salt of the keys, apart from the other rows'.
const SALT: u64 = 0x6772_6f75_7001;

/// The kinds of batch, in the order each worker takes them.
const CLEAN: usize = 0;
const POISONED: usize = 1;
const CONTROL: usize = 2;
const TURN: usize = 3;
/// Batches of one kind in a row; the first is not counted.
const BLOCK: usize = 4;

/// One job of a batch; `poison` fails after its effect.
struct Job {
    id: String,
    account: i64,
    poison: bool,
}

macro_rules! handler {
    ($db:ty, $update:path) => {
        use super::*;

        #[idem::idempotent(key = "job.id", scope = "bench.each", each = "job")]
        pub(super) async fn each(
            tx: &mut Transaction<'_, $db>,
            job: &Job,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($update())
                .bind(1_i64)
                .bind(job.account)
                .execute(&mut **tx)
                .await?;
            if job.poison {
                return Err(sqlx::Error::Protocol("a poisoned job".into()));
            }
            Ok(())
        }
    };
}

mod pg {
    handler!(Postgres, variants::pg::update);
}
mod lite {
    handler!(Sqlite, variants::lite::update);
}
mod my {
    handler!(MySql, variants::my::update);
}

/// One batch; how many jobs it applied, after checking that only the poisoned one failed.
async fn batch(conn: &Conn, jobs: &[Job]) -> Res<u64> {
    let (applied, failed): (usize, Vec<usize>) = match conn {
        Conn::Pg(s) => {
            let each = pg::each(s, jobs).await?;
            (each.applied(), each.failures().map(|(at, _)| at).collect())
        }
        Conn::Lite(s) => {
            let each = lite::each(s, jobs).await?;
            (each.applied(), each.failures().map(|(at, _)| at).collect())
        }
        Conn::My(s) => {
            let each = my::each(s, jobs).await?;
            (each.applied(), each.failures().map(|(at, _)| at).collect())
        }
    };
    let poisoned: Vec<usize> = (0..jobs.len()).filter(|&at| jobs[at].poison).collect();
    if failed != poisoned || applied + failed.len() != jobs.len() {
        return Err(format!("a batch failed {failed:?}, not {poisoned:?}").into());
    }
    Ok(applied as u64)
}

/// An account of worker `w`'s own (≡ `w` mod `workers`): two batches never wait on each
/// other's rows.
fn own_account(n: u64, w: usize, workers: usize) -> i64 {
    let per_worker = ACCOUNTS / workers as u64;
    ((n % per_worker) * workers as u64 + w as u64 + 1) as i64
}

/// What one kind of batch did in a run.
#[derive(Default)]
struct Tally {
    applied: u64,
    secs: f64,
    /// Each batch's time per applied job.
    per_job: Vec<f64>,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.applied += other.applied;
        self.secs += other.secs;
        self.per_job.extend(other.per_job);
    }

    /// Jobs/s if each of `workers` ran this kind only.
    fn rate(&self, workers: usize) -> f64 {
        workers as f64 * self.applied as f64 / self.secs
    }
}

/// One run at `workers` for about `dur`, the kinds in turn: each kind's tally, and the jobs
/// applied by the batches not counted.
async fn run(
    conn: &Arc<Conn>,
    next: &Arc<AtomicU64>,
    workers: usize,
    dur: Duration,
) -> Res<([Tally; 3], u64)> {
    let start = Instant::now();
    let deadline = start + dur;
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (conn, next) = (conn.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut seed = mix(w as u64 ^ start.elapsed().as_nanos() as u64);
            let mut tallies: [Tally; 3] = Default::default();
            let mut uncounted = 0;
            // Out of step: at 8 workers, the batches running at any moment are of every kind.
            let mut turn = (w % TURN) * BLOCK;
            while Instant::now() < deadline {
                let kind = turn / BLOCK;
                seed = mix(seed);
                let poisoned = (kind == POISONED).then_some(seed as usize % SIZE);
                let jobs: Vec<Job> = (0..SIZE)
                    .map(|i| Job {
                        id: job_id(SALT, next.fetch_add(1, Ordering::Relaxed)),
                        account: own_account(mix(seed ^ i as u64), w, workers),
                        poison: poisoned == Some(i),
                    })
                    .collect();
                let t0 = Instant::now();
                let applied = batch(&conn, &jobs).await?;
                let secs = t0.elapsed().as_secs_f64();
                if turn.is_multiple_of(BLOCK) {
                    uncounted += applied;
                } else {
                    let tally = &mut tallies[kind];
                    tally.applied += applied;
                    tally.secs += secs;
                    tally.per_job.push(secs / applied as f64);
                }
                turn = (turn + 1) % (TURN * BLOCK);
            }
            Ok::<_, BoxError>((tallies, uncounted))
        }));
    }
    let mut tallies: [Tally; 3] = Default::default();
    let mut uncounted = 0;
    for t in tasks {
        let (one, n) = t.await??;
        uncounted += n;
        for (all, one) in tallies.iter_mut().zip(one) {
            all.add(one);
        }
    }
    Ok((tallies, uncounted))
}

/// The markers the batch handler left, to check against the jobs it applied.
async fn markers(conn: &Conn) -> Res<u64> {
    let sql = format!(
        "SELECT COUNT(*) FROM {} WHERE scope = '{SCOPE}'",
        config().markers
    );
    let q = AssertSqlSafe(sql);
    let (n,): (i64,) = match conn {
        Conn::Pg(s) => sqlx::query_as(q).fetch_one(s.pool()).await?,
        Conn::Lite(s) => sqlx::query_as(q).fetch_one(s.pool()).await?,
        Conn::My(s) => sqlx::query_as(q).fetch_one(s.pool()).await?,
    };
    Ok(n as u64)
}

/// `median (min–max)` of `values`.
fn spread(values: &[f64]) -> String {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.2} ({min:.2}–{max:.2})", median(values))
}

/// The batch rows of one database, and the jobs they applied (to check the accounts).
pub(crate) async fn rows(
    kind: Kind,
    sqlite: &std::path::Path,
    rounds: usize,
    dur: Duration,
) -> Res<(String, u64)> {
    let next = Arc::new(AtomicU64::new(0));
    let mut effects = 0;
    let mut rows = String::new();
    for workers in WORKERS {
        let conn = Arc::new(connect(kind, workers + 1, sqlite).await?);
        // The PostgreSQL here runs without autovacuum: vacuum between worker counts, as the
        // main rows do, never during a timed run.
        conn.maintain().await?;
        let (warm, uncounted) = run(&conn, &next, workers, Duration::from_millis(300)).await?;
        effects += uncounted + warm.iter().map(|t| t.applied).sum::<u64>();
        let mut all: [Tally; 3] = Default::default();
        let (mut poisoned, mut control) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (round, uncounted) = run(&conn, &next, workers, dur).await?;
            effects += uncounted;
            let rate = |k: usize| round[k].rate(workers);
            poisoned.push(rate(POISONED) / rate(CLEAN));
            control.push(rate(CONTROL) / rate(CLEAN));
            for (all, one) in all.iter_mut().zip(round) {
                effects += one.applied;
                all.add(one);
            }
        }
        let rate = |k: usize| all[k].rate(workers);
        // The median batch's time per job, as a rate relative to the clean one's.
        let batch = |k: usize| median(&all[CLEAN].per_job) / median(&all[k].per_job);
        writeln!(
            rows,
            "| {} | {workers} | {:.0} | {:.0} | {:.2} | {} | {} | {:.2} / {:.2} |",
            kind.name(),
            rate(CLEAN),
            rate(POISONED),
            rate(POISONED) / rate(CLEAN),
            spread(&poisoned),
            spread(&control),
            batch(POISONED),
            batch(CONTROL),
        )?;
        conn.close().await;
    }
    let conn = connect(kind, 1, sqlite).await?;
    let kept = markers(&conn).await;
    conn.close().await;
    let kept = kept?;
    if kept != effects {
        return Err(format!("{effects} batch jobs applied, but {kept} markers kept").into());
    }
    let mut report = String::new();
    writeln!(
        report,
        "\n| database | workers | each, clean jobs/s | each, 1 poisoned of 100 jobs/s | \
         poisoned / clean | per round: poisoned / clean | per round: control / clean | \
         median batch: poisoned / clean, control / clean |"
    )?;
    writeln!(report, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    report.push_str(&rows);
    Ok((report, effects))
}
