//! Lease mode: for effects in someone else's system (a payment, an email), which cannot share
//! the marker's transaction. The marker is claimed `in_progress` for a lease measured on the
//! database's clock (`claim.rs`), the body runs outside any transaction under a timeout
//! shorter than the lease ([`Clock`]), and the marker completes only if this holder's fencing
//! token is still the current one, through the claim core's one finish.

mod claim;
mod class;
mod clock;
mod db_step;
mod keep_alive;
#[cfg(feature = "reqwest")]
mod outside;
mod steps;

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use claim::LeaseStore;
pub(crate) use claim::claim_lease;
pub(crate) use class::Class;
pub use class::MAX_ERROR_LEN;
pub(crate) use clock::Clock;
pub use steps::{MAX_STEP_NAME, Step, Verified};

use crate::backend::Holder;
use crate::claim::{Ending, Hold, Request, Ticket, finish, finish_failed};
use crate::error::{Error, LeaseError, NotKept};
use crate::key::Key;
use crate::options::LeaseOptions;
use crate::outcome::{Failed, Failure, Outcome};
use crate::outgoing::{Outbox, Unsent};
use crate::record::{self, NotStorable};

/// A lease-mode delivery's hold on its key: what the body gets as `lease: &idem::Lease`.
///
/// Pass [`idempotency_key`](Lease::idempotency_key) to the outside system (the
/// `Idempotency-Key` header of a payments API) and [`remaining`](Lease::remaining) as the
/// request's timeout: a redelivery after a crash sends the same key, and the provider does the
/// work once. End it with [`finish`](Lease::finish) (or give up with
/// [`release`](Lease::release)); dropping a lease that was not finished (a panic, a cancelled
/// future) releases the key in the background when a tokio runtime is there, else it expires.
/// Its call has the `idem.claim` span and the `idem_outcomes_total` count of an
/// `#[idempotent]` handler's.
///
/// A body of several outside calls runs each as a [`step`](Lease::step), whose value is
/// recorded as it returns, so that a redelivery resumes after the last recorded one; says of
/// its error whether it is [`permanent`](Lease::permanent), [`transient`](Lease::transient)
/// or [`unknown`](Lease::unknown); and keeps the lease alive around a slow call with
/// [`keep_alive`](Lease::keep_alive) (`docs/steps.md`). With the feature `reqwest`,
/// `Lease::send` makes such a call and classes its failure itself, and `Lease::request` and
/// `Step::request` set the key and the timeout on it.
pub struct Lease {
    store: Arc<dyn LeaseStore>,
    /// Taken by the finish; still here when the lease is dropped unfinished.
    ticket: Option<Ticket>,
    idempotency_key: String,
    token: i64,
    attempt: u32,
    options: LeaseOptions,
    clock: Arc<Clock>,
    /// The body's steps: the names used, the one running, the ones recorded before (boxed: a
    /// lease is moved around whole, and most bodies have no step).
    steps: Box<steps::Steps>,
    /// What the body said of its error.
    class: Mutex<Class>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("scope", &self.scope())
            .field("key", &self.key())
            .field("token", &self.token)
            .field("attempt", &self.attempt)
            .field("remaining", &self.remaining())
            .finish()
    }
}

impl Lease {
    pub(crate) fn new(
        store: Arc<dyn LeaseStore>,
        ticket: Ticket,
        token: i64,
        attempts: i64,
        options: LeaseOptions,
        claimed_at: Instant,
    ) -> Lease {
        let Request { scope, key, .. } = &ticket.request;
        let idempotency_key = idempotency_key(scope, key);
        Lease {
            store,
            ticket: Some(ticket),
            idempotency_key,
            token,
            attempt: u32::try_from(attempts).unwrap_or(u32::MAX),
            options,
            // Measured from before the claim was sent, so never later than the database's
            // `locked_until`: the worker's clock is not involved, only its elapsed time.
            clock: Arc::new(Clock::new(
                claimed_at.into(),
                options.lease,
                options.timeout,
            )),
            steps: Box::default(),
            class: Mutex::new(Class::Plain),
        }
    }

    fn ticket_request(&self) -> &Request {
        &self
            .ticket
            .as_ref()
            .expect("a lease keeps its ticket until it finishes")
            .request
    }

    /// The job's key, as stored in the marker.
    pub fn key(&self) -> &str {
        self.ticket_request().key.as_str()
    }

    /// The scope of the handler.
    pub fn scope(&self) -> &str {
        &self.ticket_request().scope
    }

    /// The key to give the outside system as its `Idempotency-Key`: scope and key together
    /// (`14:billing.charge|7:order-7`, idem's tuple encoding), at most 255 bytes (longer ones
    /// become `sha256:` and the hex digest of that encoding). The same on every redelivery of
    /// the job, and different for every other `(scope, key)`.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }

