//! The cases, grouped by concern; each is `pub(crate) async fn name<S: Support>()`, and the
//! backends' test binaries call them by name (see `conformance::tests!`).

mod ambiguous;
mod attribute;
mod basic;
mod batch;
mod batch_processes;
mod claims;
mod fingerprint;
mod inspect;
mod join;
mod keys;
mod lease;
mod lease_processes;
mod lease_renew;
mod migrate_lock;
mod modes;
mod processes;
mod races;
pub(crate) mod replay;
mod rollback;
mod server;
mod shapes;
mod store;

pub(crate) use ambiguous::*;
pub(crate) use attribute::*;
pub(crate) use basic::*;
pub(crate) use batch::*;
pub(crate) use batch_processes::*;
pub(crate) use claims::*;
pub(crate) use fingerprint::*;
pub(crate) use inspect::*;
pub(crate) use join::*;
pub(crate) use keys::*;
pub(crate) use lease::*;
pub(crate) use lease_processes::*;
pub(crate) use lease_renew::*;
pub(crate) use migrate_lock::*;
pub(crate) use modes::*;
pub(crate) use processes::*;
pub(crate) use races::*;
pub(crate) use replay::*;
pub(crate) use rollback::*;
pub(crate) use server::*;
pub(crate) use shapes::*;
pub(crate) use store::*;
