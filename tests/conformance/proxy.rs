//! A loopback TCP proxy between a pool and the server that cuts a connection at a chosen
//! message, for the ambiguous-commit cases: the client never hears the server's answer.
//!
//! One task per direction per connection. Client-to-server bytes are framed into protocol
//! messages and forwarded a whole message at a time; when the message that triggers the cut
//! comes, the connection is marked cut *before* the message is written, so the
//! server-to-client task (which checks the mark before every write) cannot forward its answer;
//! then the message is written and both directions are closed. The proxy cuts one connection
//! in its life; later connections pass through.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// The wire protocol the proxy frames.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wire {
    Postgres,
    MySql,
}

/// Where the proxy cuts the connection.
#[derive(Clone, Debug)]
pub(crate) enum CutAt {
    /// Right after the commit message: PostgreSQL a simple query (`Q`), MySQL a `COM_QUERY`,
    /// whose statements include `COMMIT` (PostgreSQL's is `COMMIT AND CHAIN`).
    Commit,
    /// Instead of the commit message: the connection is cut with the message dropped, so the
    /// server never commits (what the client sees is the same as with [`CutAt::Commit`]).
    InsteadOfCommit,
    /// Right after the execution of the claim: the first execute (PostgreSQL `E`, MySQL
    /// `COM_STMT_EXECUTE`) after the statement `INSERT INTO <table>` was prepared on the
    /// connection (PostgreSQL `P`, MySQL `COM_STMT_PREPARE`).
    ClaimOf(String),
}

/// A cut connection.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cut {
    /// The local port of the proxy's connection to the server: the client port the server
    /// lists for the cut session.
    pub(crate) server_side_port: u16,
}

