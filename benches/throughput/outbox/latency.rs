//! `--outbox`'s latency rows: from a job's commit (its call answered `Applied`) to the relay
//! having its message's publisher confirm from RabbitMQ, at a steady `RATE` jobs a second.
//!
//! A paced producer starts a job every `1 / RATE` s on a fixed schedule (a tokio interval
//! that makes up a late tick at once, so that the timer's millisecond granularity does not
//! lower the rate), each job in a task of its own: the schedule never waits for a job, and
//! how many commits a second the database achieved is measured, not assumed. Each job writes
//! one message, its id, to a durable queue. The relay runs as it runs in production
//! (`Relay::run`: woken by its store's commits, a poll of a second, rounds of up to 100) and
//! publishes through a `RabbitMq` publisher wrapped to note when each round's confirms came
//! back: the moment the relay has the answers it marks sent. A warm-up at the start of the
//! run is left out of the figures (the relay's first round, the pool's first connections).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem::outbox::{Message, PublishError, Publisher, RabbitMq, Relay};
use idem::{Backend, Outbox, Store};
use sqlx::Transaction;
use tokio::sync::{mpsc, oneshot};

use crate::Res;

/// Jobs committed a second.
pub(super) const RATE: u32 = 1_000;

/// How long a wait for the relay may last before the bench gives up on it.
const PATIENCE: Duration = Duration::from_secs(30);

/// The relay's poll: only a message it is not woken for waits for it.
const POLL: Duration = Duration::from_secs(1);

pub(super) struct Tick {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "bench.outbox.latency")]
async fn send_one<DB: Backend>(
    _tx: &mut Transaction<'_, DB>,
    job: &Tick,
    queue: &str,
    outbox: &mut Outbox,
) -> Result<(), idem::Error> {
    outbox.send(queue, &job.id)?;
    Ok(())
}

/// RabbitMQ, noting for each confirmed message (by its job's id, its payload) when the relay
/// got its confirm.
struct Timed {
    inner: RabbitMq,
    confirmed: mpsc::UnboundedSender<(u64, Instant)>,
}

impl Timed {
    fn note(&self, message: &Message, at: Instant) {
        if let Ok(id) = serde_json::from_slice::<u64>(&message.payload) {
            let _ = self.confirmed.send((id, at));
        }
    }
}

impl Publisher for Timed {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        let answer = self.inner.publish(message).await;
        if answer.is_ok() {
            self.note(message, Instant::now());
        }
        answer
    }

    async fn publish_all<'a>(
        &'a self,
        messages: &'a [Message],
        done: &'a mut Vec<Result<(), PublishError>>,
    ) {
        let start = done.len();
        self.inner.publish_all(messages, done).await;
        // The round's answers reach the relay together, when the last confirm is in.
        let now = Instant::now();
        for (message, answer) in messages.iter().zip(&done[start..]) {
            if answer.is_ok() {
                self.note(message, now);
            }
        }
    }
}

/// One database's figures.
pub(super) struct Latency {
    /// Jobs run, the warm-up's too.
    pub(super) jobs: usize,
    /// The warm-up, left out, and the measured part, by the schedule.
    warm: Duration,
    run: Duration,
    p50: Duration,
    p99: Duration,
    max: Duration,
    /// Commits a second from the measured part's first scheduled start to its last commit.
    committed: f64,
    /// Confirms a second over the same start to the last confirm.
    relayed: f64,
    /// Messages committed and not yet confirmed when the last job committed.
    behind: usize,
    /// From the last commit to the last confirm.
    drain: Duration,
}

