use std::time::Duration;

use super::{Classify, Disposition, Settle};
use crate::error::{Error, LeaseError, NotKept, Refusal};
use crate::key::KeyError;
use crate::outcome::{Failure, Outcome};

fn call(scope: &str, key: &str) -> (String, String) {
    (scope.to_owned(), key.to_owned())
}

fn failed(error: Error) -> Result<Outcome<u32>, Error> {
    Err(error)
}

fn retry_ms(ms: u64) -> Disposition {
    Disposition::Retry {
        after: Duration::from_millis(ms),
    }
}

#[test]
fn every_outcome_is_acked() {
    let settle = Settle::new();
    for outcome in [
        Outcome::Applied(7),
        Outcome::Duplicate,
        Outcome::Replayed(7),
        Outcome::Failed(Failure::new("card declined".into())),
    ] {
        let result: Result<Outcome<u32>, Error> = Ok(outcome);
        // The cap does not apply to work that was kept.
        assert_eq!(settle.decide(&result, 99), Disposition::Ack);
    }
}

#[test]
fn in_progress_waits_for_the_holder_and_is_never_capped() {
    let (scope, key) = call("billing", "job-1");
    let busy = failed(Error::InProgress { scope, key });
    let settle = Settle::new()
        .max_deliveries(3)
        .in_progress_after(Duration::from_millis(2_500));
    for delivery in [1, 3, 50] {
        assert_eq!(settle.decide(&busy, delivery), retry_ms(2_500));
    }
    // A zero delay would be an immediate requeue: it spins while the holder runs.
    let zero = Settle::new().in_progress_after(Duration::ZERO);
    assert_eq!(zero.decide(&busy, 1), retry_ms(1));
}

#[test]
fn a_value_that_was_not_stored_is_acked() {
    let (scope, key) = call("charge", "order-9");
    let reason = "its JSON is over the bound".to_owned();
    let done = failed(Error::ValueNotStored { scope, key, reason });
    assert_eq!(Settle::new().decide(&done, 1), Disposition::Ack);
}

#[test]
fn permanent_errors_are_dead_lettered_at_once_with_their_message() {
    let (scope, key) = call("invoice", "inv-3");
    let reused = Error::KeyReused { scope, key };
    let refused = Error::Refused(Refusal::Key(KeyError::Empty));
    let serialize = Error::Serialize("the fingerprint could not be serialised".into());
    for error in [reused, refused, serialize] {
        let message = error.to_string();
        let decided = Settle::new().decide(&failed(error), 1);
        assert_eq!(decided, Disposition::DeadLetter { reason: message });
    }
}

#[test]
fn what_was_not_kept_is_retried_with_a_doubling_bounded_backoff() {
    let not_kept: [fn(String, String) -> Error; 4] = [
        |scope, key| Error::NotKept(NotKept::RolledBack { scope, key }),
        |scope, key| Error::Lease(LeaseError::Lost { scope, key }),
        |scope, key| {
            let after = Duration::from_secs(5);
            Error::Lease(LeaseError::Timeout { scope, key, after })
        },
        |_, _| Error::Database(sqlx::Error::PoolTimedOut),
    ];
    let errors = not_kept.map(|make| make("top-up".to_owned(), "job-2".to_owned()));
    let settle = Settle::new()
        .backoff(Duration::from_millis(100), Duration::from_millis(700))
        .max_deliveries(6);
    for error in errors {
        let result = failed(error);
        let delays: Vec<Disposition> = (1..=5).map(|n| settle.decide(&result, n)).collect();
        let expected = [100, 200, 400, 700, 700].map(retry_ms);
        assert_eq!(delays, expected, "{result:?}");
    }
}

