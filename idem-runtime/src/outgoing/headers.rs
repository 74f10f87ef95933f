//! A message's headers: its content type, the W3C `traceparent` of the work that wrote it, and
//! the user's own, checked before anything is written and stored as one JSON object that only
//! the relay reads.

use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};

use crate::error::{Error, Refusal};
use crate::traceparent::{TRACEPARENT, TraceParent};

/// The most a message's headers hold: the sum, over every header (the content type and the
/// `traceparent` included), of its name's and its value's bytes and 32 more (HTTP/2's measure
/// of a header list). Well under what every broker takes, and what the outbox table's column
/// holds once written as JSON.
pub const MAX_HEADERS_SIZE: usize = 16 * 1024;

/// What a header costs beyond its name and value in [`MAX_HEADERS_SIZE`].
const HEADER_OVERHEAD: usize = 32;

/// The longest header name: what AMQP's short strings (the keys of its headers table) hold.
const MAX_NAME_LEN: usize = 255;

/// The longest content type: what AMQP's short strings (its `content_type`) hold.
const MAX_CONTENT_TYPE_LEN: usize = 255;

/// The header name that carries the content type in the stored JSON and on brokers whose
/// headers are all there is (JetStream, Kafka); the trace context's is [`TRACEPARENT`].
pub(crate) const CONTENT_TYPE: &str = "content-type";

/// The content type of [`Outbox::send`](crate::Outbox::send)'s JSON.
pub(crate) const JSON: &str = "application/json";
/// The content type of [`Outbox::send_bytes`](crate::Outbox::send_bytes)'s bytes.
pub(crate) const BYTES: &str = "application/octet-stream";

/// A message's headers: its content type, the W3C trace context of the work that sent it
/// (`traceparent`), and headers of your own (name and text value), in the order they were set.
///
/// Every message the outbox writes has a content type: `application/json` for a value sent as
/// JSON, `application/octet-stream` for bytes, unless set otherwise
/// ([`MessageBuilder::content_type`](crate::outbox::MessageBuilder::content_type)). A message
/// written before headers existed (schema version 3) has none at all, and is published
/// without.
///
/// The relay gives them to the broker as it carries headers: RabbitMQ's `content_type`
/// property and its headers table, JetStream's and Kafka's headers (`content-type`,
/// `traceparent` and yours).
///
/// # What a header may be
///
/// Checked before anything is written ([`Refusal::Message`]):
/// - a name is 1 to 255 of the characters HTTP allows in a token (RFC 9110: letters, digits
///   and ``!#$%&'*+-.^_`|~``), set once (names compare without case), and none of the names
///   idem or a broker gives a meaning to: `content-type` and `traceparent` (set them with their
///   own methods), anything starting with `idem-` (the message's id travels in one) or `Nats-`
///   (JetStream acts on them: `Nats-Msg-Id`, `Nats-Expected-*`, `Nats-Rollup`...);
/// - a value holds no control character but tabs (no NUL, CR or LF), and does not start or
///   end with a space or a tab (brokers with text headers strip them);
/// - a `traceparent` is W3C Trace Context version `00`: `00-<32 hex>-<16 hex>-<2 hex>`, in
///   lower case, the trace and parent ids not all zeros;
/// - a content type is `type/subtype` (tokens), optionally followed by `;` and parameters, at
///   most 255 bytes;
/// - all of them together are at most [`MAX_HEADERS_SIZE`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    content_type: Option<String>,
    traceparent: Option<String>,
    fields: Vec<(String, String)>,
}

impl Headers {
    /// No headers.
    pub fn new() -> Headers {
        Headers::default()
    }

    /// The message's content type, if it has one (a message written before headers has none).
    pub fn content_type(&self) -> Option<&str> {
        self.content_type.as_deref()
    }

    /// The W3C `traceparent` of the work that sent the message, if it had one.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// Your own headers (neither the content type nor the `traceparent`), in the order they
    /// were set.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> {
        self.fields.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// The value of your header `name` (compared without case), if it is set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether there is no header at all: no content type, no `traceparent`, none of yours.
    pub fn is_empty(&self) -> bool {
        self.content_type.is_none() && self.traceparent.is_none() && self.fields.is_empty()
    }

    /// These headers with `content_type` as the content type.
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Headers {
        self.content_type = Some(content_type.into());
        self
    }

    /// These headers with `traceparent` as the W3C trace context.
    pub fn with_traceparent(mut self, traceparent: impl Into<String>) -> Headers {
        self.traceparent = Some(traceparent.into());
        self
    }

