//! A lease that keeps itself alive around a slow call: renewed at a third of its length while the
//! call runs, and the call stopped with `LeaseError::Lost` once a renewal says another delivery has
//! the key.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;

use tokio::time::Instant;

use super::Lease;
use crate::error::{Error, LeaseError};
use crate::future::BoxFuture;

/// How many renewals a lease gets per length while [`Lease::keep_alive`] runs.
const RENEWALS_PER_LEASE: u32 = 3;

impl Lease {
    /// Runs `work` (a slow outside call, a whole step) while keeping the lease alive: the
    /// lease is renewed every third of its length, on the database's clock, for as long as
    /// `work` runs, and the body's time limit moves with it (so `work` may outlive the
    /// `timeout` it was given; [`remaining`](Lease::remaining) grows with each renewal).
    ///
    /// If a renewal finds that another delivery took the key over (or an operator forgot it),
    /// `work` is dropped at once and the call is [`LeaseError::Lost`]: the new holder decides the
    /// job. A renewal that fails for another reason (the database briefly unreachable) is tried
    /// again until the lease would have run out, and then the call is [`LeaseError::Lost`] too: by
    /// then another delivery may hold the key.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn slow_call(_: &str) -> u32 { 1 }
    /// # async fn f(lease: &idem::Lease) -> Result<(), idem::Error> {
    /// let answer = lease.keep_alive(slow_call(lease.idempotency_key())).await?;
    /// # let _ = answer; Ok(()) }
    /// ```
    pub async fn keep_alive<F: Future>(&self, work: F) -> Result<F::Output, Error> {
        let every = self.lease_len() / RENEWALS_PER_LEASE;
        let mut work = pin!(work);
        let mut tick = pin!(tokio::time::sleep(every));
        let mut renewal: Option<BoxFuture<'_, Result<(), Error>>> = None;
        poll_fn(|cx| {
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(Ok(out));
            }
            loop {
                if let Some(renewing) = renewal.as_mut() {
                    let Poll::Ready(renewed) = renewing.as_mut().poll(cx) else {
                        return Poll::Pending;
                    };
                    renewal = None;
                    let next = match renewed {
                        Ok(()) => every,
                        Err(lost @ Error::Lease(LeaseError::Lost { .. })) => {
                            return Poll::Ready(Err(lost));
                        }
                        // Not answered: another try soon, while the lease may still hold.
                        Err(_) if self.clock.deadline() > Instant::now() => every / 4,
                        Err(_) => return Poll::Ready(Err(super::lost(self.ticket_request()))),
                    };
                    tick.as_mut().reset(Instant::now() + next);
                }
                if tick.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                renewal = Some(Box::pin(self.renew()));
            }
        })
        .await
    }
}
