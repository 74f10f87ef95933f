//! A marker table partitioned by day on PostgreSQL (`Store::partitions`), against the server
//! at `IDEM_POSTGRES_URL`: where keys land, that each is still claimed once, what a drop and a
//! purge take, and what is refused. The whole conformance suite also runs on partitioned
//! tables (`IDEM_CONFORMANCE_PARTITIONED=1 cargo test --test postgres`, in `.ci/run`).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::partitions::{KeyTime, MAX_PARTITION_DAYS};
use idem::{Claimed, Error, Key, LeaseOptions, Outcome, Refusal, Store};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Postgres, Row as _};

const URL_VAR: &str = "IDEM_POSTGRES_URL";
const DAY: Duration = Duration::from_secs(24 * 3600);
const SCOPE: &str = "partitions.test";

async fn pool() -> PgPool {
    let url = std::env::var(URL_VAR)
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} (set {URL_VAR}) cannot be reached: {e}"))
}

/// A store on a new table name, its tables dropped first (a name is reused across runs).
async fn store(tag: &str) -> Store<Postgres> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let table = format!(
        "part_{tag}_{}_{}",
        std::process::id() % 100_000,
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let pool = pool().await;
    for t in ["", "_outbox", "_retention", "_steps", "_offsets", "_audit"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {table}{t} CASCADE"
        )))
        .execute(&pool)
        .await
        .expect("drop an old table");
    }
    Store::new(pool).with_table(&table).expect("a plain name")
}

/// A UUIDv7 made `ago` before now, the `n`th of its millisecond.
fn uuid_v7(ago: Duration, n: u16) -> Key {
    let ms = (SystemTime::now() - ago)
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64;
    Key::new(&format!(
        "{:08x}-{:04x}-7{:03x}-8000-{:012x}",
        ms >> 16,
        ms & 0xffff,
        n & 0xfff,
        std::process::id()
    ))
    .expect("a key")
}

/// The partition (of `table`, or of `table_steps`) holding `key`'s rows.
async fn home(store: &Store<Postgres>, table: &str, key: &Key) -> Vec<String> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT tableoid::regclass::text FROM {table} WHERE scope = $1 AND key = $2"
    )))
    .bind(SCOPE)
    .bind(key.as_str())
    .fetch_all(store.pool())
    .await
    .expect("read a row's partition")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

async fn count(store: &Store<Postgres>, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
        .fetch_one(store.pool())
        .await
        .expect("count")
}

/// The name of the day partition of keys made `ago`.
fn day_name(store: &Store<Postgres>, ago: Duration) -> String {
    store
        .partitions(KeyTime::UuidV7)
        .day(SystemTime::now() - ago)
        .expect("after 1970")
        .name
}

/// Claims `key` in transaction mode: whether this delivery applied it.
async fn apply(store: &Store<Postgres>, key: &Key) -> bool {
    match store.claim(SCOPE, key).await.expect("claim") {
        Claimed::Fresh(guard) => {
            let done = guard.finish(Ok::<_, Error>(())).await.expect("commit");
            assert_eq!(done, Outcome::Applied(()));
            true
        }
        Claimed::Duplicate => false,
        other => panic!("neither fresh nor a duplicate: {other:?}"),
    }
}

