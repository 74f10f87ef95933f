//! The lease-mode claim: one statement where the backend allows, on the database's clock,
//! made, retried and decided as every mode's claim is (`claim::run`).

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use super::Lease;
use crate::backend::{Backend, Fence, Holder, LeaseState, StepRow};
use crate::claim::run::{self, Attempt};
use crate::claim::{Claimed, Decision, RECHECKS, Request, decide};
use crate::error::Error;
use crate::future::BoxFuture;
use crate::key::Key;
use crate::observe;
use crate::observe::semconv::About;
use crate::options::{ClaimOptions, LeaseOptions, Mode};
use crate::outgoing::Unsent;
use crate::scope::check_scope;
use crate::store::Store;

impl<DB: Backend> Store<DB> {
    /// Lease mode by hand: claims `(scope, key)` for `options`' lease, outside any
    /// transaction.
    ///
    /// A completed marker is [`Claimed::Duplicate`] ([`Claimed::Replayed`] with `replay` and
    /// a stored value); a live lease of another delivery is [`Error::InProgress`] at once
    /// (nack the job), and so is a transaction of another mode that holds the key past the
    /// options' `wait`; a released or expired one is taken over by exactly one delivery (token
    /// up, attempts + 1); another payload under the key is [`Error::KeyReused`] (with a
    /// fingerprint). A lease outside [`MIN_LEASE`](crate::MIN_LEASE)..=
    /// [`MAX_LEASE`](crate::MAX_LEASE) is [`Refusal::Lease`](crate::Refusal::Lease), before any I/O, and so is
    /// a claim inside the open transaction of another claim of this task
    /// ([`Refusal::Nested`](crate::Refusal::Nested)). This is what `#[idempotent(lease = "...")]`
    /// expands to.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[cfg(feature = "sqlite")]
    /// # async fn f(store: &idem::Store<sqlx::Sqlite>) -> Result<(), idem::Error> {
    /// use std::time::Duration;
    ///
    /// use idem::{Claimed, Key, LeaseOptions};
    ///
    /// let key = Key::new("charge-7")?;
    /// let options = LeaseOptions::new(Duration::from_secs(30));
    /// if let Claimed::Fresh(lease) = store.lease("billing.charge", &key, options).await? {
    ///     // The outside call, under the lease's time limit, with its idempotency key.
    ///     let charged = lease.run(async { Ok::<_, idem::Error>(lease.idempotency_key().len()) });
    ///     let charged = charged.await.and_then(|r| r);
    ///     lease.finish(charged).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn lease(
        &self,
        scope: &str,
        key: &Key,
        options: LeaseOptions,
    ) -> Result<Claimed<Lease>, Error> {
        check_scope(scope)?;
        options.check()?;
        let scope = Cow::Owned(scope.to_owned());
        let request = Request::new(scope, key.clone(), claim_options(&options), "Store::lease");
        claim_lease(self, request, options).await
    }
}

/// What a lease claim shares with a claim in a transaction: its wait, replay and fingerprint.
pub(crate) fn claim_options(options: &LeaseOptions) -> ClaimOptions {
    ClaimOptions {
        wait: options.wait,
        isolation: None,
        replay: options.replay,
        fingerprint: options.fingerprint,
        messaging: options.messaging,
        link: options.link,
    }
}

/// A lease claim of `request` (whose options are `options`' own).
pub(crate) async fn claim_lease<DB: Backend>(
    store: &Store<DB>,
    mut request: Request,
    options: LeaseOptions,
) -> Result<Claimed<Lease>, Error> {
    if let Some(messaging) = options.messaging {
        request.about = Some(About::Message(messaging));
    }
    let mut observed = run::start(&request, Mode::Lease, true)?;
    let mut attempts = Leasing {
        store,
        request: &request,
        lease_ms: options.lease_ms(),
    };
    let answer = run::retrying_in_span::<DB, _>(&mut observed, &request, true, &mut attempts).await;
    let span = observed.span().clone();
    let store: Arc<dyn LeaseStore> = Arc::new(store.clone());
    let claimed = run::conclude(observed, request, answer, |taken, ticket| {
        let (token, attempts, sent) = taken;
        Lease::new(store, ticket, token, attempts, options, sent)
    })?;
    if let Claimed::Fresh(lease) = &claimed
        && lease.attempt() > 1
    {
        span.in_scope(|| observe::took_over(lease.token(), lease.attempt()));
    }
    if let Claimed::Fresh(lease) = &claimed {
        crate::testing::probe::lease_taken(lease).await?;
    }
    Ok(claimed)
}

/// A lease claim's attempts.
struct Leasing<'a, DB: Backend> {
    store: &'a Store<DB>,
    request: &'a Request,
    lease_ms: i64,
}

