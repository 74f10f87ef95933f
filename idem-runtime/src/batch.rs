//! Batch claims: the markers of a whole batch of jobs claimed with one statement, and their
//! effects committed together, so that a batch of 100 jobs costs one commit (one fsync), not
//! 100.

use std::borrow::Cow;
use std::collections::HashMap;

use sqlx::Transaction;

use crate::backend::Backend;
use crate::claim::{Held, Request, nested, run};
use crate::key::check_scope;
use crate::outgoing::Pending;
use crate::{Batch, ClaimOptions, Error, Failed, IntoKey, Key, KeyError, Store};

/// The most jobs one batch claim takes.
///
/// The claim is one statement. PostgreSQL and SQLite receive the keys as one array bind, so
/// no bind limit applies there; MySQL receives them as hex literals, twice in the claim's
/// message (insert, read back) and once more for the fresh ones, which at 1,000 keys of up to
/// 255 bytes stays near 1.6 MB in all,
/// under the smallest default `max_allowed_packet` still in use (4 MB, MySQL 5.7). A batch
/// also holds the row locks of all its keys until it commits, so a larger one would make
/// overlapping deliveries wait longer. Brokers hand out fewer (SQS 10, typical Kafka and
/// JetStream pulls a few hundred); split larger batches.
pub const MAX_BATCH: usize = 1_000;

impl Key {
    /// Encodes and validates the key of every job of a batch, before any I/O.
    ///
    /// The first refused key refuses the batch with [`KeyError::InBatch`], naming its
    /// position; more than [`MAX_BATCH`] keys are [`KeyError::BatchTooLarge`].
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use idem::{Key, KeyError};
    /// let keys = Key::batch(["a", "b"]).unwrap();
    /// assert_eq!(keys[1].as_str(), "b");
    /// assert!(matches!(
    ///     Key::batch(["a", ""]),
    ///     Err(KeyError::InBatch { position: 1, .. })
    /// ));
    /// ```
    pub fn batch<K: IntoKey>(values: impl IntoIterator<Item = K>) -> Result<Vec<Key>, KeyError> {
        collect_keys(values.into_iter().map(|value| Key::new(&value)))
    }
}

/// The keys of a batch, the first refused one naming its position. Stops at the first key
/// past [`MAX_BATCH`], so that an oversized batch is not encoded whole before it is refused.
fn collect_keys(keys: impl Iterator<Item = Result<Key, KeyError>>) -> Result<Vec<Key>, KeyError> {
    let mut out = Vec::new();
    for (position, key) in keys.enumerate() {
        if position == MAX_BATCH {
            let len = MAX_BATCH + 1;
            return Err(KeyError::BatchTooLarge { len });
        }
        match key {
            Ok(key) => out.push(key),
            Err(error) => {
                return Err(KeyError::InBatch {
                    position,
                    error: Box::new(error),
                });
            }
        }
    }
    Ok(out)
}

