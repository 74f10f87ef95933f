//! Support code the examples share with their tests. The examples themselves are the files
//! next to this folder: `cargo run --example top_up`. The quickstart is a package of its own,
//! `examples/quickstart/`, so that its first build compiles none of the web and broker crates.

pub mod charge;
pub mod checkout;
pub mod mail;
pub mod payments;
pub mod top_up;

/// The README's code blocks, compiled as doctests with this package's dependencies (axum,
/// reqwest, the test kit), so that each stays complete: a block that needs a line the README
/// does not show fails here.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
