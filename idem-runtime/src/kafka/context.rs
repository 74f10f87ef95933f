//! The consumer's rebalance callback: on an assignment, each partition starts where the
//! database says (its watermark) or where Kafka's committed offset says (the marker mode),
//! never where the client happens to be; on a revocation, what the consumer still buffers of
//! those partitions is dropped.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::backend::Backend;
use crate::error::Error;
use crate::store::Store;

/// How long a call to the broker made while positioning (a log's end, committed offsets) may
/// take.
const BROKER_CALL: Duration = Duration::from_secs(10);

/// Where a partition starts when the consumer is given it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Positions {
    /// At the database's watermark (the offset-watermark mode).
    Watermarks,
    /// At Kafka's committed offset (the per-message marker mode).
    Committed,
}

/// Where a partition that has no position yet starts: no watermark in the database (the
/// offset-watermark mode) or no offset committed to Kafka (the marker mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Unseen {
    /// At the start of its log: nothing is skipped (the default).
    #[default]
    Earliest,
    /// At the end of its log: only records produced from now on.
    Latest,
    /// At the consumer group's offset committed to Kafka, or the start of the log without
    /// one: for a group that consumed with Kafka's offsets and moves to watermarks. The marker
    /// mode starts there anyway.
    Committed,
}

/// What the callback shares with the consumer.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Errors met while positioning, for the consumer's next call to report.
    pub(crate) errors: Vec<Error>,
    /// Partitions revoked since the consumer last looked.
    pub(crate) revoked: Vec<(String, i32)>,
    /// How many assignments the consumer was given.
    pub(crate) generation: u64,
}

/// The consumer's context: the store the watermarks are in, and how partitions start.
pub(crate) struct Context<DB: Backend> {
    pub(crate) store: Store<DB>,
    pub(crate) group: String,
    pub(crate) positions: Positions,
    pub(crate) unseen: Mutex<Unseen>,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) shared: Mutex<Shared>,
}

impl<DB: Backend> ClientContext for Context<DB> {}

impl<DB: Backend> ConsumerContext for Context<DB> {
    fn rebalance(
        &self,
        base: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(base.rebalance_protocol(), RebalanceProtocol::Cooperative);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let positioned = self.position(base, tpl);
                // A partition keeps its pause through a revocation and a new assignment:
                // an assigned partition fetches, and the poller pauses it again while its
                // buffer is full.
                let assigned = match cooperative {
                    true => base.incremental_assign(&positioned),
                    false => base.assign(&positioned),
                }
                .and_then(|()| base.resume(&positioned));
                let mut shared = self.lock();
                shared.generation += 1;
                if let Err(e) = assigned {
                    shared.errors.push(kafka("assigning the partitions", &e));
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let revoked = tpl
                    .elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition()))
                    .collect::<Vec<_>>();
                let unassigned = match cooperative {
                    true => base.incremental_unassign(tpl),
                    false => base.unassign(),
                };
                let mut shared = self.lock();
                shared.revoked.extend(revoked);
                if let Err(e) = unassigned {
                    shared.errors.push(kafka("giving the partitions up", &e));
                }
            }
            other => {
                // librdkafka's own advice for an error in the callback: give everything up,
                // and let the group assign again.
                drop(base.unassign());
                let error = KafkaError::Rebalance(other.into());
                self.lock().errors.push(kafka("rebalancing", &error));
            }
        }
    }
}

