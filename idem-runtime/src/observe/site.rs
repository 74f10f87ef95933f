//! The metric labels of a scope, built once: at compile time for a handler (a `static` of the
//! generated code), at the first claim for a scope named at run time (a hand-written claim, an
//! HTTP layer), so that recording a metric neither allocates nor formats.

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

use metrics::{Key, Label};

use super::verdict::{COUNT, Verdict};
use super::{CLAIM_SECONDS, OUTCOMES_TOTAL};

/// The labels of one scope: `(scope, outcome)` for every outcome, and `scope` alone.
#[doc(hidden)]
#[derive(Debug)]
pub struct Site {
    pub(super) outcomes: [[Label; 2]; COUNT],
    pub(super) scope_only: [Label; 1],
    /// The metric keys of those labels, made (and hashed) at the scope's first call.
    keys: OnceLock<Keys>,
}

#[derive(Debug)]
struct Keys {
    outcomes: [Key; COUNT],
    claim_seconds: Key,
}

/// Scopes named at run time whose labels are kept; past this many, a process counts the rest
/// under [`OVERFLOW`]. Scopes are the stable names of a process's handlers, a few dozen at
/// most; the bound keeps scopes made from data (a mistake) from growing memory without end.
const MAX_SCOPES: usize = 1_000;

/// The scope label of the calls past [`MAX_SCOPES`] distinct run-time scopes (their spans
/// still name their own).
pub(super) const OVERFLOW: &str = "_overflow";

impl Site {
    /// The labels of `scope`, built at compile time.
    pub const fn new(scope: &'static str) -> Site {
        const fn pair(scope: &'static str, outcome: usize) -> [Label; 2] {
            [
                Label::from_static_parts("scope", scope),
                Label::from_static_parts("outcome", Verdict::ALL[outcome]),
            ]
        }
        Site {
            outcomes: [
                pair(scope, 0),
                pair(scope, 1),
                pair(scope, 2),
                pair(scope, 3),
                pair(scope, 4),
                pair(scope, 5),
                pair(scope, 6),
                pair(scope, 7),
                pair(scope, 8),
                pair(scope, 9),
                pair(scope, 10),
                pair(scope, 11),
            ],
            scope_only: [Label::from_static_parts("scope", scope)],
            keys: OnceLock::new(),
        }
    }

    fn keys(&self) -> &Keys {
        self.keys.get_or_init(|| Keys {
            outcomes: std::array::from_fn(|v| {
                Key::from_parts(OUTCOMES_TOTAL, self.outcomes[v].to_vec())
            }),
            claim_seconds: Key::from_parts(CLAIM_SECONDS, self.scope_only.to_vec()),
        })
    }

    /// The key of `idem_outcomes_total` for this scope and the outcome `verdict`.
    pub(super) fn outcome_key(&self, verdict: Verdict) -> &Key {
        &self.keys().outcomes[verdict as usize]
    }

    /// The key of `idem_claim_seconds` for this scope.
    pub(super) fn claim_seconds_key(&self) -> &Key {
        &self.keys().claim_seconds
    }

    /// The labels of `scope`, a scope named at run time: made at its first claim in the
    /// process and kept, one lookup a claim after that.
    pub(crate) fn of(scope: &str) -> &'static Site {
        static SITES: OnceLock<RwLock<HashMap<&'static str, &'static Site>>> = OnceLock::new();
        static OVERFLOWING: Site = Site::new(OVERFLOW);
        let sites = SITES.get_or_init(Default::default);
        if let Some(site) = sites.read().unwrap_or_else(|e| e.into_inner()).get(scope) {
            return site;
        }
        let mut sites = sites.write().unwrap_or_else(|e| e.into_inner());
        if let Some(site) = sites.get(scope) {
            return site;
        }
        if sites.len() >= MAX_SCOPES {
            return &OVERFLOWING;
        }
        // Kept for the process's life: at most MAX_SCOPES of them.
        let scope: &'static str = Box::leak(scope.into());
        let site: &'static Site = Box::leak(Box::new(Site::new(scope)));
        sites.insert(scope, site);
        site
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_named_at_run_time_gets_its_labels_once() {
        let a = Site::of("tests.site.a");
        assert!(std::ptr::eq(a, Site::of(&String::from("tests.site.a"))));
        assert_eq!(a.scope_only[0].value(), "tests.site.a");
        assert!(!std::ptr::eq(a, Site::of("tests.site.b")));
    }

    #[test]
    fn each_outcome_has_its_key() {
        let site = Site::new("tests.site.keys");
        for (verdict, label) in [
            (Verdict::Applied, "applied"),
            (Verdict::InProgress, "in_progress"),
            (Verdict::Error, "error"),
        ] {
            let key = site.outcome_key(verdict);
            assert_eq!(key.name(), OUTCOMES_TOTAL);
            let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
            assert_eq!(labels, [("scope", "tests.site.keys"), ("outcome", label)]);
        }
        let seconds = site.claim_seconds_key();
        assert_eq!(seconds.name(), CLAIM_SECONDS);
        assert_eq!(seconds.labels().count(), 1);
    }
}
