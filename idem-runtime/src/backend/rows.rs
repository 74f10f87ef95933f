//! The rows the backends return, as the claim core reads them.

use crate::outgoing::{Headers, Message};
use crate::record::Recorded;

/// Who holds the key of a marker that a claim found, on the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// The job's effect was committed (or its lease-mode call completed).
    Completed,
    /// Another delivery holds a lease that has not run out.
    Leased,
    /// A lease that was released or ran out: the next delivery takes it over.
    Free,
}

impl Status {
    /// From the `state` column and whether the lease is over (`locked_until` passed or unset).
    pub(crate) fn of(state: &str, lease_over: bool) -> Status {
        match (state, lease_over) {
            ("completed", _) => Status::Completed,
            (_, true) => Status::Free,
            (_, false) => Status::Leased,
        }
    }
}

/// A marker found in place: who holds it, and what it recorded.
#[derive(Debug, Clone)]
pub struct Found {
    pub(crate) status: Status,
    pub(crate) recorded: Recorded,
}

/// A row of a `marker` statement: `(state, lease over (0 or 1), fingerprint, result, error)`.
pub(crate) type MarkerState = (String, i64, Option<Vec<u8>>, Option<String>, Option<String>);

impl Found {
    /// From a row of a `marker` statement.
    pub(crate) fn of_row(row: MarkerState) -> Found {
        let (state, over, fingerprint, result, error) = row;
        Found {
            status: Status::of(&state, over != 0),
            recorded: Recorded {
                fingerprint,
                result,
                error,
            },
        }
    }

    /// A completed marker with nothing to tell beyond that (MySQL's claim answers as much
    /// without a read): a plain duplicate.
    #[cfg(feature = "mysql")]
    pub(crate) fn duplicate() -> Found {
        Found {
            status: Status::Completed,
            recorded: Recorded::default(),
        }
    }

    /// A marker of which only the status (and a failure it completed with) was read (a
    /// batch's).
    pub(crate) fn of_status(state: &str, over: i64, error: Option<String>) -> Found {
        Found {
            status: Status::of(state, over != 0),
            recorded: Recorded {
                error,
                ..Recorded::default()
            },
        }
    }
}

/// What a lease-mode claim statement found.
#[derive(Debug, Clone)]
pub enum LeaseState {
    /// This delivery holds the key now: fresh (`attempts` 1), or taken over from an earlier
    /// holder.
    Taken { token: i64, attempts: i64 },
    /// A marker it could not take.
    Found(Found),
    /// No marker (forgotten or purged between two statements): claim again.
    Missing,
}

/// The columns of `Store::inspect` in the order the backends' statements return them:
/// scope, key, state, attempts, token, created, completed, locked until, lease ms left, the
/// error a failed job recorded.
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
    Option<String>,
);

/// A recorded step as the backends' statements return it: name, position in its body (from
/// 1), the recording holder's token, value (JSON), when it was recorded (ISO-8601 UTC).
pub(crate) type StepRow = (String, i64, i64, String, String);

/// The columns of the outbox's operator statements: id, destination, scope, key, seq,
/// attempts, last error, parked (0 or 1), sent (0 or 1), created (ISO-8601 UTC), age ms, ms
/// until due (negative once due), ordering key (the job's key for a row without one), headers
/// (their stored JSON, NULL for none).
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
    String,
    Option<String>,
);

/// A taken message's columns as the backends read them: id, destination, payload, seq,
/// attempts, ordering key, headers (their stored JSON, NULL for none).
pub(crate) type MessageColumns = (String, String, Vec<u8>, i64, i64, String, Option<String>);

/// A taken message as the relay gets it.
fn message(columns: MessageColumns) -> Message {
    let (id, destination, payload, seq, attempts, ordering_key, headers) = columns;
    let headers = Headers::from_json(headers.as_deref()).unwrap_or_else(|e| {
        crate::observe::unreadable_headers(&id, &e);
        Headers::default()
    });
    Message {
        id,
        destination,
        payload,
        seq: seq.try_into().unwrap_or(u32::MAX),
        attempts: attempts.try_into().unwrap_or(u32::MAX),
        ordering_key,
        headers,
    }
}

/// What a relay's take holds: its messages, in the order they were written (a key's
/// messages in their order), and the instant they are held until, as the database wrote it
/// (the fence of the round's marks).
#[derive(Debug, Default)]
pub struct Taken {
    pub(crate) messages: Vec<Message>,
    pub(crate) hold: String,
}

impl Taken {
    /// The messages of `rows`, in their order, held until `hold`.
    pub(crate) fn new(hold: String, rows: impl IntoIterator<Item = MessageColumns>) -> Taken {
        Taken {
            messages: rows.into_iter().map(message).collect(),
            hold,
        }
    }
}
