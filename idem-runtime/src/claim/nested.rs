//! Which handler's body runs in this task, so that a claim with a store inside it (whose
//! transaction would not be the open one) is refused before any I/O.

use std::future::Future;

use crate::Error;

tokio::task_local! {
    /// The name of the handler whose body is running in this task (its transaction is open).
    static BODY: &'static str;
}

/// Runs `future` (a handler's claim, body and end) with `handler` marked as the one whose
/// transaction is open, for [`refuse_nested`]. A task-local: set and reset around each poll.
pub(crate) fn in_body<F: Future>(
    handler: &'static str,
    future: F,
) -> impl Future<Output = F::Output> {
    BODY.scope(handler, future)
}

/// Refuses a claim with a store inside a handler's body (before any I/O): its transaction
/// would be another one than the open one, and wait for it (SQLite) or commit apart from it.
pub(crate) fn refuse_nested(inner: &str) -> Result<(), Error> {
    match BODY.try_with(|outer| *outer) {
        Ok(outer) => Err(Error::Nested {
            inner: inner.to_owned(),
            outer: outer.to_owned(),
        }),
        Err(_) => Ok(()),
    }
}
