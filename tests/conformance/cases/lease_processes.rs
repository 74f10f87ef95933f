//! Lease mode across processes: a worker killed inside its outside call, and a worker paused
//! (SIGSTOP) past its lease. The provider is a table written on pools of their own, which
//! records every request with its idempotency key; deduplicating on the key, it charges once
//! per distinct key.

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{Job, TestError};
use crate::conformance::lease_handlers::*;
use crate::conformance::util::{until, within};
use crate::conformance::worker::{self, Worker, child_env};

use super::lease::CHARGES_COLUMNS;

/// Requests the provider's table holds, in all and for distinct keys.
async fn provider_counts<S: Support>(ctx: &Ctx<S>, charges: &str) -> (i64, i64) {
    let all = ctx.scalar(&format!("SELECT COUNT(*) FROM {charges}")).await;
    let distinct = ctx
        .scalar(&format!(
            "SELECT COUNT(DISTINCT idempotency_key) FROM {charges}"
        ))
        .await;
    (all, distinct)
}

fn spawn_child<S: Support>(ctx: &Ctx<S>, mode: &str, charges: &str, job: &Job) -> Worker {
    Worker::spawn(
        mode,
        &[
            (worker::CHILD_MODE, mode.to_owned()),
            (worker::CHILD_URL, ctx.url.clone()),
            (worker::CHILD_MARKERS, ctx.store.table().to_owned()),
            (worker::CHILD_EFFECTS, charges.to_owned()),
            (worker::CHILD_KEY, job.key.clone()),
        ],
    )
}

/// `kill -<sig> <pid>`.
async fn signal(pid: u32, sig: &str) {
    let status = tokio::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .await
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {pid}: {status}");
}

/// The state letter of process `pid` in `/proc/<pid>/stat` (`T` when stopped).
fn process_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc stat");
    // `pid (comm) S ...`: the state follows the last `)`.
    let after = &stat[stat.rfind(')').expect("comm") + 1..];
    after.trim_start().chars().next().expect("state")
}

pub(crate) async fn lease_worker_killed_in_its_call_is_taken_over_with_the_same_key<S: Support>() {
    let mut ctx = Ctx::<S>::new("lease_kill", 2).await;
    let charges = ctx.create_table("c", CHARGES_COLUMNS).await;
    let outside = S::connect(&ctx.url, 1).await;
    let provider = Provider::table(outside.clone(), &charges);
    let job = ctx.job("order-5", 5, 500);
    let mut w = spawn_child(&ctx, "lease_hang", &charges, &job);
    // The request reached the provider; its answer never comes back.
    let line = w.expect_line("IN_CALL").await;
    let status = w.kill().await;
    {
        use ::std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(9), "worker status {status:?}");
    }
    let mut words = line.split_whitespace().skip(1);
    let child_key = words
        .next()
        .expect("the child's idempotency key")
        .to_owned();
    let child_token: i64 = words
        .next()
        .and_then(|w| w.strip_prefix("token="))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("the child's token: {line:?}"));
    assert!(child_token > 0, "{line:?}");
    assert_eq!(provider_counts(&ctx, &charges).await, (1, 1));

    // The dead worker's lease (8 s) is still live: the next delivery is refused at once.
    in_progress(charge(&ctx.store, &job, &provider, How::Pay).await);
    let m = ctx.marker(&job.key).await;
    assert!(
        m.live && m.token == child_token,
        "the 8 s lease ran out before the check (a machine stalled that long?): {m:?}"
    );
    assert_eq!(provider.requests(), 0, "the refused delivery's body ran");

    // Once the database says it ran out, one delivery takes over, with the same key.
    let polls = ctx.until_lease_expired(&job.key).await;
    println!("killed worker's lease expired after {polls} polls of the database");
    let seen = applied_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert!(seen.token > child_token, "{seen:?} after {child_token}");
    assert_eq!(seen.attempt, 2);
    assert_eq!(
        seen.idempotency_key, child_key,
        "the retry's idempotency key"
    );
    duplicate_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    // Two requests with one key: a provider that deduplicates on it charged once.
    assert_eq!(provider_counts(&ctx, &charges).await, (2, 1));
    let key_rows = ctx
        .scalar_with(
            &format!("SELECT COUNT(*) FROM {charges} WHERE idempotency_key = $1"),
            &[crate::conformance::db::Bind::Str(child_key)],
        )
        .await;
    assert_eq!(key_rows, 2);
    let m = ctx.marker(&job.key).await;
    assert!(
        m.completed && m.token == seen.token && m.attempts == 2,
        "{m:?}"
    );
    outside.close().await;
    ctx.cleanup().await;
}

