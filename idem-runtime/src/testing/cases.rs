//! The four cases. Each runs every delivery it needs to the end before it judges them, so that
//! a violation never leaves a paused delivery or an open transaction behind.

use std::fmt::Debug;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use super::call::{Check, Deliver};
use super::probe::{Ended, Fault, Mode, Probe, Race};
use super::{Delivery, Got, Report};
use crate::outcome::Outcome;

/// Delivers the job twice, one after the other: the first must be `Applied`, the second
/// `Duplicate` (or `Replayed` with the first value, with `replay`), and `check` must read
/// `applied` after each, having read something else before the first.
///
/// Panics naming the delivery that broke the rule and what that means.
pub async fn deliver_twice<C: Check>(
    mut deliver: impl Deliver,
    mut check: C,
    applied: C::Value,
) -> Report {
    let case = "deliver_twice";
    let (mut report, before) = baseline(case, &mut check, &applied).await;
    let first = deliver_one(&mut deliver, 1, Fault::None, &mut report).await;
    let after_first = check.read().await;
    report.checked("after delivery 1", &after_first);
    let second = deliver_one(&mut deliver, 2, Fault::None, &mut report).await;
    let after_second = check.read().await;
    report.checked("after delivery 2", &after_second);

    seen_claiming(case, &report, &first);
    if first.got != Got::Applied {
        let what = format!("delivery 1 got {:?}, not Applied", first.got);
        fail(case, &report, &what, not_applied(first.got));
    }
    if after_first != applied {
        let what =
            format!("after delivery 1 applied, the check read {after_first:?}, not {applied:?}");
        fail(case, &report, &what, CHECK_AFTER_APPLIED);
    }
    expect_duplicate(case, &report, &second, &first);
    if after_second != applied {
        let what = format!(
            "after delivery 2, the check read {after_second:?}, not {applied:?} (before: \
             {before:?})"
        );
        fail(case, &report, &what, RAN_TWICE);
    }
    report
}

/// Delivers the job `n` times at once (`n` at least 2): all `n` calls are in flight together,
/// joined on the calling task, and the one that gets to its commit waits there until every
/// other has started its claim (lease mode: until every other's claim was answered), so the
/// claims overlap whatever the scheduling.
///
/// Exactly one delivery must be `Applied`. Each other must be `Duplicate` (or `Replayed`), or
/// fail with [`Error::InProgress`](crate::Error::InProgress): lease mode answers a live lease
/// that way at once, and transaction mode once a `wait` (or SQLite's busy timeout) ran out.
/// A broker redelivers such a job later, so the kit then delivers each of those once more,
/// and that delivery must be a `Duplicate`. Finally `check` must read `applied`.
///
/// Panics on `n < 2` before any delivery, and on any violation.
pub async fn deliver_concurrently<C: Check>(
    n: usize,
    mut deliver: impl Deliver,
    mut check: C,
    applied: C::Value,
) -> Report {
    let case = "deliver_concurrently";
    assert!(
        n >= 2,
        "idem::testing::deliver_concurrently: {n} delivery cannot race; pass at least 2 (8 is \
         a good number)"
    );
    let (mut report, before) = baseline(case, &mut check, &applied).await;
    let race = Race::new(n);
    let probes: Vec<Arc<Probe>> = (0..n)
        .map(|_| Probe::new(Fault::None, Some(race.clone())))
        .collect();
    let calls: Vec<_> = probes.iter().map(|p| p.run(deliver.call())).collect();
    let results = join_all(calls).await;
    for (i, (probe, result)) in probes.iter().zip(results).enumerate() {
        report.push(delivery(i + 1, &result, probe));
    }
    let waiting = report
        .got()
        .iter()
        .filter(|g| **g == Got::InProgress)
        .count();
    for number in n + 1..=n + waiting {
        deliver_one(&mut deliver, number, Fault::None, &mut report).await;
    }
    let after = check.read().await;
    report.checked("after every delivery", &after);

    let racing = &report.deliveries[..n];
    for d in racing {
        seen_claiming(case, &report, d);
    }
    let winners = racing.iter().filter(|d| d.got == Got::Applied).count();
    if winners != 1 {
        let what = format!("{winners} of the {n} concurrent deliveries were Applied, not 1");
        let why = if winners == 0 { NEVER_SEEN } else { RAN_TWICE };
        fail(case, &report, &what, why);
    }
    if let Some(odd) = racing
        .iter()
        .find(|d| !matches!(d.got, Got::Applied | Got::InProgress) && !d.got.is_duplicate())
    {
        let what = format!(
            "delivery {} got {:?}; a delivery racing the one that applies must be a \
             Duplicate or InProgress",
            odd.number, odd.got
        );
        fail(case, &report, &what, RACE_FAILED);
    }
    if let Some(again) = report.deliveries[n..]
        .iter()
        .find(|d| !d.got.is_duplicate())
    {
        let what = format!(
            "delivery {} (redelivering one that got InProgress) got {:?}, not Duplicate",
            again.number, again.got
        );
        fail(case, &report, &what, RAN_TWICE);
    }
    if after != applied {
        let what = format!("the check read {after:?}, not {applied:?} (before: {before:?})");
        fail(case, &report, &what, RAN_TWICE);
    }
    report
}

