//! Batch claims: the markers of a whole batch of jobs claimed with one statement, and their
//! effects committed together, so that a batch of 100 jobs costs one commit (one fsync), not
//! 100. The markers it meets are decided as every mode decides them.

use std::borrow::Cow;
use std::collections::HashMap;

use sqlx::Transaction;

use crate::backend::Backend;
use crate::claim::nested::Body;
use crate::claim::{Request, TxHeld, end, run};
use crate::error::{Error, Refusal};
use crate::key::{Key, MAX_BATCH};
use crate::options::ClaimOptions;
use crate::outcome::{Batch, Failed, Failure};
use crate::outgoing::BatchOutbox;
use crate::scope::check_scope;
use crate::store::Store;

impl<DB: Backend> Store<DB> {
    /// Begins a transaction and claims every key of `keys` in it with one statement, with the
    /// database's defaults.
    ///
    /// The answer says, for each position, whether this delivery holds that job
    /// ([`BatchGuard::is_fresh`]) or an earlier one committed it. A key that appears twice is
    /// claimed by its first position; the later ones are duplicates. Run the fresh jobs'
    /// effects on [`BatchGuard::tx`] (and send their messages on [`BatchGuard::outbox`]) and
    /// end with [`BatchGuard::finish`]: all of them commit together, or none does. Dropping
    /// the guard rolls everything back.
    ///
    /// The markers the claim meets are decided as in every mode: a completed one is a
    /// duplicate, a free lease is taken over, and a live lease of any job makes the whole
    /// batch [`Error::InProgress`] (nothing is claimed; every job is redelivered). A batch has
    /// one value for all its jobs, so a duplicate job is never `Replayed` (a stored value is one
    /// job's); and a batch stores no fingerprints: a batch's jobs are checked against reused
    /// keys by their single-job handlers.
    ///
    /// Refused before any I/O: a bad scope ([`Refusal::Scope`]), more than
    /// [`MAX_BATCH`] keys ([`Refusal::Batch`]; build the keys with [`Key::batch`] to
    /// learn which job's key is bad), and a claim inside the open transaction of another claim of
    /// this task ([`Refusal::Nested`]). An empty batch does no I/O.
    ///
    /// The statement, per backend: PostgreSQL `INSERT ... SELECT $1, k, ... FROM
    /// unnest($2::text[]) ... ORDER BY k ON CONFLICT DO NOTHING RETURNING key` (the keys as one
    /// array bind); SQLite the same over `json_each(?2)` (one JSON bind); MySQL and MariaDB a
    /// multi-row `INSERT IGNORE` whose rows carry the claim's nonce, read back in the same
    /// message (MySQL has no `RETURNING`, and one code path serves both servers).
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
    ///     for (_, (id, cents)) in &fresh {
    ///         claim.outbox().send(id, "receipts", cents)?;
    ///     }
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
    pub async fn claim_batch(&self, scope: &str, keys: &[Key]) -> Result<BatchGuard<DB>, Error> {
        self.claim_batch_with(scope, keys, ClaimOptions::new())
            .await
    }

    /// [`claim_batch`](Store::claim_batch) with the options' `wait` and isolation level.
    pub async fn claim_batch_with(
        &self,
        scope: &str,
        keys: &[Key],
        options: ClaimOptions,
    ) -> Result<BatchGuard<DB>, Error> {
        check_scope(scope)?;
        if keys.len() > MAX_BATCH {
            return Err(Error::Refused(Refusal::Batch { len: keys.len() }));
        }
        let scope = Cow::Owned(scope.to_owned());
        claim_batch(self, scope, keys, options, None).await
    }
}