pub(crate) async fn lease_paused_holder_resumed_after_a_takeover_gets_lease_lost<S: Support>() {
    let mut ctx = Ctx::<S>::new("lease_pause", 2).await;
    let charges = ctx.create_table("c", CHARGES_COLUMNS).await;
    let outside = S::connect(&ctx.url, 1).await;
    let provider = Provider::table(outside.clone(), &charges);
    let job = ctx.job("order-6", 6, 600);
    let mut w = spawn_child(&ctx, "lease_block", &charges, &job);
    let line = w.expect_line("IN_BODY").await;
    let paused: i64 = line
        .strip_prefix("IN_BODY token=")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("the paused worker's token: {line:?}"));
    assert!(paused > 0, "{line:?}");
    let pid = w.pid();
    signal(pid, "STOP").await;
    until(60, "the worker to stop", || async move {
        process_state(pid) == 'T'
    })
    .await;

    // While it is stopped, its 1 s lease runs out on the database and a delivery takes over.
    let polls = ctx.until_lease_expired(&job.key).await;
    println!("paused worker's lease expired after {polls} polls of the database");
    let seen = applied_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert!(seen.token > paused, "{seen:?} after {paused}");
    assert_eq!(seen.attempt, 2);
    let m = ctx.marker(&job.key).await;
    assert!(m.completed && m.token == seen.token, "{m:?}");

    // Resumed, the paused body returns `Ok`: the stale token completes nothing.
    w.send("GO").await;
    signal(pid, "CONT").await;
    let result = w.expect_line("RESULT").await;
    assert_eq!(result, "RESULT LeaseLost", "the paused worker's outcome");
    w.succeed().await;
    let m = ctx.marker(&job.key).await;
    assert!(
        m.completed && m.unlocked && m.token == seen.token && m.attempts == 2,
        "the taker's completion was overwritten: {m:?}"
    );
    assert_eq!(provider_counts(&ctx, &charges).await, (2, 1));
    outside.close().await;
    ctx.cleanup().await;
}

/// The worker process's side of the lease cases (`IDEM_CONFORMANCE_CHILD` = `lease_hang` or
/// `lease_block`).
pub(crate) async fn lease_child<S: Support>(mode: &str, url: &str, markers: &str, charges: &str) {
    let store_pool = S::connect(url, 1).await;
    let store = idem::Store::new(store_pool)
        .with_table(markers)
        .expect("table name");
    let provider = Provider::table(S::connect(url, 1).await, charges);
    let job = Job {
        key: child_env(worker::CHILD_KEY),
        id: 0,
        amount: 0,
        effects: String::new(),
    };
    match mode {
        "lease_hang" => {
            let r = charge_and_hang(&store, &job, &provider).await;
            panic!("the handler returned {r:?}; it should have hung in its call");
        }
        "lease_block" => {
            let r = within(
                120,
                "the paused call",
                charge_then_block(&store, &job, &provider),
            );
            match r.await {
                Err(TestError::Idem(idem::Error::Lease(idem::LeaseError::Lost { .. }))) => {
                    println!("RESULT LeaseLost")
                }
                other => println!("RESULT {other:?}"),
            }
        }
        other => panic!("unknown lease mode {other:?}"),
    }
}
