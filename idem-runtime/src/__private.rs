//! What `#[idempotent]` expands to calls. Not a public API: names and signatures here change
//! with the macro, which is why the facade pins both crates to one exact version.

use crate::{Backend, Error, Key};
pub use crate::{Claim, Guard, IntoKey, Outcome, Store};

/// Encodes the key. Called with the `key` expression before any I/O, so that a type without
/// [`IntoKey`] is reported on the expression itself.
#[inline]
pub fn key<K: IntoKey + ?Sized>(value: &K) -> Result<Key, Error> {
    Ok(Key::new(value)?)
}

/// Claims an already-encoded key, passing a key error through without touching the database.
#[inline]
pub async fn claim<DB: Backend>(
    store: &Store<DB>,
    scope: &str,
    key: Result<Key, Error>,
) -> Result<Claim<DB>, Error> {
    store.claim(scope, &key?).await
}
