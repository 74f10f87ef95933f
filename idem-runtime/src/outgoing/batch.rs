//! A batch handler's outbox: one outbox for the batch, each message naming the job it is of,
//! so that its id and its row carry that job's key.

use std::borrow::Cow;

use serde::Serialize;

use super::{Headers, Message, MessageBuilder, Unsent, json};
use crate::error::{Error, Refusal};
use crate::key::{IntoKey, Key};

/// The messages a batch handler sends with its jobs' effects: what the body gets as
/// `outbox: &mut idem::BatchOutbox`.
///
/// Like [`Outbox`](crate::Outbox), but each [`send`](BatchOutbox::send) names the job the
/// message is of, by the same key the attribute's `key` reads from it (`&job.id` for
/// `key = "job.id"`). The message's id is then the one that job would give it in a handler of
/// one job, [`job_id`](crate::job_id)`(scope, &(key, n))` for its `n`-th message: the same ids
/// whether the job ran alone or in a batch, and every time the body runs again after a
/// rollback. All the batch's messages are written in its transaction right before the commit,
/// so they exist exactly when the fresh jobs' effects do.
///
/// Only the fresh jobs (those the body sees) can send: a key that is not one of them is
/// refused with [`Refusal::Message`], since a duplicate job's messages were sent by the
/// delivery that committed it.
#[derive(Debug)]
pub struct BatchOutbox {
    unsent: Unsent,
    /// Indices into the pending jobs, sorted by key, to find a job by its key without a copy
    /// of every key.
    by_key: Vec<usize>,
}

impl BatchOutbox {
    /// The outbox of a batch's fresh jobs (their keys, in the batch's order).
    pub(crate) fn new(scope: Cow<'static, str>, fresh: Vec<Key>) -> BatchOutbox {
        let unsent = Unsent::new(scope, fresh);
        let mut by_key: Vec<usize> = (0..unsent.jobs.len()).collect();
        by_key.sort_unstable_by_key(|i| unsent.jobs[*i].0.as_str());
        BatchOutbox { unsent, by_key }
    }

    /// Sends `payload` (as JSON) to `destination` with the effect of the job whose key is
    /// `job` (the value the attribute's `key` reads, such as `&job.id`); returns the message's
    /// id.
    ///
    /// Refused at once, before anything is written ([`Refusal::Message`]): a key that is
    /// no fresh job of this batch, and everything [`Outbox::send`](crate::Outbox::send)
    /// refuses (an empty destination, one longer than
    /// [`MAX_DESTINATION_LEN`](crate::outbox::MAX_DESTINATION_LEN) or with a NUL, a payload
    /// that does not serialise or is over [`MAX_PAYLOAD`](crate::outbox::MAX_PAYLOAD)).
    pub fn send<K, T>(&mut self, job: &K, destination: &str, payload: &T) -> Result<&str, Error>
    where
        K: IntoKey + ?Sized,
        T: Serialize + ?Sized,
    {
        let at = self.position(job)?;
        let bytes = json(payload)?;
        self.unsent
            .push(at, None, destination, bytes, Headers::json())
    }

    /// [`send`](BatchOutbox::send) of bytes as they are.
    pub fn send_bytes<K: IntoKey + ?Sized>(
        &mut self,
        job: &K,
        destination: &str,
        payload: Vec<u8>,
    ) -> Result<&str, Error> {
        let at = self.position(job)?;
        self.unsent
            .push(at, None, destination, payload, Headers::bytes())
    }

    /// [`send`](BatchOutbox::send) under an ordering key of its own instead of the job's
    /// (see [`Outbox::send_keyed`](crate::Outbox::send_keyed)).
    pub fn send_keyed<J, K, T>(
        &mut self,
        job: &J,
        ordering_key: &K,
        destination: &str,
        payload: &T,
    ) -> Result<&str, Error>
    where
        J: IntoKey + ?Sized,
        K: IntoKey + ?Sized,
        T: Serialize + ?Sized,
    {
        let at = self.position(job)?;
        let ordering_key = Key::new(ordering_key)?;
        let bytes = json(payload)?;
        self.unsent
            .push(at, Some(ordering_key), destination, bytes, Headers::json())
    }

