//! One case's database, table and markers, and the runs of the binary against them.

pub(crate) mod bulk;
pub(crate) mod cases;
pub(crate) mod console;
pub(crate) mod doctor;
pub(crate) mod failed;
pub(crate) mod forget;
pub(crate) mod outbox;
pub(crate) mod sweep;

// The cases of every file, under one path for `every_backend!`.
pub(crate) use bulk::*;
pub(crate) use cases::*;
pub(crate) use console::*;
pub(crate) use doctor::*;
pub(crate) use failed::*;
pub(crate) use forget::*;
pub(crate) use outbox::*;
pub(crate) use sweep::*;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::{Claimed, Key, Lease, LeaseOptions, Outcome, Store};
use serde_json::Value;
use sqlx::Pool;
use tokio::io::AsyncWriteExt as _;

use crate::Db;

/// A name no other run uses: this process, the time, a counter.
pub(crate) fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_{}_{nanos}_{n}", std::process::id())
}

/// What one run of the binary did.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// Exit code 0, and nothing on standard error.
    pub(crate) fn ok(self) -> Run {
        assert_eq!((self.code, self.stderr.as_str()), (Some(0), ""), "{self:?}");
        self
    }

    /// Standard output as the one JSON document it must be.
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not one JSON document ({e}): {self:?}"))
    }

    /// The `name  value` lines of a readable marker.
    pub(crate) fn fields(&self) -> BTreeMap<String, String> {
        self.stdout
            .lines()
            .map(|line| {
                let (name, value) = line
                    .split_once(' ')
                    .unwrap_or_else(|| panic!("not a `name  value` line: {line:?}"));
                (name.to_owned(), value.trim_start().to_owned())
            })
            .collect()
    }
}

/// A JSON object's fields as the readable output writes them: null is `-`.
pub(crate) fn as_fields(doc: &Value) -> BTreeMap<String, String> {
    let Value::Object(map) = doc else {
        panic!("not an object: {doc}")
    };
    map.iter()
        .map(|(name, v)| {
            let text = match v {
                Value::Null => "-".to_owned(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (name.clone(), text)
        })
        .collect()
}

/// One case: its own table (and, on SQLite, its own file), with a store on it.
pub(crate) struct Fixture<B: Db> {
    pub(crate) url: String,
    pub(crate) pool: Pool<B::D>,
    pub(crate) store: Store<B::D>,
}

impl<B: Db> Fixture<B> {
    pub(crate) async fn new(case: &str) -> Self {
        let url = B::url();
        let pool = B::pool(&url).await;
        let table = unique(&format!("cli_{case}"));
        let store = Store::new(pool.clone())
            .with_table(&table)
            .expect("a plain table name");
        store.migrate().await.expect("migrate");
        Fixture { url, pool, store }
    }

    pub(crate) fn table(&self) -> &str {
        self.store.table()
    }

    /// `idem --database-url URL --table TABLE ARGS...`.
    pub(crate) async fn idem(&self, args: &[&str]) -> Run {
        let mut all = vec!["--database-url", &self.url, "--table", self.table()];
        all.extend_from_slice(args);
        run(&all, None, &[]).await
    }

    /// [`idem`](Fixture::idem) with `stdin` as standard input.
    pub(crate) async fn idem_stdin(&self, args: &[&str], stdin: &[u8]) -> Run {
        let mut all = vec!["--database-url", &self.url, "--table", self.table()];
        all.extend_from_slice(args);
        run(&all, Some(stdin), &[]).await
    }

    pub(crate) async fn exec(&self, sql: &str) {
        B::exec(&self.pool, sql).await;
    }

    /// Markers in the table.
    pub(crate) async fn markers(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {}", self.table());
        B::count(&self.pool, &sql).await
    }

    /// Markers of `scope` in the table.
    pub(crate) async fn markers_of(&self, scope: &str) -> i64 {
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE scope = '{scope}'",
            self.table()
        );
        B::count(&self.pool, &sql).await
    }

    /// Claims `key` in transaction mode and commits: a completed marker.
    pub(crate) async fn complete(&self, scope: &str, key: &Key) {
        match self.store.claim(scope, key).await.expect("claim") {
            Claimed::Fresh(guard) => {
                let done = guard.finish(Ok::<(), idem::Error>(())).await;
                assert_eq!(done.expect("commit"), Outcome::Applied(()));
            }
            Claimed::Duplicate | Claimed::Replayed(_) | Claimed::Failed(_) => {
                panic!("{scope} / {key} was claimed before")
            }
        }
    }

    /// Takes a lease of `secs` on `key`: an in-progress marker, live while the lease is.
    pub(crate) async fn lease(&self, scope: &str, key: &str, secs: u64) -> Lease {
        let key = Key::new(key).expect("a key");
        let options = LeaseOptions::new(Duration::from_secs(secs));
        match self.store.lease(scope, &key, options).await.expect("lease") {
            Claimed::Fresh(lease) => lease,
            Claimed::Duplicate | Claimed::Replayed(_) | Claimed::Failed(_) => {
                panic!("{scope} / {key} was leased before")
            }
        }
    }

    /// Moves the lease of `key` two hours into the past: run out, as after a crashed holder.
    pub(crate) async fn expire(&self, scope: &str, key: &str) {
        self.exec(&format!(
            "UPDATE {} SET locked_until = {} WHERE scope = '{scope}' AND {} = '{key}'",
            self.table(),
            B::TWO_HOURS_AGO,
            B::KEY
        ))
        .await;
    }

    pub(crate) async fn cleanup(self) {
        self.exec(&format!("DROP TABLE {}", self.table())).await;
        self.exec(&format!("DROP TABLE IF EXISTS {}_outbox", self.table()))
            .await;
        self.exec(&format!("DROP TABLE IF EXISTS {}_retention", self.table()))
            .await;
        self.exec(&format!("DROP TABLE IF EXISTS {}_steps", self.table()))
            .await;
        self.exec(&format!("DROP TABLE IF EXISTS {}_audit", self.table()))
            .await;
        self.pool.close().await;
        B::remove(&self.url);
    }
}

/// Runs the binary with `args` (and nothing else: no `DATABASE_URL` or `IDEM_TABLE` from the
/// environment unless `env` sets it).
pub(crate) async fn run(args: &[&str], stdin: Option<&[u8]>, env: &[(&str, &str)]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("IDEM_TABLE")
        .envs(env.iter().copied())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("the idem binary starts");
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("a stdin pipe");
        pipe.write_all(input).await.expect("write stdin");
        drop(pipe);
    }
    let out = child
        .wait_with_output()
        .await
        .expect("the idem binary ends");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).expect("UTF-8 output"),
        stderr: String::from_utf8(out.stderr).expect("UTF-8 errors"),
    }
}
