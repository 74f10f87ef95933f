//! The key encoding (`idem::Key`, `IntoKey`, `KeyWriter`, `job_id`).
//!
//! The input draws a program of `KeyWriter` calls (`part`, `display`, `tuple`, `value`, nested
//! a few levels), the shape a custom `IntoKey` or a tuple of tuples writes. Checked:
//! - `Key::new` gives what a reference encoder written here gives, error included;
//! - a key of several items decodes back to exactly the items written (so two different part
//!   sequences never encode alike), and two programs drawn from one input with different items
//!   never share a key;
//! - every key `Key::new` accepts is non-empty, at most 255 bytes, without NUL;
//! - real Rust tuples encode like the program that models them;
//! - `job_id` is the encoding of `(scope, value)`, or `sha256:` and its digest past 255 bytes.
//!
//! Not checked, because the documentation says so: a key of one plain part is stored as it is,
//! so the string `"1:a|1:b"` and the tuple `("a", "b")` are the same stored key.
#![no_main]

use arbitrary::{Result, Unstructured};
use idem::{IntoKey, Key, KeyError, KeyWriter, MAX_KEY_LEN, job_id};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest as _, Sha256};

/// One call on a `KeyWriter`.
#[derive(Debug, Clone)]
enum Op {
    Part(String),
    /// `display` of an integer.
    Int(i128),
    /// `tuple(|k| ...)` running these calls.
    Tuple(Vec<Op>),
    /// `value(&v)` of a value whose `write_key` runs these calls.
    Value(Vec<Op>),
}

/// A custom `IntoKey`: runs its calls on the writer it is given.
#[derive(Debug, Clone)]
struct Program(Vec<Op>);

impl IntoKey for Program {
    fn write_key(&self, key: &mut KeyWriter) {
        run(&self.0, key);
    }
}

fn run(ops: &[Op], key: &mut KeyWriter) {
    for op in ops {
        match op {
            Op::Part(s) => key.part(s),
            Op::Int(n) => key.display(n),
            Op::Tuple(inner) => key.tuple(|k| run(inner, k)),
            Op::Value(inner) => key.value(&Program(inner.clone())),
        }
    }
}

/// What the calls write, as the documentation describes it: a part, or a group of items (a
/// tuple, or a value that wrote several items).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Item {
    Part(String),
    Group(Vec<Item>),
}

/// The items that `ops` write at one level, or the first error, as `KeyWriter` documents it.
fn items(ops: &[Op]) -> Result<Vec<Item>, KeyError> {
    let mut out = Vec::new();
    for op in ops {
        match op {
            Op::Part(s) if s.is_empty() => return Err(KeyError::Empty),
            Op::Part(s) if s.contains('\0') => return Err(KeyError::Nul),
            Op::Part(s) => out.push(Item::Part(s.clone())),
            Op::Int(n) => out.push(Item::Part(n.to_string())),
            Op::Tuple(inner) => {
                let inner = items(inner)?;
                if inner.is_empty() {
                    return Err(KeyError::Empty);
                }
                out.push(Item::Group(inner));
            }
            Op::Value(inner) => {
                let mut inner = items(inner)?;
                match inner.len() {
                    0 => return Err(KeyError::Empty),
                    1 => out.push(inner.pop().expect("one")),
                    _ => out.push(Item::Group(inner)),
                }
            }
        }
    }
    Ok(out)
}

/// What a key stands for: one plain part (stored as written), or a list of items.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Shape {
    Plain(String),
    List(Vec<Item>),
}

fn shape(ops: &[Op]) -> Result<Shape, KeyError> {
    let mut top = items(ops)?;
    if top.len() == 1 {
        return Ok(match top.pop().expect("one") {
            Item::Part(s) => Shape::Plain(s),
            // A single tuple is stored without its parentheses.
            Item::Group(inner) => Shape::List(inner),
        });
    }
    if top.is_empty() {
        return Err(KeyError::Empty);
    }
    Ok(Shape::List(top))
}

