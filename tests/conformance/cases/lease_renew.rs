//! `Lease::renew` inside an attributed lease handler: each renewal gives the body its full
//! timeout again, so a body that keeps renewing outlives the timeout it was given, and the
//! first lease too.

use idem::{Lease, Outcome};

use super::lease::db_now;
use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{Job, TestError};
use crate::conformance::util::{unique_name, within};

/// Renews until the database's clock is past `first` (the lease's `locked_until` after a first
/// renewal, a second past the body's 1 s timeout), then succeeds; returns how often it renewed
/// after that first one.
#[idem::idempotent(
    key = "job.key",
    scope = "billing.renewing",
    lease = "2s",
    timeout = "1s"
)]
async fn renewing<S: Support>(
    lease: &Lease,
    job: &Job,
    ctx: &Ctx<S>,
    first: &str,
) -> Result<u32, TestError> {
    let _ = job;
    // A renewal first: on a loaded machine the DDL alone may take longer than the 1 s
    // timeout. `first` is then the renewed lease, still a second past the timeout.
    lease.renew().await?;
    ctx.exec(&format!(
        "CREATE TABLE {first} AS SELECT locked_until AS t FROM {} WHERE scope = 'billing.renewing'",
        ctx.store.table()
    ))
    .await;
    let past_first = format!(
        "SELECT CAST(CASE WHEN (SELECT t FROM {first}) < {} THEN 1 ELSE 0 END AS {})",
        db_now::<S>(),
        S::BIGINT
    );
    // Paced like `poll_db`; what ends the loop is the database's clock, never the time spent.
    let mut pace = tokio::time::interval(std::time::Duration::from_millis(10));
    let renew = async {
        let mut renewals = 0_u32;
        loop {
            pace.tick().await;
            lease.renew().await?;
            renewals += 1;
            if ctx.scalar(&past_first).await == 1 {
                return Ok::<u32, TestError>(renewals);
            }
        }
    };
    within(60, "the database's clock passing the first lease", renew).await
}

pub(crate) async fn lease_renewing_body_outlives_its_timeout<S: Support>() {
    let mut ctx = Ctx::<S>::new("lease_renewing", 2).await;
    let first = unique_name("first", &ctx.tag);
    ctx.tables.push(first.clone());
    let job = ctx.job("order-renewing", 21, 2100);
    match renewing(&ctx.store, &job, &ctx, &first).await {
        Ok(Outcome::Applied(renewals)) => {
            println!("renewed {renewals} times, past the first lease");
            assert!(renewals > 1);
        }
        other => panic!("a body that renews must not be cut off: got {other:?}"),
    }
    match renewing(&ctx.store, &job, &ctx, &first).await {
        Ok(Outcome::Duplicate) => {}
        other => panic!("expected Duplicate, got {other:?}"),
    }
    ctx.cleanup().await;
}
