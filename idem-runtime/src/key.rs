use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::rc::Rc;
use std::sync::Arc;

/// Why a key was refused. Keys are checked before any I/O, so a refused key writes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key (or one part of a tuple key) is the empty string.
    Empty,
    /// The encoded key is longer than [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes.
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key contains a NUL byte, which PostgreSQL cannot store in `text`.
    Nul,
    /// The key of one job of a batch was refused; the whole batch was refused with it, before
    /// any I/O.
    InBatch {
        /// The job's position in the batch, from 0.
        position: usize,
        /// Why its key was refused.
        error: Box<KeyError>,
    },
    /// The batch holds more jobs than one claim takes
    /// ([`MAX_BATCH`](crate::MAX_BATCH)).
    BatchTooLarge {
        /// How many jobs it held.
        len: usize,
    },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str(
                "the key is empty: every job needs a stable, non-empty id \
                 (check that the key expression reads the job's id)",
            ),
            KeyError::TooLong { len } => write!(
                f,
                "the encoded key is {len} bytes, more than the {} allowed: use a shorter id, \
                 or a digest of a long one (for example the hex SHA-256 of it)",
                MAX_KEY_LEN
            ),
            KeyError::Nul => f.write_str(
                "the key contains a NUL byte, which databases cannot store as text: \
                 strip it, or encode the id (for example as hex)",
            ),
            KeyError::InBatch { position, error } => write!(
                f,
                "job {position} of the batch (counting from 0): {error}; \
                 nothing of the batch was claimed"
            ),
            KeyError::BatchTooLarge { len } => write!(
                f,
                "a batch of {len} jobs is more than the {} one claim takes: \
                 split it into smaller batches",
                MAX_BATCH
            ),
        }
    }
}

impl std::error::Error for KeyError {}

/// The longest key accepted, in bytes of UTF-8.
///
/// It keeps `(scope, key)` inside every backend's index limit (MySQL's 3072-byte key prefix with
/// `utf8mb4`, for one).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: non-empty, at most [`MAX_KEY_LEN`] bytes, no NUL byte.
///
/// Built from anything that implements [`IntoKey`]; the `#[idempotent]` attribute builds it from
/// its `key` expression before it touches the database.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

impl Key {
    /// Encodes and validates `value`.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use idem::Key;
    /// assert_eq!(Key::new(&42_u64).unwrap().as_str(), "42");
    /// assert_eq!(Key::new(&("acme", 7)).unwrap().as_str(), "4:acme|1:7");
    /// assert!(Key::new("").is_err());
    /// ```
    pub fn new<K: IntoKey + ?Sized>(value: &K) -> Result<Key, KeyError> {
        // A string is stored as it is: one check and one copy, the job of every call.
        if let Some(plain) = value.as_plain() {
            check(plain)?;
            return Ok(Key(plain.to_owned()));
        }
        let encoded = encode(value)?;
        check(&encoded)?;
        Ok(Key(encoded))
    }

