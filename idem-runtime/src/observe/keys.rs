//! How a job's key appears in what idem logs: as it is, hashed, or not at all.

use std::sync::atomic::{AtomicU8, Ordering};

use sha2::{Digest as _, Sha256};

use crate::error::{Error, LeaseError, NotKept};

/// How the `idem.claim` span and idem's logged error texts show a job's key. Set it once for
/// the process with [`observe_keys`].
///
/// Keys are often ids that mean nothing outside the system (`order-7`), but some are personal
/// data (an e-mail address, a phone number) that logs should not keep.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyInSpans {
    /// The key as stored, in the span's `key` field (the default).
    #[default]
    Plain,
    /// The first 16 hex digits of the SHA-256 of the key as stored, in the span's `key_hash`
    /// field (no `key` field). The same key always gives the same hash, so one job's calls
    /// can still be found: `printf %s 'order-7' | sha256sum | cut -c1-16`. A hash hides a
    /// random id; it does not hide a key that can be guessed (a phone number can be hashed
    /// for every number): leave such keys out with [`Omitted`](KeyInSpans::Omitted).
    Hashed,
    /// No key in the span at all, and `<key omitted>` for it in logged error texts.
    Omitted,
}

static KEYS: AtomicU8 = AtomicU8::new(KeyInSpans::Plain as u8);

/// Sets how every `idem.claim` span of this process shows its key, and how the error texts
/// idem logs do ([`KeyInSpans`]). Call it at start-up, before the first handler runs; it
/// applies to the calls that start after it.
///
/// It changes only what idem logs. The errors a handler returns still carry the key (their
/// `key` field and their text), for the caller to decide what to log.
///
/// ```
/// # use idem_runtime as idem;
/// idem::observe_keys(idem::KeyInSpans::Hashed);
/// # idem::observe_keys(idem::KeyInSpans::Plain);
/// ```
pub fn observe_keys(keys: KeyInSpans) {
    KEYS.store(keys as u8, Ordering::Relaxed);
}

/// The process's setting.
pub(super) fn setting() -> KeyInSpans {
    match KEYS.load(Ordering::Relaxed) {
        1 => KeyInSpans::Hashed,
        2 => KeyInSpans::Omitted,
        _ => KeyInSpans::Plain,
    }
}

/// The `key_hash` of `key`: the first 16 hex digits of its SHA-256.
pub(super) fn hash(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut out = String::with_capacity(16);
    for byte in &digest[..8] {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// The key an error names, if it names one. Every variant is matched by name, so that one
/// added with a key in its message cannot be logged with the key in plain text by oversight.
fn key_of(error: &Error) -> Option<&str> {
    match error {
        Error::InProgress { key, .. }
        | Error::KeyReused { key, .. }
        | Error::ValueNotStored { key, .. } => Some(key),
        Error::NotKept(not_kept) => match not_kept {
            NotKept::RolledBack { key, .. }
            | NotKept::JobNotFinished { key, .. }
            | NotKept::Group { key, .. }
            | NotKept::TimedOut { key, .. }
            | NotKept::Injected { key, .. } => Some(key),
            NotKept::NotCommitted => None,
        },
        Error::Lease(lease) => match lease {
            LeaseError::Held { key, .. }
            | LeaseError::Lost { key, .. }
            | LeaseError::Unverified { key, .. }
            | LeaseError::Timeout { key, .. } => Some(key),
        },
        Error::Database(_)
        | Error::ReadOnly(_)
        | Error::Refused(_)
        | Error::Serialize(_)
        | Error::Kafka(_)
        | Error::Wal(_) => None,
    }
}

/// The text of `error` as idem logs it: its message, with the key (quoted in it) shown as the
/// process's [`KeyInSpans`] says.
pub(super) fn error_text(error: &Error) -> String {
    let text = error.to_string();
    let Some(key) = key_of(error) else {
        return text;
    };
    let shown = match setting() {
        KeyInSpans::Plain => return text,
        KeyInSpans::Hashed => format!("<key_hash={}>", hash(key)),
        KeyInSpans::Omitted => "<key omitted>".to_owned(),
    };
    text.replace(&format!("{key:?}"), &shown)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every error whose message quotes a key names it, so that a log that hides keys can
    /// hide it.
    #[test]
    fn every_error_that_quotes_a_key_names_it() {
        use std::time::Duration;
        let keyed: [fn(String, String) -> Error; 12] = [
            |scope, key| Error::InProgress { scope, key },
            |scope, key| Error::KeyReused { scope, key },
            |scope, key| {
                let reason = "too long".into();
                Error::ValueNotStored { scope, key, reason }
            },
            |scope, key| Error::NotKept(NotKept::RolledBack { scope, key }),
            |scope, key| Error::NotKept(NotKept::JobNotFinished { scope, key }),
            |scope, key| {
                let (may_be_kept, reason) = (false, "the connection was lost".into());
                Error::NotKept(NotKept::Group {
                    scope,
                    key,
                    may_be_kept,
                    reason,
                })
            },
            |scope, key| {
                let after = Duration::from_secs(5);
                Error::NotKept(NotKept::TimedOut { scope, key, after })
            },
            |scope, key| {
                Error::NotKept(NotKept::Injected {
                    scope,
                    key,
                    at: "commit",
                })
            },
            |scope, key| Error::Lease(LeaseError::Held { scope, key }),
            |scope, key| Error::Lease(LeaseError::Lost { scope, key }),
            |scope, key| {
                let step = "charge".into();
                Error::Lease(LeaseError::Unverified { scope, key, step })
            },
            |scope, key| {
                let after = Duration::from_secs(5);
                Error::Lease(LeaseError::Timeout { scope, key, after })
            },
        ];
        let key = "order-7";
        let errors = keyed.map(|make| make("billing".to_owned(), key.to_owned()));
        for error in &errors {
            assert!(error.to_string().contains(&format!("{key:?}")), "{error}");
            assert_eq!(key_of(error), Some(key), "{error}");
        }
        assert_eq!(key_of(&Error::NotKept(NotKept::NotCommitted)), None);
    }

    #[test]
    fn the_hash_is_the_sha256_prefix() {
        // printf %s 'order-7' | sha256sum
        let full = format!("{:x}", Sha256::digest(b"order-7"));
        assert_eq!(hash("order-7"), full[..16]);
        assert_eq!(hash("order-7").len(), 16);
    }
}
