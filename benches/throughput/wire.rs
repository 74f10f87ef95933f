//! What each variant sends to PostgreSQL per job, counted on the wire: a deterministic check
//! that a loaded machine cannot turn red, unlike a timing floor.
//!
//! The jobs run one at a time through a loopback proxy that parses the frontend protocol and
//! counts its messages by type. Per job is the difference between two snapshots divided by the
//! number of jobs in between, rounded: the only jobs whose messages can straddle a snapshot are
//! the one or two connections being released in the background (sqlx pings a connection as it
//! goes back to the pool), far less than half a message per job over [`JOBS`] jobs.
//!
//! Every `Query` and every `Sync` is answered by one `ReadyForQuery`: their sum is the number
//! of answers the client waits for. A `Query` that sqlx queued when a transaction was dropped
//! (its `ROLLBACK`) goes out in the same write as the release ping's `Sync`, so it adds an
//! answer but not a round trip; the report says which variant has one.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::postgres::PgPoolOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::config::config;
use crate::measure::pool_mode;
use crate::variants::{Keys, Rng, TopUp, job_id, pg};
use crate::Res;

/// Jobs per measured variant.
const JOBS: u64 = 200;
/// Salt of the hand-written jobs' keys here, apart from the timed runs' keys.
const WIRE: u64 = 0x7769_7265;

/// Frontend message types counted, in report order: simple query, parse, bind, execute, sync.
const TYPES: [u8; 5] = [b'Q', b'P', b'B', b'E', b'S'];

#[derive(Default)]
struct Counts([AtomicU64; TYPES.len()]);

impl Counts {
    fn snapshot(&self) -> [u64; TYPES.len()] {
        std::array::from_fn(|i| self.0[i].load(Ordering::SeqCst))
    }

