//! The expansion must compile warning-free in a strict crate, whatever the user's module
//! shadows, for every shape of handler. Each handler also runs, so the test checks behaviour
//! and not only that it builds.
#![deny(warnings, clippy::pedantic, unused_qualifications)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idem::Outcome;
use sqlx::{Sqlite, SqlitePool};

/// Names a user's module may define that generated code must never pick up.
#[allow(dead_code, non_camel_case_types, clippy::upper_case_acronyms)]
mod shadows {
    use ::idem::Tx;
    use sqlx::Sqlite;

    #[derive(Clone)]
    pub(crate) struct Job {
        pub(crate) id: u64,
    }

    struct Result;
    struct Ok;
    struct Err;
    struct Option;
    struct Some;
    struct None;
    struct From;
    struct Outcome;
    struct Store;
    struct Claim;
    struct Lease;
    struct Leased;
    struct Backend;
    struct Batch;
    struct Duration;
    mod core {}
    mod std {}
    mod idem {}

    /// A parameter named like the one the expansion adds, and locals named like its own.
    #[::idem::idempotent(key = "job.id", scope = "shadowed")]
    pub(crate) async fn shadowed(
        tx: &mut Tx<'_, Sqlite>,
        job: &Job,
        store: u64,
    ) -> ::core::result::Result<u64, sqlx::Error> {
        let __idem_guard = store;
        let __idem_key = job.id;
        sqlx::query("INSERT INTO effects (n) VALUES (1)")
            .execute(&mut **tx)
            .await?;
        ::core::result::Result::Ok(__idem_guard + __idem_key)
    }

    /// A batch handler among the same shadows, with locals named like the expansion's own.
    #[::idem::idempotent(key = "job.id", scope = "hygiene.batch", batch = "jobs")]
    pub(crate) async fn shadowed_batch(
        tx: &mut Tx<'_, Sqlite>,
        jobs: &[Job],
        store: u64,
    ) -> ::core::result::Result<u64, sqlx::Error> {
        let __idem_claim = store;
        let __idem_fresh = jobs.len() as u64;
        for _ in jobs {
            sqlx::query("INSERT INTO effects (n) VALUES (1)")
                .execute(&mut **tx)
                .await?;
        }
        ::core::result::Result::Ok(__idem_claim + __idem_fresh)
    }

    /// An alias of `Result` whose name does not say so, and sqlx's alias of the transaction,
    /// among the shadows: `T`, `E` and the database are read through `::idem::__private`.
    type Fallible<T> = ::core::result::Result<T, sqlx::Error>;

    #[::idem::idempotent(key = "job.id", scope = "hygiene.fallible")]
    pub(crate) async fn fallible(tx: &mut sqlx::SqliteTransaction<'_>, job: &Job) -> Fallible<u64> {
        sqlx::query("INSERT INTO effects (n) VALUES (1)")
            .execute(&mut **tx)
            .await?;
        ::core::result::Result::Ok(job.id)
    }

    /// The same alias in lease mode.
    #[::idem::idempotent(key = "job.id", scope = "hygiene.fallible_lease", lease = "5s")]
    pub(crate) async fn fallible_lease(lease: &::idem::Lease, job: &Job) -> Fallible<u64> {
        ::core::result::Result::Ok(job.id + u64::from(lease.attempt()))
    }

    /// Lease mode among the same shadows, with locals named like the expansion's own.
    #[::idem::idempotent(key = "job.id", scope = "hygiene.lease_shadowed", lease = "5s")]
    pub(crate) async fn shadowed_lease(
        __idem_lease: &::idem::Lease,
        job: &Job,
        store: u64,
    ) -> ::core::result::Result<u64, sqlx::Error> {
        let __idem_lease_ref = store;
        let __idem_result = job.id;
        ::core::result::Result::Ok(
            __idem_lease_ref + __idem_result + u64::from(__idem_lease.attempt()),
        )
    }
}

/// Types of the user's own named like the transaction, but not shaped like it
/// (`Transaction<'_, DB>`), are ordinary parameters beside the real one.
mod look_alikes {
    use sqlx::sqlite::SqliteTransaction;

    pub(crate) struct Tx {
        pub(crate) id: u64,
    }

    pub(crate) struct Transaction<T> {
        pub(crate) payload: T,
    }

    #[idem::idempotent(key = "job.id", scope = "hygiene.look_alikes")]
    pub(crate) async fn handle(
        job: &Tx,
        tx: &mut SqliteTransaction<'_>,
        payment: &mut Transaction<u64>,
    ) -> Result<u64, sqlx::Error> {
        sqlx::query("INSERT INTO effects (n) VALUES (1)")
            .execute(&mut **tx)
            .await?;
        payment.payload += job.id;
        Ok(payment.payload)
    }
}