/// A batch claim: `site` and `caller` are a handler's (else the scope's, and
/// `Store::claim_batch`).
pub(crate) async fn claim_batch<DB: Backend>(
    store: &Store<DB>,
    scope: Cow<'static, str>,
    keys: &[Key],
    options: ClaimOptions,
    handler: Option<(&'static crate::observe::Site, &'static str)>,
) -> Result<BatchGuard<DB>, Error> {
    let Some(first) = keys.first() else {
        return Ok(BatchGuard {
            fresh: Vec::new(),
            failed: Vec::new(),
            held: None,
            fresh_keys: Vec::new(),
            taken: Vec::new(),
            outbox: None,
        });
    };
    let mut sorted: Vec<&str> = keys.iter().map(Key::as_str).collect();
    sorted.sort_unstable();
    sorted.dedup();
    // A batch stores no fingerprint nor replays a value: see `Store::claim_batch`.
    let options = ClaimOptions {
        replay: false,
        fingerprint: None,
        ..options
    };
    // `InProgress` of a batch names its first key: the database does not say which key it
    // waited for.
    let request = match handler {
        Some((site, name)) => Request::of(scope, first.clone(), options, site, name.into()),
        None => Request::new(scope, first.clone(), options, "Store::claim_batch"),
    };
    let (claimed, failed, mut held) = run::batch(store, request, &sorted, keys.len()).await?;
    let mut unused: HashMap<&str, bool> =
        claimed.fresh.iter().map(|k| (k.as_str(), true)).collect();
    // The first position of a claimed key takes it; `remove` leaves later ones out.
    let fresh: Vec<bool> = keys
        .iter()
        .map(|k| unused.remove(k.as_str()).unwrap_or(false))
        .collect();
    let fresh_keys: Vec<Key> = keys
        .iter()
        .zip(&fresh)
        .filter(|&(_, fresh)| *fresh)
        .map(|(key, _)| key.clone())
        .collect();
    // Every position of a key that failed for good in an earlier delivery is that failure.
    let failed: Vec<(usize, Failure)> = keys
        .iter()
        .enumerate()
        .filter_map(|(i, k)| {
            let (_, failure) = failed.iter().find(|(key, _)| key == k.as_str())?;
            Some((i, failure.clone()))
        })
        .collect();
    // Errors of the commit name the first fresh key: the transaction held them all.
    if let (Some(held), Some(first)) = (&mut held, fresh_keys.first()) {
        held.rekey(first.clone());
    }
    Ok(BatchGuard {
        fresh,
        failed,
        held,
        fresh_keys,
        taken: claimed.taken,
        outbox: None,
    })
}

/// What [`BatchGuard::each`](crate::BatchGuard::each) takes over from a batch claim.
pub(crate) type EachParts<DB> = (
    Vec<bool>,
    Vec<(usize, Failure)>,
    Option<TxHeld<'static, DB>>,
    Vec<Key>,
    Vec<String>,
    Option<BatchOutbox>,
);

/// The answer to [`Store::claim_batch`]: which jobs of the batch this delivery holds, and the
/// open transaction holding them.
///
/// [`finish`](BatchGuard::finish) commits (every fresh marker, the effects and the
/// [`outbox`](BatchGuard::outbox) together) or rolls back; [`release`](BatchGuard::release),
/// or dropping it (a panic, a cancelled future), rolls back as well. Its call has one
/// `idem.claim` span, and `idem_outcomes_total` counts each of its jobs.
#[derive(Debug)]
#[must_use = "a batch claim may hold an open transaction: run the fresh jobs and call `finish`"]
pub struct BatchGuard<DB: Backend> {
    fresh: Vec<bool>,
    /// The positions of the jobs an earlier delivery failed for good.
    failed: Vec<(usize, Failure)>,
    held: Option<TxHeld<'static, DB>>,
    /// The fresh jobs' keys, in the batch's order, until the outbox takes them.
    fresh_keys: Vec<Key>,
    /// The fresh keys that were free leases taken over (the others were inserted).
    taken: Vec<String>,
    outbox: Option<BatchOutbox>,
}

impl<DB: Backend> BatchGuard<DB> {
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
    /// If `position` is not below [`len`](BatchGuard::len).
    pub fn is_fresh(&self, position: usize) -> bool {
        self.fresh[position]
    }

    /// The outcomes of a batch none of whose jobs is fresh: duplicates, and the failures of
    /// the jobs that failed for good.
    pub(crate) fn settled<T>(&self) -> Batch<T> {
        Batch::new(&self.fresh, None).failed_at(&self.failed)
    }

