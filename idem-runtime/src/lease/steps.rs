//! Steps inside a lease's body: each step's `Ok` value recorded in the database as it returns,
//! fenced by the lease's token, so that a later holder of the key (the redelivery after a
//! crash) gets the value back instead of running the step again.
//!
//! The body calls its steps one at a time, so the recorded steps of a job are always the first
//! ones its body reached: a step is recorded only after the ones before it were. A first
//! delivery (attempt 1) has no steps to read; a later one reads them all with one statement at
//! its first step. Each step costs one statement (its record); a recorded one costs none.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Clock, Lease};
use crate::error::{Error, LeaseError, Refusal};
use crate::key::MAX_KEY_LEN;
use crate::record::{self, NotStorable};

/// What a step's closure gets: the step's own idempotency key and its time budget.
///
/// Pass [`idempotency_key`](Step::idempotency_key) to the outside system the step calls (each
/// step of a job has its own, the same on every redelivery), and
/// [`remaining`](Step::remaining) as the call's timeout.
#[derive(Debug, Clone)]
pub struct Step {
    name: Arc<str>,
    position: u32,
    idempotency_key: Arc<str>,
    clock: Arc<Clock>,
}

impl Step {
    /// The step's name, as the body gave it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the step is in its body: 1 for the first step the body called, 2 for the next.
    pub fn position(&self) -> u32 {
        self.position
    }

    /// The key to give the outside system this step calls: the job's scope, key and the
    /// step's name together (`14:billing.charge|7:order-7|6:charge`, idem's tuple encoding),
    /// at most 255 bytes (longer ones become `sha256:` and the hex digest of that encoding).
    /// The same on every redelivery of the job, and different from every other step's and
    /// from the lease's own [`idempotency_key`](Lease::idempotency_key).
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }

    /// What the step has left: the body's time left (the lease's, less its margin), which moves
    /// with every [`renew`](Lease::renew). Give it to the outside call as its timeout.
    pub fn remaining(&self) -> Duration {
        self.clock.remaining()
    }

    /// When the lease runs out (conservatively: measured from before the claim or the last
    /// renewal was sent).
    pub fn deadline(&self) -> Instant {
        self.clock.deadline().into_std()
    }
}

/// What a step's verify found out from the outside system
/// ([`Lease::step_verified`]): whether the step's effect happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verified<T> {
    /// It happened, and this is its value: the step is recorded with it and not run.
    Happened(T),
    /// It did not happen: the step runs (or, after the step's own error, the error is
    /// transient and the lease is released for a retry).
    NotHappened,
    /// The outside system cannot tell yet: the lease is kept until it runs out, so that the
    /// next delivery asks again.
    Unknown,
}

/// The body's book of its steps: the names it used, the one running, and the steps an earlier
/// holder recorded (read at the first step of a takeover).
#[derive(Debug, Default)]
pub(crate) struct Book {
    used: Vec<Arc<str>>,
    running: Option<Arc<str>>,
    recorded: Option<HashMap<String, String>>,
}

/// The steps of a lease, shared by the body's calls (which only borrow the lease).
#[derive(Debug, Default)]
pub(crate) struct Steps(Mutex<Book>);

impl Steps {
    fn book(&self) -> MutexGuard<'_, Book> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A step between its start and its end: its place in the book is cleared when it ends, also
/// when its future is dropped (a timeout, a cancelled body).
struct Running<'a> {
    steps: &'a Steps,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.steps.book().running = None;
    }
}

/// The longest step name: what a key may be.
pub const MAX_STEP_NAME: usize = MAX_KEY_LEN;

/// A verify closure that is never called, for the steps that have none.
type NoVerify<T, E> = fn(Step) -> std::future::Ready<Result<Verified<T>, E>>;