impl<DB: Backend> Store<DB> {
    /// Begins a transaction and claims every key of `keys` in it with one statement, with the
    /// database's defaults.
    ///
    /// The answer says, for each position, whether this delivery holds that job
    /// ([`BatchClaim::is_fresh`]) or an earlier one committed it. A key that appears twice is
    /// claimed by its first position; the later ones are duplicates. Run the fresh jobs'
    /// effects on [`BatchClaim::tx`] and end with [`BatchClaim::finish`]: all of them commit
    /// together, or none does. Dropping the claim rolls everything back.
    ///
    /// Refused before any I/O: a bad scope ([`Error::InvalidScope`]) and more than
    /// [`MAX_BATCH`] keys ([`Error::InvalidKey`] with [`KeyError::BatchTooLarge`]; build the
    /// keys with [`Key::batch`] to learn which job's key is bad). An empty batch does no I/O.
    ///
    /// The statement, per backend: PostgreSQL `INSERT ... SELECT $1, k, now() FROM
    /// unnest($2::text[]) ... ORDER BY k ON CONFLICT DO NOTHING RETURNING key` (the keys as one
    /// array bind); SQLite the same over `json_each(?2)` (one JSON bind); MySQL and MariaDB a
    /// multi-row `INSERT IGNORE` whose rows carry a sentinel, read back in the same message,
    /// then cleared on the fresh rows only (two round trips per batch; MySQL has no
    /// `RETURNING`, and one code path serves both servers).
    ///
    /// Overlapping batches lock their keys in one order (sorted), so they queue, never
    /// deadlock; a claim that loses a race anyway (`40001`, `40P01`, `1213`) is retried like
    /// [`Store::claim`]. A `wait` that runs out is [`Error::InProgress`] naming the batch's
    /// first key (the database does not say which key it waited for).
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[cfg(feature = "sqlite")]
    /// # async fn f(store: &idem::Store<sqlx::Sqlite>, jobs: &[(String, i64)]) -> Result<(), idem::Error> {
    /// let keys = idem::Key::batch(jobs.iter().map(|(id, _)| id))?;
    /// let mut claim = store.claim_batch("top_up", &keys).await?;
    /// let fresh: Vec<_> = jobs.iter().enumerate().filter(|(i, _)| claim.is_fresh(*i)).collect();
    /// let result: Result<(), idem::Error> = async {
    ///     if let Some(tx) = claim.tx() {
    ///         for (_, (id, cents)) in &fresh {
    ///             sqlx::query("INSERT INTO credits (id, cents) VALUES (?, ?)")
    ///                 .bind(id).bind(cents).execute(&mut **tx).await?;
    ///         }
    ///     }
    ///     Ok(())
    /// }.await;
    /// let batch = claim.finish(result).await?;
    /// assert_eq!(batch.outcomes().len(), jobs.len());
    /// # Ok(()) }
    /// ```
    pub async fn claim_batch(&self, scope: &str, keys: &[Key]) -> Result<BatchClaim<DB>, Error> {
        self.claim_batch_with(scope, keys, ClaimOptions::new())
            .await
    }

    /// [`claim_batch`](Store::claim_batch) with a `wait` and an isolation level.
    pub async fn claim_batch_with(
        &self,
        scope: &str,
        keys: &[Key],
        options: ClaimOptions,
    ) -> Result<BatchClaim<DB>, Error> {
        check_scope(scope)?;
        if keys.len() > MAX_BATCH {
            return Err(KeyError::BatchTooLarge { len: keys.len() }.into());
        }
        nested::refuse_nested("Store::claim_batch")?;
        self.claim_batch_owned(Cow::Owned(scope.to_owned()), keys, options)
            .await
    }

    pub(crate) async fn claim_batch_owned(
        &self,
        scope: Cow<'static, str>,
        keys: &[Key],
        options: ClaimOptions,
    ) -> Result<BatchClaim<DB>, Error> {
        let Some(first) = keys.first() else {
            return Ok(BatchClaim {
                fresh: Vec::new(),
                held: None,
            });
        };
        let mut sorted: Vec<&str> = keys.iter().map(Key::as_str).collect();
        sorted.sort_unstable();
        sorted.dedup();
        // `InProgress` of a batch names its first key: the database does not say which key
        // it waited for.
        let request = Request::new(scope, first.clone(), options, None);
        let (claimed, tx) = run::own_batch(self, request.clone(), &sorted).await?;
        let mut taken: HashMap<&str, bool> = claimed.iter().map(|k| (k.as_str(), true)).collect();
        // The first position of a claimed key takes it; `remove` leaves later ones out.
        let fresh: Vec<bool> = keys
            .iter()
            .map(|k| taken.remove(k.as_str()).unwrap_or(false))
            .collect();
        let held = match (tx, fresh.iter().position(|f| *f)) {
            // Errors of the commit name the first fresh key: the transaction held them all.
            (Some(tx), Some(position)) => {
                let request = Request {
                    key: keys[position].clone(),
                    ..request
                };
                Some(Held::new(tx, self.statements().clone(), request, false))
            }
            _ => None,
        };
        Ok(BatchClaim { fresh, held })
    }
}

