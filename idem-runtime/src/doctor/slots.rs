//! The WAL relay's slots: a slot no relay confirms keeps the server's WAL without bound, and an
//! invalidated one has lost the messages it held.

use super::{Finding, Severity};
use crate::backend::Slot;

/// Bytes in the form an operator reads them.
fn size(bytes: i64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30)),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20)),
        b => format!("{b} bytes"),
    }
}

/// The worst of the database's pgoutput slots, against `lag` (bytes not yet confirmed).
pub(super) fn slots(slots: Option<Vec<Slot>>, lag: i64) -> Finding {
    let Some(slots) = slots else {
        return Finding::new(
            "wal_slots",
            Severity::Skipped,
            "not on this database (the WAL relay is PostgreSQL's)",
        );
    };
    if slots.is_empty() {
        return Finding::new(
            "wal_slots",
            Severity::Ok,
            "no logical replication slot of pgoutput in this database (no WAL relay)",
        );
    }
    let mut worst = Finding::new(
        "wal_slots",
        Severity::Ok,
        format!(
            "{} slot(s) of pgoutput, each confirmed within {} of the WAL's end",
            slots.len(),
            size(lag)
        ),
    );
    for (name, unconfirmed, retained, active, status) in slots {
        let finding = if status == "lost" {
            Finding::new(
                "wal_slots",
                Severity::Problem,
                format!(
                    "the slot {name} was invalidated: the WAL it held is gone, and with it the \
                     messages no relay had confirmed"
                ),
            )
            .fix(
                "drop the slot (`WalRelay::drop_slot`, or SELECT pg_drop_replication_slot('NAME')), \
                 set the relay up again, and \
                 resend what the jobs of the gap should have sent; to keep a slot from falling \
                 that far behind, keep its relay running (a standby relay takes over)",
            )
        } else if unconfirmed > lag || (active == 0 && unconfirmed > 0) {
            let who = match active == 1 {
                true => "its relay is streaming but behind",
                false => "no relay streams from it",
            };
            Finding::new(
                "wal_slots",
                Severity::Warning,
                format!(
                    "the slot {name} has {} of WAL not confirmed ({} retained; wal_status \
                     {status}): {who}",
                    size(unconfirmed),
                    size(retained)
                ),
            )
            .fix(
                "start (or fix) the WAL relay of this slot; a slot no relay reads keeps the \
                 server's WAL growing: cap it with max_slot_wal_keep_size, or drop a slot no \
                 relay will use again (`WalRelay::drop_slot`, or SELECT \
                 pg_drop_replication_slot('NAME'))",
            )
        } else {
            continue;
        };
        if finding.severity > worst.severity {
            worst = finding;
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(unconfirmed: i64, active: bool, status: &str) -> Slot {
        let active = i64::from(active);
        (
            "s".to_owned(),
            unconfirmed,
            unconfirmed,
            active,
            status.to_owned(),
        )
    }

    #[test]
    fn each_slot_is_judged_by_its_lag_its_relay_and_its_status() {
        let gib = 1 << 30;
        for (given, severity) in [
            (None, Severity::Skipped),
            (Some(vec![]), Severity::Ok),
            (Some(vec![slot(0, false, "reserved")]), Severity::Ok),
            (Some(vec![slot(10, true, "reserved")]), Severity::Ok),
            (Some(vec![slot(10, false, "reserved")]), Severity::Warning),
            (
                Some(vec![slot(2 * gib, true, "extended")]),
                Severity::Warning,
            ),
            (
                Some(vec![slot(10, true, "reserved"), slot(0, false, "lost")]),
                Severity::Problem,
            ),
        ] {
            let found = slots(given.clone(), gib);
            assert_eq!(found.severity, severity, "{given:?}: {found:?}");
        }
    }
}
