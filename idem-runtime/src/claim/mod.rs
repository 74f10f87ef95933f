//! The claim core, under every mode, the HTTP layer and hand-written code.
//!
//! - A claim asks with a [`Request`]: its scope and key, its options (wait, isolation, replay,
//!   fingerprint), its nonce, and how it is observed (its scope's metric labels, the name of
//!   the caller for a refused nested call).
//! - It is made by one entry per way of holding a key ([`run`]: a transaction of its own, a
//!   savepoint of the caller's, a batch; lease mode's in `lease`), all sharing the same
//!   start (the span, the nested-call check), the same bounded retry of a lost race, and the
//!   same decision about a marker it meets ([`decide`]).
//! - A fresh claim is held by a [`Ticket`] (what every holder carries: the request, the
//!   observation, the outbox) and the mode's [`Hold`] (a transaction, a savepoint, a lease),
//!   and ends in one place ([`finish`]): the value stored for `replay`, the outbox written, the
//!   verified commit (or the savepoint's release, or the lease's fenced completion), the span
//!   and metrics recorded. Its body runs marked as inside its transaction ([`nested::Body`]),
//!   so that a claim with a store in it is refused.

mod held;
pub(crate) mod nested;
pub(crate) mod run;

use std::borrow::Cow;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

pub use held::TxHeld;
pub(crate) use held::held_calls;
pub(crate) use held::{
    Ending, Hold, Kept, Ticket, end, finish, finish_failed, rolled_back, write_ending,
};

use crate::backend::{Claimant, Found, Status};
use crate::error::Error;
use crate::key::Key;
use crate::observe::Site;
use crate::observe::semconv::About;
use crate::options::ClaimOptions;
use crate::outcome::Failure;
use crate::record::Recorded;

/// How often a claim that lost a race to a transient error (a serialization failure or a
/// deadlock between waiters) is tried again before the error is returned. InnoDB can pick a
/// waiter as deadlock victim each time a holder of the key rolls back, so a waiter behind
/// several failing deliveries may lose a few rounds in a row: every round is decided, so the
/// bound only stops a livelock, and 16 covers the conformance suite's 8 failing holders
/// with 31 waiters.
pub(crate) const CLAIM_ATTEMPTS: u32 = 16;

/// How often a claim that found its marker changing under it (forgotten, taken over by another
/// delivery between two statements) asks again before it answers `InProgress`.
pub(crate) const RECHECKS: u32 = 3;

/// The answer to a claim, in every mode: `H` is what holds a fresh claim (a [`Guard`], a
/// [`JoinedGuard`], a [`Lease`], the HTTP layer's claimed transaction).
///
/// [`Guard`]: crate::Guard
/// [`JoinedGuard`]: crate::JoinedGuard
/// [`Lease`]: crate::Lease
#[derive(Debug)]
#[must_use = "a fresh claim holds the key: run the body and finish it"]
pub enum Claimed<H> {
    /// This delivery holds the key: run the body, then `finish` (or `release`).
    Fresh(H),
    /// An earlier delivery completed this key; nothing is held.
    Duplicate,
    /// An earlier delivery completed this key and stored its value (`replay`): read it with
    /// [`Recorded::decode`].
    Replayed(Recorded),
    /// An earlier delivery failed this job for good ([`Lease::permanent`](crate::Lease::permanent)):
    /// nothing is held; ack the job, it is never retried.
    Failed(Failure),
}

impl<H> Claimed<H> {
    pub(crate) fn map<G>(self, f: impl FnOnce(H) -> G) -> Claimed<G> {
        match self {
            Claimed::Fresh(h) => Claimed::Fresh(f(h)),
            Claimed::Duplicate => Claimed::Duplicate,
            Claimed::Replayed(r) => Claimed::Replayed(r),
            Claimed::Failed(f) => Claimed::Failed(f),
        }
    }
}

/// One claim: the job's identity, the options, this claim's nonce, and how it is observed.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) scope: Cow<'static, str>,
    pub(crate) key: Key,
    pub(crate) options: ClaimOptions,
    pub(crate) nonce: i64,
    /// The labels of the scope's metrics.
    pub(crate) site: &'static Site,
    /// Who claims, as a refused nested call names it (`Store::claim`, a handler's name).
    pub(crate) caller: Cow<'static, str>,
    /// What the call serves, for OpenTelemetry's attributes (else the scope's, if named).
    pub(crate) about: Option<About>,
}

impl Request {
    /// A request of `caller` (a hand-written claim: `Store::claim`, ...), labelled by its
    /// scope.
    pub(crate) fn new(
        scope: Cow<'static, str>,
        key: Key,
        options: ClaimOptions,
        caller: &'static str,
    ) -> Request {
        let site = Site::of(&scope);
        Request::of(scope, key, options, site, Cow::Borrowed(caller))
    }

