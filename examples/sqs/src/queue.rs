//! Queues: creating them with their dead-letter queue, counting what is left in them, and
//! the producer's sends.

use aws_sdk_sqs::Client;
use aws_sdk_sqs::operation::create_queue::builders::CreateQueueFluentBuilder;
use aws_sdk_sqs::types::QueueAttributeName;

use crate::{MAX_MESSAGES, SqsError, TopUp, sqs_error};

/// A queue and its dead-letter queue.
#[derive(Debug, Clone)]
pub struct Queue {
    pub url: String,
    pub dead_letters: String,
}

/// Creates `name` (visibility timeout `visibility` seconds) and `name-dlq`, with a redrive
/// policy that moves a message to the dead-letter queue once it was received
/// `max_receive_count` times without being deleted. A name ending in `.fifo` makes both FIFO
/// queues (the dead-letter queue of a FIFO queue must be one too).
pub async fn create_queue(
    client: &Client,
    name: &str,
    visibility: i32,
    max_receive_count: u32,
) -> Result<Queue, SqsError> {
    let fifo = name.ends_with(".fifo");
    let dlq_name = match name.strip_suffix(".fifo") {
        Some(stem) => format!("{stem}-dlq.fifo"),
        None => format!("{name}-dlq"),
    };
    let dlq = client.create_queue().queue_name(&dlq_name);
    let dead_letters = send_create(dlq, fifo, "CreateQueue (dead letters)").await?;
    let arn = client
        .get_queue_attributes()
        .queue_url(&dead_letters)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| sqs_error("GetQueueAttributes", e))?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| SqsError("the dead-letter queue has no QueueArn".to_owned()))?;
    let redrive = serde_json::json!({
        "deadLetterTargetArn": arn,
        "maxReceiveCount": max_receive_count.to_string(),
    });
    let main = client
        .create_queue()
        .queue_name(name)
        .attributes(
            QueueAttributeName::VisibilityTimeout,
            visibility.to_string(),
        )
        .attributes(QueueAttributeName::RedrivePolicy, redrive.to_string());
    let url = send_create(main, fifo, "CreateQueue").await?;
    Ok(Queue { url, dead_letters })
}

/// Sends `create` (a FIFO queue's if `fifo`: a queue is FIFO from its creation on); the new
/// queue's URL. `what` names the call in the error.
async fn send_create(
    mut create: CreateQueueFluentBuilder,
    fifo: bool,
    what: &str,
) -> Result<String, SqsError> {
    if fifo {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    Ok(create
        .send()
        .await
        .map_err(|e| sqs_error(what, e))?
        .queue_url
        .unwrap_or_default())
}

/// Deletes the queue and its dead-letter queue.
pub async fn delete_queue(client: &Client, queue: &Queue) -> Result<(), SqsError> {
    for url in [&queue.url, &queue.dead_letters] {
        client
            .delete_queue()
            .queue_url(url)
            .send()
            .await
            .map_err(|e| sqs_error("DeleteQueue", e))?;
    }
    Ok(())
}

/// `ApproximateNumberOfMessages` + `ApproximateNumberOfMessagesNotVisible` of `url`: the
/// messages waiting and those received and not deleted yet.
pub async fn messages_left(client: &Client, url: &str) -> Result<(u64, u64), SqsError> {
    let attributes = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .map_err(|e| sqs_error("GetQueueAttributes", e))?
        .attributes
        .unwrap_or_default();
    let count = |name| {
        attributes
            .get(&name)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Ok((
        count(QueueAttributeName::ApproximateNumberOfMessages),
        count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    ))
}

/// Sends `jobs` as JSON, ten per `SendMessageBatch`. On a FIFO queue every job is its own
/// message group, and its deduplication id is `idem::job_id("sqs.top_up", &job.id)`: a send
/// the producer retries within SQS's deduplication interval (5 minutes) is dropped by SQS.
/// That spares receives; it never replaces the handler's claim, which holds past the window.
pub async fn send_jobs<'a>(
    client: &Client,
    url: &str,
    jobs: impl IntoIterator<Item = &'a TopUp>,
) -> Result<(), SqsError> {
    let fifo = url.ends_with(".fifo");
    let jobs: Vec<&TopUp> = jobs.into_iter().collect();
    for chunk in jobs.chunks(MAX_MESSAGES as usize) {
        let mut entries = Vec::with_capacity(chunk.len());
        for (i, job) in chunk.iter().enumerate() {
            let body = serde_json::to_string(job).map_err(|e| SqsError(e.to_string()))?;
            let mut entry = aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .message_body(body);
            if fifo {
                entry = entry
                    .message_group_id(&job.id)
                    .message_deduplication_id(dedup_id(job)?);
            }
            entries.push(entry.build().map_err(|e| sqs_error("a batch entry", e))?);
        }
        let sent = client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| sqs_error("SendMessageBatch", e))?;
        if let Some(failed) = sent.failed().first() {
            return Err(SqsError(format!(
                "SendMessageBatch refused a job: {failed:?}"
            )));
        }
    }
    Ok(())
}

/// SQS's longest `MessageDeduplicationId`.
pub const MAX_DEDUP_ID: usize = 128;

/// The FIFO deduplication id of a job: `idem::job_id` of its id. SQS takes at most 128
/// characters where `job_id` may give up to 255 bytes (it hashes only past that): a longer
/// one is refused here rather than by SQS.
pub fn dedup_id(job: &TopUp) -> Result<String, SqsError> {
    let id = idem::job_id("sqs.top_up", &job.id).map_err(|e| SqsError(e.to_string()))?;
    if id.as_str().len() > MAX_DEDUP_ID {
        return Err(SqsError(format!(
            "the deduplication id of job {} is longer than SQS's {MAX_DEDUP_ID} characters",
            job.id
        )));
    }
    Ok(id.into_string())
}
