//! An AWS Lambda function fed by SQS (`idem::settle::lambda`): the partial batch response
//! names only the records that must come back, an event delivered again applies nothing twice,
//! and on a FIFO queue nothing passes a record that failed. The events are SQS's documented
//! shape; the handler's effects and markers are in SQLite.

use std::sync::atomic::{AtomicBool, Ordering};

use idem::settle::lambda::{BatchResponse, ItemFailure, SqsEvent, handle_sqs_event};
use idem::{Settle, Store};
use serde::Deserialize;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool, Transaction};

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
    credits: i64,
}

#[idem::idempotent(key = "job.id", scope = "lambda.top_up")]
async fn top_up(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO effects (job, credits) VALUES (?1, ?2)")
        .bind(&job.id)
        .bind(job.credits)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn db(test: &str) -> (Store<Sqlite>, SqlitePool, tempdir::Dir) {
    let dir = tempdir::Dir::new(&format!("idem-test-lambda-{test}"));
    let options = SqliteConnectOptions::new()
        .filename(dir.path.join("jobs.db"))
        .create_if_missing(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE effects (job TEXT NOT NULL, credits INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    (store, pool, dir)
}

/// A temporary directory removed when dropped.
mod tempdir {
    pub struct Dir {
        pub path: std::path::PathBuf,
    }

    impl Dir {
        pub fn new(prefix: &str) -> Dir {
            let path = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
            drop(std::fs::remove_dir_all(&path));
            std::fs::create_dir_all(&path).unwrap();
            Dir { path }
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            drop(std::fs::remove_dir_all(&self.path));
        }
    }
}

/// An event of `records` (message id, body, receive count) from the queue `arn`.
fn event(arn: &str, records: &[(&str, &str, u32)]) -> SqsEvent {
    let records: Vec<serde_json::Value> = records
        .iter()
        .map(|(id, body, count)| {
            serde_json::json!({
                "messageId": id,
                "receiptHandle": "AQEB...",
                "body": body,
                "attributes": {
                    "ApproximateReceiveCount": count.to_string(),
                    "SentTimestamp": "1545082649183",
                },
                "messageAttributes": {},
                "md5OfBody": "e4e68fb7bd0e697a0ae8f1bb342846b3",
                "eventSource": "aws:sqs",
                "eventSourceARN": arn,
                "awsRegion": "us-east-2",
            })
        })
        .collect();
    serde_json::from_value(serde_json::json!({ "Records": records })).unwrap()
}

fn failures(ids: &[&str]) -> BatchResponse {
    BatchResponse {
        batch_item_failures: ids
            .iter()
            .map(|id| ItemFailure {
                item_identifier: (*id).to_owned(),
            })
            .collect(),
    }
}

async fn effects(pool: &SqlitePool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT job, credits FROM effects ORDER BY job")
        .fetch_all(pool)
        .await
        .unwrap()
}

const QUEUE: &str = "arn:aws:sqs:us-east-2:123456789012:top-ups";

#[tokio::test]
async fn partial_batch_response_names_only_the_records_that_failed() {
    let (store, pool, _dir) = db("partial").await;
    let fail_once = AtomicBool::new(true);
    let handler = |job: Job| {
        let (store, fail_once) = (&store, &fail_once);
        async move {
            if job.id == "job-3" && fail_once.swap(false, Ordering::SeqCst) {
                return Err(sqlx::Error::PoolTimedOut);
            }
            top_up(store, &job).await
        }
    };
    let records = [
        ("m-1", r#"{"id":"job-1","credits":10}"#, 1),
        ("m-2", "not a job", 1),
        ("m-3", r#"{"id":"job-3","credits":30}"#, 1),
        ("m-4", r#"{"id":"job-1","credits":10}"#, 1),
    ];
    let settle = Settle::new();
    let first = handle_sqs_event(&settle, &event(QUEUE, &records), handler).await;
    // job-1 applied, its copy a duplicate; the garbage and job-3's failure come back.
    assert_eq!(first, failures(&["m-2", "m-3"]));
    assert_eq!(effects(&pool).await, [("job-1".to_owned(), 10)]);
    assert_eq!(
        serde_json::to_value(&first).unwrap(),
        serde_json::json!({
            "batchItemFailures": [{ "itemIdentifier": "m-2" }, { "itemIdentifier": "m-3" }]
        })
    );

    // The records that came back, delivered again with the rest: job-3 applies now, job-1
    // applies nothing twice; the garbage still comes back (the redrive policy dead-letters it).
    let again = records.map(|(id, body, count)| (id, body, count + 1));
    let second = handle_sqs_event(&settle, &event(QUEUE, &again), handler).await;
    assert_eq!(second, failures(&["m-2"]));
    assert_eq!(
        effects(&pool).await,
        [("job-1".to_owned(), 10), ("job-3".to_owned(), 30)]
    );
}

#[tokio::test]
async fn fifo_queue_names_every_record_after_the_first_failure_unhandled() {
    let (store, pool, _dir) = db("fifo").await;
    let records = [
        ("m-1", r#"{"id":"job-1","credits":10}"#, 1),
        ("m-2", "not a job", 1),
        ("m-3", r#"{"id":"job-3","credits":30}"#, 1),
    ];
    let fifo = format!("{QUEUE}.fifo");
    let response = handle_sqs_event(&Settle::new(), &event(&fifo, &records), |job: Job| {
        let store = &store;
        async move { top_up(store, &job).await }
    })
    .await;
    assert_eq!(response, failures(&["m-2", "m-3"]));
    // job-3 was not run: it must not pass the record before it.
    assert_eq!(effects(&pool).await, [("job-1".to_owned(), 10)]);
}
