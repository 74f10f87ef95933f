//! How a relay learns of new outbox messages between its rounds.

/// A relay's subscription to the commits of new outbox messages.
pub enum Listen {
    /// `LISTEN` on the outbox table's channel, which each commit with messages notifies.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::postgres::PgListener),
}

impl Listen {
    /// Returns at the next announced commit, or after `poll`: a notification missed while
    /// the listener reconnected leaves its messages to the next round all the same.
    pub(crate) async fn wait(&mut self, poll: std::time::Duration) {
        #[cfg(feature = "postgres")]
        match self {
            Listen::Postgres(listener) => {
                if let Ok(Err(_)) = tokio::time::timeout(poll, listener.recv()).await {
                    // The database is unreachable: wait out the poll rather than spin.
                    tokio::time::sleep(poll).await;
                }
            }
        }
        #[cfg(not(feature = "postgres"))]
        {
            let _ = poll;
            match *self {}
        }
    }
}
