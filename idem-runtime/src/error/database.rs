//! The database's side of [`Error`]: the text of [`Error::Database`] with advice that fits
//! its cause, which database refusals last, and the carrier that lets an [`Error`] ride
//! inside a `sqlx::Error`.

use std::fmt;

use super::{Error, LeaseError, NotKept};

/// The text of [`Error::Database`]: the cause, once, then what to do about it.
pub(super) struct DatabaseMessage<'a>(pub(super) &'a sqlx::Error);

impl fmt::Display for DatabaseMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let err = self.0;
        // sqlx prefixes database errors with "error returned from database:" and the code;
        // the server's own message is what says what happened.
        match err.as_database_error() {
            Some(db) => write!(f, "the database refused a statement: {}", db.message())?,
            None => write!(f, "{err}")?,
        }
        f.write_str(": ")?;
        f.write_str(advice(err))
    }
}

fn advice(err: &sqlx::Error) -> &'static str {
    if is_read_only(err) {
        return "the server is read-only (a hot standby or replica, or writes are turned off: \
                PostgreSQL's default_transaction_read_only, MySQL's read_only). Nothing was \
                written and no job was reported Applied: point the pool at the primary (after \
                a failover, at the promoted server) and let the job be redelivered; it runs \
                once writes are accepted";
    }
    if is_lost_statement(err) {
        return "a statement sqlx prepared under a name on one server connection is missing on \
                the one that ran it, or its name is taken there: a pooler in transaction mode \
                (PgBouncer's pool_mode = transaction) is between the pool and PostgreSQL. \
                Nothing was kept. Call `Store::behind_transaction_pooler()` (idem's \
                statements are then sent unnamed), send the handlers' own queries with \
                `.persistent(false)` and inside a transaction, or run the pooler in session mode \
                (docs/scaling.md, \"PgBouncer\")";
    }
    if is_missing_table(err) {
        return "the marker table does not exist: call `Store::migrate()` at start-up, or add \
                the statements of `Store::ddl()` to your migrations";
    }
    if !transient(err) {
        return "nothing was kept, and a redelivery fails the same way until the database \
                changes (a missing column or index, a table of an older schema, a privilege, \
                a read-only or unreadable database): `idem doctor` checks the schema; fix \
                it, then let the job be redelivered";
    }
    match err {
        // Under load the pool is spent long before the server is gone: say both.
        sqlx::Error::PoolTimedOut => {
            "no connection of the pool came free within its acquire timeout: every one was in \
             use (or none could be opened). Each call in flight holds one for its claim, and a \
             body that takes a second from the same pool holds two, which starves the pool \
             under load: run the body's statements on the claim's transaction, or give the \
             pool room for the calls in flight (`idem doctor` compares it with the server's \
             limit). Nothing was kept; let the job be redelivered"
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::Configuration(_) => {
            "the database could not be reached: check its URL and that it is running. Let \
             the job be redelivered: if the connection was lost during the commit, the commit \
             may have landed, and the redelivery settles it (it runs once or is a duplicate)"
        }
        _ => {
            "the job's marker and its effect were kept or lost together, so let the broker \
             redeliver the job: it will run once or be reported as a duplicate"
        }
    }
}

/// Whether the database may answer otherwise next time: a lost connection, a lost race, a
/// lock or resource limit. Refusals that only a change of the database ends are not: SQLSTATE
/// classes 42 (a missing table or column, a privilege) and 28 (authorisation) on PostgreSQL
/// and MySQL; on SQLite a missing table or column, a syntax error, and a read-only, corrupt or
/// unopenable file; a configuration sqlx refused; a column that does not decode.
pub(super) fn transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Configuration(_)
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::Encode(_)
        | sqlx::Error::InvalidArgument(_) => false,
        sqlx::Error::Database(db) => {
            let code = db.code();
            let code = code.as_deref().unwrap_or_default();
            // A statement lost to a pooler lasts until the store or the pooler is set up for
            // it.
            if code.starts_with("42") || code.starts_with("28") || is_lost_statement(err) {
                return false;
            }
            !sqlite_refusal(&**db)
        }
        _ => true,
    }
}

