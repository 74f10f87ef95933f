//! idem on a three-node MariaDB Galera cluster of the test's own (`idem_scale::galera`: Debian's
//! `galera-4` provider, `mariadbd` as user `mysql`, state transfers by rsync). One cluster
//! serves every case, which run one after the other; it is killed and its directory removed at
//! the end, or when a case fails.
//!
//! Galera certifies a transaction's writes at `COMMIT` on every node: two nodes can each insert
//! the same marker, and the one certified second fails at `COMMIT` (error 1213) after its body
//! ran, or is aborted by the winner's writes (the same 1213, at its next statement). Every case
//! counts effects in the database, read through a node with `wsrep_sync_wait = 1` (the read
//! waits until the node applied what the cluster committed before it): each key's effect
//! exactly once, whatever the deliveries raced, whichever node they went through.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::{Group, GroupOptions, Outcome, Store};
use idem_scale::galera::{Cluster, NODES};
use idem_scale::jobs::{self, AppError, Hold, Job};
use idem_scale::mariadb_jobs::{self as my, is_conflict};
use sqlx::mysql::{MySqlConnection, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, MySql, MySqlPool};
use tokio::sync::{Barrier, watch};

/// How long a redelivered job may keep failing (a conflict again, a lease still held) before
/// the test gives up: a hang guard, far above what a run takes.
const SETTLE_WITHIN: Duration = Duration::from_secs(60);

#[path = "galera/kill.rs"]
mod kill;
use kill::a_node_killed_mid_run_loses_nothing;

async fn pool(url: &str, max: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

/// The cluster's nodes as the cases reach them: a pool per node.
struct Nodes {
    urls: Vec<String>,
    pools: Vec<MySqlPool>,
}

/// The tables of one case (a marker table and an effects table, made through node 0) and a
/// store per node on them.
struct Case {
    urls: Vec<String>,
    pools: Vec<MySqlPool>,
    stores: Vec<Store<MySql>>,
    markers: String,
    effects: String,
}

impl Case {
    async fn new(nodes: &Nodes) -> Case {
        let markers = jobs::unique("galera_markers");
        let effects = jobs::unique("galera_effects");
        let stores: Vec<Store<MySql>> = nodes
            .pools
            .iter()
            .map(|p| Store::new(p.clone()).with_table(&markers).expect("a name"))
            .collect();
        stores[0].migrate().await.expect("migrate through node 0");
        my::create_effects(&nodes.pools[0], &effects).await;
        // DDL runs on every node in the cluster's order, but a node applies it after the one
        // it was sent to answered: a read with `wsrep_sync_wait` waits until it has.
        for url in &nodes.urls {
            let mut conn = my::synced(url).await;
            for table in [&markers, &effects] {
                let _: i64 =
                    sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
                        .fetch_one(&mut conn)
                        .await
                        .expect("the case's tables on every node");
            }
        }
        Case {
            urls: nodes.urls.clone(),
            pools: nodes.pools.clone(),
            stores,
            markers,
            effects,
        }
    }

    fn jobs(&self, n: usize) -> Vec<Job> {
        jobs::jobs(n, &self.effects)
    }

    /// A connection to node `i` that reads what the whole cluster committed.
    async fn synced(&self, i: usize) -> MySqlConnection {
        my::synced(&self.urls[i]).await
    }

    /// Each of `n` keys has exactly one effect and one marker, read through node `i`.
    async fn assert_once_each(&self, i: usize, n: usize, what: &str) {
        let mut conn = self.synced(i).await;
        let (keys, doubled) = my::counts(&mut conn, &self.effects).await;
        assert_eq!(
            (keys, doubled),
            (n as i64, 0),
            "{what}: (keys with an effect, keys with more than one), read through node {i}"
        );
        let markers: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {}",
            self.markers
        )))
        .fetch_one(&mut conn)
        .await
        .expect("count the markers");
        assert_eq!(markers, n as i64, "{what}: markers, read through node {i}");
    }

    async fn drop(self) {
        my::drop_tables(&self.pools[0], &[&self.markers, &self.effects]).await;
    }
}