    /// [`send_keyed`](BatchOutbox::send_keyed) of bytes as they are.
    pub fn send_bytes_keyed<J, K>(
        &mut self,
        job: &J,
        ordering_key: &K,
        destination: &str,
        payload: Vec<u8>,
    ) -> Result<&str, Error>
    where
        J: IntoKey + ?Sized,
        K: IntoKey + ?Sized,
    {
        let at = self.position(job)?;
        let ordering_key = Key::new(ordering_key)?;
        self.unsent.push(
            at,
            Some(ordering_key),
            destination,
            payload,
            Headers::bytes(),
        )
    }

    /// A message of the job whose key is `job` to `destination`, to put together (its
    /// payload, ordering key, headers) and [`send`](MessageBuilder::send) (see
    /// [`Outbox::message`](crate::Outbox::message)). A key that is no fresh job of this batch
    /// is refused by `send`.
    pub fn message<'a, K: IntoKey + ?Sized>(
        &'a mut self,
        job: &K,
        destination: &'a str,
    ) -> MessageBuilder<'a> {
        let at = self.position(job);
        MessageBuilder::new(&mut self.unsent, at, destination)
    }

    /// The messages sent so far, every job's, in the order they were sent.
    pub fn messages(&self) -> &[Message] {
        &self.unsent.messages
    }

    pub(crate) fn into_unsent(self) -> Unsent {
        self.unsent
    }

    /// The fresh job whose key `job` encodes to.
    fn position<K: IntoKey + ?Sized>(&self, job: &K) -> Result<usize, Error> {
        let key = Key::new(job)?;
        let jobs = &self.unsent.jobs;
        self.by_key
            .binary_search_by(|i| jobs[*i].0.as_str().cmp(key.as_str()))
            .map(|found| self.by_key[found])
            .map_err(|_| {
                Error::Refused(Refusal::Message {
                    reason: format!(
                        "its job's key {:?} is not one of this batch's fresh jobs: name the job by \
                     the key the attribute's `key` reads from it (a duplicate job's messages \
                     were sent by the delivery that committed it)",
                        key.as_str()
                    ),
                })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::key;
    use super::*;
    use crate::{Outbox, job_id};

    #[test]
    fn a_jobs_messages_have_the_ids_it_gets_alone() {
        let mut batch = BatchOutbox::new("orders.ship".into(), vec![key("b"), key("a")]);
        let a0 = batch.send("a", "shipping", &1).unwrap().to_owned();
        let b0 = batch.send("b", "shipping", &2).unwrap().to_owned();
        let a1 = batch.send("a", "billing", &3).unwrap().to_owned();
        let mut alone = Outbox::new("orders.ship".into(), key("a"));
        assert_eq!(alone.send("shipping", &1).unwrap(), a0);
        assert_eq!(alone.send("billing", &3).unwrap(), a1);
        assert_eq!(b0, job_id("orders.ship", &("b", 0_u32)).unwrap().as_str());
        let rows: Vec<(&str, u32)> = batch.unsent.rows().map(|(k, m)| (k, m.seq)).collect();
        assert_eq!(rows, [("a", 0), ("b", 0), ("a", 1)]);
    }

    #[test]
    fn a_key_that_is_no_fresh_job_and_a_bad_message_are_refused() {
        let mut batch = BatchOutbox::new("s".into(), vec![key("a")]);
        for err in [
            batch.send("c", "q", &1).unwrap_err(),
            batch.send("", "q", &1).unwrap_err(),
            batch.send_bytes("a", "", vec![]).unwrap_err(),
        ] {
            assert!(
                matches!(
                    err,
                    Error::Refused(Refusal::Message { .. }) | Error::Refused(Refusal::Key(_))
                ),
                "{err}"
            );
        }
        assert!(batch.messages().is_empty());
        // A refused message does not move the job's numbering.
        let id = batch.send("a", "q", &1).unwrap().to_owned();
        assert_eq!(id, job_id("s", &("a", 0_u32)).unwrap().as_str());
    }

    #[test]
    fn a_batch_message_is_built_for_a_fresh_job() {
        let mut batch = BatchOutbox::new("s".into(), vec![key("a"), key("b")]);
        let id = batch
            .message("b", "q")
            .json(&1)
            .header("tenant", "acme")
            .send()
            .unwrap()
            .to_owned();
        assert_eq!(id, job_id("s", &("b", 0_u32)).unwrap().as_str());
        assert_eq!(batch.messages()[0].headers.get("tenant"), Some("acme"));
        let err = batch.message("c", "q").json(&1).send().unwrap_err();
        assert!(err.to_string().contains("fresh jobs"), "{err}");
        assert_eq!(batch.messages().len(), 1);
    }
}