    fn add(&self, ty: u8) {
        if let Some(i) = TYPES.iter().position(|&t| t == ty) {
            self.0[i].fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Messages per job of one variant, by type (as [`TYPES`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct PerJob([u64; TYPES.len()]);

impl PerJob {
    fn get(self, ty: u8) -> u64 {
        self.0[TYPES.iter().position(|&t| t == ty).expect("a counted type")]
    }

    /// Answers (`ReadyForQuery`) the client waits for per job.
    pub(crate) fn answers(self) -> u64 {
        self.get(b'Q') + self.get(b'S')
    }

    /// Statements the server executes per job: one per `Execute`, and one per statement of
    /// each simple `Query` (see [`WireReport::statements`]).
    fn executes(self) -> u64 {
        self.get(b'E')
    }
}

pub(crate) struct WireReport {
    rows: Vec<(&'static str, PerJob, u64)>,
}

impl WireReport {
    pub(crate) fn markdown(&self) -> String {
        let mut out = String::from(
            "## Messages per job on the wire (PostgreSQL)\n\n\
             One job at a time through a counting proxy; per job over 200 jobs. `Query` is a \
             simple query (it may hold several statements), `Execute` a prepared statement's \
             run; every `Query` and `Sync` is answered by a `ReadyForQuery`.\n\n\
             | variant | Query | Parse | Bind | Execute | Sync | answers awaited | statements |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for (name, per, statements) in &self.rows {
            let _ = writeln!(
                out,
                "| {name} | {} | {} | {} | {} | {} | {} | {statements} |",
                per.get(b'Q'),
                per.get(b'P'),
                per.get(b'B'),
                per.get(b'E'),
                per.get(b'S'),
                per.answers(),
            );
        }
        out.push('\n');
        out
    }

    fn row(&self, name: &str) -> PerJob {
        self.rows
            .iter()
            .find(|(n, ..)| *n == name)
            .map(|(_, per, _)| *per)
            .expect("every variant is measured")
    }

    /// The gate: the macro waits for no more answers than the hand-written claim, but for the
    /// verified commit's one extra (the `ROLLBACK` sqlx queues for the `BEGIN` that follows
    /// `COMMIT` in the commit message, sent with the release ping), and a duplicate for none
    /// more at all.
    pub(crate) fn check(&self) -> Res<()> {
        let (hand, mac) = (self.row("handwritten"), self.row("macro"));
        let (hand_dup, mac_dup) = (self.row("handwritten duplicate"), self.row("duplicate"));
        if mac.answers() > hand.answers() + 1 || mac.executes() > hand.executes() {
            return Err(format!(
                "the macro waits for {} answers and runs {} prepared statements per fresh job, \
                 the hand-written claim {} and {}: a statement was added to the hot path",
                mac.answers(),
                mac.executes(),
                hand.answers(),
                hand.executes()
            )
            .into());
        }
        if mac_dup.answers() > hand_dup.answers() || mac_dup.executes() > hand_dup.executes() {
            return Err(format!(
                "a duplicate waits for {} answers and runs {} prepared statements under the \
                 macro, {} and {} by hand: a statement was added to the duplicate path",
                mac_dup.answers(),
                mac_dup.executes(),
                hand_dup.answers(),
                hand_dup.executes()
            )
            .into());
        }
        Ok(())
    }
}

/// Runs [`JOBS`] jobs of each variant through the proxy and counts their messages.
pub(crate) async fn measure(keys: &Keys) -> Res<WireReport> {
    let counts = Arc::new(Counts::default());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let local = listener.local_addr()?;
    let upstream = upstream_addr(&config().pg_url)?;
    let proxy = tokio::spawn(accept(listener, upstream, counts.clone()));
    let url = proxied_url(&config().pg_url, &local.to_string())?;
    let mode = pool_mode();
    let pool = PgPoolOptions::new()
        .test_before_acquire(mode.ping())
        .max_connections(mode.size(1))
        .min_connections(mode.size(1))
        .connect(&url)
        .await?;
    let store = idem::Store::new(pool).with_table(&config().markers)?;
    let mut rng = Rng(WIRE);
    let first_hand = keys.hand.fetch_add(2 * JOBS, Ordering::SeqCst);
    let first_macro = keys.applied.fetch_add(2 * JOBS, Ordering::SeqCst);
    let job = |id: String, rng: &mut Rng| TopUp {
        id,
        account: rng.account(),
        credits: 1,
    };
    let mut rows = Vec::new();
    // Each variant runs twice: the first pass prepares its statements on the connections,
    // the second is counted.
    for (name, dup) in [
        ("handwritten", false),
        ("handwritten duplicate", true),
        ("macro", false),
        ("duplicate", true),
    ] {
        let mut per = [0; TYPES.len()];
        for pass in 0..2 {
            let before = counts.snapshot();
            for n in 0..JOBS {
                let n = if dup { n } else { pass * JOBS + n };
                let j = if name.starts_with("handwritten") {
                    job(job_id(crate::measure::HAND, first_hand + n), &mut rng)
                } else {
                    job(job_id(0, first_macro + n), &mut rng)
                };
                let applied = if name.starts_with("handwritten") {
                    pg::handwritten(store.pool(), &j).await?
                } else {
                    pg::top_up(&store, &j).await?.is_applied()
                };
                if applied == dup {
                    return Err(format!("wire check: {name} job {} went wrong", j.id).into());
                }
                keys.effects.fetch_add(u64::from(applied), Ordering::SeqCst);
            }
            let after = counts.snapshot();
            per = std::array::from_fn(|i| ((after[i] - before[i]) as f64 / JOBS as f64).round() as u64);
        }
        let per = PerJob(per);
        rows.push((name, per, statements(name, per)));
    }
    store.pool().close().await;
    proxy.abort();
    Ok(WireReport { rows })
}

/// Statements the server runs per job: prepared ones, plus those of the simple queries each
/// variant sends (`BEGIN`; `COMMIT` or `ROLLBACK`; the macro's commit message
/// `SELECT 1; COMMIT; BEGIN` and the `ROLLBACK` that follows it).
fn statements(name: &str, per: PerJob) -> u64 {
    let extra = match name {
        "macro" => 2,
        _ => 0,
    };
    per.executes() + per.get(b'Q') + extra
}

fn upstream_addr(url: &str) -> Res<String> {
    let rest = url.split_once("://").ok_or("the PostgreSQL URL has no scheme")?.1;
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host.split(['/', '?']).next().unwrap_or(host);
    Ok(if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5432")
    })
}

fn proxied_url(url: &str, local: &str) -> Res<String> {
    let (scheme, rest) = url.split_once("://").ok_or("the PostgreSQL URL has no scheme")?;
    let (user, host_and_path) = rest.rsplit_once('@').map_or(("", rest), |(u, h)| (u, h));
    let path = host_and_path
        .find(['/', '?'])
        .map_or("", |i| &host_and_path[i..]);
    let at = if user.is_empty() { "" } else { "@" };
    // No TLS through the proxy: it must read the messages.
    let sep = if path.contains('?') { '&' } else { '?' };
    Ok(format!("{scheme}://{user}{at}{local}{path}{sep}sslmode=disable"))
}

async fn accept(listener: TcpListener, upstream: String, counts: Arc<Counts>) {
    while let Ok((client, _)) = listener.accept().await {
        let Ok(server) = TcpStream::connect(&upstream).await else {
            continue;
        };
        let counts = counts.clone();
        tokio::spawn(async move {
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let down = tokio::spawn(async move { tokio::io::copy(&mut sr, &mut cw).await });
            let _ = forward_counting(&mut cr, &mut sw, &counts).await;
            down.abort();
        });
    }
}

/// Copies the client's bytes to the server, counting the frontend messages. The first
/// message (the startup packet) has no type byte.
async fn forward_counting(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    counts: &Counts,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let mut started = false;
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        to.write_all(&chunk[..n]).await?;
        buf.extend_from_slice(&chunk[..n]);
        loop {
            let header = if started { 5 } else { 4 };
            if buf.len() < header {
                break;
            }
            let len_at = usize::from(started);
            let len = u32::from_be_bytes(buf[len_at..len_at + 4].try_into().expect("4 bytes"));
            let total = len_at + len as usize;
            if buf.len() < total {
                break;
            }
            if started {
                counts.add(buf[0]);
            }
            started = true;
            buf.drain(..total);
        }
    }
}
