//! The floor under the handler rows: pgbench running the handler's statements by hand, with
//! no outbox and with one `INSERT` of the job's 1 or 10 messages into an outbox table of the
//! same schema, on tables of its own. What PostgreSQL alone charges for a message, without
//! idem's client or sqlx: the best ratio to no outbox that any client could reach here.

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool};

use super::{ACCOUNTS, Names, WORKERS, median};
use crate::Res;
use crate::pgbench::{PgbenchLength, drop_own_tables, on_own_tables, top_up_script};

/// The messages a job writes in each variant, as the handler rows' 0 (no outbox), 1 and 10.
const MESSAGES: [usize; 3] = [0, 1, 10];

/// Each variant's median transactions/s over `rounds` runs of `run`, every other round in
/// reverse order; each run checked (a marker a transaction, `n` outbox rows a marker), then
/// emptied.
pub(super) async fn run(
    pool: &PgPool,
    names: &Names,
    rounds: usize,
    run: Duration,
) -> Res<[f64; 3]> {
    let (accounts, markers) = (
        format!("{}_floor", names.accounts),
        format!("{}_floor", names.markers),
    );
    let dir = std::env::temp_dir().join(format!("idem-bench-floor-{}", std::process::id()));
    let pgbench = on_own_tables(pool, &accounts, &markers, ACCOUNTS, "bench.outbox", dir).await?;
    let mut scripts = Vec::new();
    for n in MESSAGES {
        let path = pgbench.dir.join(format!("floor_{n}.sql"));
        std::fs::write(&path, script(&accounts, &markers, n))?;
        scripts.push(path);
    }
    let length = PgbenchLength::Secs(run.as_secs().max(1));
    let mut rates: [Vec<f64>; 3] = Default::default();
    for round in 0..rounds {
        let mut order = [0, 1, 2];
        if round % 2 == 1 {
            order.reverse();
        }
        for v in order {
            let done = pgbench
                .run_script(&scripts[v], WORKERS, length, &format!("floor{v}"))
                .await?;
            check(pool, &markers, done.jobs, MESSAGES[v]).await?;
            rates[v].push(done.jobs as f64 / done.secs);
        }
    }
    drop_own_tables(pool, &accounts, &markers).await?;
    std::fs::remove_dir_all(&pgbench.dir)?;
    Ok(rates.map(median))
}

/// The handler's transaction by hand: the claim, the effect and, for `n` messages, one
/// `INSERT` of all of them with the columns idem writes. Every key is fresh.
pub(super) fn script(accounts: &str, markers: &str, n: usize) -> String {
    let rows: Vec<String> = (0..n)
        .map(|seq| {
            format!(
                "(:k::text || '-{seq}', 'bench.receipts', '\\x5b312c305d'::bytea, \
                 'bench.outbox', :k::text, {seq}, :k::text, \
                 '{{\"content-type\":\"application/json\"}}', statement_timestamp())"
            )
        })
        .collect();
    let write = match n {
        0 => String::new(),
        _ => format!(
            "INSERT INTO {markers}_outbox (id, destination, payload, scope, key, seq, \
             ordering_key, headers, created_at) VALUES {} ON CONFLICT DO NOTHING;\n",
            rows.join(", ")
        ),
    };
    top_up_script(accounts, ACCOUNTS, markers, "bench.outbox", &write)
}

/// Checks that the run left a marker for each of its `jobs` transactions and `n` messages for
/// each marker, then empties both tables.
pub(super) async fn check(pool: &PgPool, markers: &str, jobs: u64, n: usize) -> Res<()> {
    let count = |table: String| async move {
        let sql = format!("SELECT COUNT(*) FROM {table}");
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
            .fetch_one(pool)
            .await
    };
    let (claimed, written) = (
        count(markers.to_owned()).await?,
        count(format!("{markers}_outbox")).await?,
    );
    if claimed as u64 != jobs || written as u64 != jobs * n as u64 {
        return Err(format!(
            "pgbench's floor: {claimed} markers and {written} messages after {jobs} \
             transactions of {n} messages"
        )
        .into());
    }
    let emptied = format!("TRUNCATE {markers}, {markers}_outbox");
    sqlx::query(AssertSqlSafe(emptied)).execute(pool).await?;
    Ok(())
}
