//! The outbox relay fed by PostgreSQL's write-ahead log: a store that sends its messages
//! through the WAL ([`Store::outbox_through_wal`]) writes each as a logical decoding message in
//! the job's transaction, and [`WalRelay`] reads them from a logical replication slot in commit
//! order, publishes them, and confirms the slot's position only past what the broker confirmed.

mod setup;
mod stream;

pub use setup::SlotLag;

use std::time::Duration;

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};
use sqlx::Postgres;

use super::{Publisher, Relay};
use crate::error::{Error, WalError};
use crate::store::Store;

/// Publishes the messages of a store that sends its outbox through the write-ahead log
/// ([`Store::outbox_through_wal`]), read from a logical replication slot (feature
/// `wal-relay`, PostgreSQL).
///
/// ```no_run
/// # use idem_runtime as idem;
/// # #[cfg(feature = "outbox-rabbitmq")]
/// # async fn example(pool: sqlx::PgPool, channel: lapin::Channel) -> Result<(), idem::Error> {
/// use idem::outbox::{RabbitMq, WalRelay};
///
/// let store = idem::Store::new(pool).outbox_through_wal();
/// let relay = WalRelay::new(
///     store,
///     "postgres://relay@db.internal/app?sslmode=verify-full",
///     RabbitMq::new(channel),
/// )?;
/// relay.setup().await?; // the publication and the slot, once; refuses a server not set up
/// relay.run(std::future::pending()).await?;
/// # Ok(()) }
/// ```
///
/// # What it guarantees
///
/// - **Nothing before its commit, nothing lost after it.** A job's messages are in the WAL only
///   if its transaction committed; the relay confirms the slot's position past a transaction
///   only once the broker confirmed every message of it and of every transaction before it. A
///   relay killed at any point starts again from the confirmed position: the messages after it
///   are published again, with their ids, and the next consumer's claim (or JetStream's
///   duplicate window) drops the copies.
/// - **Commit order.** Messages leave in the order of their transactions' commits, and a job's
///   in the order it sent them. Within a batch, one ordering key's messages go one at a time
///   (each after the broker confirmed the one before), other keys' beside them.
/// - **A refused message goes to the outbox table with its key.** A message the broker
///   refused becomes a row of the outbox table at once, as a failed attempt due again after
///   [`backoff`](WalRelay::backoff), and every later message of its key goes to the table
///   behind it (per key, nothing overtakes it) while other keys go on and the slot's position
///   moves past them. The table's rows are sent between the relay's batches, by the polling
///   relay's rounds ([`Relay::relay_once`]): retried with the backoff doubling, parked after
///   [`max_attempts`](WalRelay::max_attempts), brought back by `idem outbox requeue`. A key's
///   messages go straight to the broker again once the table holds none of them. A broker that
///   is down for long so turns the relay into a polling one until its backlog is sent.
/// - **One relay a slot.** PostgreSQL lets one connection stream from a slot. A second relay
///   started on the same slot waits, trying again every [`standby`](WalRelay::standby) (1 s),
///   and takes over when the first one's connection ends.
///
/// The slot holds the WAL from its confirmed position on: a relay that stays down keeps the
/// server's WAL growing without bound. Cap it with `max_slot_wal_keep_size` (a slot past the
/// cap is invalidated, and its messages are lost to the relay), and watch `idem doctor`.
pub struct WalRelay<P: Publisher> {
    /// The polling relay of the same store, for the rows the WAL relay parked, and the
    /// publisher, the backoff and the attempts it shares.
    table: Relay<Postgres, P>,
    replication: ReplicationConfig,
    slot: String,
    batch: usize,
    standby: Duration,
}

impl<P: Publisher> WalRelay<P> {
    /// A relay of `store`'s messages to `publisher`, reading the WAL through a replication
    /// connection to `url` (`postgres://user:password@host:port/database`, its role with the
    /// `REPLICATION` attribute; `sslmode` as libpq's: `disable` by default, `require`,
    /// `verify-ca`, `verify-full`). The slot and the publication are named `{table}_relay`
    /// ([`slot`](WalRelay::slot)). Batches of 500 messages, a backoff of 1 s doubling up to
    /// 5 min, 10 attempts before a message parks.
    ///
    /// A URL that does not parse, or names no database, is refused before any I/O
    /// ([`WalError::Refused`]).
    pub fn new(store: Store<Postgres>, url: &str, publisher: P) -> Result<Self, Error> {
        let slot = format!("{}_relay", store.sql().table.as_str());
        let replication = config(url, &slot)?;
        Ok(WalRelay {
            table: Relay::new(store, publisher).listen(false),
            replication,
            slot,
            batch: 500,
            standby: Duration::from_secs(1),
        })
    }

