//! Scopes: the stable names of handlers' markers, checked like keys.

use crate::error::{Error, Refusal};
use crate::key::MAX_KEY_LEN;

/// Scopes are checked like keys: the attribute checks its literal at compile time, the store
/// checks the scopes that hand-written code passes (1 to 255 bytes, no NUL).
pub(crate) fn check_scope(scope: &str) -> Result<(), Error> {
    if scope.is_empty() || scope.len() > MAX_KEY_LEN || scope.contains('\0') {
        return Err(Error::Refused(Refusal::Scope {
            scope: scope.to_owned(),
        }));
    }
    Ok(())
}
