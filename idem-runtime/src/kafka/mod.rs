//! Kafka consumers that process each record's effect once (feature `kafka`, on rdkafka).
//!
//! Two modes, one [`Consumer`]:
//!
//! - **Offset watermarks** ([`Consumer::watermarks`]): the database holds, per consumer group,
//!   topic and partition, the next offset to process, moved in the transaction of the
//!   records' effects ([`Store::claim_offsets`](crate::Store::claim_offsets)). A partition
//!   the consumer is given starts at its watermark; a record below it is a duplicate, with no
//!   marker per record. Offsets committed to Kafka are advisory (lag monitoring).
//! - **Per-message markers** ([`Consumer::markers`]): each record is a job keyed by an id its
//!   producer sets in a header ([`Record::id_key`]) or by its place in the log
//!   ([`Record::offset_key`]), claimed by any mode (an `#[idempotent]` handler). Partitions
//!   start at Kafka's committed offsets, which the application commits after its handlers
//!   ([`Consumer::commit`]). For topics where producers retry and one event lands at two
//!   offsets.
//!
//! The client is librdkafka (the `rdkafka` crate), polled on a thread of the consumer's own:
//! the rebalance callback, which reads the watermarks from the database, runs there, off the
//! async runtime. docs/kafka.md says which mode to choose, what a rebalance does, and what the
//! broker used in the tests (tansu) does differently from Apache Kafka.

mod claim;
mod context;
mod poller;
mod record;

use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::config::{ClientConfig, FromClientConfigAndContext as _};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::oneshot;

/// The rdkafka idem is built on: its `ClientConfig` is what [`Consumer`] takes, with no
/// dependency of your own.
pub use rdkafka;

pub use self::claim::Claim;
use self::claim::{Spans, spans};
pub use self::context::Unseen;
use self::context::{Context, Positions, Shared, kafka};
use self::poller::Command;
pub use self::record::Record;
use crate::backend::Backend;
use crate::error::{Error, KafkaError, Refusal};
use crate::group::Group;
use crate::observe::trace_context;
use crate::offsets::{OffsetGuard, RecordOffset, check_name};
use crate::store::Store;

/// A Kafka consumer in a consumer group whose records' effects are kept in `DB`.
///
/// Built from an rdkafka [`ClientConfig`] that names at least `bootstrap.servers` and
/// `group.id`. The consumer sets what its guarantees need: `enable.auto.commit=false` and
/// `enable.auto.offset.store=false` (it commits itself, after the database), and
/// `auto.offset.reset=error` (a position outside the log is reported, never silently moved to
/// the log's start or end, which would skip records or take new ones for duplicates). A
/// partition without a position starts as [`set_unseen`](Consumer::set_unseen) says
/// (default: the start of its log).
///
/// Every record [`next_batch`](Consumer::next_batch) hands out must be claimed
/// ([`claim`](Consumer::claim), whose end moves the partitions back when nothing was kept) or,
/// in the marker mode, handled and then committed ([`commit`](Consumer::commit)) or moved
/// back ([`rewind`](Consumer::rewind)): the next batch starts after the last one.
pub struct Consumer<DB: Backend> {
    base: Arc<BaseConsumer<Context<DB>>>,
    commands: Sender<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
    group: String,
    store: Store<DB>,
    /// The partitions of the claims committed since the last poll: their next offsets go to
    /// Kafka (advisory) with the next poll, one commit for many batches.
    committed: Mutex<Spans>,
}

