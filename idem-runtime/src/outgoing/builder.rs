//! One message put together a piece at a time: its payload, its ordering key, its headers;
//! checked whole and kept by `send`, like the outboxes' one-call sends.

use serde::Serialize;

use super::headers::{BYTES, Headers, JSON};
use super::{Unsent, json};
use crate::error::{Error, Refusal};
use crate::key::{IntoKey, Key};

/// A message being put together: what [`Outbox::message`](crate::Outbox::message) and
/// [`BatchOutbox::message`](crate::BatchOutbox::message) return. Give it a payload
/// ([`json`](MessageBuilder::json) or [`bytes`](MessageBuilder::bytes)), optionally an
/// ordering key and headers, and [`send`](MessageBuilder::send) it:
///
/// ```
/// # fn body(outbox: &mut idem_runtime::Outbox) -> Result<(), idem_runtime::Error> {
/// # let order = serde_json::json!({"id": 7});
/// outbox
///     .message("shipping")
///     .json(&order)
///     .key("customer-42")
///     .header("tenant", "acme")
///     .send()?;
/// # Ok(()) }
/// ```
///
/// Nothing is kept until `send`, which checks everything first (the destination, the payload,
/// the key, the [`Headers`]) and refuses a bad message whole, with the first problem it
/// found: the job's numbering does not move. A message built but never sent is dropped.
#[must_use = "a message is kept only by `send`"]
#[derive(Debug)]
pub struct MessageBuilder<'a> {
    unsent: &'a mut Unsent,
    /// The job the message is of (an index into the pending jobs), or why there is none.
    job: Result<usize, Error>,
    destination: &'a str,
    ordering_key: Option<Key>,
    payload: Option<Vec<u8>>,
    headers: Headers,
    /// The first problem a step found, reported by `send`.
    problem: Option<Error>,
}

impl<'a> MessageBuilder<'a> {
    pub(super) fn new(
        unsent: &'a mut Unsent,
        job: Result<usize, Error>,
        destination: &'a str,
    ) -> MessageBuilder<'a> {
        MessageBuilder {
            unsent,
            job,
            destination,
            ordering_key: None,
            payload: None,
            headers: Headers::new(),
            problem: None,
        }
    }

    fn failed(&mut self, problem: Error) {
        self.problem.get_or_insert(problem);
    }

    /// The payload: `payload` as JSON, content type `application/json` unless set otherwise.
    pub fn json<T: Serialize + ?Sized>(mut self, payload: &T) -> Self {
        match json(payload) {
            Ok(bytes) => self.payload = Some(bytes),
            Err(e) => self.failed(e),
        }
        self.headers.set_content_type_if_none(JSON);
        self
    }

    /// The payload: `payload` as it is, content type `application/octet-stream` unless set
    /// otherwise.
    pub fn bytes(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = Some(payload.into());
        self.headers.set_content_type_if_none(BYTES);
        self
    }

    /// An ordering key of its own instead of the job's (see
    /// [`Outbox::send_keyed`](crate::Outbox::send_keyed)), encoded and checked as a job's key.
    pub fn key<K: IntoKey + ?Sized>(mut self, ordering_key: &K) -> Self {
        match Key::new(ordering_key) {
            Ok(key) => self.ordering_key = Some(key),
            Err(e) => self.failed(e.into()),
        }
        self
    }

    /// Adds your header `name: value` (see [`Headers`] for what a header may be).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers = self.headers.with_header(name, value);
        self
    }

    /// The content type, instead of the one the payload's method gives.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.headers = self.headers.with_content_type(content_type);
        self
    }

    /// The W3C `traceparent` to send, instead of the one of the current span (if the span
    /// has one).
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.headers = self.headers.with_traceparent(traceparent);
        self
    }

    /// Sends the message with the job's effect; returns its id. Refused at once, before
    /// anything is written, with the first problem found: whatever the outbox's `send`
    /// refuses, a bad ordering key ([`Refusal::Key`]), a message with no payload, and bad
    /// headers ([`Refusal::Message`]).
    pub fn send(self) -> Result<&'a str, Error> {
        let job = self.job?;
        if let Some(problem) = self.problem {
            return Err(problem);
        }
        let Some(payload) = self.payload else {
            return Err(Error::Refused(Refusal::Message {
                reason: "it has no payload: give it one with `json` or `bytes` before `send`"
                    .to_owned(),
            }));
        };
        self.unsent.push(
            job,
            self.ordering_key,
            self.destination,
            payload,
            self.headers,
        )
    }
}
