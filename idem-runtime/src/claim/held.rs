//! A fresh claim, held, and its one end: what every holder carries ([`Ticket`]), what each
//! mode's hold does at the end ([`Hold`]), and the finish every holder goes through.

use std::future::Future;
use std::sync::Arc;

use sqlx::Transaction;

use super::Request;
use super::nested::Body;
use crate::backend::{Backend, Check, Fence, Partition, Sql};
use crate::error::{Error, NotKept};
use crate::key::Key;
use crate::observe::Observed;
use crate::outcome::{Failed, Failure, Outcome};
use crate::outgoing::{Outbox, Unsent};
use crate::record::NotStorable;

/// What every fresh claim carries, whatever holds it: the request, the call's observation,
/// and the messages its body sends.
#[derive(Debug)]
pub(crate) struct Ticket {
    pub(crate) request: Request,
    pub(crate) observed: Observed,
    /// Boxed: most bodies send nothing, and the holder (this ticket in it) is moved from
    /// future to future on every call, byte by byte.
    outbox: Option<Box<Outbox>>,
}

impl Ticket {
    pub(crate) fn new(request: Request, observed: Observed) -> Ticket {
        Ticket {
            request,
            observed,
            outbox: None,
        }
    }

    /// The claim's body, to run in its span and marked as inside its open transaction.
    pub(crate) fn body(&self) -> Body {
        let span = self.observed.span().clone();
        Body::new(self.request.caller.clone(), span)
    }

    /// The outbox of this claim's job: its messages get ids from its scope and key.
    pub(crate) fn outbox(&mut self) -> &mut Outbox {
        let Request { scope, key, .. } = &self.request;
        self.outbox
            .get_or_insert_with(|| Box::new(Outbox::new(scope.clone(), key.clone())))
    }

    fn unsent(&self) -> Option<&Unsent> {
        self.outbox
            .as_deref()
            .map(Outbox::unsent)
            .filter(|p| !p.is_empty())
    }
}

/// What holds a fresh claim in one mode, and how it ends. The finish calls `write`, then (the
/// test kit's fault, if any) `commit`, or `release` instead.
pub(crate) trait Hold: Send + Sized {
    /// Where the test kit injects a failure "right before" this hold keeps the work.
    fn end(&self) -> &'static str;

    /// Whether an outside effect happened before the end (lease mode): a value that cannot be
    /// stored then still completes the marker, without it.
    const OUTSIDE: bool;