impl<DB: Backend> Context<DB> {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The partitions of `tpl`, each with the offset it starts at; those that cannot be
    /// positioned are left out, and why is kept for the consumer to report.
    fn position(&self, base: &BaseConsumer<Self>, tpl: &TopicPartitionList) -> TopicPartitionList {
        let mut out = TopicPartitionList::new();
        let stored = match self.stored(base, tpl) {
            Ok(stored) => stored,
            Err(e) => {
                self.lock().errors.push(e);
                return out;
            }
        };
        for element in tpl.elements() {
            let (topic, partition) = (element.topic(), element.partition());
            let offset = match stored.get(&(topic.to_owned(), partition)) {
                Some(&next) => match self.check_log_end(base, topic, partition, next) {
                    Ok(()) => Offset::Offset(next),
                    Err(e) => {
                        self.lock().errors.push(e);
                        continue;
                    }
                },
                None => match *self.unseen.lock().unwrap_or_else(|e| e.into_inner()) {
                    Unseen::Earliest => Offset::Beginning,
                    Unseen::Latest => Offset::End,
                    Unseen::Committed => match committed(base, topic, partition) {
                        Ok(Some(next)) => Offset::Offset(next),
                        Ok(None) => Offset::Beginning,
                        Err(e) => {
                            self.lock().errors.push(e);
                            continue;
                        }
                    },
                },
            };
            // Adding to a list of our own cannot fail but for a bad offset, which these are not.
            drop(out.add_partition_offset(topic, partition, offset));
        }
        out
    }

    /// The positions stored for the partitions of `tpl`: the database's watermarks, or the
    /// offsets committed to Kafka.
    fn stored(
        &self,
        base: &BaseConsumer<Self>,
        tpl: &TopicPartitionList,
    ) -> Result<HashMap<(String, i32), i64>, Error> {
        let mut stored = HashMap::new();
        match self.positions {
            Positions::Watermarks => {
                let elements = tpl.elements();
                let mut topics: Vec<&str> = elements.iter().map(|e| e.topic()).collect();
                topics.sort_unstable();
                topics.dedup();
                for topic in topics {
                    // The callback runs on the consumer's own thread, never on the runtime's:
                    // blocking it on the query is what the client expects of a callback.
                    let read = self
                        .runtime
                        .block_on(self.store.watermarks(&self.group, topic));
                    for (partition, next) in read? {
                        stored.insert((topic.to_owned(), partition), next);
                    }
                }
            }
            Positions::Committed => {
                let committed = base
                    .committed_offsets(tpl.clone(), BROKER_CALL)
                    .map_err(|e| kafka("reading the committed offsets", &e))?;
                for e in committed.elements() {
                    if let Offset::Offset(next) = e.offset() {
                        stored.insert((e.topic().to_owned(), e.partition()), next);
                    }
                }
            }
        }
        Ok(stored)
    }

    /// Refuses a watermark past the end of the partition's log: the topic was made anew or
    /// lost records, and its records below the watermark would pass for duplicates.
    fn check_log_end(
        &self,
        base: &BaseConsumer<Self>,
        topic: &str,
        partition: i32,
        next: i64,
    ) -> Result<(), Error> {
        if self.positions != Positions::Watermarks {
            return Ok(());
        }
        let (_, end) = base
            .fetch_watermarks(topic, partition, BROKER_CALL)
            .map_err(|e| kafka("reading the end of a partition's log", &e))?;
        if next > end {
            return Err(Error::Kafka(crate::KafkaError::WatermarkAhead {
                group: self.group.clone(),
                topic: topic.to_owned(),
                partition,
                watermark: next,
                log_end: end,
            }));
        }
        Ok(())
    }
}

/// The group's offset committed to Kafka for one partition, if it has one.
fn committed<C: ConsumerContext>(
    base: &BaseConsumer<C>,
    topic: &str,
    partition: i32,
) -> Result<Option<i64>, Error> {
    let mut one = TopicPartitionList::new();
    one.add_partition(topic, partition);
    let got = base
        .committed_offsets(one, BROKER_CALL)
        .map_err(|e| kafka("reading the committed offsets", &e))?;
    Ok(got.elements().first().and_then(|e| match e.offset() {
        Offset::Offset(next) => Some(next),
        _ => None,
    }))
}

/// A client error, said with what the consumer was doing.
pub(crate) fn kafka(doing: &str, e: &KafkaError) -> Error {
    Error::Kafka(crate::KafkaError::Client {
        reason: format!("{doing}: {e}"),
    })
}
