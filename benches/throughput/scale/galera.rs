//! `--scale --galera`: the scaling curve on a three-node MariaDB Galera cluster
//! (`idem_scale::galera`: the installed `mariadbd` with Debian's `galera-4` provider), started
//! once for the run and removed after it, whatever the outcome.
//!
//! The steps are the ones of the single servers: 1, 2, 4 and 8 worker processes, process `i`
//! connected to node `i mod 3`, so that from 2 processes on the duplicate deliveries of a
//! neighbour's keys race through two nodes, where only certification at `COMMIT` can refuse
//! the second marker. Besides the counts of the single servers, a row gives the deliveries the
//! workers saw fail with 1213 (certification, or another node's writes, aborted them; the
//! worker delivered them again) and what the nodes counted of the same: certification failures
//! (`wsrep_local_cert_failures`) and local transactions aborted by replicated writes
//! (`wsrep_local_bf_aborts`), summed over the nodes. The doubled effects are read through every
//! node with `wsrep_sync_wait = 1` (the read waits until the node applied what the cluster
//! committed): each must see the same credits and markers, and as many of one as of the other.

use std::time::Duration;

use idem_scale::galera::{Cluster, NODES};
use sqlx::mysql::{MySqlConnection, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Connection as _};

use super::{PROCESSES, Server, doubled_my, step};
use crate::Res;
use crate::config::config;
use crate::setup::{drop_tables, setup_my};

/// A connection to `url` whose reads see every write the cluster committed before them.
async fn synced(url: &str) -> Res<MySqlConnection> {
    let mut conn = MySqlConnection::connect(url).await?;
    sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

/// The credits and the markers as node `url` sees them, once it applied every commit.
async fn totals(url: &str) -> Res<(i64, i64)> {
    let c = config();
    let mut conn = synced(url).await?;
    let markers: i64 =
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {}", c.markers)))
            .fetch_one(&mut conn)
            .await?;
    let doubled = doubled_my(&mut conn).await?;
    drop(conn.close().await);
    Ok((markers + doubled, markers))
}

/// The sum over the nodes of three `wsrep_%` counters: certification failures, the local
/// transactions another node's replicated writes aborted, and the time replication was paused
/// by flow control (a node's queue of writes to apply was too long).
async fn counters(cluster: &Cluster) -> [u64; 3] {
    [
        cluster.total("wsrep_local_cert_failures").await,
        cluster.total("wsrep_local_bf_aborts").await,
        cluster.total("wsrep_flow_control_paused_ns").await,
    ]
}

pub(super) async fn run(run: Duration) -> Res<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!("scale: starting a Galera cluster of {NODES} nodes");
    // Dropped at the end of this function, on an error too: the nodes are killed and their
    // directory removed.
    let cluster = Cluster::start().await;
    let urls: Vec<String> = (0..NODES).map(|i| cluster.url(i)).collect();
    let pids = cluster.pids();
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&urls[0])
        .await?;
    let mut report = String::from(
        "| processes | nodes used | jobs/s | vs 1 process | cluster CPU | workers' CPU | \
         duplicates met | retried after 1213 | other errors retried | certification failures \
         | BF aborts | flow control paused | doubled effects |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut first = None;
    let mut result = Ok(());
    for procs in PROCESSES {
        // Fresh tables per step through node 0; every node has applied them (the reads wait)
        // before a child starts.
        setup_my(&pool).await?;
        for url in &urls {
            totals(url).await?;
        }
        eprintln!("scale: Galera with {procs} processes");
        let before = counters(&cluster).await;
        let server = Server {
            kind: "mysql",
            urls: &urls,
            pids: Some(&pids),
        };
        let (counts, server, wall) = step(&server, procs, run).await?;
        let after = counters(&cluster).await;
        let mut seen = Vec::new();
        for url in &urls {
            seen.push(totals(url).await?);
        }
        let (credits, markers) = seen[0];
        let doubled = credits - markers;
        let rate = counts.applied as f64 / wall.as_secs_f64();
        let base = *first.get_or_insert(rate);
        let share = |d: Duration| d.as_secs_f64() / (wall.as_secs_f64() * cores as f64);
        report.push_str(&format!(
            "| {procs} | {} | {rate:.0} | {:.2} | {:.0} % | {:.0} % | {} | {} | {} | {} | {} | \
             {:.0} % | {doubled} |\n",
            procs.min(NODES),
            rate / base,
            share(server) * 100.0,
            share(counts.cpu) * 100.0,
            counts.duplicate,
            counts.conflicts,
            counts.errors - counts.conflicts,
            after[0] - before[0],
            after[1] - before[1],
            // Of the nodes' time together.
            (after[2] - before[2]) as f64 / 1e9 / (wall.as_secs_f64() * NODES as f64) * 100.0,
        ));
        if seen.iter().any(|s| *s != seen[0]) {
            result = Err(format!(
                "{procs} processes: the nodes disagree on (credits, markers): {seen:?}"
            ));
            break;
        }
        if doubled != 0 {
            result = Err(format!("{procs} processes: {doubled} effects were doubled"));
            break;
        }
        if counts.duplicate == 0 {
            result = Err(format!(
                "{procs} processes: no duplicate delivery met a marker"
            ));
            break;
        }
    }
    drop_tables(&pool).await?;
    pool.close().await;
    drop(cluster);
    println!(
        "A three-node Galera cluster on this machine; CPU shares are of the whole machine \
         ({cores} cores) over the timed window.\n"
    );
    print!("{report}");
    Ok(result?)
}
