//! The messages a handler sends through its outbox: collected while the body runs, written in
//! the claim's transaction just before its commit, so that they exist exactly when the effect
//! and the marker do.

use std::borrow::Cow;

use serde::Serialize;

use crate::error::{Error, Refusal};
use crate::job_id::job_id;
use crate::key::{IntoKey, Key};

mod batch;
mod builder;
#[cfg(feature = "postgres")]
#[cfg_attr(not(feature = "wal-relay"), allow(dead_code))]
pub(crate) mod frame;
mod headers;

pub use batch::BatchOutbox;
pub use builder::MessageBuilder;
pub use headers::{Headers, MAX_HEADERS_SIZE};

/// The largest payload one message carries: NATS's default `max_payload` (1 MB), the smallest
/// limit of the brokers idem's relay publishes to (RabbitMQ's default is 128 MB).
pub const MAX_PAYLOAD: usize = 1_000_000;

/// The longest destination name (a queue, a routing key, a subject): what AMQP's short
/// strings hold.
pub const MAX_DESTINATION_LEN: usize = 255;

/// The messages a handler sends with its effect: what the body gets as
/// `outbox: &mut idem::Outbox`.
///
/// [`send`](Outbox::send) only collects; the messages are written to the outbox table in the
/// claim's transaction, right before its commit, so that a body that fails (or a transaction
/// the database rolls back) leaves none, and a committed one leaves exactly its messages. The
/// relay ([`Relay`](crate::outbox::Relay)) publishes them after the commit.
///
/// Each message's id is [`job_id`](crate::job_id)`(scope, &(key, n))` for the `n`-th message
/// of the job (from 0): the same ids every time the body runs for that job, so a redelivery
/// that runs it again after a rollback sends the same messages, and the next consumer claims
/// that id as its key.
///
/// Each message has an ordering key: the job's key, or the one given to
/// [`send_keyed`](Outbox::send_keyed). The relay publishes the messages of one ordering key in
/// the order they were written, one at a time, and holds a key's later messages back while
/// one of its messages fails (see [`Relay`](crate::outbox::Relay)).
///
/// Each message has [`Headers`]: a content type (`application/json` for
/// [`send`](Outbox::send), `application/octet-stream` for [`send_bytes`](Outbox::send_bytes)),
/// the W3C `traceparent` of the current span when it has one, and headers of your own, given
/// to a message put together with [`message`](Outbox::message).
#[derive(Debug)]
pub struct Outbox {
    unsent: Unsent,
}

/// What both outboxes collect: the messages of one scope's jobs not written yet, each with the
/// job it is of, written by the backend's `outbox_write` in the claim's transaction (a stored
/// message the relay has yet to send is `OutboxState::Pending`).
///
/// Public only in name, for the sealed `Dialect` trait's signature: no path outside the crate
/// reaches it.
#[doc(hidden)]
#[derive(Debug)]
pub struct Unsent {
    scope: Cow<'static, str>,
    /// The jobs' keys, and how many messages each has sent (the next one's position).
    jobs: Vec<(Key, u32)>,
    messages: Vec<Message>,
    /// The job of each message: an index into `jobs`.
    owners: Vec<usize>,
}

/// One message of an outbox: its id, where it goes, its bytes and its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The message's id (AMQP `message_id`, JetStream `Nats-Msg-Id`): the next consumer's key.
    pub id: String,
    /// The queue, routing key or subject it goes to.
    pub destination: String,
    /// The payload: `send`'s value as JSON, or `send_bytes`'s bytes.
    pub payload: Vec<u8>,
    /// Its position among the job's messages, from 0.
    pub seq: u32,
    /// Failed attempts to publish it so far (the relay's count).
    pub attempts: u32,
    /// Its ordering key: the job's key unless the message was sent with one of its own
    /// ([`Outbox::send_keyed`]). The relay publishes one key's messages in their order.
    pub ordering_key: String,
    /// Its content type, trace context and your headers; none for a message written before
    /// headers existed (schema version 3).
    pub headers: Headers,
}

impl Outbox {
    pub(crate) fn new(scope: Cow<'static, str>, key: Key) -> Outbox {
        Outbox {
            unsent: Unsent::new(scope, vec![key]),
        }
    }

