//! What a marker records of the delivery that made it: the payload's fingerprint, and the
//! value to replay.
//!
//! With `replay`, the handler's `Ok` value is stored with the marker (JSON, in the same
//! transaction in transaction mode, in the completing statement in lease mode) and a later
//! delivery gets it back as [`Outcome::Replayed`](crate::Outcome::Replayed) without running.
//! With `fingerprint`, a digest of the job's payload is stored at the claim, and a later
//! delivery of the same key with another payload is [`Error::KeyReused`], whatever the
//! marker's state. An error's text that a column keeps (a permanent failure's, a relay's last
//! error) is cut to its bound by [`bounded`].

use std::borrow::Cow;
use std::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest as _, Sha256};

use crate::error::Error;

/// A SHA-256 digest of a payload's canonical JSON: objects with their keys sorted, no
/// whitespace, numbers and strings as `serde_json` writes them (but `-0.0`, written `0.0`, as
/// the equal `0.0` is). Two payloads that serialise to the same JSON value have the same
/// fingerprint, whatever order their maps iterate in.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of `value`; [`Error::Serialize`] if it cannot be serialised.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use std::collections::HashMap;
    ///
    /// use idem::Fingerprint;
    ///
    /// let a: HashMap<_, _> = [("x", 1), ("y", 2)].into();
    /// let b: HashMap<_, _> = [("y", 2), ("x", 1)].into();
    /// assert_eq!(Fingerprint::of(&a).unwrap(), Fingerprint::of(&b).unwrap());
    /// assert_ne!(Fingerprint::of(&a).unwrap(), Fingerprint::of(&("x", 1)).unwrap());
    /// ```
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<Fingerprint, Error> {
        let value = serde_json::to_value(value).map_err(serialize_error)?;
        let mut canonical = String::new();
        write_canonical(&value, &mut canonical);
        Ok(Fingerprint(Sha256::digest(canonical.as_bytes()).into()))
    }

    /// A fingerprint of raw bytes (an HTTP request's method, path and body): their SHA-256,
    /// with no JSON in between.
    #[cfg(feature = "axum")]
    pub(crate) fn of_bytes(parts: &[&[u8]]) -> Fingerprint {
        let mut digest = Sha256::new();
        for part in parts {
            // Each part prefixed by its length, so that no two sequences of parts digest alike.
            digest.update((part.len() as u64).to_be_bytes());
            digest.update(part);
        }
        Fingerprint(digest.finalize().into())
    }

    /// The digest's 32 bytes, as stored in the marker's `fingerprint` column.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("..)")
    }
}

/// Compact JSON with object keys in sorted order. `serde_json`'s own map is sorted unless some
/// crate in the build enables its `preserve_order` feature, so the order is imposed here.
fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        // `-0.0 == 0.0` for `serde_json` (and JSON's canonical form, RFC 8785, writes both as
        // `0`), but `serde_json` writes them apart: one spelling, so equal values stay one
        // digest. Found by the fuzz target `fingerprint`.
        Value::Number(n) if n.is_f64() && n.as_f64() == Some(0.0) => out.push_str("0.0"),
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// The most JSON a marker stores for `replay`: 1 MiB. Every backend holds far more (PostgreSQL
/// `json` up to 1 GB, MySQL `JSON` up to `max_allowed_packet`, 16 to 64 MB by default, SQLite
/// `TEXT` up to 1 GB), but a marker table of large values makes every purge and backup slow,
/// and a value over a server's packet limit would fail on every redelivery. A larger value is
/// refused as soon as its JSON passes the limit, before the rest of it is built: in transaction
/// mode with [`Error::Serialize`] (the transaction is rolled back), in lease mode with
/// [`Error::ValueNotStored`] (the outside call happened: the marker completes without a value).
pub const MAX_REPLAY_LEN: usize = 1 << 20;

/// What a marker recorded, read by a delivery that found it already taken.
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    pub(crate) fingerprint: Option<Vec<u8>>,
    pub(crate) result: Option<String>,
    /// A failure the marker completed with (a lease's permanent error).
    pub(crate) error: Option<String>,
}

impl Recorded {
    /// [`Error::KeyReused`] if the marker holds a fingerprint other than `ours`. A marker
    /// without one (written before `fingerprint` was added) matches any payload.
    pub(crate) fn check(
        &self,
        ours: Option<&Fingerprint>,
        scope: &str,
        key: &str,
    ) -> Result<(), Error> {
        match (ours, &self.fingerprint) {
            (Some(ours), Some(theirs)) if theirs.as_slice() != ours.as_bytes() => {
                Err(Error::KeyReused {
                    scope: scope.to_owned(),
                    key: key.to_owned(),
                })
            }
            _ => Ok(()),
        }
    }

    /// The stored value, if the first delivery stored one.
    pub fn result_json(&self) -> Option<&str> {
        self.result.as_deref()
    }

