//! The `charge_once` example, run with its own code: what it reports is checked against what
//! the payments API actually charged and against the marker table.

#[allow(dead_code)]
#[path = "../charge_once.rs"]
mod charge_once;

use charge_once::Delivery;

#[tokio::test(flavor = "multi_thread")]
async fn charge_once_charges_each_job_once_through_a_timeout() {
    let dir = std::env::temp_dir().join(format!("idem-test-charge-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("jobs.db");
    let mut out = Vec::new();
    let (deliveries, totals) = charge_once::run(&db, &mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();

    // The stalled call timed out; its redelivery got the API's first answer for that key.
    let [first, again, stalled, retried] = &deliveries[..] else {
        panic!("four deliveries expected: {deliveries:?}\n{text}")
    };
    let Delivery::Applied(alice) = first else {
        panic!("{text}")
    };
    assert_eq!((alice.id.as_str(), alice.amount), ("ch_1", 4200), "{text}");
    assert_eq!(again, &Delivery::Duplicate, "{text}");
    assert_eq!(stalled, &Delivery::TimedOut, "{text}");
    let Delivery::Applied(bob) = retried else {
        panic!("{text}")
    };
    assert_eq!((bob.id.as_str(), bob.amount), ("ch_2", 5700), "{text}");
    // Two charges, never three: the retry was answered from the API's idempotency store.
    assert_eq!(
        (totals.charges, totals.amount, totals.replayed),
        (2, 9900, 1),
        "{text}"
    );

    // Both jobs are completed markers; the second took two attempts.
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    // Lease tokens come from the database's clock: positive, where a transaction's are not.
    let rows: Vec<(String, String, i64, bool)> = sqlx::query_as(
        "SELECT key, state, attempts, token > 0 FROM idem_processed \
         WHERE scope = 'billing.charge' ORDER BY key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        rows,
        [
            ("charge-1".to_owned(), "completed".to_owned(), 1, true),
            ("charge-2".to_owned(), "completed".to_owned(), 2, true),
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn checkout_story_does_each_step_once_and_fails_a_declined_card_for_good() {
    let dir = std::env::temp_dir().join(format!("idem-test-checkout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    let done = charge_once::run_checkouts(&dir.join("jobs.db"), &mut out)
        .await
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let [first, again, declined, declined_again] = &done.outcomes[..] else {
        panic!("four deliveries expected: {done:?}\n{text}")
    };
    let idem::Outcome::Applied(checked) = first else {
        panic!("{text}")
    };
    assert_eq!(again, &idem::Outcome::Replayed(checked.clone()), "{text}");
    for failed in [declined, declined_again] {
        let idem::Outcome::Failed(failure) = failed else {
            panic!("{text}")
        };
        assert_eq!(
            failure.error(),
            "402 Payment Required from /charges: insufficient funds",
            "{text}"
        );
    }
    assert_eq!(
        (done.charges, done.mails, done.ledger_rows),
        (1, 1, 1),
        "{text}"
    );
}

/// The variables of a checkout worker process (a copy of this test binary running
/// `child_process`).
const CHILD: &str = "IDEM_CHECKOUT_CHILD";

/// Where the worker stops: after each step in turn, and once inside the mail step (after the
/// sink sent the mail, before the step's record).
const STOPS: [&str; 4] = ["charge", "in:receipt-mail", "receipt-mail", "ledger"];

fn order(n: usize) -> charge_once::Order {
    charge_once::Order {
        id: format!("order-{n}"),
        customer: "alice".into(),
        email: format!("alice-{n}@example.com"),
        amount: 1000 + i64::try_from(n).unwrap(),
    }
}

async fn store_at(db: &std::path::Path) -> idem::Store<sqlx::Sqlite> {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    idem::Store::new(pool)
}

#[tokio::test(flavor = "multi_thread")]
async fn checkout_worker_killed_after_each_step_does_each_effect_once() {
    use std::os::unix::process::ExitStatusExt as _;
    use tokio::io::AsyncBufReadExt as _;

    let dir = std::env::temp_dir().join(format!("idem-test-checkout-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("jobs.db");
    let store = store_at(&db).await;
    store.migrate().await.unwrap();
    sqlx::query(charge_once::LEDGER_DDL)
        .execute(store.pool())
        .await
        .unwrap();
    let payments = idem_examples::payments::PaymentsApi::start().await.unwrap();
    let mail = charge_once::MailSink::start().await.unwrap();
    let shop = charge_once::Shop {
        http: reqwest::Client::new(),
        payments_url: payments.url(),
        mail_url: mail.url(),
        stop_at: None,
    };
    for (n, stop) in STOPS.iter().enumerate() {
        let order = order(n);
        let exe = std::env::current_exe().unwrap();
        let mut child = tokio::process::Command::new(exe)
            .args([
                "child_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                CHILD,
                format!(
                    "{}|{}|{}|{n}|{stop}",
                    db.display(),
                    payments.url(),
                    mail.url()
                ),
            )
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let at = format!("AT {stop}");
        let reached = tokio::time::timeout(std::time::Duration::from_secs(120), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains(&at) {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        assert!(reached, "the worker never printed {at:?}");
        child.start_kill().unwrap();
        let status = child.wait().await.unwrap();
        assert_eq!(status.signal(), Some(9), "{status:?}");

        // The worker is known dead: an operator lets its lease go (its steps stay), and the
        // job is delivered again.
        assert!(
            store
                .forget_forced("shop.checkout", &order.id)
                .await
                .unwrap()
        );
        let done = match charge_once::checkout(&store, &order, &shop).await {
            Ok(idem::Outcome::Applied(done)) => done,
            other => panic!("stopped at {stop}: expected Applied, got {other:?}"),
        };
        assert_eq!(done.receipt.amount, order.amount);
        let mails = mail
            .sent()
            .iter()
            .filter(|s| s.mail.to == order.email)
            .count();
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ledger WHERE order_id = ?1")
            .bind(&order.id)
            .fetch_one(store.pool())
            .await
            .unwrap();
        // Each outside effect once: one charge per order so far, one mail, one ledger row.
        assert_eq!(payments.totals().charges, n as u64 + 1, "stopped at {stop}");
        assert_eq!((mails, rows), (1, 1), "stopped at {stop}");
        match charge_once::checkout(&store, &order, &shop).await {
            Ok(idem::Outcome::Replayed(again)) => assert_eq!(again, done),
            other => panic!("expected Replayed, got {other:?}"),
        }
    }
    store.pool().close().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The checkout worker process of `checkout_worker_killed_after_each_step_...`: checks its
/// order out and stops where it was told, until it is killed.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a worker process that the kill test starts"]
async fn child_process() {
    let orders = std::env::var(CHILD).expect("started by the kill test, which sets it");
    let [db, payments_url, mail_url, n, stop] = orders.split('|').collect::<Vec<_>>()[..] else {
        panic!("bad orders {orders:?}")
    };
    let store = store_at(std::path::Path::new(db)).await;
    let shop = charge_once::Shop {
        http: reqwest::Client::new(),
        payments_url: payments_url.to_owned(),
        mail_url: mail_url.to_owned(),
        stop_at: Some(stop.to_owned()),
    };
    let order = order(n.parse().unwrap());
    let r = charge_once::checkout(&store, &order, &shop).await;
    panic!("the checkout returned {r:?}; it should have stopped at {stop}");
}
