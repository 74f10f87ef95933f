//! What the crash tests of both job frameworks share: the job they push, the worker process's
//! guard and environment, the checks on an example's run, the wait for the re-run's outcome, a
//! bounded poll of the framework's job row, and the second worker's clean stop.

#![allow(dead_code)]

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

use idem_example_jobs::{PAUSE_AFTER_COMMIT, TopUp};

use crate::db::{CHILD_DB, TestDb};
use crate::support::{CHILD_MODE, Lines, Worker, within};

pub fn job(n: i64) -> TopUp {
    TopUp {
        id: format!("top-up-{n}"),
        account: n,
        credits: 10 * n,
    }
}

/// Panics unless this process is a worker that a test started.
pub fn assert_child_process() {
    if std::env::var(CHILD_MODE).is_err() {
        panic!("child_process is a worker process that the tests start with {CHILD_MODE} set")
    }
}

/// A worker process's variables: the test's database and, with `pause`, the pause after
/// idem's commit.
pub fn child_vars(db: &TestDb, pause: bool) -> Vec<(&'static str, String)> {
    let mut env = vec![(CHILD_DB, db.name.clone())];
    if pause {
        env.push((PAUSE_AFTER_COMMIT, "1".to_owned()));
    }
    env
}

/// The report of an example's `run` and what it wrote; panics with both if it failed.
pub fn example_report<R, E: Display>(report: Result<R, E>, out: Vec<u8>) -> (R, String) {
    let text = String::from_utf8(out).unwrap();
    let report = report.unwrap_or_else(|e| panic!("{e}\n{text}"));
    (report, text)
}

/// An example's effects: each of its five jobs applied exactly once.
pub fn assert_each_applied_once(effects: &[(String, i64)], text: &str) {
    assert_eq!(effects.len(), 5, "{text}");
    assert!(effects.iter().all(|(_, n)| *n == 1), "{text}");
}

/// The first line of worker 1 that contains `needle` (the outcome it reports for the job).
pub async fn rerun_outcome(lines: &mut Lines, needle: &str) -> String {
    within(60, "the re-run", async {
        loop {
            let (index, line) = lines.next(60).await;
            if index == 1 && line.contains(needle) {
                return line;
            }
        }
    })
    .await
}

/// Probes every 50 ms until `done` holds for what `probe` returns, or 30 s passed; the last
/// probe either way, for the test to assert on.
pub async fn poll_until<T, F: Future<Output = T>>(
    mut probe: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut poll = tokio::time::interval(Duration::from_millis(50));
    loop {
        poll.tick().await;
        let found = probe().await;
        if done(&found) || Instant::now() > deadline {
            return found;
        }
    }
}

/// Asks `worker` to stop, and checks that it did, cleanly.
pub async fn stop_cleanly(mut worker: Worker, lines: &mut Lines) {
    worker.stop().await;
    lines.expect("STOPPED", 60).await;
    worker.succeed().await;
}