impl<DB: Backend> run::Attempts for Leasing<'_, DB> {
    type Fresh = (i64, i64, Instant);

    fn attempt(
        &mut self,
    ) -> impl Future<Output = Result<Attempt<Self::Fresh>, sqlx::Error>> + Send {
        lease_attempt(self.store, self.request, self.lease_ms)
    }
}

/// One attempt: the lease statement, and again while the marker changes under it (forgotten,
/// or taken by another delivery between two statements).
async fn lease_attempt<DB: Backend>(
    store: &Store<DB>,
    request: &Request,
    lease_ms: i64,
) -> Result<Attempt<(i64, i64, Instant)>, sqlx::Error> {
    let (pool, sql) = (store.pool(), store.sql());
    for _ in 0..RECHECKS {
        let sent = Instant::now();
        let state = DB::lease_claim(pool, sql, request.claimant(), lease_ms).await?;
        crate::testing::probe::lease_answered();
        match state {
            LeaseState::Taken { token, attempts } => {
                return Ok(Attempt::Fresh((token, attempts, sent), attempts > 1));
            }
            LeaseState::Found(found) => match decide(found, request) {
                Ok(Decision::Done(done)) => return Ok(Attempt::Done(done)),
                // Free when read, but another delivery took it between the statements: ask
                // again, it decides.
                Ok(Decision::TakeOver) => {}
                Err(e) => return Ok(Attempt::Refused(e)),
            },
            LeaseState::Missing => {}
        }
    }
    Ok(Attempt::Refused(request.in_progress()))
}

/// The statements a [`Lease`] runs after its claim, without knowing the database type.
pub(crate) trait LeaseStore: Send + Sync + 'static {
    /// Completes the lease with its value and its messages (in one transaction, if there are
    /// any); `Ok(false)` if the holder no longer had the key, and nothing was written.
    fn complete<'a>(
        &'a self,
        holder: Holder<'a>,
        result: Option<&'a str>,
        outbox: Option<&'a Unsent>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
    fn release<'a>(&'a self, holder: Holder<'a>) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
    /// Completes the lease as failed for good, with `error`; `Ok(false)` if the holder no
    /// longer had the key.
    fn fail<'a>(
        &'a self,
        holder: Holder<'a>,
        error: &'a str,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
    /// The steps recorded for `(scope, key)`.
    fn steps_read<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Vec<StepRow>, sqlx::Error>>;
    /// Records a step, if `holder` still holds the key.
    fn step_record<'a>(
        &'a self,
        holder: Holder<'a>,
        name: &'a str,
        seq: i64,
        json: &'a str,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
    /// The store itself, for a database step that needs its database's type back.
    fn as_any(&self) -> &dyn std::any::Any;
    fn renew<'a>(
        &'a self,
        holder: Holder<'a>,
        lease_ms: i64,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
}

impl<DB: Backend> LeaseStore for Store<DB> {
    fn complete<'a>(
        &'a self,
        holder: Holder<'a>,
        result: Option<&'a str>,
        outbox: Option<&'a Unsent>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let sql = self.sql();
            let Some(outbox) = outbox.filter(|o| !o.is_empty()) else {
                let mut conn = self.pool().acquire().await?;
                return sql.lease_complete(&mut conn, holder, result).await;
            };
            // The messages exist exactly when the marker completed: one transaction, and none
            // if the token no longer matches.
            let mut tx = DB::begin(self.pool(), sql, &ClaimOptions::new()).await?;
            if !sql.lease_complete(&mut tx, holder, result).await? {
                tx.rollback().await?;
                return Ok(false);
            }
            DB::outbox_write(&mut tx, sql, outbox, Fence::Marker(holder.token)).await?;
            tx.commit().await?;
            sql.table.wake().committed();
            Ok(true)
        })
    }

    fn release<'a>(&'a self, holder: Holder<'a>) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(self.sql().lease_release(self.pool(), holder))
    }

    fn fail<'a>(
        &'a self,
        holder: Holder<'a>,
        error: &'a str,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(self.sql().lease_fail(self.pool(), holder, error))
    }

    fn steps_read<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Vec<StepRow>, sqlx::Error>> {
        Box::pin(self.sql().steps_read(self.pool(), scope, key))
    }

    fn step_record<'a>(
        &'a self,
        holder: Holder<'a>,
        name: &'a str,
        seq: i64,
        json: &'a str,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = self.pool().acquire().await?;
            self.sql()
                .step_record(&mut conn, holder, name, seq, json)
                .await
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn renew<'a>(
        &'a self,
        holder: Holder<'a>,
        lease_ms: i64,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(self.sql().lease_renew(self.pool(), holder, lease_ms))
    }
}
