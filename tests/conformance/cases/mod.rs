//! The cases, grouped by concern; each is `pub(crate) async fn name<S: Support>()`, and the
//! backends' test binaries call them by name (see `conformance::tests!`).

mod basic;
mod lease;
mod lease_processes;
mod processes;
mod races;
mod rollback;
mod server;
mod shapes;
mod store;

pub(crate) use basic::*;
pub(crate) use lease::*;
pub(crate) use lease_processes::*;
pub(crate) use processes::*;
pub(crate) use races::*;
pub(crate) use rollback::*;
pub(crate) use server::*;
pub(crate) use shapes::*;
pub(crate) use store::*;
