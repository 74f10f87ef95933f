//! An AWS Lambda function fed by SQS: each record of the event handled and settled by the
//! partial batch response (`ReportBatchItemFailures`), so that only the records that failed
//! come back.
//!
//! Lambda's poller deletes the records the response does not name and lets the named ones
//! come back after the queue's visibility timeout. So a record is named unless its disposition
//! is an ack: a retry comes back (after the visibility timeout, not the policy's backoff: the
//! function has no client to move it), and a dead letter comes back too until the queue's
//! redrive policy moves it (set its `maxReceiveCount` to the cap of [`Settle::max_deliveries`];
//! the reason is logged). Nothing is ever dropped unkept.
//!
//! On a FIFO queue (its ARN ends in `.fifo`) the records after the first that failed are named
//! without being handled, as AWS asks: a later message of the group must not pass an earlier
//! one.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Classify, Disposition, Settle};
use crate::outcome::Outcome;

/// An SQS event as Lambda hands it to a function: the fields idem reads.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SqsEvent {
    /// The records, in the order SQS gave them.
    #[serde(rename = "Records", default)]
    pub records: Vec<SqsRecord>,
}

/// One message of an [`SqsEvent`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SqsRecord {
    /// The message's id: what the response names.
    #[serde(rename = "messageId")]
    pub message_id: String,
    /// The message's body: the job, as JSON.
    #[serde(default)]
    pub body: String,
    /// SQS's attributes of the message (`ApproximateReceiveCount` among them).
    #[serde(default)]
    pub attributes: HashMap<String, String>,
    /// The queue's ARN.
    #[serde(rename = "eventSourceARN", default)]
    pub event_source_arn: String,
}

impl SqsRecord {
    /// Which receive of the message this is, from 1 (`ApproximateReceiveCount`).
    pub fn receive_count(&self) -> u32 {
        self.attributes
            .get("ApproximateReceiveCount")
            .and_then(|n| n.parse().ok())
            .unwrap_or(1)
    }
}

/// What the function returns: the records SQS must deliver again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BatchResponse {
    /// The records that failed, by message id.
    #[serde(rename = "batchItemFailures")]
    pub batch_item_failures: Vec<ItemFailure>,
}

/// One record of a [`BatchResponse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ItemFailure {
    /// The record's message id.
    #[serde(rename = "itemIdentifier")]
    pub item_identifier: String,
}

/// Handles each record of `event` in order: parses its body (JSON) into the handler's job,
/// runs the handler and decides as `settle` does; answers the records that must come back.
/// A body that does not parse, a handler that fails or panics: its record is named (see the
/// module's docs for what becomes of it).
pub async fn handle_sqs_event<J, F, Fut, T, E>(
    settle: &Settle,
    event: &SqsEvent,
    handler: F,
) -> BatchResponse
where
    J: DeserializeOwned,
    F: Fn(J) -> Fut,
    Fut: Future<Output = Result<Outcome<T>, E>>,
    E: Classify + Display,
{
    let mut response = BatchResponse::default();
    for record in &event.records {
        let fifo = record.event_source_arn.ends_with(".fifo");
        if fifo && !response.batch_item_failures.is_empty() {
            response.fail(record);
            continue;
        }
        let count = record.receive_count();
        let disposition = match serde_json::from_str::<J>(&record.body) {
            Err(e) => Disposition::unparsable(e),
            Ok(job) => match AssertUnwindSafe(async { handler(job).await })
                .catch_unwind()
                .await
            {
                Ok(result) => settle.decide(&result, count),
                Err(_) => settle.failed(&"the handler panicked", count),
            },
        };
        match disposition {
            Disposition::Ack => {}
            Disposition::Retry { .. } => response.fail(record),
            Disposition::DeadLetter { reason } => {
                tracing::warn!(
                    message.id = record.message_id,
                    delivery = count,
                    reason,
                    "idem: to be dead-lettered by the queue's redrive policy"
                );
                response.fail(record);
            }
        }
    }
    response
}

impl BatchResponse {
    fn fail(&mut self, record: &SqsRecord) {
        self.batch_item_failures.push(ItemFailure {
            item_identifier: record.message_id.clone(),
        });
    }
}
