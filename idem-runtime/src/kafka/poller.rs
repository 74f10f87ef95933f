//! The consumer's thread: the only one that polls the client, so that the rebalance callback,
//! which reads the database, runs off the async runtime's threads. It hands records out on
//! request and keeps polling between requests, so that a rebalance proceeds while the
//! application is inside a batch. At [`BUFFER`] records ahead it pauses the fetch of its
//! partitions instead of stopping the poll (the group's protocol, revocations and assignments,
//! runs in the poll), and resumes it once the application took half of them; a seek drops
//! what it buffered of the partitions it moves.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::oneshot;

use super::context::{Context, kafka};
use super::record::Record;
use crate::backend::Backend;
use crate::error::Error;

/// Records polled ahead of the application's requests at which the fetch pauses (a few more
/// may come: the fetches of partitions assigned meanwhile, until the next poll pauses them).
pub(crate) const BUFFER: usize = 1_000;

/// How often the thread polls while no request is waiting.
const IDLE: Duration = Duration::from_millis(50);

/// What the consumer asks of its thread.
pub(crate) enum Command {
    /// Up to `max` records, waiting at most `wait` for the first.
    Poll {
        max: usize,
        wait: Duration,
        reply: oneshot::Sender<Result<Vec<Record>, Error>>,
    },
    /// Moves each partition to its offset (the records of a batch that failed, again).
    Seek {
        to: Vec<(String, i32, i64)>,
        reply: Option<oneshot::Sender<Result<(), Error>>>,
    },
}