pub(crate) struct Proxy {
    /// Where clients connect.
    pub(crate) addr: SocketAddr,
    cuts: mpsc::UnboundedReceiver<Cut>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on `127.0.0.1:0` and forwards every connection to `upstream` (`host:port`).
    pub(crate) async fn start(upstream: String, wire: Wire, at: CutAt) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let (tx, cuts) = mpsc::unbounded_channel();
        let fired = Arc::new(AtomicBool::new(false));
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let server = TcpStream::connect(&upstream)
                    .await
                    .unwrap_or_else(|e| panic!("proxy: connect to {upstream}: {e}"));
                let port = server.local_addr().expect("a local address").port();
                drop(client.set_nodelay(true));
                drop(server.set_nodelay(true));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let cut = Arc::new(AtomicBool::new(false));
                let down = tokio::spawn(server_to_client(sr, cw, cut.clone()));
                let job = Upstream {
                    wire,
                    at: at.clone(),
                    fired: fired.clone(),
                    cut,
                    cuts: tx.clone(),
                    port,
                };
                tokio::spawn(job.run(cr, sw, down));
            }
        });
        Proxy { addr, cuts, accept }
    }

    /// Resolves when the proxy has cut a connection.
    pub(crate) async fn cut(&mut self) -> Cut {
        self.cuts.recv().await.expect("the proxy is running")
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn server_to_client(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, cut: Arc<AtomicBool>) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Marked before the triggering message went out: no answer to it passes.
        if cut.load(Ordering::SeqCst) {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

struct Upstream {
    wire: Wire,
    at: CutAt,
    fired: Arc<AtomicBool>,
    cut: Arc<AtomicBool>,
    cuts: mpsc::UnboundedSender<Cut>,
    port: u16,
}

impl Upstream {
    async fn run(self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf, down: JoinHandle<()>) {
        let mut framer = Framer::new(self.wire);
        let mut armed = false;
        let mut pending = Vec::new();
        let mut buf = vec![0_u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            pending.extend_from_slice(&buf[..n]);
            while let Some(len) = framer.next_len(&pending) {
                let msg: Vec<u8> = pending.drain(..len).collect();
                let trigger = !self.fired.load(Ordering::SeqCst)
                    && framer.triggers(&msg, &self.at, &mut armed);
                if trigger && !self.fired.swap(true, Ordering::SeqCst) {
                    self.cut.store(true, Ordering::SeqCst);
                    if !matches!(self.at, CutAt::InsteadOfCommit) {
                        let _ = to.write_all(&msg).await;
                        let _ = to.flush().await;
                    }
                    // Both directions closed: the server->client task (and its halves) gone
                    // first, then ours.
                    down.abort();
                    let _ = down.await;
                    drop(to);
                    drop(from);
                    let _ = self.cuts.send(Cut {
                        server_side_port: self.port,
                    });
                    return;
                }
                if to.write_all(&msg).await.is_err() {
                    return;
                }
            }
        }
        // The client closed: pass that on (the server->client task ends with the server).
        drop(to);
        let _ = down.await;
    }
}

/// Splits the client's byte stream into protocol messages.
struct Framer {
    wire: Wire,
    /// PostgreSQL: still in the untyped startup phase (startup, SSL or GSS request).
    startup: bool,
}

const PG_SSL_REQUEST: u32 = 80_877_103;
const PG_GSSENC_REQUEST: u32 = 80_877_104;
const COM_QUERY: u8 = 0x03;
const COM_STMT_PREPARE: u8 = 0x16;
const COM_STMT_EXECUTE: u8 = 0x17;

impl Framer {
    fn new(wire: Wire) -> Framer {
        Framer {
            wire,
            startup: true,
        }
    }

    /// The length of the first message in `buf`, if it is complete.
    fn next_len(&mut self, buf: &[u8]) -> Option<usize> {
        match self.wire {
            Wire::Postgres if self.startup => {
                let len = u32::from_be_bytes(buf.get(..4)?.try_into().ok()?) as usize;
                if buf.len() < len || len < 8 {
                    return None;
                }
                let code = u32::from_be_bytes(buf[4..8].try_into().ok()?);
                // After an SSL or GSS request (refused here: no TLS) a startup message follows.
                self.startup = code == PG_SSL_REQUEST || code == PG_GSSENC_REQUEST;
                Some(len)
            }
            Wire::Postgres => {
                let len = u32::from_be_bytes(buf.get(1..5)?.try_into().ok()?) as usize;
                (buf.len() > len).then_some(1 + len)
            }
            Wire::MySql => {
                let head = buf.get(..4)?;
                let len =
                    usize::from(head[0]) | usize::from(head[1]) << 8 | usize::from(head[2]) << 16;
                (buf.len() >= 4 + len).then_some(4 + len)
            }
        }
    }

    /// Whether the proxy cuts right after forwarding `msg`. `armed`: the claim was prepared.
    fn triggers(&self, msg: &[u8], at: &CutAt, armed: &mut bool) -> bool {
        // (kind, text): PostgreSQL's message type; MySQL's command (commands start a
        // sequence, `seq == 0`; handshake packets do not).
        let (kind, body) = match self.wire {
            Wire::Postgres => (msg[0], &msg[5..]),
            Wire::MySql if msg.len() > 4 && msg[3] == 0 => (msg[4], &msg[5..]),
            Wire::MySql => return false,
        };
        let text = String::from_utf8_lossy(body);
        let (query, prepare, execute) = match self.wire {
            Wire::Postgres => (b'Q', b'P', b'E'),
            Wire::MySql => (COM_QUERY, COM_STMT_PREPARE, COM_STMT_EXECUTE),
        };
        match at {
            CutAt::Commit | CutAt::InsteadOfCommit => {
                kind == query
                    && text.split(';').any(|s| {
                        let s = s.trim_matches(|c: char| c.is_whitespace() || c == '\0');
                        s == "COMMIT" || s.starts_with("COMMIT AND CHAIN")
                    })
            }
            CutAt::ClaimOf(table) => {
                if kind == prepare && text.contains(&format!("INSERT INTO {table} ")) {
                    *armed = true;
                }
                *armed && kind == execute
            }
        }
    }
}

/// `host:port` of the server `url` names (`default_port` when it names none).
pub(crate) fn upstream(url: &str, default_port: u16) -> String {
    let (_, host_port, _) = split_authority(url);
    if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:{default_port}")
    }
}

/// `url` with its host and port replaced by `addr`, and the query parameter `param` added.
pub(crate) fn with_address(url: &str, addr: SocketAddr, param: &str) -> String {
    let (head, _, tail) = split_authority(url);
    let sep = if tail.contains('?') { '&' } else { '?' };
    format!("{head}{addr}{tail}{sep}{param}")
}

/// `scheme://user@`, `host:port`, `/path?query`.
fn split_authority(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    let host = url[start..end].rfind('@').map_or(start, |i| start + i + 1);
    (&url[..host], &url[host..end], &url[end..])
}
