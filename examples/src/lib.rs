//! Support code the examples share with their tests. The examples themselves are the files
//! next to this folder: `cargo run --example quickstart`.

pub mod charge;
pub mod payments;
pub mod quickstart;
pub mod top_up;
