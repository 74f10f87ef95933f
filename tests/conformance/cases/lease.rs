//! Lease mode, in one process: outcomes, live leases, timeouts, takeovers of expired leases,
//! renewals, the database's clock, invalid keys and panics. The "outside system" is a
//! [`Provider`] that records every request with its idempotency key.
//!
//! Expiry is never waited for by sleeping: the cases poll the database until *it* says the
//! lease ran out (`locked_until <= now()` on its clock), bounded by `within`.

use std::sync::Arc;
use std::time::Duration;

use idem::{Claimed, Error, Key, Lease, LeaseError, LeaseOptions, Refusal};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::{Hold, TestError};
use crate::conformance::lease_handlers::*;
use crate::conformance::util::{unique_name, within};

/// The columns of the provider's table of requests.
pub(crate) const CHARGES_COLUMNS: &str =
    "(idempotency_key VARCHAR(255) NOT NULL, n BIGINT NOT NULL)";

/// The database's clock in SQL. Every lease statement of idem reads the same clock: `now()`
/// on PostgreSQL (the start of the statement's transaction: of the statement itself in
/// autocommit), `UTC_TIMESTAMP(6)` on MySQL / MariaDB, and
/// `strftime('%Y-%m-%dT%H:%M:%fZ', 'now')` on SQLite (ISO-8601 text, which sorts in time
/// order; `'now'` is fixed for one statement). The worker binds only the lease's length in
/// milliseconds, never a time of its own.
pub(crate) fn db_now<S: Support>() -> &'static str {
    match crate::conformance::util::backend::<S::Db>() {
        "postgres" => "now()",
        "mysql" => "UTC_TIMESTAMP(6)",
        "sqlite" => "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
        other => panic!("no clock SQL for {other}"),
    }
}

/// The database's now plus `ms` (which may be negative), in the marker table's time format.
pub(crate) fn db_now_plus<S: Support>(ms: i64) -> String {
    match crate::conformance::util::backend::<S::Db>() {
        "postgres" => format!("(now() + interval '{ms} milliseconds')"),
        "mysql" => format!("(UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND)", ms * 1000),
        "sqlite" => format!(
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '{}{}.{:03} seconds')",
            if ms < 0 { '-' } else { '+' },
            ms.abs() / 1000,
            ms.abs() % 1000
        ),
        other => panic!("no clock SQL for {other}"),
    }
}

/// Milliseconds from the database's now to `locked_until` (negative once expired).
fn ms_left_sql<S: Support>() -> &'static str {
    match crate::conformance::util::backend::<S::Db>() {
        "postgres" => "CAST(EXTRACT(EPOCH FROM (locked_until - now())) * 1000 AS BIGINT)",
        "mysql" => {
            "CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 \
             AS SIGNED)"
        }
        "sqlite" => "CAST((julianday(locked_until) - julianday('now')) * 86400000.0 AS INTEGER)",
        other => panic!("no clock SQL for {other}"),
    }
}

/// The pace of [`Ctx::until_lease_expired`]'s probes.
const POLL_EVERY: Duration = Duration::from_millis(10);

/// Probes the database until `probe` says true, at most once per [`POLL_EVERY`], bounded by
/// `within`; returns the number of probes. The pace keeps a wait of seconds to hundreds of
/// queries instead of tens of thousands competing with the other tests for two cores: what
/// ends the wait is the database's answer, never the time spent.
pub(crate) async fn poll_db<F, Fut>(secs: u64, what: &str, mut probe: F) -> u64
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut polls = 0;
    let mut pace = tokio::time::interval(POLL_EVERY);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    within(secs, what, async {
        loop {
            pace.tick().await;
            polls += 1;
            if probe().await {
                break;
            }
        }
    })
    .await;
    polls
}

/// One marker, read back from the database.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Marker {
    pub(crate) completed: bool,
    /// `locked_until` is NULL (released or completed).
    pub(crate) unlocked: bool,
    /// `locked_until` is after the database's now.
    pub(crate) live: bool,
    pub(crate) token: i64,
    pub(crate) attempts: i64,
}

