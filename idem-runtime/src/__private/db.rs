//! The databases that sqlx's transaction aliases name (`PgTransaction<'_>` is
//! `Transaction<'_, Postgres>`), for the store parameter that replaces them.

#[cfg(feature = "mysql")]
pub use sqlx::MySql;
#[cfg(feature = "postgres")]
pub use sqlx::Postgres;
#[cfg(feature = "sqlite")]
pub use sqlx::Sqlite;

/// Stands in for the database of a transaction parameter that named none
/// (`&mut Transaction`), so that the handler given back to rustc compiles around the one
/// error reported on that type.
#[cfg(feature = "sqlite")]
pub type Placeholder = Sqlite;
#[cfg(all(feature = "postgres", not(feature = "sqlite")))]
pub type Placeholder = Postgres;
#[cfg(all(feature = "mysql", not(any(feature = "sqlite", feature = "postgres"))))]
pub type Placeholder = MySql;
