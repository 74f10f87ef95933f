//! The `Idempotency-Key` request header: a Structured Field string (RFC 8941 §3.3.3), read
//! before anything touches the database.

use ::http::header::{GetAll, HeaderValue};

use crate::key::MAX_KEY_LEN;

/// Why a request's key header was refused: the `detail` of its 400 problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    Missing,
    Repeated,
    Empty,
    TooLong(usize),
    /// A byte the field syntax forbids (a control character, NUL, anything not ASCII), at
    /// this offset of the field's value.
    Forbidden(usize),
    /// Not a quoted string: unbalanced quotes, a bad escape, parameters or a list.
    Syntax(&'static str),
}

impl Refused {
    pub(crate) fn detail(&self, header: &str) -> String {
        let send = format!(
            "send one `{header}` header whose value is a quoted string of 1 to {MAX_KEY_LEN} \
             printable ASCII characters, new for each new operation and the same on its retries, \
             e.g. `{header}: \"8e03978e-40d5-43e8-bc93-6894a57f9324\"`"
        );
        let why = match self {
            Refused::Missing => format!("this request has no `{header}` header"),
            Refused::Repeated => format!("this request has more than one `{header}` header"),
            Refused::Empty => format!("the `{header}` header holds an empty key"),
            Refused::TooLong(len) => {
                format!("the key in `{header}` is {len} bytes long, over the {MAX_KEY_LEN} allowed")
            }
            Refused::Forbidden(at) => format!(
                "the `{header}` header holds a byte a Structured Field string cannot hold (a \
                 control character, NUL or non-ASCII) at offset {at}"
            ),
            Refused::Syntax(what) => format!("the `{header}` header is not a string: {what}"),
        };
        format!("{why}; {send}")
    }
}

/// Reads the key from every value of the header (there must be exactly one).
///
/// Accepted: an sf-string (`"..."`, with `\"` and `\\` escapes), with the spaces RFC 8941 lets
/// surround a field; with `bare`, also a value with no quotes made only of token characters
/// (`8e03978e-40d5`), which many clients send (Stripe's convention predates the draft) and
/// which cannot be read two ways. Refused: parameters (`"k";a=1`) and lists (`"a", "b"`),
/// which would change what the key means to the sender, an empty key, a key over
/// [`MAX_KEY_LEN`] bytes, and every byte outside printable ASCII.
pub(crate) fn parse(values: GetAll<'_, HeaderValue>, bare: bool) -> Result<String, Refused> {
    let mut values = values.iter();
    let value = values.next().ok_or(Refused::Missing)?;
    if values.next().is_some() {
        return Err(Refused::Repeated);
    }
    parse_one(value.as_bytes(), bare)
}

fn parse_one(raw: &[u8], bare: bool) -> Result<String, Refused> {
    if let Some(at) = raw.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Err(Refused::Forbidden(at));
    }
    let start = raw.iter().take_while(|b| **b == b' ').count();
    let end = raw.len() - raw.iter().rev().take_while(|b| **b == b' ').count();
    let value = &raw[start..end.max(start)];
    let key = match value.first() {
        None => return Err(Refused::Empty),
        Some(b'"') => string(value)?,
        Some(_) if bare => token(value)?,
        Some(_) => return Err(Refused::Syntax("it does not start with `\"`")),
    };
    if key.is_empty() {
        return Err(Refused::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Refused::TooLong(key.len()));
    }
    Ok(key)
}

/// An sf-string and nothing after it.
fn string(value: &[u8]) -> Result<String, Refused> {
    let mut key = String::new();
    let mut rest = value[1..].iter();
    loop {
        match rest.next() {
            None => return Err(Refused::Syntax("the closing `\"` is missing")),
            Some(b'\\') => match rest.next() {
                Some(c @ (b'"' | b'\\')) => key.push(char::from(*c)),
                _ => return Err(Refused::Syntax("`\\` escapes only `\"` and `\\`")),
            },
            Some(b'"') => break,
            Some(c) => key.push(char::from(*c)),
        }
    }
    match rest.next() {
        None => Ok(key),
        Some(b';') => Err(Refused::Syntax(
            "parameters after the string are not accepted (they could change what the key means)",
        )),
        Some(b',') => Err(Refused::Syntax("a list of keys is not accepted")),
        Some(_) => Err(Refused::Syntax("something follows the closing `\"`")),
    }
}

/// A bare value: token characters only (RFC 9110 `tchar`, plus `:` and `/` as sf-token has).
fn token(value: &[u8]) -> Result<String, Refused> {
    let tchar = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(b);
    if let Some(bad) = value.iter().find(|b| !tchar(b)) {
        let what = match bad {
            b';' => "parameters are not accepted",
            b',' => "a list of keys is not accepted",
            _ => "an unquoted key may hold letters, digits and `!#$%&'*+-.^_`|~:/` only: quote it",
        };
        return Err(Refused::Syntax(what));
    }
    Ok(String::from_utf8(value.to_vec()).expect("ASCII"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(raw: &str) -> Result<String, Refused> {
        parse_one(raw.as_bytes(), true)
    }

    #[test]
    fn strings_tokens_and_their_spaces() {
        assert_eq!(one(r#""8e03978e-40d5""#).unwrap(), "8e03978e-40d5");
        assert_eq!(one(r#"  "a b"  "#).unwrap(), "a b");
        assert_eq!(one(r#""q\"uo\\te""#).unwrap(), r#"q"uo\te"#);
        assert_eq!(one("8e03978e-40d5").unwrap(), "8e03978e-40d5");
        assert_eq!(one("msg_2Kx:a/b").unwrap(), "msg_2Kx:a/b");
        assert!(parse_one(b"8e03978e", false).is_err());
    }

    #[test]
    fn what_is_refused() {
        assert_eq!(one(""), Err(Refused::Empty));
        assert_eq!(one(r#""""#), Err(Refused::Empty));
        assert_eq!(one("   "), Err(Refused::Empty));
        assert!(matches!(one(r#""abc"#), Err(Refused::Syntax(_))));
        assert!(matches!(one(r#""a\b""#), Err(Refused::Syntax(_))));
        assert!(matches!(one(r#""a";x=1"#), Err(Refused::Syntax(_))));
        assert!(matches!(one(r#""a", "b""#), Err(Refused::Syntax(_))));
        assert!(matches!(one("a b"), Err(Refused::Syntax(_))));
        assert!(matches!(one("a;x=1"), Err(Refused::Syntax(_))));
        assert_eq!(parse_one(b"\"a\0b\"", true), Err(Refused::Forbidden(2)));
        assert_eq!(
            parse_one("\"é\"".as_bytes(), true),
            Err(Refused::Forbidden(1))
        );
        assert_eq!(parse_one(b"\"a\tb\"", true), Err(Refused::Forbidden(2)));
        let long = format!("\"{}\"", "k".repeat(MAX_KEY_LEN + 1));
        assert_eq!(one(&long), Err(Refused::TooLong(MAX_KEY_LEN + 1)));
        assert!(one(&format!("\"{}\"", "k".repeat(MAX_KEY_LEN))).is_ok());
    }
}
