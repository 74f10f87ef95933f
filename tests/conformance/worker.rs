//! Worker processes: copies of the test binary that run only the `child_process` test, with
//! their orders in `IDEM_CONFORMANCE_*` variables, talking to the parent over stdin/stdout.

use std::process::{ExitStatus, Stdio};
use std::sync::Arc;

use idem::{Outcome, Store};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;

use super::Support;
use super::handlers::{Job, Then, apply, many_jobs};
use super::util::{SplitMix, within};

/// Environment variables that carry a worker process's orders.
pub(crate) const CHILD_MODE: &str = "IDEM_CONFORMANCE_CHILD";
pub(crate) const CHILD_URL: &str = "IDEM_CONFORMANCE_URL";
pub(crate) const CHILD_MARKERS: &str = "IDEM_CONFORMANCE_MARKERS";
pub(crate) const CHILD_EFFECTS: &str = "IDEM_CONFORMANCE_EFFECTS";
pub(crate) const CHILD_SEED: &str = "IDEM_CONFORMANCE_SEED";
pub(crate) const CHILD_JOBS: &str = "IDEM_CONFORMANCE_JOBS";
pub(crate) const CHILD_TASKS: &str = "IDEM_CONFORMANCE_TASKS";
pub(crate) const CHILD_KEY: &str = "IDEM_CONFORMANCE_KEY";

/// The name of the `#[ignore]`d test that is the worker process's entry point.
pub(crate) const CHILD_TEST: &str = "child_process";

/// A variable the parent test set for this worker process.
pub(crate) fn child_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("worker process started without {name}: the parent test sets it")
    })
}

/// A copy of this test binary, running only [`CHILD_TEST`], with stdin and stdout piped.
pub(crate) struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Lines<BufReader<ChildStdout>>,
    stderr: Option<JoinHandle<String>>,
    name: String,
}

impl Worker {
    pub(crate) fn spawn(name: &str, env: &[(&str, String)]) -> Worker {
        let exe = std::env::current_exe().expect("path of the test binary");
        let mut cmd = Command::new(exe);
        cmd.args([
            CHILD_TEST,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start worker {name}: {e}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped")).lines();
        let mut err = child.stderr.take().expect("piped");
        let stderr = tokio::spawn(async move {
            let mut s = String::new();
            drop(err.read_to_string(&mut s).await);
            s
        });
        Worker {
            child,
            stdin,
            stdout,
            stderr: Some(stderr),
            name: name.to_owned(),
        }
    }

    /// Reads stdout up to the first line that holds `prefix` and returns it from there on.
    pub(crate) async fn expect_line(&mut self, prefix: &str) -> String {
        let what = format!("worker {} printing {prefix}", self.name);
        let read = within(120, &what, async {
            loop {
                match self.stdout.next_line().await {
                    // libtest prints `test child_process ... ` without a newline before
                    // the test runs, so the worker's first line may follow it.
                    Ok(Some(line)) if line.contains(prefix) => {
                        let at = line.find(prefix).unwrap_or(0);
                        return Some(line[at..].to_owned());
                    }
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => return None,
                }
            }
        })
        .await;
        match read {
            Some(line) => line,
            None => {
                let status = within(60, "worker exit", self.child.wait()).await;
                let stderr = self.stderr().await;
                panic!(
                    "worker {} ended ({status:?}) before printing {prefix}; its stderr:\n{stderr}",
                    self.name
                )
            }
        }
    }

    /// The worker's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id().expect("a running worker has an id")
    }

    /// Writes one line to the worker's stdin.
    pub(crate) async fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin is piped");
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("write to worker");
        stdin.flush().await.expect("flush to worker");
    }

    /// SIGKILL, then the exit status.
    pub(crate) async fn kill(mut self) -> ExitStatus {
        self.child.start_kill().expect("send SIGKILL");
        within(60, "killed worker exit", self.child.wait())
            .await
            .expect("wait for killed worker")
    }

    /// Waits for the worker to end; panics with its stderr unless it succeeded.
    pub(crate) async fn succeed(mut self) {
        drop(self.stdin.take());
        let what = format!("worker {}", self.name);
        let status = within(120, &what, self.child.wait())
            .await
            .expect("wait for worker");
        if !status.success() {
            let stderr = self.stderr().await;
            panic!(
                "worker {} failed ({status}); its stderr:\n{stderr}",
                self.name
            );
        }
    }

    async fn stderr(&mut self) -> String {
        match self.stderr.take() {
            Some(h) => within(60, "worker stderr", h).await.unwrap_or_default(),
            None => String::new(),
        }
    }
}