/// What the deliveries of one mode came to.
#[derive(Debug, Default)]
struct Tally {
    deliveries: usize,
    applied: usize,
    duplicates: usize,
    in_progress: usize,
    /// Deliveries that failed with 1213: certification (or the winner's writes) aborted them.
    conflicts: usize,
    /// Deliveries whose body returned `Ok` and whose transaction the database rolled back.
    rolled_back: usize,
    /// Group commit's calls whose group failed.
    group_failed: usize,
    redeliveries: usize,
    /// Transactions the nodes aborted meanwhile (see [`aborts`]), whether or not the error
    /// reached idem.
    aborted: u64,
}

impl Tally {
    /// Counts one answer; `true` when the delivery must be made again (nacked).
    fn count(&mut self, what: &str, job: &Job, answer: &Result<Outcome<i64>, AppError>) -> bool {
        match answer {
            Ok(Outcome::Applied(v)) => {
                assert_eq!(*v, job.amount, "{what} {}", job.key);
                self.applied += 1;
                false
            }
            Ok(Outcome::Duplicate) => {
                self.duplicates += 1;
                false
            }
            Ok(Outcome::Replayed(v)) => {
                assert_eq!(*v, job.amount, "{what} {}: the first value", job.key);
                self.duplicates += 1;
                false
            }
            Err(AppError::Idem(idem::Error::InProgress { .. })) => {
                self.in_progress += 1;
                true
            }
            Err(AppError::Idem(
                e @ (idem::Error::NotKept(idem::NotKept::RolledBack { .. })
                | idem::Error::NotKept(idem::NotKept::NotCommitted)),
            )) => {
                assert!(e.is_transient(), "{what}: {e}");
                self.rolled_back += 1;
                true
            }
            // A conflict took the group's transaction: every call in it failed (a call's
            // savepoint gone with it), none kept.
            Err(AppError::Idem(e @ idem::Error::NotKept(idem::NotKept::Group { .. }))) => {
                assert!(e.is_transient(), "{what}: {e}");
                self.group_failed += 1;
                true
            }
            Err(e) if is_conflict(e) => {
                if let AppError::Idem(idem) = e {
                    assert!(
                        idem.is_transient(),
                        "{what}: a conflict is transient: {idem}"
                    );
                }
                self.conflicts += 1;
                true
            }
            other => panic!("{what} {}: {other:?}", job.key),
        }
    }
}

/// Delivers every job through every node at once (a task per delivery), then each delivery
/// that failed or found the key in progress again through its node until it answers, as a
/// broker redelivers a nacked job. Checks that each job was `Applied` exactly once and that
/// its effect is there once.
async fn through_every_node<F, Fut>(
    cluster: &Cluster,
    case: &Case,
    what: &str,
    jobs: &[Job],
    deliver: F,
) -> Tally
where
    F: Fn(usize, Job) -> Fut,
    Fut: Future<Output = Result<Outcome<i64>, AppError>> + Send + 'static,
{
    let aborts_before = aborts(cluster).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        for node in 0..NODES {
            tasks.push((i, node, tokio::spawn(deliver(node, job.clone()))));
        }
    }
    let mut tally = Tally::default();
    let mut applied = vec![0; jobs.len()];
    // Each job's answers, in the order they came, for a failure's message.
    let mut answers: Vec<Vec<String>> = vec![Vec::new(); jobs.len()];
    let mut again = Vec::new();
    for (i, node, task) in tasks {
        let answer = task.await.expect("a delivery panicked");
        tally.deliveries += 1;
        answers[i].push(format!("node {node}: {answer:?}"));
        if matches!(answer, Ok(Outcome::Applied(_))) {
            applied[i] += 1;
        }
        if tally.count(what, &jobs[i], &answer) {
            again.push((i, node));
        }
    }
    let deadline = Instant::now() + SETTLE_WITHIN;
    for (i, node) in again {
        loop {
            let answer = deliver(node, jobs[i].clone()).await;
            tally.redeliveries += 1;
            answers[i].push(format!("node {node} again: {answer:?}"));
            if matches!(answer, Ok(Outcome::Applied(_))) {
                applied[i] += 1;
            }
            if !tally.count(what, &jobs[i], &answer) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{what} {}: still nacked after {SETTLE_WITHIN:?}: {answer:?}",
                jobs[i].key
            );
            // A redelivery's interval, as a broker's: the key's holder is finishing, or this
            // node is applying the winner's writes.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The effects first: a job answered Applied twice with one effect is another failure
    // than one whose effect is there twice.
    let twice: Vec<_> = (0..jobs.len()).filter(|&i| applied[i] != 1).collect();
    if !twice.is_empty() {
        let (keys, doubled) = my::counts(&mut case.synced(0).await, &case.effects).await;
        let shown: Vec<_> = twice.iter().map(|&i| (&jobs[i].key, &answers[i])).collect();
        panic!(
            "{what}: Applied per job {applied:?}; effects (keys, doubled) = ({keys}, \
             {doubled}); the answers of those jobs: {shown:#?}"
        );
    }
    case.assert_once_each(0, jobs.len(), what).await;
    tally.aborted = aborts(cluster).await - aborts_before;
    eprintln!(
        "{what}: {} jobs x {NODES} nodes in {:?}: {tally:?}",
        jobs.len(),
        started.elapsed()
    );
    tally
}

