//! The rows the backends return, as the claim core reads them.

use crate::Recorded;

/// What a marker that a claim could not insert says, on the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// The job's effect was committed (or its lease-mode call completed).
    Completed,
    /// Another delivery holds a lease that has not run out.
    Live,
    /// A lease that was released or ran out: the next delivery takes it over.
    Free,
}

impl Hold {
    /// From the `state` column and whether the lease is over (`locked_until` passed or unset).
    pub(crate) fn of(state: &str, lease_over: bool) -> Hold {
        match (state, lease_over) {
            ("completed", _) => Hold::Completed,
            (_, true) => Hold::Free,
            (_, false) => Hold::Live,
        }
    }
}

/// A marker found in place: what it says, and what it recorded.
#[derive(Debug, Clone)]
pub struct Found {
    pub(crate) hold: Hold,
    pub(crate) recorded: Recorded,
}

impl Found {
    /// From a row of the `marker` statement: `(state, lease over (0 or 1), fingerprint,
    /// result)`.
    pub(crate) fn of_row(row: (String, i64, Option<Vec<u8>>, Option<String>)) -> Found {
        let (state, over, fingerprint, result) = row;
        Found {
            hold: Hold::of(&state, over != 0),
            recorded: Recorded {
                fingerprint,
                result,
            },
        }
    }
}

/// What a lease-mode claim statement found.
#[derive(Debug, Clone)]
pub enum LeaseState {
    /// This delivery holds the key now: fresh, or taken over from an earlier holder.
    Taken { token: i64, attempts: i64 },
    /// A marker it could not take.
    Found(Found),
    /// No marker (forgotten or purged between two statements): claim again.
    Missing,
}

/// The columns of `Store::inspect` in the order the backends' statements return them:
/// scope, key, state, attempts, token, created, completed, locked until, lease ms left.
pub(crate) type MarkerRow = (
    String,
    String,
    String,
    i64,
    Option<i64>,
    String,
    Option<String>,
    Option<String>,
    Option<i64>,
);

/// The columns of the outbox's operator statements: id, destination, scope, key, seq,
/// attempts, last error, parked (0 or 1), sent (0 or 1), created (ISO-8601 UTC), age ms, ms
/// until due (negative once due).
pub(crate) type OutboxRow = (
    String,
    String,
    String,
    String,
    i64,
    i64,
    Option<String>,
    i64,
    i64,
    String,
    i64,
    i64,
);