    /// Sends `payload` (as JSON) to `destination` with the job's effect; returns the message's
    /// id. Refused at once, before anything is written, when the destination is empty, longer
    /// than [`MAX_DESTINATION_LEN`] or holds a NUL, or the payload does not serialise or is
    /// over [`MAX_PAYLOAD`]: [`Refusal::Message`].
    pub fn send<T: Serialize + ?Sized>(
        &mut self,
        destination: &str,
        payload: &T,
    ) -> Result<&str, Error> {
        let bytes = json(payload)?;
        self.unsent
            .push(0, None, destination, bytes, Headers::json())
    }

    /// [`send`](Outbox::send) of bytes as they are (content type `application/octet-stream`).
    pub fn send_bytes(&mut self, destination: &str, payload: Vec<u8>) -> Result<&str, Error> {
        self.unsent
            .push(0, None, destination, payload, Headers::bytes())
    }

    /// A message to `destination` to put together (its payload, ordering key, headers) and
    /// [`send`](MessageBuilder::send): the way to give a message headers of its own.
    ///
    /// ```
    /// # fn body(outbox: &mut idem_runtime::Outbox) -> Result<(), idem_runtime::Error> {
    /// outbox
    ///     .message("invoices")
    ///     .bytes(b"%PDF-1.7".to_vec())
    ///     .content_type("application/pdf")
    ///     .header("tenant", "acme")
    ///     .send()?;
    /// # Ok(()) }
    /// ```
    pub fn message<'a>(&'a mut self, destination: &'a str) -> MessageBuilder<'a> {
        MessageBuilder::new(&mut self.unsent, Ok(0), destination)
    }

    /// [`send`](Outbox::send) under an ordering key of its own instead of the job's: the relay
    /// publishes the messages of one ordering key in the order they were written, whichever
    /// jobs wrote them (`&customer_id`, so that one customer's events leave in order). The
    /// key is encoded and checked as a job's key is ([`Key`](crate::Key)); a bad one is
    /// refused at once with [`Refusal::Key`].
    pub fn send_keyed<K, T>(
        &mut self,
        ordering_key: &K,
        destination: &str,
        payload: &T,
    ) -> Result<&str, Error>
    where
        K: IntoKey + ?Sized,
        T: Serialize + ?Sized,
    {
        let ordering_key = Key::new(ordering_key)?;
        let bytes = json(payload)?;
        self.unsent
            .push(0, Some(ordering_key), destination, bytes, Headers::json())
    }

    /// [`send_keyed`](Outbox::send_keyed) of bytes as they are.
    pub fn send_bytes_keyed<K: IntoKey + ?Sized>(
        &mut self,
        ordering_key: &K,
        destination: &str,
        payload: Vec<u8>,
    ) -> Result<&str, Error> {
        let ordering_key = Key::new(ordering_key)?;
        self.unsent.push(
            0,
            Some(ordering_key),
            destination,
            payload,
            Headers::bytes(),
        )
    }

    /// The messages sent so far, in the order they were sent.
    pub fn messages(&self) -> &[Message] {
        &self.unsent.messages
    }

    pub(crate) fn into_unsent(self) -> Unsent {
        self.unsent
    }

    pub(crate) fn unsent(&self) -> &Unsent {
        &self.unsent
    }
}

impl Unsent {
    pub(crate) fn new(scope: Cow<'static, str>, keys: Vec<Key>) -> Unsent {
        Unsent {
            scope,
            jobs: keys.into_iter().map(|key| (key, 0)).collect(),
            messages: Vec::new(),
            owners: Vec::new(),
        }
    }

