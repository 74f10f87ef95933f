//! Group-commit handlers: the same effect as `handlers::apply`, in scope `apply`, with the
//! attribute's `group` flag (the caller passes an `idem::Group`), and by hand on
//! `Group::claim`.

use std::sync::atomic::{AtomicUsize, Ordering};

use idem::{Claimed, Group, Key, Outbox, Outcome};
use sqlx::Transaction;

use super::db::{Bind, TestDb};
use super::handlers::{Hold, Job, TestError, Then, hang_in_body, insert_effect};

/// Counts the calls whose body ended and whose answer is still to come (they wait for their
/// group's commit), and the most there were at once.
#[derive(Default)]
pub(crate) struct Waiting {
    now: AtomicUsize,
    pub(crate) most: AtomicUsize,
}

impl Waiting {
    fn enter(&self) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

#[idem::idempotent(key = "job.key", scope = "apply", group)]
pub(crate) async fn apply_grouped<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    then: Then,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "group").await?;
    match then {
        Then::Commit => Ok(job.amount),
        Then::Fail => Err(TestError::Refused),
        Then::Panic => panic!("handler panics on purpose (conformance test)"),
        Then::Hang => match hang_in_body().await {},
    }
}

/// [`apply_grouped`] counting the calls that wait for their group's commit.
pub(crate) async fn apply_grouped_counted<DB: TestDb>(
    group: &Group<DB>,
    job: &Job,
    waiting: &Waiting,
) -> Result<Outcome<i64>, TestError> {
    let done = apply_grouped_waiting(group, job, waiting).await;
    if matches!(done, Ok(Outcome::Applied(_))) {
        waiting.leave();
    }
    done
}

#[idem::idempotent(key = "job.key", scope = "apply", group)]
async fn apply_grouped_waiting<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    waiting: &Waiting,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "group").await?;
    // Counted as waiting from here until the caller has its answer.
    waiting.enter();
    Ok(job.amount)
}

/// `apply_grouped` whose first body parks on `hold` after its effect.
#[idem::idempotent(key = "job.key", scope = "apply", group)]
pub(crate) async fn apply_grouped_holding<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    hold: &Hold,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "group").await?;
    hold.park_first().await;
    Ok(job.amount)
}

/// `apply_grouped` whose body, for the job of id `swallower`, runs a statement that fails (id
/// 0 again in `table`, which holds it) and swallows its error, as a careless body does.
#[idem::idempotent(key = "job.key", scope = "apply", group)]
pub(crate) async fn apply_grouped_swallowing<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    table: &str,
    swallower: i64,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "group").await?;
    if job.id == swallower {
        let sql = format!("INSERT INTO {table} (id) VALUES ($1)");
        let failed = DB::execute(&mut **tx, &sql, &[Bind::I64(0)]).await;
        failed.expect_err("id 0 is there already");
    }
    Ok(job.amount)
}

/// With `replay`: the value is the job's amount, stored with the marker.
#[idem::idempotent(key = "job.key", scope = "apply.replay", group, replay)]
pub(crate) async fn apply_grouped_replay<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "replay").await?;
    Ok(job.amount)
}

/// With a fingerprint of the amount and an outbox message per job.
#[idem::idempotent(
    key = "job.key",
    scope = "apply.print",
    group,
    fingerprint = "job.amount"
)]
pub(crate) async fn apply_grouped_sending<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    outbox: &mut Outbox,
    job: &Job,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "print").await?;
    outbox.send("shipping", &job.id)?;
    Ok(job.amount)
}

/// By hand on `Group::claim`, the same effect, the body run within the group's bound; `then`
/// as `apply`'s.
pub(crate) async fn apply_grouped_by_hand<DB: TestDb>(
    group: &Group<DB>,
    job: &Job,
    then: Then,
) -> Result<Outcome<i64>, TestError> {
    let key = Key::new(&job.key).map_err(idem::Error::from)?;
    match group.claim("apply", &key).await? {
        Claimed::Fresh(mut guard) => {
            let body = guard.body();
            let result = body
                .bounded(async {
                    insert_effect(guard.tx(), job, "group").await?;
                    match then {
                        Then::Fail => Err(TestError::Refused),
                        Then::Hang => match hang_in_body().await {},
                        _ => Ok(job.amount),
                    }
                })
                .await;
            guard.finish(result).await
        }
        Claimed::Duplicate | Claimed::Replayed(_) => Ok(Outcome::Duplicate),
        Claimed::Failed(failure) => Ok(Outcome::Failed(failure)),
    }
}