/// Runs until the consumer is dropped (its end of the channel closes).
pub(crate) fn run<DB: Backend>(base: Arc<BaseConsumer<Context<DB>>>, commands: Receiver<Command>) {
    let mut poller = Poller {
        base,
        buffered: VecDeque::new(),
        paused: false,
    };
    loop {
        match commands.recv_timeout(IDLE) {
            Ok(Command::Poll { max, wait, reply }) => {
                let answer = poller.records(max, wait);
                // The caller went away (a cancelled future): what it would have got comes
                // first next time, so that no record is skipped.
                if let Err(Ok(records)) = reply.send(answer) {
                    for record in records.into_iter().rev() {
                        poller.buffered.push_front(Ok(record));
                    }
                }
            }
            Ok(Command::Seek { to, reply }) => {
                let answer = poller.seek(&to);
                if let Some(reply) = reply {
                    drop(reply.send(answer));
                }
            }
            Err(RecvTimeoutError::Timeout) => poller.fill(Duration::ZERO),
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

struct Poller<DB: Backend> {
    base: Arc<BaseConsumer<Context<DB>>>,
    buffered: VecDeque<Result<Record, Error>>,
    /// Whether the fetch of the assigned partitions is paused (the buffer was full).
    paused: bool,
}

impl<DB: Backend> Poller<DB> {
    /// Polls once for up to `wait`, and on while records come at once; a full buffer pauses
    /// the fetch (and the poll waits no more), so that the poll goes on serving the group.
    /// Drops what it holds of partitions revoked meanwhile.
    fn fill(&mut self, wait: Duration) {
        let mut wait = wait;
        loop {
            let full = self.buffered.len() >= BUFFER;
            if full {
                // On every fill: a partition assigned meanwhile fetches until paused.
                self.fetch_paused(true);
                wait = Duration::ZERO;
            }
            match self.base.poll(wait) {
                Some(Ok(message)) => self.buffered.push_back(Ok(Record::of(&message))),
                Some(Err(e)) => self.buffered.push_back(Err(polled(&e))),
                None => break,
            }
            // Full: one poll serves the group's protocol; the next fill comes within `IDLE`.
            if full {
                break;
            }
            wait = Duration::ZERO;
        }
        let revoked = std::mem::take(&mut self.base.context().lock().revoked);
        if !revoked.is_empty() {
            self.buffered.retain(|r| match r {
                Ok(r) => !revoked
                    .iter()
                    .any(|(t, p)| t == r.topic() && *p == r.partition()),
                Err(_) => true,
            });
        }
        if self.buffered.len() < BUFFER / 2 {
            self.fetch_paused(false);
        }
    }

    /// Pauses (`true`) or resumes the fetch of every assigned partition. librdkafka drops
    /// what it fetched ahead of a paused partition and, on resume, fetches from the record
    /// after the last one polled (or from where a seek or an assignment put the partition).
    fn fetch_paused(&mut self, pause: bool) {
        if !pause && !self.paused {
            return;
        }
        let done = self.base.assignment().and_then(|assigned| match pause {
            true => self.base.pause(&assigned),
            false => self.base.resume(&assigned),
        });
        match done {
            Ok(()) => self.paused = pause,
            Err(e) => {
                let doing = if pause { "pausing" } else { "resuming" };
                let e = kafka(&format!("{doing} the fetch"), &e);
                self.buffered.push_back(Err(e));
            }
        }
    }

    /// Up to `max` records, in the order they came; an error the client or the rebalance
    /// callback met comes first, alone.
    fn records(&mut self, max: usize, wait: Duration) -> Result<Vec<Record>, Error> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(e) = self.pending_error() {
                return Err(e);
            }
            if self.buffered.is_empty() {
                self.fill(deadline.saturating_duration_since(Instant::now()));
            } else {
                self.fill(Duration::ZERO);
            }
            if let Some(e) = self.pending_error() {
                return Err(e);
            }
            if !self.buffered.is_empty() || Instant::now() >= deadline {
                break;
            }
        }
        let mut out = Vec::new();
        while out.len() < max {
            match self.buffered.front() {
                Some(Ok(_)) => {
                    if let Some(Ok(record)) = self.buffered.pop_front() {
                        out.push(record);
                    }
                }
                // An error waits for the next call, after the records before it.
                Some(Err(_)) | None => break,
            }
        }
        if out.is_empty()
            && let Some(Err(e)) = self.buffered.pop_front()
        {
            return Err(e);
        }
        Ok(out)
    }

    fn pending_error(&self) -> Option<Error> {
        let mut shared = self.base.context().lock();
        match shared.errors.is_empty() {
            true => None,
            false => Some(shared.errors.remove(0)),
        }
    }

    /// Moves each partition to its offset and drops the records buffered of it: they were
    /// fetched from the old position.
    fn seek(&mut self, to: &[(String, i32, i64)]) -> Result<(), Error> {
        self.buffered.retain(|r| match r {
            Ok(r) => !to
                .iter()
                .any(|(t, p, _)| t == r.topic() && *p == r.partition()),
            Err(_) => true,
        });
        // A seek is the move of a fetching partition: a paused one fetches first (the next
        // fill pauses it again, from the sought position, if the buffer is still full).
        self.fetch_paused(false);
        let mut tpl = TopicPartitionList::new();
        for (topic, partition, offset) in to {
            tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset))
                .map_err(|e| kafka("seeking back", &e))?;
        }
        let sought = self
            .base
            .seek_partitions(tpl, Duration::from_secs(10))
            .map_err(|e| kafka("seeking back", &e))?;
        for e in sought.elements() {
            // A partition this consumer no longer holds (revoked meanwhile) cannot be moved,
            // and needs not be: its new holder starts at the watermark.
            if let Err(err) = e.error()
                && !matches!(err, KafkaError::Seek(_) | KafkaError::OffsetFetch(_))
                && err.rdkafka_error_code() != Some(RDKafkaErrorCode::State)
            {
                return Err(kafka("seeking back", &err));
            }
        }
        Ok(())
    }
}

/// An error the client reported while polling.
fn polled(e: &KafkaError) -> Error {
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::AutoOffsetReset) => Error::Kafka(crate::KafkaError::Client {
            reason: format!(
                "a partition's position is outside its log ({e}): its records from there were \
                 deleted (retention) or its log was made anew; the consumer resets no position \
                 by itself, so nothing is skipped: set the watermark where the log now starts \
                 (`Store::set_watermark`) once you know what was lost"
            ),
        }),
        _ => kafka("polling", e),
    }
}