    /// A request whose labels are known (a handler's, built at compile time; a layer's).
    pub(crate) fn of(
        scope: Cow<'static, str>,
        key: Key,
        options: ClaimOptions,
        site: &'static Site,
        caller: Cow<'static, str>,
    ) -> Request {
        Request {
            scope,
            key,
            about: options.messaging.map(About::Message),
            options,
            nonce: nonce(),
            site,
            caller,
        }
    }

    pub(crate) fn claimant(&self) -> Claimant<'_> {
        Claimant {
            scope: &self.scope,
            key: self.key.as_str(),
            fingerprint: self.options.fingerprint.as_ref().map(|f| &f.as_bytes()[..]),
            nonce: self.nonce,
            wait: self.options.wait,
        }
    }

    pub(crate) fn in_progress(&self) -> Error {
        Error::InProgress {
            scope: self.scope.to_string(),
            key: self.key.as_str().to_owned(),
        }
    }
}

/// What a marker that a claim could not insert means for it.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Completed by an earlier delivery: a duplicate, replayed if asked and stored.
    Done(Claimed<()>),
    /// A released or expired lease: this claim takes it over.
    TakeOver,
}

/// The decision every mode makes about a marker it meets: a payload other than the marker's
/// is [`Error::KeyReused`] whatever the marker's state; a completed marker is a duplicate
/// (replayed with `replay` and a stored value), or a failure if it recorded one; a live lease of another delivery is
/// [`Error::InProgress`], never a duplicate (its job may still fail); a free lease is taken
/// over.
pub(crate) fn decide(found: Found, request: &Request) -> Result<Decision, Error> {
    let Found { status, recorded } = found;
    recorded.check(
        request.options.fingerprint.as_ref(),
        &request.scope,
        request.key.as_str(),
    )?;
    match status {
        Status::Completed => Ok(Decision::Done(match (&recorded.error, &recorded.result) {
            // Failed for good: what every mode answers, `replay` or not.
            (Some(error), _) => Claimed::Failed(Failure::new(error.clone())),
            (None, Some(_)) if request.options.replay => Claimed::Replayed(recorded),
            (None, _) => Claimed::Duplicate,
        })),
        Status::Leased => Err(request.in_progress()),
        Status::Free => Ok(Decision::TakeOver),
    }
}

/// A claim's own id: negative (lease tokens are positive) and, with 63 random bits, distinct
/// from every other claim of the same key.
fn nonce() -> i64 {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let bits = RandomState::new().hash_one(COUNT.fetch_add(1, Ordering::Relaxed));
    -((bits >> 1) as i64) - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Fingerprint;

    #[test]
    fn nonces_are_negative_and_distinct() {
        let nonces: std::collections::HashSet<i64> = (0..10_000).map(|_| nonce()).collect();
        assert_eq!(nonces.len(), 10_000);
        assert!(nonces.iter().all(|n| *n < 0));
    }

    fn found(status: Status, fingerprint: Option<&Fingerprint>, result: Option<&str>) -> Found {
        Found {
            status,
            recorded: Recorded {
                fingerprint: fingerprint.map(|f| f.as_bytes().to_vec()),
                result: result.map(str::to_owned),
                error: None,
            },
        }
    }

    fn request(options: ClaimOptions) -> Request {
        Request::new("s".into(), Key::new("k").unwrap(), options, "Store::claim")
    }

    #[test]
    fn only_a_completed_marker_is_a_duplicate() {
        let plain = request(ClaimOptions::new());
        let replay = request(ClaimOptions::new().replay());
        let done = |r: &Request, status, result| decide(found(status, None, result), r);
        assert!(matches!(
            done(&plain, Status::Completed, Some("1")),
            Ok(Decision::Done(Claimed::Duplicate))
        ));
        assert!(matches!(
            done(&replay, Status::Completed, Some("1")),
            Ok(Decision::Done(Claimed::Replayed(_)))
        ));
        assert!(matches!(
            done(&replay, Status::Completed, None),
            Ok(Decision::Done(Claimed::Duplicate))
        ));
        assert!(matches!(
            done(&plain, Status::Leased, None),
            Err(Error::InProgress { .. })
        ));
        assert!(matches!(
            done(&plain, Status::Free, None),
            Ok(Decision::TakeOver)
        ));
    }

    #[test]
    fn another_payload_is_refused_whatever_the_state() {
        let ours = Fingerprint::of(&1).unwrap();
        let theirs = Fingerprint::of(&2).unwrap();
        let request = request(ClaimOptions::new().fingerprint(ours));
        for status in [Status::Completed, Status::Leased, Status::Free] {
            let got = decide(found(status, Some(&theirs), None), &request);
            assert!(matches!(got, Err(Error::KeyReused { .. })), "{status:?}");
            let same = decide(found(status, Some(&ours), None), &request);
            assert!(same.is_ok() || status == Status::Leased);
        }
    }
}