/// By hand on `Group::claim`: the first call parks on `hold` after its claim and outside any
/// body bound, holding its group's turn, then writes the effect.
pub(crate) async fn apply_grouped_by_hand_parking<DB: TestDb>(
    group: &Group<DB>,
    job: &Job,
    hold: &Hold,
) -> Result<Outcome<i64>, TestError> {
    let key = Key::new(&job.key).map_err(idem::Error::from)?;
    match group.claim("apply", &key).await? {
        Claimed::Fresh(mut guard) => {
            hold.park_first().await;
            let result = insert_effect(guard.tx(), job, "group").await;
            guard
                .finish(result.map(|()| job.amount).map_err(TestError::from))
                .await
        }
        Claimed::Duplicate | Claimed::Replayed(_) => Ok(Outcome::Duplicate),
        Claimed::Failed(failure) => Ok(Outcome::Failed(failure)),
    }
}

/// Lease mode in scope `apply`: the effect row written outside any transaction, once the
/// lease is held (what a lease handler's outside call stands for).
pub(crate) async fn lease_apply<DB: TestDb>(
    store: &idem::Store<DB>,
    job: &Job,
) -> Result<Outcome<i64>, TestError> {
    lease_apply_on(store, job, store.pool()).await
}

#[idem::idempotent(key = "job.key", scope = "apply", lease = "30s")]
async fn lease_apply_on<DB: TestDb>(
    lease: &idem::Lease,
    job: &Job,
    pool: &sqlx::Pool<DB>,
) -> Result<i64, TestError> {
    let _ = lease;
    let sql = format!(
        "INSERT INTO {} (id, amount, origin) VALUES ($1, $2, $3)",
        job.effects
    );
    let binds = [
        super::db::Bind::I64(job.id),
        super::db::Bind::I64(job.amount),
        super::db::Bind::Str("lease".to_owned()),
    ];
    let mut conn = pool.acquire().await?;
    DB::execute(&mut conn, &sql, &binds).await?;
    Ok(job.amount)
}

/// [`top_up_grouped`] in the lane of its account: the top-ups of one account meet in one lane.
#[idem::idempotent(key = "job.key", scope = "hot", group, lane = "account")]
pub(crate) async fn top_up_in_its_lane<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    accounts: &str,
    account: i64,
) -> Result<(), TestError> {
    top_up_rows(tx, job, accounts, account).await
}

/// [`top_up_in_its_lane`] by hand, on `Group::claim_in_lane`; with `hold`, the first call
/// parks on it after its claim, holding its lane's turn.
pub(crate) async fn top_up_in_its_lane_by_hand<DB: TestDb>(
    group: &Group<DB>,
    job: &Job,
    accounts: &str,
    account: i64,
    hold: Option<&Hold>,
) -> Result<Outcome<()>, TestError> {
    let key = Key::new(&job.key).map_err(idem::Error::from)?;
    let options = idem::ClaimOptions::new();
    match group.claim_in_lane(account, "hot", &key, options).await? {
        Claimed::Fresh(mut guard) => {
            if let Some(hold) = hold {
                hold.park_first().await;
            }
            let body = guard.body();
            let result = body
                .bounded(top_up_rows(guard.tx(), job, accounts, account))
                .await;
            guard.finish(result).await
        }
        Claimed::Duplicate | Claimed::Replayed(_) => Ok(Outcome::Duplicate),
        Claimed::Failed(failure) => Ok(Outcome::Failed(failure)),
    }
}

async fn top_up_rows<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    accounts: &str,
    account: i64,
) -> Result<(), TestError> {
    let sql = format!("UPDATE {accounts} SET credits = credits + $1 WHERE id = $2");
    DB::execute(
        &mut **tx,
        &sql,
        &[Bind::I64(job.amount), Bind::I64(account)],
    )
    .await?;
    insert_effect(tx, job, "hot").await?;
    Ok(())
}

/// A top-up of a hot account: one of few rows that many concurrent jobs update.
#[idem::idempotent(key = "job.key", scope = "hot", group)]
pub(crate) async fn top_up_grouped<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    accounts: &str,
    account: i64,
) -> Result<(), TestError> {
    top_up_rows(tx, job, accounts, account).await
}
