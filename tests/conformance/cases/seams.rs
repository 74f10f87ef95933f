//! Where two parts of idem meet: a forgotten lease and its fencing tokens, lease claims behind
//! a transaction claim, a lease handler inside a transaction body, a claim's `wait` and the
//! body's own statements, and an outbox message after a swallowed rollback.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{
    Claimed, Error, Key, Lease, LeaseError, LeaseOptions, NotKept, Outbox, Outcome, Refusal, Store,
};
use sqlx::{Pool, Transaction};

use super::lease::{db_now_plus, poll_db};
use super::outbox::{outbox_table, ship};
use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::lease_handlers::{How, Provider, SCOPE, charge};
use crate::conformance::util::{db_code, within};
use crate::conformance::{Support, TestDb};

/// What a call or a claim came to, compared exactly.
#[derive(Debug, PartialEq, Eq)]
enum Got {
    Applied,
    Fresh,
    Duplicate,
    InProgress,
    LeaseLost,
    RolledBack,
    Nested,
    Refused,
    /// A database error: its code and message.
    Database(String),
    Other(String),
}

fn idem_got(e: Error) -> Got {
    match e {
        Error::InProgress { .. } => Got::InProgress,
        Error::Lease(LeaseError::Lost { .. }) => Got::LeaseLost,
        Error::NotKept(NotKept::RolledBack { .. }) => Got::RolledBack,
        Error::Refused(Refusal::Nested { .. }) => Got::Nested,
        Error::Database(e) => sql_got(&e),
        other => Got::Other(format!("{other:?}")),
    }
}

fn sql_got(e: &sqlx::Error) -> Got {
    Got::Database(format!("{:?}: {e}", db_code(e)))
}

fn got<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> Got {
    match result {
        Ok(Outcome::Applied(_)) => Got::Applied,
        Ok(Outcome::Duplicate | Outcome::Replayed(_)) => Got::Duplicate,
        Ok(Outcome::Failed(f)) => Got::Other(format!("{f:?}")),
        Err(TestError::Idem(e)) => idem_got(e),
        Err(TestError::Db(e)) => sql_got(&e),
        Err(TestError::Refused) => Got::Refused,
    }
}

fn leased(result: Result<Claimed<Lease>, Error>) -> Got {
    match result {
        Ok(Claimed::Fresh(_)) => Got::Fresh,
        Ok(Claimed::Duplicate | Claimed::Replayed(_)) => Got::Duplicate,
        Ok(Claimed::Failed(f)) => Got::Other(format!("{f:?}")),
        Err(e) => idem_got(e),
    }
}

fn thirty_seconds() -> LeaseOptions {
    LeaseOptions::new(Duration::from_secs(30))
}

async fn fresh_lease<S: Support>(ctx: &Ctx<S>, key: &Key) -> Lease {
    match ctx.store.lease(SCOPE, key, thirty_seconds()).await {
        Ok(Claimed::Fresh(lease)) => lease,
        other => panic!("expected a fresh lease, got {other:?}"),
    }
}

/// A's lease runs out, an operator forgets the marker (a lease no one holds may be forgotten),
/// and B takes the key afresh: A still holds its `Lease`, B holds the key.
async fn forgotten_under_a_holder<S: Support>(ctx: &Ctx<S>, key: &Key) -> (Lease, Lease) {
    let a = fresh_lease(ctx, key).await;
    ctx.set_locked_until(key.as_str(), &db_now_plus::<S>(-1000))
        .await;
    let forgot = ctx.store.forget(SCOPE, key.as_str()).await;
    assert!(
        forgot.expect("forget an expired lease"),
        "no marker to forget"
    );
    let b = fresh_lease(ctx, key).await;
    (a, b)
}

pub(crate) async fn forgotten_lease_taken_again_gets_a_larger_token_and_fences_the_old_holder<
    S: Support,
