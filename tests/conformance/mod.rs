//! The conformance suite: every behaviour idem promises, written once and run against every
//! backend on a real database.
//!
//! A backend joins with one trait impl and one line (see `tests/postgres.rs`):
//!
//! ```text
//! struct Pg;
//! impl conformance::Support for Pg { ... }        // connect, SQL dialect
//! impl conformance::Server for Pg { ... }         // only for servers: kill a connection
//! conformance::suite!(Pg, server);                // `conformance::suite!(Lite);` without a server
//! ```
//!
//! Every test makes its own tables (unique names), so tests run in parallel and reruns never
//! collide; a test that passes drops them again. A server that cannot be reached fails the test
//! with the URL and the environment variable that overrides it: the suite never skips.

use std::future::Future;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{Database, Pool};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;

/// What the suite needs to know about one database.
pub(crate) trait Support: 'static {
    /// The sqlx database type handlers run on.
    type Db: idem::Backend;

    /// A database URL for one test: the server's (from the environment variable or the default)
    /// or, for an embedded database, a new file.
    fn url() -> String;

    /// A pool of at most `max` connections to `url`. Panics, naming the URL and the variable
    /// that overrides it, when the database cannot be reached.
    fn connect(url: &str, max: u32) -> impl Future<Output = Pool<Self::Db>> + Send;

    /// `sql` written with `$1, $2, ...` in this database's placeholder style.
    fn sql(sql: &str) -> String {
        sql.to_owned()
    }

    /// An SQL expression that reads the marker table's `key` column as text.
    const KEY_TEXT: &'static str;

    /// The type to `CAST` an aggregate to so that it decodes as `i64`.
    const BIGINT: &'static str;

    /// An SQL expression for the time two hours ago, in the marker table's time format.
    const TWO_HOURS_AGO: &'static str;

    /// Removes what [`url`](Support::url) created outside the database (files), if anything.
    fn remove(_url: &str) {}
}

/// What the suite needs from a database server (not from an embedded database).
#[allow(dead_code, reason = "only the backends that need it use it")]
pub(crate) trait Server: Support {
    /// The environment variable that overrides the server's URL.
    const URL_VAR: &'static str;

    /// A URL of this scheme on which no server listens.
    const UNREACHABLE_URL: &'static str;

    /// The id by which another session can kill this connection.
    fn connection_id(
        conn: &mut <Self::Db as Database>::Connection,
    ) -> impl Future<Output = i64> + Send + '_;

    /// Kills the connection `id` from another session of `pool`.
    fn kill(pool: &Pool<Self::Db>, id: i64) -> impl Future<Output = ()> + Send + '_;
}

/// The URL of a server: `var` if set, else `default`.
#[allow(dead_code, reason = "only the backends that need it use it")]
pub(crate) fn server_url(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// The failure of a test whose server cannot be reached. Never a skip.
#[allow(dead_code, reason = "only the backends that need it use it")]
pub(crate) fn unreachable(name: &str, url: &str, var: &str, err: &dyn std::fmt::Display) -> ! {
    panic!(
        "cannot connect to {name} at {url}: {err}. Start the server, or set {var} to the URL \
         of one (the conformance suite never skips a backend)"
    )
}

/// `$1, $2, ...` (in order, each once) rewritten to `?`, for MySQL.
#[allow(dead_code, reason = "only the backends that need it use it")]
pub(crate) fn question_marks(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut next = 1;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            let mut n = 0;
            while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                n = n * 10 + d;
                chars.next();
            }
            assert_eq!(n, next, "placeholders must run $1, $2, ... in order: {sql}");
            next += 1;
            out.push('?');
        } else {
            out.push(c);
        }
    }
    out
}

/// SplitMix64: a small seeded generator, enough to shuffle jobs reproducibly.
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher-Yates.
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// A name no other test or earlier run uses: `{kind}_{tag}_{12 hex digits}`, a plain SQL
/// identifier of at most 51 characters.
pub(crate) fn unique_name(kind: &str, tag: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as u64;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut rng = SplitMix::new(nanos ^ (u64::from(std::process::id()) << 40) ^ (n << 20));
    let tag: String = tag.chars().take(30).collect();
    format!("{kind}_{tag}_{:012x}", rng.next_u64() >> 16)
}

/// The seed for shuffles: `IDEM_CONFORMANCE_SEED` to repeat a run, else a fresh one.
pub(crate) fn seed() -> u64 {
    match std::env::var("IDEM_CONFORMANCE_SEED") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("IDEM_CONFORMANCE_SEED={s:?} is not a u64")),
        Err(_) => SplitMix::new(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("clock after 1970")
                .as_nanos() as u64,
        )
        .next_u64(),
    }
}

/// `fut`, or a panic naming `what` after `secs` seconds: a guard against a hang, never a way
/// to wait for something.
pub(crate) async fn within<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {secs} s"))
}

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

