//! `replay` and `fingerprint`: what a marker remembers of the delivery that made it.
//!
//! With `replay`, the handler's `Ok` value is stored with the marker (JSON, in the same
//! transaction in transaction mode, in the completing statement in lease mode) and a later
//! delivery gets it back as [`Outcome::Replayed`](crate::Outcome::Replayed) without running.
//! With `fingerprint`, a digest of the job's payload is stored at the claim, and a later
//! delivery of the same key with another payload is [`Error::KeyReused`], whatever the
//! marker's state.

use std::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest as _, Sha256};

use crate::Error;

/// A SHA-256 digest of a payload's canonical JSON: objects with their keys sorted, no
/// whitespace, numbers and strings as `serde_json` writes them. Two payloads that serialise to
/// the same JSON value have the same fingerprint, whatever order their maps iterate in.
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
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// The most JSON a marker stores for `replay`: 1 MiB. Every backend holds far more (PostgreSQL
/// `json` up to 1 GB, MySQL `JSON` up to `max_allowed_packet`, 16 to 64 MB by default, SQLite
/// `TEXT` up to 1 GB), but a marker table of large values makes every purge and backup slow,
/// and a value over a server's packet limit would fail on every redelivery. A larger value is
/// [`Error::Serialize`] and nothing is committed.
pub const MAX_REPLAY_LEN: usize = 1 << 20;

/// What a marker recorded, read by a delivery that found it already taken.
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    pub(crate) fingerprint: Option<Vec<u8>>,
    pub(crate) result: Option<String>,
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
    /// was added replays as a plain duplicate).
    pub fn decode<T: DeserializeOwned>(&self) -> Result<Option<T>, Error> {
        self.result
            .as_deref()
            .map(|json| serde_json::from_str(json).map_err(serialize_error))
            .transpose()
    }
}

/// A stored value read back as `T`.
pub(crate) fn decode<T: DeserializeOwned>(json: &str) -> Result<T, Error> {
    serde_json::from_str(json).map_err(serialize_error)
}

/// The JSON a replayed value is stored as.
pub(crate) fn encode<T: Serialize>(value: &T) -> Result<String, Error> {
    let json = serde_json::to_string(value).map_err(serialize_error)?;
    if json.len() > MAX_REPLAY_LEN {
        return Err(Error::Serialize(format!(
            "the value to replay is {} bytes of JSON, more than the {MAX_REPLAY_LEN} a marker \
             keeps: replay a receipt (ids, totals), not a document",
            json.len()
        )));
    }
    Ok(json)
}

fn serialize_error(err: serde_json::Error) -> Error {
    Error::Serialize(err.to_string())
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
        match encode(&"x".repeat(MAX_REPLAY_LEN - 1)) {
            Err(Error::Serialize(msg)) => assert!(msg.contains("1048577 bytes"), "{msg}"),
            other => panic!("expected Serialize, got {other:?}"),
        }
    }

    #[test]
    fn a_value_that_cannot_be_serialised_is_an_error() {
        let map: std::collections::HashMap<(i32, i32), i32> = [((1, 2), 3)].into();
        assert!(matches!(Fingerprint::of(&map), Err(Error::Serialize(_))));
    }
}