    /// These headers and your header `name: value` after them.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Headers {
        self.fields.push((name.into(), value.into()));
        self
    }

    /// What a JSON payload starts with: its content type.
    pub(crate) fn json() -> Headers {
        Headers::new().with_content_type(JSON)
    }

    /// What bytes start with: their content type.
    pub(crate) fn bytes() -> Headers {
        Headers::new().with_content_type(BYTES)
    }

    pub(crate) fn set_content_type_if_none(&mut self, content_type: &str) {
        if self.content_type.is_none() {
            self.content_type = Some(content_type.to_owned());
        }
    }

    pub(crate) fn set_traceparent_if_none(&mut self, traceparent: Option<String>) {
        if self.traceparent.is_none() {
            self.traceparent = traceparent;
        }
    }

    /// Every header as it goes to a broker whose headers are all there is: the content type
    /// and the `traceparent` first, under their names, then yours.
    pub fn all(&self) -> impl Iterator<Item = (&str, &str)> {
        let content_type = self.content_type().map(|v| (CONTENT_TYPE, v));
        let traceparent = self.traceparent().map(|v| (TRACEPARENT, v));
        content_type
            .into_iter()
            .chain(traceparent)
            .chain(self.iter())
    }

    /// Refuses what no broker should get (see [`Headers`]), naming the header and the fix.
    pub(crate) fn check(&self) -> Result<(), Error> {
        let refuse = |reason: String| Err(Error::Refused(Refusal::Message { reason }));
        if let Some(content_type) = &self.content_type
            && let Err(problem) = check_content_type(content_type)
        {
            return refuse(format!("its content type {content_type:?} {problem}"));
        }
        if let Some(traceparent) = &self.traceparent
            && let Err(problem) = TraceParent::parse(traceparent)
        {
            return refuse(format!(
                "its traceparent {traceparent:?} is not a W3C Trace Context: {problem}"
            ));
        }
        for (at, (name, value)) in self.fields.iter().enumerate() {
            if let Err(problem) = check_name(name) {
                return refuse(format!("its header name {name:?} {problem}"));
            }
            if self.fields[..at]
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case(name))
            {
                return refuse(format!(
                    "its header {name:?} is set twice (names compare without case): set it once"
                ));
            }
            if let Err(problem) = check_value(value) {
                return refuse(format!("the value of its header {name:?} {problem}"));
            }
        }
        let size: usize = self
            .all()
            .map(|(name, value)| name.len() + value.len() + HEADER_OVERHEAD)
            .sum();
        if size > MAX_HEADERS_SIZE {
            return refuse(format!(
                "its headers are {size} bytes (names and values, 32 more each), more than the \
                 {MAX_HEADERS_SIZE} a message carries: put what is large in the payload"
            ));
        }
        Ok(())
    }

    /// The stored form: one JSON object, the content type and the `traceparent` under their
    /// names first, then yours in their order; `None` for no headers (stored as NULL).
    pub(crate) fn to_json(&self) -> Option<String> {
        if self.is_empty() {
            return None;
        }
        let mut out = String::from("{");
        for (at, (name, value)) in self.all().enumerate() {
            if at > 0 {
                out.push(',');
            }
            // Strings never fail to serialise.
            out.push_str(&serde_json::to_string(name).unwrap_or_default());
            out.push(':');
            out.push_str(&serde_json::to_string(value).unwrap_or_default());
        }
        out.push('}');
        Some(out)
    }

    /// Reads [`to_json`](Headers::to_json)'s form back (NULL: no headers).
    pub(crate) fn from_json(stored: Option<&str>) -> Result<Headers, serde_json::Error> {
        let Some(stored) = stored else {
            return Ok(Headers::default());
        };
        let mut de = serde_json::Deserializer::from_str(stored);
        let pairs = de.deserialize_map(InOrder)?;
        de.end()?;
        let mut headers = Headers::default();
        for (name, value) in pairs {
            if name == CONTENT_TYPE {
                headers.content_type = Some(value);
            } else if name == TRACEPARENT {
                headers.traceparent = Some(value);
            } else {
                headers.fields.push((name, value));
            }
        }
        Ok(headers)
    }
}

/// A JSON object of strings, its entries in the order they are written.
struct InOrder;

impl<'de> Visitor<'de> for InOrder {
    type Value = Vec<(String, String)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of header names and their text values")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(pair) = map.next_entry()? {
            pairs.push(pair);
        }
        Ok(pairs)
    }
}

/// RFC 9110's `tchar`: what a header name (a token) is made of.
fn is_tchar(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("is empty: name the header".to_owned());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "is longer than {MAX_NAME_LEN} bytes, what AMQP's header names hold"
        ));
    }
    if let Some(bad) = name.chars().find(|c| !is_tchar(*c)) {
        return Err(format!(
            "holds {bad:?}: a header name is letters, digits and !#$%&'*+-.^_`|~"
        ));
    }
    let lower = name.to_ascii_lowercase();
    if lower == CONTENT_TYPE {
        return Err("is the content type's: set it with `content_type`".to_owned());
    }
    if lower == TRACEPARENT {
        return Err("is the trace context's: set it with `traceparent`".to_owned());
    }
    if lower.starts_with("idem-") {
        return Err(
            "starts with `idem-`, which idem keeps for its own (the message's id): choose \
             another name"
                .to_owned(),
        );
    }
    if lower.starts_with("nats-") {
        return Err(
            "starts with `Nats-`, which JetStream acts on (`Nats-Msg-Id` is the message's id, \
             `Nats-Expected-*` conditions the publish): choose another name"
                .to_owned(),
        );
    }
    Ok(())
}

