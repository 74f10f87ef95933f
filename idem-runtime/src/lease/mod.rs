//! Lease mode: for effects in someone else's system (a payment, an email), which cannot share
//! the marker's transaction. The marker is claimed `in_progress` for a lease measured on the
//! database's clock (`claim.rs`), the body runs outside any transaction under a timeout
//! shorter than the lease, and the marker completes only if this holder's fencing token is
//! still the current one.

mod claim;

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use claim::LeaseStore;
pub use claim::Leased;

use crate::claim::settle;
use crate::record::NotStorable;
use crate::{Error, Failed, Key, LeaseOptions, Outcome};

/// A lease-mode delivery's hold on its key: what the body gets as `lease: &idem::Lease`.
///
/// Pass [`idempotency_key`](Lease::idempotency_key) to the outside system (the
/// `Idempotency-Key` header of a payments API) and [`remaining`](Lease::remaining) as the
/// request's timeout: a redelivery after a crash sends the same key, and the provider does the
/// work once. Dropping a lease that was not finished (a panic, a cancelled future) releases
/// the key in the background when a tokio runtime is there, else it expires.
pub struct Lease {
    store: Arc<dyn LeaseStore>,
    scope: Cow<'static, str>,
    key: Key,
    idempotency_key: String,
    token: i64,
    attempt: u32,
    options: LeaseOptions,
    deadline: Mutex<Instant>,
    settled: bool,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("scope", &self.scope)
            .field("key", &self.key.as_str())
            .field("token", &self.token)
            .field("attempt", &self.attempt)
            .field("remaining", &self.remaining())
            .finish()
    }
}

impl Lease {
    pub(crate) fn new(
        store: Arc<dyn LeaseStore>,
        scope: Cow<'static, str>,
        key: Key,
        token: i64,
        attempts: i64,
        options: LeaseOptions,
        claimed_at: Instant,
    ) -> Lease {
        let idempotency_key = idempotency_key(&scope, &key);
        Lease {
            store,
            scope,
            key,
            idempotency_key,
            token,
            attempt: u32::try_from(attempts).unwrap_or(u32::MAX),
            options,
            // Measured from before the claim was sent, so never later than the database's
            // `locked_until`: the worker's clock is not involved, only its elapsed time.
            deadline: Mutex::new(claimed_at + options.lease),
            settled: false,
        }
    }

    /// The job's key, as stored in the marker.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// The scope of the handler.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The key to give the outside system as its `Idempotency-Key`: scope and key together
    /// (`14:billing.charge|7:order-7`, idem's tuple encoding), at most 255 bytes (longer ones
    /// become `sha256:` and the hex digest of that encoding). The same on every redelivery of
    /// the job, and different for every other `(scope, key)`.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }

    /// The fencing token: 1 for the first holder, one more for each takeover.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// Which delivery holds the key: 1 for the first, one more for each takeover after an
    /// expired lease or a failed attempt.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// When the lease runs out (conservatively: measured from before the claim was sent).
    pub fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the body has left: the smaller of the lease's time left and the body's timeout
    /// (`timeout`, from the claim or the last [`renew`](Lease::renew)). Give it to the
    /// outside call as its timeout, so that the call gives up before idem cuts the body off.
    pub fn remaining(&self) -> Duration {
        self.cutoff().saturating_duration_since(Instant::now())
    }

    /// When the body is cut off: the lease's deadline less the margin between lease and
    /// timeout.
    fn cutoff(&self) -> Instant {
        let margin = self.options.lease.saturating_sub(self.options.timeout);
        let deadline = self.deadline();
        deadline.checked_sub(margin).unwrap_or(deadline)
    }

    /// The lease's length.
    pub fn lease_len(&self) -> Duration {
        self.options.lease
    }

    /// Extends the lease by its full length from now (database clock), if this delivery still
    /// holds it; else [`Error::LeaseLost`].
    pub async fn renew(&self) -> Result<(), Error> {
        let sent = Instant::now();
        if self.store.renew(self).await? {
            *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = sent + self.options.lease;
            Ok(())
        } else {
            Err(self.lost())
        }
    }

    /// Runs the body under the lease's timeout.
    ///
    /// The limit is [`cutoff`](Lease::cutoff), so the body gets its full timeout again from
    /// each [`renew`](Lease::renew): a body that renews keeps running, one that does not is
    /// cut off while the lease still holds.
    pub(crate) async fn run<F: Future>(&self, body: F) -> Result<F::Output, Error> {
        let mut body = std::pin::pin!(body);
        loop {
            let limit = self.cutoff();
            match tokio::time::timeout_at(limit.into(), body.as_mut()).await {
                Ok(out) => return Ok(out),
                // Renewed while we waited: wait on, up to the new limit.
                Err(_) if self.cutoff() > limit => {}
                Err(_) => {
                    return Err(Error::Timeout {
                        scope: self.scope.to_string(),
                        key: self.key.as_str().to_owned(),
                        after: self.options.timeout,
                    });
                }
            }
        }
    }