>() {
    let ctx = Ctx::<S>::new("seam_forget", 2).await;
    let key = Key::new("order-forgotten").expect("a valid key");
    let (a, b) = forgotten_under_a_holder(&ctx, &key).await;
    let tokens = (a.token(), b.token());
    let old = got(a.finish::<(), TestError>(Ok(())).await);
    let between = ctx.marker(key.as_str()).await;
    let new = got(b.finish::<(), TestError>(Ok(())).await);
    // A token that starts again at 1 lets A's completion pass for B's.
    assert_eq!(
        (tokens.1 > tokens.0, old, between.completed, new),
        (true, Got::LeaseLost, false, Got::Applied),
        "(B's token above A's, A's finish, completed by A, B's finish); tokens {tokens:?}, \
         the marker after A's finish: {between:?}"
    );
    let m = ctx.marker(key.as_str()).await;
    assert!(m.completed && m.token == tokens.1, "{m:?}");
    ctx.cleanup().await;
}

pub(crate) async fn fenced_holder_of_a_forgotten_lease_cannot_release_the_new_one<S: Support>() {
    let ctx = Ctx::<S>::new("seam_fence", 2).await;
    let key = Key::new("order-fenced").expect("a valid key");
    let (a, b) = forgotten_under_a_holder(&ctx, &key).await;
    let tokens = (a.token(), b.token());
    // A's error releases A's lease, which is no longer the one on the key.
    let old = got(a.finish::<(), TestError>(Err(TestError::Refused)).await);
    let third = leased(ctx.store.lease(SCOPE, &key, thirty_seconds()).await);
    let new = got(b.finish::<(), TestError>(Ok(())).await);
    assert_eq!(
        (old, third, new),
        (Got::Refused, Got::InProgress, Got::Applied),
        "(A's failed finish, a third claim while B holds the key, B's finish); tokens {tokens:?}"
    );
    ctx.cleanup().await;
}

/// Lease claims queued behind the key.
const WAITERS: usize = 30;

/// A transaction claim holds the key while [`WAITERS`] lease claims queue behind it, then
/// rolls back. Each claim answers: at most one takes the key, every other meets a holder
/// (the transaction, or the new lease, which stays unfinished until all have answered).
pub(crate) async fn lease_claims_behind_a_rolled_back_transaction_claim_are_fresh_at_most_once<
    S: Support,
>() {
    let ctx = Ctx::<S>::new("seam_behind", WAITERS as u32 + 4).await;
    let job = ctx.job("order-behind", 1, 100);
    let key = Key::new(&job.key).expect("a valid key");
    let Claimed::Fresh(mut holder) = ctx.store.claim(SCOPE, &key).await.expect("claim") else {
        panic!("a fresh key was a duplicate")
    };
    insert_effect(holder.tx(), &job, "holder")
        .await
        .expect("the holder's effect");
    let answered = Arc::new(AtomicUsize::new(0));
    let mut claims = tokio::task::JoinSet::new();
    for _ in 0..WAITERS {
        let (store, key, answered) = (ctx.store.clone(), key.clone(), answered.clone());
        claims.spawn(async move {
            let claim = store.lease(SCOPE, &key, thirty_seconds()).await;
            answered.fetch_add(1, Ordering::SeqCst);
            claim
        });
    }
    // On the servers, let go once every claim has answered or is seen queued on the key;
    // SQLite's waiters cannot be seen, so there the holder lets go at once.
    if ctx.claims_waiting().await.is_some() {
        let (c, answered) = (&ctx, &answered);
        poll_db(
            60,
            "every lease claim answered or queued",
            move || async move {
                let waiting = c.claims_waiting().await.unwrap_or(0);
                answered.load(Ordering::SeqCst) + waiting as usize >= WAITERS
            },
        )
        .await;
    }
    let unanswered = WAITERS - answered.load(Ordering::SeqCst);
    let rolled_back = got(holder
        .finish::<(), TestError>(Err(TestError::Refused))
        .await);
    assert_eq!(rolled_back, Got::Refused);
    let (mut fresh, mut others) = (Vec::new(), BTreeMap::new());
    while let Some(claim) = within(120, "a lease claim", claims.join_next()).await {
        match claim.expect("no panic") {
            Ok(Claimed::Fresh(lease)) => fresh.push(lease),
            other => *others.entry(format!("{:?}", leased(other))).or_insert(0) += 1,
        }
    }
    println!(
        "{unanswered} of {WAITERS} lease claims had not answered at the rollback; {} fresh",
        fresh.len()
    );
    assert!(fresh.len() <= 1, "{} claims took the key", fresh.len());
    let in_progress = BTreeMap::from([(format!("{:?}", Got::InProgress), WAITERS - fresh.len())]);
    assert_eq!(
        others, in_progress,
        "the answers of the claims that did not take the key, counted"
    );
    let took = fresh.len() as i64;
    for lease in fresh {
        ctx.exec(&format!(
            "INSERT INTO {} (id, amount, origin) VALUES (1, 100, 'lease')",
            ctx.effects
        ))
        .await;
        assert_eq!(
            got(lease.finish::<(), TestError>(Ok(())).await),
            Got::Applied
        );
    }
    assert_eq!(ctx.effects_total().await, took);
    ctx.cleanup().await;
}