    /// Adds the next message of the job at `job`, under `ordering_key` (the job's key if
    /// `None`), checked first: nothing is kept of a message that is refused, and the job's
    /// numbering does not move. Without a `traceparent` of its own the message gets the
    /// current span's, if any.
    pub(crate) fn push(
        &mut self,
        job: usize,
        ordering_key: Option<Key>,
        destination: &str,
        payload: Vec<u8>,
        mut headers: Headers,
    ) -> Result<&str, Error> {
        check_destination(destination)?;
        headers.set_traceparent_if_none(crate::observe::ambient_traceparent());
        headers.check()?;
        if payload.len() > MAX_PAYLOAD {
            return Err(Error::Refused(Refusal::Message {
                reason: format!(
                    "its payload is {} bytes, more than the {MAX_PAYLOAD} a message carries: \
                     send an id of the document, not the document",
                    payload.len()
                ),
            }));
        }
        let (key, sent) = &mut self.jobs[job];
        let seq = *sent;
        let next = seq.checked_add(1).ok_or_else(|| {
            Error::Refused(Refusal::Message {
                reason: "a job sends at most 4294967295 messages".to_owned(),
            })
        })?;
        // The same formula in every mode: a job's messages have the same ids whether it ran
        // alone or in a batch.
        let id = job_id(&self.scope, &(key.as_str(), seq))?.into_string();
        *sent = next;
        let ordering_key = match ordering_key {
            Some(own) => own.as_str().to_owned(),
            None => key.as_str().to_owned(),
        };
        self.messages.push(Message {
            id,
            destination: destination.to_owned(),
            payload,
            seq,
            attempts: 0,
            ordering_key,
            headers,
        });
        self.owners.push(job);
        Ok(&self.messages.last().expect("just pushed").id)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The key of the job at `job`.
    pub(crate) fn key(&self, job: usize) -> &Key {
        &self.jobs[job].0
    }

    /// The outbox of the job at `job` alone, numbering on from the messages it sent here.
    pub(crate) fn job_outbox(&self, job: usize) -> Outbox {
        let (key, sent) = &self.jobs[job];
        let mut unsent = Unsent::new(self.scope.clone(), vec![key.clone()]);
        unsent.jobs[0].1 = *sent;
        Outbox { unsent }
    }

    /// Takes the messages of `outbox` (made by [`job_outbox`](Unsent::job_outbox) for `job`)
    /// back as that job's.
    pub(crate) fn absorb(&mut self, job: usize, outbox: Outbox) {
        let Unsent { jobs, messages, .. } = outbox.unsent;
        self.jobs[job].1 = jobs[0].1;
        self.owners.extend(std::iter::repeat_n(job, messages.len()));
        self.messages.extend(messages);
    }

    /// Forgets every message of the job at `job` (it failed: none of them is written).
    pub(crate) fn drop_job(&mut self, job: usize) {
        let owners = std::mem::take(&mut self.owners);
        let messages = std::mem::take(&mut self.messages);
        for (owner, message) in owners.into_iter().zip(messages) {
            if owner != job {
                self.owners.push(owner);
                self.messages.push(message);
            }
        }
    }

    pub(crate) fn scope(&self) -> &str {
        &self.scope
    }

    /// Each message with the key of the job that sent it, in the order they were sent.
    pub(crate) fn rows(&self) -> impl Iterator<Item = (&str, &Message)> {
        self.owners
            .iter()
            .zip(&self.messages)
            .map(|(job, message)| (self.jobs[*job].0.as_str(), message))
    }
}

fn json<T: Serialize + ?Sized>(payload: &T) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(payload).map_err(|e| {
        Error::Refused(Refusal::Message {
            reason: format!("its payload cannot be serialised as JSON: {e}"),
        })
    })
}

