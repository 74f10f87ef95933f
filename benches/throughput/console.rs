//! `--console` (PostgreSQL): how long each page of the web console (`idem::console`) takes to
//! answer, on a marker table of one failed job and on one of 10M markers (1M with `--quick`;
//! `IDEM_BENCH_CONSOLE_MARKERS` sets another size), served on loopback and asked over HTTP,
//! one request at a time. The 10M markers: 20 scopes, completed over the last 30 days (about
//! 330 000 a day), one in 997 failed for good with one of 7 errors (140 groups), one in ten thousand
//! still in progress (half of them leases run out an hour ago). Reported per page: p50 and p95
//! over 40 requests after 3 unmeasured ones, and p95 against the one-job table's (the same run).
//! The doctor's page is left out: it counts the leases in progress (no index), an off-peak
//! page by its own words.

use std::time::Instant;

use idem::console::Console;
use idem::{FailureGroup, Store};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Pool, Postgres};

use crate::Res;
use crate::config::config;
use crate::report::percentile_ms;
use crate::setup::exec;

const SCOPES: u64 = 20;
const REQUESTS: usize = 40;
const WARM: usize = 3;

/// The pages' times on a table of one failed job, then on the same table filled with `n`
/// markers.
async fn both(
    admin: &Pool<Postgres>,
    pool: Pool<Postgres>,
    table: &str,
    n: u64,
) -> Res<(Vec<Vec<u64>>, Vec<Vec<u64>>)> {
    let store = Store::new(pool).with_table(table)?;
    store.migrate().await?;
    // One failed job before the fill, so that its group's page answers on both tables.
    exec(
        admin,
        &format!(
            "INSERT INTO {table} (scope, key, state, token, completed_at, error) \
             VALUES ('scope-0', 'seed', 'completed', 1, now(), 'error 0')"
        ),
    )
    .await?;
    let group = FailureGroup::id_of("scope-0", "error 0");
    let empty = measure(store.clone(), &group).await?;
    fill(admin, table, n).await?;
    let full = measure(store, &group).await?;
    Ok((empty, full))
}

/// `n` markers in one statement, then `VACUUM ANALYZE` (as autovacuum would leave them).
async fn fill(admin: &Pool<Postgres>, table: &str, n: u64) -> Res<()> {
    let t0 = Instant::now();
    exec(
        admin,
        &format!(
            "BEGIN; SET LOCAL work_mem = '512MB';
             INSERT INTO {table} (scope, key, state, token, attempts, created_at, completed_at,
                                  locked_until, error)
             SELECT 'scope-' || (g % {SCOPES}), 'k' || g,
                    CASE WHEN g % 10000 = 0 THEN 'in_progress' ELSE 'completed' END,
                    1, 1, ts - interval '1 second',
                    CASE WHEN g % 10000 = 0 THEN NULL ELSE ts END,
                    CASE WHEN g % 10000 = 0 THEN now() + (g % 20000 - 5000) * interval '1 second' END,
                    CASE WHEN g % 997 = 7 THEN 'error ' || (g / 997 % 7) END
             FROM (SELECT g, now() - (g % (30 * 86400)) * interval '1 second' AS ts
                   FROM generate_series(1, {n}) g) a;
             COMMIT;"
        ),
    )
    .await?;
    exec(admin, &format!("VACUUM ANALYZE {table}")).await?;
    eprintln!(
        "console: {n} markers in {table} in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The pages, as paths of a console served at `/`.
fn pages(group: &str) -> Vec<(&'static str, String)> {
    vec![
        ("overview", "/".into()),
        ("failures", "/failures".into()),
        ("failure group", format!("/failures/{group}")),
        ("job", "/job?scope=scope-0&key=seed".into()),
        ("stuck", "/stuck".into()),
        ("outbox", "/outbox".into()),
        ("audit", "/audit".into()),
    ]
}

/// Each page's response times, in the pages' order.
async fn measure(store: Store<Postgres>, group: &str) -> Res<Vec<Vec<u64>>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let app = Console::new(store).router();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let mut times = Vec::new();
    for (name, path) in pages(group) {
        let mut each = Vec::new();
        for i in 0..WARM + REQUESTS {
            let t0 = Instant::now();
            let response = client.get(format!("{base}{path}")).send().await?;
            let status = response.status();
            let body = response.text().await?;
            if !status.is_success() {
                return Err(format!("{name}: {status}: {body}").into());
            }
            if i >= WARM {
                each.push(t0.elapsed().as_nanos() as u64);
            }
        }
        times.push(each);
    }
    server.abort();
    Ok(times)
}

pub(crate) async fn run(quick: bool) -> Res<()> {
    let n: u64 = match std::env::var("IDEM_BENCH_CONSOLE_MARKERS") {
        Ok(n) => n.parse()?,
        Err(_) if quick => 1_000_000,
        Err(_) => 10_000_000,
    };
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&config().pg_url)
        .await?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&config().pg_url)
        .await?;
    let table = format!("idem_bench_console_p{}", std::process::id());
    let drop = format!(
        "DROP TABLE IF EXISTS {table}, {table}_outbox, {table}_retention, {table}_steps, {table}_offsets, \
         {table}_audit CASCADE"
    );
    exec(&admin, &drop).await?;
    let measured = both(&admin, pool, &table, n).await;
    // Dropped whether the run succeeded or not.
    exec(&admin, &drop).await?;
    let (empty, full) = measured?;

    println!("## Console pages at {n} markers (PostgreSQL)\n");
    println!("| page | p50 ms | p95 ms | p95 at 1 job ms | p95 / 1 job |");
    println!("|---|---:|---:|---:|---:|");
    for (i, (name, _)) in pages("").iter().enumerate() {
        let p50 = percentile_ms(&full[i], 50.0);
        let p95 = percentile_ms(&full[i], 95.0);
        let base = percentile_ms(&empty[i], 95.0);
        println!(
            "| {name} | {p50:.1} | {p95:.1} | {base:.1} | {:.1} |",
            p95 / base.max(0.001)
        );
    }
    Ok(())
}
