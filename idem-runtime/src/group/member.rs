//! One call in a group: its claim in a savepoint of its lane's transaction, its hold while the
//! body runs, and its end, which releases the savepoint and waits for the generation's commit.
//! Built on the claim core's pieces (the start, the bounded retry, the decision, the one
//! finish), as every mode is.

use std::future::Future;
use std::sync::Arc;

use sqlx::Transaction;

use super::lane::{Ended, Lane, Left, Shared, Turn, Waiter, ended};
use crate::backend::{Backend, Savepoint};
use crate::claim::nested::Body;
use crate::claim::run::{Attempt, Attempts, conclude, retrying, shared_attempt, start};
use crate::claim::{
    Claimed, Ending, Hold, Kept, Request, Ticket, finish, rolled_back, write_ending,
};
use crate::error::{Error, NotKept};
use crate::observe::{self, Observed};
use crate::options::Mode;
use crate::outcome::{Failed, Outcome};
use crate::outgoing::Outbox;
use crate::record::NotStorable;

/// The claim of one call in its lane: a turn, a savepoint, the claim. A fresh claim keeps the
/// turn (its body runs on the lane's transaction); any other answer gives it back at once,
/// but waits for the generation's end first when it met a marker an earlier call of the same
/// generation wrote (that marker is not committed yet).
pub(crate) async fn claim<DB: Backend>(
    shared: &Arc<Shared<DB>>,
    lane: &Lane<DB>,
    request: Request,
) -> Result<Claimed<GroupHeld<DB>>, Error> {
    let mut observed = start(&request, Mode::Group, true)?;
    let attempts = InGroup {
        shared,
        request: &request,
    };
    let answer = match in_turn(shared, lane, &mut observed, &request, attempts).await {
        Ok((Attempt::Fresh((), took_over), turn)) => Ok(Attempt::Fresh(turn, took_over)),
        Ok((other, turn)) => {
            let waiter = turn.holder_of(&request);
            turn.leave(shared, false);
            not_fresh(other, waiter, &request).await
        }
        Err(e) => Err(e),
    };
    let shared = shared.clone();
    conclude(observed, request, answer, |turn, ticket| {
        GroupHeld::new(turn, shared, Kept::Marker, Vec::new(), ticket)
    })
}

/// A claim's attempts in a savepoint of the lane's transaction. An attempt that loses the
/// transaction (rolling back to its savepoint failed) fails the generation, and the next
/// attempt begins a new one.
struct InGroup<'a, DB: Backend> {
    shared: &'a Arc<Shared<DB>>,
    request: &'a Request,
}

impl<DB: Backend> InTurn<DB> for InGroup<'_, DB> {
    type Fresh = ();

    async fn attempt(&mut self, turn: &mut Turn<DB>) -> Result<Attempt<()>, sqlx::Error> {
        let sql = self.shared.store.sql();
        let (tx, opening) = turn.ready_attempt(self.request.options.wait).await?;
        let answer = shared_attempt::<DB>(tx, sql, self.request, opening).await;
        turn.attempted(answer, "a claim")
    }
}

/// A claim's attempts in a turn of its lane (see [`in_turn`]): like [`Attempts`], each on the
/// turn's transaction.
pub(crate) trait InTurn<DB: Backend>: Send {
    type Fresh: Send;

    fn attempt(
        &mut self,
        turn: &mut Turn<DB>,
    ) -> impl Future<Output = Result<Attempt<Self::Fresh>, sqlx::Error>> + Send;
}

/// Attempts in a turn, with the turn they are made in.
struct Turned<'t, DB: Backend, A> {
    turn: &'t mut Turn<DB>,
    attempts: A,
}

impl<DB: Backend, A: InTurn<DB>> Attempts for Turned<'_, DB, A> {
    type Fresh = A::Fresh;

    fn attempt(&mut self) -> impl Future<Output = Result<Attempt<A::Fresh>, sqlx::Error>> + Send {
        self.attempts.attempt(self.turn)
    }
}

