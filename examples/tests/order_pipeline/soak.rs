//! The pipeline's soak: order jobs through a worker, a relay and a consumer process, each
//! SIGKILLed in turn on a schedule drawn from a printed seed; and two relays side by side.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::order_pipeline::{Order, publish_orders};
use crate::support::{Lines, Worker, within};
use crate::{Pipeline, id_after};

/// A small generator for the kill schedule (xorshift64*): the seed is printed, so a failing
/// schedule can be run again with `IDEM_SOAK_SEED`.
struct Schedule(u64);

impl Schedule {
    fn next(&mut self, below: u64) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d) % below
    }
}

const ROLES: [&str; 3] = ["worker", "relay", "consumer"];

/// Order jobs (`IDEM_SOAK_JOBS`, 2,000 by default), published once each; a worker, a relay and a
/// consumer process; every 100 to 400 lines the three print (a handled delivery, a confirmed
/// publish), one of them is SIGKILLed (worker, relay, consumer in turn from a seeded start)
/// and started again, 12 times in all. At the end the database holds one order, one outbox
/// message (sent) and one email per job.
#[tokio::test(flavor = "multi_thread")]
async fn soak_killing_worker_relay_and_consumer_leaves_one_email_per_order() {
    const KILLS: usize = 12;
    let jobs: usize = std::env::var("IDEM_SOAK_JOBS").map_or(2_000, |n| n.parse().unwrap());
    let seed: u64 = std::env::var("IDEM_SOAK_SEED").map_or_else(
        |_| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            t.map_or(1, |d| d.as_nanos() as u64) | 1
        },
        |s| s.parse().unwrap(),
    );
    println!("order pipeline soak: {jobs} jobs, IDEM_SOAK_SEED={seed}");
    let started = Instant::now();
    let p = Pipeline::create("soak").await;
    let orders: Vec<Order> = (1..=jobs)
        .map(|n| Order {
            id: format!("order-{n}"),
            customer: format!("customer{n}@example.com"),
        })
        .collect();
    publish_orders(&p.channel, &p.names, &orders).await.unwrap();

    let mut schedule = Schedule(seed);
    let mut lines = Lines::new();
    let env = p.env(50);
    let mut next_index = ROLES.len();
    let mut running: Vec<Option<Worker>> = ROLES
        .iter()
        .enumerate()
        .map(|(i, role)| Some(Worker::spawn(i, role, &env, lines.tx.clone())))
        .collect();
    // Which role each process index plays.
    let mut role_of: Vec<usize> = (0..ROLES.len()).collect();
    let mut kills = [0_usize; 3];
    let mut victim = schedule.next(3) as usize;
    let mut gap = 100 + schedule.next(301);
    let mut seen = 0_u64;
    let soak = async {
        loop {
            let next = lines.next_or_quiet(Duration::from_secs(2)).await;
            if (next.is_none() || seen.is_multiple_of(200)) && {
                let c = p.counts().await;
                c.emails as usize >= jobs && c.sent as usize >= jobs
            } {
                break;
            }
            let Some((_, line)) = next else { continue };
            let counted = line.starts_with("HANDLED") || line.starts_with("CONFIRMED");
            // Lines of a process already killed may still arrive: they count, but do not
            // pick it again.
            seen += u64::from(counted);
            gap = gap.saturating_sub(u64::from(counted));
            if gap == 0 && kills.iter().sum::<usize>() < KILLS {
                let slot = role_of
                    .iter()
                    .rposition(|&r| r == victim)
                    .expect("each role runs");
                let process = running[slot].take().expect("the role's current process");
                assert!(!process.kill().await.success());
                kills[victim] += 1;
                running.push(Some(Worker::spawn(
                    next_index,
                    ROLES[victim],
                    &env,
                    lines.tx.clone(),
                )));
                role_of.push(victim);
                next_index += 1;
                victim = (victim + 1) % 3;
                gap = 100 + schedule.next(301);
            }
        }
        for process in running.iter_mut().flatten() {
            process.stop().await;
        }
        for process in running.into_iter().flatten() {
            process.succeed().await;
        }
    };
    within(240, "the soak", soak).await;
    // What the kills cost: deliveries that came again and were duplicates at the worker's or
    // the consumer's claim, and messages the relays published more than once.
    let (mut again, mut published) = ([0_usize; 3], 0_usize);
    for (index, line) in &lines.seen {
        again[role_of[*index]] += usize::from(line.starts_with("HANDLED duplicate"));
        published += usize::from(line.starts_with("CONFIRMED"));
    }
    let c = p.counts().await;
    let killed = format!("kills (worker, relay, consumer) {kills:?}, seed {seed}");
    assert_eq!(kills.iter().sum::<usize>(), KILLS, "{killed}");
    let n = jobs as i64;
    assert_eq!(
        (c.orders, c.messages, c.sent, c.emails, c.distinct_emails),
        (n, n, n, n, n),
        "{killed}"
    );
    println!(
        "order pipeline soak: {jobs} orders, {} outbox messages, {} emails in {:.1} s; \
         {killed}; duplicates at the worker {}, at the consumer {}; {published} confirms \
         seen for {jobs} messages",
        c.messages,
        c.emails,
        started.elapsed().as_secs_f64(),
        again[0],
        again[2],
    );
    p.drop().await;
}

