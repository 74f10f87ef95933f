//! [`Relay::run`]: rounds while there is a backlog, several in flight, then a wait for the
//! next commit or the poll.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

use super::{Confirmed, Publisher, Relay};
use crate::backend::{Backend, Listen};
use crate::error::Error;

impl<DB: Backend, P: Publisher> Relay<DB, P> {
    /// Relays until `stop` resolves: rounds, [`rounds_in_flight`](Relay::rounds_in_flight) of
    /// them at once while there is a backlog, then, when they found nothing to send, a wait of
    /// `poll` before the next ones. A database error ends it (restart it from your
    /// supervisor); the rounds it cut short leave their messages held until their hold runs
    /// out.
    ///
    /// The wait ends early at the commit of a new message, unless the relay was told not to
    /// listen ([`listen`](Relay::listen)):
    ///
    /// - **a commit through the relay's store** (or a clone of it), on every database: the
    ///   store wakes its relays in the process once the commit is confirmed, with no round
    ///   trip. That covers the claims of every mode, batches, group commit (on PostgreSQL)
    ///   and leases; a claim joined to your transaction ([`Store::join`]) commits with your
    ///   commit, which the store does not see: on PostgreSQL it is announced as below, on
    ///   MySQL and SQLite it waits for the poll.
    /// - **a commit through another store** (another process) on PostgreSQL: each store
    ///   announces its commits of messages with `NOTIFY` on the channel `{table}_outbox`,
    ///   outside the jobs' transactions and at most once per
    ///   [`Store::outbox_notify_interval`] for all the commits in between; the relay listens
    ///   on it from a connection of its own (not one of the store's pool), except behind a
    ///   pooler in transaction mode ([`Store::behind_transaction_pooler`]), where nothing is
    ///   announced and the relay polls.
    ///
    /// A process that dies between a commit and its announcement leaves the messages to the
    /// relays' polls: `poll` bounds that latency, and the latency of every message the
    /// relay is not woken for.
    ///
    /// [`Store::join`]: crate::Store::join
    /// [`Store::outbox_notify_interval`]: crate::Store::outbox_notify_interval
    /// [`Store::behind_transaction_pooler`]: crate::Store::behind_transaction_pooler
    pub async fn run(&self, poll: Duration, stop: impl Future<Output = ()>) -> Result<(), Error> {
        let mut stop = std::pin::pin!(stop);
        let wake = self.store.sql().table.wake().clone();
        // Subscribed and listening before the first round: a commit from then on wakes the
        // relay, even one that lands while a round runs (the change waits in the receiver,
        // the notification in the listener).
        let mut commits = self.listen.then(|| wake.subscribe());
        let mut listen = None;
        if self.listen {
            let listening = DB::listen(self.store.pool(), self.store.sql());
            let Some(listening) = unless(stop.as_mut(), listening).await else {
                return Ok(());
            };
            listen = Some(listening?);
        }
        let unmarked = std::sync::Mutex::new(Vec::new());
        loop {
            let Some(moved) = unless(stop.as_mut(), self.rounds(&unmarked)).await else {
                // Rounds cut short leave their messages held; those that ended are marked.
                return self.mark_unmarked(&unmarked).await;
            };
            let moved = match moved {
                Ok(moved) => moved,
                Err(e) => {
                    // Whatever the lanes' rounds confirmed is marked if the database lets it.
                    let _ = self.mark_unmarked(&unmarked).await;
                    return Err(e);
                }
            };
            if moved > 0 {
                continue;
            }
            let waiting = wait(poll, commits.as_mut(), listen.as_mut(), wake.token());
            if unless(stop.as_mut(), waiting).await.is_none() {
                return Ok(());
            }
        }
    }