    /// Writes what is kept with the marker before it is kept: the value for `replay` and the
    /// outbox's messages, in the claim's transaction (a lease writes both as it completes).
    /// Called only when there is one of them to write.
    fn write(&mut self, ending: Ending<'_>) -> impl Future<Output = Result<(), Error>> + Send;

    /// Keeps the work: commits (verified), releases the savepoint, or completes the lease if
    /// its token still matches.
    fn commit(self, ending: Ending<'_>) -> impl Future<Output = Result<(), Error>> + Send;

    /// Keeps nothing: rolls back, or releases the lease for the next delivery.
    fn release(self, request: &Request) -> impl Future<Output = ()> + Send;
}

/// What a fresh claim whose body succeeded ends with: its request, the value to store with
/// the marker (`replay`, as JSON) and the outbox's messages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ending<'a> {
    pub(crate) request: &'a Request,
    pub(crate) value: Option<&'a str>,
    pub(crate) outbox: Option<&'a Unsent>,
}

/// Ends a fresh claim with the body's `result`, in every mode: on `Ok`, stores what `encode`
/// makes of the value (`replay`) and the outbox's messages with the marker, and keeps the work
/// ([`Outcome::Applied`] only once the database confirmed it); on `Err` (the body's, or idem's:
/// a lease's timeout), keeps nothing. Then records the call's outcome on its span and
/// metrics.
pub(crate) async fn finish<H: Hold, T, E>(
    hold: H,
    ticket: Ticket,
    outbox: Option<&Unsent>,
    result: Result<T, Failed<E>>,
    encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
) -> Result<Outcome<T>, Failed<E>> {
    let ended = end(hold, &ticket, outbox, result, encode).await;
    let Ticket { observed, .. } = ticket;
    observed.ended(&ended);
    ended
}

/// Ends a fresh claim whose body failed for good (a lease's permanent error): the hold keeps
/// the claim as failed (its commit records `failure` instead of a value, and writes none of
/// the outbox's messages), and the call's outcome is [`Outcome::Failed`], observed as such.
pub(crate) async fn finish_failed<H: Hold, T, E>(
    hold: H,
    ticket: Ticket,
    failure: Failure,
) -> Result<Outcome<T>, Failed<E>> {
    let kept: Result<Outcome<()>, Failed<E>> = end(hold, &ticket, None, Ok(()), |_| Ok(None)).await;
    let ended = kept.map(|_| Outcome::Failed(failure));
    let Ticket { observed, .. } = ticket;
    observed.ended(&ended);
    ended
}

/// [`finish`] without the observation's end: a batch records one outcome per job.
pub(crate) async fn end<H: Hold, T, E>(
    mut hold: H,
    ticket: &Ticket,
    outbox: Option<&Unsent>,
    result: Result<T, Failed<E>>,
    encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
) -> Result<Outcome<T>, Failed<E>> {
    let (request, outbox) = (&ticket.request, outbox.or(ticket.unsent()));
    let value = match result {
        Ok(value) => value,
        Err(failed) => {
            hold.release(request).await;
            return Err(failed);
        }
    };
    let (json, not_stored) = match encode(&value) {
        Ok(json) => (json, None),
        Err(NotStorable(reason)) if H::OUTSIDE => (None, Some(reason)),
        Err(NotStorable(reason)) => {
            hold.release(request).await;
            return Err(Failed::Idem(Error::Serialize(format!(
                "the value of {:?} / {:?} cannot be stored for `replay`: {reason}; the \
                 transaction was rolled back, nothing was kept; a redelivery runs the job \
                 again and fails the same way unless its value changes: make the value \
                 storable, or drop `replay`",
                request.scope,
                request.key.as_str()
            ))));
        }
    };
    let ending = Ending {
        request,
        value: json.as_deref(),
        outbox,
    };
    // Nothing to write is every plain job's end: no write's future to build and poll.
    if (json.is_some() || outbox.is_some())
        && let Err(e) = hold.write(ending).await
    {
        hold.release(request).await;
        return Err(Failed::Idem(e));
    }
    let (scope, key) = (&request.scope, request.key.as_str());
    if let Some(e) = crate::testing::probe::before_commit(scope, key, hold.end()).await {
        hold.release(request).await;
        return Err(Failed::Idem(e));
    }
    hold.commit(ending).await.map_err(Failed::Idem)?;
    match not_stored {
        None => Ok(Outcome::Applied(value)),
        Some(reason) => Err(Failed::Idem(Error::ValueNotStored {
            scope: request.scope.to_string(),
            key: request.key.as_str().to_owned(),
            reason,
        })),
    }
}

/// A fresh claim's transaction: one of idem's own, or a savepoint of the caller's (`joined`),
/// which ends with a `RELEASE` and leaves the commit to the caller. Dropping it (a panic, a
/// cancelled future) rolls it back.
#[derive(Debug)]
pub(crate) struct TxHold<'c, DB: Backend> {
    tx: Transaction<'c, DB>,
    sql: Arc<Sql<DB>>,
    joined: bool,
    kept: Kept,
    /// Whether it wrote outbox messages: its commit then wakes the store's relays.
    wrote: bool,
}

/// What a fresh claim's transaction writes that only it holds: what its commit looks for
/// (MySQL) and what its outbox's write is fenced by (MySQL, SQLite).
#[derive(Debug, Clone)]
pub(crate) enum Kept {
    /// The claim's marker, holding its nonce.
    Marker,
    /// The offset watermark of this partition, which the claim moved and which holds its
    /// nonce (an offset claim of several partitions names its first).
    Watermark {
        group: String,
        topic: String,
        partition: i32,
    },
}

impl Kept {
    pub(crate) fn partition(&self) -> Option<Partition<'_>> {
        match self {
            Kept::Marker => None,
            Kept::Watermark {
                group,
                topic,
                partition,
            } => Some(Partition {
                group,
                topic,
                partition: *partition,
            }),
        }
    }
}

/// What a statement of ours that failed means: the body swallowed an error that aborted the
/// transaction or savepoint (PostgreSQL), which is a rollback, not a database failure.
fn failed<DB: Backend>(e: sqlx::Error, request: &Request) -> Error {
    if DB::is_aborted(&e) {
        return rolled_back(request);
    }
    e.into()
}

pub(crate) fn rolled_back(request: &Request) -> Error {
    Error::NotKept(NotKept::RolledBack {
        scope: request.scope.to_string(),
        key: request.key.as_str().to_owned(),
    })
}