/// Fails the first delivery between its effect and its commit, then redelivers.
///
/// Transaction mode: right before `COMMIT` (a joined call: before its savepoint is released)
/// the kit rolls back instead, and the call returns
/// [`NotKept::Injected`](crate::NotKept::Injected); `check` must then read what it read before the
/// delivery (nothing was kept). Lease mode: right before the completing statement the kit releases
/// the lease instead; the outside call has happened, so the check is not read there. Either way the
/// redelivery must be `Applied` (in lease mode by the lease's attempt 2), `check` must read
/// `applied`, and one more delivery must be a `Duplicate`.
///
/// A handler that writes outside its transaction fails here in transaction mode, and a lease
/// handler whose outside call is not idempotent (no stable `Idempotency-Key`) in lease mode.
pub async fn fail_before_commit<C: Check>(
    mut deliver: impl Deliver,
    mut check: C,
    applied: C::Value,
) -> Report {
    let case = "fail_before_commit";
    let (mut report, before) = baseline(case, &mut check, &applied).await;
    let failed = deliver_one(&mut deliver, 1, Fault::BeforeCommit, &mut report).await;
    let lease = failed.mode == Some(Mode::Lease);
    let after_failure = if lease {
        None
    } else {
        let read = check.read().await;
        report.checked("after delivery 1 was rolled back", &read);
        Some(read)
    };
    let retried = deliver_one(&mut deliver, 2, Fault::None, &mut report).await;
    let after = check.read().await;
    report.checked("after delivery 2", &after);
    let third = deliver_one(&mut deliver, 3, Fault::None, &mut report).await;

    seen_claiming(case, &report, &failed);
    if failed.got != Got::Injected {
        let what = format!(
            "delivery 1 got {:?}, so it never reached its commit, where the kit fails it",
            failed.got
        );
        fail(case, &report, &what, not_applied(failed.got));
    }
    if let Some(read) = after_failure
        && read != before
    {
        let what = format!(
            "after delivery 1 was rolled back, the check read {read:?}, not {before:?} as \
             before it: its effect outlived the rollback"
        );
        fail(case, &report, &what, OUTSIDE_TX);
    }
    if retried.got != Got::Applied {
        let what = format!(
            "delivery 2, after delivery 1 failed before its commit, got {:?}, not Applied",
            retried.got
        );
        let why = if retried.got.is_duplicate() {
            "delivery 1's marker was kept although its commit failed: nothing of a failed \
             delivery may be kept"
        } else {
            RETRY_FAILED
        };
        fail(case, &report, &what, why);
    }
    if after != applied {
        let what = format!(
            "after delivery 1 failed and delivery 2 applied, the check read {after:?}, not \
             {applied:?} (before: {before:?})"
        );
        let why = if lease {
            NOT_IDEMPOTENT_OUTSIDE
        } else {
            RAN_TWICE
        };
        fail(case, &report, &what, why);
    }
    expect_duplicate(case, &report, &third, &retried);
    report
}

