//! The lease-mode claim: one statement where the backend allows, on the database's clock,
//! decided as every mode decides.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use super::Lease;
use crate::backend::{Backend, LeaseOp, LeaseState};
use crate::claim::{Claimed, Decided, RECHECKS, Request, decide, decision};
use crate::key::check_scope;
use crate::observe;
use crate::{BoxFuture, ClaimOptions, Error, Fingerprint, Key, LeaseOptions, Store};

/// The answer to [`Store::lease`]: on [`Claimed::Fresh`] the [`Lease`] this delivery holds.
pub type Leased = Claimed<Lease>;

impl<DB: Backend> Store<DB> {
    /// Lease mode by hand: claims `(scope, key)` for `options`' lease, outside any
    /// transaction.
    ///
    /// A completed marker is [`Claimed::Duplicate`]; a live lease of another delivery is
    /// [`Error::InProgress`] at once (nack the job); a released or expired one is taken over by
    /// exactly one delivery (token + 1, attempts + 1). A lease outside
    /// [`MIN_LEASE`](crate::MIN_LEASE)..=[`MAX_LEASE`](crate::MAX_LEASE) is
    /// [`Error::InvalidLease`], before any I/O. This is what `#[idempotent(lease = "...")]`
    /// expands to.
    pub async fn lease(
        &self,
        scope: &str,
        key: &Key,
        options: LeaseOptions,
    ) -> Result<Leased, Error> {
        self.lease_checked(scope, key, options, None).await
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
        check_scope(scope)?;
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
        options.check()?;
        let mut claim = ClaimOptions::new();
        if options.replay {
            claim = claim.replay();
        }
        let request = Request::new(scope, key, claim, fingerprint);
        let started = Instant::now();
        let leased = self.lease_attempts(request, options).await;
        let took_over = matches!(&leased, Ok(Claimed::Fresh(lease)) if lease.token() > 1);
        observe::decided(started, decision(&leased, took_over));
        if let Ok(Claimed::Fresh(lease)) = &leased
            && took_over
        {
            observe::took_over(lease.token(), lease.attempt());
        }
        leased
    }

    async fn lease_attempts(
        &self,
        request: Request,
        options: LeaseOptions,
    ) -> Result<Leased, Error> {
        #[cfg(feature = "testing")]
        crate::testing::probe::claiming(crate::options::Mode::Lease);
        for _ in 0..RECHECKS {
            let sent = Instant::now();
            let claimant = request.claimant();
            let state =
                DB::lease_claim(self.pool(), self.statements(), claimant, options.lease_ms()).await;
            observe::attempted(sent);
            let state = state?;
            #[cfg(feature = "testing")]
            crate::testing::probe::lease_answered();
            match state {
                LeaseState::Taken { token, attempts } => {
                    let store = Arc::new(self.clone());
                    let Request { scope, key, .. } = request;
                    let lease = Lease::new(store, scope, key, token, attempts, options, sent);
                    #[cfg(feature = "testing")]
                    crate::testing::probe::lease_taken(&lease).await?;
                    return Ok(Claimed::Fresh(lease));
                }
                LeaseState::Found(found) => match decide(found, &request)? {
                    Decided::Done(done) => return Ok(done.map(|()| unreachable!("not fresh"))),
                    // Free when read, but another delivery took it between the statements:
                    // ask again, it decides.
                    Decided::TakeOver => {}
                },
                LeaseState::Missing => {}
            }
        }
        Err(request.in_progress())
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
            self.statements(),
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
