//! Bodies whose statements fail: returned with `?`, or swallowed.

use std::sync::Arc;
use std::time::Duration;

use idem::{Outcome, Store};

use idem::{ClaimOptions, Claimed, Isolation};
use sqlx::{Pool, Transaction};

use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::util::db_code;
use crate::conformance::util::within;
use crate::conformance::{Support, TestDb};

/// A constraint violated by the effect's second statement, returned with `?`.
async fn failing_statement_releases_the_claim<S: Support>(
    tag: &str,
    columns: &str,
    seed_row: Option<i64>,
    bad: i64,
    want: ::sqlx::error::ErrorKind,
) {
    let mut ctx = Ctx::<S>::new(tag, 2).await;
    let table = ctx.create_table("c", columns).await;
    let rows = format!("SELECT COUNT(*) FROM {table}");
    if let Some(v) = seed_row {
        ctx.exec(&format!("INSERT INTO {table} (v) VALUES ({v})"))
            .await;
    }
    let before = ctx.scalar(&rows).await;
    let job = ctx.job("job-constraint", 11, 110);
    match apply_and_insert(&ctx.store, &job, &table, bad).await {
        Err(TestError::Db(e)) => {
            let kind = e.as_database_error().map(|d| d.kind());
            assert_eq!(kind, Some(want), "{e}");
        }
        other => panic!("expected a constraint violation, got {other:?}"),
    }
    assert_eq!(
        ctx.markers().await,
        0,
        "the claim survived a failed statement"
    );
    assert_eq!(
        ctx.effects_total().await,
        0,
        "the effect survived a failed statement"
    );
    assert_eq!(ctx.scalar(&rows).await, before);
    assert_eq!(
        applied(apply_and_insert(&ctx.store, &job, &table, 5).await),
        110
    );
    duplicate(apply_and_insert(&ctx.store, &job, &table, 6).await);
    assert_eq!(ctx.effects(11).await, 1);
    assert_eq!(ctx.markers().await, 1);
    assert_eq!(ctx.scalar(&rows).await, before + 1);
    ctx.cleanup().await;
}

pub(crate) async fn failing_effect_statement_unique_violation_releases_the_claim<S: Support>() {
    failing_statement_releases_the_claim::<S>(
        "unique",
        "(v BIGINT NOT NULL UNIQUE)",
        Some(1),
        1,
        ::sqlx::error::ErrorKind::UniqueViolation,
    )
    .await;
}

pub(crate) async fn failing_effect_statement_check_violation_releases_the_claim<S: Support>() {
    failing_statement_releases_the_claim::<S>(
        "check",
        "(v BIGINT NOT NULL CHECK (v >= 0))",
        None,
        -1,
        ::sqlx::error::ErrorKind::CheckViolation,
    )
    .await;
}

/// The effect, then a failure on which the database rolls the whole transaction back, with
/// its error swallowed; then one more statement (into `after`, its error ignored too), and
/// `Ok`: what a careless body does.
#[idem::idempotent(key = "job.key", scope = "apply")]
async fn apply_swallowing<S: Support>(
    tx: &mut Transaction<'_, S::Db>,
    job: &Job,
    other: &Pool<S::Db>,
    rows: &str,
    after: &str,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "apply").await?;
    S::swallow_a_rollback(&mut **tx, other, rows).await;
    let sql = format!("INSERT INTO {after} (id) VALUES ($1)");
    drop(S::Db::execute(&mut **tx, &sql, &[Bind::I64(job.id)]).await);
    Ok(job.amount)
}

