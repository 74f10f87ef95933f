//! A W3C trace context `traceparent`: the value a producer's message carries and a consumer's
//! claim links to, read and written strictly. Plain data that the outbox, the options and the
//! observation layer all name; how a claim's span is linked to it is `observe::trace_context`'s.

use std::fmt;
use std::str::FromStr;

/// The header (Kafka, AMQP, HTTP) and the message field that carry a W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

/// What a version-00 traceparent looks like, for the errors.
const EXPECTED: &str = "expected `00-<trace id: 32 lower-case hex digits>-<parent id: 16 \
                        lower-case hex digits>-<flags: 2 lower-case hex digits>`, like \
                        `00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`";

/// A W3C trace context `traceparent` of version `00`: the trace, the span that sent the
/// message (its parent id), and the trace flags.
///
/// Parsed strictly ([`parse`](TraceParent::parse)): 55 bytes, version `00`, lower-case hex,
/// neither id all zeros; anything else is a [`TraceParentError`], never a panic. Formatted
/// (`Display`) the same way, so that a parsed value prints as it was read.
///
/// A producer puts it in a message's `traceparent` header ([`TRACEPARENT`]), a consumer gives
/// it to its claim ([`ClaimOptions::link`](crate::ClaimOptions::link), the attribute's
/// `link = ".."`, the Kafka consumer from each record's header), and the claim's span links to
/// the producer's.
///
/// ```
/// # use idem_runtime as idem;
/// use idem::TraceParent;
///
/// let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// let parent: TraceParent = header.parse().unwrap();
/// assert!(parent.is_sampled());
/// assert_eq!(parent.to_string(), header);
/// assert!("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"
///     .parse::<TraceParent>()
///     .is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
}

/// Why a string is not a version-00 `traceparent`; its text says what to send instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceParentError {
    /// A version other than `00` (`ff` is forbidden, later ones are not understood here).
    #[error(
        "a traceparent of version `{version}` is not understood: only version `00` is; {EXPECTED}"
    )]
    Version {
        /// The version's two characters as written.
        version: String,
    },
    /// Not 55 bytes long.
    #[error("a traceparent is 55 bytes long, this one is {len}; {EXPECTED}")]
    Length {
        /// Its length in bytes.
        len: usize,
    },
    /// Its four parts are not separated by `-` at their places.
    #[error("a traceparent's four parts are separated by `-`, this one's are not; {EXPECTED}")]
    Separators,
    /// A part holds something other than lower-case hex digits (upper-case ones included,
    /// which W3C refuses).
    #[error("the {part} of this traceparent is not lower-case hex digits; {EXPECTED}")]
    NotLowerHex {
        /// `version`, `trace id`, `parent id` or `flags`.
        part: &'static str,
    },
    /// An id of all zeros, which W3C reserves for an invalid one.
    #[error("the {part} of this traceparent is all zeros, which marks an invalid id; {EXPECTED}")]
    ZeroId {
        /// `trace id` or `parent id`.
        part: &'static str,
    },
}

