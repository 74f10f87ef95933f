//! Worker processes for the broker tests: copies of the test binary that run only its
//! `#[ignore]`d `child_process` test, with their orders in environment variables, printing one
//! line per event on stdout and stopping on a `STOP` line (or end of file) on stdin.

#![allow(dead_code)]

use std::future::Future;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::task::JoinHandle;

/// The variable that makes a copy of the test binary a worker; its value is the mode.
pub const CHILD_MODE: &str = "IDEM_BROKER_CHILD";
/// The name of the `#[ignore]`d test that is a worker process's entry point.
pub const CHILD_TEST: &str = "child_process";

/// PostgreSQL of the worker processes: `IDEM_POSTGRES_URL`, else the local server.
pub fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Connects to PostgreSQL; panics naming the URL and the variable that overrides it.
pub async fn postgres(max: u32) -> sqlx::PgPool {
    let url = postgres_url();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url} (set IDEM_POSTGRES_URL): {e}"))
}

/// A variable the parent test set for this worker process.
pub fn child_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("worker process started without {name}: the parent test sets it")
    })
}

/// Resolves when the parent writes `STOP` or closes the worker's stdin (the parent died).
pub fn stop_signal() -> impl Future<Output = ()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::stdin().read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) if line.trim() == "STOP" => break,
                Ok(_) => {}
            }
        }
        // The receiver gone means the worker is already stopping.
        let _ = tx.send(());
    });
    async move {
        drop(rx.await);
    }
}

/// Fails the test if `fut` takes longer than `secs`: every wait of these tests is bounded.
pub async fn within<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {secs} s"))
}

/// A line a worker printed, with the index the parent gave the worker.
pub type Line = (usize, String);

/// A copy of this test binary, running only [`CHILD_TEST`] in `mode`.
pub struct Worker {
    pub index: usize,
    child: Child,
    stdin: Option<ChildStdin>,
    stderr: Option<JoinHandle<String>>,
}

impl Worker {
    /// Starts worker `index`; its stdout lines go to `lines`.
    pub fn spawn(
        index: usize,
        mode: &str,
        env: &[(&str, String)],
        lines: UnboundedSender<Line>,
    ) -> Worker {
        let exe = std::env::current_exe().expect("path of the test binary");
        let mut cmd = Command::new(exe);
        cmd.args([
            CHILD_TEST,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_MODE, mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start worker {index}: {e}"));
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().expect("piped")).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                // libtest prints `test child_process ... ` without a newline before the test
                // runs, so the worker's first line may follow it.
                let line = match line.find("test child_process ... ") {
                    Some(at) => line[at + "test child_process ... ".len()..].to_owned(),
                    None => line,
                };
                if lines.send((index, line)).is_err() {
                    break;
                }
            }
        });
        let mut err = child.stderr.take().expect("piped");
        let stderr = tokio::spawn(async move {
            let mut s = String::new();
            drop(err.read_to_string(&mut s).await);
            s
        });
        Worker {
            index,
            child,
            stdin,
            stderr: Some(stderr),
        }
    }

    /// Asks the worker to finish what it holds and stop.
    pub async fn stop(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            // A worker that already ended has closed its stdin; its exit status tells.
            drop(stdin.write_all(b"STOP\n").await);
            drop(stdin.flush().await);
        }
    }

    /// SIGKILL, then the exit status.
    pub async fn kill(mut self) -> ExitStatus {
        self.child.start_kill().expect("send SIGKILL");
        within(60, "killed worker exit", self.child.wait())
            .await
            .expect("wait for killed worker")
    }

    /// Waits for the worker to end; panics with its stderr unless it succeeded.
    pub async fn succeed(mut self) {
        let status = within(60, "worker exit", self.child.wait())
            .await
            .expect("wait for worker");
        if !status.success() {
            let stderr = match self.stderr.take() {
                Some(h) => within(30, "worker stderr", h).await.unwrap_or_default(),
                None => String::new(),
            };
            panic!(
                "worker {} failed ({status}); its stderr:\n{stderr}",
                self.index
            );
        }
    }
}

/// Lines of one or more workers.
pub struct Lines {
    pub tx: UnboundedSender<Line>,
    rx: UnboundedReceiver<Line>,
    /// Every line read so far, for failure messages.
    pub seen: Vec<Line>,
}

impl Lines {
    pub fn new() -> Lines {
        let (tx, rx) = unbounded_channel();
        Lines {
            tx,
            rx,
            seen: Vec::new(),
        }
    }

    /// The next line of any worker, within `secs`.
    pub async fn next(&mut self, secs: u64) -> Line {
        let line = tokio::time::timeout(Duration::from_secs(secs), self.rx.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "no worker printed a line within {secs} s; so far:\n{}",
                    self.dump()
                )
            })
            .expect("the test holds a sender");
        self.seen.push(line.clone());
        line
    }

    /// The next line of any worker, or `None` if none comes within `quiet`.
    pub async fn next_or_quiet(&mut self, quiet: Duration) -> Option<Line> {
        let line = tokio::time::timeout(quiet, self.rx.recv()).await.ok()?;
        let line = line.expect("the test holds a sender");
        self.seen.push(line.clone());
        Some(line)
    }

    /// Reads lines up to the first that starts with `prefix`, within `secs` in all.
    pub async fn expect(&mut self, prefix: &str, secs: u64) -> Line {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let line = match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(line)) => line,
                _ => panic!(
                    "no worker printed {prefix:?} within {secs} s; so far:\n{}",
                    self.dump()
                ),
            };
            self.seen.push(line.clone());
            if line.1.starts_with(prefix) {
                return line;
            }
        }
    }

    pub fn dump(&self) -> String {
        self.seen
            .iter()
            .map(|(i, l)| format!("[{i}] {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
