//! 2,000 jobs sent twice each through three worker processes of the `sqs_worker` loop (batch
//! handler, PostgreSQL), SIGKILLed on a schedule drawn from a printed seed and replaced. At the
//! end every job's effect is in exactly once and the queue and its dead-letter queue are empty.

mod common;

use std::time::{Duration, Instant};

use common::support::{Lines, Worker, postgres, within};
use common::{Names, job, sqs};
use idem_example_sqs::send_jobs;
use sqlx::AssertSqlSafe;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that the tests start themselves"]
async fn child_process() {
    common::child_main().await;
}

/// xorshift64*: enough to draw a kill schedule that a printed seed replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// What the workers told, counted from their lines.
#[derive(Default, Debug)]
struct Counts {
    received: u64,
    redelivered: u64,
    duplicates: u64,
    deleted: u64,
    retried: u64,
}

impl Counts {
    fn add(&mut self, line: &str) {
        if let Some(rest) = line.strip_prefix("RECEIVED ") {
            self.received += 1;
            self.redelivered += u64::from(!rest.ends_with(" count=1"));
        } else if line.starts_with("HANDLED duplicate") {
            // Told before the delete: a kill can repeat it, never lose it.
            self.duplicates += 1;
        } else if line.starts_with("DELETED") {
            self.deleted += 1;
        } else if line.starts_with("RETRY") {
            self.retried += 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn soak_three_workers_killed_repeatedly_apply_every_job_once() {
    const JOBS: i64 = 2_000;
    const WORKERS: usize = 3;
    const MAX_KILLS: u64 = 12;
    let started = Instant::now();
    let seed = match std::env::var("IDEM_SQS_SOAK_SEED") {
        Ok(s) => s.parse().expect("IDEM_SQS_SOAK_SEED is a number"),
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        }
    };
    println!("sqs soak: kill schedule seed {seed} (IDEM_SQS_SOAK_SEED={seed} replays it)");
    let mut rng = Rng(seed);
    // A visibility timeout of 2 s: the batches a killed worker held come back quickly.
    let names = Names::create("soak", 2, 10).await;
    // Each job's copy follows it three messages later, so that both copies are often in one
    // receive (the second is a duplicate within the batch) or in two workers' batches at once
    // (one waits on the other's claim).
    let order: Vec<_> = (0..JOBS + 3)
        .flat_map(|i| {
            let first = (i < JOBS).then(|| job(i + 1));
            let copy = (i >= 3).then(|| job(i - 2));
            first.into_iter().chain(copy)
        })
        .collect();
    let client = sqs().await;
    let total = order.len() as u64;

    let soak = async {
        let mut lines = Lines::new();
        let mut workers: Vec<Option<Worker>> = (0..WORKERS)
            .map(|i| Some(Worker::spawn(i, "batch", &names.env(), lines.tx.clone())))
            .collect();
        let mut counts = Counts::default();
        // The producer keeps at most this many messages ahead of the deletes: moto scans its
        // whole queue on every receive and delete, so a queue of thousands would make moto,
        // not the workers, the bottleneck.
        const AHEAD: u64 = 300;
        let mut sent = 0_u64;
        let mut kills = 0_u64;
        let mut next_kill = 100 + rng.below(300);
        let pool = postgres(1).await;
        let distinct = || async {
            let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT count(DISTINCT job) FROM {}",
                names.effects
            )))
            .fetch_one(&pool)
            .await
            .unwrap();
            n
        };
        // Until every job's effect is in the database: printed deletes do not tell, a kill
        // can lose a delete that landed (or the line of one).
        loop {
            while sent < total && sent < counts.deleted + AHEAD {
                let chunk = &order[sent as usize..(sent as usize + 100).min(order.len())];
                send_jobs(&client, &names.queue.url, chunk).await.unwrap();
                sent += chunk.len() as u64;
            }
            let next = lines.next_or_quiet(Duration::from_secs(3)).await;
            if (next.is_none() || (counts.deleted >= JOBS as u64 && counts.deleted % 20 == 0))
                && distinct().await == JOBS
            {
                break;
            }
            let Some((index, line)) = next else { continue };
            counts.add(&line);
            // On the line just read: the worker that printed it holds its next batch soon,
            // often with its transaction open.
            if line.starts_with("DELETED")
                && counts.deleted >= next_kill
                && counts.deleted + 300 < total
                && kills < MAX_KILLS
                && let Some(victim) = workers[index].take()
            {
                assert!(!victim.kill().await.success());
                kills += 1;
                next_kill = counts.deleted + 100 + rng.below(300);
                let replacement = workers.len();
                workers.push(Some(Worker::spawn(
                    replacement,
                    "batch",
                    &names.env(),
                    lines.tx.clone(),
                )));
            }
        }
        // The batches the killed workers held come back after the visibility timeout, as
        // duplicates: the live workers delete them.
        let left = names.wait_empty(60).await;
        let mut live: Vec<Worker> = workers.into_iter().flatten().collect();
        for w in &mut live {
            w.stop().await;
        }
        let mut stopped = 0;
        while stopped < live.len() {
            let (_, line) = lines.next(60).await;
            stopped += usize::from(line == "STOPPED");
            counts.add(&line);
        }
        for w in live {
            w.succeed().await;
        }
        pool.close().await;
        (counts, kills, left, lines)
    };
    let (counts, kills, left, lines) = within(180, "the soak", soak).await;

    println!(
        "sqs soak: {JOBS} jobs sent twice ({total} messages), {WORKERS} worker processes; \
         {counts:?}, {kills} SIGKILLs; {:.1} s wall",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(left, (0, 0), "(queue, dead-letter queue) not empty");
    assert_eq!(names.left().await, (0, 0));
    let expected_sum = JOBS * (JOBS + 1) / 2;
    assert_eq!(
        names.effects().await,
        (JOBS, JOBS, expected_sum),
        "(rows, distinct jobs, sum of credits)"
    );
    let pool = postgres(1).await;
    let wrong: Vec<(String, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT job, count(*), sum(credits)::bigint FROM {} GROUP BY job \
         HAVING count(*) <> 1 OR sum(credits) <> substr(job, 8)::bigint",
        names.effects
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let markers: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE scope = 'sqs.top_up'",
        names.markers
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    assert!(wrong.is_empty(), "jobs applied other than once: {wrong:?}");
    assert_eq!(markers, JOBS);
    assert!(
        counts.duplicates >= JOBS as u64,
        "every job's second copy is a duplicate: {} counted for {JOBS} jobs",
        counts.duplicates
    );
    assert!(kills >= 5, "only {kills} kills\n{}", lines.dump());
    assert!(
        counts.redelivered >= 1,
        "no message came back after {kills} kills"
    );
}