pub(crate) async fn body_that_swallows_a_rollback_is_rolled_back_not_applied<S: Support>() {
    let mut ctx = Ctx::<S>::new("swallow", 2).await;
    let rows = ctx
        .create_table("r", "(id BIGINT NOT NULL PRIMARY KEY, v BIGINT NOT NULL)")
        .await;
    let values: Vec<String> = (1..=100).map(|i| format!("({i}, 0)")).collect();
    ctx.exec(&format!(
        "INSERT INTO {rows} (id, v) VALUES {}",
        values.join(", ")
    ))
    .await;
    let after = ctx.create_table("a", "(id BIGINT NOT NULL)").await;
    // A second session for MySQL's deadlock, and an observer of its lock wait.
    let other = S::connect(&ctx.url, 2).await;
    let job = ctx.job("job-swallow", 17, 170);
    let key = idem::Key::new(job.key.as_str()).expect("a valid key");
    let call = apply_swallowing::<S>(&ctx.store, &job, &other, &rows, &after);
    let result = within(120, "the swallowing body", call).await;
    // Nothing was kept: the consumer loop retries it, and dead-letters it at the cap.
    let settle = idem::Settle::new().max_deliveries(2);
    assert!(matches!(
        settle.decide(&result, 1),
        idem::Disposition::Retry { .. }
    ));
    assert!(matches!(
        settle.decide(&result, 2),
        idem::Disposition::DeadLetter { .. }
    ));
    match result {
        Err(TestError::Idem(idem::Error::NotKept(idem::NotKept::RolledBack { scope, key: k }))) => {
            assert_eq!((scope.as_str(), k.as_str()), ("apply", key.as_str()));
        }
        other => panic!("expected NotKept::RolledBack, got {other:?}"),
    }
    assert_eq!(
        ctx.markers().await,
        0,
        "a marker survived the database's rollback"
    );
    assert_eq!(
        ctx.effects_total().await,
        0,
        "an effect survived the database's rollback"
    );
    // What ran after the rollback ran outside the transaction: idem cannot undo it, which is
    // why the error tells the body to return database errors with `?`.
    let kept = ctx.scalar(&format!("SELECT COUNT(*) FROM {after}")).await;
    assert_eq!(kept, i64::from(S::STATEMENT_AFTER_ROLLBACK_KEPT));
    let next = within(60, "the redelivery", apply(&ctx.store, &job, Then::Commit)).await;
    assert_eq!(applied(next), 170);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(17).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    other.close().await;
    ctx.cleanup().await;
}

/// PostgreSQL only: a write skew between the body (serializable) and another serializable
/// transaction fails the body with 40001, which must come back as an error, never Applied.
/// Not on MySQL: its SERIALIZABLE turns the reads into locking reads, so the same schedule
/// ends in a lock wait and a deadlock whose victim InnoDB picks, not in a serialization
/// failure of the body. Not on SQLite: writers are serialised, there is nothing to detect.
pub(crate) async fn serialization_failure_in_the_body_is_an_error_not_applied<S: Support>() {
    let mut ctx = Ctx::<S>::new("skew", 3).await;
    let table = ctx.create_table("s", "(v BIGINT NOT NULL)").await;
    let count = format!("SELECT COUNT(*) FROM {table}");
    let insert = format!("INSERT INTO {table} (v) VALUES (1)");
    let job = ctx.job("job-skew", 23, 230);
    let key = idem::Key::new(job.key.as_str()).expect("a valid key");
    let options = ClaimOptions::new().isolation(Isolation::Serializable);
    let Claimed::Fresh(mut guard) = ctx
        .store
        .claim_with("apply", &key, options)
        .await
        .expect("claim")
    else {
        panic!("a fresh key was a duplicate")
    };
    // Ours reads the table ...
    let seen = S::Db::fetch_i64(&mut **guard.tx(), &count, &[])
        .await
        .expect("read");
    assert_eq!(seen, 0);
    // ... theirs reads it too, writes it and commits first ...
    let mut theirs = ctx.pool.acquire().await.expect("a connection");
    for sql in [
        "BEGIN ISOLATION LEVEL SERIALIZABLE",
        &count,
        &insert,
        "COMMIT",
    ] {
        S::Db::execute(&mut theirs, sql, &[]).await.expect(sql);
    }
    drop(theirs);
    // ... and ours then writes what theirs read: no serial order explains both.
    let body = async {
        insert_effect(guard.tx(), &job, "apply").await?;
        S::Db::execute(&mut **guard.tx(), &insert, &[]).await?;
        Ok::<i64, TestError>(job.amount)
    }
    .await;
    let code = match guard.finish(body).await {
        Err(TestError::Db(e)) | Err(TestError::Idem(idem::Error::Database(e))) => db_code(&e),
        other => panic!("expected a serialization failure, got {other:?}"),
    };
    assert_eq!(code.as_deref(), Some("40001"));
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(ctx.effects_total().await, 0);
    assert_eq!(ctx.scalar(&count).await, 1, "only their row");
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 230);
    assert_eq!(ctx.effects(23).await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}
