//! The hooks the runtime calls when the `testing` feature is on, and the task-local that tells
//! them what the kit wants of the delivery being polled.
//!
//! Outside a kit's delivery no probe is set and every hook returns at once: a handler under
//! test runs exactly the code it runs in production, with the kit's faults added only where
//! it asked for them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::error::{Error, LeaseError, NotKept};
pub(crate) use crate::options::Mode;
use crate::outcome::{Failed, Outcome};

tokio::task_local! {
    static PROBE: Arc<Probe>;
}

/// What the kit does to one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Nothing: the delivery runs as in production.
    None,
    /// Fail the delivery right before its commit (transaction mode) or its completing
    /// statement (lease mode): roll back or release instead, and return [`NotKept::Injected`].
    BeforeCommit,
    /// Lease mode: right after the claim, expire the lease in the database, then wait until the
    /// kit lets the delivery go on.
    ExpireAfterClaim,
    /// Lease mode: crash the delivery right after its `n`-th step (run or read back): nothing
    /// after it runs or is kept, and the lease is left to the kit.
    CrashAfterStep(u32),
}

/// The kind of idem error a delivery ended with, read before it became the handler's `E`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ended {
    Ok,
    InProgress,
    LeaseLost,
    Injected,
    /// Another error of idem's.
    Idem,
    /// The body's own error.
    Handler,
}

/// What the runtime reported about one delivery.
#[derive(Debug, Clone, Default)]
pub(crate) struct Seen {
    pub(crate) mode: Option<Mode>,
    /// Lease mode: the claim's attempt.
    pub(crate) attempt: Option<u32>,
    pub(crate) injected: bool,
    pub(crate) ended: Option<Ended>,
    /// The message of idem's error, if the call ended with one.
    pub(crate) idem_error: Option<String>,
    /// Lease mode: the steps the delivery ended, in order, each with whether it ran (or was
    /// read back).
    pub(crate) steps: Vec<(String, bool)>,
    /// Lease mode: the delivery was crashed after a step.
    pub(crate) crashed: bool,
}

/// Where a paused delivery is (case `expire_lease`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pause {
    Running,
    /// Its lease is expired in the database and it waits.
    Paused,
    Resumed,
}

/// How long a delivery waits at its commit for the others of its race before the kit fails
/// the case (instead of hanging).
const RACE_LIMIT: Duration = Duration::from_secs(60);

/// Deliveries that must all have started their claims before any of them commits.
#[derive(Debug)]
pub(crate) struct Race {
    total: usize,
    arrived: watch::Sender<usize>,
}

impl Race {
    pub(crate) fn new(total: usize) -> Arc<Race> {
        Arc::new(Race {
            total,
            arrived: watch::Sender::new(0),
        })
    }

    async fn all_arrived(&self) {
        let mut rx = self.arrived.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        drop(rx.wait_for(|n| *n >= self.total).await);
    }
}

/// One delivery's link between the kit and the runtime.
#[derive(Debug)]
pub(crate) struct Probe {
    fault: Fault,
    race: Option<Arc<Race>>,
    arrived: AtomicBool,
    seen: Mutex<Seen>,
    pause: watch::Sender<Pause>,
}

impl Probe {
    pub(crate) fn new(fault: Fault, race: Option<Arc<Race>>) -> Arc<Probe> {
        Arc::new(Probe {
            fault,
            race,
            arrived: AtomicBool::new(false),
            seen: Mutex::new(Seen::default()),
            pause: watch::Sender::new(Pause::Running),
        })
    }

    /// Runs `delivery` with this probe visible to the runtime's hooks; counts it as arrived
    /// at the race when it ends, so that a delivery that never claims cannot hold the others
    /// up.
    pub(crate) async fn run<F: Future>(self: &Arc<Self>, delivery: F) -> F::Output {
        let out = PROBE.scope(self.clone(), delivery).await;
        self.arrive();
        out
    }

