//! The `kafka_worker` example against a real Kafka-protocol broker (`IDEM_KAFKA_URL`, tansu in
//! CI), and its worker loop in processes of one consumer group that are SIGKILLed at chosen
//! points, on PostgreSQL. Every effect is a row in a table without a unique index, so an
//! effect applied twice shows.

#[allow(dead_code)]
#[path = "../kafka_worker.rs"]
mod kafka_worker;

mod common;

use std::time::Duration;

use common::support::{Line, Lines, within};
use common::{World, child_main};
use idem_example_kafka::{Mode, kafka_url};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::{Offset, TopicPartitionList};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that the tests start themselves"]
async fn child_process() {
    child_main().await;
}

/// Reads lines until one of worker `index` starts with `prefix`, within `secs` in all.
async fn expect_from(lines: &mut Lines, index: usize, prefix: &str, secs: u64) -> Line {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let line = lines.next(left.as_secs().max(1)).await;
        if line.0 == index && line.1.starts_with(prefix) {
            return line;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker {index} printed no {prefix:?} within {secs} s; so far:\n{}",
            lines.dump()
        );
    }
}

/// `partition:offset` pairs of the lines of worker `index` that start with `prefix`.
fn records_seen(lines: &Lines, index: usize, prefix: &str) -> Vec<(i32, i64)> {
    lines
        .seen
        .iter()
        .filter(|(i, l)| *i == index && l.starts_with(prefix))
        .map(|(_, l)| {
            let at = l.rsplit(' ').next().unwrap();
            let (p, o) = at.split_once(':').unwrap();
            (p.parse().unwrap(), o.parse().unwrap())
        })
        .collect()
}

/// The `partition:offset` pairs of a `BATCH` line.
fn batch_of(line: &str) -> Vec<(i32, i64)> {
    line.trim_start_matches("BATCH ")
        .split(',')
        .map(|at| {
            let (p, o) = at.split_once(':').unwrap();
            (p.parse().unwrap(), o.parse().unwrap())
        })
        .collect()
}