    /// The encoded key, as stored in the `key` column.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The most jobs one batch claim takes.
///
/// The claim is one statement. PostgreSQL and SQLite receive the keys as one array bind, so
/// no bind limit applies there; MySQL receives them as hex literals, twice in the claim's
/// message (insert, read back) and once more for the fresh ones, which at 1,000 keys of up to
/// 255 bytes stays near 1.6 MB in all, under the smallest default `max_allowed_packet` still
/// in use (4 MB, MySQL 5.7). A batch also holds the row locks of all its keys until it
/// commits, so a larger one would make overlapping deliveries wait longer. Brokers hand out
/// fewer (SQS 10, typical Kafka and JetStream pulls a few hundred); split larger batches.
pub const MAX_BATCH: usize = 1_000;

impl Key {
    /// Encodes and validates the key of every job of a batch, before any I/O.
    ///
    /// The first refused key refuses the batch with [`KeyError::InBatch`], naming its
    /// position; more than [`MAX_BATCH`] keys are [`KeyError::BatchTooLarge`].
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use idem::{Key, KeyError};
    /// let keys = Key::batch(["a", "b"]).unwrap();
    /// assert_eq!(keys[1].as_str(), "b");
    /// assert!(matches!(
    ///     Key::batch(["a", ""]),
    ///     Err(KeyError::InBatch { position: 1, .. })
    /// ));
    /// ```
    pub fn batch<K: IntoKey>(values: impl IntoIterator<Item = K>) -> Result<Vec<Key>, KeyError> {
        collect_keys(values.into_iter().map(|value| Key::new(&value)))
    }
}

/// The keys of a batch, the first refused one naming its position. Stops at the first key
/// past [`MAX_BATCH`], so that an oversized batch is not encoded whole before it is refused.
pub(crate) fn collect_keys(
    keys: impl Iterator<Item = Result<Key, KeyError>>,
) -> Result<Vec<Key>, KeyError> {
    let mut out = Vec::new();
    for (position, key) in keys.enumerate() {
        if position == MAX_BATCH {
            let len = MAX_BATCH + 1;
            return Err(KeyError::BatchTooLarge { len });
        }
        match key {
            Ok(key) => out.push(key),
            Err(error) => {
                return Err(KeyError::InBatch {
                    position,
                    error: Box::new(error),
                });
            }
        }
    }
    Ok(out)
}

/// The encoding of `value` as [`Key::new`] makes it, without the length limit: what the
/// digests of over-long ids (`job_id`, `Lease::idempotency_key`) are taken of.
pub(crate) fn encode<K: IntoKey + ?Sized>(value: &K) -> Result<String, KeyError> {
    let mut w = KeyWriter {
        buf: String::new(),
        items: 0,
        error: None,
    };
    value.write_key(&mut w);
    if let Some(e) = w.error {
        return Err(e);
    }
    // Items are written in their element form (`5:acme1`, `(...)`); a key of one item is
    // stored in its plain form (`acme1`, or a tuple's elements without the parentheses),
    // which keeps the encodings of strings, integers and tuples what they always were.
    if w.items == 1 {
        let plain = if w.buf.starts_with('(') {
            1..w.buf.len() - 1
        } else {
            w.buf.find(':').map_or(0, |colon| colon + 1)..w.buf.len()
        };
        w.buf.truncate(plain.end);
        w.buf.drain(..plain.start);
    }
    Ok(w.buf)
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn check(s: &str) -> Result<(), KeyError> {
    if s.is_empty() {
        return Err(KeyError::Empty);
    }
    if s.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: s.len() });
    }
    if s.contains('\0') {
        return Err(KeyError::Nul);
    }
    Ok(())
}

/// Receives the parts of a key from [`IntoKey::write_key`].
///
/// A key of one part is stored as it is (`42`, `order-7`). Several parts are stored as a tuple:
/// each prefixed by its length in bytes and separated by `|` (`4:acme|1:7`), a nested tuple in
/// parentheses. So a custom key that writes two parts encodes like the tuple of those parts,
/// and no two different sequences of parts encode to the same key, whatever characters the
/// parts hold. A type whose values write different shapes (one part for some, several for
/// others) should start every value with a part naming its shape: a one-part key `4:acme|1:7`
/// and the two parts `acme`, `7` are the same stored key.
#[derive(Debug)]
pub struct KeyWriter {
    buf: String,
    /// Items written at the current level: parts, tuples and grouped values.
    items: u32,
    error: Option<KeyError>,
}

impl KeyWriter {
    /// Appends one part. An empty part or one with a NUL byte makes the key invalid.
    pub fn part(&mut self, part: &str) {
        if self.error.is_some() {
            return;
        }
        if part.is_empty() {
            self.error = Some(KeyError::Empty);
            return;
        }
        if part.contains('\0') {
            self.error = Some(KeyError::Nul);
            return;
        }
        self.separate();
        // Writing into a String cannot fail.
        let _ = write!(self.buf, "{}:{part}", part.len());
    }

    /// Appends a part written by its `Display` implementation.
    pub fn display(&mut self, part: impl fmt::Display) {
        let mut s = String::new();
        let _ = write!(s, "{part}");
        self.part(&s);
    }

    /// Appends the parts that `f` writes as one nested tuple.
    pub fn tuple(&mut self, f: impl FnOnce(&mut KeyWriter)) {
        self.separate();
        self.buf.push('(');
        let outer = std::mem::replace(&mut self.items, 0);
        f(self);
        if self.items == 0 && self.error.is_none() {
            self.error = Some(KeyError::Empty);
        }
        self.items = outer;
        self.buf.push(')');
    }

    /// Appends the key of `value` as one item: as it is if it writes one part or one tuple,
    /// as a nested tuple if it writes several parts. Tuples write each element with it, so
    /// elements that write several parts cannot run into their neighbours.
    pub fn value<K: IntoKey + ?Sized>(&mut self, value: &K) {
        if self.items > 0 {
            self.buf.push('|');
        }
        let start = self.buf.len();
        let outer = std::mem::replace(&mut self.items, 0);
        value.write_key(self);
        let written = std::mem::replace(&mut self.items, outer + 1);
        match written {
            0 if self.error.is_none() => self.error = Some(KeyError::Empty),
            0 | 1 => {}
            _ => {
                self.buf.insert(start, '(');
                self.buf.push(')');
            }
        }
    }