impl<DB: Backend> std::fmt::Debug for Consumer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("group", &self.group)
            .field("positions", &self.base.context().positions)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Consumer<DB> {
    /// A consumer in the offset-watermark mode: each partition it is given starts at the
    /// database's watermark, and [`claim`](Consumer::claim) moves the watermark with the
    /// records' effects.
    ///
    /// Call it inside a tokio runtime (the rebalance callback runs the database's queries on
    /// it). Refused before any I/O: a configuration without `group.id`, or with one that is
    /// not a name of 1 to 255 bytes ([`Refusal::Offsets`]), or that rdkafka refuses
    /// ([`KafkaError::Client`]).
    pub fn watermarks(store: Store<DB>, config: &ClientConfig) -> Result<Self, Error> {
        Consumer::new(store, config, Positions::Watermarks)
    }

    /// A consumer for the per-message marker mode: each partition it is given starts at the
    /// group's offset committed to Kafka, and the application claims each record by its key
    /// in any mode, then commits the batch's offsets ([`commit`](Consumer::commit)).
    pub fn markers(store: Store<DB>, config: &ClientConfig) -> Result<Self, Error> {
        Consumer::new(store, config, Positions::Committed)
    }

    fn new(store: Store<DB>, config: &ClientConfig, positions: Positions) -> Result<Self, Error> {
        let group = config
            .get("group.id")
            .ok_or_else(|| {
                Error::Refused(Refusal::Offsets {
                    reason:
                        "the consumer's configuration has no `group.id`: name its consumer group"
                            .to_owned(),
                })
            })?
            .to_owned();
        check_name("consumer group", &group)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::Kafka(KafkaError::Client {
                reason:
                    "a Kafka consumer is made inside a tokio runtime, whose handle its rebalance \
                     callback uses"
                        .to_owned(),
            })
        })?;
        let mut config = config.clone();
        config
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "error");
        let context = Context {
            store: store.clone(),
            group: group.clone(),
            positions,
            unseen: Mutex::new(Unseen::default()),
            runtime,
            shared: Mutex::new(Shared::default()),
        };
        let base = BaseConsumer::from_config_and_context(&config, context)
            .map_err(|e| kafka("making the consumer", &e))?;
        let base = Arc::new(base);
        let (commands, received) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("idem-kafka-{group}"))
            .spawn({
                let base = base.clone();
                move || poller::run(base, received)
            })
            .map_err(|e| {
                Error::Kafka(KafkaError::Client {
                    reason: format!("starting the consumer's thread: {e}"),
                })
            })?;
        Ok(Consumer {
            base,
            commands,
            thread: Some(thread),
            group,
            store,
            committed: Mutex::new(Vec::new()),
        })
    }

    /// Where partitions without a position start from now on (default: the start of their
    /// log); set it before [`subscribe`](Consumer::subscribe).
    pub fn set_unseen(&self, unseen: Unseen) {
        *self
            .base
            .context()
            .unseen
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = unseen;
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The store the consumer keeps its watermarks in.
    pub fn store(&self) -> &Store<DB> {
        &self.store
    }

    /// Joins the group on `topics`; partitions come with the group's assignments.
    pub fn subscribe(&self, topics: &[&str]) -> Result<(), Error> {
        for topic in topics {
            check_name("topic", topic)?;
        }
        self.base
            .subscribe(topics)
            .map_err(|e| kafka("subscribing", &e))
    }

    /// How many assignments the group gave this consumer so far (a rebalance gives one).
    pub fn assignments(&self) -> u64 {
        self.base.context().lock().generation
    }

    /// The partitions this consumer holds now.
    pub fn assignment(&self) -> Result<Vec<(String, i32)>, Error> {
        let tpl = self
            .base
            .assignment()
            .map_err(|e| kafka("reading the assignment", &e))?;
        Ok(tpl
            .elements()
            .iter()
            .map(|e| (e.topic().to_owned(), e.partition()))
            .collect())
    }

    /// Up to `max` records, in the order of each partition's log, waiting at most `wait` for
    /// the first (an empty batch when none came).
    ///
    /// An error met since the last call comes first: a partition whose watermark is past its log's
    /// end ([`KafkaError::WatermarkAhead`]: it is not consumed), a watermark that could not be read
    /// ([`Error::Database`]: those partitions are not consumed until the next rebalance), a
    /// position outside the log or a broker that cannot be reached ([`KafkaError::Client`]).
    /// Cancelling the call loses nothing: records it polled are handed out by the next one.
    pub async fn next_batch(&mut self, max: usize, wait: Duration) -> Result<Vec<Record>, Error> {
        self.commit_claimed();
        let (reply, answer) = oneshot::channel();
        let max = max.max(1);
        self.send(Command::Poll { max, wait, reply })?;
        answer.await.map_err(|_| stopped())?
    }

    /// Claims `records` (a batch of [`next_batch`](Consumer::next_batch)) by their offsets,
    /// in the offset-watermark mode: [`Store::claim_offsets`](crate::Store::claim_offsets)
    /// for this consumer's group, and, when the claim ends, Kafka's commit or the partitions
    /// moved back (see [`Claim`]).
    ///
    /// The claim's `idem.claim` span links to the producer's span of each record that has a
    /// `traceparent` header ([`Record::traceparent`]; one link per distinct context); a header
    /// that does not parse is ignored (a `debug` event), never an error. A batch whose every
    /// record is a duplicate has ended its span before the consumer could link it, and links
    /// nothing.
    pub async fn claim(&mut self, records: &[Record]) -> Result<Claim<'_, DB>, Error> {
        let spans = spans(records);
        let at: Vec<RecordOffset<'_>> = records.iter().map(Record::at).collect();
        let answer = self.store.claim_offsets(&self.group, &at).await;
        self.answered(answer, records, spans)
    }

    /// [`claim`](Consumer::claim) in a savepoint of `group`'s open transaction
    /// ([`Group::claim_offsets`](crate::Group::claim_offsets)): consumers of one process (a
    /// consumer per partition, each in a task of its own) share one commit. The claim's end
    /// answers once the group committed; a group that failed as a whole is
    /// [`NotKept::Group`](crate::NotKept::Group), and the batch's partitions are moved back as for
    /// any claim that was not kept. `group` must be made on this consumer's store. Its span is
    /// linked to the records' producers as [`claim`](Consumer::claim)'s is.
    pub async fn claim_in(
        &mut self,
        group: &Group<DB>,
        records: &[Record],
    ) -> Result<Claim<'_, DB>, Error> {
        let spans = spans(records);
        let at: Vec<RecordOffset<'_>> = records.iter().map(Record::at).collect();
        let answer = group.claim_offsets(&self.group, &at).await;
        self.answered(answer, records, spans)
    }

    /// A claim's answer, whichever way it was made: its span linked to the records'
    /// producers, or the partitions moved back when nothing is held.
    fn answered(
        &mut self,
        answer: Result<OffsetGuard<DB>, Error>,
        records: &[Record],
        spans: Spans,
    ) -> Result<Claim<'_, DB>, Error> {
        match answer {
            Ok(guard) => {
                if let Some(span) = guard.span() {
                    link_records(span, records);
                }
                Ok(Claim::new(guard, self, spans))
            }
            Err(e) => {
                self.seek_back(&spans);
                Err(e)
            }
        }
    }

    /// Commits to Kafka, for each partition of `records`, the offset after its last record
    /// (asynchronously: the answer is not waited for). The position of the marker mode; in
    /// the offset-watermark mode the consumer does it with the poll after a claim committed,
    /// for lag monitoring only.
    pub fn commit(&self, records: &[Record]) -> Result<(), Error> {
        let tpl = next_offsets(&spans(records))?;
        if tpl.count() == 0 {
            return Ok(());
        }
        self.base
            .commit(&tpl, CommitMode::Async)
            .map_err(|e| kafka("committing offsets", &e))
    }

    /// Moves each partition of `records` back to its first record among them: the next batch
    /// brings them again (a handler failed; nothing of them was kept).
    pub async fn rewind(&mut self, records: &[Record]) -> Result<(), Error> {
        let to = spans(records)
            .into_iter()
            .map(|(t, p, first, _)| (t, p, first))
            .collect();
        let (reply, answer) = oneshot::channel();
        self.send(Command::Seek {
            to,
            reply: Some(reply),
        })?;
        answer.await.map_err(|_| stopped())?
    }

    /// Commits the offsets of the last claims to Kafka (advisory), leaves the group and stops
    /// the consumer's thread, waiting for all three.
    pub async fn close(mut self) {
        self.commit_claimed();
        let thread = self.thread.take();
        drop(self);
        if let Some(thread) = thread {
            drop(tokio::task::spawn_blocking(move || thread.join()).await);
        }
    }

    fn send(&self, command: Command) -> Result<(), Error> {
        self.commands.send(command).map_err(|_| stopped())
    }

    /// Notes a committed claim's partitions, for the advisory commit of the next poll.
    fn claimed(&self, spans: &Spans) {
        let mut committed = self.committed.lock().unwrap_or_else(|e| e.into_inner());
        for (topic, partition, first, last) in spans {
            match committed
                .iter_mut()
                .find(|(t, p, ..)| t == topic && p == partition)
            {
                Some(span) => span.3 = span.3.max(*last),
                None => committed.push((topic.clone(), *partition, *first, *last)),
            }
        }
    }

    /// The advisory commit of the claims committed since the last poll: an error only delays
    /// lag figures, and the next one covers it.
    fn commit_claimed(&self) {
        let spans = std::mem::take(&mut *self.committed.lock().unwrap_or_else(|e| e.into_inner()));
        if let Ok(tpl) = next_offsets(&spans)
            && tpl.count() > 0
        {
            drop(self.base.commit(&tpl, CommitMode::Async));
        }
    }

    /// Queues the move of each partition back to its first record among `spans`, ahead of
    /// any later request.
    fn seek_back(&self, spans: &Spans) {
        let to = spans
            .iter()
            .map(|(t, p, first, _)| (t.clone(), *p, *first))
            .collect();
        drop(self.send(Command::Seek { to, reply: None }));
    }
}

/// Links a batch's span to its records' producers, each distinct context once; only for a
/// span a subscriber wants, so that a consumer without one reads no header.
fn link_records(span: &tracing::Span, records: &[Record]) {
    if span.is_disabled() {
        return;
    }
    let mut seen = std::collections::HashSet::new();
    let producers: Vec<_> = records
        .iter()
        .filter_map(Record::traceparent)
        .filter(|parent| seen.insert(*parent))
        .collect();
    trace_context::link(span, &producers);
}

/// For each partition, the offset after its last record.
fn next_offsets(spans: &Spans) -> Result<TopicPartitionList, Error> {
    let mut tpl = TopicPartitionList::new();
    for (topic, partition, _, last) in spans {
        tpl.add_partition_offset(topic, *partition, Offset::Offset(last + 1))
            .map_err(|e| kafka("committing offsets", &e))?;
    }
    Ok(tpl)
}

fn stopped() -> Error {
    Error::Kafka(KafkaError::Client {
        reason: "the consumer's thread stopped (the client panicked)".to_owned(),
    })
}
