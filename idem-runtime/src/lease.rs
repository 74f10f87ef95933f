//! Lease mode: for effects in someone else's system (a payment, an email), which cannot share
//! the marker's transaction. The marker is claimed `in_progress` for a lease measured on the
//! database's clock, the body runs outside any transaction under a timeout shorter than the
//! lease, and the marker completes only if this holder's fencing token is still the current
//! one.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{Backend, LeaseOp};
use crate::observe;
use crate::{Error, Fingerprint, Key, Recorded, Store};

/// How often a claim that found its marker gone between two statements (forgotten or purged
/// by an operator) asks again.
const LEASE_CLAIM_ATTEMPTS: u32 = 3;

/// How long a lease-mode delivery holds its key, and how long its body may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseOptions {
    pub(crate) lease: Duration,
    pub(crate) timeout: Duration,
    pub(crate) replay: bool,
}

impl LeaseOptions {
    /// A lease of `lease`, with the body's timeout [`default_timeout`](Self::default_timeout).
    pub const fn new(lease: Duration) -> Self {
        LeaseOptions {
            lease,
            timeout: Self::default_timeout(lease),
            replay: false,
        }
    }

    /// A delivery that finds the key completed gets the first delivery's stored value back
    /// (`replay`).
    pub const fn replay(mut self) -> Self {
        self.replay = true;
        self
    }

    /// The timeout when none is given: the lease minus a safety margin of a fifth of it, at
    /// most 5 s, which leaves the completing statement time to reach the database before any
    /// other delivery may take the key over.
    pub const fn default_timeout(lease: Duration) -> Duration {
        let fifth = lease.as_millis() / 5;
        let margin = if fifth < 5_000 { fifth } else { 5_000 };
        Duration::from_millis((lease.as_millis() - margin) as u64)
    }

    /// The body's timeout. It must be shorter than the lease (the attribute checks it at
    /// compile time; here a longer one is cut to the default).
    pub const fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = if timeout.as_nanos() < self.lease.as_nanos() {
            timeout
        } else {
            Self::default_timeout(self.lease)
        };
        self
    }

    /// The lease.
    pub const fn lease_len(&self) -> Duration {
        self.lease
    }

    /// The body's timeout.
    pub const fn timeout_len(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX)
    }
}

/// What a lease-mode claim found.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub enum LeaseState {
    /// This delivery holds the key now: fresh, or taken over from an expired holder.
    Taken { token: i64, attempts: i64 },
    /// The job completed earlier.
    Completed(Recorded),
    /// Another delivery holds a live lease.
    Held(Recorded),
    /// No marker (forgotten or purged between two statements): claim again.
    Missing,
}

/// The answer to [`Store::lease`].
#[derive(Debug)]
#[must_use = "a fresh lease holds the key: run the body and call `Lease::finish`"]
pub enum Leased {
    /// This delivery holds the key: run the body, then [`Lease::finish`].
    Fresh(Lease),
    /// An earlier delivery completed this key; nothing is held.
    Duplicate,
    /// An earlier delivery completed this key and stored its value (`replay`).
    Replayed(Recorded),
}

impl<DB: Backend> Store<DB> {
    /// Lease mode by hand: claims `(scope, key)` for `options`' lease, outside any
    /// transaction.
    ///
    /// A completed marker is [`Leased::Duplicate`]; a live lease of another delivery is
    /// [`Error::InProgress`] at once (nack the job); an expired one is taken over by exactly
    /// one delivery (token + 1, attempts + 1). This is what `#[idempotent(lease = "...")]`
    /// expands to.
    pub async fn lease(
        &self,
        scope: &str,
        key: &Key,
        options: LeaseOptions,
    ) -> Result<Leased, Error> {
        crate::store::check_scope(scope)?;
        self.lease_owned(Cow::Owned(scope.to_owned()), key.clone(), options, None)
            .await
    }