impl<S: Support> Ctx<S> {
    async fn marker_value(&self, key: &str, expr: &str) -> i64 {
        let sql = format!(
            "SELECT CAST({expr} AS {}) FROM {} WHERE {} = $1",
            S::BIGINT,
            self.store.table(),
            S::KEY_TEXT
        );
        self.scalar_with(&sql, &[Bind::Str(key.to_owned())]).await
    }

    /// The marker of `key` (which must exist).
    pub(crate) async fn marker(&self, key: &str) -> Marker {
        let now = db_now::<S>();
        let flag = |cond: &str| format!("CASE WHEN {cond} THEN 1 ELSE 0 END");
        Marker {
            completed: self.marker_value(key, &flag("state = 'completed'")).await == 1,
            unlocked: self.marker_value(key, &flag("locked_until IS NULL")).await == 1,
            live: self
                .marker_value(key, &flag(&format!("locked_until > {now}")))
                .await
                == 1,
            token: self.marker_value(key, "token").await,
            attempts: self.marker_value(key, "attempts").await,
        }
    }

    /// Whether the database says the lease of `key` ran out: `locked_until <= now()`.
    pub(crate) async fn lease_expired(&self, key: &str) -> bool {
        let cond = format!(
            "CASE WHEN locked_until IS NOT NULL AND locked_until <= {} THEN 1 ELSE 0 END",
            db_now::<S>()
        );
        self.marker_value(key, &cond).await == 1
    }

    /// Polls the database until the lease of `key` ran out on its clock; returns the polls.
    pub(crate) async fn until_lease_expired(&self, key: &str) -> u64 {
        poll_db(60, "the database saying the lease ran out", || {
            self.lease_expired(key)
        })
        .await
    }

    /// Sets `locked_until` of `key` to the SQL expression `at`.
    pub(crate) async fn set_locked_until(&self, key: &str, at: &str) {
        let sql = format!(
            "UPDATE {} SET locked_until = {at} WHERE {} = $1",
            self.store.table(),
            S::KEY_TEXT
        );
        let mut conn = self.pool.acquire().await.expect("a connection");
        let n = <S::Db as crate::conformance::TestDb>::execute(
            &mut conn,
            &sql,
            &[Bind::Str(key.to_owned())],
        )
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
        assert_eq!(n, 1, "{sql}");
    }
}

fn key(s: &str) -> Key {
    Key::new(s).expect("a valid key")
}

/// A lease claimed by hand (not through a handler).
async fn claim_by_hand<S: Support>(ctx: &Ctx<S>, k: &str, lease: Duration) -> Lease {
    match ctx
        .store
        .lease(SCOPE, &key(k), LeaseOptions::new(lease))
        .await
    {
        Ok(Claimed::Fresh(lease)) => lease,
        other => panic!("expected a fresh lease, got {other:?}"),
    }
}

fn lease_lost<T: std::fmt::Debug>(result: Result<T, TestError>) {
    match result {
        Err(TestError::Idem(Error::Lease(LeaseError::Lost { scope, .. }))) => {
            assert_eq!(scope, SCOPE)
        }
        other => panic!("expected LeaseError::Lost, got {other:?}"),
    }
}

pub(crate) async fn lease_first_delivery_applies_second_is_duplicate<S: Support>() {
    let mut ctx = Ctx::<S>::new("lease_dup", 2).await;
    let charges = ctx.create_table("c", CHARGES_COLUMNS).await;
    // The provider writes on a pool of its own, never the store's.
    let outside = S::connect(&ctx.url, 1).await;
    let provider = Provider::table(outside.clone(), &charges);
    let job = ctx.job("order-1", 1, 100);
    let seen = applied_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert!(
        seen.token > 0,
        "a fencing token is positive: {}",
        seen.token
    );
    assert_eq!(seen.attempt, 1);
    assert_eq!(seen.idempotency_key, "14:billing.charge|7:order-1");
    duplicate_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    duplicate_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert_eq!(provider.requests(), 1, "the outside call happened once");
    let rows = ctx.scalar(&format!("SELECT COUNT(*) FROM {charges}")).await;
    assert_eq!(rows, 1, "requests the provider's table saw");
    let m = ctx.marker(&job.key).await;
    assert!(m.completed && m.unlocked, "{m:?}");
    assert_eq!((m.token, m.attempts), (seen.token, 1));
    outside.close().await;
    ctx.cleanup().await;
}

