//! Steps across processes: a worker killed (SIGKILL) right after each step in turn; the
//! redelivery replays the recorded steps and runs the rest, so each effect happens once.

use super::lease::{CHARGES_COLUMNS, db_now_plus};
use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::Job;
use crate::conformance::lease_handlers::Provider;
use crate::conformance::step_handlers::*;
use crate::conformance::worker::{self, Worker, child_env};

/// Order of the worker process of [`steps_are_replayed_after_the_worker_is_killed_after_each_step`]:
/// the step after which it hangs.
pub(crate) const CHILD_STOP_AFTER: &str = "IDEM_CONFORMANCE_STOP_AFTER";

pub(crate) async fn steps_are_replayed_after_the_worker_is_killed_after_each_step<S: Support>() {
    let mut ctx = Ctx::<S>::new("steps_kill", 2).await;
    let charges = ctx.create_table("c", CHARGES_COLUMNS).await;
    let outside = S::connect(&ctx.url, 1).await;
    let provider = Provider::table(outside.clone(), &charges);
    for after in 1..=3_u32 {
        let job = ctx.job(&format!("order-k{after}"), 40 + i64::from(after), 4000);
        let mut w = Worker::spawn(
            "steps_hang",
            &[
                (worker::CHILD_MODE, "steps_hang".to_owned()),
                (worker::CHILD_URL, ctx.url.clone()),
                (worker::CHILD_MARKERS, ctx.store.table().to_owned()),
                (worker::CHILD_EFFECTS, ctx.effects.clone()),
                (worker::CHILD_KEY, job.key.clone()),
                (worker::CHILD_JOBS, charges.clone()),
                (CHILD_STOP_AFTER, after.to_string()),
            ],
        );
        w.expect_line(&format!("AFTER_STEP {after}")).await;
        let status = w.kill().await;
        {
            use ::std::os::unix::process::ExitStatusExt as _;
            assert_eq!(status.signal(), Some(9), "worker status {status:?}");
        }
        let n = after as usize;
        let mut expected = [0_i64; 3];
        expected[..n].fill(1);
        assert_eq!(
            ctx.step_effects(&charges, &job).await,
            expected,
            "killed after step {after}"
        );
        assert_eq!(ctx.recorded_steps(CHECKOUT, &job.key).await.len(), n);
        // The killed worker's lease runs out (on the database's clock), and the job is
        // delivered again.
        ctx.set_locked_until(&job.key, &db_now_plus::<S>(-1000))
            .await;
        let done = applied_checkout(checkout(&ctx.store, &job, &provider, Stop::Never).await);
        let ran_by = |step: u32| if step <= after { 1 } else { 2 };
        assert_eq!(
            done,
            Checkout {
                charge: format!("ch-{}-attempt-{}", job.id, ran_by(1)),
                mail: format!("mail-{}-attempt-{}", job.id, ran_by(2)),
                ledger: ran_by(3),
            },
            "killed after step {after}"
        );
        assert_eq!(
            ctx.step_effects(&charges, &job).await,
            [1, 1, 1],
            "each effect once, killed after step {after}"
        );
    }
    outside.close().await;
    ctx.cleanup().await;
}

/// The worker process's side: runs the checkout of its job, hanging after its step.
pub(crate) async fn steps_child<S: Support>(url: &str, markers: &str, effects: &str) {
    let pool = S::connect(url, 2).await;
    let store = idem::Store::new(pool)
        .with_table(markers)
        .expect("table name");
    let provider = Provider::table(S::connect(url, 1).await, &child_env(worker::CHILD_JOBS));
    let after: u32 = child_env(CHILD_STOP_AFTER).parse().expect("a step");
    let key = child_env(worker::CHILD_KEY);
    let id = key
        .strip_prefix("order-k")
        .and_then(|n| n.parse::<i64>().ok())
        .map(|n| 40 + n)
        .expect("a job key of the case");
    let job = Job {
        key,
        id,
        amount: 4000,
        effects: effects.to_owned(),
    };
    let r = checkout(&store, &job, &provider, Stop::HangAfter(after)).await;
    panic!("the handler returned {r:?}; it should have hung after step {after}");
}
