//! The `sqs_worker` example against a real SQS implementation (moto's server at
//! `IDEM_SQS_URL`), and its worker loop in processes that are SIGKILLed at chosen points, on
//! PostgreSQL. Every effect is a row in a table without a unique index, so an effect applied
//! twice shows.

#[allow(dead_code)]
#[path = "../sqs_worker.rs"]
mod sqs_worker;

mod common;

use std::path::PathBuf;

use common::support::{Line, Lines, Worker, within};
use common::{Names, job, lease_env, sqs};
use idem_example_sqs::{dedup_id, messages_left, send_jobs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that the tests start themselves"]
async fn child_process() {
    common::child_main().await;
}

/// Reads lines until one of worker `index` starts with `prefix`, within `secs` in all.
async fn expect_from(lines: &mut Lines, index: usize, prefix: &str, secs: u64) -> Line {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let line = lines.next(left.as_secs().max(1)).await;
        if line.0 == index && line.1.starts_with(prefix) {
            return line;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker {index} printed no {prefix:?} within {secs} s; so far:\n{}",
            lines.dump()
        );
    }
}

/// Lines of worker `index` seen so far that start with `prefix`.
fn seen(lines: &Lines, index: usize, prefix: &str) -> Vec<String> {
    lines
        .seen
        .iter()
        .filter(|(i, l)| *i == index && l.starts_with(prefix))
        .map(|(_, l)| l.clone())
        .collect()
}