impl TraceParent {
    /// The traceparent of these ids and flags; refused if an id is all zeros.
    pub fn new(trace_id: [u8; 16], span_id: [u8; 8], flags: u8) -> Result<Self, TraceParentError> {
        if trace_id == [0; 16] {
            return Err(TraceParentError::ZeroId { part: "trace id" });
        }
        if span_id == [0; 8] {
            return Err(TraceParentError::ZeroId { part: "parent id" });
        }
        Ok(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Reads a version-00 `traceparent`: `00-<32 hex>-<16 hex>-<2 hex>`, lower-case, neither
    /// id all zeros. Anything else (another version, surrounding spaces, upper-case digits) is
    /// refused.
    pub fn parse(value: &str) -> Result<Self, TraceParentError> {
        TraceParent::parse_bytes(value.as_bytes())
    }

    /// [`parse`](TraceParent::parse) of a header's bytes (Kafka's headers are bytes).
    pub fn parse_bytes(b: &[u8]) -> Result<Self, TraceParentError> {
        let not_hex = |part| TraceParentError::NotLowerHex { part };
        // A version's own error first: a later version may be longer than 55 bytes.
        if b.len() >= 3 && b[2] == b'-' {
            let version = hex::<1>(&b[..2]).ok_or(not_hex("version"))?;
            if version != [0] {
                return Err(TraceParentError::Version {
                    version: String::from_utf8_lossy(&b[..2]).into_owned(),
                });
            }
        }
        if b.len() != 55 {
            return Err(TraceParentError::Length { len: b.len() });
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return Err(TraceParentError::Separators);
        }
        // The version was read above: the separators are at their places.
        let trace_id = hex::<16>(&b[3..35]).ok_or(not_hex("trace id"))?;
        let span_id = hex::<8>(&b[36..52]).ok_or(not_hex("parent id"))?;
        let [flags] = hex::<1>(&b[53..]).ok_or(not_hex("flags"))?;
        TraceParent::new(trace_id, span_id, flags)
    }

    /// The consumer's reading of a header from the wire: the traceparent, or `None` for a
    /// value that is none, which is ignored with a `debug` event (target `idem`). A message's
    /// header is the producer's to get wrong, and must not fail its job.
    pub fn from_header(value: impl AsRef<[u8]>) -> Option<Self> {
        let value = value.as_ref();
        match TraceParent::parse_bytes(value) {
            Ok(parent) => Some(parent),
            Err(error) => {
                ignored(value, &error);
                None
            }
        }
    }

    /// The trace's id.
    pub const fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The id of the span that sent the message (W3C's `parent-id`).
    pub const fn span_id(&self) -> [u8; 8] {
        self.span_id
    }

    /// The trace flags.
    pub const fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the producer sampled its trace (the flags' lowest bit).
    pub const fn is_sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        write_hex(f, &self.trace_id)?;
        f.write_str("-")?;
        write_hex(f, &self.span_id)?;
        f.write_str("-")?;
        write_hex(f, &[self.flags])
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceParent({self})")
    }
}

impl FromStr for TraceParent {
    type Err = TraceParentError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        TraceParent::parse(value)
    }
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
}

/// `N` bytes of `2 * N` lower-case hex digits.
fn hex<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    fn nibble(d: u8) -> Option<u8> {
        match d {
            b'0'..=b'9' => Some(d - b'0'),
            b'a'..=b'f' => Some(d - b'a' + 10),
            _ => None,
        }
    }
    if digits.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

/// A consumer's traceparent that does not parse: said at `debug`, the value cut short (a
/// header is the producer's, of any length).
fn ignored(value: &[u8], error: &TraceParentError) {
    tracing::debug!(
        target: "idem",
        traceparent = %String::from_utf8_lossy(&value[..value.len().min(64)]),
        %error,
        "idem: ignoring a message's traceparent that does not parse; its claim is not linked \
         to the producer's span"
    );
}

/// What the consumer side gives a claim for its link: the types the attribute's `link = ".."`
/// takes. A value that is not a traceparent links nothing (with a `debug` event).
#[diagnostic::on_unimplemented(
    message = "`link` reads a W3C traceparent: `{Self}` is not one",
    label = "the `link` expression has type `{Self}`",
    note = "give `&str`, `String`, `&[u8]`, `Vec<u8>`, `idem::TraceParent`, or an `Option` of one of them, like \"msg.traceparent\""
)]
pub trait Link {
    /// The traceparent, if the value holds one.
    fn link(&self) -> Option<TraceParent>;
}

impl Link for TraceParent {
    fn link(&self) -> Option<TraceParent> {
        Some(*self)
    }
}

impl Link for str {
    fn link(&self) -> Option<TraceParent> {
        TraceParent::from_header(self)
    }
}

impl Link for String {
    fn link(&self) -> Option<TraceParent> {
        TraceParent::from_header(self)
    }
}

impl Link for [u8] {
    fn link(&self) -> Option<TraceParent> {
        TraceParent::from_header(self)
    }
}

impl Link for Vec<u8> {
    fn link(&self) -> Option<TraceParent> {
        TraceParent::from_header(self)
    }
}

impl<T: Link + ?Sized> Link for &T {
    fn link(&self) -> Option<TraceParent> {
        (**self).link()
    }
}