/// Transactions the nodes aborted for a conflict: the ones certification failed
/// (`wsrep_local_cert_failures`) and the local ones the writes of another node's aborted
/// (`wsrep_local_bf_aborts`).
async fn aborts(cluster: &Cluster) -> u64 {
    cluster.total("wsrep_local_cert_failures").await + cluster.total("wsrep_local_bf_aborts").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idem_keeps_each_job_once_on_a_three_node_galera_cluster() {
    let started = Instant::now();
    let mut cluster = Cluster::start().await;
    eprintln!(
        "the cluster of {NODES} nodes synced in {:?}",
        started.elapsed()
    );
    let urls: Vec<String> = (0..NODES).map(|i| cluster.url(i)).collect();
    let mut pools = Vec::new();
    for url in &urls {
        pools.push(pool(url, 16).await);
    }
    let nodes = Nodes { urls, pools };

    let mut conflicts = 0;
    conflicts += transaction_mode(&cluster, &nodes).await.conflicts;
    conflicts += joined(&cluster, &nodes).await.conflicts;
    conflicts += replay(&cluster, &nodes).await.conflicts;
    // Lease mode's claims raced as much, but certification's aborts of them never reached
    // idem as errors: the nodes retried the statement (or idem did), which met the marker.
    let leases = [
        lease(&cluster, &nodes).await,
        lease_without_autocommit_retries(&cluster, &nodes).await,
    ];
    assert!(
        leases.iter().map(|t| t.aborted).sum::<u64>() > 0,
        "no lease claim was aborted by certification: {leases:?}"
    );
    conflicts += leases.iter().map(|t| t.conflicts).sum::<usize>();
    conflicts += group_commit(&cluster, &nodes).await.conflicts;
    conflicts += batch(&cluster, &nodes).await;
    // Deliveries that lost the race at COMMIT, over every mode: the race was real.
    assert!(conflicts > 0, "no delivery lost a certification conflict");
    eprintln!("conflicts over the modes: {conflicts}");
    a_commit_certification_refuses_is_not_applied(&nodes).await;
    a_lease_held_through_one_node_holds_on_the_others(&nodes).await;
    a_node_out_of_the_cluster_refuses_with_a_transient_error(&cluster, &nodes).await;
    a_node_killed_mid_run_loses_nothing(&mut cluster, &nodes).await;
    drop(cluster);
    eprintln!("the whole run: {:?}", started.elapsed());
}

async fn transaction_mode(cluster: &Cluster, nodes: &Nodes) -> Tally {
    let case = Case::new(nodes).await;
    let jobs = case.jobs(30);
    let stores = case.stores.clone();
    let tally = through_every_node(cluster, &case, "transaction", &jobs, move |node, job| {
        let store = stores[node].clone();
        async move { my::in_transaction(&store, &job).await }
    })
    .await;
    case.drop().await;
    tally
}

async fn joined(cluster: &Cluster, nodes: &Nodes) -> Tally {
    let case = Case::new(nodes).await;
    let jobs = case.jobs(30);
    let stores = case.stores.clone();
    let tally = through_every_node(cluster, &case, "joined", &jobs, move |node, job| {
        let store = stores[node].clone();
        async move {
            let mut tx = store.pool().begin().await?;
            let outcome = my::joined(store.join(&mut tx), &job).await?;
            // The caller's commit, checked: Applied only once it is certified.
            idem::commit(tx).await?;
            Ok(outcome)
        }
    })
    .await;
    case.drop().await;
    tally
}

async fn replay(cluster: &Cluster, nodes: &Nodes) -> Tally {
    let case = Case::new(nodes).await;
    let jobs = case.jobs(20);
    let stores = case.stores.clone();
    let tally = through_every_node(cluster, &case, "replay", &jobs, move |node, job| {
        let store = stores[node].clone();
        async move { my::replayed(&store, &job).await }
    })
    .await;
    case.drop().await;
    tally
}

/// Lease mode's claim is one statement in autocommit, an `INSERT` of the marker (or an
/// `UPDATE` taking a free lease over): two nodes can both run it, and certification lets one
/// commit. The other node retries the statement (`wsrep_retry_autocommit`), which then meets
/// the marker: `InProgress`, or `Duplicate` once the holder completed.
async fn lease(cluster: &Cluster, nodes: &Nodes) -> Tally {
    let case = Case::new(nodes).await;
    let jobs = case.jobs(30);
    let (stores, pools) = (case.stores.clone(), case.pools.clone());
    let tally = through_every_node(cluster, &case, "lease", &jobs, move |node, job| {
        let (store, pool) = (stores[node].clone(), pools[node].clone());
        async move { my::leased(&store, &job, &pool).await }
    })
    .await;
    case.drop().await;
    tally
}

/// Lease mode again, on sessions that do not let the node retry an autocommit statement
/// certification failed (`wsrep_retry_autocommit = 0`): the losing claim gets 1213, which idem
/// retries as a lost race; the retry meets the marker.
async fn lease_without_autocommit_retries(cluster: &Cluster, nodes: &Nodes) -> Tally {
    let mut pools = Vec::new();
    for url in &nodes.urls {
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10))
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql("SET SESSION wsrep_retry_autocommit = 0")
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            })
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
        pools.push(pool);
    }
    let nodes = Nodes {
        urls: nodes.urls.clone(),
        pools,
    };
    let case = Case::new(&nodes).await;
    let jobs = case.jobs(30);
    let (stores, pools) = (case.stores.clone(), case.pools.clone());
    let what = "lease, wsrep_retry_autocommit = 0";
    let tally = through_every_node(cluster, &case, what, &jobs, move |node, job| {
        let (store, pool) = (stores[node].clone(), pools[node].clone());
        async move { my::leased(&store, &job, &pool).await }
    })
    .await;
    case.drop().await;
    for pool in nodes.pools {
        pool.close().await;
    }
    tally
}

