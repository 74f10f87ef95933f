//! What each variant sends to the server per job, counted on the wire: a deterministic check
//! that a loaded machine cannot turn red, unlike a timing floor.
//!
//! The jobs run one at a time through a loopback proxy that parses the client's side of the
//! protocol (PostgreSQL's frontend messages, MySQL's command packets) and counts its messages
//! by type. Per job is the difference between two snapshots divided by the number of jobs in
//! between, rounded: the only messages that can straddle a snapshot are those of the one or
//! two connections being released in the background (sqlx pings a connection as it goes back
//! to the pool), far less than half a message per job over [`JOBS`] jobs.
//!
//! PostgreSQL answers every `Query` and every `Sync` with one `ReadyForQuery`; MySQL answers
//! every command but `COM_STMT_CLOSE`. Their count is the number of answers the client waits
//! for. PostgreSQL sends a `ROLLBACK` that sqlx queued when a transaction was dropped in the
//! same write as the release ping's `Sync`: one more answer, not one more round trip.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

use crate::Res;
use crate::config::config;
use crate::measure::{HAND, connect_to};
use crate::variants::{Keys, Kind, Rng, TopUp, Variant, job_id};

/// Jobs per measured variant.
const JOBS: u64 = 200;
/// Where the accounts of these jobs come from (any fixed seed).
const SEED: u64 = 0x7769_7265;

/// The client's messages counted, by protocol, in report order.
struct Protocol {
    /// Column names.
    names: [&'static str; 5],
    /// Type byte (PostgreSQL) or command byte (MySQL) of each column.
    types: [u8; 5],
    /// Columns that the server answers.
    answered: [bool; 5],
    /// The column of prepared statements run.
    execute: usize,
    /// The column of text queries, which may hold several statements.
    query: usize,
}

const PG: Protocol = Protocol {
    names: ["Query", "Parse", "Bind", "Execute", "Sync"],
    types: [b'Q', b'P', b'B', b'E', b'S'],
    answered: [true, false, false, false, true],
    execute: 3,
    query: 0,
};

const MY: Protocol = Protocol {
    names: [
        "COM_QUERY",
        "STMT_PREPARE",
        "STMT_EXECUTE",
        "STMT_CLOSE",
        "PING",
    ],
    types: [0x03, 0x16, 0x17, 0x19, 0x0e],
    answered: [true, true, true, false, true],
    execute: 2,
    query: 0,
};

fn protocol(kind: Kind) -> &'static Protocol {
    match kind {
        Kind::MySql => &MY,
        _ => &PG,
    }
}

#[derive(Default)]
struct Counts([AtomicU64; 5]);