/// Takes a turn in `lane` and makes a claim's attempts in it, in the claim's span: the answer,
/// and the turn, which a fresh claim keeps.
pub(crate) async fn in_turn<DB: Backend, A: InTurn<DB>>(
    shared: &Arc<Shared<DB>>,
    lane: &Lane<DB>,
    observed: &mut Observed,
    request: &Request,
    attempts: A,
) -> Result<(Attempt<A::Fresh>, Turn<DB>), Error> {
    let span = observed.span().clone();
    let claimed = async {
        let mut turn = lane.turn(shared).await.map_err(Error::from)?;
        let mut turned = Turned {
            turn: &mut turn,
            attempts,
        };
        let answer = retrying::<DB, _>(observed, request, true, &mut turned).await?;
        Ok((answer, turn))
    };
    observe::in_span(span, claimed).await
}

/// A member's claim that did not take its key (or records): its answer once the group that
/// `waiter` watches has ended. A duplicate made by an earlier member of the same open group
/// (its marker, or its watermark) is one only if that group commits; if it fails, so does
/// this answer, as the group's.
pub(crate) async fn not_fresh<F, G>(
    other: Attempt<F>,
    waiter: Option<Waiter>,
    request: &Request,
) -> Result<Attempt<G>, Error> {
    let other = match other {
        Attempt::Done(done) => Attempt::Done(done),
        Attempt::Refused(e) => Attempt::Refused(e),
        Attempt::Fresh(..) => unreachable!("a fresh claim is answered by its member"),
    };
    let Some(waiter) = waiter else {
        return Ok(other);
    };
    match ended(waiter).await {
        Ended::Committed => Ok(other),
        Ended::RolledBack => Err(group_failed(
            request,
            false,
            "the database rolled the group's transaction back",
        )),
        Ended::Failed {
            may_be_kept,
            reason,
        } => Err(group_failed(request, may_be_kept, &reason)),
    }
}

pub(super) fn group_failed(request: &Request, may_be_kept: bool, reason: &str) -> Error {
    Error::NotKept(NotKept::Group {
        scope: request.scope.to_string(),
        key: request.key.as_str().to_owned(),
        may_be_kept,
        reason: reason.to_owned(),
    })
}

/// A fresh claim in a group: the lane's turn, which the call keeps while its body runs, and
/// what the claim wrote that the group's commit can look for.
#[derive(Debug)]
pub(crate) struct GroupHold<DB: Backend> {
    turn: Option<Turn<DB>>,
    shared: Arc<Shared<DB>>,
    kept: Kept,
    /// The partitions whose watermarks an offset claim moved, as (topic, partition).
    moved: Vec<(String, i32)>,
    /// The call wrote outbox messages: the group's commit wakes the store's relays.
    wrote: bool,
}

impl<DB: Backend> GroupHold<DB> {
    fn tx(&mut self) -> &mut Transaction<'static, DB> {
        let turn = self.turn.as_mut().expect("held until the end");
        turn.tx().expect("the generation stays open during a turn")
    }

    /// Rolls back to the call's savepoint and gives the turn back; a savepoint that cannot be
    /// rolled back fails the generation.
    async fn roll_back(&mut self) {
        let back = DB::savepoint(self.tx(), Savepoint::RollBack).await;
        let mut turn = self.turn.take().expect("held until the end");
        turn.disarm();
        match back {
            Ok(()) => turn.leave(&self.shared, false),
            Err(e) => {
                let reason = format!("a call's savepoint could not be rolled back: {e}");
                turn.fail(false, &reason);
            }
        }
    }
}

impl<DB: Backend> Hold for GroupHold<DB> {
    const OUTSIDE: bool = false;

