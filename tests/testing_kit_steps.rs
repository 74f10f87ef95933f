//! `idem::testing::crash_after_each_step`: a lease handler whose outside calls are steps
//! passes it (each call made once, whatever step the delivery crashed after); one that makes
//! an outside call outside of its steps fails it, naming what ran twice.

use std::future::poll_fn;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::str::FromStr as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use idem::testing::{Got, crash_after_each_step};
use idem::{Lease, Store};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

/// The outside system: counts every call by name, deduplicating nothing.
#[derive(Default)]
struct Outside(Mutex<Vec<String>>);

impl Outside {
    fn call(&self, what: &str) -> u32 {
        let mut calls = self.0.lock().unwrap();
        calls.push(what.to_owned());
        u32::try_from(calls.len()).unwrap()
    }

    fn counts(&self, job: &str) -> Vec<usize> {
        let calls = self.0.lock().unwrap();
        ["charge", "mail", "ship"]
            .iter()
            .map(|step| {
                calls
                    .iter()
                    .filter(|c| **c == format!("{job}/{step}"))
                    .count()
            })
            .collect()
    }
}

struct Order {
    id: String,
}

async fn store() -> Store<Sqlite> {
    static N: AtomicU32 = AtomicU32::new(0);
    let file = std::env::temp_dir().join(format!(
        "idem_kit_steps_{}_{}.db",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", file.display()))
        .unwrap()
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new().connect_with(opts).await.unwrap();
    let store = Store::new(pool);
    store.migrate().await.unwrap();
    store
}

/// Three outside calls, each a step.
#[idem::idempotent(key = "order.id", scope = "kit.checkout", lease = "30s", replay)]
async fn checkout(lease: &Lease, order: &Order, outside: &Outside) -> Result<u32, idem::Error> {
    let mut last = 0;
    for step in ["charge", "mail", "ship"] {
        let call = format!("{}/{step}", order.id);
        last = lease
            .step(step, |_| async {
                Ok::<_, idem::Error>(outside.call(&call))
            })
            .await?;
    }
    Ok(last)
}

/// The mail is sent outside of any step: a redelivery sends it again.
#[idem::idempotent(key = "order.id", scope = "kit.checkout", lease = "30s")]
async fn checkout_mailing_outside_a_step(
    lease: &Lease,
    order: &Order,
    outside: &Outside,
) -> Result<(), idem::Error> {
    let id = &order.id;
    lease
        .step("charge", |_| async {
            Ok::<_, idem::Error>(outside.call(&format!("{id}/charge")))
        })
        .await?;
    outside.call(&format!("{id}/mail"));
    lease
        .step("ship", |_| async {
            Ok::<_, idem::Error>(outside.call(&format!("{id}/ship")))
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_handler_of_steps_survives_a_crash_after_each_step() {
    let store = store().await;
    let outside = Outside::default();
    let order = Order {
        id: "order-1".into(),
    };
    let report = crash_after_each_step(
        || checkout(&store, &order, &outside),
        || async { outside.counts("order-1") },
        vec![1, 1, 1],
    )
    .await;
    // Crashed after step 1, 2 and 3, then a delivery to the end, then a replay.
    assert_eq!(
        report.got(),
        [
            Got::Injected,
            Got::Injected,
            Got::Injected,
            Got::Applied,
            Got::Replayed
        ]
    );
    let attempts: Vec<Option<u32>> = report.deliveries().iter().map(|d| d.attempt()).collect();
    assert_eq!(attempts[..4], [Some(1), Some(2), Some(3), Some(4)]);
}

#[tokio::test]
async fn a_call_outside_the_steps_is_found_running_twice() {
    let store = store().await;
    let outside = Outside::default();
    let order = Order {
        id: "order-2".into(),
    };
    let case = crash_after_each_step(
        || checkout_mailing_outside_a_step(&store, &order, &outside),
        || async { outside.counts("order-2") },
        vec![1, 1, 1],
    );
    let mut case = pin!(case);
    let panic =
        poll_fn(
            |cx| match std::panic::catch_unwind(AssertUnwindSafe(|| case.as_mut().poll(cx))) {
                Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
                Ok(std::task::Poll::Ready(report)) => panic!("the case passed: {report}"),
                Err(payload) => std::task::Poll::Ready(payload),
            },
        )
        .await;
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("the check read [1, 2, 1], not [1, 1, 1]")
            && message.contains("an outside call outside of any step ran again"),
        "{message}"
    );
}
