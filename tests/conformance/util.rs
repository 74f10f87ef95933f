//! Small helpers every case uses: unique names, the seeded shuffle, the hang guard.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The URL of a server: `var` if set, else `default`.
pub(crate) fn server_url(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// The failure of a test whose server cannot be reached. Never a skip.
pub(crate) fn unreachable(name: &str, url: &str, var: &str, err: &dyn std::fmt::Display) -> ! {
    panic!(
        "cannot connect to {name} at {url}: {err}. Start the server, or set {var} to the URL \
         of one (the conformance suite never skips a backend)"
    )
}

/// `$1, $2, ...` (in order, each once) rewritten to `?`, for MySQL.
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

/// Polls `probe` until it returns true, yielding to the runtime between probes (each probe is
/// a database round trip, so this is not a busy loop). Bounded by [`within`]: the condition is
/// what the test waits for, never the time.
pub(crate) async fn until<F, Fut>(secs: u64, what: &str, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    within(secs, what, async {
        while !probe().await {
            tokio::task::yield_now().await;
        }
    })
    .await
}

/// The SQLSTATE (PostgreSQL, SQLite's result code) or MySQL error number of `err`, as text.
pub(crate) fn db_code(err: &sqlx::Error) -> Option<String> {
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
}

/// The backend's short name (`postgres`, `mysql`, `sqlite`), for SQL that differs per database.
pub(crate) fn backend<DB: sqlx::Database>() -> &'static str {
    match DB::NAME {
        "PostgreSQL" => "postgres",
        "MySQL" => "mysql",
        "SQLite" => "sqlite",
        other => panic!("no conformance support for {other}"),
    }
}