    fn separate(&mut self) {
        if self.items > 0 {
            self.buf.push('|');
        }
        self.items += 1;
    }
}

/// A value that can identify a job: strings, integers, `uuid::Uuid` (feature `uuid`),
/// references and tuples of these.
///
/// Implement it for your own id types by writing their parts:
///
/// ```
/// # use idem_runtime as idem;
/// use idem::{IntoKey, Key, KeyWriter};
/// struct OrderId(u64);
/// impl IntoKey for OrderId {
///     fn write_key(&self, key: &mut KeyWriter) {
///         key.display(self.0);
///     }
/// }
/// assert_eq!(Key::new(&OrderId(7)).unwrap().as_str(), "7");
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency key",
    label = "the `key` expression has type `{Self}`",
    note = "a key is a string, an integer, a `uuid::Uuid` (feature `uuid`), or a tuple of these",
    note = "use a field that holds the job's stable id, convert it (`.to_string()`), or implement `idem::IntoKey` for your id type"
)]
pub trait IntoKey {
    /// Writes this value's parts into `key`.
    fn write_key(&self, key: &mut KeyWriter);

    /// The key as it is stored, if this value is one string part (what `write_key` writing
    /// that one part encodes to): lets [`Key::new`] skip the writer.
    #[doc(hidden)]
    fn as_plain(&self) -> Option<&str> {
        None
    }
}

macro_rules! text_keys {
    ($($t:ty),*) => {$(
        impl IntoKey for $t {
            fn write_key(&self, key: &mut KeyWriter) {
                key.part(self);
            }

            fn as_plain(&self) -> Option<&str> {
                Some(self)
            }
        }
    )*};
}
text_keys!(str, String, Cow<'_, str>);

impl IntoKey for Key {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(&self.0);
    }

    fn as_plain(&self) -> Option<&str> {
        Some(&self.0)
    }
}

macro_rules! int_keys {
    ($($t:ty)*) => {$(
        impl IntoKey for $t {
            fn write_key(&self, key: &mut KeyWriter) {
                key.display(self);
            }
        }
    )*};
}
int_keys!(i8 i16 i32 i64 i128 isize u8 u16 u32 u64 u128 usize);

macro_rules! pointer_keys {
    ($($p:ty),*) => {$(
        impl<T: IntoKey + ?Sized> IntoKey for $p {
            fn write_key(&self, key: &mut KeyWriter) {
                (**self).write_key(key);
            }

            fn as_plain(&self) -> Option<&str> {
                (**self).as_plain()
            }
        }
    )*};
}
pointer_keys!(&T, &mut T, Box<T>, Rc<T>, Arc<T>);

#[cfg(feature = "uuid")]
impl IntoKey for uuid::Uuid {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(
            self.hyphenated()
                .encode_lower(&mut uuid::Uuid::encode_buffer()),
        );
    }
}

/// `IntoKey` for the tuples of one to as many elements as names are given, each arity's impl
/// naming its elements as the longest does (`(A, B)`, not the last two names).
macro_rules! tuple_keys {
    (@impl $($t:ident)+) => {
        impl<$($t: IntoKey),+> IntoKey for ($($t,)+) {
            // The elements are bound by their types' names.
            #[allow(non_snake_case)]
            fn write_key(&self, key: &mut KeyWriter) {
                let ($($t,)+) = self;
                key.tuple(|key| { $(key.value($t);)+ });
            }
        }
    };
    (@each [$($done:ident)*]) => {};
    (@each [$($done:ident)*] $next:ident $($rest:ident)*) => {
        tuple_keys!(@impl $($done)* $next);
        tuple_keys!(@each [$($done)* $next] $($rest)*);
    };
    ($($t:ident)+) => {
        tuple_keys!(@each [] $($t)+);
    };
}
tuple_keys!(A B C D E F);

#[cfg(test)]
mod tests {
    use super::*;

    fn enc<K: IntoKey + ?Sized>(k: &K) -> Result<String, KeyError> {
        Key::new(k).map(|k| k.0)
    }

    #[test]
    fn scalars_are_stored_as_written() {
        assert_eq!(enc("job-1").unwrap(), "job-1");
        assert_eq!(enc(&String::from("é")).unwrap(), "é");
        assert_eq!(enc(&-5_i32).unwrap(), "-5");
        assert_eq!(enc(&u128::MAX).unwrap(), u128::MAX.to_string());
        assert_eq!(enc(&&&7_u8).unwrap(), "7");
    }

