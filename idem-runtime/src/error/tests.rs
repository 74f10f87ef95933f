//! What every message of [`Error`] says, and when it advises a retry.

use std::error::Error as _;

use super::*;

#[test]
fn an_unreachable_database_is_said_once_with_what_to_do() {
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    let err = Error::from(sqlx::Error::Io(refused));
    let msg = err.to_string();
    assert!(msg.contains("check its URL"), "{msg}");
    assert_eq!(msg.matches("refused").count(), 1, "{msg}");
    assert!(err.source().is_none());
}

#[test]
fn every_variant_says_what_to_do() {
    let cases = [
        (Error::from(KeyError::Empty), "non-empty id"),
        (
            Error::Refused(Refusal::Table { name: "a b".into() }),
            "plain SQL identifier",
        ),
        (
            Error::Refused(Refusal::Scope {
                scope: String::new(),
            }),
            "1 to 255 bytes",
        ),
        (
            Error::NotKept(NotKept::RolledBack {
                scope: "s".into(),
                key: "k".into(),
            }),
            "return database errors from the body with `?`",
        ),
        (
            Error::InProgress {
                scope: "s".into(),
                key: "k".into(),
            },
            "nack the job",
        ),
        (
            Error::from(sqlx::Error::PoolTimedOut),
            "every one was in use",
        ),
        (
            Error::from(sqlx::Error::RowNotFound),
            "kept or lost together",
        ),
        (
            Error::Kafka(KafkaError::WatermarkAhead {
                group: "g".into(),
                topic: "t".into(),
                partition: 0,
                watermark: 9,
                log_end: 4,
            }),
            "set the watermark to where its records start",
        ),
    ];
    for (err, advice) in cases {
        let msg = err.to_string();
        assert!(msg.contains(advice), "{msg:?} lacks {advice:?}");
        // A line continuation lost in the source leaves a run of spaces in the message.
        assert!(!msg.contains("  "), "{msg:?} has a run of spaces");
        // Each message is whole: nothing to print again from a source.
        assert!(err.source().is_none(), "{msg}");
    }
}

#[test]
fn retry_advice_is_for_transient_errors_only() {
    let transient = [
        Error::from(sqlx::Error::PoolTimedOut),
        Error::from(sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into())),
        Error::InProgress {
            scope: "s".into(),
            key: "k".into(),
        },
    ];
    for err in transient {
        assert!(err.is_transient(), "{err}");
    }
    let lasting = [
        Error::from(KeyError::Empty),
        Error::Refused(Refusal::Batch { len: 1001 }),
        Error::Refused(Refusal::Scope {
            scope: String::new(),
        }),
        Error::KeyReused {
            scope: "s".into(),
            key: "k".into(),
        },
        Error::from(sqlx::Error::ColumnNotFound("result".into())),
    ];
    for err in lasting {
        assert!(!err.is_transient(), "{err}");
        let msg = err.to_string();
        assert!(
            !msg.contains("retry") || msg.contains("do not retry"),
            "{msg}"
        );
        assert!(!msg.contains("let the broker redeliver"), "{msg}");
    }
}

/// Every refusal, as an error, lasts (a redelivery is refused again) and says what the refusal
/// says, nothing more.
#[test]
fn every_refusal_is_a_lasting_error_with_its_own_message() {
    let second = std::time::Duration::from_secs(1);
    let refusals = [
        Refusal::Key(KeyError::Empty),
        Refusal::Batch { len: 1001 },
        Refusal::Table { name: "a b".into() },
        Refusal::Scope {
            scope: String::new(),
        },
        Refusal::Message { reason: "r".into() },
        Refusal::Lease { lease: second },
        Refusal::Retention { retention: second },
        Refusal::Partitions {
            table: "t".into(),
            problem: "p".into(),
        },
        Refusal::Step {
            scope: "s".into(),
            key: "k".into(),
            step: "x".into(),
            reason: "r".into(),
        },
        Refusal::Group { reason: "r".into() },
        Refusal::Offsets { reason: "r".into() },
        Refusal::Record { reason: "r".into() },
        Refusal::Nested {
            inner: "i".into(),
            outer: "o".into(),
        },
    ];
    for refusal in refusals {
        // A variant added to `Refusal` fails to compile here until it is in the list above.
        match refusal {
            Refusal::Key(_)
            | Refusal::Batch { .. }
            | Refusal::Table { .. }
            | Refusal::Scope { .. }
            | Refusal::Message { .. }
            | Refusal::Lease { .. }
            | Refusal::Retention { .. }
            | Refusal::Partitions { .. }
            | Refusal::Step { .. }
            | Refusal::Group { .. }
            | Refusal::Offsets { .. }
            | Refusal::Record { .. }
            | Refusal::Nested { .. } => {}
        }
        let err = Error::from(refusal.clone());
        assert!(
            matches!(&err, Error::Refused(r) if *r == refusal),
            "{err:?}"
        );
        assert!(!err.is_transient(), "{err}");
        assert_eq!(err.to_string(), refusal.to_string());
        assert!(err.source().is_none(), "{err}");
    }
    assert_eq!(
        Error::from(KeyError::BatchTooLarge { len: 1001 }).to_string(),
        Refusal::Batch { len: 1001 }.to_string()
    );
}

/// What the docs say of `sqlx::Error` as a handler's error type ("Why not `sqlx::Error`"):
/// idem's error rides as a database error, prints as one, and comes back with its kind.
#[test]
fn sqlx_error_carries_idem_errors_as_database_errors() {
    let err = sqlx::Error::from(Error::InProgress {
        scope: "billing.top_up".into(),
        key: "42".into(),
    });
    let text = err.to_string();
    assert!(
        text.starts_with(
            "error returned from database: another delivery of \"billing.top_up\" / \"42\" \
             is still in progress"
        ),
        "{text}"
    );
    let back = err
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<Error>());
    assert!(matches!(back, Some(Error::InProgress { .. })), "{back:?}");
    let reused = sqlx::Error::from(Error::KeyReused {
        scope: "s".into(),
        key: "k".into(),
    });
    assert_eq!(
        reused.as_database_error().map(|e| e.kind()),
        Some(sqlx::error::ErrorKind::UniqueViolation)
    );
    assert!(matches!(Error::from(reused), Error::KeyReused { .. }));
}