/// Stops the workers and reads their lines up to each one's `STOPPED`.
async fn stop_all(lines: &mut Lines, workers: Vec<Worker>) {
    let mut workers = workers;
    for w in &mut workers {
        w.stop().await;
    }
    let mut stopped = 0;
    while stopped < workers.len() {
        stopped += usize::from(lines.next(60).await.1 == "STOPPED");
    }
    for w in workers {
        w.succeed().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn example_applies_each_job_once_and_dead_letters_the_rest() {
    let dir = std::env::temp_dir().join(format!("idem-test-sqs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    let url = idem_example_sqs::sqs_url();
    let report = within(
        120,
        "the sqs_worker example",
        sqs_worker::run(&url, &dir.join("jobs.db"), &mut out),
    )
    .await;
    std::fs::remove_dir_all(&dir).unwrap();
    let text = String::from_utf8(out).unwrap();
    let report = report.unwrap_or_else(|e| panic!("{e}\n{text}"));
    let t = report.top_ups;
    assert_eq!(
        (t.applied, t.duplicates, t.dead_lettered),
        (5, 5, 1),
        "{text}"
    );
    assert_eq!(report.balances, [(1, 160), (2, 190)], "{text}");
    let r = report.receipts;
    assert_eq!(
        (r.applied, r.duplicates, r.dead_lettered),
        (3, 3, 1),
        "{text}"
    );
    assert_eq!(report.receipts_sent.len(), 3, "{text}");
    assert!(
        report.receipts_sent.iter().all(|l| !l.contains("999")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_between_commit_and_delete_the_redelivery_is_a_duplicate() {
    let names = Names::create("commit_delete", 2, 5).await;
    let client = sqs().await;
    let jobs = [job(1), job(2), job(3)];
    send_jobs(&client, &names.queue.url, &jobs).await.unwrap();

    let mut lines = Lines::new();
    let first = Worker::spawn(0, "pause_after_commit", &names.env(), lines.tx.clone());
    let (_, committed) = lines.expect("COMMITTED", 60).await;
    let ids: Vec<String> = committed.split(' ').skip(1).map(str::to_owned).collect();
    let n = ids.len() as i64;
    let sum: i64 = ids.iter().map(|id| id[7..].parse::<i64>().unwrap()).sum();
    // Committed and not deleted: the effects are in, the messages are still SQS's.
    assert_eq!(names.effects().await, (n, n, sum));
    assert!(!first.kill().await.success());

    let second = Worker::spawn(1, "batch", &names.env(), lines.tx.clone());
    let mut deleted = Vec::new();
    while deleted.len() < jobs.len() {
        let (_, line) = expect_from(&mut lines, 1, "DELETED", 60).await;
        deleted.push(line);
    }
    for id in &ids {
        // Handed out again once the visibility timeout ran out: a second receive.
        let received = seen(&lines, 1, &format!("RECEIVED {id} "));
        let count: u32 = received[0]
            .rsplit("count=")
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(count >= 2, "{received:?}\n{}", lines.dump());
        assert!(
            deleted.contains(&format!("DELETED duplicate {id}")),
            "{}",
            lines.dump()
        );
    }
    assert_eq!(names.wait_empty(30).await, (0, 0), "{}", lines.dump());
    stop_all(&mut lines, vec![second]).await;
    assert_eq!(names.effects().await, (3, 3, 6), "{}", lines.dump());
}

/// Starts a lease test: job 1 sent to a fresh queue (visibility timeout 2 s), worker 0 in
/// `mode` inside the handler's body, held there until the test writes the gate file, then
/// worker 1 in `mode`. The queue's names, the gate, the lines, worker 0, worker 1.
async fn start_lease_test(test: &str, mode: &str) -> (Names, PathBuf, Lines, Worker, Worker) {
    let names = Names::create(test, 2, 10).await;
    let gate = std::env::temp_dir().join(format!("idem-sqs-gate-{test}-{}", std::process::id()));
    drop(std::fs::remove_file(&gate));
    send_jobs(&sqs().await, &names.queue.url, [&job(1)])
        .await
        .unwrap();

    let mut lines = Lines::new();
    let env = lease_env(&names, &gate);
    let first = Worker::spawn(0, mode, &env, lines.tx.clone());
    expect_from(&mut lines, 0, "IN BODY top-up-1", 60).await;
    let second = Worker::spawn(1, mode, &env, lines.tx.clone());
    (names, gate, lines, first, second)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_handler_slower_than_the_visibility_timeout_is_handed_out_again_and_applies_once() {
    let (names, gate, mut lines, first, second) =
        start_lease_test("lease_no_beat", "lease_renew_only").await;
    // The first still runs (it waits for the gate) and renews its lease, but nothing extends
    // the message's visibility: SQS hands it to the second, which finds the lease live.
    let (_, retried) = expect_from(&mut lines, 1, "RETRY top-up-1", 60).await;
    assert!(retried.contains("after=1s"), "{}", lines.dump());
    assert!(retried.contains("in progress"), "{}", lines.dump());
    let received = seen(&lines, 1, "RECEIVED top-up-1");
    assert!(received[0].ends_with("count=2"), "{}", lines.dump());
    assert!(seen(&lines, 0, "HANDLED").is_empty(), "{}", lines.dump());
    std::fs::write(&gate, b"open").unwrap();

    expect_from(&mut lines, 0, "DELETED applied top-up-1", 60).await;
    // Deleted with the first receipt handle; SQS may keep a message whose handle is stale
    // (moto deletes it): the second then gets it again, a duplicate, and deletes it.
    assert_eq!(names.wait_empty(30).await, (0, 0), "{}", lines.dump());
    stop_all(&mut lines, vec![first, second]).await;
    drop(std::fs::remove_file(&gate));
    let applied: usize = (0..2)
        .map(|i| seen(&lines, i, "HANDLED applied").len())
        .sum();
    let bodies: usize = (0..2).map(|i| seen(&lines, i, "IN BODY").len()).sum();
    assert_eq!((applied, bodies), (1, 1), "{}", lines.dump());
    assert_eq!(names.effects().await, (1, 1, 1), "{}", lines.dump());
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_heartbeat_a_slow_lease_handler_keeps_its_message() {
    let (names, gate, mut lines, first, second) =
        start_lease_test("lease_beat", "lease_heartbeat").await;
    expect_from(&mut lines, 1, "READY", 60).await;
    // Six heartbeats 0.7 s apart: past twice the visibility timeout (2 s) and past the lease
    // (3 s), which only the renewals kept. The second worker polls all along.
    for _ in 0..6 {
        let (_, beat) = expect_from(&mut lines, 0, "HEARTBEAT top-up-1", 60).await;
        assert_eq!(beat, "HEARTBEAT top-up-1 extended=true", "{}", lines.dump());
    }
    assert!(seen(&lines, 1, "RECEIVED").is_empty(), "{}", lines.dump());
    std::fs::write(&gate, b"open").unwrap();

    expect_from(&mut lines, 0, "DELETED applied top-up-1", 60).await;
    assert_eq!(
        seen(&lines, 0, "RECEIVED"),
        ["RECEIVED top-up-1 count=1"],
        "{}",
        lines.dump()
    );
    assert_eq!(names.wait_empty(30).await, (0, 0), "{}", lines.dump());
    stop_all(&mut lines, vec![first, second]).await;
    drop(std::fs::remove_file(&gate));
    assert!(seen(&lines, 1, "RECEIVED").is_empty(), "{}", lines.dump());
    assert_eq!(names.effects().await, (1, 1, 1), "{}", lines.dump());
}

/// A FIFO queue drops a send whose `MessageDeduplicationId` it saw within its deduplication
/// interval. Only copies sent while the first is still in the queue are checked: moto forgets
/// an id once its message is deleted, where SQS keeps it for the whole 5 minutes.
#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_queue_drops_a_retried_send_with_the_same_job_id() {
    let client = sqs().await;
    let name = format!("idem-test-fifo-{}.fifo", std::process::id());
    let queue = idem_example_sqs::create_queue(&client, &name, 2, 5)
        .await
        .unwrap();
    let jobs = [job(1), job(2), job(3)];
    let sent = async {
        // The producer's retry: every job sent twice.
        send_jobs(&client, &queue.url, jobs.iter().chain(&jobs))
            .await
            .unwrap();
        messages_left(&client, &queue.url).await.unwrap()
    };
    let left = sent.await;
    idem_example_sqs::delete_queue(&client, &queue)
        .await
        .unwrap();
    assert_eq!(left, (3, 0));
    assert_eq!(dedup_id(&jobs[0]).unwrap(), "10:sqs.top_up|8:top-up-1");
}