#[test]
fn the_cap_dead_letters_the_delivery_that_reaches_it_with_its_last_error() {
    let (scope, key) = call("top-up", "job-4");
    let rolled_back = failed(Error::NotKept(NotKept::RolledBack { scope, key }));
    let settle = Settle::new().max_deliveries(3);
    assert!(matches!(
        settle.decide(&rolled_back, 2),
        Disposition::Retry { .. }
    ));
    let Disposition::DeadLetter { reason } = settle.decide(&rolled_back, 3) else {
        panic!("the third delivery of a cap of 3 must be dead-lettered");
    };
    let last = rolled_back.as_ref().unwrap_err().to_string();
    assert!(reason.starts_with("delivered 3 times"), "{reason}");
    assert!(reason.ends_with(&last), "{reason}");
    // At least one delivery: a cap of 0 dead-letters the first failure, as a cap of 1 does.
    let at_once = Settle::new().max_deliveries(0);
    assert_eq!(at_once.get_max_deliveries(), 1);
    assert!(matches!(
        at_once.decide(&rolled_back, 1),
        Disposition::DeadLetter { .. }
    ));
}

#[test]
fn the_backoff_does_not_overflow_on_a_huge_delivery_count() {
    let result = failed(Error::Database(sqlx::Error::PoolTimedOut));
    let settle = Settle::new().max_deliveries(u32::MAX);
    assert_eq!(
        settle.decide(&result, u32::MAX - 1),
        Disposition::Retry {
            after: Duration::from_secs(30)
        }
    );
}

/// A handler's own error type: its idem error decides, else its own permanence.
#[derive(Debug, thiserror::Error)]
enum ChargeError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("card declined")]
    Declined,
    #[error("the payment service is down")]
    Unavailable,
}

impl Classify for ChargeError {
    fn idem_error(&self) -> Option<&Error> {
        match self {
            ChargeError::Idem(e) => Some(e),
            _ => None,
        }
    }

    fn is_permanent(&self) -> bool {
        match self {
            ChargeError::Idem(e) => e.is_permanent(),
            ChargeError::Declined => true,
            ChargeError::Unavailable => false,
        }
    }
}

#[test]
fn a_handlers_own_error_says_what_is_permanent() {
    let settle = Settle::new();
    let declined: Result<Outcome<()>, ChargeError> = Err(ChargeError::Declined);
    assert_eq!(
        settle.decide(&declined, 1),
        Disposition::DeadLetter {
            reason: "card declined".into()
        }
    );
    let down: Result<Outcome<()>, ChargeError> = Err(ChargeError::Unavailable);
    assert_eq!(settle.decide(&down, 1), retry_ms(100));
    let (scope, key) = call("charge", "order-1");
    let busy: Result<Outcome<()>, ChargeError> = Err(Error::InProgress { scope, key }.into());
    assert_eq!(settle.decide(&busy, 1), retry_ms(1_000));
}

#[test]
fn an_idem_error_carried_by_sqlx_or_a_box_decides_as_itself() {
    let (scope, key) = call("charge", "order-2");
    let reused = || Error::KeyReused {
        scope: scope.clone(),
        key: key.clone(),
    };
    let carried: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::from(reused()));
    assert!(matches!(
        Settle::new().decide(&carried, 1),
        Disposition::DeadLetter { .. }
    ));
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(reused());
    assert!(boxed.idem_error().is_some());
    let busy: Box<dyn std::error::Error + Send + Sync> =
        Box::new(sqlx::Error::from(Error::InProgress {
            scope: scope.clone(),
            key: key.clone(),
        }));
    let busy: Result<Outcome<()>, _> = Err(busy);
    assert_eq!(Settle::new().decide(&busy, 1), retry_ms(1_000));
    // A database error of the body's own: retried when it may pass, dead-lettered when not.
    let timed_out: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::PoolTimedOut);
    assert_eq!(Settle::new().decide(&timed_out, 1), retry_ms(100));
    let missing: Result<Outcome<()>, sqlx::Error> =
        Err(sqlx::Error::ColumnNotFound("balance".into()));
    assert!(matches!(
        Settle::new().decide(&missing, 1),
        Disposition::DeadLetter { .. }
    ));
}

#[test]
fn an_unparsable_payload_is_a_dead_letter_that_says_so() {
    let parsed: Result<u32, _> = "twelve".parse::<u32>();
    let Err(e) = parsed else {
        panic!("\"twelve\" is no number");
    };
    assert_eq!(
        Disposition::unparsable(e),
        Disposition::DeadLetter {
            reason: "the payload is not a job: invalid digit found in string".into()
        }
    );
}
