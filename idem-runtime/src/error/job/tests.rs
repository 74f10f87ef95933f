use std::time::Duration;

use super::JobError;
use crate::error::{Error, KafkaError, LeaseError, NotKept, Refusal};
use crate::key::{Key, KeyError};
use crate::outcome::Outcome;
use crate::settle::{Classify, Disposition, Settle};

/// One idem error of each disposition `Settle::decide` has: built afresh for each side of a
/// comparison, since `Error` is not `Clone`.
fn idem_errors() -> Vec<Error> {
    let (scope, key) = ("billing".to_owned(), "job-7".to_owned());
    vec![
        Error::InProgress {
            scope: scope.clone(),
            key: key.clone(),
        },
        Error::ValueNotStored {
            scope: scope.clone(),
            key: key.clone(),
            reason: "its JSON is over the bound".into(),
        },
        Error::KeyReused {
            scope: scope.clone(),
            key: key.clone(),
        },
        Error::Refused(Refusal::Key(KeyError::Empty)),
        Error::Serialize("the fingerprint could not be serialised".into()),
        Error::NotKept(NotKept::RolledBack {
            scope: scope.clone(),
            key: key.clone(),
        }),
        Error::Lease(LeaseError::Lost {
            scope: scope.clone(),
            key: key.clone(),
        }),
        Error::Lease(LeaseError::Timeout {
            scope,
            key,
            after: Duration::from_secs(5),
        }),
        Error::Kafka(KafkaError::Client {
            reason: "broker down".into(),
        }),
        Error::Database(sqlx::Error::PoolTimedOut),
        Error::Database(sqlx::Error::RowNotFound),
    ]
}

fn decide<E: Classify + std::fmt::Display>(error: E, delivery: u32) -> Disposition {
    let settle = Settle::new().max_deliveries(4);
    settle.decide(&Err::<Outcome<()>, E>(error), delivery)
}

#[test]
fn an_idem_error_keeps_its_kind_and_its_text() {
    for (idem, again) in idem_errors().into_iter().zip(idem_errors()) {
        let (text, transient, permanent) =
            (idem.to_string(), idem.is_transient(), idem.is_permanent());
        let job = JobError::from(again);
        let kept = job.as_idem().expect("an idem error stays one");
        assert_eq!(kept.to_string(), text);
        assert_eq!(kept.is_transient(), transient, "{text}");
        assert_eq!(job.is_permanent(), permanent, "{text}");
        assert_eq!(job.to_string(), text);
        assert!(job.downcast_ref::<Error>().is_some());
        assert_eq!(job.into_idem().unwrap().to_string(), text);
    }
}

#[test]
fn settle_decides_a_job_error_as_the_idem_error_it_holds() {
    for delivery in [1, 2, 4, 9] {
        for (idem, again) in idem_errors().into_iter().zip(idem_errors()) {
            let text = idem.to_string();
            let as_idem = decide(idem, delivery);
            assert_eq!(decide(JobError::from(again), delivery), as_idem, "{text}");
        }
    }
    let busy = || Error::InProgress {
        scope: "billing".into(),
        key: "job-7".into(),
    };
    assert_eq!(
        Disposition::of(&Err::<Outcome<()>, _>(JobError::from(busy())), 1),
        Disposition::Retry {
            after: Duration::from_secs(1)
        }
    );
}

#[test]
fn idem_errors_that_travelled_come_out_as_themselves() {
    // Inside a `sqlx::Error` (a call that returns `sqlx::Error` met it).
    let reused = Error::KeyReused {
        scope: "invoice".into(),
        key: "inv-3".into(),
    };
    let carried = JobError::from(sqlx::Error::from(reused));
    assert!(matches!(carried.as_idem(), Some(Error::KeyReused { .. })));
    assert!(carried.is_permanent());
    // Its families, as `Error::from` makes them.
    let key = JobError::from(Key::new("").unwrap_err());
    assert!(matches!(
        key.as_idem(),
        Some(Error::Refused(Refusal::Key(KeyError::Empty)))
    ));
    let lost = LeaseError::Lost {
        scope: "charge".into(),
        key: "order-9".into(),
    };
    let lost = JobError::from(lost);
    assert!(matches!(
        lost.as_idem(),
        Some(Error::Lease(LeaseError::Lost { .. }))
    ));
    assert!(!lost.is_permanent());
    // Boxed: `JobError::new` takes what `?` cannot.
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(Error::Serialize("x".into()));
    assert!(matches!(
        JobError::new(boxed).as_idem(),
        Some(Error::Serialize(_))
    ));
    let boxed: Box<dyn std::error::Error + Send + Sync> =
        Box::new(sqlx::Error::from(Error::Serialize("y".into())));
    assert!(matches!(
        JobError::new(boxed).as_idem(),
        Some(Error::Serialize(_))
    ));
}

