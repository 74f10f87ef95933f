//! The claim core, under every mode: what a claim asks, what a marker it meets means (the
//! decision, written once), how a claim begins, retries and waits ([`run`]), and how a fresh
//! claim ends ([`Held`]). The modes are thin layers over it.

mod held;
pub(crate) mod nested;
pub(crate) mod run;

use std::borrow::Cow;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

pub use held::Held;

use crate::backend::{Claimant, Found, Hold};
use crate::observe::Decision;
use crate::{ClaimOptions, Error, Failed, Fingerprint, Key, Outcome, Recorded};

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

/// The answer to a claim, in every mode: `H` is what holds a fresh claim (a transaction of
/// the call's own, a savepoint of the caller's, a lease).
#[derive(Debug)]
#[must_use = "a fresh claim holds the key: run the body and finish it"]
pub enum Claimed<H> {
    /// This delivery holds the key: run the body, then finish.
    Fresh(H),
    /// An earlier delivery completed this key; nothing is held.
    Duplicate,
    /// An earlier delivery completed this key and stored its value (`replay`): read it with
    /// [`Recorded::decode`].
    Replayed(Recorded),
}

impl<H> Claimed<H> {
    pub(crate) fn map<G>(self, f: impl FnOnce(H) -> G) -> Claimed<G> {
        match self {
            Claimed::Fresh(h) => Claimed::Fresh(f(h)),
            Claimed::Duplicate => Claimed::Duplicate,
            Claimed::Replayed(r) => Claimed::Replayed(r),
        }
    }
}

/// One claim: the job's identity, the handler's options and this claim's nonce.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) scope: Cow<'static, str>,
    pub(crate) key: Key,
    pub(crate) options: ClaimOptions,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) nonce: i64,
}

impl Request {
    pub(crate) fn new(
        scope: Cow<'static, str>,
        key: Key,
        options: ClaimOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Request {
        Request {
            scope,
            key,
            options,
            fingerprint,
            nonce: nonce(),
        }
    }

    pub(crate) fn claimant(&self) -> Claimant<'_> {
        Claimant {
            scope: &self.scope,
            key: self.key.as_str(),
            fingerprint: self.fingerprint.as_ref().map(|f| &f.as_bytes()[..]),
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
pub(crate) enum Decided {
    /// Completed by an earlier delivery: a duplicate, replayed if asked and stored.
    Done(Claimed<()>),
    /// A released or expired lease: this claim takes it over.
    TakeOver,
}

/// The decision every mode makes about a marker it meets: a payload other than the marker's
/// is [`Error::KeyReused`] whatever the marker's state; a completed marker is a duplicate
/// (replayed with `replay` and a stored value); a live lease of another delivery is
/// [`Error::InProgress`], never a duplicate (its job may still fail); a free lease is taken
/// over.
pub(crate) fn decide(found: Found, request: &Request) -> Result<Decided, Error> {
    let Found { hold, recorded } = found;
    recorded.check(
        request.fingerprint.as_ref(),
        &request.scope,
        request.key.as_str(),
    )?;
    match hold {
        Hold::Completed => Ok(Decided::Done(match recorded.result {
            Some(_) if request.options.replay => Claimed::Replayed(recorded),
            _ => Claimed::Duplicate,
        })),
        Hold::Live => Err(request.in_progress()),
        Hold::Free => Ok(Decided::TakeOver),
    }
}

/// What a claim's answer was, for its event and span.
pub(crate) fn decision<H>(claimed: &Result<Claimed<H>, Error>, took_over: bool) -> Decision {
    match claimed {
        Ok(Claimed::Fresh(_)) if took_over => Decision::Takeover,
        Ok(Claimed::Fresh(_)) => Decision::Fresh,
        Ok(Claimed::Duplicate) => Decision::Duplicate,
        Ok(Claimed::Replayed(_)) => Decision::Replayed,
        Err(Error::InProgress { .. }) => Decision::InProgress,
        Err(_) => Decision::Failed,
    }
}

/// The one place where a call's [`Error`] becomes the handler's error type.
pub(crate) fn settle<T, E: From<Error>>(
    result: Result<Outcome<T>, Failed<E>>,
) -> Result<Outcome<T>, E> {
    #[cfg(feature = "testing")]
    crate::testing::probe::settled(&result);
    result.map_err(Failed::into_handler_error)
}

/// A claim's own id: negative (lease tokens count up from 1) and, with 63 random bits, distinct
/// from every other claim of the same key.
fn nonce() -> i64 {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let bits = RandomState::new().hash_one(COUNT.fetch_add(1, Ordering::Relaxed));
    -((bits >> 1) as i64) - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_are_negative_and_distinct() {
        let nonces: std::collections::HashSet<i64> = (0..10_000).map(|_| nonce()).collect();
        assert_eq!(nonces.len(), 10_000);
        assert!(nonces.iter().all(|n| *n < 0));
    }

    fn found(hold: Hold, fingerprint: Option<&Fingerprint>, result: Option<&str>) -> Found {
        Found {
            hold,
            recorded: Recorded {
                fingerprint: fingerprint.map(|f| f.as_bytes().to_vec()),
                result: result.map(str::to_owned),
            },
        }
    }

    #[test]
    fn only_a_completed_marker_is_a_duplicate() {
        let key = Key::new("k").unwrap();
        let plain = Request::new("s".into(), key.clone(), ClaimOptions::new(), None);
        let replay = Request::new("s".into(), key, ClaimOptions::new().replay(), None);
        let done = |r: &Request, hold, result| decide(found(hold, None, result), r);
        assert!(matches!(
            done(&plain, Hold::Completed, Some("1")),
            Ok(Decided::Done(Claimed::Duplicate))
        ));
        assert!(matches!(
            done(&replay, Hold::Completed, Some("1")),
            Ok(Decided::Done(Claimed::Replayed(_)))
        ));
        assert!(matches!(
            done(&replay, Hold::Completed, None),
            Ok(Decided::Done(Claimed::Duplicate))
        ));
        assert!(matches!(
            done(&plain, Hold::Live, None),
            Err(Error::InProgress { .. })
        ));
        assert!(matches!(
            done(&plain, Hold::Free, None),
            Ok(Decided::TakeOver)
        ));
    }

    #[test]
    fn another_payload_is_refused_whatever_the_state() {
        let ours = Fingerprint::of(&1).unwrap();
        let theirs = Fingerprint::of(&2).unwrap();
        let key = Key::new("k").unwrap();
        let request = Request::new("s".into(), key, ClaimOptions::new(), Some(ours));
        for hold in [Hold::Completed, Hold::Live, Hold::Free] {
            let got = decide(found(hold, Some(&theirs), None), &request);
            assert!(matches!(got, Err(Error::KeyReused { .. })), "{hold:?}");
            assert!(decide(found(hold, Some(&ours), None), &request).is_ok() || hold == Hold::Live);
        }
    }
}