    #[test]
    fn tuple_parts_cannot_run_into_each_other() {
        assert_eq!(enc(&("a|1:b", "c")).unwrap(), "5:a|1:b|1:c");
        assert_eq!(enc(&("a", "1:b|1:c")).unwrap(), "1:a|7:1:b|1:c");
        assert_ne!(enc(&("ab", "c")).unwrap(), enc(&("a", "bc")).unwrap());
        assert_eq!(enc(&("t", ("u", 2))).unwrap(), "1:t|(1:u|1:2)");
        assert_ne!(enc(&("t", ("u", 2))).unwrap(), enc(&("t", "u", 2)).unwrap());
        assert_eq!(enc(&(1,)).unwrap(), "1:1");
    }

    /// A key of the user's own, writing its parts itself.
    struct Tenant<'a>(&'a str, u32);

    impl IntoKey for Tenant<'_> {
        fn write_key(&self, key: &mut KeyWriter) {
            key.part(self.0);
            key.display(self.1);
        }
    }

    /// A part count that depends on the value.
    enum Either<'a> {
        One(&'a str),
        Two(&'a str, &'a str),
    }

    impl IntoKey for Either<'_> {
        fn write_key(&self, key: &mut KeyWriter) {
            match self {
                Either::One(a) => key.part(a),
                Either::Two(a, b) => {
                    key.part(a);
                    key.part(b);
                }
            }
        }
    }

    #[test]
    fn custom_keys_with_several_parts_cannot_collide() {
        assert_ne!(
            enc(&Tenant("acme1", 7)).unwrap(),
            enc(&Tenant("acme", 17)).unwrap()
        );
        // Several parts encode like the tuple of those parts.
        assert_eq!(
            enc(&Tenant("acme", 17)).unwrap(),
            enc(&("acme", 17)).unwrap()
        );
        assert_eq!(enc(&Tenant("acme", 17)).unwrap(), "4:acme|2:17");
        // Inside a tuple, an element that writes several parts is grouped.
        let a = enc(&(Either::Two("x", "y"), Either::One("z"))).unwrap();
        let b = enc(&(Either::One("x"), Either::Two("y", "z"))).unwrap();
        assert_ne!(a, b);
        assert_eq!(a, "(1:x|1:y)|1:z");
        assert_eq!(b, "1:x|(1:y|1:z)");
        assert_eq!(
            enc(&("t", Tenant("a", 1))).unwrap(),
            enc(&("t", ("a", 1))).unwrap()
        );
    }

    #[test]
    fn every_part_sequence_of_a_tuple_has_its_own_key() {
        // Exhaustive over short parts drawn from the characters the encoding itself uses.
        let alphabet = ["1", ":", "|", "(", ")", "1:", "|1", "a|1:b"];
        let mut seen = std::collections::HashMap::new();
        for a in alphabet {
            for b in alphabet {
                let pairs = [
                    enc(&(a, b)).unwrap(),
                    enc(&(a, (b,))).unwrap(),
                    enc(&((a,), b)).unwrap(),
                    enc(&(Either::Two(a, b), "z")).unwrap(),
                ];
                for (shape, key) in pairs.into_iter().enumerate() {
                    if let Some(prev) = seen.insert(key.clone(), (shape, a, b)) {
                        panic!("{key:?} encodes both {prev:?} and {:?}", (shape, a, b));
                    }
                }
            }
        }
    }

    #[test]
    fn bad_keys_are_refused() {
        assert_eq!(enc(""), Err(KeyError::Empty));
        assert_eq!(enc(&("", 1)), Err(KeyError::Empty));
        assert_eq!(enc(&(Either::Two("a", ""), 1)), Err(KeyError::Empty));
        assert_eq!(enc("a\0b"), Err(KeyError::Nul));
        assert_eq!(enc(&("ab", "c\0")), Err(KeyError::Nul));
        assert_eq!(enc(&"x".repeat(256)), Err(KeyError::TooLong { len: 256 }));
        assert_eq!(enc(&"x".repeat(255)).unwrap().len(), 255);
        // 85 three-byte characters are 255 bytes; one more is over.
        assert!(enc(&"€".repeat(85)).is_ok());
        assert_eq!(enc(&"€".repeat(86)), Err(KeyError::TooLong { len: 258 }));
    }

    #[test]
    fn errors_say_what_to_do() {
        let msg = KeyError::TooLong { len: 300 }.to_string();
        assert!(msg.contains("300 bytes") && msg.contains("255"), "{msg}");
        assert!(KeyError::Empty.to_string().contains("non-empty id"));
    }
}