/// A lease claim meets a transaction-mode delivery parked in its body with the key: the
/// delivery may still commit or fail, so the lease claim answers `InProgress`, and does not
/// wait for it without bound.
pub(crate) async fn lease_claim_behind_an_open_transaction_claim_is_in_progress<S: Support>() {
    let ctx = Ctx::<S>::new("seam_open", 3).await;
    // SQLite's lease claim waits for the write lock for the busy timeout: sqlx's 5 s here,
    // not the suite's minute.
    let pool = S::connect_default_wait(&ctx.url, 2).await;
    let leasing = Store::new(pool.clone())
        .with_table(ctx.store.table())
        .expect("table name");
    let job = ctx.job("job-open", 6, 600);
    let key = Key::new(&job.key).expect("a valid key");
    let hold = Arc::new(Hold::default());
    let holder = tokio::spawn({
        let (store, job, hold) = (ctx.store.clone(), job.clone(), hold.clone());
        async move { apply_holding(&store, &job, &hold).await }
    });
    within(60, "the holder parking in its body", hold.entered()).await;
    let claim = leasing.lease("apply", &key, thirty_seconds());
    let during = leased(within(60, "a lease claim behind the open transaction", claim).await);
    hold.release();
    let held = got(within(60, "the holder", holder).await.expect("no panic"));
    assert_eq!(
        (during, held),
        (Got::InProgress, Got::Applied),
        "(the lease claim, the holder)"
    );
    assert_eq!(ctx.effects(6).await, 1);
    let after = leased(leasing.lease("apply", &key, thirty_seconds()).await);
    assert_eq!(after, Got::Duplicate);
    pool.close().await;
    ctx.cleanup().await;
}

/// Writes its own effect, then calls the lease handler `charge` with the store.
#[idem::idempotent(key = "job.key", scope = "conformance.outer")]
async fn outer_leasing<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    store: &Store<DB>,
    inner: &Job,
    provider: &Provider<DB>,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "outer").await?;
    drop(charge(store, inner, provider, How::Pay).await?);
    Ok(job.amount)
}

/// A lease handler called with a store inside a transaction body would claim apart from the
/// open transaction (and on SQLite wait for its write lock): refused, before any I/O.
pub(crate) async fn lease_handler_inside_a_transaction_body_is_refused_as_nested<S: Support>() {
    let ctx = Ctx::<S>::new("seam_nested", 2).await;
    let pool = S::connect_default_wait(&ctx.url, 3).await;
    let store = Store::new(pool.clone())
        .with_table(ctx.store.table())
        .expect("table name");
    let provider = Provider::<S::Db>::in_memory();
    let (job, inner) = (ctx.job("job-outer", 8, 80), ctx.job("job-inner", 9, 90));
    let call = outer_leasing(&store, &job, &store, &inner, &provider);
    let answer = got(within(60, "a lease handler in a transaction body", call).await);
    assert_eq!(
        (
            answer,
            provider.requests(),
            ctx.markers().await,
            ctx.effects_total().await
        ),
        (Got::Nested, 0, 0, 0),
        "(the outer call, outside calls, markers, effects)"
    );
    // Outside any body the lease handler runs as usual.
    let alone = charge(&store, &inner, &provider, How::Pay).await;
    assert_eq!(got(alone), Got::Applied);
    pool.close().await;
    ctx.cleanup().await;
}

