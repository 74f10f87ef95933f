//! CI's bounded chaos soak: the harness binary run for 60 s on a fixed seed, with its own
//! servers (about 10 s to start them) and a drain of at most 90 s. The binary prints the
//! schedule as it is applied and the table; it exits non-zero on any violation of the
//! checker, naming the seed.

use std::process::Command;

/// The seed of CI's schedule; a failure is replayed with
/// `cargo run -p idem-chaos -- --duration 60s --seed 20261201`.
const SEED: &str = "20261201";

#[test]
fn a_seeded_schedule_of_faults_leaves_every_job_applied_exactly_once() {
    let status = Command::new(env!("CARGO_BIN_EXE_idem-chaos"))
        .args(["--duration", "60s", "--seed", SEED, "--drain", "90s"])
        .status()
        .expect("the chaos harness runs");
    assert!(
        status.success(),
        "the chaos soak failed ({status}) with seed {SEED}: its output above lists the \
         violations"
    );
}
