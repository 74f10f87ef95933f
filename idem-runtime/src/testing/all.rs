//! Every case that applies to a handler, each on a fresh job, in one call.

use std::fmt::Debug;

use super::Report;
use super::cases::{deliver_concurrently, deliver_twice, expire_lease, fail_before_commit};
use super::probe::Mode;
use crate::outcome::Outcome;

/// How many deliveries [`all_cases`] makes at once in its `deliver_concurrently` case.
pub const CONCURRENT_DELIVERIES: usize = 8;

/// Runs every case that applies to the handler's mode, each on a fresh job:
/// [`deliver_twice`], [`deliver_concurrently`] (with [`CONCURRENT_DELIVERIES`] deliveries),
/// [`fail_before_commit`], and, for a lease-mode handler, [`expire_lease`]. The mode is the
/// one the first delivery claimed in.
///
/// - `fresh(n)` makes the job of case `n` (1, 2, ...): a job id no delivery has seen, and
///   whatever rows its effect needs (a new account), since a case must see the check read
///   something else before the job applies;
/// - `deliver(&job)` is the handler's call;
/// - `check(&job)` reads the job's effect back;
/// - `applied` is what `check` reads once the job applied exactly once.
///
/// Returns each case's name and [`Report`], in the order they ran. Panics as the first case
/// whose rule the handler breaks does.
pub async fn all_cases<J, T, E, V>(
    mut fresh: impl AsyncFnMut(usize) -> J,
    deliver: impl AsyncFn(&J) -> Result<Outcome<T>, E>,
    check: impl AsyncFn(&J) -> V,
    applied: V,
) -> Vec<(&'static str, Report)>
where
    T: Debug,
    E: Debug,
    V: PartialEq + Debug + Clone,
{
    let (deliver, check) = (&deliver, &check);
    let mut reports = Vec::new();

    let job = fresh(1).await;
    let report = deliver_twice(|| deliver(&job), || check(&job), applied.clone()).await;
    let lease = report.deliveries()[0].mode == Some(Mode::Lease);
    reports.push(("deliver_twice", report));

    let job = fresh(2).await;
    let report = deliver_concurrently(
        CONCURRENT_DELIVERIES,
        || deliver(&job),
        || check(&job),
        applied.clone(),
    )
    .await;
    reports.push(("deliver_concurrently", report));

    let job = fresh(3).await;
    let report = fail_before_commit(|| deliver(&job), || check(&job), applied.clone()).await;
    reports.push(("fail_before_commit", report));

    if lease {
        let job = fresh(4).await;
        let report = expire_lease(|| deliver(&job), || check(&job), applied).await;
        reports.push(("expire_lease", report));
    }
    reports
}
