//! The cases that need a server: a claim that loses a race and is retried, and one that waits
//! on a held key for its whole `wait`. Each test names its own tables.

use std::future::Future;
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;

use super::*;

async fn pg() -> (Store<Postgres>, PgPool, String) {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} (set IDEM_POSTGRES_URL): {e}"));
    let markers = unique("idem_obs");
    let effects = format!("{markers}_effects");
    let store = Store::new(pool.clone()).with_table(&markers).unwrap();
    store.migrate().await.unwrap();
    let ddl = format!("CREATE TABLE {effects} (id BIGINT NOT NULL)");
    sqlx::query(AssertSqlSafe(ddl))
        .execute(&pool)
        .await
        .unwrap();
    (store, pool, effects)
}

async fn cleanup(store: &Store<Postgres>, pool: &PgPool, effects: &str) {
    let outbox = format!("{}_outbox", store.table());
    for table in [store.table(), effects, &outbox] {
        let sql = format!("DROP TABLE {table}");
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
    }
}

async fn pg_count(pool: &PgPool, table: &str, id: i64) -> i64 {
    let sql = format!("SELECT COUNT(*) FROM {table} WHERE id = $1");
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Sessions blocked on a row lock while inserting into `markers` (claims queued on a key).
async fn waiting(pool: &PgPool, markers: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%INSERT INTO ' || $1 || ' %'",
    )
    .bind(markers)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), future)
        .await
        .unwrap_or_else(|_| panic!("still waiting after 60 s for {what}"))
}

async fn pg_effect(tx: &mut Transaction<'_, Postgres>, job: &Job) -> Result<i64, Error> {
    let sql = format!("INSERT INTO {} (id) VALUES ($1)", job.table);
    sqlx::query(AssertSqlSafe(sql))
        .bind(job.id)
        .execute(&mut **tx)
        .await?;
    Ok(job.id)
}

#[idem::idempotent(key = "job.id", scope = "obs.pg.retry", isolation = "serializable")]
async fn pg_serializable(tx: &mut Transaction<'_, Postgres>, job: &Job) -> Result<i64, Error> {
    pg_effect(tx, job).await
}

#[idem::idempotent(key = "job.id", scope = "obs.pg.in_progress", wait = "200ms")]
async fn pg_waiting(tx: &mut Transaction<'_, Postgres>, job: &Job) -> Result<i64, Error> {
    pg_effect(tx, job).await
}

/// The delivery that queued behind a holder's uncommitted claim started its snapshot before
/// the holder committed: under SERIALIZABLE its claim fails (40001) and is retried, and the
/// retry sees the committed marker.
#[tokio::test]
async fn pg_lost_race_is_retried_with_a_warning() {
    const SCOPE: &str = "obs.pg.retry";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool, effects) = pg().await;
    let job = Job::new(21, &effects);
    let retries_before = idem::__private::claim_retries();

    let mut held = match store.claim(SCOPE, &job.key()).await.unwrap() {
        idem::Claimed::Fresh(guard) => guard,
        other => panic!("{other:?}"),
    };
    pg_effect(held.tx(), &job).await.unwrap();
    let racer = {
        let (store, job) = (store.clone(), Job::new(job.id, &effects));
        tokio::spawn(async move { pg_serializable(&store, &job).await })
    };
    within("the second delivery to queue on the key", async {
        while waiting(&pool, store.table()).await != 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(
        held.finish(Ok::<(), Error>(())).await.unwrap(),
        Outcome::Applied(())
    );
    let outcome = within("the racer", racer).await.unwrap().unwrap();
    assert_eq!(outcome, Outcome::Duplicate);
    assert_eq!(pg_count(&pool, &effects, 21).await, 1);
    assert!(idem::__private::claim_retries() > retries_before);

    // The hand-held claim is a call of its own.
    let [(held, held_span), (id, span)] = &seen.claims()[..] else {
        panic!("two spans: {:?}", seen.claims())
    };
    let (fields, _) = split(held_span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "applied", 0)
    );
    assert_eq!(decisions(&seen, *held), ["fresh"]);
    let (fields, _) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "duplicate", 1)
    );
    let events = seen.idem_events(*id);
    let warns: Vec<_> = events.iter().filter(|e| e.level == Level::WARN).collect();
    let [warn] = &warns[..] else {
        panic!("one warning for the retry: {events:?}")
    };
    assert_eq!(warn.fields["retry"], "1");
    assert_eq!(decisions(&seen, *id), ["duplicate"]);
    assert_eq!(outcomes(SCOPE, "duplicate"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(claim_samples(SCOPE).len(), 2);
    cleanup(&store, &pool, &effects).await;
}

#[tokio::test]
async fn pg_in_progress_after_waiting_on_the_key() {
    const SCOPE: &str = "obs.pg.in_progress";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool, effects) = pg().await;
    let job = Job::new(22, &effects);
    let held = match store.claim(SCOPE, &job.key()).await.unwrap() {
        idem::Claimed::Fresh(guard) => guard,
        other => panic!("{other:?}"),
    };

    let err = within("lock_timeout", pg_waiting(&store, &job))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err}");
    drop(held);
    assert_eq!(pg_count(&pool, &effects, 22).await, 0);

    // The hand-held claim, dropped unfinished, is counted as an error and says so.
    let [(held, held_span), (id, span)] = &seen.claims()[..] else {
        panic!("two spans: {:?}", seen.claims())
    };
    let (fields, _) = split(held_span);
    assert_eq!(fields, expect(SCOPE, &job.key(), "transaction", "error", 0));
    let dropped = "the call was dropped before it finished (a panic or a cancelled future): \
                   its transaction was rolled back, or its lease released";
    assert_eq!(
        finished(&seen, *held),
        (Level::WARN, ended("error", Some(dropped)))
    );
    let (fields, waited) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "in_progress", 0)
    );
    // `lock_timeout` (the `wait`) ran out before the server gave up: that is in the field.
    assert!(waited >= 200, "waited_ms = {waited}");
    assert_eq!(decisions(&seen, *id), ["in_progress"]);
    assert_eq!(outcomes(SCOPE, "in_progress"), 1);
    assert_eq!(outcomes(SCOPE, "error"), 1);
    let samples = claim_samples(SCOPE);
    assert!(
        samples.len() == 2 && samples.iter().any(|s| *s >= 0.2),
        "{samples:?}"
    );
    cleanup(&store, &pool, &effects).await;
}
