//! idem on the setups users scale out to, tested on real servers (docs/scaling.md): PgBouncer
//! in transaction pooling mode in front of PostgreSQL (`tests/pgbouncer.rs`), a read-only
//! PostgreSQL (`tests/read_only.rs`), a primary whose standby is promoted after the
//! primary was killed (`tests/standby.rs`), and a three-node MariaDB Galera cluster
//! (`tests/galera.rs`). The tests start what they need themselves. The benchmark starts a
//! primary whose synchronous standby streams through a delaying proxy (`delay.rs`).

pub mod bouncer;
pub mod delay;
pub mod galera;
pub mod jobs;
pub mod mariadb_jobs;
pub mod standby;