    /// Rounds until one finds nothing to send (or sends nothing), up to
    /// [`rounds_in_flight`](Relay::rounds_in_flight) of them at once; returns how many
    /// messages they published (`sent` and `lost`).
    ///
    /// Each lane runs its rounds one after another; the lanes take in turn (one take at a
    /// time, so that each take sees the holds of the takes before it and gets a full batch
    /// rather than racing another for the same keys). The first take always runs; a lane
    /// takes again only while the take before it, any lane's, came back full: a backlog. A
    /// relay without one runs one round at a time, one take per wake-up, as with a single
    /// lane. A lane also stops at a round that published nothing (the broker down, every
    /// message failed): the others finish their rounds, and the relay waits before trying
    /// again, as after a single round.
    ///
    /// A lane's round hands its confirmed messages to `unmarked` (its lane's slot), and the
    /// lane's next take marks them in its own transaction: one commit a round rather than two.
    /// A lane that ends marks what its slot holds; so does [`run`](Relay::run) when stopped.
    async fn rounds(&self, unmarked: &Unmarked) -> Result<usize, Error> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let turn = tokio::sync::Mutex::new(());
        let backlog = AtomicBool::new(true);
        let batch = usize::try_from(self.batch).unwrap_or(usize::MAX);
        let slot = |lane: usize| unmarked.lock().expect("no lane panics holding it")[lane].take();
        let lane = async |lane: usize| -> Result<usize, Error> {
            let mut moved = 0;
            loop {
                let round = {
                    let _turn = turn.lock().await;
                    if !backlog.load(Ordering::Relaxed) {
                        break;
                    }
                    let round = self.take(slot(lane)).await?;
                    let full = round.taken.messages.len() >= batch;
                    backlog.store(full, Ordering::Relaxed);
                    round
                };
                if round.taken.messages.is_empty() {
                    break;
                }
                let (relayed, confirmed) = self.finish(round, true).await?;
                unmarked.lock().expect("no lane panics holding it")[lane] = confirmed;
                if relayed.sent + relayed.lost == 0 {
                    break;
                }
                moved += relayed.sent + relayed.lost;
            }
            if let Some(Confirmed { ids, hold }) = slot(lane) {
                let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                self.mark_sent(&ids, &hold).await?;
            }
            Ok(moved)
        };
        unmarked
            .lock()
            .expect("no lane panics holding it")
            .resize_with(self.rounds_in_flight, || None);
        let lanes = (0..self.rounds_in_flight)
            .map(|at| Box::pin(lane(at)))
            .collect();
        all(lanes).await
    }

    /// Marks the confirmed messages the lanes of a stopped [`run`](Relay::run) left in
    /// `unmarked`.
    async fn mark_unmarked(&self, unmarked: &Unmarked) -> Result<(), Error> {
        let left: Vec<Confirmed> = std::mem::take(&mut *unmarked.lock().expect("no panics"))
            .into_iter()
            .flatten()
            .collect();
        for Confirmed { ids, hold } in left {
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            self.mark_sent(&ids, &hold).await?;
        }
        Ok(())
    }
}

/// Per lane of [`Relay::run`], its last round's confirmed messages, not marked yet.
type Unmarked = std::sync::Mutex<Vec<Option<Confirmed>>>;

/// The sum of `lanes`' counts, once every one ended; the first error at once (dropping the
/// others).
async fn all<F>(lanes: Vec<std::pin::Pin<Box<F>>>) -> Result<usize, Error>
where
    F: Future<Output = Result<usize, Error>>,
{
    use std::task::Poll;
    let mut lanes: Vec<Option<std::pin::Pin<Box<F>>>> = lanes.into_iter().map(Some).collect();
    let mut sum = 0;
    std::future::poll_fn(|cx| {
        for slot in &mut lanes {
            let Some(lane) = slot else { continue };
            if let Poll::Ready(done) = lane.as_mut().poll(cx) {
                *slot = None;
                sum += done?;
            }
        }
        match lanes.iter().all(Option::is_none) {
            true => Poll::Ready(Ok(sum)),
            false => Poll::Pending,
        }
    })
    .await
}

/// `work`'s output, or `None` if `stop` resolved first.
pub(super) async fn unless<T>(
    mut stop: std::pin::Pin<&mut impl Future<Output = ()>>,
    work: impl Future<Output = T>,
) -> Option<T> {
    use std::task::Poll;
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        if stop.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        work.as_mut().poll(cx).map(Some)
    })
    .await
}

/// Waits for the first of: a commit of the relay's own store, another store's announcement
/// (not `own`'s), `poll`. A listener whose connection failed is given up for this wait: the
/// poll ends it rather than a spin.
async fn wait(
    poll: Duration,
    commits: Option<&mut watch::Receiver<u64>>,
    listen: Option<&mut Listen>,
    own: &str,
) {
    let local = std::pin::pin!(async {
        let changed = match commits {
            Some(commits) => commits.changed().await.is_ok(),
            None => false,
        };
        if !changed {
            std::future::pending::<()>().await;
        }
    });
    let remote = std::pin::pin!(async {
        let heard = match listen {
            Some(listen) => listen.next(own).await.is_ok(),
            None => false,
        };
        if !heard {
            std::future::pending::<()>().await;
        }
    });
    unless(local, unless(remote, tokio::time::sleep(poll))).await;
}