#[test]
fn a_body_error_is_its_own_and_retried_up_to_the_cap() {
    fn parse() -> Result<i64, JobError> {
        Ok(serde_json::from_str::<i64>("not a number")?)
    }
    let error = parse().unwrap_err();
    let text = serde_json::from_str::<i64>("not a number")
        .unwrap_err()
        .to_string();
    assert!(error.as_idem().is_none());
    assert!(error.downcast_ref::<serde_json::Error>().is_some());
    assert_eq!(error.to_string(), text);
    assert!(error.idem_error().is_none());
    assert!(!error.is_permanent());
    assert_eq!(
        decide(parse().unwrap_err(), 1),
        Disposition::Retry {
            after: Duration::from_millis(100)
        }
    );
    let capped = decide(parse().unwrap_err(), 4);
    let reason = format!(
        "delivered 4 times, the cap of `Settle::max_deliveries`; the last delivery failed: {text}"
    );
    assert_eq!(capped, Disposition::DeadLetter { reason });
    assert!(parse().unwrap_err().into_idem().is_err());
    let message = JobError::new("no such account");
    assert_eq!(message.to_string(), "no such account");
    assert!(message.as_idem().is_none());
}

#[test]
fn a_body_database_error_is_classified_as_sqlx_error_is() {
    let errors: [fn() -> sqlx::Error; 2] =
        [|| sqlx::Error::RowNotFound, || sqlx::Error::PoolTimedOut];
    for error in errors {
        let text = error().to_string();
        let job = JobError::from(error());
        assert!(
            job.as_idem().is_none(),
            "the body's own database error: {text}"
        );
        assert!(job.downcast_ref::<sqlx::Error>().is_some());
        assert_eq!(
            job.is_permanent(),
            Classify::is_permanent(&error()),
            "{text}"
        );
        for delivery in [1, 4] {
            assert_eq!(
                decide(JobError::from(error()), delivery),
                decide(error(), delivery),
                "{text}"
            );
        }
    }
}

#[test]
fn a_body_error_marked_permanent_is_dead_lettered_at_once_with_its_text() {
    let declined = JobError::permanent("card declined");
    assert!(declined.is_permanent());
    assert_eq!(declined.to_string(), "card declined");
    assert_eq!(
        decide(declined, 1),
        Disposition::DeadLetter {
            reason: "card declined".into()
        }
    );
    let marked = JobError::new("card declined").into_permanent();
    assert!(marked.is_permanent());
    let lost = JobError::permanent(LeaseError::Lost {
        scope: "charge".into(),
        key: "order-9".into(),
    });
    assert!(matches!(lost.as_idem(), Some(Error::Lease(_))), "{lost:?}");
    assert!(lost.is_permanent());
    let parse = || -> Result<i64, JobError> {
        serde_json::from_str::<i64>("[]").map_err(JobError::permanent)
    };
    assert!(parse().unwrap_err().is_permanent());
    assert!(format!("{:?}", parse().unwrap_err()).contains("permanent: true"));
    // An idem error keeps the dispositions decided before permanence.
    let busy = JobError::permanent(Error::InProgress {
        scope: "billing".into(),
        key: "job-7".into(),
    });
    assert_eq!(
        decide(busy, 1),
        Disposition::Retry {
            after: Duration::from_secs(1)
        }
    );
}

#[test]
fn a_job_error_goes_out_through_question_mark_as_a_boxed_error() {
    fn worker() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Err(JobError::from(Error::Serialize("z".into())))?;
        Ok(())
    }
    fn main_like() -> Result<(), Box<dyn std::error::Error>> {
        Err(JobError::new("no such account"))?;
        Ok(())
    }
    let error = worker().unwrap_err();
    assert!(matches!(
        error.downcast_ref::<Error>(),
        Some(Error::Serialize(_))
    ));
    assert_eq!(main_like().unwrap_err().to_string(), "no such account");
    let job = JobError::from(Error::Serialize("z".into()));
    let as_error: &(dyn std::error::Error + Send + Sync) = job.as_ref();
    assert_eq!(as_error.to_string(), job.to_string());
}

#[test]
fn it_is_a_handler_error_type_that_crosses_tasks() {
    fn handler_error<E: crate::__private::HandlerError + Send + Sync + 'static>() {}
    handler_error::<JobError>();
}
