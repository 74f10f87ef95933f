//! `--outbox`'s wake-up rows: from a job's commit (its call answered `Applied`) to the moment
//! a waiting relay hands its message to the publisher, p50 and p99, for a relay of the store
//! the job commits through and for one of another store (another pool on the same table, as
//! another process has). The relays' poll is a minute: every sample is a wake-up. The jobs
//! run one at a time, `PACE` apart, so that each finds its relay waiting.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::outbox::{Message, PublishError, Publisher, Relay};
use idem::{Outbox, Store};
use sqlx::{Postgres, Transaction};
use tokio::sync::mpsc;

use super::{Job, Names, effect};
use crate::Res;

/// Between two jobs: longer than a relay's round that finds nothing.
const PACE: Duration = Duration::from_millis(5);

#[idem::idempotent(key = "job.id", scope = "bench.outbox.wake")]
async fn top_up_one(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
    accounts: &str,
    outbox: &mut Outbox,
) -> Result<(), idem::Error> {
    effect(tx, accounts, job).await?;
    outbox.send("bench.wake", &job.account)?;
    Ok(())
}

/// Tells the bench when each message reached it; publishes nothing.
struct Clock(mpsc::UnboundedSender<Instant>);

impl Publisher for Clock {
    async fn publish<'a>(&'a self, _: &'a Message) -> Result<(), PublishError> {
        let _ = self.0.send(Instant::now());
        Ok(())
    }
}

/// p50 and p99 of the commit-to-publish latency of `samples` jobs committed through `store`
/// and relayed from `relayed` (the same store, or another).
pub(super) async fn latency(
    store: &Store<Postgres>,
    relayed: Store<Postgres>,
    names: &Names,
    first_id: u64,
    samples: usize,
) -> Res<(Duration, Duration)> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let relay = Relay::new(relayed, Clock(tx));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(Duration::from_secs(60), async {
                let _ = stopped.await;
            })
            .await
    });
    let accounts = Arc::new(names.accounts.clone());
    let mut took = Vec::with_capacity(samples);
    // The first job waits for the relay's first round too: left out.
    for n in 0..=samples {
        tokio::time::sleep(PACE).await;
        let id = first_id + n as u64;
        let job = Job {
            id,
            account: (id as i64) % super::ACCOUNTS + 1,
        };
        let outcome = top_up_one(store, &job, &accounts).await?;
        let committed = Instant::now();
        assert!(outcome.is_applied(), "job {id} was fresh");
        let published = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .map_err(|_| format!("job {id}'s message was not relayed within 30 s"))?
            .ok_or("the relay stopped")?;
        if n > 0 {
            took.push(published.saturating_duration_since(committed));
        }
    }
    let _ = stop.send(());
    running.await??;
    took.sort();
    let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    Ok((at(0.5), at(0.99)))
}
