//! `--group --floor`: the ceiling PostgreSQL itself sets each design of group commit, measured
//! with pgbench on the statements that design sends, against one job a transaction on the
//! same server in the same run. No idem in it: what any client could reach here.
//!
//! - **One job a transaction**, 8 clients: `BEGIN`, the claim, the effect, `COMMIT` (the main
//!   rows' hand-written top-up, `pgbench::top_up_script`).
//! - **A group, savepoint by savepoint** (how `group` runs today), 8 or 32 jobs a transaction
//!   on each of 2 clients (the default lanes): every job its `SAVEPOINT`, claim, effect and
//!   `RELEASE`, one statement after another, and one `COMMIT` for the group.
//! - **A group, one claim**: one statement claims all the group's keys, then each job its
//!   savepoint and effect: a group whose bodies stay their own; and the same without the
//!   savepoints' round trips (as if each rode with its job's first statement).
//! - **A group, statements shared**: the same jobs with one statement claiming all their keys
//!   and one for all their effects, as a batch does.
//!
//! Every job of a transaction tops up the same account (one row locked a transaction, so the
//! two clients never deadlock), in every variant alike. Each run is checked: a marker a job,
//! and the accounts' credits grown by the jobs.

use std::fmt::Write as _;
use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool};

use crate::config::config;
use crate::pgbench::{PgbenchLength, drop_own_tables, on_own_tables, top_up_script};
use crate::report::median;
use crate::{ACCOUNTS, Res};

/// How a transaction's jobs send their statements.
#[derive(Clone, Copy)]
enum Design {
    /// One job a transaction: the main rows' hand-written top-up.
    Alone,
    /// Each job its savepoint, claim and effect.
    Each,
    /// One statement claims every key, then each job its savepoint and effect.
    ClaimShared,
    /// One statement claims every key, then each job its effect: the savepoints' round trips
    /// gone, as if each rode with its job's first statement.
    ClaimOnly,
    /// One statement claims every key, one tops up the account for all of them.
    Shared,
}

/// The variants: a name, jobs a transaction, clients, and how the jobs send their statements.
const VARIANTS: [(&str, usize, usize, Design); 9] = [
    ("one job a transaction, 8 clients", 1, 8, Design::Alone),
    (
        "group of 8, savepoint by savepoint, 2 lanes",
        8,
        2,
        Design::Each,
    ),
    (
        "group of 32, savepoint by savepoint, 2 lanes",
        32,
        2,
        Design::Each,
    ),
    (
        "group of 8, one claim, then each job's savepoint and effect, 2 lanes",
        8,
        2,
        Design::ClaimShared,
    ),
    (
        "group of 32, one claim, then each job's savepoint and effect, 2 lanes",
        32,
        2,
        Design::ClaimShared,
    ),
    (
        "group of 8, one claim, then each job's effect, 2 lanes",
        8,
        2,
        Design::ClaimOnly,
    ),
    (
        "group of 32, one claim, then each job's effect, 2 lanes",
        32,
        2,
        Design::ClaimOnly,
    ),
    (
        "group of 8, statements shared, 2 lanes",
        8,
        2,
        Design::Shared,
    ),
    (
        "group of 32, statements shared, 2 lanes",
        32,
        2,
        Design::Shared,
    ),
];

const SCOPE: &str = "bench.group.floor";

