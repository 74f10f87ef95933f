/// The Kafka consumer or producer could not go on (feature `kafka`): the client failed, or a
/// partition's watermark is past the end of its log. It reaches callers as
/// [`Error::Kafka`](crate::Error::Kafka); the variant says which, and its message what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// The Kafka client failed (feature `kafka`): a broker that cannot be reached, a
    /// subscription or commit refused. What it says comes from librdkafka.
    #[error("kafka: {reason}")]
    Client {
        /// librdkafka's description, with what idem was doing.
        reason: String,
    },

    /// The database's watermark of a partition is past the end of the partition's log: the
    /// topic was deleted and made again, or its log was truncated (a broker that lost its
    /// data). Records now in the log below the watermark would be taken for duplicates, so the
    /// Kafka consumer does not consume the partition; nothing was written.
    #[error(
        "the watermark of {group:?} on {topic:?} partition {partition} is {watermark}, past \
         the end of the partition's log ({log_end}): the topic was made again or its log lost \
         records, and its new records would be taken for duplicates; the partition is not \
         consumed. If the log was made anew, set the watermark to where its records start \
         (`Store::set_watermark`); nothing was written"
    )]
    WatermarkAhead {
        /// The consumer group.
        group: String,
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The next offset the database holds for it.
        watermark: i64,
        /// The partition's end (its high watermark): the offset of the next record it takes.
        log_end: i64,
    },
}