    pub(crate) fn seen(&self) -> Seen {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until the delivery is paused after its claim (its lease expired).
    pub(crate) async fn paused(&self) {
        let mut rx = self.pause.subscribe();
        drop(rx.wait_for(|p| *p == Pause::Paused).await);
    }

    /// Lets a paused delivery go on.
    pub(crate) fn resume(&self) {
        self.pause.send_replace(Pause::Resumed);
    }

    fn arrive(&self) {
        if !self.arrived.swap(true, Ordering::SeqCst)
            && let Some(race) = &self.race
        {
            race.arrived.send_modify(|n| *n += 1);
        }
    }

    fn note(&self, f: impl FnOnce(&mut Seen)) {
        f(&mut self.seen.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

fn current() -> Option<Arc<Probe>> {
    PROBE.try_with(Arc::clone).ok()
}

/// A delivery is about to claim. In transaction mode it counts as in flight for a race from
/// here, before any statement: its claim may wait on the holder's transaction (PostgreSQL's
/// row lock, SQLite's write lock), which the holder keeps open until every delivery arrived.
/// A group's member too, before it waits for its lane's turn: the deliveries of one key share
/// a lane, whose turn the holder keeps until it is kept.
pub(crate) fn claiming(mode: Mode) {
    if let Some(probe) = current() {
        probe.note(|s| s.mode = Some(mode));
        if matches!(mode, Mode::Transaction | Mode::Group) {
            probe.arrive();
        }
    }
}

/// Lease mode: the claim statement answered. A lease claim never waits on the holder, so a
/// racing delivery counts as arrived only now, and the holder, which completes only once all
/// arrived, was certainly still holding its lease when each of them asked.
pub(crate) fn lease_answered() {
    if let Some(probe) = current() {
        probe.arrive();
    }
}

/// Lease mode: the claim took the key. Under [`Fault::ExpireAfterClaim`] the lease is expired
/// in the database (as if this holder had stalled past it) and the delivery waits for the
/// kit; when it goes on, its own clock gets a full lease again, so that its body runs as a
/// holder that believes its lease still holds (a paused process, a jumped clock) would run it.
pub(crate) async fn lease_taken(lease: &dyn Held) -> Result<(), Error> {
    let Some(probe) = current() else {
        return Ok(());
    };
    probe.note(|s| s.attempt = Some(lease.attempt()));
    if probe.fault != Fault::ExpireAfterClaim {
        return Ok(());
    }
    lease.expire_now().await?;
    let mut rx = probe.pause.subscribe();
    probe.pause.send_replace(Pause::Paused);
    drop(rx.wait_for(|p| *p == Pause::Resumed).await);
    lease.reset_deadline(Instant::now());
    Ok(())
}

/// What the hooks need of a lease that a delivery holds, so that they know no mode.
pub(crate) trait Held: Sync {
    /// Which delivery holds the key (1 for the first).
    fn attempt(&self) -> u32;
    /// Expires the lease in the database now, as if its holder had stalled past it.
    fn expire_now(&self) -> crate::future::BoxFuture<'_, Result<bool, sqlx::Error>>;
    /// Gives the holder's clock a full lease from `now` (not the database's).
    fn reset_deadline(&self, now: Instant);
}

/// Right before a commit (or a savepoint's release, or a lease's completing statement): waits
/// until every delivery of a race has started its claim, then injects the kit's fault if it
/// asked for one. `Some(error)` means: do not commit, undo, and return it.
pub(crate) async fn before_commit(scope: &str, key: &str, at: &'static str) -> Option<Error> {
    let probe = current()?;
    if let Some(race) = &probe.race
        && tokio::time::timeout(RACE_LIMIT, race.all_arrived())
            .await
            .is_err()
    {
        let arrived = *race.arrived.borrow();
        panic!(
            "idem::testing: a delivery of {key:?} waited {RACE_LIMIT:?} at its commit for the \
             other deliveries of the race to start their claims, and only {arrived} of {} did: \
             something makes them wait for this one before they claim (a lock the handler \
             takes before its claim, a pool too small for the deliveries at once)",
            race.total
        );
    }
    if probe.fault != Fault::BeforeCommit {
        return None;
    }
    probe.note(|s| s.injected = true);
    Some(Error::NotKept(NotKept::Injected {
        scope: scope.to_owned(),
        key: key.to_owned(),
        at,
    }))
}

/// Lease mode: a step ended with its value, run now (`ran`) or read back. Under
/// [`Fault::CrashAfterStep`] at this step's place, `Some(error)`: the delivery crashes here.
pub(crate) async fn step_done(scope: &str, key: &str, name: &str, ran: bool) -> Option<Error> {
    let probe = current()?;
    let mut place = 0;
    probe.note(|s| {
        s.steps.push((name.to_owned(), ran));
        place = s.steps.len();
    });
    let Fault::CrashAfterStep(n) = probe.fault else {
        return None;
    };
    if usize::try_from(n).ok() != Some(place) {
        return None;
    }
    probe.note(|s| s.crashed = true);
    Some(Error::crashed(scope, key))
}

/// The end of a call (every path's: the attribute's, a guard's, the HTTP layer's), before
/// idem's error becomes the handler's `E`.
pub(crate) fn settled<T, E>(result: &Result<Outcome<T>, Failed<E>>) {
    match result {
        Ok(_) => note(Ended::Ok, None),
        Err(Failed::Handler(_)) => note(Ended::Handler, None),
        Err(Failed::Idem(e)) => refused(e),
    }
}

/// A call that ended with idem's `error`, whether its claim was refused or its end failed.
pub(crate) fn refused(error: &Error) {
    let ended = match error {
        Error::InProgress { .. } => Ended::InProgress,
        Error::Lease(LeaseError::Lost { .. }) => Ended::LeaseLost,
        Error::NotKept(NotKept::Injected { .. }) => Ended::Injected,
        _ => Ended::Idem,
    };
    note(ended, Some(error.to_string()));
}

fn note(ended: Ended, message: Option<String>) {
    let Some(probe) = current() else {
        return;
    };
    probe.note(|s| {
        s.ended = Some(ended);
        s.idem_error = message;
    });
}

#[cfg(test)]
mod tests {
    use std::pin::pin;
    use std::task::Poll;

    use super::*;

    async fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        let mut fut = fut;
        std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await
    }

    /// A delivery that claims and gets to its commit.
    async fn claim_and_commit() -> Option<Error> {
        claiming(Mode::Transaction);
        before_commit("scope", "key", "commit").await
    }

    #[tokio::test]
    async fn the_holder_waits_at_its_commit_until_every_racer_started_its_claim() {
        let race = Race::new(3);
        let holder = Probe::new(Fault::None, Some(race.clone()));
        let mut committing = pin!(holder.run(claim_and_commit()));
        assert!(poll_once(committing.as_mut()).await.is_pending());
        let claimer = Probe::new(Fault::None, Some(race.clone()));
        claimer.run(async { claiming(Mode::Transaction) }).await;
        assert!(poll_once(committing.as_mut()).await.is_pending());
        // A delivery that ends without claiming counts too, or the holder would wait forever.
        let quitter = Probe::new(Fault::None, Some(race));
        quitter.run(async {}).await;
        assert!(matches!(poll_once(committing).await, Poll::Ready(None)));
        assert_eq!(holder.seen().mode, Some(Mode::Transaction));
        assert_eq!(quitter.seen().mode, None);
    }

    #[tokio::test]
    async fn only_the_delivery_asked_for_gets_the_injected_failure() {
        let failing = Probe::new(Fault::BeforeCommit, None);
        let injected = failing.run(claim_and_commit()).await;
        assert!(
            matches!(&injected, Some(Error::NotKept(NotKept::Injected { scope, key, at: "commit" }))
                if scope == "scope" && key == "key"),
            "{injected:?}"
        );
        assert!(failing.seen().injected);
        let healthy = Probe::new(Fault::None, None);
        assert!(healthy.run(claim_and_commit()).await.is_none());
        // Outside the kit: no probe, nothing injected, nothing waited for.
        assert!(claim_and_commit().await.is_none());
    }
}