/// The conformance suite for one backend: `suite!(Support)` for an embedded database,
/// `suite!(Support, server)` for a server (adds the tests that kill a connection and that
/// require a loud failure when the server is down).
macro_rules! suite {
    (@common $support:ty) => {
        use ::std::sync::Arc;

        use ::idem::{Outcome, Store};
        use ::sqlx::{AssertSqlSafe, Pool, Transaction};

        use $crate::conformance as cf;

        type S = $support;
        type Db = <S as cf::Support>::Db;

        /// `sql` in this database's placeholder style.
        fn q(sql: &str) -> AssertSqlSafe<String> {
            AssertSqlSafe(<S as cf::Support>::sql(sql))
        }

        /// The error type of every test handler.
        #[derive(Debug)]
        enum TestError {
            Idem(::idem::Error),
            Db(::sqlx::Error),
            Refused,
        }

        impl From<::idem::Error> for TestError {
            fn from(e: ::idem::Error) -> Self {
                TestError::Idem(e)
            }
        }

        impl From<::sqlx::Error> for TestError {
            fn from(e: ::sqlx::Error) -> Self {
                TestError::Db(e)
            }
        }

        /// One job: its idempotency key, and the effect row (`id`, `amount`) its handlers
        /// insert into the `effects` table.
        #[derive(Clone, Debug)]
        struct Job {
            key: String,
            id: i64,
            amount: i64,
            effects: String,
        }

        /// What `apply` does after its effect statement.
        #[derive(Debug)]
        enum Then {
            Commit,
            Fail,
            Panic,
            /// Prints `IN_BODY` and waits forever (until the process is killed).
            Hang,
        }

        async fn insert_effect(
            tx: &mut Transaction<'_, Db>,
            job: &Job,
            origin: &str,
        ) -> Result<(), ::sqlx::Error> {
            ::sqlx::query(q(&format!(
                "INSERT INTO {} (id, amount, origin) VALUES ($1, $2, $3)",
                job.effects
            )))
            .bind(job.id)
            .bind(job.amount)
            .bind(origin)
            .execute(&mut **tx)
            .await?;
            Ok(())
        }

        #[::idem::idempotent(key = "job.key")]
        async fn apply(
            tx: &mut Transaction<'_, Db>,
            job: &Job,
            then: Then,
        ) -> Result<i64, TestError> {
            insert_effect(tx, job, "apply").await?;
            match then {
                Then::Commit => Ok(job.amount),
                Then::Fail => Err(TestError::Refused),
                Then::Panic => panic!("handler panics on purpose (conformance test)"),
                Then::Hang => {
                    {
                        use ::std::io::Write as _;
                        let mut out = ::std::io::stdout().lock();
                        writeln!(out, "IN_BODY").expect("stdout");
                        out.flush().expect("stdout");
                    }
                    let never: ::std::convert::Infallible = ::std::future::pending().await;
                    match never {}
                }
            }
        }

        /// Fails (after its effect statement) while `failures` is above zero, counting it down.
        #[::idem::idempotent(key = "job.key", scope = "apply")]
        async fn apply_unless_told_to_fail(
            tx: &mut Transaction<'_, Db>,
            job: &Job,
            failures: &::std::sync::atomic::AtomicUsize,
        ) -> Result<i64, TestError> {
            use ::std::sync::atomic::Ordering::SeqCst;
            insert_effect(tx, job, "apply").await?;
            if failures.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok() {
                return Err(TestError::Refused);
            }
            Ok(job.amount)
        }

        /// Same key, another scope.
        #[::idem::idempotent(key = "job.key", scope = "conformance.elsewhere")]
        async fn apply_elsewhere(
            tx: &mut Transaction<'_, Db>,
            job: &Job,
        ) -> Result<i64, TestError> {
            insert_effect(tx, job, "elsewhere").await?;
            Ok(job.amount)
        }

        /// The effect, then a second statement into `table` that may violate a constraint.
        #[::idem::idempotent(key = "job.key", scope = "apply")]
        async fn apply_and_insert(
            tx: &mut Transaction<'_, Db>,
            job: &Job,
            table: &str,
            value: i64,
        ) -> Result<i64, TestError> {
            insert_effect(tx, job, "apply").await?;
            ::sqlx::query(q(&format!("INSERT INTO {table} (v) VALUES ($1)")))
                .bind(value)
                .execute(&mut **tx)
                .await?;
            Ok(job.amount)
        }

        /// Every shape of handler the attribute must keep `Send` (each run under `tokio::spawn`).
        #[allow(unreachable_pub, reason = "the suite checks that `pub` handlers expand")]
        mod shapes {
            use super::{Db, Job, TestError, insert_effect};
            use ::sqlx::Transaction;

            pub(crate) trait HasId {
                fn id(&self) -> &str;
                fn job(&self) -> &Job;
            }

            impl HasId for Job {
                fn id(&self) -> &str {
                    &self.key
                }
                fn job(&self) -> &Job {
                    self
                }
            }

            /// A `pub` free function.
            #[::idem::idempotent(key = "job.key")]
            pub async fn free(tx: &mut Transaction<'_, Db>, job: &Job) -> Result<i64, TestError> {
                insert_effect(tx, job, "free").await?;
                Ok(job.amount)
            }

            pub(crate) struct Service {
                pub(crate) origin: &'static str,
            }

            impl Service {
                /// A `pub(crate)` method on `&self`, spelling the transaction `idem::Tx`.
                #[::idem::idempotent(key = "job.key", scope = "shapes.method")]
                pub(crate) async fn method(
                    &self,
                    tx: &mut ::idem::Tx<'_, Db>,
                    job: &Job,
                ) -> Result<i64, TestError> {
                    insert_effect(tx, job, self.origin).await?;
                    Ok(job.amount)
                }
            }

            /// A generic function over the job type (so it names its scope).
            #[::idem::idempotent(key = "job.id()", scope = "shapes.generic")]
            pub(crate) async fn generic<J: HasId + Sync>(
                tx: &mut Transaction<'_, Db>,
                job: &J,
            ) -> Result<i64, TestError> {
                insert_effect(tx, job.job(), "generic").await?;
                Ok(job.job().amount)
            }

            /// A private function taking its job by value, with the transaction last.
            #[::idem::idempotent(key = "job.key")]
            async fn owned(job: Job, tx: &mut Transaction<'_, Db>) -> Result<i64, TestError> {
                insert_effect(tx, &job, "owned").await?;
                Ok(job.amount)
            }

            pub(crate) fn owned_call(
                store: ::idem::Store<Db>,
                job: Job,
            ) -> impl ::std::future::Future<Output = Result<::idem::Outcome<i64>, TestError>>
            + Send
            + 'static {
                async move { owned(job, &store).await }
            }
        }

        /// A connected pool, a migrated marker table and an effects table, all new.
        struct Ctx {
            url: String,
            pool: Pool<Db>,
            store: Store<Db>,
            effects: String,
            tag: String,
            tables: Vec<String>,
        }

        impl Ctx {
            async fn new(tag: &str, connections: u32) -> Ctx {
                let url = <S as cf::Support>::url();
                let pool = <S as cf::Support>::connect(&url, connections).await;
                let markers = cf::unique_name("m", tag);
                let store = Store::new(pool.clone())
                    .with_table(&markers)
                    .expect("generated table names are identifiers");
                store.migrate().await.expect("migrate the marker table");
                let mut ctx = Ctx {
                    url,
                    pool,
                    store,
                    effects: String::new(),
                    tag: tag.to_owned(),
                    tables: vec![markers],
                };
                ctx.effects = ctx
                    .create_table(
                        "e",
                        "(id BIGINT NOT NULL, amount BIGINT NOT NULL, origin VARCHAR(32) NOT NULL)",
                    )
                    .await;
                ctx
            }

            /// `CREATE TABLE <new name> <columns>`; the name is returned.
            async fn create_table(&mut self, kind: &str, columns: &str) -> String {
                let name = cf::unique_name(kind, &self.tag);
                self.exec(&format!("CREATE TABLE {name} {columns}")).await;
                self.tables.push(name.clone());
                name
            }

            fn job(&self, key: &str, id: i64, amount: i64) -> Job {
                Job {
                    key: key.to_owned(),
                    id,
                    amount,
                    effects: self.effects.clone(),
                }
            }

            async fn exec(&self, sql: &str) {
                ::sqlx::query(q(sql))
                    .execute(&self.pool)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
            }

            async fn scalar(&self, sql: &str) -> i64 {
                ::sqlx::query_scalar::<_, i64>(q(sql))
                    .fetch_one(&self.pool)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"))
            }

            /// Rows in the marker table.
            async fn markers(&self) -> i64 {
                self.scalar(&format!("SELECT COUNT(*) FROM {}", self.store.table()))
                    .await
            }

            /// Effect rows of job `id` (from any handler).
            async fn effects(&self, id: i64) -> i64 {
                self.scalar(&format!("SELECT COUNT(*) FROM {} WHERE id = {id}", self.effects))
                    .await
            }

            /// Effect rows of job `id` written by the handler `origin`.
            async fn effects_from(&self, id: i64, origin: &str) -> i64 {
                self.scalar(&format!(
                    "SELECT COUNT(*) FROM {} WHERE id = {id} AND origin = '{origin}'",
                    self.effects
                ))
                .await
            }

            async fn effects_total(&self) -> i64 {
                self.scalar(&format!("SELECT COUNT(*) FROM {}", self.effects))
                    .await
            }

            /// The keys stored in the marker table, sorted.
            async fn stored_keys(&self) -> Vec<String> {
                let sql = format!(
                    "SELECT {} FROM {}",
                    <S as cf::Support>::KEY_TEXT,
                    self.store.table()
                );
                let mut keys: Vec<String> = ::sqlx::query_scalar(q(&sql))
                    .fetch_all(&self.pool)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
                keys.sort();
                keys
            }

            /// Drops the test's tables (a failing test keeps them for inspection).
            async fn cleanup(self) {
                for t in &self.tables {
                    self.exec(&format!("DROP TABLE {t}")).await;
                }
                self.pool.close().await;
                <S as cf::Support>::remove(&self.url);
            }
        }

        fn applied(result: Result<Outcome<i64>, TestError>) -> i64 {
            match result {
                Ok(Outcome::Applied(v)) => v,
                other => panic!("expected Applied, got {other:?}"),
            }
        }

        fn duplicate(result: Result<Outcome<i64>, TestError>) {
            match result {
                Ok(Outcome::Duplicate) => {}
                other => panic!("expected Duplicate, got {other:?}"),
            }
        }

        // 1
        #[tokio::test(flavor = "multi_thread")]
        async fn first_delivery_applies_second_is_duplicate() {
            let ctx = Ctx::new("dup", 2).await;
            let job = ctx.job("job-1", 1, 10);
            assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 10);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert_eq!(ctx.effects(1).await, 1);
            assert_eq!(ctx.effects_total().await, 1);
            assert_eq!(ctx.markers().await, 1);
            ctx.cleanup().await;
        }

        // 2
        #[tokio::test(flavor = "multi_thread")]
        async fn handler_error_keeps_nothing_and_next_delivery_applies() {
            let ctx = Ctx::new("err", 2).await;
            let job = ctx.job("job-err", 2, 20);
            match apply(&ctx.store, &job, Then::Fail).await {
                Err(TestError::Refused) => {}
                other => panic!("expected the handler's own error, got {other:?}"),
            }
            assert_eq!(ctx.markers().await, 0, "a failed handler left a marker");
            assert_eq!(ctx.effects_total().await, 0, "a failed handler left its effect");
            assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 20);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert_eq!(ctx.effects(2).await, 1);
            assert_eq!(ctx.markers().await, 1);
            ctx.cleanup().await;
        }

        // 3
        #[tokio::test(flavor = "multi_thread")]
        async fn handler_panic_rolls_back_and_next_delivery_applies() {
            let ctx = Ctx::new("panic", 2).await;
            let job = ctx.job("job-panic", 3, 30);
            let (store, j) = (ctx.store.clone(), job.clone());
            let joined = tokio::spawn(async move { apply(&store, &j, Then::Panic).await }).await;
            match joined {
                Err(e) if e.is_panic() => {}
                other => panic!("expected the task to panic, got {other:?}"),
            }
            assert_eq!(ctx.markers().await, 0, "a panicking handler left a marker");
            assert_eq!(ctx.effects_total().await, 0, "a panicking handler left its effect");
            let next = apply(&ctx.store, &job, Then::Commit);
            let next = cf::within(60, "delivery after a panic", next).await;
            assert_eq!(applied(next), 30);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert_eq!(ctx.effects(3).await, 1);
            assert_eq!(ctx.markers().await, 1);
            ctx.cleanup().await;
        }

        // 4
        #[tokio::test(flavor = "multi_thread")]
        async fn concurrent_deliveries_of_one_key_apply_once() {
            const DELIVERIES: usize = 64;
            let ctx = Ctx::new("race", 8).await;
            let job = ctx.job("job-race", 4, 40);
            let barrier = Arc::new(tokio::sync::Barrier::new(DELIVERIES));
            let tasks: Vec<_> = (0..DELIVERIES)
                .map(|_| {
                    let (store, job, barrier) = (ctx.store.clone(), job.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        apply(&store, &job, Then::Commit).await
                    })
                })
                .collect();
            let (mut applied_n, mut duplicate_n) = (0, 0);
            for t in tasks {
                match cf::within(120, "a concurrent delivery", t).await.expect("no panic") {
                    Ok(Outcome::Applied(v)) => {
                        assert_eq!(v, 40);
                        applied_n += 1;
                    }
                    Ok(Outcome::Duplicate) => duplicate_n += 1,
                    Err(e) => panic!("a concurrent delivery failed: {e:?}"),
                }
            }
            assert_eq!((applied_n, duplicate_n), (1, DELIVERIES - 1));
            assert_eq!(ctx.effects(4).await, 1);
            assert_eq!(ctx.effects_total().await, 1);
            assert_eq!(ctx.markers().await, 1);
            ctx.cleanup().await;
        }

        // 4, with holders that roll back while the others wait on the key (on InnoDB the
        // waiters can then deadlock with each other: a race to retry, never a failure).
        #[tokio::test(flavor = "multi_thread")]
        async fn concurrent_deliveries_after_failed_holders_apply_once() {
            const DELIVERIES: usize = 64;
            const FAILURES: usize = 8;
            let ctx = Ctx::new("rollbackrace", 8).await;
            let job = ctx.job("job-rollback-race", 41, 410);
            let failures = Arc::new(::std::sync::atomic::AtomicUsize::new(FAILURES));
            let barrier = Arc::new(tokio::sync::Barrier::new(DELIVERIES));
            let tasks: Vec<_> = (0..DELIVERIES)
                .map(|_| {
                    let (store, job, barrier, failures) =
                        (ctx.store.clone(), job.clone(), barrier.clone(), failures.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        apply_unless_told_to_fail(&store, &job, &failures).await
                    })
                })
                .collect();
            let (mut applied_n, mut duplicate_n, mut refused_n) = (0, 0, 0);
            for t in tasks {
                match cf::within(120, "a concurrent delivery", t).await.expect("no panic") {
                    Ok(Outcome::Applied(v)) => {
                        assert_eq!(v, 410);
                        applied_n += 1;
                    }
                    Ok(Outcome::Duplicate) => duplicate_n += 1,
                    Err(TestError::Refused) => refused_n += 1,
                    Err(e) => panic!("a concurrent delivery failed: {e:?}"),
                }
            }
            assert_eq!(
                (applied_n, refused_n, duplicate_n),
                (1, FAILURES, DELIVERIES - FAILURES - 1),
                "(applied, failed bodies, duplicates)"
            );
            assert_eq!(ctx.effects(41).await, 1);
            assert_eq!(ctx.effects_total().await, 1);
            assert_eq!(ctx.markers().await, 1);
            ctx.cleanup().await;
        }

        // 5
        #[tokio::test(flavor = "multi_thread")]
        async fn same_key_in_two_scopes_runs_once_in_each() {
            let ctx = Ctx::new("scopes", 2).await;
            let job = ctx.job("job-42", 42, 5);
            assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 5);
            assert_eq!(applied(apply_elsewhere(&ctx.store, &job).await), 5);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            duplicate(apply_elsewhere(&ctx.store, &job).await);
            assert_eq!(ctx.effects_from(42, "apply").await, 1);
            assert_eq!(ctx.effects_from(42, "elsewhere").await, 1);
            assert_eq!(ctx.effects_total().await, 2);
            assert_eq!(ctx.markers().await, 2);
            ctx.cleanup().await;
        }

        // 6
        #[tokio::test(flavor = "multi_thread")]
        async fn invalid_keys_are_refused_and_write_nothing() {
            let ctx = Ctx::new("badkey", 2).await;
            let cases = [
                (String::new(), ::idem::KeyError::Empty),
                ("k".repeat(256), ::idem::KeyError::TooLong { len: 256 }),
                ("a\0b".to_owned(), ::idem::KeyError::Nul),
            ];
            for (key, want) in cases {
                let job = ctx.job(&key, 6, 60);
                match apply(&ctx.store, &job, Then::Commit).await {
                    Err(TestError::Idem(::idem::Error::InvalidKey(got))) => {
                        assert_eq!(got, want, "key {key:?}")
                    }
                    other => panic!("key {key:?}: expected InvalidKey, got {other:?}"),
                }
            }
            assert_eq!(ctx.markers().await, 0);
            assert_eq!(ctx.effects_total().await, 0);
            ctx.cleanup().await;
        }

        /// The jobs of the multi-process test: `job-<i>` with effect row `(i, amount)`.
        fn many_jobs(n: i64, effects: &str) -> Vec<Job> {
            (0..n)
                .map(|i| Job {
                    key: format!("job-{i}"),
                    id: i,
                    amount: 1 + (i * 7919) % 1000,
                    effects: effects.to_owned(),
                })
                .collect()
        }

        // 7
        #[tokio::test(flavor = "multi_thread")]
        async fn four_processes_apply_every_job_exactly_once() {
            const PROCESSES: u64 = 4;
            const JOBS: i64 = 2000;
            let ctx = Ctx::new("procs", 2).await;
            let seed = cf::seed();
            println!("seed {seed} (IDEM_CONFORMANCE_SEED={seed} repeats this order)");
            let mut workers: Vec<cf::Worker> = (0..PROCESSES)
                .map(|p| {
                    cf::Worker::spawn(
                        &format!("{p}"),
                        &[
                            (cf::CHILD_MODE, "work".to_owned()),
                            (cf::CHILD_URL, ctx.url.clone()),
                            (cf::CHILD_MARKERS, ctx.store.table().to_owned()),
                            (cf::CHILD_EFFECTS, ctx.effects.clone()),
                            (cf::CHILD_SEED, seed.wrapping_add(p).to_string()),
                            (cf::CHILD_JOBS, JOBS.to_string()),
                            (cf::CHILD_TASKS, "2".to_owned()),
                        ],
                    )
                })
                .collect();
            // Every worker is connected and has its order before any starts.
            for w in &mut workers {
                w.expect_line("READY").await;
            }
            for w in &mut workers {
                w.send("GO").await;
            }
            let (mut applied_n, mut duplicate_n) = (0_i64, 0_i64);
            for mut w in workers {
                let line = w.expect_line("DONE").await;
                let counts: Vec<i64> = line
                    .split_whitespace()
                    .filter_map(|kv| kv.split_once('=').map(|(_, v)| v.parse().expect("count")))
                    .collect();
                let [a, d] = counts[..] else { panic!("bad line {line:?}") };
                applied_n += a;
                duplicate_n += d;
                w.succeed().await;
            }
            let jobs = many_jobs(JOBS, &ctx.effects);
            let want_sum: i64 = jobs.iter().map(|j| j.amount).sum();
            assert_eq!(applied_n, JOBS, "seed {seed}: Applied outcomes over all workers");
            assert_eq!(duplicate_n, JOBS * (PROCESSES as i64 - 1), "seed {seed}: Duplicates");
            assert_eq!(ctx.effects_total().await, JOBS, "seed {seed}: effect rows");
            let big = <S as cf::Support>::BIGINT;
            let sum = ctx
                .scalar(&format!("SELECT CAST(SUM(amount) AS {big}) FROM {}", ctx.effects))
                .await;
            assert_eq!(sum, want_sum, "seed {seed}: SUM(amount)");
            let off = ctx
                .scalar(&format!(
                    "SELECT COUNT(*) FROM (SELECT id FROM {} GROUP BY id HAVING COUNT(*) <> 1) x",
                    ctx.effects
                ))
                .await;
            assert_eq!(off, 0, "seed {seed}: jobs whose effect did not happen exactly once");
            let distinct = ctx
                .scalar(&format!("SELECT COUNT(DISTINCT id) FROM {}", ctx.effects))
                .await;
            assert_eq!(distinct, JOBS, "seed {seed}: jobs with an effect");
            assert_eq!(ctx.markers().await, JOBS, "seed {seed}: markers");
            ctx.cleanup().await;
        }

        /// Effect row (`id`, `amount`) of the job the worker of test 8 hangs in.
        const KILLED_JOB: (i64, i64) = (8, 80);

        // 8
        #[tokio::test(flavor = "multi_thread")]
        async fn worker_killed_inside_the_body_keeps_nothing() {
            let ctx = Ctx::new("sigkill", 2).await;
            let (id, amount) = KILLED_JOB;
            let job = ctx.job("job-killed", id, amount);
            let mut w = cf::Worker::spawn(
                "hang",
                &[
                    (cf::CHILD_MODE, "hang".to_owned()),
                    (cf::CHILD_URL, ctx.url.clone()),
                    (cf::CHILD_MARKERS, ctx.store.table().to_owned()),
                    (cf::CHILD_EFFECTS, ctx.effects.clone()),
                    (cf::CHILD_KEY, job.key.clone()),
                ],
            );
            w.expect_line("IN_BODY").await;
            let status = w.kill().await;
            {
                use ::std::os::unix::process::ExitStatusExt as _;
                assert_eq!(status.signal(), Some(9), "worker status {status:?}");
            }
            assert_eq!(ctx.markers().await, 0, "a killed worker's marker survived");
            assert_eq!(ctx.effects_total().await, 0, "a killed worker's effect survived");
            let next = apply(&ctx.store, &job, Then::Commit);
            let next = cf::within(120, "delivery after a killed worker", next).await;
            assert_eq!(applied(next), amount);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert_eq!(ctx.effects(id).await, 1);
            assert_eq!(ctx.markers().await, 1);
            ctx.cleanup().await;
        }

        /// The worker process of tests 7 and 8 (this binary, started again by them).
        #[tokio::test(flavor = "multi_thread")]
        #[ignore = "a worker process: started by four_processes_apply_every_job_exactly_once \
                    and worker_killed_inside_the_body_keeps_nothing, with its orders in \
                    IDEM_CONFORMANCE_* variables"]
        async fn child_process() {
            let Ok(mode) = ::std::env::var(cf::CHILD_MODE) else {
                panic!(
                    "child_process is a worker process that the tests start with their orders \
                     in {} and related variables; it refuses to run on its own",
                    cf::CHILD_MODE
                )
            };
            let url = cf::child_env(cf::CHILD_URL);
            let markers = cf::child_env(cf::CHILD_MARKERS);
            let effects = cf::child_env(cf::CHILD_EFFECTS);
            match mode.as_str() {
                "work" => {
                    let seed: u64 = cf::child_env(cf::CHILD_SEED).parse().expect("seed");
                    let n: i64 = cf::child_env(cf::CHILD_JOBS).parse().expect("jobs");
                    let tasks: u32 = cf::child_env(cf::CHILD_TASKS).parse().expect("tasks");
                    let pool = <S as cf::Support>::connect(&url, tasks).await;
                    let store = Store::new(pool).with_table(&markers).expect("table name");
                    let mut jobs = many_jobs(n, &effects);
                    cf::SplitMix::new(seed).shuffle(&mut jobs);
                    jobs.reverse(); // popped from the end
                    let queue = Arc::new(::std::sync::Mutex::new(jobs));
                    println!("READY");
                    let go = tokio::task::spawn_blocking(|| {
                        let mut line = String::new();
                        ::std::io::stdin().read_line(&mut line).map(|_| line)
                    })
                    .await
                    .expect("read stdin")
                    .expect("read stdin");
                    assert_eq!(go.trim(), "GO", "unexpected order {go:?}");
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
                                        Ok(Outcome::Duplicate) => d += 1,
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
                    let pool = <S as cf::Support>::connect(&url, 1).await;
                    let store = Store::new(pool).with_table(&markers).expect("table name");
                    let (id, amount) = KILLED_JOB;
                    let job = Job {
                        key: cf::child_env(cf::CHILD_KEY),
                        id,
                        amount,
                        effects,
                    };
                    let r = apply(&store, &job, Then::Hang).await;
                    panic!("the handler returned {r:?}; it should have hung in its body");
                }
                other => panic!("unknown {} {other:?}", cf::CHILD_MODE),
            }
        }

        // 10
        #[tokio::test(flavor = "multi_thread")]
        async fn every_handler_shape_runs_under_tokio_spawn() {
            let ctx = Ctx::new("shapes", 2).await;
            let job = ctx.job("job-shape", 10, 100);
            let service = Arc::new(shapes::Service { origin: "method" });
            for round in 0..2 {
                let spawned = [
                    tokio::spawn({
                        let (store, job) = (ctx.store.clone(), job.clone());
                        async move { shapes::free(&store, &job).await }
                    }),
                    tokio::spawn({
                        let (store, job) = (ctx.store.clone(), job.clone());
                        let service = service.clone();
                        async move { service.method(&store, &job).await }
                    }),
                    tokio::spawn({
                        let (store, job) = (ctx.store.clone(), job.clone());
                        async move { shapes::generic(&store, &job).await }
                    }),
                    tokio::spawn(shapes::owned_call(ctx.store.clone(), job.clone())),
                ];
                for (i, task) in spawned.into_iter().enumerate() {
                    let result = task.await.expect("no panic");
                    if round == 0 {
                        assert_eq!(applied(result), 100, "shape {i}");
                    } else {
                        duplicate(result);
                    }
                }
            }
            for origin in ["free", "method", "generic", "owned"] {
                assert_eq!(ctx.effects_from(10, origin).await, 1, "shape {origin}");
            }
            assert_eq!(ctx.effects_total().await, 4);
            assert_eq!(ctx.markers().await, 4);
            ctx.cleanup().await;
        }

        /// 11: a constraint violated by the effect's second statement.
        async fn failing_statement_releases_the_claim(
            tag: &str,
            columns: &str,
            seed_row: Option<i64>,
            bad: i64,
            want: ::sqlx::error::ErrorKind,
        ) {
            let mut ctx = Ctx::new(tag, 2).await;
            let table = ctx.create_table("c", columns).await;
            let rows = format!("SELECT COUNT(*) FROM {table}");
            if let Some(v) = seed_row {
                ctx.exec(&format!("INSERT INTO {table} (v) VALUES ({v})")).await;
            }
            let before = ctx.scalar(&rows).await;
            let job = ctx.job("job-constraint", 11, 110);
            match apply_and_insert(&ctx.store, &job, &table, bad).await {
                Err(TestError::Db(e)) => {
                    let kind = e.as_database_error().map(|d| d.kind());
                    assert_eq!(kind, Some(want), "{e}");
                }
                other => panic!("expected a constraint violation, got {other:?}"),
            }
            assert_eq!(ctx.markers().await, 0, "the claim survived a failed statement");
            assert_eq!(ctx.effects_total().await, 0, "the effect survived a failed statement");
            assert_eq!(ctx.scalar(&rows).await, before);
            assert_eq!(applied(apply_and_insert(&ctx.store, &job, &table, 5).await), 110);
            duplicate(apply_and_insert(&ctx.store, &job, &table, 6).await);
            assert_eq!(ctx.effects(11).await, 1);
            assert_eq!(ctx.markers().await, 1);
            assert_eq!(ctx.scalar(&rows).await, before + 1);
            ctx.cleanup().await;
        }

        // 11
        #[tokio::test(flavor = "multi_thread")]
        async fn failing_effect_statement_unique_violation_releases_the_claim() {
            failing_statement_releases_the_claim(
                "unique",
                "(v BIGINT NOT NULL UNIQUE)",
                Some(1),
                1,
                ::sqlx::error::ErrorKind::UniqueViolation,
            )
            .await;
        }

        // 11
        #[tokio::test(flavor = "multi_thread")]
        async fn failing_effect_statement_check_violation_releases_the_claim() {
            failing_statement_releases_the_claim(
                "check",
                "(v BIGINT NOT NULL CHECK (v >= 0))",
                None,
                -1,
                ::sqlx::error::ErrorKind::CheckViolation,
            )
            .await;
        }

        // 12
        #[tokio::test(flavor = "multi_thread")]
        async fn longest_multibyte_key_round_trips() {
            let ctx = Ctx::new("euro", 2).await;
            let key = "€".repeat(85);
            assert_eq!(key.len(), ::idem::MAX_KEY_LEN);
            let job = ctx.job(&key, 12, 120);
            assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 120);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert_eq!(ctx.stored_keys().await, vec![key.clone()]);
            assert_eq!(ctx.effects(12).await, 1);
            let longer = ctx.job(&format!("{key}x"), 13, 130);
            match apply(&ctx.store, &longer, Then::Commit).await {
                Err(TestError::Idem(::idem::Error::InvalidKey(::idem::KeyError::TooLong {
                    len: 256,
                }))) => {}
                other => panic!("expected a 256-byte key to be refused, got {other:?}"),
            }
            assert_eq!(ctx.markers().await, 1);
            assert_eq!(ctx.effects_total().await, 1);
            ctx.cleanup().await;
        }

        // 13
        #[tokio::test(flavor = "multi_thread")]
        async fn keys_differing_in_case_or_trailing_space_are_distinct() {
            let ctx = Ctx::new("case", 2).await;
            let keys = ["Job-A", "job-a", "x", "x "];
            for (id, key) in (1..).zip(keys) {
                match apply(&ctx.store, &ctx.job(key, id, id * 10), Then::Commit).await {
                    Ok(Outcome::Applied(v)) => assert_eq!(v, id * 10),
                    other => panic!(
                        "key {key:?} (after {:?}): expected Applied, got {other:?}",
                        &keys[..id as usize - 1]
                    ),
                }
            }
            for (id, key) in (1..).zip(keys) {
                duplicate(apply(&ctx.store, &ctx.job(key, id, id * 10), Then::Commit).await);
            }
            let mut want: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
            want.sort();
            assert_eq!(ctx.stored_keys().await, want);
            for id in 1..=4 {
                assert_eq!(ctx.effects(id).await, 1, "job {id}");
            }
            ctx.cleanup().await;
        }

        // 14
        #[tokio::test(flavor = "multi_thread")]
        async fn concurrent_migrations_of_a_fresh_table_succeed() {
            const TASKS: usize = 8;
            let mut ctx = Ctx::new("migrate", TASKS as u32).await;
            let fresh = cf::unique_name("m", "fresh");
            let store = Store::new(ctx.pool.clone())
                .with_table(&fresh)
                .expect("identifier");
            let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
            let tasks: Vec<_> = (0..TASKS)
                .map(|_| {
                    let (store, barrier) = (store.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.migrate().await
                    })
                })
                .collect();
            for t in tasks {
                cf::within(120, "a migration", t)
                    .await
                    .expect("no panic")
                    .expect("concurrent migrate");
            }
            ctx.tables.push(fresh.clone());
            store.migrate().await.expect("migrate again");
            let job = ctx.job("job-migrated", 14, 140);
            assert_eq!(applied(apply(&store, &job, Then::Commit).await), 140);
            duplicate(apply(&store, &job, Then::Commit).await);
            assert_eq!(ctx.scalar(&format!("SELECT COUNT(*) FROM {fresh}")).await, 1);
            assert_eq!(ctx.effects(14).await, 1);
            ctx.cleanup().await;
        }

        // 14
        #[tokio::test(flavor = "multi_thread")]
        async fn table_names_that_are_not_identifiers_are_refused() {
            let ctx = Ctx::new("badtable", 1).await;
            for bad in ["bad; name", "x\"; DROP TABLE y; --", "", "a.b"] {
                match Store::new(ctx.pool.clone()).with_table(bad) {
                    Err(::idem::Error::InvalidTable { name }) => assert_eq!(name, bad),
                    Err(e) => panic!("{bad:?}: expected InvalidTable, got {e:?}"),
                    Ok(_) => panic!("{bad:?} was accepted as a table name"),
                }
            }
            ctx.cleanup().await;
        }

        // 14: the longest name `with_table` accepts works end to end.
        #[tokio::test(flavor = "multi_thread")]
        async fn longest_table_name_works() {
            let mut ctx = Ctx::new("longtable", 2).await;
            let base = cf::unique_name("m", "long");
            let name = format!("{base}{}", "x".repeat(::idem::MAX_TABLE_LEN - base.len()));
            let store = Store::new(ctx.pool.clone())
                .with_table(&name)
                .expect("MAX_TABLE_LEN characters is allowed");
            store
                .migrate()
                .await
                .unwrap_or_else(|e| panic!("migrate {name}: {e}"));
            ctx.tables.push(name.clone());
            let job = ctx.job("job-long-table", 16, 160);
            assert_eq!(applied(apply(&store, &job, Then::Commit).await), 160);
            duplicate(apply(&store, &job, Then::Commit).await);
            assert_eq!(ctx.scalar(&format!("SELECT COUNT(*) FROM {name}")).await, 1);
            assert_eq!(ctx.effects(16).await, 1);
            ctx.cleanup().await;
        }

        // 15
        #[tokio::test(flavor = "multi_thread")]
        async fn forget_lets_a_job_run_again() {
            let ctx = Ctx::new("forget", 2).await;
            let job = ctx.job("job-forget", 15, 150);
            assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 150);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert!(!ctx.store.forget("conformance.elsewhere", &job.key).await.expect("forget"));
            assert!(ctx.store.forget("apply", &job.key).await.expect("forget"));
            assert_eq!(ctx.markers().await, 0);
            assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 150);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert_eq!(ctx.effects(15).await, 2);
            assert_eq!(ctx.markers().await, 1);
            assert!(!ctx.store.forget("apply", "job-unknown").await.expect("forget"));
            assert_eq!(ctx.markers().await, 1);
            ctx.cleanup().await;
        }

        // Retention: purge deletes old completed markers, in batches, and nothing younger.
        #[tokio::test(flavor = "multi_thread")]
        async fn purge_deletes_only_markers_older_than_the_retention() {
            let ctx = Ctx::new("purge", 2).await;
            let old = ::idem::PURGE_BATCH + 7;
            for n in 0..old + 3 {
                let key = ::idem::Key::new(&n).expect("integer keys are valid");
                match ctx.store.claim("aged", &key).await.expect("claim") {
                    ::idem::Claim::Fresh(guard) => {
                        let done = guard.finish(Ok::<(), ::idem::Error>(())).await;
                        assert_eq!(done.expect("commit"), Outcome::Applied(()));
                    }
                    ::idem::Claim::Duplicate => panic!("key {n} was claimed twice"),
                }
            }
            let table = ctx.store.table().to_owned();
            ctx.exec(&format!(
                "UPDATE {table} SET completed_at = {} WHERE scope = 'aged' AND {} NOT IN ('{}', '{}', '{}')",
                <S as cf::Support>::TWO_HOURS_AGO,
                <S as cf::Support>::KEY_TEXT,
                old,
                old + 1,
                old + 2,
            ))
            .await;
            let purged = ctx.store.purge(Duration::from_secs(3600)).await.expect("purge");
            assert_eq!(purged, u64::try_from(old).unwrap());
            assert_eq!(ctx.markers().await, 3);
            // The young markers still stop their jobs.
            let young = ::idem::Key::new(&old).unwrap();
            assert!(matches!(
                ctx.store.claim("aged", &young).await.expect("claim"),
                ::idem::Claim::Duplicate
            ));
            assert_eq!(ctx.store.purge(Duration::from_secs(3600)).await.expect("purge"), 0);
            ctx.cleanup().await;
        }
    };

    (@server $support:ty) => {
        /// Reads its own connection id, has another pool kill that connection, returns `Ok`.
        #[::idem::idempotent(key = "job.key", scope = "apply")]
        async fn apply_then_kill_own_connection(
            tx: &mut Transaction<'_, Db>,
            job: &Job,
            killer: &Pool<Db>,
        ) -> Result<i64, TestError> {
            insert_effect(tx, job, "apply").await?;
            let id = <S as cf::Server>::connection_id(&mut **tx).await;
            <S as cf::Server>::kill(killer, id).await;
            Ok(job.amount)
        }

        // 9
        #[tokio::test(flavor = "multi_thread")]
        async fn connection_killed_before_commit_keeps_nothing() {
            let ctx = Ctx::new("killconn", 2).await;
            let killer = <S as cf::Support>::connect(&ctx.url, 1).await;
            let job = ctx.job("job-killconn", 9, 90);
            match apply_then_kill_own_connection(&ctx.store, &job, &killer).await {
                Err(TestError::Idem(::idem::Error::Database(_))) => {}
                other => panic!("expected the commit to fail, got {other:?}"),
            }
            assert_eq!(ctx.markers().await, 0, "a marker survived a killed connection");
            assert_eq!(ctx.effects_total().await, 0, "an effect survived a killed connection");
            let next = apply(&ctx.store, &job, Then::Commit);
            let next = cf::within(120, "delivery after a killed connection", next).await;
            assert_eq!(applied(next), 90);
            duplicate(apply(&ctx.store, &job, Then::Commit).await);
            assert_eq!(ctx.effects(9).await, 1);
            assert_eq!(ctx.markers().await, 1);
            killer.close().await;
            ctx.cleanup().await;
        }

        #[tokio::test(flavor = "multi_thread")]
        async fn unreachable_server_fails_the_test_naming_url_and_variable() {
            let url = <S as cf::Server>::UNREACHABLE_URL;
            let joined = tokio::spawn(async move {
                drop(<S as cf::Support>::connect(url, 1).await);
            })
            .await;
            let Err(e) = joined else { panic!("connecting to {url} succeeded") };
            let payload = e.into_panic();
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            assert!(msg.contains(url), "{msg}");
            assert!(msg.contains(<S as cf::Server>::URL_VAR), "{msg}");
        }
    };

    ($support:ty) => {
        $crate::conformance::suite!(@common $support);
    };

    ($support:ty, server) => {
        $crate::conformance::suite!(@common $support);
        $crate::conformance::suite!(@server $support);
    };
}

pub(crate) use suite;
