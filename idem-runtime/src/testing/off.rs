//! The test kit's hooks in a build without the `testing` feature: each one answers as the kit
//! does outside a delivery under test (nothing to note, no fault), in a function the compiler
//! removes. The runtime calls the hooks unconditionally, so that a handler under test runs the
//! code it runs in production; `probe.rs` holds the kit's versions, with the same signatures.

use crate::error::Error;
use crate::options::Mode;
use crate::outcome::{Failed, Outcome};

#[inline(always)]
pub(crate) fn claiming(_mode: Mode) {}

#[inline(always)]
pub(crate) fn lease_answered() {}

#[inline(always)]
pub(crate) async fn lease_taken(_lease: &dyn Held) -> Result<(), Error> {
    Ok(())
}

/// What the kit's hooks need of a held lease; nothing calls it without the kit.
#[allow(
    dead_code,
    reason = "the kit's hooks call these; without the kit nothing does"
)]
pub(crate) trait Held: Sync {
    fn attempt(&self) -> u32;
    fn expire_now(&self) -> crate::future::BoxFuture<'_, Result<bool, sqlx::Error>>;
    fn reset_deadline(&self, now: std::time::Instant);
}

#[inline(always)]
pub(crate) async fn before_commit(_scope: &str, _key: &str, _at: &'static str) -> Option<Error> {
    None
}

#[inline(always)]
pub(crate) async fn step_done(_scope: &str, _key: &str, _name: &str, _ran: bool) -> Option<Error> {
    None
}

#[inline(always)]
pub(crate) fn settled<T, E>(_result: &Result<Outcome<T>, Failed<E>>) {}

#[inline(always)]
pub(crate) fn refused(_error: &Error) {}