    fn end(&self) -> &'static str {
        "group savepoint release"
    }

    async fn write(&mut self, ending: Ending<'_>) -> Result<(), Error> {
        let (shared, kept) = (self.shared.clone(), self.kept.clone());
        let tx = self.tx();
        self.wrote |= write_ending::<DB>(tx, shared.store.sql(), &kept, ending).await?;
        Ok(())
    }

    async fn commit(mut self, ending: Ending<'_>) -> Result<(), Error> {
        let request = ending.request;
        let step = self
            .turn
            .as_ref()
            .expect("held until the end")
            .release_step(&self.shared);
        let released = match step {
            Some(step) => DB::savepoint(self.tx(), step).await,
            None => Ok(()),
        };
        if let Err(e) = released {
            // The body's statements failed under it although it returned `Ok` (PostgreSQL
            // aborted its savepoint), or the transaction is gone.
            self.roll_back().await;
            return Err(match e.as_database_error() {
                Some(_) => rolled_back(request),
                None => e.into(),
            });
        }
        let mut turn = self.turn.take().expect("held until the end");
        if let Some(Savepoint::Next(_)) = step {
            turn.primed();
        }
        let (kept, moved, wrote) = (&self.kept, &self.moved, self.wrote);
        let left = turn.kept(request, &self.shared, kept, moved, wrote, step.is_none());
        let end = match left {
            Left::Waiting(waiter) => ended(waiter).await,
            // Alone in its generation: no other call's commit hangs on this one's future.
            Left::Alone(closing) => closing.commit(self.shared.clone()).await,
        };
        match end {
            Ended::Committed => Ok(()),
            Ended::RolledBack => Err(rolled_back(request)),
            Ended::Failed {
                may_be_kept,
                reason,
            } => Err(group_failed(request, may_be_kept, &reason)),
        }
    }

    async fn release(mut self, _: &Request) {
        self.roll_back().await;
    }
}

/// A fresh claim in a group, held: the lane's turn and the ticket. What
/// [`GroupGuard`](super::GroupGuard) wraps, and what the attribute's expansion holds.
#[doc(hidden)]
#[derive(Debug)]
pub struct GroupHeld<DB: Backend> {
    hold: GroupHold<DB>,
    ticket: Ticket,
}

impl<DB: Backend> GroupHeld<DB> {
    pub(crate) fn new(
        turn: Turn<DB>,
        shared: Arc<Shared<DB>>,
        kept: Kept,
        moved: Vec<(String, i32)>,
        ticket: Ticket,
    ) -> Self {
        GroupHeld {
            hold: GroupHold {
                turn: Some(turn),
                shared,
                kept,
                moved,
                wrote: false,
            },
            ticket,
        }
    }

    /// The request, to rekey (an offset claim's first fresh record names it).
    pub(crate) fn request_mut(&mut self) -> &mut Request {
        &mut self.ticket.request
    }

    pub(crate) fn into_parts(self) -> (GroupHold<DB>, Ticket) {
        (self.hold, self.ticket)
    }

    /// The transaction the body runs on: the group's, inside this call's savepoint.
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        self.hold.tx()
    }

    /// The outbox of this call's job, written with its marker when the call is kept.
    pub fn outbox(&mut self) -> &mut Outbox {
        self.ticket.outbox()
    }

    /// The transaction and the outbox at once, for a body that takes both.
    pub fn parts(&mut self) -> (&mut Transaction<'static, DB>, &mut Outbox) {
        (self.hold.tx(), self.ticket.outbox())
    }

    /// The call's `idem.claim` span.
    pub fn span(&self) -> &tracing::Span {
        self.ticket.observed.span()
    }

    /// The claim's body: runs in the call's span, marked as inside its open transaction, and
    /// within its group's `max_body` when run [`bounded`](Body::bounded).
    pub fn body(&self) -> Body {
        let Request { scope, key, .. } = &self.ticket.request;
        let after = self.hold.shared.options.max_body;
        self.ticket.body().within(after, scope, key.as_str())
    }

    /// Ends the call with `result`, storing what `encode` makes of an `Ok` value.
    pub(crate) async fn finish<T, E>(
        self,
        result: Result<T, E>,
        encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
    ) -> Result<Outcome<T>, Failed<E>> {
        let GroupHeld { hold, ticket } = self;
        finish(hold, ticket, None, result.map_err(Failed::Handler), encode).await
    }

    /// Gives up: rolls back to the call's savepoint; the group goes on.
    pub(crate) async fn release(self) {
        let result: Result<(), ()> = Err(());
        drop(self.finish(result, |_| Ok(None)).await);
    }
}