impl<T: Link> Link for Option<T> {
    fn link(&self) -> Option<TraceParent> {
        self.as_ref().and_then(Link::link)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_formats_version_00() {
        let parent = TraceParent::parse(GOOD).unwrap();
        assert_eq!(
            parent.trace_id(),
            [
                0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                0x47, 0x36
            ]
        );
        assert_eq!(
            parent.span_id(),
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(parent.flags(), 1);
        assert!(parent.is_sampled());
        assert_eq!(parent.to_string(), GOOD);
        assert_eq!(format!("{parent:?}"), format!("TraceParent({GOOD})"));
        let unsampled: TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
            .parse()
            .unwrap();
        assert!(!unsampled.is_sampled());
        assert_eq!(
            unsampled.to_string(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
        );
        let made = TraceParent::new([0xff; 16], [1; 8], 0x03).unwrap();
        assert_eq!(
            made.to_string(),
            "00-ffffffffffffffffffffffffffffffff-0101010101010101-03"
        );
        assert_eq!(TraceParent::parse(&made.to_string()), Ok(made));
    }

    #[test]
    fn refuses_everything_else() {
        use TraceParentError::{NotLowerHex, ZeroId};
        let refused = |value: &str| TraceParent::parse(value).unwrap_err();
        assert_eq!(refused(""), TraceParentError::Length { len: 0 });
        assert_eq!(refused(&GOOD[..54]), TraceParentError::Length { len: 54 });
        assert_eq!(
            refused(&format!("{GOOD}-")),
            TraceParentError::Length { len: 56 }
        );
        assert_eq!(
            refused(&format!(" {GOOD}")),
            TraceParentError::Length { len: 56 }
        );
        // A shorter trace id and a longer parent id: the length is right, the places are not.
        assert_eq!(
            refused("00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01"),
            TraceParentError::Separators
        );
        assert_eq!(
            refused("00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            TraceParentError::Separators
        );
        // GOOD with one part not lowercase hex, or an id of zeros.
        let (trace, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
        let refusals = [
            (GOOD.to_uppercase(), NotLowerHex { part: "trace id" }),
            (
                GOOD.replace(parent, "00F067AA0BA902B7"),
                NotLowerHex { part: "parent id" },
            ),
            (GOOD.replace("-01", "-0g"), NotLowerHex { part: "flags" }),
            (
                GOOD.replacen("00", "0x", 1),
                NotLowerHex { part: "version" },
            ),
            (
                GOOD.replace(trace, &"0".repeat(32)),
                ZeroId { part: "trace id" },
            ),
            (
                GOOD.replace(parent, &"0".repeat(16)),
                ZeroId { part: "parent id" },
            ),
        ];
        for (value, refusal) in refusals {
            assert_eq!(refused(&value), refusal, "{value}");
        }
        for version in ["01", "ff", "cc"] {
            let later = format!("{version}{}-what-comes-next", &GOOD[2..]);
            assert_eq!(
                refused(&later),
                TraceParentError::Version {
                    version: version.to_owned()
                }
            );
        }
        // Multi-byte characters: refused, never sliced inside one.
        assert!(
            TraceParent::parse("00-é4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01").is_err()
        );
        assert!(TraceParent::parse("éé-").is_err());
        let text = refused("nope").to_string();
        assert!(text.contains("55 bytes long, this one is 4"), "{text}");
        assert!(text.contains("like `00-4bf92f"), "{text}");
    }

    #[test]
    fn the_consumer_reads_headers_leniently() {
        assert_eq!(
            TraceParent::from_header(GOOD),
            TraceParent::parse(GOOD).ok()
        );
        assert_eq!(
            TraceParent::from_header(GOOD.as_bytes()),
            TraceParent::parse(GOOD).ok()
        );
        assert_eq!(TraceParent::from_header("garbage"), None);
        assert_eq!(TraceParent::from_header([0xff, 0xfe]), None);
        assert_eq!(Some(GOOD).link(), TraceParent::parse(GOOD).ok());
        assert_eq!(None::<String>.link(), None);
        assert_eq!(Some(String::from("00-x")).link(), None);
        assert_eq!(
            Some(GOOD.as_bytes().to_vec()).link(),
            TraceParent::parse(GOOD).ok()
        );
        assert_eq!((&&GOOD).link(), TraceParent::parse(GOOD).ok());
    }
}