/// The report: each variant's median jobs/s over `rounds` runs of `run`, every other round in
/// reverse order, and its ratio to one job a transaction.
pub(crate) async fn run(rounds: usize, run: Duration) -> Res<String> {
    let pid = std::process::id();
    let (accounts, markers) = (
        format!("idem_bench_gf_accounts_p{pid}"),
        format!("idem_bench_gf_markers_p{pid}"),
    );
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&config().pg_url)
        .await?;
    let dir = std::env::temp_dir().join(format!("idem-bench-group-floor-{pid}"));
    let pgbench = on_own_tables(&pool, &accounts, &markers, ACCOUNTS, SCOPE, dir).await?;
    let mut scripts = Vec::new();
    for (v, &(_, jobs, _, design)) in VARIANTS.iter().enumerate() {
        let path = pgbench.dir.join(format!("group_floor_{v}.sql"));
        std::fs::write(&path, script(&accounts, &markers, jobs, design))?;
        scripts.push(path);
    }
    let length = PgbenchLength::Secs(run.as_secs().max(1));
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    let mut credited = 0_u64;
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..VARIANTS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for v in order {
            let (_, jobs, clients, _) = VARIANTS[v];
            let done = pgbench
                .run_script(&scripts[v], clients, length, &format!("gf{v}"))
                .await?;
            let applied = done.jobs * jobs as u64;
            credited += applied;
            check(&pool, &accounts, &markers, applied, credited).await?;
            rates[v].push(applied as f64 / done.secs);
        }
    }
    drop_own_tables(&pool, &accounts, &markers).await?;
    pool.close().await;
    std::fs::remove_dir_all(&pgbench.dir)?;

    let rates: Vec<f64> = rates.iter().map(|r| median(r)).collect();
    let mut out = format!(
        "## Group commit's floor: pgbench on each design's statements (PostgreSQL, jobs/s, \
         {rounds} rounds of {} s, medians)\n\n\
         | design | jobs/s | vs one job a transaction |\n|---|---|---|\n",
        run.as_secs().max(1)
    );
    for (&(name, ..), rate) in VARIANTS.iter().zip(&rates) {
        let _ = writeln!(out, "| {name} | {rate:.0} | {:.2} |", rate / rates[0]);
    }
    Ok(out)
}

/// One transaction of `jobs` jobs, all on one account, sent as `design` says.
fn script(accounts: &str, markers: &str, jobs: usize, design: Design) -> String {
    let mut s = format!("\\set aid random(1, {ACCOUNTS})\n");
    let claim_all = format!(
        "INSERT INTO {markers} (scope, key, completed_at) \
         SELECT '{SCOPE}', md5(random()::text || clock_timestamp()::text || g), now() \
         FROM generate_series(1, {jobs}) AS g ORDER BY 2 ON CONFLICT DO NOTHING;\n"
    );
    let effect = format!("UPDATE {accounts} SET credits = credits + 1 WHERE id = :aid;\n");
    match design {
        Design::Alone => return top_up_script(accounts, ACCOUNTS, markers, SCOPE, ""),
        Design::Shared => {
            let _ = write!(
                s,
                "BEGIN;\n{claim_all}\
                 UPDATE {accounts} SET credits = credits + {jobs} WHERE id = :aid;\n"
            );
        }
        Design::ClaimShared => {
            let _ = write!(s, "BEGIN;\n{claim_all}");
            for _ in 0..jobs {
                let _ = write!(s, "SAVEPOINT job;\n{effect}RELEASE SAVEPOINT job;\n");
            }
        }
        Design::ClaimOnly => {
            let _ = write!(s, "BEGIN;\n{claim_all}");
            for _ in 0..jobs {
                s.push_str(&effect);
            }
        }
        Design::Each => {
            for j in 0..jobs {
                let _ = writeln!(s, "\\set k{j} random(1, 9000000000000000000)");
            }
            s.push_str("BEGIN;\n");
            for j in 0..jobs {
                let claim = format!(
                    "INSERT INTO {markers} (scope, key, completed_at) \
                     VALUES ('{SCOPE}', :k{j}, now()) ON CONFLICT DO NOTHING;\n{effect}"
                );
                let _ = write!(s, "SAVEPOINT job;\n{claim}RELEASE SAVEPOINT job;\n");
            }
        }
    }
    s.push_str("COMMIT;\n");
    s
}

/// Checks that the run left a marker for each of its `applied` jobs and that the accounts hold
/// the `credited` jobs of every run so far, then empties the markers.
async fn check(
    pool: &PgPool,
    accounts: &str,
    markers: &str,
    applied: u64,
    credited: u64,
) -> Res<()> {
    let claimed: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {markers}")))
        .fetch_one(pool)
        .await?;
    let sum: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COALESCE(SUM(credits), 0)::int8 FROM {accounts}"
    )))
    .fetch_one(pool)
    .await?;
    if claimed as u64 != applied || sum as u64 != credited {
        return Err(format!(
            "group floor: {claimed} markers for {applied} jobs, {sum} credits for {credited}"
        )
        .into());
    }
    sqlx::query(AssertSqlSafe(format!("TRUNCATE {markers}")))
        .execute(pool)
        .await?;
    Ok(())
}