/// What a fresh claim's transaction (or savepoint) writes as it ends well, before its commit:
/// the value to replay, and the messages, fenced by what the claim keeps. `true` if it wrote
/// a message, which the commit then announces to the store's relays.
pub(crate) async fn write_ending<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
    kept: &Kept,
    ending: Ending<'_>,
) -> Result<bool, Error> {
    let Ending {
        request,
        value,
        outbox,
    } = ending;
    let (scope, key) = (&request.scope, request.key.as_str());
    if let Some(json) = value {
        let recorded = sql.record(conn, scope, key, json).await;
        recorded.map_err(|e| failed::<DB>(e, request))?;
    }
    let Some(outbox) = outbox else {
        return Ok(false);
    };
    let fence = match kept.partition() {
        None => Fence::Marker(request.nonce),
        Some(at) => Fence::Watermark(at, request.nonce),
    };
    let written = DB::outbox_write(conn, sql, outbox, fence).await;
    written.map_err(|e| failed::<DB>(e, request))?;
    Ok(!outbox.is_empty())
}

impl<DB: Backend> Hold for TxHold<'_, DB> {
    const OUTSIDE: bool = false;

    fn end(&self) -> &'static str {
        match self.joined {
            true => "savepoint release",
            false => "commit",
        }
    }

    async fn write(&mut self, ending: Ending<'_>) -> Result<(), Error> {
        let (tx, sql, kept) = (&mut self.tx, &self.sql, &self.kept);
        self.wrote |= write_ending::<DB>(tx, sql, kept, ending).await?;
        Ok(())
    }

    async fn commit(self, ending: Ending<'_>) -> Result<(), Error> {
        let request = ending.request;
        if self.joined {
            // The caller's commit is not ours to see: the messages are announced in the
            // caller's transaction, where the database can (PostgreSQL's `NOTIFY`).
            let mut tx = self.tx;
            if self.wrote {
                let announced = self.sql.outbox_announce(&mut tx).await;
                announced.map_err(|e| failed::<DB>(e, request))?;
            }
            // `RELEASE SAVEPOINT`: applied in the caller's transaction, which is theirs to
            // commit. A failed release (the body swallowed an error that aborted the
            // transaction) drops the savepoint, whose drop rolls back to it.
            return tx.commit().await.map_err(|e| failed::<DB>(e, request));
        }
        let table = &self.sql.table;
        let check = match self.kept.partition() {
            None => Check::Marker(table, request.claimant()),
            Some(at) => Check::Watermark(table, at, request.nonce),
        };
        match DB::commit(self.tx, check, &request.options).await {
            Ok(true) => {
                if self.wrote {
                    table.wake().committed();
                }
                Ok(())
            }
            Ok(false) => Err(rolled_back(request)),
            Err(e) => Err(e.into()),
        }
    }

    async fn release(self, request: &Request) {
        // A failed rollback is not reported: the error that led here is what the caller
        // needs, and the database drops the transaction with the connection anyway.
        if self.joined {
            drop(self.tx.rollback().await);
        } else {
            drop(DB::rollback(self.tx, &request.options).await);
        }
    }
}

