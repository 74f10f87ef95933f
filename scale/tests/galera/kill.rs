//! A node SIGKILLed while workers on every node claim jobs, restarted, and rejoined.

use super::*;

/// Workers per node, jobs, and how many `Applied` before a node is killed.
const WORKERS: usize = 3;
const KILL_JOBS: usize = 240;
const APPLIED_BEFORE_KILL: usize = 80;

/// The answer of a job's first delivery.
#[derive(Clone, Debug)]
enum First {
    NotDelivered,
    Applied,
    Duplicate,
    Failed(String),
}

/// Workers on every node claim fresh jobs in transaction mode; once some were `Applied`, one
/// node gets SIGKILL. Its workers stop at their first failed call; the others go on (their
/// commits wait until the cluster has dropped the dead node). The node is started again and
/// rejoins (IST); every job whose call failed, or that no worker reached, is delivered again
/// through it. Every key has its effect once, and every job a worker saw `Applied` is there.
pub(super) async fn a_node_killed_mid_run_loses_nothing(cluster: &mut Cluster, nodes: &Nodes) {
    const KILLED: usize = 1;
    let case = Case::new(nodes).await;
    let jobs = Arc::new(case.jobs(KILL_JOBS));
    let first = Arc::new(Mutex::new(vec![First::NotDelivered; KILL_JOBS]));
    let next = Arc::new(AtomicUsize::new(0));
    let (applied_tx, mut applied_rx) = watch::channel(0usize);
    let applied_tx = Arc::new(applied_tx);
    let mut workers = Vec::new();
    for node in 0..NODES {
        for _ in 0..WORKERS {
            let (store, jobs, first, next, applied) = (
                case.stores[node].clone(),
                jobs.clone(),
                first.clone(),
                next.clone(),
                applied_tx.clone(),
            );
            workers.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(job) = jobs.get(i) else { return };
                    let answer = my::worked(&store, job).await;
                    let (seen, stop) = match &answer {
                        Ok(Outcome::Applied(_)) => {
                            applied.send_modify(|n| *n += 1);
                            (First::Applied, false)
                        }
                        Ok(Outcome::Duplicate) => (First::Duplicate, false),
                        Ok(other) => panic!("{}: {other:?}", job.key),
                        Err(e) => {
                            if let AppError::Idem(e) = e {
                                assert!(e.is_transient(), "{}: {e}", job.key);
                            }
                            // The killed node's workers stop, as a worker whose database is
                            // gone would; the others go on.
                            (First::Failed(format!("{e:?}")), node == KILLED)
                        }
                    };
                    first.lock().expect("first")[i] = seen;
                    if stop {
                        return;
                    }
                }
            }));
        }
    }
    applied_rx
        .wait_for(|n| *n >= APPLIED_BEFORE_KILL)
        .await
        .expect("the workers run");
    let killed_at = Instant::now();
    cluster.kill(KILLED).await;
    for worker in workers {
        worker.await.expect("a worker panicked");
    }
    let drained = killed_at.elapsed();
    let transfer = cluster.restart(KILLED).await;
    let rejoined = killed_at.elapsed();
    let first = first.lock().expect("first").clone();
    let mut redelivered = (0, 0);
    for (job, seen) in jobs.iter().zip(&first) {
        if matches!(seen, First::Applied | First::Duplicate) {
            continue;
        }
        let deadline = Instant::now() + SETTLE_WITHIN;
        loop {
            match my::worked(&case.stores[KILLED], job).await {
                Ok(Outcome::Applied(_)) => redelivered.0 += 1,
                Ok(Outcome::Duplicate) => redelivered.1 += 1,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("{} redelivered through the restarted node: {e:?}", job.key);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                other => panic!("{} redelivered: {other:?}", job.key),
            }
            break;
        }
    }
    // Read through the node that was killed, and through another: the same, whole.
    for node in [KILLED, 0] {
        case.assert_once_each(node, KILL_JOBS, "a node killed mid-run")
            .await;
    }
    let mut conn = case.synced(0).await;
    let kept: std::collections::HashSet<String> = my::keys(&mut conn, &case.effects)
        .await
        .into_iter()
        .collect();
    let applied: Vec<&Job> = jobs
        .iter()
        .zip(&first)
        .filter(|(_, seen)| matches!(seen, First::Applied))
        .map(|(job, _)| job)
        .collect();
    assert!(
        applied.iter().all(|job| kept.contains(&job.key)),
        "an Applied job's effect is missing"
    );
    let failed: Vec<&String> = first
        .iter()
        .filter_map(|seen| match seen {
            First::Failed(e) => Some(e),
            _ => None,
        })
        .collect();
    eprintln!(
        "node {KILLED} killed after {APPLIED_BEFORE_KILL} Applied: {} jobs Applied at their \
         first delivery, {} failed, {} not reached; redelivered: {} Applied, {} Duplicate (had \
         committed before the kill); the workers done {drained:?} after the kill, the node \
         synced again {rejoined:?} after it ({transfer}); first failure: {:?}",
        applied.len(),
        failed.len(),
        first
            .iter()
            .filter(|s| matches!(s, First::NotDelivered))
            .count(),
        redelivered.0,
        redelivered.1,
        failed.first()
    );
    case.drop().await;
}