/// A group per node: the calls through one node share its transactions, so a conflict at a
/// group's commit fails every call of that group, each of which is redelivered.
async fn group_commit(cluster: &Cluster, nodes: &Nodes) -> Tally {
    let case = Case::new(nodes).await;
    let jobs = case.jobs(30);
    let groups: Vec<Group<MySql>> = case
        .stores
        .iter()
        .map(|s| s.group(GroupOptions::new()).expect("valid options"))
        .collect();
    let tally = through_every_node(cluster, &case, "group", &jobs, move |node, job| {
        let group = groups[node].clone();
        async move { my::grouped(&group, &job).await }
    })
    .await;
    case.drop().await;
    tally
}

/// Overlapping batches of 10 (0..10, 5..15, ..., 50..60), each delivered through every node at
/// once; a batch that failed is redelivered through its node until it commits. Returns the
/// batches that lost a conflict.
async fn batch(cluster: &Cluster, nodes: &Nodes) -> usize {
    let case = Case::new(nodes).await;
    let aborts_before = aborts(cluster).await;
    let started = Instant::now();
    let all = case.jobs(60);
    let batches: Vec<Vec<Job>> = (0..all.len() - 5)
        .step_by(5)
        .map(|start| all[start..(start + 10).min(all.len())].to_vec())
        .collect();
    let mut tasks = Vec::new();
    for batch in &batches {
        for node in 0..NODES {
            let (store, batch) = (case.stores[node].clone(), batch.clone());
            tasks.push(tokio::spawn(async move {
                let deadline = Instant::now() + SETTLE_WITHIN;
                let mut conflicts = 0;
                loop {
                    match my::batch(&store, &batch).await {
                        Ok(done) => return (batch, done, conflicts),
                        // A conflict, or a transaction the database threw away under the
                        // batch: nothing kept, redelivered.
                        Err(e)
                            if is_conflict(&e)
                                || matches!(
                                    e,
                                    AppError::Idem(idem::Error::NotKept(
                                        idem::NotKept::RolledBack { .. }
                                    ))
                                ) =>
                        {
                            conflicts += 1;
                            assert!(Instant::now() < deadline, "a batch kept failing: {e:?}");
                        }
                        Err(e) => panic!("a batch failed: {e:?}"),
                    }
                }
            }));
        }
    }
    let mut applied = std::collections::HashMap::new();
    let mut conflicts = 0;
    for task in tasks {
        let (batch, done, lost) = task.await.expect("a batch panicked");
        conflicts += lost;
        for (job, outcome) in batch.iter().zip(done.outcomes()) {
            match outcome {
                Outcome::Applied(()) => *applied.entry(job.key.clone()).or_insert(0) += 1,
                Outcome::Duplicate => {}
                other => panic!("{}: {other:?}", job.key),
            }
        }
    }
    assert_eq!(applied.len(), all.len(), "every job applied by some batch");
    assert!(
        applied.values().all(|&n| n == 1),
        "a job applied twice: {applied:?}"
    );
    case.assert_once_each(0, all.len(), "batch").await;
    eprintln!(
        "batch: {} batches x {NODES} nodes in {:?}: {conflicts} conflicts; certification \
         failures and brute-force aborts on the nodes: {}",
        batches.len(),
        started.elapsed(),
        aborts(cluster).await - aborts_before
    );
    case.drop().await;
    conflicts
}

