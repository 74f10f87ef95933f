/// The WAL relay could not go on, or was not set up to (feature `wal-relay`,
/// [`WalRelay`](crate::outbox::WalRelay)). It reaches callers as
/// [`Error::Wal`](crate::Error::Wal); the variant says which, and its message what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WalError {
    /// A name or address the relay was given, refused before any I/O: nothing was created.
    #[error("the WAL relay refused its {what}: {reason}")]
    Refused {
        /// What was refused (the slot's name, the replication URL).
        what: &'static str,
        /// What is wrong with it, and what to give instead.
        reason: String,
    },

    /// The server is not set up for the relay: `wal_level` is not `logical`, the role may not
    /// replicate, the slot was invalidated or belongs to another plugin. Found before anything
    /// was published; the message names the fix.
    #[error("the WAL relay cannot start: {problem}")]
    Setup {
        /// What stands in the way, and the fix.
        problem: String,
    },

    /// A store that sends its outbox through the WAL
    /// ([`Store::outbox_through_wal`](crate::Store::outbox_through_wal)) found no logical
    /// replication slot (`pgoutput`) in its database: WAL written before a slot exists is never
    /// decoded by it, so the claim's messages would have been lost. Nothing was written (the
    /// claim's transaction fails with it): set the relay up first, then deliver the job again.
    #[error(
        "no logical replication slot of pgoutput exists in this database, so the messages this \
         job sends through the WAL would be lost: nothing was written. Run the WAL relay's \
         setup (`WalRelay::setup`, which makes its slot) before the first job, then deliver \
         the job again"
    )]
    NoSlot,

    /// The replication connection failed or ended: the server restarted, the network broke,
    /// another relay holds the slot. Nothing past the last confirmed position was confirmed:
    /// a relay started again replays from there, with the same ids.
    #[error(
        "the WAL relay's replication stream ended: {reason}; start the relay again (it replays from the slot's confirmed position)"
    )]
    Stream {
        /// What the replication client said.
        reason: String,
    },

    /// A message in the WAL under the store's prefix that is not a message of this idem's
    /// frame. The relay stops before it rather than confirm past a message it could not send.
    #[error(
        "the WAL relay read a message at {lsn} it cannot decode ({reason}); nothing past it \
         was confirmed"
    )]
    Frame {
        /// Its position in the WAL.
        lsn: String,
        /// What is wrong with it.
        reason: String,
    },
}