    /// Streams from the slot (and publication) `name` instead: a letter or `_`, then
    /// letters, digits or `_`, at most 63 characters; anything else is refused
    /// ([`WalError::Refused`]). Each relay of one store needs a slot of its own only if they
    /// are to publish the same messages twice (to two brokers, say).
    pub fn slot(mut self, name: &str) -> Result<Self, Error> {
        let mut chars = name.chars();
        let plain = matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
            && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && name.len() <= 63;
        if !plain {
            return Err(Error::Wal(WalError::Refused {
                what: "slot name",
                reason: format!(
                    "{name:?} is not a slot name PostgreSQL takes: a lowercase letter or `_`, \
                     then lowercase letters, digits or `_`, at most 63 bytes"
                ),
            }));
        }
        name.clone_into(&mut self.slot);
        self.replication.slot = name.to_owned();
        self.replication.publication = name.into();
        Ok(self)
    }

    /// How many messages one batch publishes at most (whole transactions, at least one): the
    /// relay reads on while it has fewer, and publishes them together, each key's in waves.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// The wait before the first retry of a failed message (doubling with each attempt, at
    /// most 5 min).
    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.table = self.table.backoff(backoff);
        self
    }

    /// After how many failed attempts a message is parked.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.table = self.table.max_attempts(max_attempts);
        self
    }

    /// How often a relay that finds its slot held by another one tries again (1 s): the
    /// longest a standby relay takes to take over once the active one's connection ended.
    pub fn standby(mut self, every: Duration) -> Self {
        self.standby = every.max(Duration::from_millis(10));
        self
    }

    /// The slot's name.
    pub fn slot_name(&self) -> &str {
        &self.slot
    }

    fn store(&self) -> &Store<Postgres> {
        &self.table.store
    }
}

/// The replication client's configuration for `url`, streaming from `slot`.
fn config(url: &str, slot: &str) -> Result<ReplicationConfig, Error> {
    let refused = |reason: String| {
        Error::Wal(WalError::Refused {
            what: "replication URL",
            reason,
        })
    };
    let parsed = url::Url::parse(url).map_err(|e| {
        refused(format!(
            "it does not parse ({e}): give postgres://user:password@host:port/database"
        ))
    })?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(refused(format!(
            "its scheme is {:?}: give postgres://user:password@host:port/database",
            parsed.scheme()
        )));
    }
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("x={s}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    let database = decode(parsed.path().trim_start_matches('/'));
    if database.is_empty() {
        return Err(refused(
            "it names no database: a slot belongs to one database, give its name as the path"
                .to_owned(),
        ));
    }
    let user = match parsed.username() {
        "" => "postgres".to_owned(),
        user => decode(user),
    };
    let password = parsed.password().map(decode).unwrap_or_default();
    let host = parsed.host_str().unwrap_or("localhost").to_owned();
    let mut tls = TlsConfig::disabled();
    for (name, value) in parsed.query_pairs() {
        if name == "sslmode" {
            tls = match &*value {
                "disable" | "allow" | "prefer" => TlsConfig::disabled(),
                "require" => TlsConfig::require(),
                "verify-ca" => TlsConfig::verify_ca(None),
                "verify-full" => TlsConfig::verify_full(None),
                other => {
                    return Err(refused(format!(
                        "its sslmode {other:?} is none of disable, require, verify-ca, verify-full"
                    )));
                }
            };
        }
    }
    debug_assert!(matches!(tls.mode, SslMode::Disable) || tls.mode.requires_tls());
    Ok(
        ReplicationConfig::new(host, user, password, database, slot, slot)
            .with_port(parsed.port().unwrap_or(5432))
            .with_tls(tls)
            .with_application_name(format!("idem relay {slot}"))
            // A confirmed position reaches the server within this, and the slot lets go of
            // the WAL before it.
            .with_status_interval(Duration::from_millis(100))
            .with_wakeup_interval(Duration::from_secs(1)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_gives_its_parts_and_a_bad_one_says_what_to_give() {
        let cfg = config("postgres://re%40lay:p%3Aw@db:6543/app?sslmode=require", "s").unwrap();
        assert_eq!(
            (cfg.user.as_str(), cfg.password.as_str(), cfg.host.as_str()),
            ("re@lay", "p:w", "db")
        );
        assert_eq!((cfg.port, cfg.database.as_str()), (6543, "app"));
        assert!(cfg.tls.mode.requires_tls());
        for (url, says) in [
            ("not a url", "does not parse"),
            ("mysql://root@h/db", "scheme"),
            ("postgres://u@h", "names no database"),
            ("postgres://u@h/db?sslmode=sometimes", "sslmode"),
        ] {
            let error = config(url, "s").unwrap_err().to_string();
            assert!(error.contains(says), "{url}: {error}");
        }
    }
}
