//! [`WalRelay::run`]: the slot's transactions read in commit order, their messages published
//! in batches, the slot confirmed past a transaction once every message of it and before it
//! is confirmed by the broker or written to the outbox table.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use pgwire_replication::{FeedbackObserver, Lsn, PgWireError, ReplicationClient, ReplicationEvent};

use super::WalRelay;
use crate::backend::postgres::wal_prefix;
use crate::error::{Error, WalError};
use crate::outgoing::frame::{self, Framed};
use crate::record::bounded;
use crate::relay::run::unless;
use crate::relay::{Publisher, waves};

/// How often the relay sends the outbox table's due rows while some key has rows there.
const TABLE_EVERY: Duration = Duration::from_secs(1);

/// One committed transaction's messages, and the WAL position past its commit.
struct Txn {
    end: Lsn,
    messages: Vec<Pending>,
}

/// A message not yet confirmed by the broker (nor written to the outbox table).
struct Pending {
    framed: Framed,
    done: bool,
}

/// A message for the outbox table, and its error if the broker refused it.
type Row<'a> = (&'a Framed, Option<&'a str>);

/// How a stream ended.
enum Ended {
    Stopped,
    /// The slot is streaming to another relay: this one waits to take over.
    Held(String),
}

impl<P: Publisher> WalRelay<P> {
    /// Relays until `stop` resolves: sets up ([`setup`](WalRelay::setup)), then streams from the
    /// slot, from the position last confirmed. While another relay streams from the slot, waits
    /// and tries again every [`standby`](WalRelay::standby). A replication stream that fails
    /// (the server restarted, the connection broke) ends it with [`WalError::Stream`]: restart
    /// it from your supervisor; it replays from the confirmed position. Stopped, it leaves the
    /// messages it had not confirmed to the next run, which publishes them again.
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<(), Error> {
        let mut stop = std::pin::pin!(stop);
        match unless(stop.as_mut(), self.setup()).await {
            None => return Ok(()),
            Some(set) => set?,
        }
        // Told of each standby status update, so that a stopped relay can wait for its last
        // confirmed position to reach the server before it ends the stream.
        let reported = std::sync::Arc::new(tokio::sync::Notify::new());
        let observer = {
            let reported = reported.clone();
            FeedbackObserver::new(move |_| reported.notify_one())
        };
        loop {
            let config = self
                .replication
                .clone()
                .with_feedback_observer(observer.clone());
            let connected = ReplicationClient::connect(config);
            let mut client = match unless(stop.as_mut(), connected).await {
                None => return Ok(()),
                Some(client) => client.map_err(stream_error)?,
            };
            let ended = self.stream(&mut client, stop.as_mut()).await;
            if matches!(ended, Ok(Ended::Stopped)) {
                // Its last confirmed position, sent within the status interval: otherwise the
                // next run would publish again what this one saw confirmed.
                let reported = async {
                    while client.feedback_pending_since().is_some() {
                        reported.notified().await;
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(1), reported).await;
            }
            close(client).await;
            match ended? {
                Ended::Stopped => return Ok(()),
                Ended::Held(by) => {
                    tracing::debug!(slot = %self.slot, %by, "slot held by another relay; waiting");
                    let wait = tokio::time::sleep(self.standby);
                    if unless(stop.as_mut(), wait).await.is_none() {
                        return Ok(());
                    }
                }
            }
        }
    }

    async fn stream(
        &self,
        client: &mut ReplicationClient,
        mut stop: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<Ended, Error> {
        let prefix = wal_prefix(self.store().sql().table.as_str());
        let mut state = State {
            queue: VecDeque::new(),
            open: None,
            held: 0,
            tabled: self.tabled_keys().await?,
            table_at: Instant::now(),
        };
        loop {
            // Wait for the stream only with nothing to publish now; while the table holds
            // messages, no longer than its next round.
            if state.held == 0 {
                let until = (!state.tabled.is_empty())
                    .then(|| tokio::time::Instant::from_std(state.table_at + TABLE_EVERY));
                let wait = async {
                    match until {
                        Some(until) => tokio::select! {
                            event = client.recv() => Some(event),
                            () = tokio::time::sleep_until(until) => None,
                        },
                        None => Some(client.recv().await),
                    }
                };
                match unless(stop.as_mut(), wait).await {
                    None => return Ok(Ended::Stopped),
                    Some(Some(event)) => {
                        if let Some(ended) = state.read(client, event, &prefix)? {
                            return Ok(ended);
                        }
                    }
                    Some(None) => {}
                }
            }
            // What else has arrived, while the batch has room.
            while state.held < self.batch {
                let Some(event) = client.recv().now_or_never() else {
                    break;
                };
                if let Some(ended) = state.read(client, event, &prefix)? {
                    return Ok(ended);
                }
            }
            let published = self.publish(&mut state);
            if unless(stop.as_mut(), published)
                .await
                .transpose()?
                .is_none()
            {
                return Ok(Ended::Stopped);
            }
            if let Some(end) = state.confirmable() {
                client.update_applied_lsn(end);
            }
            if !state.tabled.is_empty() && state.table_at.elapsed() >= TABLE_EVERY {
                // The table's due rows, round after round while they move (a backlog left by
                // a broker that was down), then its keys again.
                let drained = async {
                    while self.table.relay_once().await?.sent > 0 {}
                    self.tabled_keys().await
                };
                match unless(stop.as_mut(), drained).await {
                    None => return Ok(Ended::Stopped),
                    Some(tabled) => state.tabled = tabled?,
                }
                state.table_at = Instant::now();
            }
        }
    }

    /// One batch: the messages of the transactions in hand, in commit order, up to the batch,
    /// published in waves. Those of keys with rows in the outbox table are written there
    /// instead, behind them; a message the broker refused goes there too, with its attempt,
    /// its error and its backoff, and its key with it: the table's rounds retry it, park it
    /// after `max_attempts`, and keep its key's order, while the stream goes on.
    async fn publish(&self, state: &mut State) -> Result<(), Error> {
        let mut picked: Vec<(usize, usize)> = Vec::new();
        let mut to_table: Vec<(usize, usize)> = Vec::new();
        'txns: for (t, txn) in state.queue.iter().enumerate() {
            for (m, pending) in txn.messages.iter().enumerate() {
                if pending.done {
                    continue;
                }
                match state.tabled.contains(&pending.framed.message.ordering_key) {
                    true => to_table.push((t, m)),
                    false => picked.push((t, m)),
                }
            }
            if picked.len() >= self.batch {
                break 'txns;
            }
        }
        if !to_table.is_empty() {
            let rows: Vec<Row<'_>> = to_table
                .iter()
                .map(|&(t, m)| (&state.queue[t].messages[m].framed, None))
                .collect();
            self.to_table(&rows).await?;
            for (t, m) in to_table {
                state.finish(t, m);
            }
        }
        if picked.is_empty() {
            return Ok(());
        }
        let messages: Vec<_> = picked
            .iter()
            .map(|&(t, m)| state.queue[t].messages[m].framed.message.clone())
            .collect();
        let keys = waves::Keys::of(&messages);
        let mut round = waves::Round::new(messages);
        round.publish(&self.table.publisher, &keys).await;
        let mut failed: Vec<(usize, usize, String)> = Vec::new();
        for (at, answer) in round.answers(&keys) {
            let (t, m) = picked[at];
            match answer {
                waves::Answer::Published => state.finish(t, m),
                // Its key's earlier message failed: it follows it to the table, next batch.
                waves::Answer::Waiting | waves::Answer::Left => {}
                waves::Answer::Failed(e) => {
                    let error = e.to_string();
                    let message = &state.queue[t].messages[m].framed.message;
                    tracing::warn!(id = %message.id, %error,
                        "the WAL relay could not publish a message; the outbox table's rounds retry it");
                    failed.push((t, m, bounded(&error, super::super::ERROR_TEXT).into()));
                }
            }
        }
        if !failed.is_empty() {
            let rows: Vec<Row<'_>> = failed
                .iter()
                .map(|(t, m, error)| (&state.queue[*t].messages[*m].framed, Some(error.as_str())))
                .collect();
            self.to_table(&rows).await?;
            for (t, m, _) in failed {
                let key = state.queue[t].messages[m]
                    .framed
                    .message
                    .ordering_key
                    .clone();
                state.tabled.insert(key);
                state.finish(t, m);
            }
            state.table_at = Instant::now();
        }
        Ok(())
    }

    /// Writes `rows` to the outbox table, in their order, in one transaction, each after
    /// every row of its key already there: one that failed (with its error) as a failed
    /// attempt, due again after the backoff (parked at once with `max_attempts(1)`), the others
    /// pending, behind their key's.
    async fn to_table(&self, rows: &[Row<'_>]) -> Result<(), Error> {
        let table = self.store().sql().table.as_str();
        let insert = format!(
            "INSERT INTO {table}_outbox (id, destination, payload, scope, key, seq, \
             ordering_key, headers, attempts, last_error, parked, next_attempt_at, created_at) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, \
             now() + $12 * interval '1 millisecond', \
             GREATEST(clock_timestamp(), (SELECT max(created_at) + interval '1 microsecond' \
             FROM {table}_outbox WHERE ordering_key = $7 AND sent_at IS NULL)) \
             ON CONFLICT (id) DO NOTHING"
        );
        let backoff = i64::try_from(self.table.backoff.as_millis()).unwrap_or(i64::MAX);
        let mut tx = self.store().pool().begin().await?;
        for (framed, error) in rows {
            let m = &framed.message;
            let attempts = i64::from(error.is_some());
            let park = error.is_some() && self.table.max_attempts <= 1;
            sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
                .bind(&m.id)
                .bind(&m.destination)
                .bind(&m.payload)
                .bind(&framed.scope)
                .bind(&framed.key)
                .bind(i64::from(m.seq))
                .bind(&m.ordering_key)
                .bind(m.headers.to_json())
                .bind(attempts)
                .bind(*error)
                .bind(park)
                .bind(if error.is_some() { backoff } else { 0 })
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The ordering keys with unsent rows in the outbox table: their messages from the WAL go
    /// there too, behind them.
    async fn tabled_keys(&self) -> Result<HashSet<String>, Error> {
        let table = self.store().sql().table.as_str();
        let keys: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT DISTINCT COALESCE(ordering_key, key) FROM {table}_outbox \
             WHERE sent_at IS NULL"
        )))
        .fetch_all(self.store().pool())
        .await?;
        Ok(keys.into_iter().collect())
    }
}

/// What a stream has in hand.
struct State {
    /// Committed transactions not yet confirmed, in commit order.
    queue: VecDeque<Txn>,
    /// The messages of the transaction being read.
    open: Option<Vec<Pending>>,
    /// How many messages of `queue` are not done.
    held: usize,
    /// Keys with unsent rows in the outbox table.
    tabled: HashSet<String>,
    table_at: Instant,
}

impl State {
    /// Takes in one event; a stream's end, if it ended.
    fn read(
        &mut self,
        client: &ReplicationClient,
        event: Result<Option<ReplicationEvent>, PgWireError>,
        prefix: &str,
    ) -> Result<Option<Ended>, Error> {
        let event = match event {
            Ok(Some(event)) => event,
            // The relay asks its client to stop only after the stream ended: this end is the
            // server's (a shutdown), and the supervisor's restart replays from the slot.
            Ok(None) => {
                return Err(Error::Wal(WalError::Stream {
                    reason: "the server ended the replication stream".to_owned(),
                }));
            }
            Err(e) => {
                let text = e.to_string();
                // 55006, object_in_use: "replication slot .. is active for PID ..".
                if text.contains("is active for PID") {
                    return Ok(Some(Ended::Held(text)));
                }
                return Err(stream_error(e));
            }
        };
        match event {
            ReplicationEvent::Begin { .. } => self.open = Some(Vec::new()),
            ReplicationEvent::Message {
                transactional: true,
                lsn,
                prefix: of,
                content,
            } if of == prefix => {
                let framed = frame::decode(&content).map_err(|reason| {
                    Error::Wal(WalError::Frame {
                        lsn: lsn.to_string(),
                        reason,
                    })
                })?;
                self.open.get_or_insert_default().push(Pending {
                    framed,
                    done: false,
                });
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                let messages = self.open.take().unwrap_or_default();
                if messages.is_empty() && self.queue.is_empty() {
                    client.update_applied_lsn(end_lsn);
                } else {
                    self.held += messages.len();
                    self.queue.push_back(Txn {
                        end: end_lsn,
                        messages,
                    });
                }
            }
            // Everything before the server's position was sent: with nothing in hand, it is
            // all confirmed (the WAL of other databases and of transactions without
            // messages, which pgoutput does not send).
            ReplicationEvent::KeepAlive { wal_end, .. }
                if self.queue.is_empty() && self.open.is_none() =>
            {
                client.update_applied_lsn(wal_end);
            }
            _ => {}
        }
        Ok(None)
    }

    fn finish(&mut self, t: usize, m: usize) {
        let pending = &mut self.queue[t].messages[m];
        if !pending.done {
            pending.done = true;
            self.held -= 1;
        }
    }

    /// Drops the transactions at the front whose messages are all done; the end of the last
    /// one dropped, to confirm.
    fn confirmable(&mut self) -> Option<Lsn> {
        let mut end = None;
        while self
            .queue
            .front()
            .is_some_and(|txn| txn.messages.iter().all(|p| p.done))
        {
            end = self.queue.pop_front().map(|txn| txn.end);
        }
        end
    }
}

/// Ends the replication connection, so that the slot is free for the next relay at once: a
/// graceful stop, which drains the events the client still buffers (its worker waits for room
/// before it sees the stop), bounded; then a hard one.
async fn close(mut client: ReplicationClient) {
    let graceful = tokio::time::timeout(Duration::from_secs(2), client.shutdown()).await;
    if graceful.is_err() {
        client.abort();
    }
}

fn stream_error(e: PgWireError) -> Error {
    Error::Wal(WalError::Stream {
        reason: e.to_string(),
    })
}
