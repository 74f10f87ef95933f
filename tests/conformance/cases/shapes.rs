//! Handler shapes the attribute must keep `Send` (each run under `tokio::spawn`).

use std::sync::Arc;
use std::time::Duration;

use idem::{Outcome, Store};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::within;

/// The handlers, each of a shape the attribute must expand to a `Send` future.
#[allow(
    unreachable_pub,
    reason = "the suite checks that `pub` handlers expand"
)]
mod shaped {
    use sqlx::Transaction;

    use crate::conformance::TestDb;
    use crate::conformance::handlers::{Job, TestError, insert_effect};

    pub(crate) trait HasId {
        fn id(&self) -> &str;
        fn job(&self) -> &Job;
    }

    impl HasId for Job {
        fn id(&self) -> &str {
            &self.key
        }
        fn job(&self) -> &Job {
            self
        }
    }

    /// A `pub` free function.
    #[idem::idempotent(key = "job.key", scope = "free")]
    pub async fn free<DB: TestDb>(
        tx: &mut Transaction<'_, DB>,
        job: &Job,
    ) -> Result<i64, TestError> {
        insert_effect(tx, job, "free").await?;
        Ok(job.amount)
    }

    pub(crate) struct Service {
        pub(crate) origin: &'static str,
    }

    impl Service {
        /// A `pub(crate)` method on `&self`, spelling the transaction `idem::Tx`.
        #[idem::idempotent(key = "job.key", scope = "shapes.method")]
        pub(crate) async fn method<DB: TestDb>(
            &self,
            tx: &mut idem::Tx<'_, DB>,
            job: &Job,
        ) -> Result<i64, TestError> {
            insert_effect(tx, job, self.origin).await?;
            Ok(job.amount)
        }
    }

    /// A function generic over the job type as well.
    #[idem::idempotent(key = "job.id()", scope = "generic")]
    pub(crate) async fn generic<DB: TestDb, J: HasId + Sync>(
        tx: &mut Transaction<'_, DB>,
        job: &J,
    ) -> Result<i64, TestError> {
        insert_effect(tx, job.job(), "generic").await?;
        Ok(job.job().amount)
    }

    /// A private function taking its job by value, with the transaction last.
    #[idem::idempotent(key = "job.key", scope = "owned")]
    async fn owned<DB: TestDb>(job: Job, tx: &mut Transaction<'_, DB>) -> Result<i64, TestError> {
        insert_effect(tx, &job, "owned").await?;
        Ok(job.amount)
    }

    #[allow(
        clippy::manual_async_fn,
        reason = "the signature is the check: the future is Send + 'static"
    )]
    pub(crate) fn owned_call<DB: TestDb>(
        store: idem::Store<DB>,
        job: Job,
    ) -> impl Future<Output = Result<idem::Outcome<i64>, TestError>> + Send + 'static {
        async move { owned(job, &store).await }
    }

    /// Destructured parameters (a tuple, a struct behind a reference) and an `impl Trait`
    /// parameter; the key reads a name bound by a pattern.
    #[idem::idempotent(key = "key", scope = "shapes.destructured")]
    pub(crate) async fn destructured<DB: TestDb>(
        Job {
            key, id, effects, ..
        }: &Job,
        (a, b): (i64, i64),
        tx: &mut Transaction<'_, DB>,
        origin: impl AsRef<str> + Send,
    ) -> Result<i64, TestError> {
        let job = Job {
            key: key.clone(),
            id: *id,
            amount: a + b,
            effects: effects.clone(),
        };
        insert_effect(tx, &job, origin.as_ref()).await?;
        Ok(a + b)
    }
}

pub(crate) async fn every_handler_shape_runs_under_tokio_spawn<S: Support>() {
    let ctx = Ctx::<S>::new("shapes", 2).await;
    let job = ctx.job("job-shape", 10, 100);
    let service = Arc::new(shaped::Service { origin: "method" });
    for round in 0..2 {
        let spawned = [
            tokio::spawn({
                let (store, job) = (ctx.store.clone(), job.clone());
                async move { shaped::free(&store, &job).await }
            }),
            tokio::spawn({
                let (store, job) = (ctx.store.clone(), job.clone());
                let service = service.clone();
                async move { service.method(&store, &job).await }
            }),
            tokio::spawn({
                let (store, job) = (ctx.store.clone(), job.clone());
                async move { shaped::generic(&store, &job).await }
            }),
            tokio::spawn(shaped::owned_call(ctx.store.clone(), job.clone())),
        ];
        for (i, task) in spawned.into_iter().enumerate() {
            let result = task.await.expect("no panic");
            if round == 0 {
                assert_eq!(applied(result), 100, "shape {i}");
            } else {
                duplicate(result);
            }
        }
    }
    for origin in ["free", "method", "generic", "owned"] {
        assert_eq!(ctx.effects_from(10, origin).await, 1, "shape {origin}");
    }
    assert_eq!(ctx.effects_total().await, 4);
    assert_eq!(ctx.markers().await, 4);
    ctx.cleanup().await;
}

pub(crate) async fn destructured_and_impl_trait_parameters_run_under_tokio_spawn<S: Support>() {
    let ctx = Ctx::<S>::new("destructured", 2).await;
    let job = ctx.job("job-destructured", 19, 0);
    for round in 0..2 {
        let task = tokio::spawn({
            let (store, job) = (ctx.store.clone(), job.clone());
            async move { shaped::destructured(&job, (150, 40), &store, String::from("split")).await }
        });
        let result = within(60, "the destructured handler", task)
            .await
            .expect("no panic");
        if round == 0 {
            assert_eq!(applied(result), 190);
        } else {
            duplicate(result);
        }
    }
    assert_eq!(ctx.effects_from(19, "split").await, 1);
    assert_eq!(
        ctx.scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE amount = 190",
            ctx.effects
        ))
        .await,
        1
    );
    assert_eq!(ctx.stored_keys().await, vec![job.key.clone()]);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}