/// The calls of a public guard of one fresh claim (`Guard`, `JoinedGuard`, `GroupGuard`), each
/// handed to the claim its field `held` holds. The guard gives each call's documentation, in
/// this order: what the transaction is and when it commits differ from guard to guard.
macro_rules! held_calls {
    (
        $guard:ident<$($lt:lifetime,)? DB>, $tx:lifetime;
        $(#[$tx_doc:meta])* tx;
        $(#[$outbox_doc:meta])* outbox;
        $(#[$span_doc:meta])* span;
        $(#[$body_doc:meta])* body;
        $(#[$finish_doc:meta])* finish;
        $(#[$replay_doc:meta])* finish_replay;
        $(#[$release_doc:meta])* release;
    ) => {
        impl<$($lt,)? DB: $crate::backend::Backend> $guard<$($lt,)? DB> {
            $(#[$tx_doc])*
            pub fn tx(&mut self) -> &mut ::sqlx::Transaction<$tx, DB> {
                self.held.tx()
            }

            $(#[$outbox_doc])*
            pub fn outbox(&mut self) -> &mut $crate::outgoing::Outbox {
                self.held.outbox()
            }

            $(#[$span_doc])*
            pub fn span(&self) -> &::tracing::Span {
                self.held.span()
            }

            $(#[$body_doc])*
            pub fn body(&self) -> $crate::claim::nested::Body {
                self.held.body()
            }

            $(#[$finish_doc])*
            pub async fn finish<T, E: From<$crate::error::Error>>(
                self,
                result: Result<T, E>,
            ) -> Result<$crate::outcome::Outcome<T>, E> {
                let end = self.held.finish(result, |_| Ok(None)).await;
                end.map_err($crate::outcome::Failed::into_handler_error)
            }

            $(#[$replay_doc])*
            pub async fn finish_replay<T: ::serde::Serialize, E: From<$crate::error::Error>>(
                self,
                result: Result<T, E>,
            ) -> Result<$crate::outcome::Outcome<T>, E> {
                let end = self.held.finish(result, |v| $crate::record::encode(v).map(Some));
                end.await.map_err($crate::outcome::Failed::into_handler_error)
            }

            $(#[$release_doc])*
            pub async fn release(self) {
                self.held.release().await;
            }
        }
    };
}
pub(crate) use held_calls;

/// A fresh claim in a transaction, held: the transaction (or savepoint) and the ticket. What
/// [`Guard`](crate::Guard) and [`JoinedGuard`](crate::JoinedGuard) wrap, and what the
/// attribute's expansion holds either as.
#[doc(hidden)]
#[derive(Debug)]
pub struct TxHeld<'c, DB: Backend> {
    hold: TxHold<'c, DB>,
    ticket: Ticket,
}

impl<'c, DB: Backend> TxHeld<'c, DB> {
    pub(crate) fn new(
        tx: Transaction<'c, DB>,
        sql: Arc<Sql<DB>>,
        joined: bool,
        ticket: Ticket,
    ) -> Self {
        TxHeld {
            hold: TxHold {
                tx,
                sql,
                joined,
                kept: Kept::Marker,
                wrote: false,
            },
            ticket,
        }
    }

    /// What the claim keeps, when not a marker: a fresh offset claim's watermark it moved.
    pub(crate) fn keeping(mut self, kept: Kept) -> Self {
        self.hold.kept = kept;
        self
    }

    /// The transaction (or savepoint) the body runs on.
    pub fn tx(&mut self) -> &mut Transaction<'c, DB> {
        &mut self.hold.tx
    }

    /// The outbox of this claim's job, written with the marker when the claim is kept.
    pub fn outbox(&mut self) -> &mut Outbox {
        self.ticket.outbox()
    }

    /// The transaction and the outbox at once, for a body that takes both.
    pub fn parts(&mut self) -> (&mut Transaction<'c, DB>, &mut Outbox) {
        (&mut self.hold.tx, self.ticket.outbox())
    }

    /// The call's `idem.claim` span.
    pub fn span(&self) -> &tracing::Span {
        self.ticket.observed.span()
    }

    /// The claim's body: runs in the call's span, marked as inside its open transaction.
    pub fn body(&self) -> Body {
        self.ticket.body()
    }

    /// The transaction and the statements at once.
    pub(crate) fn tx_sql(&mut self) -> (&mut Transaction<'c, DB>, &Sql<DB>) {
        (&mut self.hold.tx, &self.hold.sql)
    }

    /// The scope and key claimed.
    pub(crate) fn request(&self) -> &Request {
        &self.ticket.request
    }

    /// The request, to rekey (an offset claim's first fresh record names it).
    pub(crate) fn request_mut(&mut self) -> &mut Request {
        &mut self.ticket.request
    }

    /// The key its errors (and MySQL's commit check, which looks for the claim's nonce on one of
    /// its markers) name: a batch's first fresh job's.
    pub(crate) fn rekey(&mut self, key: Key) {
        self.ticket.request.key = key;
    }

    pub(crate) fn into_parts(self) -> (TxHold<'c, DB>, Ticket) {
        (self.hold, self.ticket)
    }

    /// Ends the claim with `result`, storing what `encode` makes of an `Ok` value: the
    /// finish's future itself, not one awaiting it, which would copy it (and its answer) once
    /// more per call.
    pub(crate) fn finish<T, E>(
        self,
        result: Result<T, E>,
        encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
    ) -> impl Future<Output = Result<Outcome<T>, Failed<E>>> {
        let TxHeld { hold, ticket } = self;
        finish(hold, ticket, None, result.map_err(Failed::Handler), encode)
    }

    /// Ends the claim keeping nothing: the transaction is rolled back (or the savepoint), and
    /// the call is counted as the body's failure.
    pub(crate) async fn release(self) {
        let result: Result<(), ()> = Err(());
        drop(self.finish(result, |_| Ok(None)).await);
    }
}