    /// [`lease`](Store::lease) that stores the payload's fingerprint with the marker, and
    /// refuses a delivery of the key with another one ([`Error::KeyReused`]), whether the
    /// marker is completed or still held.
    pub async fn lease_checked(
        &self,
        scope: &str,
        key: &Key,
        options: LeaseOptions,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Leased, Error> {
        crate::store::check_scope(scope)?;
        let owned = Cow::Owned(scope.to_owned());
        self.lease_owned(owned, key.clone(), options, fingerprint.copied())
            .await
    }

    pub(crate) async fn lease_owned(
        &self,
        scope: Cow<'static, str>,
        key: Key,
        options: LeaseOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Leased, Error> {
        let started = Instant::now();
        let leased = self.lease_attempts(scope, key, options, fingerprint).await;
        observe::decided(started, observe::Decision::of_lease(&leased));
        if let Ok(Leased::Fresh(lease)) = &leased
            && lease.token() > 1
        {
            observe::took_over(lease.token(), lease.attempt());
        }
        leased
    }

    async fn lease_attempts(
        &self,
        scope: Cow<'static, str>,
        key: Key,
        options: LeaseOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Leased, Error> {
        let print = fingerprint.as_ref().map(|f| &f.as_bytes()[..]);
        #[cfg(feature = "testing")]
        crate::testing::probe::claiming(crate::testing::probe::Mode::Lease);
        for _ in 0..LEASE_CLAIM_ATTEMPTS {
            let sent = Instant::now();
            let state = DB::lease_claim(
                self.pool(),
                self.sql(),
                &scope,
                key.as_str(),
                options.lease_ms(),
                print,
            )
            .await;
            observe::attempted(sent);
            let state = state?;
            #[cfg(feature = "testing")]
            crate::testing::probe::lease_answered();
            match state {
                LeaseState::Taken { token, attempts } => {
                    let store = Arc::new(self.clone());
                    let lease = Lease::new(store, scope, key, token, attempts, options, sent);
                    #[cfg(feature = "testing")]
                    crate::testing::probe::lease_taken(&lease).await?;
                    return Ok(Leased::Fresh(lease));
                }
                LeaseState::Completed(recorded) => {
                    recorded.check(fingerprint.as_ref(), &scope, key.as_str())?;
                    return Ok(match recorded.result {
                        Some(_) if options.replay => Leased::Replayed(recorded),
                        _ => Leased::Duplicate,
                    });
                }
                LeaseState::Held(recorded) => {
                    recorded.check(fingerprint.as_ref(), &scope, key.as_str())?;
                    break;
                }
                LeaseState::Missing => {}
            }
        }
        Err(Error::InProgress {
            scope: scope.into_owned(),
            key: key.as_str().to_owned(),
        })
    }

    async fn lease_update(
        &self,
        lease: &Lease,
        op: LeaseOp,
        result: Option<&str>,
    ) -> Result<bool, sqlx::Error> {
        let (scope, key, token, lease_ms) = lease.parts();
        DB::lease_update(
            self.pool(),
            self.sql(),
            op,
            scope,
            key,
            token,
            lease_ms,
            result,
        )
        .await
    }
}

impl<DB: Backend> LeaseStore for Store<DB> {
    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        result: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(self.lease_update(lease, LeaseOp::Complete, result))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(self.lease_update(lease, LeaseOp::Release, None))
    }

    fn renew<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(self.lease_update(lease, LeaseOp::Renew, None))
    }
}

/// The statements a [`Lease`] runs after its claim, without knowing the database type.
pub(crate) trait LeaseStore: Send + Sync + 'static {
    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        result: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
    fn renew<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
}

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

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

    /// Time left on the lease: give it to the outside call as its timeout.
    pub fn remaining(&self) -> Duration {
        self.deadline().saturating_duration_since(Instant::now())
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
    #[doc(hidden)]
    ///
    /// The limit is the lease's deadline less the margin between lease and timeout, so the body
    /// gets its full timeout again from each [`renew`](Lease::renew): a body that renews keeps
    /// running, one that does not is cut off while the lease still holds.
    pub async fn run<F: Future>(&self, body: F) -> Result<F::Output, Error> {
        let margin = self.options.lease.saturating_sub(self.options.timeout);
        let mut body = std::pin::pin!(body);
        loop {
            let limit = self
                .deadline()
                .checked_sub(margin)
                .unwrap_or_else(Instant::now);
            match tokio::time::timeout_at(limit.into(), body.as_mut()).await {
                Ok(out) => return Ok(out),
                // Renewed while we waited: wait on, up to the new limit.
                Err(_)
                    if self
                        .deadline()
                        .checked_sub(margin)
                        .is_some_and(|l| l > limit) => {}
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

    /// Ends the call: `Ok` completes the marker if this delivery still holds the key (else
    /// [`Error::LeaseLost`], and the value is not reported as applied); `Err` releases the key
    /// at once so that a redelivery may retry.
    pub(crate) async fn end<T, E>(
        self,
        result: Result<Result<T, E>, Error>,
    ) -> Result<crate::Outcome<T>, crate::__private::Failed<E>> {
        self.end_recording(result, |_| Ok(None)).await
    }

    pub(crate) async fn end_replay<T: serde::Serialize, E>(
        self,
        result: Result<Result<T, E>, Error>,
    ) -> Result<crate::Outcome<T>, crate::__private::Failed<E>> {
        self.end_recording(result, |v| crate::replay::encode(v).map(Some))
            .await
    }

    pub(crate) async fn end_recording<T, E>(
        mut self,
        result: Result<Result<T, E>, Error>,
        encode: impl FnOnce(&T) -> Result<Option<String>, Error>,
    ) -> Result<crate::Outcome<T>, crate::__private::Failed<E>> {
        use crate::__private::Failed;
        self.settled = true;
        let result = match result {
            Ok(Ok(value)) => match encode(&value) {
                Ok(json) => Ok(Ok((value, json))),
                Err(e) => Err(e),
            },
            Ok(Err(e)) => Ok(Err(e)),
            Err(e) => Err(e),
        };
        #[cfg(feature = "testing")]
        if result.as_ref().is_ok_and(|r| r.is_ok()) {
            let at = "completing statement";
            let injected = crate::testing::probe::before_commit(&self.scope, self.key(), at);
            if let Some(e) = injected.await {
                drop(self.store.release(&self).await);
                return Err(Failed::Idem(e));
            }
        }
        match result {
            Ok(Ok((value, json))) => match self.store.complete(&self, json.as_deref()).await {
                Ok(true) => Ok(crate::Outcome::Applied(value)),
                Ok(false) => Err(Failed::Idem(self.lost())),
                // Not completed: give the key back now rather than at the lease's end, as for
                // any other failure (the release fails too if the database is gone, and then
                // the lease expires).
                Err(e) => {
                    drop(self.store.release(&self).await);
                    Err(Failed::Idem(Error::Database(e)))
                }
            },
            Ok(Err(e)) => {
                drop(self.store.release(&self).await);
                Err(Failed::Handler(e))
            }
            // The timeout, or a value that cannot be stored: nothing is completed.
            Err(e) => {
                drop(self.store.release(&self).await);
                Err(Failed::Idem(e))
            }
        }
    }

    /// [`finish`](Lease::finish) that also stores the `Ok` value with the marker (`replay`), in
    /// the completing statement.
    pub async fn finish_replay<T: serde::Serialize, E: From<Error>>(
        self,
        result: Result<T, E>,
    ) -> Result<crate::Outcome<T>, E> {
        crate::__private::settle(self.end_replay(Ok(result)).await)
    }

    /// Ends a call by hand: completes on `Ok`, releases on `Err`.
    pub async fn finish<T, E: From<Error>>(
        self,
        result: Result<T, E>,
    ) -> Result<crate::Outcome<T>, E> {
        crate::__private::settle(self.end(Ok(result)).await)
    }

    /// Expires this lease in the database now, as if its holder had stalled past it.
    #[cfg(feature = "testing")]
    pub(crate) async fn expire_now(&self) -> Result<bool, sqlx::Error> {
        self.store.release(self).await
    }

    /// Gives this holder's clock a full lease from `now` (not the database's).
    #[cfg(feature = "testing")]
    pub(crate) fn reset_deadline(&self, now: Instant) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = now + self.options.lease;
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

    #[test]
    fn default_timeout_leaves_a_margin() {
        assert_eq!(
            LeaseOptions::new(Duration::from_secs(30)).timeout_len(),
            Duration::from_secs(25)
        );
        assert_eq!(
            LeaseOptions::new(Duration::from_secs(2)).timeout_len(),
            Duration::from_millis(1600)
        );
        let opts = LeaseOptions::new(Duration::from_secs(30)).timeout(Duration::from_secs(10));
        assert_eq!(opts.timeout_len(), Duration::from_secs(10));
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