#[tokio::test]
async fn every_mode_claims_a_key_once_in_the_partition_of_its_day() {
    let store = store("modes").await;
    let days = store.partitions(KeyTime::UuidV7);
    let made = days.migrate(2).await.expect("migrate partitioned");
    assert_eq!(made.len(), 3, "today and two days ahead: {made:?}");
    let back = days
        .add(SystemTime::now() - 3 * DAY, SystemTime::now() - DAY)
        .await
        .expect("add three past days");
    assert_eq!(back.len(), 3, "{back:?}");

    let table = store.table().to_owned();
    let mut expected = 0;
    for ago in [3 * DAY, 2 * DAY, Duration::ZERO] {
        // Transaction mode, twice.
        let key = uuid_v7(ago, 1);
        assert!(apply(&store, &key).await, "the first delivery applies");
        assert!(!apply(&store, &key).await, "the redelivery is a duplicate");
        assert_eq!(home(&store, &table, &key).await, [day_name(&store, ago)]);

        // Lease mode, with a step recorded in the steps' partition of the same day.
        let key = uuid_v7(ago, 2);
        let options = LeaseOptions::new(Duration::from_secs(30));
        let Claimed::Fresh(lease) = store.lease(SCOPE, &key, options).await.expect("lease") else {
            panic!("a new key is fresh");
        };
        let charged: Result<u32, Error> = lease.step("charge", |_| async { Ok(7) }).await;
        assert_eq!(
            lease.finish(charged).await.expect("complete"),
            Outcome::Applied(7)
        );
        let again = store
            .lease(SCOPE, &key, options)
            .await
            .expect("lease again");
        assert!(matches!(again, Claimed::Duplicate), "{again:?}");
        assert_eq!(home(&store, &table, &key).await, [day_name(&store, ago)]);
        let steps = format!("{table}_steps");
        let step_day = day_name(&store, ago).replacen(&table, &steps, 1);
        assert_eq!(home(&store, &steps, &key).await, [step_day]);

        // A batch of two, then the same batch again.
        let keys = vec![uuid_v7(ago, 3), uuid_v7(ago, 4)];
        let batch = store.claim_batch(SCOPE, &keys).await.expect("batch");
        assert_eq!(batch.fresh(), [true, true]);
        let done = batch
            .finish(Ok::<_, Error>(()))
            .await
            .expect("commit the batch");
        assert_eq!(
            done.outcomes(),
            [Outcome::Applied(()), Outcome::Applied(())]
        );
        let batch = store.claim_batch(SCOPE, &keys).await.expect("batch again");
        assert_eq!(batch.fresh(), [false, false]);
        let done = batch
            .finish(Ok::<_, Error>(()))
            .await
            .expect("end the batch");
        assert_eq!(done.outcomes(), [Outcome::Duplicate, Outcome::Duplicate]);
        expected += 4;
    }
    // A key that carries no time lands in the default partition, once.
    let plain = Key::new("order-42").expect("a key");
    assert!(apply(&store, &plain).await);
    assert!(!apply(&store, &plain).await);
    assert_eq!(
        home(&store, &table, &plain).await,
        [format!("{table}_default")]
    );
    assert_eq!(count(&store, &table).await, expected + 1);
}

#[tokio::test]
async fn a_drop_takes_whole_days_older_than_the_longest_retention_and_nothing_else() {
    let store = store("drop").await;
    let days = store.partitions(KeyTime::UuidV7);
    days.migrate(1).await.expect("migrate partitioned");
    days.add(SystemTime::now() - 12 * DAY, SystemTime::now() - 6 * DAY)
        .await
        .expect("add past days");
    let table = store.table().to_owned();
    let old = uuid_v7(11 * DAY, 1);
    let middle = uuid_v7(8 * DAY, 1);
    let fresh = uuid_v7(Duration::ZERO, 1);
    for key in [&old, &middle, &fresh] {
        assert!(apply(&store, key).await);
    }
    // A scope keeping its markers 10 days holds back the days under 10 days old.
    store
        .set_retention("other.scope", 10 * DAY)
        .await
        .expect("set a retention");
    let dropped = days.drop_older_than(5 * DAY).await.expect("drop");
    let names: Vec<&str> = dropped.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [day_name(&store, 12 * DAY), day_name(&store, 11 * DAY)]
    );
    assert_eq!(
        count(&store, &table).await,
        2,
        "the old key's marker went with its day"
    );
    assert!(home(&store, &table, &old).await.is_empty());
    assert_eq!(
        home(&store, &table, &middle).await,
        [day_name(&store, 8 * DAY)]
    );

    store
        .clear_retention("other.scope")
        .await
        .expect("clear it");
    let dropped = days.drop_older_than(5 * DAY).await.expect("drop again");
    assert_eq!(dropped.len(), 5, "the days 10 to 6 days ago: {dropped:?}");
    assert_eq!(
        home(&store, &table, &fresh).await,
        [day_name(&store, Duration::ZERO)]
    );
    assert!(
        !sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
            .bind(day_name(&store, 8 * DAY).replacen(&table, &format!("{table}_steps"), 1))
            .fetch_one(store.pool())
            .await
            .expect("look for the steps' partition"),
        "the steps' partition of a dropped day goes with it"
    );
    // A redelivery after its day went runs again, as after a purge; its marker goes to the
    // default partition now that its day has none.
    assert!(apply(&store, &middle).await);
    assert_eq!(
        home(&store, &table, &middle).await,
        [format!("{table}_default")]
    );
}

