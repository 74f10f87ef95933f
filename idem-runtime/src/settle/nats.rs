//! The consumer loop on NATS JetStream (async-nats): a pull consumer's messages as a
//! [`Source`], each settled as its [`Disposition`] says.
//!
//! - **Ack**: an ack the server confirms (a lost plain ack would mean a redelivery after
//!   `ack_wait`, harmless but slower).
//! - **Retry after a delay**: a nak with that delay; JetStream redelivers the message then.
//! - **Dead letter**: JetStream keeps no dead letters of its own, so a copy is published to
//!   your dead-letter subject (which a stream must capture: the publish waits for the
//!   stream's ack) with the reason in its `Idem-Reason` header, then the message is
//!   terminated (`+TERM`: never redelivered).
//! - **Heartbeat** (the runner's, while a handler runs): `+WPI` ([`AckKind::Progress`]), not
//!   waiting for the server's answer: a lost one is covered by the next.
//!
//! The delivery count is JetStream's own (`delivered`). Give the consumer a `max_deliver`
//! above the runner's cap (or none), so that the cap, not the server, decides the last
//! delivery. A handler may run longer than the consumer's `ack_wait`: the runner's
//! [heartbeat](super::Runner::heartbeat) sends an "in progress" ack (`+WPI`) every period,
//! which starts the `ack_wait` over; give the runner a period well under it. Deliveries
//! dropped unsettled at shutdown come back after `ack_wait`.

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::Stream;
use async_nats::jetstream::{AckKind, Context, Message};
use futures_util::StreamExt as _;

use super::{Delivery, Disposition, Source};

/// The async-nats this adapter is built on: your client and consumer must be this crate's.
pub use async_nats;

/// The header of a dead letter that says why it was dead-lettered.
pub const REASON_HEADER: &str = "Idem-Reason";
/// The header of a dead letter that says how many deliveries it had.
pub const DELIVERY_HEADER: &str = "Idem-Delivery";

/// Why a delivery or a settlement did not reach NATS.
#[derive(Debug, thiserror::Error)]
#[error("NATS JetStream: {what}: {source}")]
pub struct NatsError {
    what: &'static str,
    #[source]
    source: async_nats::Error,
}

impl NatsError {
    fn new(what: &'static str, source: impl Into<async_nats::Error>) -> NatsError {
        NatsError {
            what,
            source: source.into(),
        }
    }
}

/// A pull consumer's messages, as the runner's [`Source`].
pub struct Pull {
    messages: Option<Stream>,
    context: Context,
    dead_letters: String,
}

impl Pull {
    /// Pulls `consumer`'s messages `prefetch` at a time (give the runner the same
    /// [`in_flight`](super::Runner::in_flight)); dead letters go to `dead_letters`, a subject
    /// a stream of `context` captures.
    pub async fn consume(
        consumer: &PullConsumer,
        context: &Context,
        prefetch: usize,
        dead_letters: impl Into<String>,
    ) -> Result<Pull, NatsError> {
        let messages = consumer
            .stream()
            .max_messages_per_batch(prefetch.max(1))
            .messages()
            .await
            .map_err(|e| NatsError::new("the consumer's messages", e))?;
        Ok(Pull {
            messages: Some(messages),
            context: context.clone(),
            dead_letters: dead_letters.into(),
        })
    }
}

impl std::fmt::Debug for Pull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pull")
            .field("pulling", &self.messages.is_some())
            .field("dead_letters", &self.dead_letters)
            .finish_non_exhaustive()
    }
}

impl Source for Pull {
    type Delivery = Pulled;
    type Error = NatsError;

    async fn next(&mut self) -> Option<Result<Pulled, NatsError>> {
        let message = match self.messages.as_mut()?.next().await? {
            Ok(message) => message,
            Err(e) => return Some(Err(NatsError::new("the next message", e))),
        };
        let count = match message.info() {
            Ok(info) => u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX),
            Err(e) => return Some(Err(NatsError::new("the message's delivery info", e))),
        };
        Some(Ok(Pulled {
            message,
            count,
            context: self.context.clone(),
            dead_letters: self.dead_letters.clone(),
        }))
    }

    /// Stops pulling: messages pulled already and not settled come back after `ack_wait`.
    async fn stop(&mut self) -> Result<(), NatsError> {
        self.messages = None;
        Ok(())
    }

    async fn close(self) -> Result<(), NatsError> {
        Ok(())
    }
}

/// One delivery of a JetStream message.
#[derive(Debug)]
pub struct Pulled {
    message: Message,
    count: u32,
    context: Context,
    dead_letters: String,
}

impl Pulled {
    /// The message as async-nats gave it (subject, headers, delivery info).
    pub fn message(&self) -> &Message {
        &self.message
    }
}

impl Delivery for Pulled {
    type Error = NatsError;

    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn count(&self) -> u32 {
        self.count
    }

    fn id(&self) -> Option<&str> {
        let headers = self.message.headers.as_ref()?;
        Some(headers.get("Nats-Msg-Id")?.as_str())
    }

    fn system(&self) -> &'static str {
        "nats"
    }

    fn destination(&self) -> Option<&str> {
        Some(self.message.subject.as_str())
    }

    /// An "in progress" ack (`+WPI`): the server starts the consumer's `ack_wait` over. Sent
    /// on the client's connection ahead of the settlement, so it never lands after it.
    async fn extend(&self) -> Result<(), NatsError> {
        self.message
            .ack_with(AckKind::Progress)
            .await
            .map_err(|e| NatsError::new("the heartbeat (in progress)", e))
    }

    async fn settle(self, disposition: &Disposition) -> Result<(), NatsError> {
        let kind = match disposition {
            Disposition::Ack => AckKind::Ack,
            Disposition::Retry { after } => AckKind::Nak(Some(*after)),
            Disposition::DeadLetter { reason } => {
                self.dead_letter(reason).await?;
                AckKind::Term
            }
        };
        self.message
            .double_ack_with(kind)
            .await
            .map_err(|e| NatsError::new("the settlement", e))
    }
}

impl Pulled {
    /// Publishes a copy to the dead-letter subject and waits for its stream's ack.
    async fn dead_letter(&self, reason: &str) -> Result<(), NatsError> {
        let mut headers = HeaderMap::new();
        // The copy is a message of its own: the original's id would make the stream drop it
        // as a duplicate of the job.
        for (name, values) in self.message.headers.iter().flat_map(HeaderMap::iter) {
            if !name.to_string().eq_ignore_ascii_case("Nats-Msg-Id") {
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        headers.insert(REASON_HEADER, one_line(reason).as_str());
        headers.insert(DELIVERY_HEADER, self.count.to_string().as_str());
        self.context
            .publish_with_headers(
                self.dead_letters.clone(),
                headers,
                self.message.payload.clone(),
            )
            .await
            .map_err(|e| NatsError::new("the dead letter's publish", e))?
            .await
            .map_err(|e| NatsError::new("the dead letter's stream ack", e))?;
        Ok(())
    }
}

/// A header value holds no line break.
fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " ")
}