impl Counts {
    fn snapshot(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.0[i].load(Ordering::SeqCst))
    }

    fn add(&self, proto: &Protocol, ty: u8) {
        if let Some(i) = proto.types.iter().position(|&t| t == ty) {
            self.0[i].fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Messages per job of one variant, by column of its [`Protocol`].
#[derive(Clone, Copy)]
struct PerJob([u64; 5]);

impl PerJob {
    fn answers(self, proto: &Protocol) -> u64 {
        (0..5)
            .filter(|&i| proto.answered[i])
            .map(|i| self.0[i])
            .sum()
    }

    fn executes(self, proto: &Protocol) -> u64 {
        self.0[proto.execute]
    }
}

/// The variants measured, as (name, variant run, a duplicate?).
const MEASURED: [(&str, Variant, bool); 4] = [
    ("handwritten", Variant::Handwritten, false),
    ("handwritten duplicate", Variant::Handwritten, true),
    ("macro", Variant::Macro, false),
    ("duplicate", Variant::Duplicate, true),
];

pub(crate) struct WireReport {
    kind: Kind,
    rows: Vec<(&'static str, PerJob)>,
}

impl WireReport {
    pub(crate) fn markdown(&self) -> String {
        let proto = protocol(self.kind);
        let mut out = format!(
            "## Messages per job on the wire ({})\n\n\
             One job at a time through a counting proxy, per job over {JOBS} jobs; pools as \
             below. Text queries may hold several statements (the macro's commit message holds \
             two).\n\n| variant |",
            self.kind.name()
        );
        for name in proto.names {
            let _ = write!(out, " {name} |");
        }
        out.push_str(" answers awaited | statements |\n|---|");
        out.push_str(&"---:|".repeat(7));
        out.push('\n');
        for (name, per) in &self.rows {
            let _ = write!(out, "| {name} |");
            for n in per.0 {
                let _ = write!(out, " {n} |");
            }
            let _ = writeln!(
                out,
                " {} | {} |",
                per.answers(proto),
                statements(name, *per, proto)
            );
        }
        out.push('\n');
        out
    }

    fn row(&self, name: &str) -> PerJob {
        self.rows
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, per)| *per)
            .expect("every variant is measured")
    }

    /// The gate. A fresh job under the macro runs no more prepared statements than the
    /// hand-written claim, and waits for at most one answer more: the `ROLLBACK` that sqlx
    /// queues for the transaction it still counts open after idem's own commit message (on
    /// PostgreSQL the one `AND CHAIN` opened), sent as the connection goes back (with the
    /// release ping on PostgreSQL, before it on MySQL). A duplicate reads the marker it
    /// met, which tells a completed job (a duplicate) from a lease another delivery still
    /// holds (in progress, never to be acked); the hand-written claim treats every marker as
    /// completed. PostgreSQL reads it in the claim's own statement, so a duplicate waits for
    /// no more than by hand; MySQL, whose failed `INSERT` answers nothing else, waits for one
    /// answer more, from one prepared statement more.
    pub(crate) fn check(&self) -> Res<()> {
        let proto = protocol(self.kind);
        let (read_answers, read_executes) = match self.kind {
            Kind::MySql => (1, 1),
            _ => (0, 0),
        };
        let pairs = [
            ("handwritten", "macro", 1, 0),
            (
                "handwritten duplicate",
                "duplicate",
                read_answers,
                read_executes,
            ),
        ];
        for (hand, mac, answers, executes) in pairs {
            let (h, m) = (self.row(hand), self.row(mac));
            if m.answers(proto) > h.answers(proto) + answers
                || m.executes(proto) > h.executes(proto) + executes
            {
                return Err(format!(
                    "{}: `{mac}` waits for {} answers and runs {} prepared statements per job, \
                     `{hand}` {} and {}: a statement was added to idem's path",
                    self.kind.name(),
                    m.answers(proto),
                    m.executes(proto),
                    h.answers(proto),
                    h.executes(proto)
                )
                .into());
            }
        }
        Ok(())
    }
}

/// Statements the server runs per job: the prepared ones, plus one per statement of each
/// text query (the macro's commit message holds two: PostgreSQL's `SAVEPOINT ..; COMMIT AND
/// CHAIN`, MySQL's probe and `COMMIT`).
fn statements(name: &str, per: PerJob, proto: &Protocol) -> u64 {
    let extra = if name == "macro" { 1 } else { 0 };
    per.0[proto.execute] + per.0[proto.query] + extra
}

/// Runs [`JOBS`] jobs of each variant of `kind` (PostgreSQL or MySQL) through the proxy, one
/// worker, and counts their messages.
pub(crate) async fn measure(kind: Kind, keys: &Keys, sqlite: &Path) -> Res<WireReport> {
    let url = match kind {
        Kind::MySql => &config().my_url,
        _ => &config().pg_url,
    };
    let counts = Arc::new(Counts::default());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let local = listener.local_addr()?.to_string();
    let proxy = tokio::spawn(accept(
        listener,
        upstream_addr(url, kind)?,
        counts.clone(),
        kind,
    ));
    let conn = connect_to(kind, 1, sqlite, &proxied_url(url, &local, kind)?).await?;
    let mut rng = Rng(SEED);
    let first_hand = keys.hand.fetch_add(2 * JOBS, Ordering::SeqCst);
    let first_macro = keys.applied.fetch_add(2 * JOBS, Ordering::SeqCst);
    let mut rows = Vec::new();
    for (name, variant, dup) in MEASURED {
        let mut per = [0; 5];
        // Two passes: the first prepares the statements on the connections, the second is
        // counted. Duplicates re-deliver the first pass's keys of their fresh variant.
        for pass in 0..2 {
            let before = counts.snapshot();
            for n in 0..JOBS {
                let n = if dup { n } else { pass * JOBS + n };
                let id = match variant {
                    Variant::Handwritten => job_id(HAND, first_hand + n),
                    _ => job_id(0, first_macro + n),
                };
                let job = TopUp {
                    id,
                    account: rng.account(),
                    credits: 1,
                };
                let applied = conn.job(variant, &job).await?;
                if applied == dup {
                    return Err(format!("wire check: `{name}` job {} went wrong", job.id).into());
                }
                keys.effects.fetch_add(u64::from(applied), Ordering::SeqCst);
            }
            let after = counts.snapshot();
            per = std::array::from_fn(|i| {
                ((after[i] - before[i]) as f64 / JOBS as f64).round() as u64
            });
        }
        rows.push((name, PerJob(per)));
    }
    conn.close().await;
    proxy.abort();
    Ok(WireReport { kind, rows })
}

/// `host:port` of the server in `url`.
fn upstream_addr(url: &str, kind: Kind) -> Res<String> {
    let rest = url
        .split_once("://")
        .ok_or("the server's URL has no scheme")?
        .1;
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host.split(['/', '?']).next().unwrap_or(host);
    let port = if kind == Kind::MySql { 3306 } else { 5432 };
    Ok(if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:{port}")
    })
}