#[tokio::test]
async fn purge_of_a_partitioned_table_deletes_only_the_old_rows_that_share_a_row_id() {
    let store = store("purge").await;
    let days = store.partitions(KeyTime::UuidV7);
    days.migrate(0).await.expect("migrate partitioned");
    let table = store.table().to_owned();
    let old = Key::new("order-1").expect("a key");
    let fresh = uuid_v7(Duration::ZERO, 1);
    assert!(apply(&store, &old).await);
    assert!(apply(&store, &fresh).await);
    // Both rows are updated once (the default partition's aged), so each partition's only
    // live row has the same row id.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {table} SET completed_at = CASE WHEN key = 'order-1' \
         THEN now() - interval '2 hours' ELSE now() END"
    )))
    .execute(store.pool())
    .await
    .expect("age the default partition's marker");
    let ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT ctid::text FROM {table} ORDER BY key"
    )))
    .fetch_all(store.pool())
    .await
    .expect("row ids");
    assert_eq!(ids, ["(0,2)", "(0,2)"]);
    assert_eq!(
        store.purge(Duration::from_secs(3600)).await.expect("purge"),
        1
    );
    assert_eq!(
        home(&store, &table, &fresh).await,
        [day_name(&store, Duration::ZERO)]
    );
    assert!(home(&store, &table, &old).await.is_empty());
}

#[tokio::test]
async fn a_table_that_is_not_partitioned_is_refused_and_kept() {
    let store = store("plain").await;
    store.migrate().await.expect("migrate");
    let err = store
        .partitions(KeyTime::UuidV7)
        .migrate(1)
        .await
        .expect_err("a plain table cannot be partitioned in place");
    assert!(
        matches!(err, Error::Refused(Refusal::Partitions { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains("is not partitioned"), "{err}");
    let kind: String =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
            .bind(store.table())
            .fetch_one(store.pool())
            .await
            .expect("the table is there");
    assert_eq!(kind, "r");
}

#[tokio::test]
async fn bad_days_are_refused_before_any_io() {
    // Nothing listens on port 1: any I/O would fail with a database error.
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .expect("a lazy pool");
    let store = Store::new(pool);
    let days = store.partitions(KeyTime::Ulid);
    for err in [
        days.ensure(MAX_PARTITION_DAYS)
            .await
            .expect_err("too many days"),
        days.migrate(MAX_PARTITION_DAYS + 1)
            .await
            .expect_err("too many days"),
        days.add(SystemTime::now(), SystemTime::now() - 2 * DAY)
            .await
            .expect_err("days out of order"),
        days.add(UNIX_EPOCH - DAY, SystemTime::now())
            .await
            .expect_err("before 1970"),
    ] {
        assert!(
            matches!(err, Error::Refused(Refusal::Partitions { .. })),
            "{err:?}"
        );
    }
    let err = days
        .drop_older_than(Duration::ZERO)
        .await
        .expect_err("no retention");
    assert!(
        matches!(err, Error::Refused(Refusal::Retention { .. })),
        "{err:?}"
    );
}

#[tokio::test]
async fn workers_migrating_at_once_make_each_partition_once() {
    let store = store("race").await;
    let runs = (0..4).map(|_| {
        let store = store.clone();
        tokio::spawn(async move { store.partitions(KeyTime::Ulid).migrate(3).await })
    });
    let mut made = 0;
    for run in runs {
        made += run.await.expect("no panic").expect("migrate").len();
    }
    assert_eq!(
        made, 4,
        "today and three days ahead, made by one of the workers"
    );
    assert_eq!(
        store
            .partitions(KeyTime::Ulid)
            .list()
            .await
            .expect("list")
            .len(),
        4
    );
}