/// Two relay processes at once on one outbox (batches of 10, `SKIP LOCKED`), with a consumer:
/// every message is published at least once (its id among the relays' confirmed ones), both
/// relays publish some of them, and each message is consumed once: one email per order.
#[tokio::test(flavor = "multi_thread")]
async fn two_relays_at_once_publish_each_message_and_it_is_consumed_once() {
    const ORDERS: usize = 300;
    let p = Pipeline::create("two_relays").await;
    let mut lines = Lines::new();
    let env = p.env(10);
    let mut processes: Vec<Worker> = ["relay", "relay", "consumer"]
        .iter()
        .enumerate()
        .map(|(i, role)| Worker::spawn(i, role, &env, lines.tx.clone()))
        .collect();
    for _ in 0..3 {
        lines.expect("READY", 60).await;
    }
    // The relays poll while the orders commit, so both find messages to take.
    let ids: Vec<String> = (1..=ORDERS).map(|n| format!("order-{n}")).collect();
    let place = async {
        for chunk in ids.chunks(8) {
            futures_util::future::join_all(chunk.iter().map(|id| p.place(id))).await;
        }
    };
    within(60, "placing the orders", place).await;
    p.until(60, "every email", |c| {
        c.emails as usize >= ORDERS && c.sent as usize >= ORDERS
    })
    .await;
    for process in &mut processes {
        process.stop().await;
    }
    let mut stopped = 0;
    while stopped < 3 {
        stopped += usize::from(lines.next(60).await.1 == "STOPPED");
    }
    for process in processes {
        process.succeed().await;
    }
    let mut by_relay = [0_usize; 2];
    let mut confirmed = BTreeSet::new();
    for (index, line) in &lines.seen {
        if line.starts_with("CONFIRMED") {
            by_relay[*index] += 1;
            confirmed.insert(id_after(line, "CONFIRMED").to_owned());
        }
    }
    let sql = format!("SELECT id FROM {}", p.names.outbox());
    let outbox: BTreeSet<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(&p.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(outbox.len(), ORDERS);
    assert_eq!(confirmed, outbox, "each message published at least once");
    assert!(
        by_relay.iter().all(|&n| n > 0),
        "both relays published: {by_relay:?}"
    );
    println!("two relays: {by_relay:?} confirms for {ORDERS} messages");
    let c = p.counts().await;
    let n = ORDERS as i64;
    assert_eq!(
        (c.orders, c.messages, c.sent, c.emails, c.distinct_emails),
        (n, n, n, n, n),
        "published by the relays: {by_relay:?}"
    );
    p.drop().await;
}
