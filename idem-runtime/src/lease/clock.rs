//! A lease's clock on the worker's side: when the lease runs out, and the body's one time
//! limit, which moves with every renewal. The attribute, the HTTP layer and hand-written code
//! run a lease's body under the same [`Clock::run`].

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

// tokio's clock, which is the system's but for tests that pause it.
use tokio::time::Instant;

/// When a lease runs out, measured from before its claim (or its last renewal) was sent, and
/// how much of it the body may use.
#[derive(Debug)]
pub(crate) struct Clock {
    deadline: Mutex<Instant>,
    lease: Duration,
    timeout: Duration,
}

impl Clock {
    pub(crate) fn new(sent: Instant, lease: Duration, timeout: Duration) -> Clock {
        Clock {
            deadline: Mutex::new(sent + lease),
            lease,
            timeout,
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A renewal sent at `sent` succeeded: the lease runs a full length from then.
    pub(crate) fn renewed(&self, sent: Instant) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = sent + self.lease;
    }

    /// When the body is cut off: the lease's deadline less the margin between lease and
    /// timeout, so that the completing statement reaches the database while the lease holds.
    fn cutoff(&self) -> Instant {
        let margin = self.lease.saturating_sub(self.timeout);
        let deadline = self.deadline();
        deadline.checked_sub(margin).unwrap_or(deadline)
    }

    /// What the body has left before it is cut off.
    pub(crate) fn remaining(&self) -> Duration {
        self.cutoff().saturating_duration_since(Instant::now())
    }

    /// Runs `body` until it is done or cut off; `Err(timeout)` when cut off (the body is
    /// dropped then). The limit is read again when it passes, so a body that renewed meanwhile
    /// keeps running, one that did not is cut off while the lease still holds.
    pub(crate) async fn run<F: Future>(&self, body: F) -> Result<F::Output, Duration> {
        let mut body = std::pin::pin!(body);
        loop {
            let limit = self.cutoff();
            match tokio::time::timeout_at(limit, body.as_mut()).await {
                Ok(out) => return Ok(out),
                // Renewed while we waited: wait on, up to the new limit.
                Err(_) if self.cutoff() > limit => {}
                Err(_) => return Err(self.timeout),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_is_what_the_body_has_left() {
        let claimed = Instant::now();
        let clock = Clock::new(claimed, Duration::from_secs(30), Duration::from_secs(10));
        let left = clock.remaining();
        let elapsed = claimed.elapsed();
        // The body's 10 s, not the lease's 30 s, less what has passed since the claim.
        assert!(left <= Duration::from_secs(10), "{left:?}");
        assert!(
            left + elapsed >= Duration::from_secs(10),
            "{left:?} {elapsed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_moves_the_body_s_limit() {
        let clock = Clock::new(
            Instant::now(),
            Duration::from_secs(2),
            Duration::from_secs(1),
        );
        let renewing = async {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(800)).await;
                clock.renewed(Instant::now());
            }
            "done"
        };
        // 2.4 s of work under a 1 s limit, renewed every 0.8 s.
        assert_eq!(clock.run(renewing).await, Ok("done"));
        let stalled = std::future::pending::<()>();
        assert_eq!(clock.run(stalled).await, Err(Duration::from_secs(1)));
    }
}