/// `url` pointed at the proxy, in plain text: the proxy must read the messages.
fn proxied_url(url: &str, local: &str, kind: Kind) -> Res<String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or("the server's URL has no scheme")?;
    let (user, host_and_path) = rest.rsplit_once('@').map_or(("", rest), |(u, h)| (u, h));
    let path = host_and_path
        .find(['/', '?'])
        .map_or("", |i| &host_and_path[i..]);
    let at = if user.is_empty() { "" } else { "@" };
    let sep = if path.contains('?') { '&' } else { '?' };
    let plain = if kind == Kind::MySql {
        "ssl-mode=disabled"
    } else {
        "sslmode=disable"
    };
    Ok(format!("{scheme}://{user}{at}{local}{path}{sep}{plain}"))
}

async fn accept(listener: TcpListener, upstream: String, counts: Arc<Counts>, kind: Kind) {
    while let Ok((client, _)) = listener.accept().await {
        let Ok(server) = TcpStream::connect(&upstream).await else {
            continue;
        };
        let counts = counts.clone();
        tokio::spawn(async move {
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let down = tokio::spawn(async move { tokio::io::copy(&mut sr, &mut cw).await });
            let _ = forward_counting(&mut cr, &mut sw, &counts, kind).await;
            down.abort();
        });
    }
}

/// Copies the client's bytes to the server, counting its messages as they complete.
async fn forward_counting(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    counts: &Counts,
    kind: Kind,
) -> std::io::Result<()> {
    let proto = protocol(kind);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    // PostgreSQL's first message, the startup packet, has no type byte.
    let mut started = kind == Kind::MySql;
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        to.write_all(&chunk[..n]).await?;
        buf.extend_from_slice(&chunk[..n]);
        while let Some((total, ty)) = next_message(&buf, kind, started) {
            if let Some(ty) = ty {
                counts.add(proto, ty);
            }
            started = true;
            buf.drain(..total);
        }
    }
}

/// The length of the complete message at the start of `buf`, and its type if it is counted.
fn next_message(buf: &[u8], kind: Kind, started: bool) -> Option<(usize, Option<u8>)> {
    if kind == Kind::MySql {
        // 3-byte length, sequence number, payload. A command starts a sequence (0); the
        // handshake response and authentication packets continue the server's.
        let header = buf.get(..4)?;
        let len = u32::from_le_bytes([header[0], header[1], header[2], 0]) as usize;
        let total = 4 + len;
        let command = (header[3] == 0).then(|| buf.get(4).copied()).flatten();
        return (buf.len() >= total).then_some((total, command));
    }
    let at = usize::from(started);
    let len = u32::from_be_bytes(buf.get(at..at + 4)?.try_into().ok()?) as usize;
    let total = at + len;
    (buf.len() >= total).then_some((total, started.then_some(buf[0])))
}
