//! CI's bounded chaos soak: the harness binary run for 60 s on a fixed seed, with its own
//! servers (10 to 20 s to start them) and a drain of at most 90 s. The binary prints the
//! schedule as it is applied and the table; it exits non-zero on any violation of the
//! checker, naming the seed.

use std::process::Command;
use std::time::{Duration, Instant};

/// The seed of CI's schedule; a failure is replayed with
/// `cargo run -p idem-chaos -- --duration 60s --seed 20261201`.
const SEED: &str = "20261201";

/// Far more than a run takes (about 80 s): a harness stuck past it is killed, and fails.
const LIMIT: Duration = Duration::from_secs(420);

#[test]
fn a_seeded_schedule_of_faults_leaves_every_job_applied_exactly_once() {
    let mut harness = Command::new(env!("CARGO_BIN_EXE_idem-chaos"))
        .args(["--duration", "60s", "--seed", SEED, "--drain", "90s"])
        .spawn()
        .expect("the chaos harness starts");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = harness.try_wait().expect("the harness's status") {
            break status;
        }
        if started.elapsed() > LIMIT {
            drop(harness.kill());
            panic!("the chaos soak (seed {SEED}) ran past {LIMIT:?} and was killed");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "the chaos soak failed ({status}) with seed {SEED}: its output above lists the \
         violations"
    );
}