/// The verified commit on a certifying cluster: each key's three deliveries, one per node, run
/// their bodies and wait for each other before any commits, so that every one of them inserted
/// the marker on its node. Certification lets exactly one commit; the two others fail at
/// `COMMIT` (or at the commit's probe, aborted by the winner's writes first) with a transient
/// error, never `Applied`, and keep nothing; their redelivery is a duplicate.
async fn a_commit_certification_refuses_is_not_applied(nodes: &Nodes) {
    let case = Case::new(nodes).await;
    let jobs = case.jobs(8);
    let mut message = None;
    for job in &jobs {
        let barrier = Arc::new(Barrier::new(NODES));
        let tasks: Vec<_> = (0..NODES)
            .map(|node| {
                let (store, job, barrier) =
                    (case.stores[node].clone(), job.clone(), barrier.clone());
                tokio::spawn(async move { my::together(&store, &job, &barrier).await })
            })
            .collect();
        let mut applied = 0;
        let mut losers = Vec::new();
        for (node, task) in tasks.into_iter().enumerate() {
            // A hang guard only: each body waits for the two others.
            let answer = tokio::time::timeout(SETTLE_WITHIN, task)
                .await
                .expect("the three deliveries met and committed")
                .expect("no panic");
            match answer {
                Ok(Outcome::Applied(v)) => {
                    assert_eq!(v, job.amount);
                    applied += 1;
                }
                // The claim's error (the commit's), not the body's.
                Err(AppError::Idem(e)) if my::number_of(&e) == Some(my::ER_LOCK_DEADLOCK) => {
                    assert!(e.is_transient(), "{e}");
                    message.get_or_insert_with(|| e.to_string());
                    losers.push(node);
                }
                other => panic!("{} through node {node}: {other:?}", job.key),
            }
        }
        assert_eq!(
            (applied, losers.len()),
            (1, NODES - 1),
            "{}: one Applied, the others refused at COMMIT",
            job.key
        );
        for node in losers {
            let deadline = Instant::now() + SETTLE_WITHIN;
            let alone = Barrier::new(1);
            loop {
                match my::together(&case.stores[node], job, &alone).await {
                    Ok(Outcome::Duplicate) => break,
                    Err(e) if is_conflict(&e) && Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    other => panic!("{} redelivered through node {node}: {other:?}", job.key),
                }
            }
        }
    }
    case.assert_once_each(0, jobs.len(), "refused at COMMIT")
        .await;
    eprintln!(
        "refused at COMMIT: {} keys, each Applied through one node and refused through {}: {}",
        jobs.len(),
        NODES - 1,
        message.unwrap_or_default()
    );
    case.drop().await;
}