mod reexport {
    pub(crate) use ::idem as idem_again;
}

struct Job {
    tenant: String,
    id: u64,
}

struct Worker {
    name: &'static str,
}

impl Worker {
    /// A method: `self` stays a parameter and may be used in the key.
    #[idem::idempotent(key = "(self.name, job.id)", scope = "worker")]
    async fn handle(
        &self,
        tx: &mut sqlx::Transaction<'_, Sqlite>,
        job: &Job,
    ) -> Result<&'static str, sqlx::Error> {
        sqlx::query("INSERT INTO effects (n) VALUES (1)")
            .execute(&mut **tx)
            .await?;
        Ok(self.name)
    }
}

trait HasId {
    fn id(&self) -> u64;
}

impl HasId for Job {
    fn id(&self) -> u64 {
        self.id
    }
}

/// A generic handler (so it names its scope) with an early `return` and a composite key.
#[idem::idempotent(key = "(job.id(), tenant)", scope = "generic")]
pub(crate) async fn generic<J: HasId + Sync>(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    job: &J,
    tenant: &str,
) -> Result<u64, sqlx::Error> {
    if job.id() == 0 {
        return Ok(0);
    }
    sqlx::query("INSERT INTO effects (n) VALUES (?1)")
        .bind(i64::try_from(job.id()).unwrap_or(i64::MAX))
        .execute(&mut **tx)
        .await?;
    Ok(job.id())
}

/// A raw identifier (its scope, the name it had by default, is written without `r#`), and an
/// inner attribute, which must stay inside the body (this crate denies warnings).
#[idem::idempotent(key = "job.id", scope = "type")]
async fn r#type<'a>(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    job: &'a Job,
) -> Result<&'a str, sqlx::Error> {
    #![allow(unused_variables)]
    let unused = job.id;
    sqlx::query("INSERT INTO effects (n) VALUES (1)")
        .execute(&mut **tx)
        .await?;
    Ok(job.tenant.as_str())
}

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A `Result` alias with one parameter, re-rooted through a re-export.
#[reexport::idem_again::idempotent(
    key = "job.tenant",
    scope = "aliased",
    crate = "crate::reexport::idem_again"
)]
async fn aliased(tx: &mut sqlx::Transaction<'_, Sqlite>, job: Job) -> BoxResult<String> {
    sqlx::query("INSERT INTO effects (n) VALUES (1)")
        .execute(&mut **tx)
        .await?;
    Ok(job.tenant)
}

/// A tuple key of an owned field, read through `&Job`: each element is borrowed, never moved.
#[idem::idempotent(key = "(job.tenant, job.id)", scope = "hygiene.tenant")]
async fn per_tenant(tx: &mut sqlx::Transaction<'_, Sqlite>, job: &Job) -> Result<u64, sqlx::Error> {
    sqlx::query("INSERT INTO effects (n) VALUES (1)")
        .execute(&mut **tx)
        .await?;
    Ok(job.id)
}

/// Lease mode: the body runs outside any transaction; it counts its runs where the test can
/// see them, as an outside system would.
#[idem::idempotent(
    key = "job.id",
    scope = "hygiene.lease",
    lease = "30s",
    timeout = "10s"
)]
async fn leased(lease: &idem::Lease, job: &Job, runs: &AtomicU32) -> Result<String, sqlx::Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    assert!(lease.remaining() <= std::time::Duration::from_secs(30));
    Ok(format!("{} {}", lease.idempotency_key(), job.tenant))
}

/// `Lease` imported by `use` and written bare, as the docs show: the parameter becomes the
/// store, and the import must stay used (this crate denies `unused_imports`). Its named
/// lifetime is the signature's, not the lease's inside the body.
mod imported_lease {
    use idem::Lease;

    #[idem::idempotent(key = "job.id", scope = "hygiene.imported_lease", lease = "5s")]
    pub(crate) async fn handle<'a>(
        lease: &'a Lease,
        job: &'a super::Job,
    ) -> Result<&'a str, sqlx::Error> {
        assert_eq!(lease.attempt(), 1);
        Ok(job.tenant.as_str())
    }
}

/// `lease` and `timeout` from consts (checked at compile time, by `const` assertions in the
/// expansion), next to a user's own `Duration` shadow.
mod const_lease {
    pub(crate) const LEASE: std::time::Duration = std::time::Duration::from_secs(20);
    pub(crate) const TIMEOUT: std::time::Duration = std::time::Duration::from_millis(50);