    /// The stored value as `T`: `None` if nothing was stored (a marker from before `replay`
    /// was added replays as a plain duplicate). A stored value that no longer reads as `T`
    /// (the type changed since) is [`Error::Serialize`]; the job itself was applied.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<Option<T>, Error> {
        self.result
            .as_deref()
            .map(|json| {
                decode(json).map_err(|e| {
                    Error::Serialize(format!(
                        "the value an earlier delivery stored for `replay` no longer reads as \
                         the handler's type: {e}; the job was applied by that delivery (ack \
                         it), only its value is lost"
                    ))
                })
            })
            .transpose()
    }
}

/// A stored value read back as `T`.
pub(crate) fn decode<T: DeserializeOwned>(json: &str) -> Result<T, serde_json::Error> {
    serde_json::from_str(json)
}

/// Why a value could not be stored for `replay`.
#[derive(Debug)]
pub(crate) struct NotStorable(pub(crate) String);

/// The JSON a replayed value is stored as; written into a buffer that refuses to grow past
/// [`MAX_REPLAY_LEN`], so an oversized value stops serialising there.
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<String, NotStorable> {
    let mut out = Bounded(Vec::new());
    if let Err(e) = serde_json::to_writer(&mut out, value) {
        return Err(NotStorable(if e.is_io() {
            format!(
                "its JSON is more than the {MAX_REPLAY_LEN} bytes a marker keeps: replay a \
                 receipt (ids, totals), not a document"
            )
        } else {
            format!("it cannot be serialised as JSON: {e}")
        }));
    }
    // serde_json writes UTF-8 only.
    Ok(String::from_utf8(out.0).expect("serde_json writes UTF-8"))
}

/// A writer that fails once more than [`MAX_REPLAY_LEN`] bytes were written.
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_REPLAY_LEN {
            return Err(std::io::Error::other("over MAX_REPLAY_LEN"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn serialize_error(err: serde_json::Error) -> Error {
    Error::Serialize(format!(
        "the `fingerprint` expression cannot be serialised as JSON: {err}; nothing was \
         written (fix its `Serialize`, or point `fingerprint` at fields that serialise)"
    ))
}

/// `text`, cut to at most `max` bytes at a character boundary, and marked with `…` where it
/// was cut: an error's text as a column keeps it.
pub(crate) fn bounded(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max - '…'.len_utf8();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end]).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let value = serde_json::json!({"b": [ {"z": 1, "a": 2} ], "a": "x"});
        let mut out = String::new();
        write_canonical(&value, &mut out);
        assert_eq!(out, r#"{"a":"x","b":[{"a":2,"z":1}]}"#);
    }

    /// The fuzz target `fingerprint` found `-0.0` and `0.0`, equal values, with two digests.
    #[test]
    fn negative_zero_is_zero() {
        let mut out = String::new();
        write_canonical(&serde_json::json!([-0.0, 0.0, 0, {"x": -0.0}]), &mut out);
        assert_eq!(out, r#"[0.0,0.0,0,{"x":0.0}]"#);
        assert_eq!(
            Fingerprint::of(&-0.0_f64).unwrap(),
            Fingerprint::of(&0.0_f64).unwrap()
        );
        assert_eq!(
            Fingerprint::of(&serde_json::json!({"amount": -0.0})).unwrap(),
            Fingerprint::of(&serde_json::json!({"amount": 0.0})).unwrap()
        );
        // A float zero is still not the integer zero: they are different values.
        assert_ne!(
            Fingerprint::of(&0.0_f64).unwrap(),
            Fingerprint::of(&0_u64).unwrap()
        );
    }

    #[test]
    fn different_payloads_have_different_fingerprints() {
        let a = Fingerprint::of(&serde_json::json!({"amount": 100})).unwrap();
        let b = Fingerprint::of(&serde_json::json!({"amount": 101})).unwrap();
        assert_ne!(a, b);
        assert_eq!(
            a,
            Fingerprint::of(&serde_json::json!({"amount": 100})).unwrap()
        );
    }

    #[test]
    fn a_value_over_the_replay_limit_is_refused() {
        assert!(encode(&"x".repeat(MAX_REPLAY_LEN - 2)).is_ok());
        let refused = encode(&"x".repeat(MAX_REPLAY_LEN - 1)).unwrap_err();
        assert!(
            refused.0.contains("more than the 1048576 bytes"),
            "{refused:?}"
        );
        // An endless sequence is cut at the limit instead of filling memory.
        struct Endless;
        impl Serialize for Endless {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_seq(std::iter::repeat_n("x", usize::MAX))
            }
        }
        assert!(encode(&Endless).unwrap_err().0.contains("more than"));
    }

    #[test]
    fn a_value_that_cannot_be_serialised_is_an_error() {
        let map: std::collections::HashMap<(i32, i32), i32> = [((1, 2), 3)].into();
        assert!(matches!(Fingerprint::of(&map), Err(Error::Serialize(_))));
    }

    #[test]
    fn error_texts_are_cut_at_a_character_boundary() {
        assert_eq!(bounded("short", 2000), "short");
        let long = "é".repeat(2000);
        let cut = bounded(&long, 2000);
        assert!(cut.len() <= 2000, "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert!(cut.trim_end_matches('…').chars().all(|c| c == 'é'));
    }
}