/// The offsets the group committed to Kafka for `partitions` of the world's topic.
fn kafka_committed(world: &World, partitions: i32) -> Vec<Offset> {
    let consumer: BaseConsumer = idem_example_kafka::config(&world.url, Some(&world.group))
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(&world.topic, p);
    }
    let got = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .unwrap();
    got.elements().iter().map(|e| e.offset()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn example_applies_each_job_once_in_both_modes() {
    let dir = std::env::temp_dir().join(common::unique("idem-kafka-example"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    let report = within(
        180,
        "the kafka_worker example",
        kafka_worker::run(&kafka_url(), &dir.join("jobs.db"), &mut out),
    )
    .await;
    std::fs::remove_dir_all(&dir).unwrap();
    let text = String::from_utf8(out).unwrap();
    let report = report.unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(report.watermark_effects, report.watermark_jobs as i64, "{text}");
    assert_eq!(report.marker_effects, report.marker_jobs as i64, "{text}");
    assert_eq!(report.marker_duplicates, report.marker_jobs, "{text}");
}

/// Worker 0 commits its first batch and is SIGKILLed before Kafka's offset commit (it holds
/// there); worker 1 of the same group takes its partitions over.
async fn killed_between_the_database_commit_and_the_offset_commit(mode: Mode) -> (World, Lines, Vec<(i32, i64)>) {
    let world = World::new(&kafka_url(), 2).await;
    world.produce("job", 20).await;
    let mut lines = Lines::new();
    let gate = world.dir.join("gate");
    let hold = format!("after:{}", gate.display());
    let a = world.spawn(0, &world.child_env(mode, 4, Some(&hold), None), &lines);
    let batch = expect_from(&mut lines, 0, "BATCH", 60).await.1;
    let committed = batch_of(&batch);
    expect_from(&mut lines, 0, "COMMITTED", 60).await;
    a.kill().await;
    // Nothing reached Kafka: the group's offsets are where they started.
    let kafka = kafka_committed(&world, 2);
    assert!(
        kafka.iter().all(|o| !matches!(o, Offset::Offset(n) if *n > 0)),
        "the killed worker committed offsets to Kafka: {kafka:?}"
    );
    let b = world.spawn(1, &world.child_env(mode, 4, None, None), &lines);
    world.until_effects(20, &mut lines).await;
    let mut b = b;
    b.stop().await;
    expect_from(&mut lines, 1, "STOPPED", 60).await;
    b.succeed().await;
    assert_eq!(world.not_once().await, [], "{}", lines.dump());
    assert_eq!(world.effects().await, 20);
    (world, lines, committed)
}

#[tokio::test(flavor = "multi_thread")]
async fn watermarks_worker_killed_after_its_commit_is_followed_from_the_watermark() {
    let (world, lines, committed) =
        killed_between_the_database_commit_and_the_offset_commit(Mode::Watermarks).await;
    // The group's new member started each partition at its watermark: the committed batch
    // was not read again, and nothing was a duplicate.
    let seen = records_seen(&lines, 1, "APPLIED");
    assert!(
        committed.iter().all(|r| !seen.contains(r)),
        "worker 1 read records worker 0 had committed: {committed:?}\n{}",
        lines.dump()
    );
    assert_eq!(records_seen(&lines, 1, "DUPLICATE"), [], "{}", lines.dump());
    assert_eq!(seen.len() + committed.len(), 20, "{}", lines.dump());
    let marks = world.store.watermarks(&world.group, &world.topic).await.unwrap();
    let total: i64 = marks.iter().map(|(_, next)| next).sum();
    assert_eq!(total, 20, "each partition's watermark is past its last record: {marks:?}");
    world.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn markers_worker_killed_after_its_commit_has_its_records_redelivered_as_duplicates() {
    let (world, lines, committed) =
        killed_between_the_database_commit_and_the_offset_commit(Mode::Markers).await;
    // Kafka's offsets had not moved: the new member read the committed batch again, and the
    // markers made each of its records a duplicate.
    let mut dup = records_seen(&lines, 1, "DUPLICATE");
    dup.sort_unstable();
    let mut committed = committed;
    committed.sort_unstable();
    assert_eq!(dup, committed, "{}", lines.dump());
    world.cleanup().await;
}

/// Worker 0 holds its batch's transaction open; worker 1 joins the group, and the rebalance
/// gives it the partition (static membership: its `group.instance.id` sorts first). It starts
/// at the stored watermark (none committed yet), reads the same records, and its claim waits
/// for worker 0's transaction (shown in `pg_stat_activity`); once worker 0 commits, worker 1's
/// records are duplicates and it goes on with the next ones.
#[tokio::test(flavor = "multi_thread")]
async fn rebalance_with_a_batch_in_flight_applies_every_record_once() {
    let world = World::new(&kafka_url(), 1).await;
    world.produce("early", 10).await;
    let mut lines = Lines::new();
    let gate = world.dir.join("gate");
    let hold = format!("before:{}", gate.display());
    let env_a = world.child_env(Mode::Watermarks, 100, Some(&hold), Some("member-2"));
    let mut a = world.spawn(0, &env_a, &lines);
    expect_from(&mut lines, 0, "HOLDING", 60).await;
    let env_b = world.child_env(Mode::Watermarks, 100, None, Some("member-1"));
    let mut b = world.spawn(1, &env_b, &lines);
    // Worker 1's claim of the same records waits on the watermark's row, which worker 0's
    // transaction wrote: the two batches overlap.
    let waiting = format!(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%{}_offsets%'",
        world.markers
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(waiting.clone()))
            .fetch_one(&world.pool)
            .await
            .unwrap();
        if n > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker 1's claim never waited for worker 0's batch:\n{}",
            lines.dump()
        );
        drop(lines.next_or_quiet(Duration::from_millis(100)).await);
    }
    std::fs::write(&gate, b"").unwrap();
    world.until_effects(10, &mut lines).await;
    // The partition is worker 1's now: what comes next is its to apply.
    world.produce("late", 5).await;
    world.until_effects(15, &mut lines).await;
    for w in [&mut a, &mut b] {
        w.stop().await;
    }
    let mut stopped = 0;
    while stopped < 2 {
        stopped += usize::from(lines.next(60).await.1 == "STOPPED");
    }
    a.succeed().await;
    b.succeed().await;
    assert_eq!(world.not_once().await, [], "{}", lines.dump());
    assert_eq!(records_seen(&lines, 0, "APPLIED").len(), 10, "{}", lines.dump());
    assert_eq!(records_seen(&lines, 1, "DUPLICATE").len(), 10, "{}", lines.dump());
    assert_eq!(records_seen(&lines, 1, "APPLIED").len(), 5, "{}", lines.dump());
    world.cleanup().await;
}