/// Lease mode: expires the lease of a running delivery and redelivers.
///
/// Delivery 1 is paused right after it took its lease; the kit expires that lease in the
/// database (as if delivery 1 had stalled past it) and makes delivery 2, which must take the
/// key over (`Applied`, lease attempt 2). Then delivery 1 goes on, believing its lease still
/// holds (its own clock is given a full lease again, as a paused process or a jumped clock
/// would believe): its body runs, and the call must not report success (it gets
/// [`LeaseError::Lost`](crate::LeaseError::Lost) when its result is refused, or its own error).
/// `check` must read `applied` (say, the payments API charged once, thanks to the
/// `Idempotency-Key`), and one more delivery must be a `Duplicate`.
///
/// Panics on a transaction-mode handler ("needs lease mode") and on any violation.
pub async fn expire_lease<C: Check>(
    mut deliver: impl Deliver,
    mut check: C,
    applied: C::Value,
) -> Report {
    let case = "expire_lease";
    let (mut report, before) = baseline(case, &mut check, &applied).await;
    let stalled = Probe::new(Fault::ExpireAfterClaim, None);
    let mut first = pin!(stalled.run(deliver.call()));
    let mut paused = pin!(stalled.paused());
    let early = poll_fn(|cx| match first.as_mut().poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => paused.as_mut().poll(cx).map(|()| None),
    })
    .await;
    if let Some(result) = early {
        let d = report.push(delivery(1, &result, &stalled)).clone();
        seen_claiming(case, &report, &d);
        if d.mode == Some(Mode::Transaction) {
            let what = "delivery 1 claimed in a transaction, not a lease";
            fail(case, &report, what, NEEDS_LEASE);
        }
        let what = format!("delivery 1 got {:?} and took no lease to expire", d.got);
        fail(case, &report, &what, not_applied(d.got));
    }
    let second = Probe::new(Fault::None, None);
    let taken = second.run(deliver.call()).await;
    stalled.resume();
    let resumed = first.await;
    let stalled_delivery = delivery(1, &resumed, &stalled);
    let taker = delivery(2, &taken, &second);
    report.push(stalled_delivery.clone());
    report.push(taker.clone());
    let after = check.read().await;
    report.checked("after deliveries 1 and 2", &after);
    let third = deliver_one(&mut deliver, 3, Fault::None, &mut report).await;

    if taker.got != Got::Applied || taker.attempt != Some(2) {
        let what = format!(
            "delivery 2, made while delivery 1's lease was expired, got {:?}{}, not Applied \
             by lease attempt 2",
            taker.got,
            taker
                .attempt
                .map(|a| format!(" by lease attempt {a}"))
                .unwrap_or_default()
        );
        fail(case, &report, &what, TAKEOVER_FAILED);
    }
    if matches!(
        stalled_delivery.got,
        Got::Applied | Got::Duplicate | Got::Replayed
    ) {
        let what = format!(
            "delivery 1, whose lease was taken over by delivery 2, reported {:?}",
            stalled_delivery.got
        );
        fail(case, &report, &what, FENCING_FAILED);
    }
    if after != applied {
        let what = format!(
            "after delivery 2 took the key over and delivery 1 went on, the check read \
             {after:?}, not {applied:?} (before: {before:?})"
        );
        fail(case, &report, &what, NOT_IDEMPOTENT_OUTSIDE);
    }
    expect_duplicate(case, &report, &third, &taker);
    report
}

const NEVER_SEEN: &str = "the kit expects a job no delivery has handled yet: give each case \
    its own job id (and fresh rows for its effect), and make the closure call the handler \
    directly";
const NO_CLAIM: &str = "the closure must call an idempotent handler (or claim with the store) \
    on the test's own task: the kit follows each delivery through a task-local, which does \
    not reach into `tokio::spawn`ed tasks; and the key must be valid, since a refused key \
    never reaches its claim";
const CHECK_AFTER_APPLIED: &str = "the check does not read what one application of the job \
    leaves: pass the value it reads after the job applied once (or the handler's effect is \
    not committed with it)";
const RAN_TWICE: &str = "the job's effect is not there exactly once: a later delivery applied \
    it again. The handler's key must be the same on every delivery of a job (a stable job id, \
    not a time or a random value), and every statement of the effect must run on the \
    transaction the handler is given";
const RACE_FAILED: &str = "concurrent deliveries of one job must wait for the one that holds \
    the key and then find its marker (Duplicate), or give up with InProgress so the broker \
    redelivers; any other error would make a healthy job fail";
const OUTSIDE_TX: &str = "the handler writes outside the transaction it is given (on the pool, \
    another connection, or in autocommit), so a failure between its effect and its commit \
    keeps the effect without the marker, and the redelivery applies it again. Run every \
    statement of the effect on `tx`; for effects in other systems use lease mode with an \
    idempotency key";
const RETRY_FAILED: &str = "a delivery that failed before its commit must leave the job as if \
    it never ran, so the redelivery applies it";
const NOT_IDEMPOTENT_OUTSIDE: &str = "the outside effect happened more than once: another \
    delivery of the same job made the outside call again, and the outside system acted again. \
    Pass `lease.idempotency_key()` to it (an `Idempotency-Key` header), which must answer a \
    repeated key with its first result instead of acting again";
const NEEDS_LEASE: &str = "expire_lease tests lease-mode handlers (`lease = \"30s\"`, a \
    `lease: &idem::Lease` parameter); a transaction-mode handler has no lease to expire, test \
    it with fail_before_commit";
const TAKEOVER_FAILED: &str = "a redelivery that finds an expired lease must take the key over \
    (attempt 2) and apply the job";
const FENCING_FAILED: &str = "a delivery whose lease was taken over must not report success: \
    the holder of the newer lease decides the outcome (Error::Lease(LeaseError::Lost))";