    #[allow(dead_code)]
    struct Duration;

    /// Never finishes when `stall`, so that its timeout (the const) ends it.
    #[idem::idempotent(key = "job.id", scope = "hygiene.const_lease", lease = LEASE, timeout = TIMEOUT)]
    pub(crate) async fn handle(
        lease: &idem::Lease,
        job: &super::Job,
        stall: bool,
    ) -> Result<u64, idem::Error> {
        assert!(lease.remaining() <= TIMEOUT);
        assert!(lease.deadline() > std::time::Instant::now());
        if stall {
            std::future::pending::<()>().await;
        }
        Ok(job.id)
    }
}

async fn setup() -> idem::Store<Sqlite> {
    let pool = SqlitePool::connect("sqlite::memory:").await.unwrap();
    sqlx::query("CREATE TABLE effects (n INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = idem::Store::new(pool);
    store.migrate().await.unwrap();
    store
}

async fn effects(store: &idem::Store<Sqlite>) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn lease_and_timeout_from_consts() {
    let store = setup().await;
    let job = Job {
        id: 9,
        tenant: "acme".into(),
    };
    let err = const_lease::handle(&store, &job, true).await.unwrap_err();
    let idem::Error::Lease(idem::LeaseError::Timeout { after, .. }) = err else {
        panic!("{err}")
    };
    assert_eq!(after, const_lease::TIMEOUT);
    let retried = const_lease::handle(&store, &job, false).await.unwrap();
    assert_eq!(retried, Outcome::Applied(9));
    let marker = store
        .inspect("hygiene.const_lease", &idem::Key::new(&9).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(marker.attempts, 2);
}

#[tokio::test]
async fn shadowed_names_do_not_reach_the_expansion() {
    let store = setup().await;
    let job = shadows::Job { id: 5 };
    assert_eq!(
        shadows::shadowed(&store, &job, 10).await.unwrap(),
        Outcome::Applied(15)
    );
    assert_eq!(
        shadows::shadowed(&store, &job, 10).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(effects(&store).await, 1);
    let jobs = [shadows::Job { id: 5 }, shadows::Job { id: 6 }];
    let done = shadows::shadowed_batch(&store, &jobs, 10).await.unwrap();
    assert_eq!(
        done.outcomes(),
        [Outcome::Applied(()), Outcome::Applied(())]
    );
    assert_eq!(done.value(), Some(&12));
    let again = shadows::shadowed_batch(&store, &jobs, 10).await.unwrap();
    assert_eq!(again.outcomes(), [Outcome::Duplicate, Outcome::Duplicate]);
    assert_eq!(effects(&store).await, 3);
}

#[tokio::test]
async fn every_shape_runs_once_per_key() {
    let store = setup().await;
    let worker = Worker { name: "w1" };
    let job = Job {
        tenant: "acme".into(),
        id: 7,
    };
    assert_eq!(
        worker.handle(&store, &job).await.unwrap(),
        Outcome::Applied("w1")
    );
    assert_eq!(
        worker.handle(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        generic(&store, &job, "acme").await.unwrap(),
        Outcome::Applied(7)
    );
    assert_eq!(
        generic(&store, &job, "acme").await.unwrap(),
        Outcome::Duplicate
    );
    // Another tenant is another key.
    assert_eq!(
        generic(&store, &job, "globex").await.unwrap(),
        Outcome::Applied(7)
    );
    // The early `return` still commits the marker.
    let zero = Job {
        tenant: "acme".into(),
        id: 0,
    };
    assert_eq!(
        generic(&store, &zero, "acme").await.unwrap(),
        Outcome::Applied(0)
    );
    assert_eq!(
        generic(&store, &zero, "acme").await.unwrap(),
        Outcome::Duplicate
    );
    let owned = || Job {
        tenant: "initech".into(),
        id: 1,
    };
    assert_eq!(
        aliased(&store, owned()).await.unwrap(),
        Outcome::Applied("initech".to_owned())
    );
    assert_eq!(aliased(&store, owned()).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        r#type(&store, &job).await.unwrap(),
        Outcome::Applied("acme")
    );
    assert_eq!(r#type(&store, &job).await.unwrap(), Outcome::Duplicate);
    assert_eq!(effects(&store).await, 1 + 2 + 1 + 1);

    let scopes: Vec<(String, String)> =
        sqlx::query_as("SELECT scope, key FROM idem_processed ORDER BY scope, key")
            .fetch_all(store.pool())
            .await
            .unwrap();
    let expected = [
        ("aliased", "initech"),
        ("generic", "1:0|4:acme"),
        ("generic", "1:7|4:acme"),
        ("generic", "1:7|6:globex"),
        ("type", "7"),
        ("worker", "2:w1|1:7"),
    ];
    let scopes: Vec<(&str, &str)> = scopes.iter().map(|(s, k)| (&**s, &**k)).collect();
    assert_eq!(scopes, expected);
}

#[tokio::test]
async fn lease_mode_runs_once_under_tokio_spawn() {
    let store = setup().await;
    let runs = Arc::new(AtomicU32::new(0));
    let call = || {
        let (store, runs) = (store.clone(), runs.clone());
        // `tokio::spawn` needs the whole call to be `Send + 'static`.
        tokio::spawn(async move {
            let job = Job {
                tenant: "acme".into(),
                id: 9,
            };
            leased(&store, &job, &runs).await
        })
    };
    assert_eq!(
        call().await.unwrap().unwrap(),
        Outcome::Applied("13:hygiene.lease|1:9 acme".to_owned())
    );
    assert_eq!(call().await.unwrap().unwrap(), Outcome::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let job = shadows::Job { id: 5 };
    assert_eq!(
        shadows::shadowed_lease(&store, &job, 10).await.unwrap(),
        Outcome::Applied(16)
    );
    assert_eq!(
        shadows::shadowed_lease(&store, &job, 10).await.unwrap(),
        Outcome::Duplicate
    );

    let job = Job {
        tenant: "acme".into(),
        id: 10,
    };
    assert_eq!(
        imported_lease::handle(&store, &job).await.unwrap(),
        Outcome::Applied("acme")
    );
    assert_eq!(
        imported_lease::handle(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
}

/// Nesting: the inner handler joins the outer's transaction, under the same strict lints.
#[idem::idempotent(key = "job.id", scope = "hygiene.outer")]
async fn outer(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    job: &Job,
    store: &idem::Store<Sqlite>,
) -> Result<u64, sqlx::Error> {
    let inner = generic(store.join(tx), job, "nested").await?;
    Ok(inner.into_value().unwrap_or_default() + 1)
}

#[tokio::test]
async fn joined_calls_run_in_the_callers_transaction() {
    let store = setup().await;
    let job = shadows::Job { id: 11 };
    let mut tx = store.pool().begin().await.unwrap();
    assert_eq!(
        shadows::shadowed(store.join(&mut tx), &job, 1)
            .await
            .unwrap(),
        Outcome::Applied(12)
    );
    let worker = Worker { name: "joined" };
    let job = Job {
        tenant: "acme".into(),
        id: 12,
    };
    assert_eq!(
        worker.handle(store.join(&mut tx), &job).await.unwrap(),
        Outcome::Applied("joined")
    );
    tx.commit().await.unwrap();
    assert_eq!(effects(&store).await, 2);
    assert_eq!(
        worker.handle(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );

    assert_eq!(
        outer(&store, &job, &store).await.unwrap(),
        Outcome::Applied(13)
    );
    assert_eq!(
        outer(&store, &job, &store).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        generic(&store, &job, "nested").await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(effects(&store).await, 3);
}

#[tokio::test]
async fn tuple_keys_of_owned_fields_encode_like_the_tuple() {
    let store = setup().await;
    let job = Job {
        tenant: "acme".into(),
        id: 7,
    };
    assert_eq!(per_tenant(&store, &job).await.unwrap(), Outcome::Applied(7));
    assert_eq!(per_tenant(&store, &job).await.unwrap(), Outcome::Duplicate);
    let stored: String =
        sqlx::query_scalar("SELECT key FROM idem_processed WHERE scope = 'hygiene.tenant'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(stored, idem::Key::new(&("acme", 7)).unwrap().as_str());
    assert_eq!(effects(&store).await, 1);
}

#[tokio::test]
async fn aliases_of_result_and_of_the_transaction() {
    let store = setup().await;
    let job = shadows::Job { id: 3 };
    assert_eq!(
        shadows::fallible(&store, &job).await.unwrap(),
        Outcome::Applied(3)
    );
    assert_eq!(
        shadows::fallible(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        shadows::fallible_lease(&store, &job).await.unwrap(),
        Outcome::Applied(4)
    );
    assert_eq!(
        shadows::fallible_lease(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
    let job = look_alikes::Tx { id: 4 };
    let mut payment = look_alikes::Transaction { payload: 10 };
    assert_eq!(
        look_alikes::handle(&job, &store, &mut payment)
            .await
            .unwrap(),
        Outcome::Applied(14)
    );
    assert_eq!(
        look_alikes::handle(&job, &store, &mut payment)
            .await
            .unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(payment.payload, 14);
    assert_eq!(effects(&store).await, 2);
}
