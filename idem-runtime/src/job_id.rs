//! Producer-side ids: the same job always gets the same id, derived from its data.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::key::{IntoKey, KeyWriter, encode};
use crate::key::{KeyError, MAX_KEY_LEN};

/// A job's stable id, made by [`job_id`] from a scope and the job's data.
///
/// At most [`MAX_KEY_LEN`] (255) bytes, never empty, no NUL byte: it can be a broker's
/// deduplication id (`Nats-Msg-Id`, a Kafka record key) and an idem key alike. SQS's
/// `MessageDeduplicationId` is stricter: at most 128 characters of printable ASCII, so an id
/// of a long or non-ASCII key does not fit there as it is (the SQS example refuses it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

impl JobId {
    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for JobId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl IntoKey for JobId {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(&self.0);
    }
}

/// The stable id of the job `value` in `scope`, for the producer to attach to the message.
///
/// It is the key encoding of the tuple `(scope, value)` (as [`Key::new`](crate::Key::new)
/// makes it: `12:send-invoice|8:order-42`), or, when that is longer than 255 bytes, `sha256:`
/// and the hex digest of that encoding (71 bytes). The same data gives the same id in every
/// process and every release; different scopes or values give different ids. Nothing random
/// goes in, so a producer that retries a publish (a double click, a timeout whose publish did
/// land) sends the same id again and a broker that deduplicates on it can drop the copy.
///
/// A broker's deduplication only holds within its window (two minutes by default on
/// JetStream, five on SQS FIFO) and only for publishes: redeliveries of one message, copies
/// published after the window and replays from a dead-letter queue all reach the consumer.
/// This id therefore never replaces the handler's claim (`#[idempotent]`); it only spares the
/// consumer some of the copies.
///
/// Fails like a key does: on an empty value (or empty scope), or a NUL byte.
///
/// ```
/// # use idem_runtime::job_id;
/// let id = job_id("send-invoice", &"order-42").unwrap();
/// assert_eq!(id.as_str(), "12:send-invoice|8:order-42");
/// assert_eq!(id, job_id("send-invoice", &"order-42").unwrap());
/// ```
pub fn job_id<V: IntoKey + ?Sized>(scope: &str, value: &V) -> Result<JobId, KeyError> {
    bounded_encoding(&(scope, value)).map(JobId)
}

/// The key encoding of `value` if it fits in [`MAX_KEY_LEN`] bytes, else `sha256:` and the hex
/// digest of that encoding. Shared by [`job_id`] and `Lease::idempotency_key`, so that both
/// ids of a job are built one way.
pub(crate) fn bounded_encoding<K: IntoKey + ?Sized>(value: &K) -> Result<String, KeyError> {
    let encoded = encode(value)?;
    if encoded.is_empty() {
        return Err(KeyError::Empty);
    }
    if encoded.len() <= MAX_KEY_LEN {
        return Ok(encoded);
    }
    let digest = Sha256::digest(encoded.as_bytes());
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in digest {
        // Writing into a String cannot fail.
        let _ = fmt::Write::write_fmt(&mut out, format_args!("{b:02x}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_are_stable_and_distinct() {
        let id = job_id("send-invoice", &"order-42").unwrap();
        // Stable: the encoding is written down here, so a change to it fails this test.
        assert_eq!(id.as_str(), "12:send-invoice|8:order-42");
        assert_eq!(id.to_string(), id.as_str());
        assert_eq!(AsRef::<str>::as_ref(&id), id.as_str());
        assert_eq!(
            id,
            job_id("send-invoice", &String::from("order-42")).unwrap()
        );
        assert_eq!(job_id("top-up", &7_u64).unwrap().as_str(), "6:top-up|1:7");
        assert_eq!(
            job_id("top-up", &("acme", 7)).unwrap().as_str(),
            "6:top-up|(4:acme|1:7)"
        );

        // Another scope, another value, or the same characters split differently: another id.
        assert_ne!(id, job_id("send-reminder", &"order-42").unwrap());
        assert_ne!(id, job_id("send-invoice", &"order-43").unwrap());
        assert_ne!(
            job_id("a|1:b", &"c").unwrap(),
            job_id("a", &"b|1:c").unwrap()
        );

        // Over 255 bytes: a digest, itself stable and distinct.
        let long = job_id("send-invoice", &"x".repeat(300)).unwrap();
        assert!(long.as_str().starts_with("sha256:"), "{long}");
        assert_eq!(long.as_str().len(), 71);
        assert_eq!(long, job_id("send-invoice", &"x".repeat(300)).unwrap());
        assert_ne!(long, job_id("send-invoice", &"y".repeat(300)).unwrap());
        assert_ne!(long, job_id("other", &"x".repeat(300)).unwrap());
        // Up to 255 bytes stays readable.
        let edge = "x".repeat(255 - "12:send-invoice|235:".len());
        let plain = job_id("send-invoice", &edge).unwrap();
        assert_eq!(plain.as_str().len(), 255, "{plain}");
        let over = job_id("send-invoice", &format!("{edge}x")).unwrap();
        assert!(over.as_str().starts_with("sha256:"), "{over}");

        assert_eq!(job_id("send-invoice", ""), Err(KeyError::Empty));
        assert_eq!(job_id("", &"order-42"), Err(KeyError::Empty));
        assert_eq!(job_id("send-invoice", "a\0b"), Err(KeyError::Nul));
    }

    #[test]
    fn a_job_id_is_a_key_of_its_own() {
        let id = job_id("send-invoice", &"order-42").unwrap();
        assert_eq!(crate::Key::new(&id).unwrap().as_str(), id.as_str());
    }
}
