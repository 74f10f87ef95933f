//! The case of lease handlers with steps: a crash after each step in turn, and every step run
//! once across the deliveries.

use super::call::{Check, Deliver};
use super::cases::{baseline, delivery, expect_duplicate, fail, seen_claiming};
use super::probe::{Fault, Mode, Probe};
use super::{Got, Report};

/// The most steps [`crash_after_each_step`] crashes after: a body that reaches more is
/// refused (each crash is one more delivery).
pub const MAX_CRASHES: u32 = 64;

/// Lease mode with steps ([`Lease::step`](crate::Lease::step)): crashes the job's delivery
/// right after its first step, redelivers it crashing right after its second step, and so on,
/// until a delivery runs to its end; then delivers it once more.
///
/// A crash leaves what a killed worker leaves: the steps recorded so far, and a lease that the
/// next delivery takes over (the kit releases it rather than wait for it to run out). Nothing
/// of the crashed delivery after its step runs: its next step is refused at once, and its end
/// does not complete the marker.
///
/// Every step must run exactly once across all the deliveries (the others read it back), the
/// last delivery must be `Applied` and the one after it a `Duplicate` (or `Replayed` with the
/// same value), and `check` must read `applied`, having read something else before.
///
/// Panics on a transaction-mode handler, on a handler that records no step, and on any
/// violation, naming the step and the deliveries that ran it.
pub async fn crash_after_each_step<C: Check>(
    mut deliver: impl Deliver,
    mut check: C,
    applied: C::Value,
) -> Report {
    let case = "crash_after_each_step";
    let (mut report, before) = baseline(case, &mut check, &applied).await;
    // Per step name, the deliveries whose body ran it.
    let mut runs: Vec<(String, Vec<usize>)> = Vec::new();
    let mut number = 0;
    let last = loop {
        number += 1;
        let crash_at = u32::try_from(number).unwrap_or(u32::MAX);
        let probe = Probe::new(Fault::CrashAfterStep(crash_at), None);
        let result = probe.run(deliver.call()).await;
        let d = report.push(delivery(number, &result, &probe)).clone();
        let seen = probe.seen();
        for (name, ran) in seen.steps {
            let i = match runs.iter().position(|(n, _)| *n == name) {
                Some(i) => i,
                None => {
                    runs.push((name, Vec::new()));
                    runs.len() - 1
                }
            };
            if ran {
                runs[i].1.push(number);
            }
        }
        seen_claiming(case, &report, &d);
        if d.mode == Some(Mode::Transaction) {
            let what = "delivery 1 claimed in a transaction, not a lease";
            fail(case, &report, what, NEEDS_LEASE_STEPS);
        }
        if !seen.crashed {
            break d;
        }
        if crash_at >= MAX_CRASHES {
            let what = format!("the body reached more than {MAX_CRASHES} steps");
            fail(case, &report, &what, "test a handler of fewer steps");
        }
    };
    let after = check.read().await;
    report.checked("after the last delivery", &after);
    let again = super::cases::deliver_one(&mut deliver, number + 1, Fault::None, &mut report).await;

    if runs.is_empty() {
        let what = format!("delivery 1 got {:?} and recorded no step", report.got()[0]);
        fail(case, &report, &what, NEEDS_LEASE_STEPS);
    }
    if last.got != Got::Applied {
        let what = format!(
            "delivery {}, the first not crashed after a step, got {:?}, not Applied",
            last.number, last.got
        );
        fail(case, &report, &what, RESUME_FAILED);
    }
    for (name, ran_in) in &runs {
        if ran_in.len() != 1 {
            let what = format!(
                "the step {name:?} ran in {} deliveries ({ran_in:?}), not 1",
                ran_in.len()
            );
            fail(case, &report, &what, STEP_RAN_TWICE);
        }
    }
    if after != applied {
        let what = format!(
            "after the deliveries, the check read {after:?}, not {applied:?} (before: \
             {before:?})"
        );
        fail(case, &report, &what, EFFECT_TWICE);
    }
    expect_duplicate(case, &report, &again, &last);
    report
}

const NEEDS_LEASE_STEPS: &str = "crash_after_each_step tests lease-mode handlers whose body \
    runs its outside calls as steps (`lease.step(\"charge\", ..)`); test a transaction-mode \
    handler with fail_before_commit";
const RESUME_FAILED: &str = "a delivery after crashed ones must resume after their recorded \
    steps and apply the job";
const STEP_RAN_TWICE: &str = "a recorded step must be read back by later deliveries, never run \
    again: give each step a stable name (not one made of a time or a random value), and run \
    every outside call inside a step";
const EFFECT_TWICE: &str = "the job's effect is not there exactly once: an outside call outside \
    of any step ran again in a later delivery, or a step's call is not the step's own (pass \
    `step.idempotency_key()` to the outside system)";