/// Runs the producer on `store` and the relay on `relayed` (a clone of it, or another store
/// on the same table) for the warm-up and the run.
pub(super) async fn measure<DB: Backend>(
    store: &Store<DB>,
    relayed: Store<DB>,
    inner: RabbitMq,
    queue: &str,
    first_id: u64,
    quick: bool,
) -> Res<Latency> {
    let (warm, run) = if quick {
        (Duration::from_millis(200), Duration::from_secs(1))
    } else {
        (Duration::from_millis(500), Duration::from_secs(5))
    };
    let period = Duration::from_secs(1) / RATE;
    let warm_jobs = (warm.as_secs_f64() * f64::from(RATE)) as usize;
    let jobs = warm_jobs + (run.as_secs_f64() * f64::from(RATE)) as usize;

    let (confirmed, mut confirms) = mpsc::unbounded_channel();
    let relay = Relay::new(relayed, Timed { inner, confirmed });
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(POLL, async {
                let _ = stopped.await;
            })
            .await
    });

    let start = Instant::now();
    // The default `Burst`: a tick late by the timer's granularity is made up at once, and
    // the ticks stay on the schedule `start + n * period`.
    let mut ticks = tokio::time::interval_at(start.into(), period);
    let mut tasks = Vec::with_capacity(jobs);
    for n in 0..jobs {
        ticks.tick().await;
        let (store, queue) = (store.clone(), queue.to_owned());
        let id = first_id + n as u64;
        tasks.push(tokio::spawn(async move {
            let outcome = send_one(&store, &Tick { id }, &queue).await?;
            let applied = Instant::now();
            if !outcome.is_applied() {
                return Err(format!("job {id} was not fresh").into());
            }
            Ok::<Instant, crate::BoxError>(applied)
        }));
    }
    let mut applied = Vec::with_capacity(jobs);
    for task in tasks {
        applied.push(task.await??);
    }

    // A message published twice (a round that lost its hold) keeps its first confirm.
    let mut confirm_at: HashMap<u64, Instant> = HashMap::with_capacity(jobs);
    while confirm_at.len() < jobs {
        let (id, at) = tokio::time::timeout(PATIENCE, confirms.recv())
            .await
            .map_err(|_| {
                format!(
                    "{} of {jobs} messages confirmed, none more within {PATIENCE:?}",
                    confirm_at.len()
                )
            })?
            .ok_or("the relay stopped")?;
        confirm_at.entry(id).or_insert(at);
    }
    let _ = stop.send(());
    running.await??;

    let measured_from = start + period * warm_jobs as u32;
    let last_commit = *applied.iter().max().expect("jobs ran");
    let mut last_confirm = measured_from;
    let mut behind = 0;
    let mut took = Vec::with_capacity(jobs - warm_jobs);
    for (n, applied) in applied.iter().enumerate() {
        let confirmed = confirm_at[&(first_id + n as u64)];
        if confirmed > last_commit {
            behind += 1;
        }
        if n >= warm_jobs {
            last_confirm = last_confirm.max(confirmed);
            took.push(confirmed.saturating_duration_since(*applied));
        }
    }
    took.sort();
    let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    let measured = took.len() as f64;
    Ok(Latency {
        jobs,
        warm,
        run,
        p50: at(0.5),
        p99: at(0.99),
        max: took[took.len() - 1],
        committed: measured / (last_commit - measured_from).as_secs_f64(),
        relayed: measured / (last_confirm - measured_from).as_secs_f64(),
        behind,
        drain: last_confirm.saturating_duration_since(last_commit),
    })
}

/// The latency table, on stdout.
pub(super) fn report(rows: &[(&'static str, Latency)]) {
    let Some((_, first)) = rows.first() else {
        return;
    };
    println!(
        "\n## Outbox: from a job's commit to its message's confirm by RabbitMQ, at {RATE} \
         jobs/s of one message ({:?} measured after a warm-up of {:?}; the relay woken by its \
         store's commits, its poll {POLL:?})\n",
        first.run, first.warm
    );
    println!(
        "| database | p50 | p99 | max | commits/s | relayed/s | unconfirmed at the last \
         commit | last commit to last confirm |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for (name, l) in rows {
        println!(
            "| {name} | {:.2} ms | {:.2} ms | {:.2} ms | {:.0} | {:.0} | {} | {:.2} ms |",
            ms(l.p50),
            ms(l.p99),
            ms(l.max),
            l.committed,
            l.relayed,
            l.behind,
            ms(l.drain)
        );
    }
}