/// A lease claimed through node 0, its body parked: claims of the key through the other
/// nodes find it in progress (the lease's marker is committed, and certified, before the body
/// runs); once it completed they are duplicates.
async fn a_lease_held_through_one_node_holds_on_the_others(nodes: &Nodes) {
    let case = Case::new(nodes).await;
    let jobs = case.jobs(5);
    for job in &jobs {
        let hold = Arc::new(Hold::default());
        let holder = {
            let (store, pool, job, hold) = (
                case.stores[0].clone(),
                case.pools[0].clone(),
                job.clone(),
                hold.clone(),
            );
            tokio::spawn(async move { my::lease_held(&store, &job, &pool, &hold).await })
        };
        hold.entered().await;
        for node in 1..NODES {
            match my::lease_held(&case.stores[node], job, &case.pools[node], &hold).await {
                Err(AppError::Idem(idem::Error::InProgress { .. })) => {}
                other => panic!("{} through node {node} while held: {other:?}", job.key),
            }
        }
        hold.release();
        let first = holder
            .await
            .expect("the holder")
            .expect("the holder's call");
        assert_eq!(first, Outcome::Applied(job.amount));
        for node in 1..NODES {
            let deadline = Instant::now() + SETTLE_WITHIN;
            loop {
                match my::lease_held(&case.stores[node], job, &case.pools[node], &hold).await {
                    Ok(Outcome::Duplicate) => break,
                    // The node has not applied the completion yet.
                    Err(AppError::Idem(idem::Error::InProgress { .. }))
                        if Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    other => panic!("{} through node {node} once done: {other:?}", job.key),
                }
            }
        }
    }
    case.assert_once_each(0, jobs.len(), "lease held").await;
    case.drop().await;
}

/// A node cut off from the others (`gmcast.isolate`) leaves the primary component: a claim
/// through it fails, with a transient error (1180 at `COMMIT` while it finds out, then 1047
/// `WSREP has not yet prepared node for application use`), and keeps nothing. Once it joined
/// again, the redelivery runs.
async fn a_node_out_of_the_cluster_refuses_with_a_transient_error(
    cluster: &Cluster,
    nodes: &Nodes,
) {
    const CUT: usize = NODES - 1;
    let case = Case::new(nodes).await;
    let jobs = case.jobs(2);
    let started = Instant::now();
    cluster.set_isolated(CUT, true).await;
    // Sent at once: the node may still count itself in the cluster, until its commit.
    let early = my::in_transaction(&case.stores[CUT], &jobs[0]).await;
    cluster.isolate(CUT).await;
    let late = my::in_transaction(&case.stores[CUT], &jobs[1]).await;
    let mut applied = 0;
    match early {
        // Committed before the node was cut off: kept, checked below.
        Ok(Outcome::Applied(_)) => applied += 1,
        Err(AppError::Idem(e @ idem::Error::Database(_))) => {
            assert!(e.is_transient(), "{e}");
            eprintln!("a claim as the node was cut off: {e}");
        }
        // The node left the cluster during the body: the body's own statement failed.
        Err(AppError::Db(e)) => eprintln!("a body as the node was cut off: {e}"),
        other => panic!("a claim as the node was cut off: {other:?}"),
    }
    match late {
        // `WSREP has not yet prepared node for application use`.
        Err(AppError::Idem(e)) if my::number_of(&e) == Some(1047) => {
            assert!(e.is_transient(), "{e}");
            eprintln!("a claim through a node out of the cluster: {e}");
        }
        other => panic!("a claim through a node out of the cluster: {other:?}"),
    }
    cluster.rejoin(CUT).await;
    eprintln!(
        "node {CUT} cut off and joined again in {:?}",
        started.elapsed()
    );
    let mut conn = case.synced(0).await;
    assert_eq!(
        my::counts(&mut conn, &case.effects).await,
        (applied, 0),
        "only a claim Applied before the cut kept its effect"
    );
    for job in &jobs {
        match my::in_transaction(&case.stores[CUT], job).await {
            Ok(Outcome::Applied(_) | Outcome::Duplicate) => {}
            other => panic!("{} redelivered once joined: {other:?}", job.key),
        }
    }
    case.assert_once_each(CUT, jobs.len(), "a node out of the cluster")
        .await;
    case.drop().await;
}
