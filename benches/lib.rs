//! Nothing to see: the benchmark is `throughput/main.rs` and its modules, run with
//! `cargo bench --bench throughput`. Cargo wants a library or binary target in every package.