impl Lease {
    /// Runs the step `name` of the body once per job: its `Ok` value is recorded (JSON) as it
    /// returns, if this delivery still holds the key; a later delivery (after a crash, a
    /// timeout, an error) that reaches the same step gets the recorded value back without
    /// running it.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn f(lease: &idem::Lease) -> Result<(), idem::Error> {
    /// let charge_id: String = lease
    ///     .step("charge", |step| async move {
    ///         // The step's own idempotency key and time budget go to the outside call.
    ///         let _ = (step.idempotency_key(), step.remaining());
    ///         Ok::<_, idem::Error>("ch_1".to_owned())
    ///     })
    ///     .await?;
    /// lease
    ///     .step("mail", |step| async move {
    ///         let _ = (step.idempotency_key(), &charge_id);
    ///         Ok::<_, idem::Error>(())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// - Steps run one at a time in the body's order, so the recorded steps are always the
    ///   first ones it reached. A name used twice in one body, a step started while another
    ///   runs, and a name that is empty, longer than [`MAX_STEP_NAME`] bytes or holds a NUL
    ///   byte are [`Refusal::Step`], before anything runs.
    /// - The record is fenced: a holder whose lease was taken over gets
    ///   [`LeaseError::Lost`] and records nothing (its step ran: the outside system got the step's
    ///   idempotency key, which the new holder sends too).
    /// - The step's `Err` is returned as it is and nothing is recorded: the next delivery
    ///   runs the step again. A value that cannot be stored (not serialisable, over
    ///   [`MAX_REPLAY_LEN`](crate::MAX_REPLAY_LEN)) is [`Error::Serialize`]: the step ran,
    ///   and runs again on the next delivery. A recorded value that no longer reads as `T`
    ///   is [`Error::Serialize`] too.
    pub async fn step<T, E, F, Fut>(&self, name: &str, run: F) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.step_with(name, run, None::<NoVerify<T, E>>).await
    }

    /// [`step`](Lease::step) whose effect the outside system can be asked about: `verify`
    /// asks it (by the step's idempotency key) whether the step's effect happened.
    ///
    /// `verify` runs
    /// - before the step, on a delivery that took the key over (not the first attempt) and
    ///   finds the step unrecorded: the holder before may have run it and stopped before its
    ///   record (a crash, a lost lease);
    /// - after the step, when the step's error was marked [`unknown`](Lease::unknown) (a
    ///   timeout: the call may have happened).
    ///
    /// [`Verified::Happened`] records its value as the step's and returns it;
    /// [`Verified::NotHappened`] runs the step (before) or makes its error
    /// [`transient`](Lease::transient) (after); [`Verified::Unknown`] keeps the lease until
    /// it runs out ([`unknown`](Lease::unknown)) and returns [`LeaseError::Unverified`] (before) or
    /// the step's error (after).
    pub async fn step_verified<T, E, F, Fut, V, VFut>(
        &self,
        name: &str,
        run: F,
        verify: V,
    ) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        V: FnMut(Step) -> VFut,
        VFut: Future<Output = Result<Verified<T>, E>>,
    {
        self.step_with(name, run, Some(verify)).await
    }

    async fn step_with<T, E, F, Fut, V, VFut>(
        &self,
        name: &str,
        run: F,
        mut verify: Option<V>,
    ) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(Step) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        V: FnMut(Step) -> VFut,
        VFut: Future<Output = Result<Verified<T>, E>>,
    {
        let (step, _running) = self.begin_step(name)?;
        if let Some(value) = self.replayed(&step).await? {
            return Ok(value);
        }
        if let Some(verify) = verify.as_mut()
            && self.attempt() > 1
        {
            match verify(step.clone()).await? {
                Verified::Happened(value) => return self.keep_step(&step, value, false).await,
                Verified::NotHappened => {}
                Verified::Unknown => {
                    self.classify(super::Class::Unknown);
                    return Err(E::from(self.unverified(&step)));
                }
            }
        }
        let ran = run(step.clone()).await;
        let value = match ran {
            Ok(value) => value,
            Err(e) => {
                let Some(verify) = verify.as_mut() else {
                    return Err(e);
                };
                if !self.is_unknown() {
                    return Err(e);
                }
                return match verify(step.clone()).await? {
                    Verified::Happened(value) => {
                        self.classify(super::Class::Plain);
                        self.keep_step(&step, value, true).await
                    }
                    Verified::NotHappened => {
                        self.classify(super::Class::Transient);
                        Err(e)
                    }
                    Verified::Unknown => Err(e),
                };
            }
        };
        self.keep_step(&step, value, true).await
    }

    /// Runs the database step `name` once per job: `run` writes on its own transaction, which
    /// commits together with the step's record (both or neither), if this delivery still holds
    /// the key; a later delivery gets the recorded value back without running it.
    ///
    /// `DB` must be the database of the store the lease was taken on (else
    /// [`Refusal::Step`], before anything runs). The transaction begins as a claim's does
    /// (SQLite: `BEGIN IMMEDIATE`) and its commit is verified (a transaction the database rolled
    /// back is [`NotKept::RolledBack`](crate::NotKept::RolledBack), nothing of it kept). `run`'s
    /// `Err` rolls it back. A claim with a store inside `run` is refused as [`Refusal::Nested`].
    /// Names and order as for [`step`](Lease::step).
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[cfg(feature = "sqlite")]
    /// # async fn f(lease: &idem::Lease) -> Result<(), idem::Error> {
    /// let row: i64 = lease
    ///     .tx_step("ledger", async |tx: &mut idem::Tx<'_, sqlx::Sqlite>| {
    ///         let done = sqlx::query("INSERT INTO ledger (order_id, cents) VALUES (7, 4200)")
    ///             .execute(&mut **tx)
    ///             .await?;
    ///         Ok::<_, idem::Error>(done.last_insert_rowid())
    ///     })
    ///     .await?;
    /// # let _ = row; Ok(()) }
    /// ```
    pub async fn tx_step<DB, T, E, F>(&self, name: &str, run: F) -> Result<T, E>
    where
        DB: crate::backend::Backend,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: AsyncFnOnce(&mut sqlx::Transaction<'_, DB>) -> Result<T, E>,
    {
        let (step, _running) = self.begin_step(name)?;
        if let Some(value) = self.replayed(&step).await? {
            return Ok(value);
        }
        let Some(store) = self
            .store
            .as_any()
            .downcast_ref::<crate::store::Store<DB>>()
        else {
            return Err(E::from(self.invalid_step(
                &step.name,
                format!(
                    "the lease was taken on a store of another database than the step's \
                     transaction ({}): name the lease's database in the closure's \
                     `&mut idem::Tx<'_, DB>`",
                    DB::BACKEND
                ),
            )));
        };
        let body = self.ticket_body();
        let value = super::db_step::run(store, self, &step, body, run).await?;
        self.step_done(&step, true).await?;
        Ok(value)
    }

    /// Checks the step's name and the body's order, and books the step as running.
    fn begin_step(&self, name: &str) -> Result<(Step, Running<'_>), Error> {
        let reason = if name.is_empty() {
            Some("a step name cannot be empty".to_owned())
        } else if name.len() > MAX_STEP_NAME {
            Some(format!(
                "a step name is at most {MAX_STEP_NAME} bytes, this one is {}",
                name.len()
            ))
        } else if name.contains('\0') {
            Some("a step name cannot hold a NUL byte".to_owned())
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(self.invalid_step(name, reason));
        }
        if self.class() == super::Class::Crashed {
            // The kit crashed this delivery after a step: nothing after it runs.
            return Err(Error::crashed(self.scope(), self.key()));
        }
        let mut book = self.steps.book();
        if let Some(other) = &book.running {
            let reason = format!(
                "it was started while the step {other:?} was still running: steps run one at \
                 a time, in order (await each step before the next)"
            );
            return Err(self.invalid_step(name, reason));
        }
        if book.used.iter().any(|used| &**used == name) {
            let reason = "this body already ran a step of that name: give each step of a body \
                          a name of its own (a step in a loop: put the item's id in its name)"
                .to_owned();
            return Err(self.invalid_step(name, reason));
        }
        let name: Arc<str> = Arc::from(name);
        book.used.push(name.clone());
        book.running = Some(name.clone());
        let position = u32::try_from(book.used.len()).unwrap_or(u32::MAX);
        drop(book);
        let idempotency_key = crate::job_id::bounded_encoding(&(self.scope(), self.key(), &*name))
            .expect("a checked scope, a valid key and a checked name always encode");
        let step = Step {
            name,
            position,
            idempotency_key: Arc::from(idempotency_key),
            clock: self.clock.clone(),
        };
        Ok((step, Running { steps: &self.steps }))
    }

    /// The step's recorded value, if a holder before this one recorded it. A first delivery
    /// reads nothing: no step of the key can be recorded before its marker existed.
    async fn replayed<T: DeserializeOwned>(&self, step: &Step) -> Result<Option<T>, Error> {
        if self.attempt() <= 1 {
            return Ok(None);
        }
        let loaded = self.steps.book().recorded.is_some();
        if !loaded {
            let rows = self.store.steps_read(self.scope(), self.key()).await?;
            let recorded = rows.into_iter().map(|(name, _, _, json, _)| (name, json));
            self.steps.book().recorded = Some(recorded.collect());
        }
        let json = self
            .steps
            .book()
            .recorded
            .as_ref()
            .and_then(|recorded| recorded.get(&*step.name).cloned());
        let Some(json) = json else {
            return Ok(None);
        };
        let value = record::decode(&json).map_err(|e| {
            Error::Serialize(format!(
                "the value recorded for the step {:?} of {:?} / {:?} no longer reads as the \
                 step's type: {e}; the step ran (it is not run again): make its type read the \
                 recorded JSON, or forget the job to run it from the start",
                step.name,
                self.scope(),
                self.key()
            ))
        })?;
        self.step_done(step, false).await?;
        Ok(Some(value))
    }

    /// Records `value` as the step's, fenced by the lease's token.
    async fn keep_step<T: Serialize, E: From<Error>>(
        &self,
        step: &Step,
        value: T,
        ran: bool,
    ) -> Result<T, E> {
        let json = self.step_json(step, &value)?;
        let recorded = self
            .store
            .step_record(self.holder(), &step.name, i64::from(step.position), &json)
            .await
            .map_err(Error::from)?;
        if !recorded {
            return Err(E::from(super::lost(self.ticket_request())));
        }
        self.step_done(step, ran).await?;
        Ok(value)
    }

    /// The JSON a step's value is recorded as.
    pub(super) fn step_json<T: Serialize>(&self, step: &Step, value: &T) -> Result<String, Error> {
        record::encode(value).map_err(|NotStorable(reason)| {
            Error::Serialize(format!(
                "the value of the step {:?} of {:?} / {:?} cannot be recorded: {reason}; the \
                 step ran but was not recorded, so the next delivery runs it again (with the \
                 same idempotency key)",
                step.name,
                self.scope(),
                self.key()
            ))
        })
    }

    /// A step ended with its value (run now, or read back): the test kit's point after each
    /// step.
    async fn step_done(&self, step: &Step, ran: bool) -> Result<(), Error> {
        if let Some(e) =
            crate::testing::probe::step_done(self.scope(), self.key(), &step.name, ran).await
        {
            self.classify(super::Class::Crashed);
            return Err(e);
        }
        let _ = (step, ran);
        Ok(())
    }

    fn invalid_step(&self, name: &str, reason: String) -> Error {
        Error::Refused(Refusal::Step {
            scope: self.scope().to_owned(),
            key: self.key().to_owned(),
            step: name.to_owned(),
            reason,
        })
    }

    fn unverified(&self, step: &Step) -> Error {
        Error::Lease(LeaseError::Unverified {
            scope: self.scope().to_owned(),
            key: self.key().to_owned(),
            step: step.name.to_string(),
        })
    }
}
