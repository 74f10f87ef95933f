//! A record as the consumer hands it out: owned, with its place in the log, and the key the
//! per-message marker mode claims it by.

use rdkafka::Message as _;
use rdkafka::message::{BorrowedMessage, Headers as _};

use crate::error::{Error, Refusal};
use crate::key::Key;
use crate::offsets::{RecordOffset, record_key};
use crate::traceparent::{TRACEPARENT, TraceParent};

/// One record of a topic, as the broker delivered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    timestamp: Option<i64>,
}

impl Record {
    pub(crate) fn of(message: &BorrowedMessage<'_>) -> Record {
        let headers = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        Record {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().map(<[u8]>::to_vec),
            headers,
            timestamp: message.timestamp().to_millis(),
        }
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The partition of the topic.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// The record's offset in its partition.
    pub fn offset(&self) -> i64 {
        self.offset
    }

    /// Its place in the log, as an offset claim takes it.
    pub fn at(&self) -> RecordOffset<'_> {
        RecordOffset {
            topic: &self.topic,
            partition: self.partition,
            offset: self.offset,
        }
    }

    /// The record's key (Kafka's, which chose its partition), if it has one.
    pub fn key(&self) -> Option<&[u8]> {
        self.key.as_deref()
    }

    /// The record's value, if it has one.
    pub fn payload(&self) -> Option<&[u8]> {
        self.payload.as_deref()
    }

    /// The value of the first header called `name`; `None` if there is no such header or it
    /// has no value.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// The producer's trace context: its `traceparent` header
    /// ([`TRACEPARENT`](crate::TRACEPARENT)), if it has one that parses. A value that does
    /// not is ignored with a `debug` event ([`TraceParent::from_header`]): the header is the
    /// producer's to get wrong, and must not fail the record's job. Give it to a claim with
    /// [`ClaimOptions::link`](crate::ClaimOptions::link) or the attribute's
    /// `link = "record.traceparent()"`; [`Consumer::claim`](super::Consumer::claim) links
    /// every record's.
    pub fn traceparent(&self) -> Option<TraceParent> {
        self.header(TRACEPARENT).and_then(TraceParent::from_header)
    }

    /// Every header, in the order the producer set them.
    pub fn headers(&self) -> &[(String, Option<Vec<u8>>)] {
        &self.headers
    }

    /// The record's timestamp, in milliseconds since 1970, if the broker gave one.
    pub fn timestamp(&self) -> Option<i64> {
        self.timestamp
    }

    /// The key of the record's place in the log, `topic/partition/offset`
    /// ([`record_key`]): what the per-message marker mode claims when the producer sets no id.
    pub fn offset_key(&self) -> Key {
        record_key(&self.topic, self.partition, self.offset)
    }

    /// The key the producer gave the record in the header `name` (an id it sets once and
    /// keeps when it retries, so that a record sent twice, at two offsets, is one job), for
    /// the per-message marker mode.
    ///
    /// A record without that header, or whose value is not a valid key (empty, longer than
    /// [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes, not UTF-8, with a NUL), is refused with
    /// [`Refusal::Record`] naming the record, before any I/O: nothing can tell whether it
    /// is a retry of another record. Handle it as a poison record (a dead-letter topic), or
    /// fall back to [`offset_key`](Record::offset_key) knowingly.
    pub fn id_key(&self, name: &str) -> Result<Key, Error> {
        let refuse = |why: &str| {
            Error::Refused(Refusal::Record {
                reason: format!(
                    "the record at {:?} partition {} offset {} {why}: it cannot be told apart from \
                 a retry of another record; dead-letter it, or key it by its offset",
                    self.topic, self.partition, self.offset
                ),
            })
        };
        let value = match self.headers.iter().find(|(n, _)| n == name) {
            Some((_, Some(value))) => value,
            Some((_, None)) | None => return Err(refuse(&format!("has no header {name:?}"))),
        };
        let text = std::str::from_utf8(value)
            .map_err(|_| refuse(&format!("has a header {name:?} that is not UTF-8")))?;
        Key::new(text).map_err(|e| refuse(&format!("has a header {name:?} that is no key ({e})")))
    }
}