/// The answer to [`Store::claim_batch`]: which jobs of the batch this delivery holds, and the
/// open transaction holding them.
///
/// [`finish`](BatchClaim::finish) commits (every fresh marker and the effects together) or
/// rolls back; dropping it, by a panic or a cancelled future, rolls back as well.
#[derive(Debug)]
#[must_use = "a batch claim may hold an open transaction: run the fresh jobs and call `finish`"]
pub struct BatchClaim<DB: Backend> {
    fresh: Vec<bool>,
    held: Option<Held<'static, DB>>,
}

impl<DB: Backend> BatchClaim<DB> {
    /// How many jobs the batch holds (fresh and duplicate).
    pub fn len(&self) -> usize {
        self.fresh.len()
    }

    /// `true` for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.fresh.is_empty()
    }

    /// `true` if this delivery holds the job at `position`: run its effect.
    ///
    /// # Panics
    ///
    /// If `position` is not below [`len`](BatchClaim::len).
    pub fn is_fresh(&self, position: usize) -> bool {
        self.fresh[position]
    }

    /// For each position of the batch, whether this delivery holds that job.
    pub fn fresh(&self) -> &[bool] {
        &self.fresh
    }

    /// `true` if at least one job is fresh (so the body must run).
    pub fn any_fresh(&self) -> bool {
        self.held.is_some()
    }

    /// The transaction the fresh jobs' effects must run on; `None` when every job was a
    /// duplicate (the transaction has ended already).
    pub fn tx(&mut self) -> Option<&mut Transaction<'static, DB>> {
        self.held.as_mut().map(Held::tx)
    }

    /// Ends the call: commits on `Ok`, rolls back on `Err`.
    ///
    /// On `Ok`, each fresh job is [`Outcome::Applied`](crate::Outcome::Applied) only once the database confirmed the
    /// commit (the same check as [`Guard::finish`](crate::Guard::finish): a transaction the
    /// database threw away is [`Error::RolledBack`] and nothing of it was kept). With no fresh
    /// job there is nothing to commit: the outcomes are all duplicates, and the value is
    /// dropped ([`Batch::value`] is `None`); an `Err` is returned as it is. `RolledBack` names
    /// the batch's first fresh key: the whole transaction was lost, every fresh job with it.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Batch<T>, E> {
        expansion::settle_batch(self.finish_failed(result, None).await)
    }

    async fn finish_failed<T, E>(
        self,
        result: Result<T, E>,
        outbox: Option<Pending>,
    ) -> Result<Batch<T>, Failed<E>> {
        let Some(held) = self.held else {
            result.map_err(Failed::Handler)?;
            return Ok(Batch::new(&vec![false; self.fresh.len()], None));
        };
        let value = held
            .finish_sending(result, |_| Ok(None), outbox)
            .await?
            .into_value();
        Ok(Batch::new(&self.fresh, value))
    }
}

/// What a batch handler's expansion calls (re-exported by `__private`).
pub(crate) mod expansion {
    use std::borrow::Cow;

    use super::{BatchClaim, collect_keys};
    use crate::backend::Backend;
    use crate::claim::nested;
    use crate::{Batch, BatchOutbox, ClaimOptions, Error, Failed, Key, KeyError, Store};

    /// The key of one job, encoded and checked (the position is added by [`batch_keys`]).
    #[inline]
    pub fn batch_key<K: crate::IntoKey + ?Sized>(value: &K) -> Result<Key, KeyError> {
        Key::new(value)
    }

    /// Before any I/O: refuses a call inside another handler's body, and checks every key.
    pub fn batch_keys(
        handler: &'static str,
        keys: impl Iterator<Item = Result<Key, KeyError>>,
    ) -> Result<Vec<Key>, Error> {
        nested::refuse_nested(handler)?;
        Ok(collect_keys(keys)?)
    }

    /// Claims the batch, passing a key error through without touching the database.
    pub async fn claim_batch<DB: Backend>(
        store: &Store<DB>,
        scope: &'static str,
        options: ClaimOptions,
        keys: Result<Vec<Key>, Error>,
    ) -> Result<BatchClaim<DB>, Error> {
        store
            .claim_batch_owned(Cow::Borrowed(scope), &keys?, options)
            .await
    }

