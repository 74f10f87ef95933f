use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::rc::Rc;
use std::sync::Arc;

use crate::error::KeyError;

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
    /// # use idem_runtime::Key;
    /// assert_eq!(Key::new(&42_u64).unwrap().as_str(), "42");
    /// assert_eq!(Key::new(&("acme", 7)).unwrap().as_str(), "4:acme|1:7");
    /// assert!(Key::new("").is_err());
    /// ```
    pub fn new<K: IntoKey + ?Sized>(value: &K) -> Result<Key, KeyError> {
        let mut w = KeyWriter {
            buf: String::new(),
            depth: 0,
            first: true,
            error: None,
        };
        value.write_key(&mut w);
        if let Some(e) = w.error {
            return Err(e);
        }
        check(&w.buf)?;
        Ok(Key(w.buf))
    }

    /// The encoded key, as stored in the `key` column.
    pub fn as_str(&self) -> &str {
        &self.0
    }
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
/// A scalar key is stored as it is (`42`, `order-7`). The parts of a tuple are each prefixed by
/// their length in bytes and separated by `|` (`4:acme|1:7`), so no two different tuples of the
/// same shape encode to the same key, whatever characters their parts hold.
#[derive(Debug)]
pub struct KeyWriter {
    buf: String,
    depth: u32,
    first: bool,
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
        if self.depth == 0 {
            self.buf.push_str(part);
        } else {
            self.separate();
            // Writing into a String cannot fail.
            let _ = write!(self.buf, "{}:{part}", part.len());
        }
    }

    /// Appends a part written by its `Display` implementation.
    pub fn display(&mut self, part: impl fmt::Display) {
        let mut s = String::new();
        let _ = write!(s, "{part}");
        self.part(&s);
    }

    /// Writes the parts that `f` writes as one tuple.
    pub fn tuple(&mut self, f: impl FnOnce(&mut KeyWriter)) {
        let nested = self.depth > 0;
        if nested {
            self.separate();
            self.buf.push('(');
        }
        self.depth += 1;
        self.first = true;
        f(self);
        self.depth -= 1;
        self.first = false;
        if nested {
            self.buf.push(')');
        }
    }

    fn separate(&mut self) {
        if !self.first {
            self.buf.push('|');
        }
        self.first = false;
    }
}

/// A value that can identify a job: strings, integers, `uuid::Uuid` (feature `uuid`),
/// references and tuples of these.
///
/// Implement it for your own id types by writing their parts:
///
/// ```
/// # use idem_runtime::{IntoKey, KeyWriter, Key};
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
}

impl IntoKey for str {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(self);
    }
}

impl IntoKey for String {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(self);
    }
}

impl IntoKey for Cow<'_, str> {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(self);
    }
}

impl IntoKey for Key {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(&self.0);
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

macro_rules! tuple_keys {
    ($(($($t:ident $i:tt),+))*) => {$(
        impl<$($t: IntoKey),+> IntoKey for ($($t,)+) {
            fn write_key(&self, key: &mut KeyWriter) {
                key.tuple(|key| { $(self.$i.write_key(key);)+ });
            }
        }
    )*};
}
tuple_keys! {
    (A 0)
    (A 0, B 1)
    (A 0, B 1, C 2)
    (A 0, B 1, C 2, D 3)
    (A 0, B 1, C 2, D 3, E 4)
    (A 0, B 1, C 2, D 3, E 4, F 5)
}

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

    #[test]
    fn bad_keys_are_refused() {
        assert_eq!(enc(""), Err(KeyError::Empty));
        assert_eq!(enc(&("", 1)), Err(KeyError::Empty));
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