    /// The fencing token: a number that grows with every holder of the key and never repeats
    /// for it, [`Store::forget`](crate::Store::forget) included (the database clock's
    /// microseconds at the claim, or one more than the last holder's if that is larger). Give
    /// it to an outside system that can refuse writes of a holder older than the last one it
    /// saw.
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
        self.clock.deadline().into_std()
    }

    /// What the body has left: the smaller of the lease's time left and the body's timeout
    /// (`timeout`, from the claim or the last [`renew`](Lease::renew)). Give it to the
    /// outside call as its timeout, so that the call gives up before idem cuts the body off.
    pub fn remaining(&self) -> Duration {
        self.clock.remaining()
    }

    /// The lease's length.
    pub fn lease_len(&self) -> Duration {
        self.options.lease
    }

    /// The call's `idem.claim` span.
    pub fn span(&self) -> &tracing::Span {
        self.ticket
            .as_ref()
            .expect("a lease keeps its ticket until it finishes")
            .observed
            .span()
    }

    /// The outbox of this claim's job: its messages are written in the statement's
    /// transaction that completes the marker, and only if this delivery still holds the key.
    pub fn outbox(&mut self) -> &mut Outbox {
        self.ticket
            .as_mut()
            .expect("a lease keeps its ticket until it finishes")
            .outbox()
    }

    /// Extends the lease by its full length from now (database clock), if this delivery still holds
    /// it; else [`LeaseError::Lost`]. The body's time limit moves with it: a body that renews keeps
    /// running, under the attribute, the HTTP layer and [`run`](Lease::run) alike.
    pub async fn renew(&self) -> Result<(), Error> {
        let sent = tokio::time::Instant::now();
        let renewed = self
            .store
            .renew(self.holder(), self.options.lease_ms())
            .await?;
        if !renewed {
            return Err(lost(self.ticket_request()));
        }
        self.clock.renewed(sent);
        Ok(())
    }

    /// Runs `body` in the call's span under the lease's timeout: [`LeaseError::Timeout`] if it does
    /// not finish in time (the time limit moves with each [`renew`](Lease::renew)); the body is
    /// dropped then. A lease holds no transaction, so claims in its body are not refused as nested.
    pub async fn run<F: Future>(&self, body: F) -> Result<F::Output, Error> {
        self.clock
            .run(crate::observe::in_span(self.span().clone(), body))
            .await
            .map_err(|after| timed_out(self.ticket_request(), after))
    }

    /// The lease's clock, shared with whoever runs the body under it (the HTTP layer, whose
    /// handler holds the lease meanwhile).
    #[cfg(feature = "axum")]
    pub(crate) fn clock(&self) -> Arc<Clock> {
        self.clock.clone()
    }

    fn holder(&self) -> Holder<'_> {
        Holder {
            scope: self.scope(),
            key: self.key(),
            token: self.token,
        }
    }

    /// The body of a step that holds a transaction: marked so that a claim in it is refused as
    /// nested.
    fn ticket_body(&self) -> crate::claim::nested::Body {
        self.ticket
            .as_ref()
            .expect("a lease keeps its ticket until it finishes")
            .body()
    }

    fn rolled_back(&self) -> Error {
        Error::NotKept(NotKept::RolledBack {
            scope: self.scope().to_owned(),
            key: self.key().to_owned(),
        })
    }

    /// Ends the call, with `outbox`'s messages if the body had its own. `Ok` completes the
    /// marker if this delivery still holds the key (else [`LeaseError::Lost`], and the value is not
    /// reported as applied), storing what `encode` makes of the value (`replay`). The outside call
    /// happened by then, so a value that cannot be stored still completes the marker, without it:
    /// later deliveries are duplicates, and this one gets [`Error::ValueNotStored`]. `Err` (the
    /// body's, or a timeout `result` holds) releases the key at once so that a redelivery may
    /// retry.
    pub(crate) async fn finish_with<T, E>(
        mut self,
        result: Result<Result<T, E>, Error>,
        encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
        outbox: Option<&Unsent>,
    ) -> Result<Outcome<T>, Failed<E>> {
        let ticket = self.ticket.take().expect("a lease finishes once");
        let class = self.class();
        let mut hold = Ends {
            store: self.store.clone(),
            token: self.token,
            // An error that may have had its effect keeps the lease until it runs out.
            keep: class == Class::Unknown,
            failing: None,
        };
        // The body's own error, said to be permanent: the marker completes as failed.
        if let (Class::Permanent(error), Ok(Err(_))) = (&class, &result) {
            hold.failing = Some(error.clone());
            return finish_failed(hold, ticket, Failure::new(error.clone())).await;
        }
        let result = match result {
            Ok(result) => result.map_err(Failed::Handler),
            Err(e) => Err(Failed::Idem(e)),
        };
        let result = match class {
            // The kit crashed the delivery after a step: nothing after it is kept.
            Class::Crashed => Err(Failed::Idem(Error::crashed(
                &ticket.request.scope,
                ticket.request.key.as_str(),
            ))),
            _ => result,
        };
        finish(hold, ticket, outbox, result, encode).await
    }

    /// Ends a call by hand: completes on `Ok`, releases on `Err`.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Outcome<T>, E> {
        let end = self.finish_with(Ok(result), |_| Ok(None), None).await;
        end.map_err(Failed::into_handler_error)
    }

    /// [`finish`](Lease::finish) that also stores the `Ok` value with the marker (`replay`), in the
    /// completing statement.
    pub async fn finish_replay<T: Serialize, E: From<Error>>(
        self,
        result: Result<T, E>,
    ) -> Result<Outcome<T>, E> {
        let end = self.finish_with(Ok(result), |v| record::encode(v).map(Some), None);
        end.await.map_err(Failed::into_handler_error)
    }

    /// Ends a call whose body ran out of time (`after`): the key is released.
    #[cfg(feature = "axum")]
    pub(crate) async fn timed_out(self, after: Duration) {
        let timeout = timed_out(self.ticket_request(), after);
        let result: Result<Result<(), ()>, Error> = Err(timeout);
        drop(self.finish_with(result, |_| Ok(None), None).await);
    }

    /// Gives up: releases the key now, so that the next delivery takes it over (whatever the
    /// body said of its error).
    pub async fn release(self) {
        self.classify(Class::Plain);
        let result: Result<(), ()> = Err(());
        drop(self.finish_with(Ok(result), |_| Ok(None), None).await);
    }
}

