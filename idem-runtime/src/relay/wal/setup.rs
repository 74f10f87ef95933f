//! The WAL relay's slot and publication, made idempotently as `migrate` makes tables, and what
//! the server must allow first (each refusal naming its fix); the slot's lag; dropping it.

use super::WalRelay;
use crate::error::{Error, WalError};
use crate::relay::Publisher;

/// How far a slot is behind the server's WAL ([`WalRelay::lag`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotLag {
    /// WAL bytes written since the position the relay confirmed: what it has yet to read.
    pub unconfirmed_bytes: i64,
    /// WAL bytes the server keeps for the slot (from its restart position on).
    pub retained_bytes: i64,
    /// Whether a relay is streaming from it now.
    pub active: bool,
    /// PostgreSQL's `wal_status` of the slot: `reserved`, `extended`, `unreserved`, or `lost`
    /// (invalidated: its messages are gone).
    pub wal_status: String,
}

/// A slot's row of `pg_replication_slots`, as [`WalRelay::lag`] reads it.
type LagRow = (Option<i64>, Option<i64>, bool, Option<String>);

impl<P: Publisher> WalRelay<P> {
    /// Makes the publication and the logical replication slot (`pgoutput`) if they are
    /// missing, through the store's pool (its role needs the `REPLICATION` attribute to make
    /// the slot), and checks what the relay needs: `wal_level = logical`, a replication role
    /// for the relay's URL, a slot of `pgoutput` in the store's database that was not
    /// invalidated. Each refusal is a [`WalError::Setup`] naming its fix, found before
    /// anything is published. [`run`](WalRelay::run) calls it first; calling it again changes
    /// nothing.
    ///
    /// The slot keeps every message committed from its creation on, even before a relay runs.
    pub async fn setup(&self) -> Result<(), Error> {
        let pool = self.store().pool();
        let setup = |problem: String| Error::Wal(WalError::Setup { problem });
        let level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
            .fetch_one(pool)
            .await?;
        if level != "logical" {
            return Err(setup(format!(
                "the server's wal_level is {level:?}, and the relay reads logical decoding \
                 messages: run ALTER SYSTEM SET wal_level = logical and restart the server"
            )));
        }
        let user = &self.replication.user;
        let may: Option<bool> = sqlx::query_scalar(
            "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = $1",
        )
        .bind(user)
        .fetch_optional(pool)
        .await?;
        match may {
            None => {
                return Err(setup(format!(
                    "the relay's URL names the role {user:?}, which does not exist"
                )));
            }
            Some(false) => {
                return Err(setup(format!(
                    "the role {user:?} may not stream replication: run ALTER ROLE \"{user}\" \
                     REPLICATION (or give the relay a role that may)"
                )));
            }
            Some(true) => {}
        }
        let slot = self.slot.as_str();
        let published: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
                .bind(slot)
                .fetch_one(pool)
                .await?;
        if !published {
            // A publication of no table: the relay reads the logical decoding messages,
            // which pgoutput sends whatever the publication holds.
            let created = sqlx::query(sqlx::AssertSqlSafe(format!("CREATE PUBLICATION {slot}")))
                .execute(pool)
                .await;
            ok_if_made_meanwhile(created.map(drop))?;
        }
        let found: Option<(String, Option<String>, bool)> = sqlx::query_as(
            "SELECT plugin, wal_status, database = current_database() \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(slot)
        .fetch_optional(pool)
        .await?;
        match found {
            None => {
                let created =
                    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                        .bind(slot)
                        .execute(pool)
                        .await;
                ok_if_made_meanwhile(created.map(drop))
            }
            Some((plugin, _, _)) if plugin != "pgoutput" => Err(setup(format!(
                "the slot {slot:?} decodes with {plugin:?}, and the relay reads pgoutput: give \
                 the relay another slot (WalRelay::slot), or drop that one"
            ))),
            Some((_, _, false)) => Err(setup(format!(
                "the slot {slot:?} belongs to another database than the store's: give the \
                 relay another slot (WalRelay::slot)"
            ))),
            Some((_, Some(status), _)) if status == "lost" => Err(setup(format!(
                "the slot {slot:?} was invalidated (it fell behind max_slot_wal_keep_size): \
                 the messages it held are gone from the WAL. Drop it (`WalRelay::drop_slot`), \
                 set the relay up again, and resend what the jobs of the gap should have sent"
            ))),
            Some(_) => Ok(()),
        }
    }

    /// How far the slot is behind the server's WAL; `None` when there is no such slot.
    pub async fn lag(&self) -> Result<Option<SlotLag>, Error> {
        let row: Option<LagRow> = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8, \
             pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8, active, wal_status \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(self.store().pool())
        .await?;
        Ok(row.map(|(unconfirmed, retained, active, status)| SlotLag {
            unconfirmed_bytes: unconfirmed.unwrap_or(0),
            retained_bytes: retained.unwrap_or(0),
            active,
            wal_status: status.unwrap_or_default(),
        }))
    }

    /// Drops the slot and the publication (the server then keeps no WAL for the relay);
    /// whether there was a slot. Messages committed and not yet confirmed are lost to the
    /// relay. A slot a relay is streaming from is not dropped: PostgreSQL refuses, and the
    /// error says so.
    pub async fn drop_slot(&self) -> Result<bool, Error> {
        let pool = self.store().pool();
        let dropped: Option<bool> = sqlx::query_scalar(
            "SELECT pg_drop_replication_slot(slot_name) IS NULL FROM pg_replication_slots \
             WHERE slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(pool)
        .await?;
        let slot = &self.slot;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP PUBLICATION IF EXISTS {slot}"
        )))
        .execute(pool)
        .await?;
        Ok(dropped.is_some())
    }
}

/// A `CREATE` that another relay's setup won is as good as one's own: `duplicate_object`, or
/// the catalog's `unique_violation` when both ran at once.
fn ok_if_made_meanwhile(made: Result<(), sqlx::Error>) -> Result<(), Error> {
    match made {
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42710" | "23505")) => {
            Ok(())
        }
        other => Ok(other?),
    }
}