/// `apply` with a `wait`, returning the session's lock wait as its body sees it.
#[idem::idempotent(key = "job.key", scope = "apply", wait = "1s")]
async fn apply_reading_the_wait<S: Support>(
    tx: &mut Transaction<'_, S::Db>,
    job: &Job,
    then: Then,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "apply").await?;
    let wait = S::Db::fetch_i64(&mut **tx, S::LOCK_WAIT_MS, &[]).await?;
    match then {
        Then::Commit => Ok(wait),
        _ => Err(TestError::Refused),
    }
}

/// The session's lock wait on the pool's only connection.
async fn lock_wait<S: Support>(single: &Pool<S::Db>) -> i64 {
    let mut conn = single.acquire().await.expect("a connection");
    S::Db::fetch_i64(&mut conn, S::LOCK_WAIT_MS, &[])
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", S::LOCK_WAIT_MS))
}

/// A store on a pool of one connection, so that every call and read shares one session.
async fn single_session<S: Support>(ctx: &Ctx<S>) -> (Pool<S::Db>, Store<S::Db>) {
    let single = S::connect(&ctx.url, 1).await;
    let store = Store::new(single.clone())
        .with_table(ctx.store.table())
        .expect("table name");
    (single, store)
}

/// `wait` bounds the claim, not the body: the body's statements wait as the connection's
/// own statements do.
pub(crate) async fn wait_does_not_reach_the_body<S: Support>() {
    let ctx = Ctx::<S>::new("seam_waitbody", 2).await;
    let (single, store) = single_session(&ctx).await;
    let before = lock_wait::<S>(&single).await;
    let job = ctx.job("job-waitbody", 51, 510);
    match apply_reading_the_wait::<S>(&store, &job, Then::Commit).await {
        Ok(Outcome::Applied(in_body)) => assert_eq!(
            in_body, before,
            "the body's lock wait (ms), against the connection's before the call"
        ),
        other => panic!("expected Applied, got {other:?}"),
    }
    single.close().await;
    ctx.cleanup().await;
}

/// After a call with `wait`, applied, failed or a duplicate, the pooled connection's lock
/// wait is what it was before.
pub(crate) async fn wait_does_not_outlive_the_call_on_the_pooled_connection<S: Support>() {
    let ctx = Ctx::<S>::new("seam_waitpool", 2).await;
    let (single, store) = single_session(&ctx).await;
    let before = lock_wait::<S>(&single).await;
    let (job, failing) = (
        ctx.job("job-waitpool", 52, 520),
        ctx.job("job-fails", 53, 1),
    );
    let mut after = Vec::new();
    let applied = got(apply_reading_the_wait::<S>(&store, &job, Then::Commit).await);
    after.push(("applied", applied, lock_wait::<S>(&single).await));
    let failed = got(apply_reading_the_wait::<S>(&store, &failing, Then::Fail).await);
    after.push(("failed", failed, lock_wait::<S>(&single).await));
    let again = got(apply_reading_the_wait::<S>(&store, &job, Then::Commit).await);
    after.push(("duplicate", again, lock_wait::<S>(&single).await));
    assert_eq!(
        after,
        [
            ("applied", Got::Applied, before),
            ("failed", Got::Refused, before),
            ("duplicate", Got::Duplicate, before),
        ],
        "(call, its answer, the connection's lock wait in ms after it)"
    );
    single.close().await;
    ctx.cleanup().await;
}

/// `apply` with a `wait`, whose body updates row 1 of `rows`.
#[idem::idempotent(key = "job.key", scope = "apply", wait = "1s")]
async fn apply_updating<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    rows: &str,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "apply").await?;
    let sql = format!("UPDATE {rows} SET v = v + 10 WHERE id = 1");
    DB::execute(&mut **tx, &sql, &[]).await?;
    Ok(job.amount)
}

