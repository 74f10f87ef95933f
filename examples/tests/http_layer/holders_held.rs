//! The six holders of `holders.rs`, while the first still holds the key (parked in its body):
//! the second never reports a duplicate (never acks, never replays). Behind a lease (lease
//! mode, the layer in lease mode) every second is `InProgress` at once (HTTP: 409). Behind an
//! open transaction (transaction mode, joined, batch, the layer in transaction mode) a second
//! that claims in a transaction waits, and applies once the first failed; a lease-mode second
//! is `InProgress` on the servers, and waits for the write lock on SQLite like any writer.

use super::holders::{Ctx, Got, HOLDERS, Holder, Waiters};
use super::*;

/// Until a claim is seen waiting on the marker table's row locks (servers); SQLite's waiters
/// wait in the busy handler, where no query sees them, so there the overlap is not shown.
async fn until_a_claim_waits<DB: Waiters>(ctx: &Ctx<DB>) {
    if ctx.claims_waiting().await.is_none() {
        return;
    }
    within(30, "a claim waiting on the key", async {
        while ctx.claims_waiting().await.unwrap_or(0) < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

/// Every ordered pair of holders, 36: the first parks holding the key, the second delivers
/// meanwhile; then the first fails, and the job applies once.
async fn held_key_is_never_a_duplicate<DB: Waiters>(tables: Tables<DB>) {
    let ctx = Ctx::new(tables).await;
    let sqlite = DB::WAITERS.is_none();
    for first in HOLDERS {
        for second in HOLDERS {
            let job = ctx.job();
            let hold = Arc::new(Hold::default());
            // Refused at once: a live lease, or a lease claim behind a transaction on a server.
            let refused = first.leased() || (second.leased() && !sqlite);
            let holder = ctx.deliver(first, &job, Some(&hold));
            let meanwhile = async {
                hold.entered.notified().await;
                if refused {
                    let during = ctx.deliver(second, &job, None).await;
                    hold.release.notify_one();
                    return during;
                }
                let waiter = ctx.deliver(second, &job, None);
                let release = async {
                    until_a_claim_waits(&ctx).await;
                    hold.release.notify_one();
                };
                tokio::join!(waiter, release).0
            };
            let ((held, _), (during, _)) =
                within(60, "the pair", async { tokio::join!(holder, meanwhile) }).await;
            let pair = format!("{first:?} holding, then {second:?}");
            assert_eq!(held, Got::Failed, "{pair}: the first");
            if refused {
                assert_eq!(during, Got::InProgress, "{pair}");
                assert_eq!(ctx.effects(&job).await, 0, "{pair}: effects while refused");
                let after = within(60, "the retry", ctx.deliver(second, &job, None)).await;
                assert_eq!(after.0, Got::Applied, "{pair}: once the first let go");
            } else {
                assert_eq!(during, Got::Applied, "{pair}: the waiter");
            }
            assert_eq!(ctx.effects(&job).await, 1, "{pair}: effects");
            // Completed now: a duplicate to the holder that had it first.
            let late = within(60, "a late delivery", ctx.deliver(first, &job, None)).await;
            let done = match (first, second) {
                (Holder::HttpTx | Holder::HttpLease, Holder::HttpTx | Holder::HttpLease) => {
                    Got::Replayed
                }
                (Holder::HttpTx | Holder::HttpLease, _) => Got::NotKept,
                _ => Got::Duplicate,
            };
            assert_eq!(late.0, done, "{pair}, then {first:?} again");
            assert_eq!(ctx.effects(&job).await, 1, "{pair}: effects at the end");
        }
    }
    ctx.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_key_held_by_any_holder_is_never_a_duplicate_to_another() {
    let tables = Tables::new(postgres().await, "pg_holders_held").await;
    held_key_is_never_a_duplicate(tables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_a_key_held_by_any_holder_is_never_a_duplicate_to_another() {
    let tables = Tables::new(mariadb().await, "my_holders_held").await;
    held_key_is_never_a_duplicate(tables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_a_key_held_by_any_holder_is_never_a_duplicate_to_another() {
    let pool = sqlite(&temp_db("holders_held")).await;
    held_key_is_never_a_duplicate(Tables::new(pool, "holders_held").await).await;
}
