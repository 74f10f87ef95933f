//! A TCP proxy that holds everything it forwards for a fixed delay each way: the network
//! between a primary and a synchronous standby in another zone, on a kernel without `netem`.
//!
//! Each direction of a connection is a reader thread and a writer thread joined by a channel:
//! the reader stamps every chunk it reads with the time it may leave, the writer sleeps until
//! then and writes it. A constant delay keeps the order of the chunks, and a chunk read while
//! an earlier one waits does not wait behind it for longer than its own delay (they overlap,
//! as packets in flight on a wire do). Threads and `std::thread::sleep` rather than tokio's
//! timer, which rounds every sleep up to the next millisecond: a 0.5 ms delay would be 1 ms.
//! [`DelayProxy::round_trip`] measures what the delay really is on the machine at hand.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running proxy from its own port on 127.0.0.1 to a target; stopped when dropped.
pub struct DelayProxy {
    port: u16,
    delay_ns: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl DelayProxy {
    /// Listens on a free port of 127.0.0.1 and forwards each connection to `target`, every
    /// chunk `delay` late in each direction.
    pub fn start(target: SocketAddr, delay: Duration) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy's port");
        let port = listener.local_addr().expect("the proxy's address").port();
        let delay_ns = Arc::new(AtomicU64::new(delay.as_nanos() as u64));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (delay_ns.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if s.load(Ordering::Acquire) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(target) else {
                    // The target is down: the client sees its connection closed, as it
                    // would see the target's refusal.
                    continue;
                };
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (from, to) = (
                        from.try_clone().expect("clone a socket"),
                        to.try_clone().expect("clone a socket"),
                    );
                    pipe(from, to, d.clone());
                }
            }
        });
        DelayProxy {
            port,
            delay_ns,
            stop,
        }
    }

    /// The port the proxy listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Changes the delay of the chunks read from now on, on every connection.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ns
            .store(delay.as_nanos() as u64, Ordering::Release);
    }

    /// The delay chunks read now get.
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_ns.load(Ordering::Acquire))
    }

    /// Round trips of one byte through a proxy of this one's delay to an echo server of its
    /// own, `n` of them: what a round trip through the proxy really takes here (the sleeps'
    /// overshoot and the threads' wake-ups included), sorted.
    pub fn round_trip(delay: Duration, n: usize) -> Vec<Duration> {
        let echo = TcpListener::bind("127.0.0.1:0").expect("bind an echo port");
        let target = echo.local_addr().expect("the echo's address");
        std::thread::spawn(move || {
            if let Ok((mut peer, _)) = echo.accept() {
                peer.set_nodelay(true).expect("TCP_NODELAY");
                let mut byte = [0u8; 1];
                while peer.read_exact(&mut byte).is_ok() {
                    if peer.write_all(&byte).is_err() {
                        return;
                    }
                }
            }
        });
        let proxy = DelayProxy::start(target, delay);
        let mut client =
            TcpStream::connect(("127.0.0.1", proxy.port())).expect("connect to the proxy");
        client.set_nodelay(true).expect("TCP_NODELAY");
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let sent = [i as u8];
            let mut echoed = [0u8; 1];
            let t0 = Instant::now();
            client.write_all(&sent).expect("send through the proxy");
            client
                .read_exact(&mut echoed)
                .expect("the echo through the proxy");
            times.push(t0.elapsed());
            assert_eq!(echoed, sent, "the proxy changed or reordered a byte");
        }
        times.sort();
        times
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accepting thread, which then sees the flag; connections already made run
        // until either end closes.
        drop(TcpStream::connect(("127.0.0.1", self.port)));
    }
}

/// Forwards `from` to `to`, each chunk `delay_ns` late.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay_ns: Arc<AtomicU64>) {
    // No Nagle on either side: a small message (a commit's WAL, the standby's reply) leaves
    // at once, as it does on a direct connection of libpq's.
    let _ = from.set_nodelay(true);
    let _ = to.set_nodelay(true);
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let due =
                        Instant::now() + Duration::from_nanos(delay_ns.load(Ordering::Acquire));
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
        // Dropping `tx` ends the writer once it wrote what is queued.
    });
    std::thread::spawn(move || {
        for (due, chunk) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each byte comes back as sent, through both directions, and never sooner than the delay
    /// twice over.
    #[test]
    fn forwards_both_ways_no_sooner_than_the_delay() {
        for delay in [Duration::ZERO, Duration::from_micros(500)] {
            let times = DelayProxy::round_trip(delay, 20);
            assert_eq!(times.len(), 20);
            // A round trip crosses the proxy twice: it cannot be shorter than two delays.
            assert!(
                times[0] >= 2 * delay,
                "{:?} under {:?}",
                times[0],
                2 * delay
            );
        }
    }
}