/// Begins a case's report with the effect read before any delivery; a check that already
/// reads `applied` could not tell whether the job ran, so it is refused.
pub(super) async fn baseline<C: Check>(
    case: &str,
    check: &mut C,
    applied: &C::Value,
) -> (Report, C::Value) {
    let mut report = Report::default();
    let before = check.read().await;
    report.checked("before any delivery", &before);
    if before == *applied {
        panic!(
            "idem::testing::{case}: the check already reads {before:?} before any delivery, \
             so it cannot tell whether the job applied; check something the job changes \
             (a fresh account's balance, a count of the job's rows)"
        );
    }
    (report, before)
}

/// Makes one delivery under `fault` and records it.
pub(super) async fn deliver_one(
    deliver: &mut impl Deliver,
    number: usize,
    fault: Fault,
    report: &mut Report,
) -> Delivery {
    let probe = Probe::new(fault, None);
    let result = probe.run(deliver.call()).await;
    report.push(delivery(number, &result, &probe)).clone()
}

pub(super) fn delivery<T: Debug, E: Debug>(
    number: usize,
    result: &Result<Outcome<T>, E>,
    probe: &Probe,
) -> Delivery {
    let seen = probe.seen();
    let got = match (result, &seen.ended) {
        (Ok(Outcome::Applied(_)), _) => Got::Applied,
        (Ok(Outcome::Duplicate), _) => Got::Duplicate,
        (Ok(Outcome::Replayed(_)), _) => Got::Replayed,
        (Ok(Outcome::Failed(_)), _) => Got::FailedForGood,
        (Err(_), Some(Ended::InProgress)) => Got::InProgress,
        (Err(_), Some(Ended::LeaseLost)) => Got::LeaseLost,
        (Err(_), Some(Ended::Injected)) => Got::Injected,
        (Err(_), _) => Got::Failed,
    };
    let returned = match result {
        Ok(outcome) => format!("Ok({outcome:?})"),
        Err(e) => format!("Err({e:?})"),
    };
    Delivery {
        number,
        got,
        returned,
        value: result
            .as_ref()
            .ok()
            .and_then(Outcome::value)
            .map(|v| format!("{v:?}")),
        attempt: seen.attempt,
        mode: seen.mode,
        idem_error: seen.idem_error,
    }
}

/// `later` must be a duplicate of `first`, and a replayed value must be `first`'s value.
pub(super) fn expect_duplicate(case: &str, report: &Report, later: &Delivery, first: &Delivery) {
    if !later.got.is_duplicate() {
        let what = format!(
            "delivery {}, after delivery {} applied, got {:?}, not Duplicate",
            later.number, first.number, later.got
        );
        fail(case, report, &what, RAN_TWICE);
    }
    if later.got == Got::Replayed && later.value != first.value {
        let what = format!(
            "delivery {} replayed {}, but delivery {} had returned {}",
            later.number,
            later.value.as_deref().unwrap_or("nothing"),
            first.number,
            first.value.as_deref().unwrap_or("nothing"),
        );
        fail(
            case,
            report,
            &what,
            "a replayed value must be the first delivery's (compared as `Debug` prints them)",
        );
    }
}

/// Why a first delivery that should have applied did not, by what it got.
fn not_applied(got: Got) -> &'static str {
    match got {
        Got::Duplicate | Got::Replayed => NEVER_SEEN,
        Got::InProgress => {
            "another delivery held the job's key: nothing else may deliver the job while the \
             case runs (give each case its own job id)"
        }
        _ => {
            "the delivery failed on its own before its commit (its error is above): the kit \
             needs a handler that applies the job when nothing goes wrong"
        }
    }
}

/// The kit reaches a call through a task-local: a delivery in which no claim was seen ran its
/// handler elsewhere (or is no idempotent handler), and nothing the kit injects would reach it.
pub(super) fn seen_claiming(case: &str, report: &Report, d: &Delivery) {
    if d.mode.is_none() {
        let what = format!(
            "the kit saw no claim in delivery {}, which got {:?}",
            d.number, d.got
        );
        fail(case, report, &what, NO_CLAIM);
    }
}

pub(super) fn fail(case: &str, report: &Report, what: &str, why: &str) -> ! {
    panic!("idem::testing::{case}: {what}.\n{why}.\nWhat happened:\n{report}")
}

/// Polls every call on the current task until all are done: they are in flight together
/// without being spawned, so they may borrow the test's store and job.
async fn join_all<F: Future>(calls: Vec<F>) -> Vec<F::Output> {
    let mut calls: Vec<_> = calls.into_iter().map(Box::pin).collect();
    let mut outs: Vec<Option<F::Output>> = calls.iter().map(|_| None).collect();
    poll_fn(|cx| {
        let mut pending = false;
        for (call, out) in calls.iter_mut().zip(outs.iter_mut()) {
            if out.is_none() {
                match call.as_mut().poll(cx) {
                    Poll::Ready(v) => *out = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outs.into_iter()
        .map(|o| o.expect("every call is done"))
        .collect()
}
