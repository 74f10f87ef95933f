//! A loopback TCP proxy between the workers and a server, which the fault schedule tells to
//! add latency, reset every connection (an RST both ways) or leave some connections half-open:
//! still established at both ends, with nothing passing, until the proxy resets them later.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Pass,
    /// Half-open: the sockets stay up, no byte is forwarded.
    Frozen,
    Reset,
}

struct Shared {
    upstream: String,
    latency_ms: AtomicU64,
    next: AtomicU64,
    conns: Mutex<HashMap<u64, watch::Sender<State>>>,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, watch::Sender<State>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct Proxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            latency_ms: AtomicU64::new(0),
            next: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(serve(s.clone(), client));
            }
        });
        Ok(Proxy {
            addr,
            shared,
            accept,
        })
    }

    /// Adds this much to every chunk forwarded either way (zero: none).
    pub fn set_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.shared.latency_ms.store(ms, Ordering::SeqCst);
    }

    /// Resets every connection; returns how many there were.
    pub fn reset_all(&self) -> usize {
        let conns = self.shared.conns();
        for state in conns.values() {
            state.send_replace(State::Reset);
        }
        conns.len()
    }

    /// Leaves every `nth` connection half-open; returns their ids, for [`Proxy::reset`].
    pub fn freeze(&self, nth: usize, offset: usize) -> Vec<u64> {
        let conns = self.shared.conns();
        let mut ids: Vec<u64> = conns.keys().copied().collect();
        ids.sort_unstable();
        let frozen: Vec<u64> = ids
            .into_iter()
            .enumerate()
            .filter(|(i, _)| (i + offset).is_multiple_of(nth.max(1)))
            .map(|(_, id)| id)
            .collect();
        for id in &frozen {
            conns[id].send_replace(State::Frozen);
        }
        frozen
    }

    /// Resets the connections `ids` that are still there.
    pub fn reset(&self, ids: &[u64]) {
        let conns = self.shared.conns();
        for id in ids {
            if let Some(state) = conns.get(id) {
                state.send_replace(State::Reset);
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset_all();
    }
}

async fn serve(shared: Arc<Shared>, client: TcpStream) {
    // A server that is down (restarting) refuses: the client sees its connection closed.
    let Ok(server) = TcpStream::connect(&shared.upstream).await else {
        return;
    };
    drop(client.set_nodelay(true));
    drop(server.set_nodelay(true));
    let id = shared.next.fetch_add(1, Ordering::SeqCst);
    let (tx, rx) = watch::channel(State::Pass);
    shared.conns().insert(id, tx);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let mut reset = rx.clone();
    let reset_seen = tokio::select! {
        () = pump(&mut cr, &mut sw, &shared, rx.clone()) => false,
        () = pump(&mut sr, &mut cw, &shared, rx) => false,
        _ = reset.wait_for(|s| *s == State::Reset) => true,
    };
    shared.conns().remove(&id);
    if reset_seen {
        // SO_LINGER 0: closing sends an RST instead of a FIN, to both ends.
        drop(cr.as_ref().set_zero_linger());
        drop(sr.as_ref().set_zero_linger());
    }
}

async fn pump(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    shared: &Shared,
    mut state: watch::Receiver<State>,
) {
    let mut buf = vec![0_u8; 32 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let latency = shared.latency_ms.load(Ordering::SeqCst);
        if latency > 0 {
            tokio::time::sleep(Duration::from_millis(latency)).await;
        }
        // Half-open: hold the bytes until the connection is reset (the select above ends it).
        if state.wait_for(|s| *s == State::Pass).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