    /// The jobs of a batch handler: the body gets clones of the fresh ones.
    #[diagnostic::on_unimplemented(
        message = "the jobs of a batch handler must be `Clone`: `{Self}` is not",
        label = "the body gets clones of the fresh jobs of this batch, in this type",
        note = "derive `Clone` for `{Self}`, or claim by hand with `Store::claim_batch`"
    )]
    pub trait BatchJob: Clone {}

    impl<T: Clone> BatchJob for T {}

    /// The fresh jobs, as the body's batch parameter sees them (a slice).
    pub enum FreshJobs<'a, T> {
        /// Every job of the batch was fresh.
        All(&'a [T]),
        /// Clones of the fresh ones, in the batch's order.
        Some(Vec<T>),
    }

    impl<T> std::ops::Deref for FreshJobs<'_, T> {
        type Target = [T];

        fn deref(&self) -> &[T] {
            match self {
                FreshJobs::All(jobs) => jobs,
                FreshJobs::Some(jobs) => jobs,
            }
        }
    }

    /// The jobs the body gets: the batch itself when every job is fresh, else clones of the
    /// fresh ones, in the batch's order (the body's parameter keeps its declared type).
    pub fn fresh_jobs<'a, T: BatchJob, DB: Backend>(
        jobs: &'a [T],
        claim: &BatchClaim<DB>,
    ) -> FreshJobs<'a, T> {
        if claim.fresh().iter().all(|f| *f) {
            return FreshJobs::All(jobs);
        }
        FreshJobs::Some(
            jobs.iter()
                .zip(claim.fresh())
                .filter(|(_, fresh)| **fresh)
                .map(|(job, _)| job.clone())
                .collect(),
        )
    }

    /// The transaction of a claim with a fresh job.
    pub fn batch_tx<DB: Backend>(
        claim: &mut BatchClaim<DB>,
    ) -> &mut sqlx::Transaction<'static, DB> {
        claim
            .tx()
            .expect("the expansion runs the body only with a fresh job")
    }

    /// The answer of a batch whose every job is a duplicate; the body did not run.
    pub fn all_duplicates<T, DB: Backend>(claim: &BatchClaim<DB>) -> Batch<T> {
        Batch::new(claim.fresh(), None)
    }

    /// [`BatchClaim::finish`] without converting idem's errors yet.
    pub async fn finish_batch<DB: Backend, T, E: From<Error>>(
        claim: BatchClaim<DB>,
        result: Result<T, E>,
    ) -> Result<Batch<T>, Failed<E>> {
        claim.finish_failed(result, None).await
    }

    /// [`claim_batch`] of a handler with an outbox: the outbox of the fresh jobs beside the
    /// claim (their keys move into it; the claim keeps none).
    pub async fn claim_batch_sending<DB: Backend>(
        store: &Store<DB>,
        scope: &'static str,
        options: ClaimOptions,
        keys: Result<Vec<Key>, Error>,
    ) -> Result<(BatchClaim<DB>, BatchOutbox), Error> {
        let keys = keys?;
        let claim = store
            .claim_batch_owned(Cow::Borrowed(scope), &keys, options)
            .await?;
        let fresh = keys
            .into_iter()
            .zip(claim.fresh())
            .filter_map(|(key, fresh)| fresh.then_some(key))
            .collect();
        Ok((claim, BatchOutbox::new(Cow::Borrowed(scope), fresh)))
    }

    /// [`finish_batch`] that also writes the outbox's messages in the batch's transaction.
    pub async fn finish_batch_sending<DB: Backend, T, E: From<Error>>(
        claim: BatchClaim<DB>,
        result: Result<T, E>,
        outbox: BatchOutbox,
    ) -> Result<Batch<T>, Failed<E>> {
        claim
            .finish_failed(result, Some(outbox.into_pending()))
            .await
    }

    /// The one place where an [`Error`] of a batch becomes the handler's error type.
    #[inline]
    pub fn settle_batch<T, E: crate::HandlerError>(
        result: Result<Batch<T>, Failed<E>>,
    ) -> Result<Batch<T>, E> {
        result.map_err(Failed::into_handler_error)
    }
}