fn check_destination(destination: &str) -> Result<(), Error> {
    let problem = if destination.is_empty() {
        "its destination is empty: name the queue, routing key or subject"
    } else if destination.len() > MAX_DESTINATION_LEN {
        "its destination is longer than 255 bytes"
    } else if destination.contains('\0') {
        "its destination holds a NUL byte"
    } else {
        return Ok(());
    };
    Err(Error::Refused(Refusal::Message {
        reason: problem.to_owned(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn key(k: &str) -> Key {
        Key::new(k).unwrap()
    }

    #[test]
    fn ids_follow_scope_key_and_position() {
        let mut a = Outbox::new("orders.ship".into(), key("order-7"));
        let first = a.send("shipping", &1).unwrap().to_owned();
        let second = a.send("shipping", &2).unwrap().to_owned();
        assert_eq!(
            first,
            job_id("orders.ship", &("order-7", 0_u32)).unwrap().as_str()
        );
        assert_ne!(first, second);
        // The same body run again sends the same ids.
        let mut again = Outbox::new("orders.ship".into(), key("order-7"));
        assert_eq!(again.send("shipping", &9).unwrap(), first);
        // Another job, or another scope, never shares one.
        let mut other = Outbox::new("orders.ship".into(), key("order-8"));
        assert_ne!(other.send("shipping", &1).unwrap(), first);
        let mut elsewhere = Outbox::new("orders.bill".into(), key("order-7"));
        assert_ne!(elsewhere.send("shipping", &1).unwrap(), first);
    }

    #[test]
    fn bad_messages_are_refused_at_send() {
        let mut outbox = Outbox::new("s".into(), key("k"));
        for (destination, payload) in [
            ("", vec![]),
            ("q\0", vec![]),
            (&"q".repeat(256) as &str, vec![]),
            ("q", vec![0; MAX_PAYLOAD + 1]),
        ] {
            let err = outbox.send_bytes(destination, payload).unwrap_err();
            assert!(
                matches!(err, Error::Refused(Refusal::Message { .. })),
                "{err}"
            );
        }
        assert!(outbox.messages().is_empty());
        assert!(outbox.send_bytes("q", vec![0; MAX_PAYLOAD]).is_ok());
    }

    #[test]
    fn a_message_is_ordered_by_its_jobs_key_unless_given_its_own() {
        let mut outbox = Outbox::new("orders.ship".into(), key("order-7"));
        outbox.send("shipping", &1).unwrap();
        outbox.send_keyed(&("customer", 42), "billing", &2).unwrap();
        outbox
            .send_bytes_keyed("customer-9", "billing", vec![])
            .unwrap();
        let keys: Vec<&str> = outbox
            .messages()
            .iter()
            .map(|m| m.ordering_key.as_str())
            .collect();
        assert_eq!(keys, ["order-7", "8:customer|2:42", "customer-9"]);
        // The ids are the job's, whatever the ordering key.
        let seqs: Vec<u32> = outbox.messages().iter().map(|m| m.seq).collect();
        assert_eq!(seqs, [0, 1, 2]);
        // A bad ordering key is refused as a bad job key is, and nothing is kept.
        let err = outbox.send_keyed("", "billing", &3).unwrap_err();
        assert!(matches!(err, Error::Refused(Refusal::Key(_))), "{err}");
        assert_eq!(outbox.messages().len(), 3);
    }

    #[test]
    fn every_message_has_a_content_type_and_a_built_one_its_headers() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut outbox = Outbox::new("s".into(), key("k"));
        outbox.send("q", &1).unwrap();
        outbox.send_bytes("q", vec![1]).unwrap();
        outbox.send_keyed("c", "q", &2).unwrap();
        let built = outbox
            .message("q")
            .header("tenant", "acme")
            .json(&3)
            .key("c")
            .traceparent(tp)
            .send()
            .unwrap()
            .to_owned();
        outbox
            .message("q")
            .content_type("application/pdf")
            .bytes(b"%PDF".to_vec())
            .send()
            .unwrap();
        let types: Vec<Option<&str>> = outbox
            .messages()
            .iter()
            .map(|m| m.headers.content_type())
            .collect();
        assert_eq!(
            types,
            [
                Some("application/json"),
                Some("application/octet-stream"),
                Some("application/json"),
                Some("application/json"),
                Some("application/pdf"),
            ]
        );
        let m = &outbox.messages()[3];
        assert_eq!(m.id, built);
        assert_eq!((m.seq, m.ordering_key.as_str()), (3, "c"));
        assert_eq!(m.headers.traceparent(), Some(tp));
        assert_eq!(m.headers.iter().collect::<Vec<_>>(), [("tenant", "acme")]);
        assert_eq!(m.payload, b"3");
        // Without a traceparent of its own, a message has the current span's: none here.
        assert_eq!(outbox.messages()[0].headers.traceparent(), None);
    }

    #[test]
    fn a_refused_built_message_keeps_nothing_and_moves_no_numbering() {
        let mut outbox = Outbox::new("s".into(), key("k"));
        let refusals = [
            outbox.message("q").send().unwrap_err(),
            outbox.message("q").json(&1).key("").send().unwrap_err(),
            outbox.message("").json(&1).send().unwrap_err(),
            outbox
                .message("q")
                .json(&1)
                .header("Nats-Msg-Id", "x")
                .send()
                .unwrap_err(),
            outbox
                .message("q")
                .json(&1)
                .traceparent("00-0-0-0")
                .send()
                .unwrap_err(),
        ];
        assert!(
            refusals[0].to_string().contains("no payload"),
            "{}",
            refusals[0]
        );
        assert!(
            matches!(refusals[1], Error::Refused(Refusal::Key(_))),
            "{}",
            refusals[1]
        );
        for err in &refusals[2..] {
            assert!(
                matches!(err, Error::Refused(Refusal::Message { .. })),
                "{err}"
            );
        }
        assert!(outbox.messages().is_empty());
        let id = outbox.message("q").json(&1).send().unwrap().to_owned();
        assert_eq!(id, job_id("s", &("k", 0_u32)).unwrap().as_str());
    }
}
