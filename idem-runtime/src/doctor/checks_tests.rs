//! The checks' verdicts at their thresholds.

use super::*;

#[test]
fn bloat_is_a_warning_only_past_its_thresholds() {
    let sev = |b| bloat("t", Some(b)).severity;
    assert_eq!(
        sev(Bloat::Rows {
            dead: 50_000,
            live: 100_000
        }),
        Severity::Warning
    );
    assert_eq!(
        sev(Bloat::Rows {
            dead: 5_000,
            live: 100
        }),
        Severity::Ok
    );
    assert_eq!(
        sev(Bloat::Rows {
            dead: 50_000,
            live: 1_000_000
        }),
        Severity::Ok
    );
    assert_eq!(
        sev(Bloat::Pages {
            free: 2_000,
            total: 4_000
        }),
        Severity::Warning
    );
    assert_eq!(
        sev(Bloat::Bytes {
            free: 1 << 30,
            used: 1 << 30
        }),
        Severity::Warning
    );
    assert_eq!(bloat("t", None).severity, Severity::Skipped);
}

#[test]
fn wait_and_lease_are_checked_against_the_ack_timeout() {
    let secs = Duration::from_secs;
    let check = |c: Checkup| ack_timeout(&c).severity;
    assert_eq!(check(Checkup::new()), Severity::Skipped);
    let sqs = Checkup::new().ack_timeout(secs(30));
    assert_eq!(check(sqs.clone().wait(secs(5))), Severity::Ok);
    assert_eq!(check(sqs.clone().wait(secs(30))), Severity::Problem);
    assert_eq!(check(sqs.lease(secs(60))), Severity::Warning);
}

#[test]
fn the_pool_wants_one_connection_more_than_the_jobs() {
    assert_eq!(pool_check(9, Some(8), Some(100)).severity, Severity::Ok);
    assert_eq!(pool_check(8, Some(8), None).severity, Severity::Warning);
    assert_eq!(
        pool_check(200, Some(8), Some(100)).severity,
        Severity::Problem
    );
    assert_eq!(pool_check(9, None, None).severity, Severity::Skipped);
}

#[test]
fn a_pooler_shows_as_another_port() {
    let untold = pooler(Some((6432, 5432)), false);
    assert_eq!(untold.severity, Severity::Warning);
    let fix = untold.fix.unwrap_or_default();
    assert!(fix.contains("Store::behind_transaction_pooler()"), "{fix}");
    assert_eq!(pooler(Some((6432, 5432)), true).severity, Severity::Ok);
    assert_eq!(pooler(Some((5432, 5432)), false).severity, Severity::Ok);
    assert_eq!(pooler(None, false).severity, Severity::Skipped);
}

#[test]
fn a_clock_off_by_more_than_the_tolerance_is_a_warning() {
    let t0 = UNIX_EPOCH + Duration::from_secs(1_000_000);
    let t1 = t0 + Duration::from_millis(20);
    let host = 1_000_000_010;
    let check = |db| clock(Some(db), t0, t1, Duration::from_secs(1)).severity;
    assert_eq!(check(host + 500), Severity::Ok);
    assert_eq!(check(host + 5_000), Severity::Warning);
    assert_eq!(check(host - 5_000), Severity::Warning);
    assert_eq!(
        clock(None, t0, t1, Duration::ZERO).severity,
        Severity::Skipped
    );
}