/// The reference encoder: each part as `LEN:PART`, a group in parentheses, items joined by `|`.
fn join(items: &[Item], out: &mut String) {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        match item {
            Item::Part(s) => {
                out.push_str(&s.len().to_string());
                out.push(':');
                out.push_str(s);
            }
            Item::Group(inner) => {
                out.push('(');
                join(inner, out);
                out.push(')');
            }
        }
    }
}

fn unbounded(shape: &Shape) -> String {
    match shape {
        Shape::Plain(s) => s.clone(),
        Shape::List(items) => {
            let mut out = String::new();
            join(items, &mut out);
            out
        }
    }
}

fn reference(ops: &[Op]) -> Result<String, KeyError> {
    let encoded = unbounded(&shape(ops)?);
    if encoded.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: encoded.len() });
    }
    Ok(encoded)
}

/// The reference decoder: the items of a list key, read from the key alone. That it gives back
/// what was written proves no other list of items has this key.
fn decode(s: &str) -> Option<Vec<Item>> {
    let (items, rest) = decode_items(s.as_bytes())?;
    rest.is_empty().then_some(items)
}

fn decode_items(mut s: &[u8]) -> Option<(Vec<Item>, &[u8])> {
    let mut out = Vec::new();
    loop {
        if let Some(rest) = s.strip_prefix(b"(") {
            let (inner, rest) = decode_items(rest)?;
            s = rest.strip_prefix(b")")?;
            out.push(Item::Group(inner));
        } else {
            let digits = s.iter().take_while(|b| b.is_ascii_digit()).count();
            let len: usize = std::str::from_utf8(&s[..digits]).ok()?.parse().ok()?;
            let rest = s[digits..].strip_prefix(b":")?;
            if rest.len() < len {
                return None;
            }
            let part = std::str::from_utf8(&rest[..len]).ok()?;
            out.push(Item::Part(part.to_owned()));
            s = &rest[len..];
        }
        match s.strip_prefix(b"|") {
            Some(rest) => s = rest,
            None => return Some((out, s)),
        }
    }
}

/// Characters the encoding itself uses, and a few others of one to three bytes.
const PIECES: [&str; 14] = [
    "1", "2", "0", ":", "|", "(", ")", "a", "1:", "|1:", ")|(", "é", "€", "\0",
];

fn part(u: &mut Unstructured<'_>) -> Result<String> {
    Ok(match u.int_in_range(0..=7)? {
        0 => u.arbitrary()?,
        // A long part, to cross the 255-byte limit.
        1 => u.choose(&PIECES)?.repeat(u.int_in_range(1..=130)?),
        _ => {
            let mut s = String::new();
            for _ in 0..u.int_in_range(0..=6)? {
                s.push_str(u.choose(&PIECES)?);
            }
            s
        }
    })
}

fn ops(u: &mut Unstructured<'_>, depth: u32) -> Result<Vec<Op>> {
    let mut out = Vec::new();
    for _ in 0..u.int_in_range(0..=4)? {
        let kind = if depth == 0 {
            u.int_in_range(0..=1)?
        } else {
            u.int_in_range(0..=5)?
        };
        out.push(match kind {
            0 => Op::Part(part(u)?),
            1 => Op::Int(match u.int_in_range(0..=2)? {
                0 => u.int_in_range(-20..=120)?,
                1 => i128::from(u.arbitrary::<i64>()?),
                _ => u.arbitrary()?,
            }),
            2 | 3 => Op::Tuple(ops(u, depth - 1)?),
            _ => Op::Value(ops(u, depth - 1)?),
        });
    }
    Ok(out)
}

fn check_program(ops: &[Op]) -> Option<String> {
    let got = Key::new(&Program(ops.to_vec())).map(|k| k.as_str().to_owned());
    let want = reference(ops);
    assert_eq!(got, want, "Key::new and the reference disagree on {ops:?}");
    let key = got.ok()?;
    assert!(!key.is_empty() && key.len() <= MAX_KEY_LEN && !key.contains('\0'));
    if let Ok(Shape::List(items)) = shape(ops) {
        assert_eq!(decode(&key).as_ref(), Some(&items), "{key:?} from {ops:?}");
    }
    // A key is a key of its own: as a one-part key it is stored unchanged.
    assert_eq!(Key::new(&key).unwrap().as_str(), key);
    Some(key)
}

