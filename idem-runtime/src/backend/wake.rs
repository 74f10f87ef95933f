//! How a relay learns of new outbox messages without a notification in the transaction that
//! wrote them.
//!
//! A `NOTIFY` in the writing transaction (PostgreSQL) takes a lock at commit that every
//! notifying transaction of the database waits for in turn: committing jobs that send
//! messages were serialised on it. Instead, the commit of messages is signalled here, after
//! it, and
//!
//! - the relays of the same store (its clones included) are woken in the process, with no
//!   round trip;
//! - the relays of other processes (other stores) are told by one announcement (PostgreSQL's
//!   `NOTIFY`, on a connection of the store's pool, outside any job's transaction) for all
//!   the commits signalled within [`Wake::every`] of the last one: the first commit after a
//!   quiet spell is announced at once, the ones that follow it at most once per interval.
//!
//! A process that dies between a commit and its announcement costs only latency: the other
//! relays' polls find the messages.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::future::BoxFuture;

/// Sends an announcement carrying a store's token, on the database's channel of the outbox.
pub(crate) type Announcer = Arc<dyn Fn(String) -> BoxFuture<'static, ()> + Send + Sync>;

/// The default interval between two announcements of a store's commits.
pub(crate) const DEFAULT_EVERY: Duration = Duration::from_millis(2);

/// The commits of a store's outbox messages, as its relays wait for them.
pub(crate) struct Wake {
    /// Bumped after each commit that wrote messages; each relay of the store holds a receiver.
    commits: watch::Sender<u64>,
    /// The announcement to the other processes, where the database has one.
    announcer: OnceLock<Announcer>,
    /// A commit not yet covered by an announcement sent or being sent.
    pending: AtomicBool,
    /// An announcing task is running.
    running: AtomicBool,
    /// The interval between two announcements, in microseconds.
    every: AtomicU64,
    /// When the last announcement was begun, in microseconds since `epoch` (0: never).
    last: AtomicU64,
    epoch: Instant,
    /// The payload of this store's announcements, by which its own relays (woken already)
    /// know them.
    token: String,
}

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wake")
            .field("token", &self.token)
            .field("every", &self.every())
            .finish_non_exhaustive()
    }
}

impl Wake {
    pub(crate) fn new() -> Arc<Wake> {
        static STORES: AtomicU64 = AtomicU64::new(0);
        let n = STORES.fetch_add(1, Ordering::Relaxed);
        Arc::new(Wake {
            commits: watch::Sender::new(0),
            announcer: OnceLock::new(),
            pending: AtomicBool::new(false),
            running: AtomicBool::new(false),
            every: AtomicU64::new(micros(DEFAULT_EVERY)),
            last: AtomicU64::new(0),
            epoch: Instant::now(),
            // The pid alone may repeat across hosts or containers on one database; the
            // start's nanoseconds make a clash of two stores' tokens unlikely (a clash would
            // cost the other store's relays only their poll's latency).
            token: format!("{}.{n}.{}", std::process::id(), started_nanos()),
        })
    }

    /// Gives the store's announcement to other processes; the first one given stays.
    pub(crate) fn announce_with(&self, announcer: Announcer) {
        let _ = self.announcer.set(announcer);
    }

    /// The interval between two announcements.
    pub(crate) fn every(&self) -> Duration {
        Duration::from_micros(self.every.load(Ordering::Relaxed))
    }

    #[cfg(feature = "postgres")]
    pub(crate) fn set_every(&self, every: Duration) {
        self.every.store(micros(every), Ordering::Relaxed);
    }

    /// What a relay of this store waits on: it sees every commit signalled after this call.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.commits.subscribe()
    }

    /// The payload of this store's announcements.
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// Signals a commit that wrote messages: call it only once the commit is confirmed.
    pub(crate) fn committed(self: &Arc<Self>) {
        self.commits.send_modify(|n| *n = n.wrapping_add(1));
        if self.announcer.get().is_none() {
            return;
        }
        // Pending before running is looked at: a task that finds nothing pending and stops
        // looks again once it no longer runs, so no commit is left unannounced.
        self.pending.store(true, Ordering::SeqCst);
        if self.running.swap(true, Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.running.store(false, Ordering::SeqCst);
            return;
        };
        runtime.spawn(self.clone().announcing());
    }

    /// Announces until no commit is pending: each announcement covers the commits signalled
    /// before it begins, so a commit signalled while one is on its way gets the next.
    async fn announcing(self: Arc<Self>) {
        let Some(announce) = self.announcer.get().cloned() else {
            self.running.store(false, Ordering::SeqCst);
            return;
        };
        loop {
            let last = self.last.load(Ordering::Relaxed);
            if last != 0 {
                let next = Duration::from_micros(last) + self.every();
                let now = self.epoch.elapsed();
                if next > now {
                    tokio::time::sleep(next - now).await;
                }
            }
            if !self.pending.swap(false, Ordering::SeqCst) {
                self.running.store(false, Ordering::SeqCst);
                if self.pending.load(Ordering::SeqCst) && !self.running.swap(true, Ordering::SeqCst)
                {
                    continue;
                }
                return;
            }
            let begun = micros(self.epoch.elapsed()).max(1);
            self.last.store(begun, Ordering::Relaxed);
            announce(self.token.clone()).await;
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The nanoseconds of the wall clock's current second.
fn started_nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}
