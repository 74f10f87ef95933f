//! The fingerprint's canonical JSON (`idem::Fingerprint::of`).
//!
//! The input is either JSON text (its objects keep the order written: this crate turns on
//! `serde_json`'s `preserve_order`, as any crate in a user's build may) or draws a JSON value
//! directly. Checked:
//! - the digest is SHA-256 of the compact JSON with every object's keys sorted, as written
//!   here by `serde_json` itself;
//! - the same value with every object's keys in another order has the same digest, both as a
//!   `serde_json::Value` and through a `Serialize` that writes the map entries in that order;
//! - two values that differ (by `serde_json`'s equality) have different digests, and two that
//!   are equal (`-0.0` and `0.0` among them) the same.
#![no_main]

use arbitrary::{Result, Unstructured};
use idem::Fingerprint;
use libfuzzer_sys::fuzz_target;
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::{Map, Number, Value};
use sha2::{Digest as _, Sha256};

/// Keys that collide in prefix, case, escapes and byte order.
const KEYS: [&str; 12] = [
    "",
    "a",
    "b",
    "A",
    "aa",
    "a\u{0}",
    "\"",
    "\\",
    "é",
    "e\u{301}",
    "\u{1F600}",
    "\u{7f}",
];

fn string(u: &mut Unstructured<'_>) -> Result<String> {
    Ok(if u.ratio(1, 3)? {
        u.arbitrary()?
    } else {
        u.choose(&KEYS)?.to_string()
    })
}

fn number(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=4)? {
        0 => Value::from(u.int_in_range(-3i64..=3)?),
        1 => Value::from(u.arbitrary::<u64>()?),
        2 => Value::from(u.arbitrary::<i64>()?),
        // Not finite: `serde_json` makes it `null`.
        3 => Value::from(f64::from_bits(u.arbitrary()?)),
        _ => Number::from_f64(*u.choose(&[0.0, -0.0, 1.0, -1.5, 1e300, 5e-324, 0.1])?)
            .map_or(Value::Null, Value::Number),
    })
}

fn value(u: &mut Unstructured<'_>, depth: u32) -> Result<Value> {
    let kind = if depth == 0 {
        u.int_in_range(0..=3)?
    } else {
        u.int_in_range(0..=5)?
    };
    Ok(match kind {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => number(u)?,
        3 => Value::String(string(u)?),
        4 => {
            let mut items = Vec::new();
            for _ in 0..u.int_in_range(0..=4)? {
                items.push(value(u, depth - 1)?);
            }
            Value::Array(items)
        }
        _ => {
            let mut map = Map::new();
            for _ in 0..u.int_in_range(0..=5)? {
                map.insert(string(u)?, value(u, depth - 1)?);
            }
            Value::Object(map)
        }
    })
}

/// `value` with every object's entries permuted by `u` (a new map: insertion order is kept).
fn shuffled(value: &Value, u: &mut Unstructured<'_>) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            shuffle(&mut entries, u);
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), shuffled(v, u)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(|v| shuffled(v, u)).collect()),
        scalar => scalar.clone(),
    }
}

fn shuffle<T>(items: &mut [T], u: &mut Unstructured<'_>) {
    for i in (1..items.len()).rev() {
        let j = u.int_in_range(0..=i).unwrap_or(0);
        items.swap(i, j);
    }
}

/// Serialises a value with its objects' entries in reverse order: a `HashMap` or a struct
/// that writes its fields in some order of its own.
struct Reversed<'a>(&'a Value);

impl Serialize for Reversed<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self.0 {
            Value::Object(map) => {
                let mut m = s.serialize_map(Some(map.len()))?;
                for (k, v) in map.iter().rev() {
                    m.serialize_entry(k, &Reversed(v))?;
                }
                m.end()
            }
            Value::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for v in items {
                    seq.serialize_element(&Reversed(v))?;
                }
                seq.end()
            }
            scalar => scalar.serialize(s),
        }
    }
}

/// The canonical form, built another way: sort every object, then let `serde_json` write it.
fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), sorted(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        // Equal to `0.0`, so spelt like it (`Fingerprint`'s documentation says so).
        Value::Number(n) if n.as_f64() == Some(0.0) && n.is_f64() => Value::from(0.0),
        scalar => scalar.clone(),
    }
}

fn digest(value: &Value) -> Fingerprint {
    Fingerprint::of(value).expect("a serde_json::Value always serialises")
}

fn check(value: &Value, u: &mut Unstructured<'_>) -> Fingerprint {
    let fp = digest(value);
    let canonical = serde_json::to_string(&sorted(value)).expect("serialises");
    let want: [u8; 32] = Sha256::digest(canonical.as_bytes()).into();
    assert_eq!(
        fp.as_bytes(),
        &want,
        "{value} is not digested as {canonical}"
    );
    let other = shuffled(value, u);
    assert_eq!(other, *value);
    assert_eq!(digest(&other), fp, "{value} and {other}");
    assert_eq!(Fingerprint::of(&Reversed(value)).unwrap(), fp, "{value}");
    fp
}

fn one(data: &[u8]) -> Result<()> {
    let (first, mut u) = match data.split_first() {
        // JSON text first, then the bytes that shuffle.
        Some((b'{' | b'[' | b'"', _)) => {
            let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
            let Ok(value) = serde_json::from_slice::<Value>(&data[..end]) else {
                return Ok(());
            };
            (
                value,
                Unstructured::new(data.get(end + 1..).unwrap_or_default()),
            )
        }
        _ => {
            let mut u = Unstructured::new(data);
            (value(&mut u, 4)?, u)
        }
    };
    let fp = check(&first, &mut u);
    let second = value(&mut u, 3)?;
    let fp2 = check(&second, &mut u);
    if first != second {
        assert_ne!(
            fp, fp2,
            "{first} and {second} differ but share a fingerprint"
        );
    } else {
        assert_eq!(fp, fp2, "{first} and {second} are equal");
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = one(data);
});