/// The body's own statement waits behind another session's row lock for longer than the
/// claim's `wait`, and the delivery still applies once that lock is let go.
pub(crate) async fn body_statement_waits_longer_than_the_claims_wait<S: Support>() {
    let Some(running) = S::UPDATES_RUNNING_LONGER_THAN else {
        panic!("this backend cannot show a waiting statement: do not list this case")
    };
    let mut ctx = Ctx::<S>::new("seam_bodywait", 4).await;
    let rows = ctx
        .create_table("r", "(id BIGINT NOT NULL PRIMARY KEY, v BIGINT NOT NULL)")
        .await;
    ctx.exec(&format!("INSERT INTO {rows} (id, v) VALUES (1, 0)"))
        .await;
    let mut blocker = ctx.pool.begin().await.expect("begin");
    let lock = format!("UPDATE {rows} SET v = v + 1 WHERE id = 1");
    S::Db::execute(&mut *blocker, &lock, &[])
        .await
        .expect("lock row 1");
    let job = ctx.job("job-bodywait", 54, 540);
    let delivery = tokio::spawn({
        let (store, job, rows) = (ctx.store.clone(), job.clone(), rows.clone());
        async move { apply_updating(&store, &job, &rows).await }
    });
    let (c, d, r) = (&ctx, &delivery, rows.as_str());
    poll_db(
        60,
        "the body's UPDATE waiting 1.5 s, or the delivery's end",
        move || async move {
            let binds = [Bind::Str(r.to_owned()), Bind::I64(1500)];
            d.is_finished() || c.scalar_with(running, &binds).await >= 1
        },
    )
    .await;
    blocker.commit().await.expect("the blocker's commit");
    let answer = got(within(60, "the delivery", delivery)
        .await
        .expect("no panic"));
    assert_eq!(answer, Got::Applied, "the delivery whose body waited");
    assert_eq!(ctx.effects(54).await, 1);
    let v = ctx
        .scalar(&format!("SELECT v FROM {rows} WHERE id = 1"))
        .await;
    assert_eq!(v, 11, "the blocker's update and the body's");
    ctx.cleanup().await;
}

/// The effect, a failure on which the database rolls the transaction back (swallowed), then
/// one outbox message, and `Ok`.
#[idem::idempotent(key = "job.key", scope = "orders.ship")]
async fn ship_swallowing<S: Support>(
    tx: &mut Transaction<'_, S::Db>,
    job: &Job,
    outbox: &mut Outbox,
    other: &Pool<S::Db>,
    rows: &str,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "ship").await?;
    S::swallow_a_rollback(&mut **tx, other, rows).await;
    outbox.send("q", &1)?;
    Ok(job.amount)
}

/// The outbox message goes with the transaction the database threw away: `NotKept::RolledBack`, and
/// nothing kept, neither by the rolled-back transaction nor outside it.
pub(crate) async fn outbox_message_of_a_body_that_swallows_a_rollback_is_not_kept<S: Support>() {
    let mut ctx = Ctx::<S>::new("seam_swallow", 2).await;
    let rows = ctx
        .create_table("r", "(id BIGINT NOT NULL PRIMARY KEY, v BIGINT NOT NULL)")
        .await;
    let values: Vec<String> = (1..=100).map(|i| format!("({i}, 0)")).collect();
    ctx.exec(&format!(
        "INSERT INTO {rows} (id, v) VALUES {}",
        values.join(", ")
    ))
    .await;
    let other = S::connect(&ctx.url, 2).await;
    let outbox = format!("SELECT COUNT(*) FROM {}", outbox_table(&ctx));
    let job = ctx.job("job-swallow-outbox", 18, 180);
    let call = ship_swallowing::<S>(&ctx.store, &job, &other, &rows);
    let answer = got(within(120, "the swallowing body", call).await);
    assert_eq!(
        (
            answer,
            ctx.markers().await,
            ctx.effects_total().await,
            ctx.scalar(&outbox).await
        ),
        (Got::RolledBack, 0, 0, 0),
        "(the call, markers, effects, outbox messages)"
    );
    let next = within(
        60,
        "the redelivery",
        ship(&ctx.store, &job, 1, Then::Commit),
    )
    .await;
    assert_eq!(got(next), Got::Applied);
    assert_eq!(ctx.scalar(&outbox).await, 1);
    other.close().await;
    ctx.cleanup().await;
}
