//! The database restarted while calls are inside a group: the harness binary's
//! `group-restart` case, on a PostgreSQL cluster and a MariaDB datadir of its own (about
//! 15 s, most of it starting the servers). It exits non-zero naming what it found.

use std::process::Command;

#[test]
fn a_database_restart_inside_a_group_loses_nothing_and_redelivery_applies_each_once() {
    let status = Command::new(env!("CARGO_BIN_EXE_idem-chaos"))
        .arg("group-restart")
        .status()
        .expect("the chaos harness starts");
    assert!(
        status.success(),
        "the group-restart case failed ({status}): its output above says what it found"
    );
}