fn check_value(value: &str) -> Result<(), String> {
    if let Some(bad) = value.chars().find(|c| c.is_control() && *c != '\t') {
        return Err(format!(
            "holds the control character {bad:?}: a header value is one line of text \
             (no NUL, CR or LF)"
        ));
    }
    if value.starts_with([' ', '\t']) || value.ends_with([' ', '\t']) {
        return Err(
            "starts or ends with a space or a tab, which brokers with text headers strip: \
             trim it"
                .to_owned(),
        );
    }
    Ok(())
}

fn check_content_type(content_type: &str) -> Result<(), String> {
    if content_type.len() > MAX_CONTENT_TYPE_LEN {
        return Err(format!(
            "is longer than {MAX_CONTENT_TYPE_LEN} bytes, what AMQP's content_type holds"
        ));
    }
    check_value(content_type)?;
    let essence = content_type.split(';').next().unwrap_or_default();
    let token = |t: &str| !t.is_empty() && t.chars().all(is_tchar);
    match essence.trim_end().split_once('/') {
        Some((kind, sub)) if token(kind) && token(sub) => Ok(()),
        _ => Err(
            "is not a media type: give `type/subtype` (`application/json`), parameters after \
             a `;`"
                .to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn refused(headers: Headers) -> String {
        match headers.check() {
            Err(Error::Refused(Refusal::Message { reason })) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn good_headers_pass_and_round_trip_in_order() {
        let headers = Headers::new()
            .with_content_type("application/cloudevents+json; charset=utf-8")
            .with_traceparent(TP)
            .with_header("z-last", "1")
            .with_header("a-first", "a value\twith \"quotes\" and é");
        headers.check().unwrap();
        let stored = headers.to_json().unwrap();
        assert!(stored.starts_with("{\"content-type\":"), "{stored}");
        let back = Headers::from_json(Some(&stored)).unwrap();
        assert_eq!(back, headers);
        assert_eq!(
            back.iter().collect::<Vec<_>>(),
            [
                ("z-last", "1"),
                ("a-first", "a value\twith \"quotes\" and é")
            ]
        );
        assert_eq!(back.get("A-FIRST"), headers.get("a-first"));
        assert_eq!(Headers::new().to_json(), None);
        assert_eq!(Headers::from_json(None).unwrap(), Headers::new());
        assert!(Headers::from_json(Some("[1]")).is_err());
    }

    #[test]
    fn bad_names_and_values_are_refused_with_the_fix() {
        for (name, says) in [
            ("", "empty"),
            (&"n".repeat(256), "255"),
            ("a b", "letters, digits"),
            ("a:b", "letters, digits"),
            ("é", "letters, digits"),
            ("Content-Type", "content_type"),
            ("TraceParent", "`traceparent`"),
            ("idem-message-id", "idem-"),
            ("Nats-Msg-Id", "JetStream"),
            ("nats-expected-stream", "JetStream"),
        ] {
            let reason = refused(Headers::new().with_header(name, "v"));
            assert!(reason.contains(says), "{name:?}: {reason}");
        }
        for (value, says) in [
            ("a\0b", "control"),
            ("a\r\nb", "control"),
            ("a\nb", "control"),
            ("\u{7f}", "control"),
            (" padded", "trim"),
            ("padded\t", "trim"),
        ] {
            let reason = refused(Headers::new().with_header("x", value));
            assert!(reason.contains(says), "{value:?}: {reason}");
        }
        let twice = Headers::new()
            .with_header("X-a", "1")
            .with_header("x-A", "2");
        assert!(refused(twice).contains("twice"));
        assert!(Headers::new().with_header("x", "").check().is_ok());
    }

    #[test]
    fn traceparents_must_be_w3c_version_00() {
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            let reason = refused(Headers::new().with_traceparent(bad));
            assert!(reason.contains("W3C"), "{bad:?}: {reason}");
        }
        Headers::new().with_traceparent(TP).check().unwrap();
    }

    #[test]
    fn content_types_are_media_types() {
        for bad in ["json", "/json", "application/", "a b/c", "text/plain\n", ""] {
            let reason = refused(Headers::new().with_content_type(bad));
            assert!(reason.contains("content type"), "{bad:?}: {reason}");
        }
        let long = format!("application/{}", "x".repeat(250));
        assert!(refused(Headers::new().with_content_type(long)).contains("255"));
        Headers::new()
            .with_content_type("text/plain;charset=utf-8")
            .check()
            .unwrap();
    }

    #[test]
    fn the_headers_size_is_bounded() {
        // One header of exactly the limit passes; a byte more is refused.
        let value = "v".repeat(MAX_HEADERS_SIZE - HEADER_OVERHEAD - 1);
        Headers::new().with_header("x", &value).check().unwrap();
        let over = Headers::new().with_header("x", format!("{value}v"));
        assert!(refused(over).contains("16384"));
        // The content type counts too.
        let with_type = Headers::new()
            .with_content_type("a/b")
            .with_header("x", &value);
        assert!(refused(with_type).contains("bytes"));
    }
}
