//! `idem::observe_keys`: a process-wide setting, so these tests run in a binary of their own
//! (one test, the settings in turn), apart from `tests/observe.rs`, whose spans show keys.

#[allow(dead_code)]
#[path = "observe/capture.rs"]
mod capture;

use capture::{Fields, subscribe};
use idem::{Error, KeyInSpans, Outcome, Store};
use std::str::FromStr as _;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
use sqlx::{Sqlite, Transaction};
use tracing::Level;

struct Job {
    email: String,
}

#[idem::idempotent(key = "job.email", scope = "keys.welcome", wait = "50ms")]
async fn welcome(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(())
}

/// The span's fields (without `waited_ms`) and the `error` of its `idem call finished`.
fn seen_call(seen: &capture::Seen) -> (Fields, Option<String>) {
    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span: {:?}", seen.claims())
    };
    let mut fields = span.fields.clone();
    fields.remove("waited_ms");
    let error = seen
        .idem_events(*id)
        .into_iter()
        .find(|e| e.level >= Level::INFO && e.fields.contains_key("error"))
        .map(|e| e.fields["error"].clone());
    (fields, error)
}

fn fields(pairs: &[(&str, &str)]) -> Fields {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test]
async fn keys_plain_hashed_or_omitted() {
    // A file, so that the held claim and the waiting call share one database.
    let file = std::env::temp_dir().join(format!("idem_observe_keys_{}.db", std::process::id()));
    let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", file.display()))
        .unwrap()
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(opts)
        .await
        .unwrap();
    let store = Store::new(pool);
    store.migrate().await.unwrap();
    let job = Job {
        email: "ada@example.com".into(),
    };
    // printf %s 'ada@example.com' | sha256sum | cut -c1-16
    let hash = "b5fc85e55755f9e0";

    let plain = fields(&[
        ("scope", "keys.welcome"),
        ("key", "ada@example.com"),
        ("mode", "transaction"),
        ("outcome", "applied"),
        ("retries", "0"),
    ]);
    let (seen, guard) = subscribe();
    assert_eq!(welcome(&store, &job).await.unwrap(), Outcome::Applied(()));
    assert_eq!(seen_call(&seen), (plain, None));
    drop(guard);

    idem::observe_keys(KeyInSpans::Hashed);
    let (seen, guard) = subscribe();
    assert_eq!(welcome(&store, &job).await.unwrap(), Outcome::Duplicate);
    let hashed = fields(&[
        ("scope", "keys.welcome"),
        ("key_hash", hash),
        ("mode", "transaction"),
        ("outcome", "duplicate"),
        ("retries", "0"),
    ]);
    assert_eq!(seen_call(&seen), (hashed, None));
    drop(guard);

    // An error that names the key logs it as the setting says; the error returned keeps it.
    let bob_key = idem::Key::new("bob@example.com").unwrap();
    let held = match store.claim("keys.welcome", &bob_key).await.unwrap() {
        idem::Claimed::Fresh(guard) => guard,
        other => panic!("{other:?}"),
    };
    let bob = Job {
        email: "bob@example.com".into(),
    };
    let bob_hash = "5ff860bf1190596c";
    let text = |key: &str| {
        format!(
            "another delivery of \"keys.welcome\" / {key} is still in progress: nothing ran; \
             nack the job so that it is redelivered later (do not ack it: the other delivery \
             may still fail)"
        )
    };
    let (seen, guard) = subscribe();
    let err = welcome(&store, &bob).await.unwrap_err();
    assert_eq!(err.to_string(), text("\"bob@example.com\""));
    let (span, error) = seen_call(&seen);
    assert_eq!(span["key_hash"], bob_hash);
    assert!(!span.contains_key("key"), "{span:?}");
    assert_eq!(error, Some(text(&format!("<key_hash={bob_hash}>"))));
    drop(guard);

    idem::observe_keys(KeyInSpans::Omitted);
    let (seen, guard) = subscribe();
    let err = welcome(&store, &bob).await.unwrap_err();
    assert_eq!(err.to_string(), text("\"bob@example.com\""));
    let omitted = fields(&[
        ("scope", "keys.welcome"),
        ("mode", "transaction"),
        ("outcome", "in_progress"),
        ("retries", "0"),
    ]);
    assert_eq!(seen_call(&seen), (omitted, Some(text("<key omitted>"))));
    drop(guard);
    drop(held);
    idem::observe_keys(KeyInSpans::Plain);
}