/// SQLite's refusals that last: the primary result codes PERM, READONLY, CORRUPT, CANTOPEN,
/// AUTH and NOTADB, and SQLITE_ERROR's schema refusals, told apart by their text.
fn sqlite_refusal(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        let primary = db
            .code()
            .and_then(|c| c.parse::<u32>().ok())
            .map(|c| c & 0xff);
        let message = db.message();
        return matches!(primary, Some(3 | 8 | 11 | 14 | 23 | 26))
            || message.contains("no such table")
            || message.contains("no such column")
            || message.contains("has no column named")
            || message.contains("syntax error");
    }
    let _ = db;
    false
}

/// PostgreSQL `25006` (`read_only_sql_transaction`: a hot standby, or
/// `default_transaction_read_only`), the same SQLSTATE on MySQL and MariaDB in a read-only
/// transaction, and their error 1290 for a server running with `read_only`.
pub(super) fn is_read_only(err: &sqlx::Error) -> bool {
    let Some(db) = err.as_database_error() else {
        return false;
    };
    if db.code().as_deref() == Some("25006") {
        return true;
    }
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return my.number() == 1290 && my.message().contains("read-only");
    }
    false
}

/// What a pooler in transaction mode does to sqlx's statements on PostgreSQL: `26000`
/// (`prepared statement "sqlx_s_1" does not exist`, `unnamed prepared statement does not
/// exist`), `42P05` (`prepared statement "sqlx_s_1" already exists`), and `08P01` for a bind
/// that reached another client's unnamed statement (`bind message supplies 2 parameters, but
/// prepared statement "" requires 5`).
fn is_lost_statement(err: &sqlx::Error) -> bool {
    let Some(db) = err.as_database_error() else {
        return false;
    };
    let message = db.message();
    match db.code().as_deref() {
        Some("26000" | "42P05") => message.contains("prepared statement"),
        Some("08P01") => message.contains("prepared statement \"\""),
        _ => false,
    }
}

/// PostgreSQL `42P01`, MySQL 1146, SQLite "no such table".
fn is_missing_table(err: &sqlx::Error) -> bool {
    let Some(db) = err.as_database_error() else {
        return false;
    };
    matches!(db.code().as_deref(), Some("42P01" | "42S02"))
        || db.message().contains("no such table")
}

/// What lets an [`Error`] ride inside [`sqlx::Error::Database`], so that handlers returning
/// `sqlx::Error` keep its kind (sqlx's blanket `From<E: DatabaseError>` makes the conversion):
/// sqlx's own pattern for driver errors gets it back.
///
/// ```
/// # use idem_runtime as idem;
/// let err = sqlx::Error::from(idem::Error::KeyReused { scope: "s".into(), key: "k".into() });
/// let idem_err = err
///     .as_database_error()
///     .and_then(|e| e.try_downcast_ref::<idem::Error>());
/// assert!(matches!(idem_err, Some(idem::Error::KeyReused { .. })));
/// ```
///
/// A database error keeps its message, code and kind; idem's own have no SQLSTATE, and a key
/// reused for another payload reads like a violated unique key.
impl sqlx::error::DatabaseError for Error {
    fn message(&self) -> &str {
        if let Some(db) = self.driver_error() {
            return db.message();
        }
        match self {
            Error::InProgress { .. } => "another delivery of the key is still in progress",
            Error::KeyReused { .. } => "the idempotency key was used for another payload",
            Error::NotKept(NotKept::RolledBack { .. }) | Error::NotKept(NotKept::NotCommitted) => {
                "the database rolled the transaction back instead of committing it"
            }
            Error::Lease(LeaseError::Lost { .. }) => "the lease was lost to another delivery",
            Error::Lease(LeaseError::Timeout { .. }) => "the body ran out of time",
            _ => "idem refused or could not complete the call",
        }
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.driver_error().and_then(|db| db.code())
    }

    fn constraint(&self) -> Option<&str> {
        self.driver_error().and_then(|db| db.constraint())
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        if let Some(db) = self.driver_error() {
            return db.kind();
        }
        match self {
            Error::KeyReused { .. } => sqlx::error::ErrorKind::UniqueViolation,
            _ => sqlx::error::ErrorKind::Other,
        }
    }
}