    /// Ends the call. `Ok` completes the marker if this delivery still holds the key (else
    /// [`Error::LeaseLost`], and the value is not reported as applied), storing what
    /// `encode` makes of the value (`replay`). The outside call happened by then, so a
    /// value that cannot be stored still completes the marker, without it: later deliveries
    /// are duplicates, and this one gets [`Error::ValueNotStored`]. `Err` (the body's, or
    /// the timeout `result` holds) releases the key at once so that a redelivery may retry.
    pub(crate) async fn finish_with<T, E>(
        mut self,
        result: Result<Result<T, E>, Error>,
        encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
    ) -> Result<Outcome<T>, Failed<E>> {
        self.settled = true;
        let value = match result {
            Ok(Ok(value)) => value,
            Ok(Err(e)) => {
                drop(self.store.release(&self).await);
                return Err(Failed::Handler(e));
            }
            Err(e) => {
                drop(self.store.release(&self).await);
                return Err(Failed::Idem(e));
            }
        };
        let (json, not_stored) = match encode(&value) {
            Ok(json) => (json, None),
            Err(NotStorable(reason)) => (None, Some(reason)),
        };
        #[cfg(feature = "testing")]
        {
            let at = "completing statement";
            let injected = crate::testing::probe::before_commit(&self.scope, self.key(), at);
            if let Some(e) = injected.await {
                drop(self.store.release(&self).await);
                return Err(Failed::Idem(e));
            }
        }
        match self.store.complete(&self, json.as_deref()).await {
            Ok(true) => match not_stored {
                None => Ok(Outcome::Applied(value)),
                Some(reason) => Err(Failed::Idem(Error::ValueNotStored {
                    scope: self.scope.to_string(),
                    key: self.key.as_str().to_owned(),
                    reason,
                })),
            },
            Ok(false) => Err(Failed::Idem(self.lost())),
            // Not completed: give the key back now rather than at the lease's end, as for any
            // other failure (the release fails too if the database is gone, and then the lease
            // expires).
            Err(e) => {
                drop(self.store.release(&self).await);
                Err(Failed::Idem(e.into()))
            }
        }
    }

    /// [`finish`](Lease::finish) that also stores the `Ok` value with the marker (`replay`), in
    /// the completing statement.
    pub async fn finish_replay<T: serde::Serialize, E: From<Error>>(
        self,
        result: Result<T, E>,
    ) -> Result<Outcome<T>, E> {
        let end = self.finish_with(Ok(result), |v| crate::record::encode(v).map(Some));
        settle(end.await)
    }

    /// Ends a call by hand: completes on `Ok`, releases on `Err`.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Outcome<T>, E> {
        settle(self.finish_with(Ok(result), |_| Ok(None)).await)
    }

    fn lost(&self) -> Error {
        Error::LeaseLost {
            scope: self.scope.to_string(),
            key: self.key.as_str().to_owned(),
        }
    }

    pub(crate) fn parts(&self) -> (&str, &str, i64, i64) {
        (
            &self.scope,
            self.key.as_str(),
            self.token,
            self.options.lease_ms(),
        )
    }
}

#[cfg(feature = "testing")]
impl crate::testing::probe::Held for Lease {
    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn expire_now(&self) -> crate::BoxFuture<'_, Result<bool, sqlx::Error>> {
        self.store.release(self)
    }

    fn reset_deadline(&self, now: Instant) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = now + self.options.lease;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // A panic or a cancelled future: give the key back now if a runtime can run the
        // statement; otherwise the lease expires on its own.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let orphan = Lease {
                store: self.store.clone(),
                scope: std::mem::take(&mut self.scope),
                key: self.key.clone(),
                idempotency_key: String::new(),
                token: self.token,
                attempt: self.attempt,
                options: self.options,
                deadline: Mutex::new(self.deadline()),
                settled: true,
            };
            handle.spawn(async move {
                drop(orphan.store.release(&orphan).await);
            });
        }
    }
}

fn idempotency_key(scope: &str, key: &Key) -> String {
    // The scope was checked (non-empty, no NUL) before the claim and the key is valid, so the
    // pair always encodes; `job_id` builds the producer's id the same way.
    crate::job_id::bounded_encoding(&(scope, key.as_str()))
        .expect("a checked scope and a valid key always encode")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BoxFuture;

    struct Nowhere;

    impl LeaseStore for Nowhere {
        fn complete<'a>(
            &'a self,
            _: &'a Lease,
            _: Option<&'a str>,
        ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
            Box::pin(async { Ok(true) })
        }
        fn release<'a>(&'a self, _: &'a Lease) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
            Box::pin(async { Ok(true) })
        }
        fn renew<'a>(&'a self, _: &'a Lease) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
            Box::pin(async { Ok(true) })
        }
    }

    #[test]
    fn remaining_is_what_the_body_has_left() {
        let options = LeaseOptions::new(Duration::from_secs(30)).timeout(Duration::from_secs(10));
        let key = Key::new("k").unwrap();
        let claimed = Instant::now();
        let mut lease = Lease::new(Arc::new(Nowhere), "s".into(), key, 1, 1, options, claimed);
        lease.settled = true;
        let left = lease.remaining();
        let elapsed = claimed.elapsed();
        // The body's 10 s, not the lease's 30 s, less what has passed since the claim.
        assert!(left <= Duration::from_secs(10), "{left:?}");
        assert!(
            left + elapsed >= Duration::from_secs(10),
            "{left:?} {elapsed:?}"
        );
    }

    #[test]
    fn idempotency_keys_are_scoped_bounded_and_distinct() {
        let k = |s: &str| Key::new(s).unwrap();
        assert_eq!(
            idempotency_key("billing.charge", &k("order-7")),
            "14:billing.charge|7:order-7"
        );
        assert_ne!(
            idempotency_key("a|1:b", &k("c")),
            idempotency_key("a", &k("b|1:c"))
        );
        let long = idempotency_key("billing.charge", &k(&"x".repeat(255)));
        assert!(long.starts_with("sha256:") && long.len() == 71, "{long}");
        assert_ne!(
            long,
            idempotency_key("billing.charge", &k(&"y".repeat(255)))
        );
        assert_eq!(
            long,
            idempotency_key("billing.charge", &k(&"x".repeat(255)))
        );
    }
}