/// Effect row (`id`, `amount`) of the job the worker of
/// `worker_killed_inside_the_body_keeps_nothing` hangs in.
pub(crate) const KILLED_JOB: (i64, i64) = (8, 80);

/// Starts the workers together: each is connected and has its order (it said `READY`)
/// before any gets `GO`.
pub(crate) async fn start_together(workers: &mut [Worker]) {
    for w in workers.iter_mut() {
        w.expect_line("READY").await;
    }
    for w in workers.iter_mut() {
        w.send("GO").await;
    }
}

/// Sums the workers' last lines, `DONE applied=A duplicate=D`; each must then exit cleanly.
pub(crate) async fn applied_and_duplicates(workers: Vec<Worker>) -> (i64, i64) {
    let (mut applied, mut duplicate) = (0_i64, 0_i64);
    for mut w in workers {
        let line = w.expect_line("DONE").await;
        let counts: Vec<i64> = line
            .split_whitespace()
            .filter_map(|kv| kv.split_once('=').map(|(_, v)| v.parse().expect("count")))
            .collect();
        let [a, d] = counts[..] else {
            panic!("bad line {line:?}")
        };
        applied += a;
        duplicate += d;
        w.succeed().await;
    }
    (applied, duplicate)
}

/// The worker's side of [`start_together`].
pub(crate) async fn ready_then_go() {
    println!("READY");
    let go = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .expect("read stdin")
    .expect("read stdin");
    assert_eq!(go.trim(), "GO", "unexpected order {go:?}");
}

/// The worker process's side: what each backend's `#[ignore]`d `child_process` test runs.
pub(crate) async fn child_process<S: Support>() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        panic!(
            "child_process is a worker process that the tests start with their orders \
             in {CHILD_MODE} and related variables; it refuses to run on its own"
        )
    };
    let url = child_env(CHILD_URL);
    let markers = child_env(CHILD_MARKERS);
    let effects = child_env(CHILD_EFFECTS);
    match mode.as_str() {
        "work" => {
            let seed: u64 = child_env(CHILD_SEED).parse().expect("seed");
            let n: i64 = child_env(CHILD_JOBS).parse().expect("jobs");
            let tasks: u32 = child_env(CHILD_TASKS).parse().expect("tasks");
            let pool = S::connect(&url, tasks).await;
            let store = Store::new(pool).with_table(&markers).expect("table name");
            let mut jobs = many_jobs(n, &effects);
            SplitMix::new(seed).shuffle(&mut jobs);
            jobs.reverse(); // popped from the end
            let queue = Arc::new(std::sync::Mutex::new(jobs));
            ready_then_go().await;
            let runners: Vec<_> = (0..tasks)
                .map(|_| {
                    let (store, queue) = (store.clone(), queue.clone());
                    tokio::spawn(async move {
                        let (mut a, mut d) = (0_i64, 0_i64);
                        loop {
                            let next = queue.lock().expect("queue").pop();
                            let Some(job) = next else { break (a, d) };
                            match apply(&store, &job, Then::Commit).await {
                                Ok(Outcome::Applied(v)) => {
                                    assert_eq!(v, job.amount);
                                    a += 1;
                                }
                                Ok(Outcome::Duplicate | Outcome::Replayed(_)) => d += 1,
                                Ok(Outcome::Failed(f)) => panic!("{} failed: {f:?}", job.key),
                                Err(e) => panic!("delivery of {} failed: {e:?}", job.key),
                            }
                        }
                    })
                })
                .collect();
            let (mut a, mut d) = (0, 0);
            for r in runners {
                let (ra, rd) = r.await.expect("worker task");
                a += ra;
                d += rd;
            }
            println!("DONE applied={a} duplicate={d}");
        }
        "hang" => {
            let pool = S::connect(&url, 1).await;
            let store = Store::new(pool).with_table(&markers).expect("table name");
            let (id, amount) = KILLED_JOB;
            let job = Job {
                key: child_env(CHILD_KEY),
                id,
                amount,
                effects,
            };
            let r = apply(&store, &job, Then::Hang).await;
            panic!("the handler returned {r:?}; it should have hung in its body");
        }
        "batch_outbox_hang" => {
            super::cases::batch_outbox_child::<S>(&url, &markers, &effects).await;
        }
        "batch_hang" | "batch_work" => {
            super::cases::batch_child::<S>(&mode, &url, &markers, &effects).await;
        }
        "steps_hang" => {
            super::cases::steps_child::<S>(&url, &markers, &effects).await;
        }
        "lease_hang" | "lease_block" => {
            super::cases::lease_child::<S>(&mode, &url, &markers, &effects).await;
        }
        other => panic!("unknown {CHILD_MODE} {other:?}"),
    }
}
