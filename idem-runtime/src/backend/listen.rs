//! How a relay learns of new outbox messages committed by other processes between its rounds.

/// A relay's subscription to the announced commits of new outbox messages.
pub enum Listen {
    /// The database announces no commits: the relay polls, and hears only its own store's.
    Polled,
    /// `LISTEN` on the outbox table's channel, on which the stores announce their commits of
    /// messages (`backend/wake.rs`), and joined claims theirs.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::postgres::PgListener),
}

impl Listen {
    /// Returns at the next announcement that is not `own`'s: the store's own commits woke its
    /// relays in the process already. An error means the listener's connection failed; it
    /// reconnects at the next call, and a notification missed meanwhile leaves its messages
    /// to the next round all the same. [`Listen::Polled`] never returns.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) async fn next(&mut self, own: &str) -> Result<(), sqlx::Error> {
        match self {
            Listen::Polled => std::future::pending().await,
            #[cfg(feature = "postgres")]
            Listen::Postgres(listener) => loop {
                if listener.recv().await?.payload() != own {
                    return Ok(());
                }
            },
        }
    }
}