/// What ends a lease, once its ticket is taken: the statements and the token.
struct Ends {
    store: Arc<dyn LeaseStore>,
    token: i64,
    /// Keep the lease instead of releasing it (an unknown error).
    keep: bool,
    /// Complete the marker as failed with this error, not with a value (a permanent error).
    failing: Option<String>,
}

impl Ends {
    fn holder<'a>(&self, request: &'a Request) -> Holder<'a> {
        Holder {
            scope: &request.scope,
            key: request.key.as_str(),
            token: self.token,
        }
    }
}

impl Hold for Ends {
    const OUTSIDE: bool = true;

    fn end(&self) -> &'static str {
        "completing statement"
    }

    async fn write(&mut self, _: Ending<'_>) -> Result<(), Error> {
        // The value and the messages go with the completing statement.
        Ok(())
    }

    async fn commit(self, ending: Ending<'_>) -> Result<(), Error> {
        let Ending {
            request,
            value,
            outbox,
        } = ending;
        let holder = self.holder(request);
        let kept = match &self.failing {
            Some(error) => self.store.fail(holder, error).await,
            None => self.store.complete(holder, value, outbox).await,
        };
        match kept {
            Ok(true) => Ok(()),
            Ok(false) => Err(lost(request)),
            // Not completed: give the key back now rather than at the lease's end, as for any
            // other failure (the release fails too if the database is gone, and then the lease
            // expires).
            Err(e) => {
                drop(self.store.release(holder).await);
                Err(e.into())
            }
        }
    }

    async fn release(self, request: &Request) {
        if self.keep {
            return;
        }
        drop(self.store.release(self.holder(request)).await);
    }
}

fn lost(request: &Request) -> Error {
    Error::Lease(LeaseError::Lost {
        scope: request.scope.to_string(),
        key: request.key.as_str().to_owned(),
    })
}

fn timed_out(request: &Request, after: Duration) -> Error {
    Error::Lease(LeaseError::Timeout {
        scope: request.scope.to_string(),
        key: request.key.as_str().to_owned(),
        after,
    })
}

impl crate::testing::probe::Held for Lease {
    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn expire_now(&self) -> crate::future::BoxFuture<'_, Result<bool, sqlx::Error>> {
        self.store.release(self.holder())
    }

    fn reset_deadline(&self, now: Instant) {
        self.clock.renewed(now.into());
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        // A panic or a cancelled future: give the key back now if a runtime can run the
        // statement; otherwise the lease expires on its own. The ticket's observation, dropped
        // unfinished, counts the call as an error.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let store = self.store.clone();
            let (scope, key, token): (Cow<'static, str>, Key, i64) = (
                ticket.request.scope.clone(),
                ticket.request.key.clone(),
                self.token,
            );
            handle.spawn(async move {
                let holder = Holder {
                    scope: &scope,
                    key: key.as_str(),
                    token,
                };
                drop(store.release(holder).await);
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