pub(crate) async fn lease_live_lease_is_in_progress_without_running_the_body<S: Support>() {
    let ctx = Ctx::<S>::new("lease_live", 4).await;
    let provider = Arc::new(Provider::<S::Db>::in_memory());
    let hold = Arc::new(Hold::default());
    let job = ctx.job("order-2", 2, 200);
    let first = {
        let (store, job, provider, hold) = (
            ctx.store.clone(),
            job.clone(),
            provider.clone(),
            hold.clone(),
        );
        tokio::spawn(async move { charge(&store, &job, &*provider, How::Park(&hold)).await })
    };
    within(60, "the first body parking", hold.entered()).await;
    let m = ctx.marker(&job.key).await;
    assert!(!m.completed && m.live, "{m:?}");
    let token = m.token;
    let second = within(
        60,
        "a second delivery",
        charge(&ctx.store, &job, &*provider, How::Pay),
    )
    .await;
    in_progress(second);
    assert_eq!(provider.requests(), 1, "the second body ran");
    assert_eq!(
        ctx.marker(&job.key).await.token,
        token,
        "the second took over"
    );
    hold.release();
    let seen = applied_seen(within(60, "the first delivery", first).await.expect("task"));
    assert_eq!((seen.token, seen.attempt), (token, 1));
    duplicate_seen(charge(&ctx.store, &job, &*provider, How::Pay).await);
    assert_eq!(provider.requests(), 1);
    ctx.cleanup().await;
}