    /// The failure of the job at `position` if an earlier delivery failed it for good (a
    /// lease-mode body's permanent error under the same scope): the job is not fresh, and its
    /// outcome is [`Outcome::Failed`](crate::Outcome::Failed).
    pub fn failure(&self, position: usize) -> Option<&Failure> {
        let (_, failure) = self.failed.iter().find(|(p, _)| *p == position)?;
        Some(failure)
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
        self.held.as_mut().map(TxHeld::tx)
    }

    /// The outbox of the batch's fresh jobs: each message names its job by its key, and all
    /// are written with the markers when the batch finishes with `Ok`.
    pub fn outbox(&mut self) -> &mut BatchOutbox {
        let scope = match &self.held {
            Some(held) => held.request().scope.clone(),
            None => Cow::Borrowed(""),
        };
        let keys = &mut self.fresh_keys;
        self.outbox
            .get_or_insert_with(|| BatchOutbox::new(scope, std::mem::take(keys)))
    }

    /// The transaction and the outbox at once, for a body that takes both; `None` as for
    /// [`tx`](BatchGuard::tx).
    pub fn parts(&mut self) -> Option<(&mut Transaction<'static, DB>, &mut BatchOutbox)> {
        self.outbox();
        let outbox = self.outbox.as_mut().expect("made above");
        let tx = self.held.as_mut().map(TxHeld::tx)?;
        Some((tx, outbox))
    }

    /// The call's `idem.claim` span; `None` when every job was a duplicate (the call has
    /// ended).
    pub fn span(&self) -> Option<&tracing::Span> {
        self.held.as_ref().map(TxHeld::span)
    }

    /// The batch's body, to run in its span and marked as inside its open transaction (see
    /// [`Guard::body`](crate::Guard::body)); `None` when every job was a duplicate.
    pub fn body(&self) -> Option<Body> {
        self.held.as_ref().map(TxHeld::body)
    }

    /// Ends the call: commits on `Ok`, rolls back on `Err`.
    ///
    /// On `Ok`, each fresh job is [`Outcome::Applied`](crate::Outcome::Applied) only once the
    /// database confirmed the commit (the same check as
    /// [`Guard::finish`](crate::Guard::finish): a transaction the database threw away is
    /// [`NotKept::RolledBack`](crate::NotKept::RolledBack) and nothing of it was kept). With no
    /// fresh job there is nothing to commit: the outcomes are all duplicates, and the value is
    /// dropped ([`Batch::value`] is `None`); an `Err` is returned as it is. `NotKept::RolledBack`
    /// names the batch's first fresh key: the whole transaction was lost, every fresh job with it.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Batch<T>, E> {
        let end = self.finish_failed(result.map_err(Failed::Handler)).await;
        end.map_err(Failed::into_handler_error)
    }

    /// Gives up: rolls the transaction back, every fresh job's marker and effect with it.
    pub async fn release(self) {
        let result: Result<(), Failed<()>> = Err(Failed::Handler(()));
        drop(self.finish_failed(result).await);
    }

    /// What [`each`](BatchGuard::each) runs on: the fresh flags, the transaction, the fresh
    /// keys in order, the keys taken over, and the messages sent so far.
    pub(crate) fn into_each_parts(self) -> EachParts<DB> {
        let BatchGuard {
            fresh,
            failed,
            held,
            fresh_keys,
            taken,
            outbox,
        } = self;
        (fresh, failed, held, fresh_keys, taken, outbox)
    }

    pub(crate) async fn finish_failed<T, E>(
        self,
        result: Result<T, Failed<E>>,
    ) -> Result<Batch<T>, Failed<E>> {
        let BatchGuard {
            fresh,
            failed,
            held,
            outbox,
            ..
        } = self;
        let Some(held) = held else {
            result?;
            return Ok(Batch::new(&fresh, None).failed_at(&failed));
        };
        let (hold, ticket) = held.into_parts();
        let unsent = outbox.map(BatchOutbox::into_unsent);
        let ended = end(hold, &ticket, unsent.as_ref(), result, |_| Ok(None)).await;
        let batch =
            ended.map(|outcome| Batch::new(&fresh, outcome.into_value()).failed_at(&failed));
        ticket.observed.ended_batch(&batch);
        batch
    }
}
