//! idem on the setups users scale out to, tested on real servers (docs/scaling.md): PgBouncer
//! in transaction pooling mode in front of PostgreSQL (`tests/pgbouncer.rs`), a read-only
//! PostgreSQL (`tests/read_only.rs`), and a primary whose standby is promoted after the
//! primary was killed (`tests/standby.rs`). The tests start what they need themselves.

pub mod bouncer;
pub mod jobs;
pub mod standby;