pub(crate) async fn lease_stalled_call_times_out_releases_and_redelivery_applies<S: Support>() {
    let ctx = Ctx::<S>::new("lease_stall", 2).await;
    let provider = Provider::<S::Db>::in_memory();
    let answer = tokio::sync::Notify::new();
    let job = ctx.job("order-3", 3, 300);
    // The answer never comes while the call runs: only the 300 ms timeout can end it.
    let stalled = charge_stalling(&ctx.store, &job, &provider, &answer);
    match within(60, "a stalled call", stalled).await {
        Err(TestError::Idem(Error::Lease(LeaseError::Timeout { scope, after, .. }))) => {
            assert_eq!(scope, SCOPE);
            assert_eq!(after, Duration::from_millis(300));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    // The answer arrives after the call was given up (nothing waits for it any more).
    answer.notify_waiters();
    let m = ctx.marker(&job.key).await;
    let first = m.token;
    assert_eq!(
        m,
        Marker {
            completed: false,
            unlocked: true,
            live: false,
            token: first,
            attempts: 1
        },
        "a timed-out call releases its key at once, keeping its attempt"
    );
    let seen = applied_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert!(
        seen.token > first,
        "a takeover's token grows: {} after {first}",
        seen.token
    );
    assert_eq!(seen.attempt, 2);
    assert_eq!((provider.requests(), provider.charges()), (2, 1));
    let m = ctx.marker(&job.key).await;
    assert!(
        m.completed && m.unlocked && m.token == seen.token && m.attempts == 2,
        "{m:?}"
    );
    ctx.cleanup().await;
}

pub(crate) async fn lease_handler_error_releases_at_once_and_redelivery_applies<S: Support>() {
    let ctx = Ctx::<S>::new("lease_err", 2).await;
    let provider = Provider::<S::Db>::in_memory();
    let job = ctx.job("order-4", 4, 400);
    match charge(&ctx.store, &job, &provider, How::Fail).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the handler's own error, got {other:?}"),
    }
    let m = ctx.marker(&job.key).await;
    assert!(!m.completed && m.unlocked, "not released at once: {m:?}");
    assert_eq!(m.attempts, 1);
    let seen = applied_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert!(
        seen.token > m.token,
        "a takeover's token grows: {} after {}",
        seen.token,
        m.token
    );
    assert_eq!(seen.attempt, 2);
    duplicate_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert_eq!((provider.requests(), provider.charges()), (2, 1));
    ctx.cleanup().await;
}

pub(crate) async fn lease_expired_lease_is_taken_over_by_exactly_one_of_32<S: Support>() {
    let ctx = Ctx::<S>::new("lease_race", 16).await;
    // The taker parks in its body: every other delivery meets its live lease.
    let parked = race_an_expired_lease(&ctx, "order-32a", true).await;
    assert_eq!(
        parked,
        (RACERS - 1, 0),
        "(in progress, duplicate) while the taker is parked"
    );
    // Free-running: the others meet the live lease or, once it completed, the completion.
    let (busy, dups) = race_an_expired_lease(&ctx, "order-32b", false).await;
    assert_eq!(busy + dups, RACERS - 1);
    ctx.cleanup().await;
}

const RACERS: usize = 32;

/// [`RACERS`] concurrent deliveries of `k` against an expired lease: exactly one takes it over
/// (a larger token, attempt 2) and calls the provider; returns the others' (in progress,
/// duplicate).
async fn race_an_expired_lease<S: Support>(ctx: &Ctx<S>, k: &str, park: bool) -> (usize, usize) {
    let provider = Arc::new(Provider::<S::Db>::in_memory());
    let hold = Arc::new(Hold::default());
    let job = ctx.job(k, 32, 3200);
    // A holder that claimed for the shortest lease (1 s) and never finished: its lease runs out on the database.
    let stale = claim_by_hand(ctx, &job.key, idem::MIN_LEASE).await;
    assert_eq!(stale.attempt(), 1);
    let polls = ctx.until_lease_expired(&job.key).await;
    println!("{k}: expired after {polls} polls of the database");
    let start = Arc::new(tokio::sync::Barrier::new(RACERS));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..RACERS {
        let (store, job, provider, start, hold) = (
            ctx.store.clone(),
            job.clone(),
            provider.clone(),
            start.clone(),
            hold.clone(),
        );
        tasks.spawn(async move {
            start.wait().await;
            let how = if park { How::Park(&hold) } else { How::Pay };
            charge(&store, &job, &*provider, how).await
        });
    }
    let (mut applied, mut busy, mut dups) = (Vec::new(), 0, 0);
    let mut tally = |r: Result<idem::Outcome<Seen>, TestError>| match r {
        Ok(idem::Outcome::Applied(seen)) => applied.push(seen),
        Ok(idem::Outcome::Duplicate | idem::Outcome::Replayed(_)) => dups += 1,
        Ok(idem::Outcome::Failed(f)) => panic!("no delivery fails for good here: {f:?}"),
        Err(TestError::Idem(Error::InProgress { .. })) => busy += 1,
        Err(e) => panic!("a racing delivery failed: {e:?}"),
    };
    if park {
        // The taker cannot return before it is released: the first 31 to return are the others.
        within(60, "the taker parking", hold.entered()).await;
        for _ in 1..RACERS {
            let r = within(120, "a racing delivery", tasks.join_next()).await;
            tally(r.expect("a task").expect("task"));
        }
        hold.release();
    }
    while let Some(r) = within(120, "a racing delivery", tasks.join_next()).await {
        tally(r.expect("task"));
    }
    println!(
        "{k}: {RACERS} deliveries: {} applied, {busy} in progress, {dups} duplicate",
        applied.len()
    );
    assert_eq!(applied.len(), 1, "{k}: takeovers: {applied:?}");
    assert!(applied[0].token > stale.token(), "{k}: {applied:?}");
    assert_eq!(applied[0].attempt, 2);
    assert_eq!(
        provider.requests(),
        1,
        "{k}: the outside call happened once"
    );
    // The stale holder comes back: its result is not recorded.
    lease_lost(stale.finish::<(), TestError>(Ok(())).await);
    let m = ctx.marker(&job.key).await;
    let taken = applied[0].token;
    assert!(
        m.completed && m.token == taken && m.attempts == 2,
        "{k}: {m:?}"
    );
    (busy, dups)
}

/// The renewal rounds of [`lease_renew_keeps_the_lease_and_fails_after_a_takeover`].
const RENEW_LEASE_MS: i64 = 2000;

pub(crate) async fn lease_renew_keeps_the_lease_and_fails_after_a_takeover<S: Support>() {
    let mut ctx = Ctx::<S>::new("lease_renew", 2).await;
    let provider = Provider::<S::Db>::in_memory();
    let job = ctx.job("order-7", 7, 700);
    // A long call by hand (`Store::lease` has no timeout): a 2 s lease, renewed.
    let lease = claim_by_hand(&ctx, &job.key, Duration::from_millis(2000)).await;
    // The first `locked_until`, kept in a table of its own to compare on the database.
    let first = unique_name("first", &ctx.tag);
    ctx.exec(&format!(
        "CREATE TABLE {first} AS SELECT locked_until AS t FROM {}",
        ctx.store.table()
    ))
    .await;
    ctx.tables.push(first.clone());
    let now = db_now::<S>();
    let past_first = format!(
        "SELECT CAST(CASE WHEN (SELECT t FROM {first}) < {now} THEN 1 ELSE 0 END AS {})",
        S::BIGINT
    );
    let mut renewals = 0_u32;
    within(60, "renewing past the first lease", async {
        loop {
            lease.renew().await.expect("renew while holding the key");
            renewals += 1;
            if ctx.scalar(&past_first).await == 1 {
                break;
            }
            // Renew again when half of the lease is left (or the first lease is over).
            let (c, k, past) = (&ctx, job.key.as_str(), past_first.as_str());
            poll_db(60, "half of the renewed lease", move || async move {
                c.scalar(past).await == 1
                    || c.marker_value(k, ms_left_sql::<S>()).await < RENEW_LEASE_MS / 2
            })
            .await;
        }
    })
    .await;
    lease.renew().await.expect("renew while holding the key");
    println!("renewed {renewals} times until the database's now passed the first lease");
    // The first lease is over on the database's clock; the renewed one keeps the key.
    in_progress(charge(&ctx.store, &job, &provider, How::Pay).await);
    let m = ctx.marker(&job.key).await;
    assert!(
        m.live && m.token == lease.token(),
        "the renewed lease ran out before it was checked (a machine stalled for 2 s?): {m:?}"
    );
    assert_eq!(provider.requests(), 0);
    // No more renewals: the lease runs out and another delivery takes the key over.
    let polls = ctx.until_lease_expired(&job.key).await;
    println!("renewed lease expired after {polls} polls");
    let seen = applied_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert!(
        seen.token > lease.token(),
        "{seen:?} after {}",
        lease.token()
    );
    assert_eq!(seen.attempt, 2);
    match lease.renew().await {
        Err(Error::Lease(LeaseError::Lost { scope, .. })) => assert_eq!(scope, SCOPE),
        other => panic!("renewing after a takeover: expected LeaseError::Lost, got {other:?}"),
    }
    lease_lost(lease.finish::<(), TestError>(Ok(())).await);
    let m = ctx.marker(&job.key).await;
    assert!(
        m.completed && m.token == seen.token && m.attempts == 2,
        "{m:?}"
    );
    ctx.cleanup().await;
}

pub(crate) async fn lease_claims_use_the_database_clock<S: Support>() {
    let ctx = Ctx::<S>::new("lease_clock", 2).await;
    let provider = Provider::<S::Db>::in_memory();

    // 1. After a claim of 30 s, the database's own arithmetic: now < locked_until <= now + 30 s.
    let held = claim_by_hand(&ctx, "order-8a", Duration::from_secs(30)).await;
    let left = ctx.marker_value("order-8a", ms_left_sql::<S>()).await;
    println!("locked_until - now() = {left} ms on the database after a 30 s claim");
    assert!(0 < left && left <= 30_000, "{left} ms");
    let bounded = format!(
        "CASE WHEN locked_until > {} AND locked_until <= {} THEN 1 ELSE 0 END",
        db_now::<S>(),
        db_now_plus::<S>(30_000)
    );
    assert_eq!(ctx.marker_value("order-8a", &bounded).await, 1);
    applied_by_hand(held.finish::<(), TestError>(Ok(())).await);

    // 2. A lease claimed for the shortest lease (1 s), expired on the database, then moved ten years ahead by
    // SQL: the worker's 1 s is long over, yet a delivery is refused: only the row's
    // `locked_until` against the database's now decides.
    let job = ctx.job("order-8b", 8, 800);
    let short = claim_by_hand(&ctx, &job.key, idem::MIN_LEASE).await;
    ctx.until_lease_expired(&job.key).await;
    ctx.set_locked_until(&job.key, &db_now_plus::<S>(10 * 365 * 86_400_000))
        .await;
    in_progress(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert_eq!(provider.requests(), 0);

    // 3. The other way: a holder whose own deadline is about 30 s away, but whose row says
    // the lease ended on the database's clock, is taken over at once.
    let job = ctx.job("order-8c", 9, 900);
    let long = claim_by_hand(&ctx, &job.key, Duration::from_secs(30)).await;
    assert!(long.remaining() > Duration::ZERO);
    ctx.set_locked_until(&job.key, db_now::<S>()).await;
    let seen = applied_seen(charge(&ctx.store, &job, &provider, How::Pay).await);
    assert!(seen.token > long.token(), "{seen:?} after {}", long.token());
    assert_eq!(seen.attempt, 2);
    lease_lost(long.finish::<(), TestError>(Ok(())).await);
    // The short holder still holds its token: its error releases the key.
    match short.finish::<(), TestError>(Err(TestError::Refused)).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the holder's own error, got {other:?}"),
    }
    assert!(ctx.marker("order-8b").await.unlocked);
    ctx.cleanup().await;
}

/// The 30 s lease of the clock case completes normally.
fn applied_by_hand(result: Result<idem::Outcome<()>, TestError>) {
    match result {
        Ok(idem::Outcome::Applied(())) => {}
        other => panic!("expected Applied, got {other:?}"),
    }
}

pub(crate) async fn lease_invalid_key_is_refused_before_any_io<S: Support>() {
    let ctx = Ctx::<S>::new("lease_badkey", 2).await;
    let provider = Provider::<S::Db>::in_memory();
    // A store whose pool is closed: any statement would fail with `PoolClosed`.
    let closed = S::connect(&ctx.url, 1).await;
    let offline = idem::Store::new(closed.clone())
        .with_table(ctx.store.table())
        .expect("table name");
    closed.close().await;
    let cases = [
        (String::new(), idem::KeyError::Empty),
        ("k".repeat(256), idem::KeyError::TooLong { len: 256 }),
        ("a\0b".to_owned(), idem::KeyError::Nul),
    ];
    for (k, want) in cases {
        let job = ctx.job(&k, 10, 1000);
        for store in [&ctx.store, &offline] {
            match charge(store, &job, &provider, How::Pay).await {
                Err(TestError::Idem(Error::Refused(Refusal::Key(got)))) => {
                    assert_eq!(got, want, "{k:?}")
                }
                other => panic!("key {k:?}: expected Refusal::Key, got {other:?}"),
            }
        }
    }
    // The control: a valid key on the closed pool does reach for the database.
    let job = ctx.job("order-10", 10, 1000);
    match charge(&offline, &job, &provider, How::Pay).await {
        Err(TestError::Idem(Error::Database(_))) => {}
        other => panic!("a valid key on a closed pool: expected Database, got {other:?}"),
    }
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(provider.requests(), 0);
    ctx.cleanup().await;
}

pub(crate) async fn lease_panicking_body_releases_the_key<S: Support>() {
    let ctx = Ctx::<S>::new("lease_panic", 2).await;
    let provider = Arc::new(Provider::<S::Db>::in_memory());
    let job = ctx.job("order-11", 11, 1100);
    let joined = {
        let (store, job, provider) = (ctx.store.clone(), job.clone(), provider.clone());
        tokio::spawn(async move { charge(&store, &job, &*provider, How::Panic).await }).await
    };
    match joined {
        Err(e) if e.is_panic() => {}
        other => panic!("expected the task to panic, got {other:?}"),
    }
    // The release runs in the background: wait for the database to show it.
    let (c, k) = (&ctx, job.key.as_str());
    let polls = poll_db(
        60,
        "the background release after a panic",
        move || async move { c.marker(k).await.unlocked },
    )
    .await;
    println!("released after a panic: {polls} polls");
    let m = ctx.marker(&job.key).await;
    assert!(!m.completed && m.token > 0 && m.attempts == 1, "{m:?}");
    let seen = applied_seen(charge(&ctx.store, &job, &*provider, How::Pay).await);
    assert!(seen.token > m.token, "{seen:?} after {m:?}");
    assert_eq!(seen.attempt, 2);
    assert_eq!((provider.requests(), provider.charges()), (2, 1));
    ctx.cleanup().await;
}

/// The statement that moves a session to UTC+05:00, and the query that reads the session's
/// zone; `None` where the database has no session time zone (SQLite's `'now'` is UTC).
fn another_time_zone<S: Support>() -> Option<(&'static str, &'static str)> {
    match crate::conformance::util::backend::<S::Db>() {
        // POSIX zone names count west-positive: `UTC-5` is five hours east of Greenwich.
        "postgres" => Some((
            "SET TIME ZONE 'UTC-5'",
            "SELECT current_setting('TimeZone')",
        )),
        "mysql" => Some(("SET time_zone = '+05:00'", "SELECT @@session.time_zone")),
        _ => None,
    }
}

/// Two workers whose sessions are in different time zones share one lease clock: a 30 s lease
/// claimed from a UTC session is live for a session at UTC+05:00 too. On MySQL / MariaDB
/// `locked_until` is a `DATETIME(6)`, which holds no zone: idem writes and compares it with
/// `UTC_TIMESTAMP(6)`, never the session-local `CURRENT_TIMESTAMP(6)` (with which the +05:00
/// session took the live lease over).
pub(crate) async fn lease_is_live_for_a_session_in_another_time_zone<S: Support>() {
    let ctx = Ctx::<S>::new("lease_tz", 2).await;
    let Some((set_zone, zone_sql)) = another_time_zone::<S>() else {
        panic!(
            "{} has no session time zone: do not list this case",
            ctx.url
        )
    };
    // One connection, kept by its pool: the session setting stays for every statement.
    let east = S::connect(&ctx.url, 1).await;
    let zone = || async {
        let mut conn = east.acquire().await.expect("a connection");
        let zone = <S::Db as crate::conformance::TestDb>::fetch_strings(&mut conn, zone_sql)
            .await
            .expect("the session's time zone");
        zone.concat()
    };
    {
        let mut conn = east.acquire().await.expect("a connection");
        <S::Db as crate::conformance::TestDb>::execute(&mut conn, set_zone, &[])
            .await
            .unwrap_or_else(|e| panic!("{set_zone}: {e}"));
    }
    let before = zone().await;
    assert!(
        before.contains('5'),
        "the session's time zone is {before:?}"
    );
    let east_store = idem::Store::new(east.clone())
        .with_table(ctx.store.table())
        .expect("table name");
    let provider = Provider::<S::Db>::in_memory();
    let job = ctx.job("order-tz", 12, 1200);
    let held = claim_by_hand(&ctx, &job.key, Duration::from_secs(30)).await;
    let east_answer = charge(&east_store, &job, &provider, How::Pay).await;
    assert_eq!(zone().await, before, "the pool changed its session");
    in_progress(east_answer);
    assert_eq!(provider.requests(), 0);
    match held.finish::<(), TestError>(Ok(())).await {
        Ok(idem::Outcome::Applied(())) => {}
        other => panic!("the holder: expected Applied, got {other:?}"),
    }
    duplicate_seen(charge(&east_store, &job, &provider, How::Pay).await);
    east.close().await;
    ctx.cleanup().await;
}