/// `job_id(scope, value)`: the encoding of the tuple `(scope, value)`, bounded by a digest.
fn check_job_id(scope: &str, ops: &[Op]) {
    let as_tuple = [Op::Tuple(vec![
        Op::Value(vec![Op::Part(scope.to_owned())]),
        Op::Value(ops.to_vec()),
    ])];
    let want = shape(&as_tuple).map(|s| {
        let full = unbounded(&s);
        if full.len() <= MAX_KEY_LEN {
            full
        } else {
            let hex: String = Sha256::digest(full.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            format!("sha256:{hex}")
        }
    });
    let got = job_id(scope, &Program(ops.to_vec()));
    assert_eq!(got.as_ref().map(|id| id.as_str()), want.as_deref());
    if let Ok(id) = got {
        assert_eq!(Key::new(&id).unwrap().as_str(), id.as_str());
    }
}

/// Real tuples, checked against the program that models them (each element a `value`).
fn check_tuples(u: &mut Unstructured<'_>) -> Result<()> {
    let a = part(u)?;
    let b = part(u)?;
    let c = part(u)?;
    let n: u64 = u.arbitrary()?;
    let m: i8 = u.arbitrary()?;
    let val = |ops: Vec<Op>| Op::Value(ops);
    let p = |s: &str| Op::Part(s.to_owned());
    let cases: [(Result<Key, KeyError>, Vec<Op>); 5] = [
        (
            Key::new(&(a.as_str(),)),
            vec![Op::Tuple(vec![val(vec![p(&a)])])],
        ),
        (
            Key::new(&(a.clone(), n)),
            vec![Op::Tuple(vec![
                val(vec![p(&a)]),
                val(vec![Op::Int(n.into())]),
            ])],
        ),
        (
            Key::new(&(m, (b.as_str(), n), c.as_str())),
            vec![Op::Tuple(vec![
                val(vec![Op::Int(m.into())]),
                val(vec![Op::Tuple(vec![
                    val(vec![p(&b)]),
                    val(vec![Op::Int(n.into())]),
                ])]),
                val(vec![p(&c)]),
            ])],
        ),
        (
            Key::new(&((a.as_str(),), &b, Box::new(c.clone()))),
            vec![Op::Tuple(vec![
                val(vec![Op::Tuple(vec![val(vec![p(&a)])])]),
                val(vec![p(&b)]),
                val(vec![p(&c)]),
            ])],
        ),
        (
            Key::new(&(a.as_str(), b.as_str(), c.as_str(), n, m, "z")),
            vec![Op::Tuple(vec![
                val(vec![p(&a)]),
                val(vec![p(&b)]),
                val(vec![p(&c)]),
                val(vec![Op::Int(n.into())]),
                val(vec![Op::Int(m.into())]),
                val(vec![p("z")]),
            ])],
        ),
    ];
    for (got, model) in cases {
        assert_eq!(
            got.map(|k| k.as_str().to_owned()),
            reference(&model),
            "{model:?}"
        );
    }
    Ok(())
}

fn one(data: &[u8]) -> Result<()> {
    let mut u = Unstructured::new(data);
    let first = ops(&mut u, 3)?;
    let second = ops(&mut u, 3)?;
    let k1 = check_program(&first);
    let k2 = check_program(&second);
    if let (Some(k1), Some(k2)) = (k1, k2) {
        let (s1, s2) = (shape(&first).unwrap(), shape(&second).unwrap());
        let both_lists = matches!((&s1, &s2), (Shape::List(_), Shape::List(_)));
        let both_plain = matches!((&s1, &s2), (Shape::Plain(_), Shape::Plain(_)));
        if (both_lists || both_plain) && s1 != s2 {
            assert_ne!(k1, k2, "{first:?} and {second:?} share a key");
        }
    }
    let scope = part(&mut u)?;
    check_job_id(&scope, &first);
    check_tuples(&mut u)
}

fuzz_target!(|data: &[u8]| {
    let _ = one(data);
});
