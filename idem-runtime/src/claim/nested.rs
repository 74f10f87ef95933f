//! Which claim's body is running, so that a claim with a store made inside it (whose
//! transaction would not be the open one) is refused before any I/O.
//!
//! The mark is a task-local around the body's future ([`Body::run`]), not a mark on the task:
//! a task that runs two jobs side by side (`join_all` over a prefetched batch) runs two bodies,
//! neither inside the other, and their claims are not nested. The attribute and the HTTP
//! layer run every body this way; hand-written code does with [`Body::run`].

use std::borrow::Cow;
use std::future::Future;
use std::time::Duration;

use crate::error::{Error, NotKept, Refusal};

tokio::task_local! {
    /// The claim whose transaction is open in the body being polled.
    static BODY: Cow<'static, str>;
}

/// A fresh claim's body, to run in the call's `idem.claim` span and marked as inside the
/// claim's open transaction: a claim with a store in it is refused with [`Refusal::Nested`] (claim
/// on [`Store::join`](crate::Store::join) there instead).
///
/// Made by [`Guard::body`](crate::Guard::body), [`JoinedGuard::body`](crate::JoinedGuard::body)
/// and [`BatchGuard::body`](crate::BatchGuard::body); it borrows nothing of its holder, so the
/// body can borrow the holder's transaction:
///
/// ```no_run
/// # use idem_runtime as idem;
/// # #[cfg(feature = "sqlite")]
/// # async fn f(mut guard: idem::Guard<sqlx::Sqlite>) -> Result<(), idem::Error> {
/// let body = guard.body();
/// let done = body
///     .run(async {
///         sqlx::query("UPDATE accounts SET credits = credits + 50 WHERE id = 7")
///             .execute(&mut **guard.tx())
///             .await
///     })
///     .await;
/// guard.finish(done.map_err(idem::Error::from)).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Body {
    holder: Cow<'static, str>,
    span: tracing::Span,
    bound: Option<Bound>,
}

/// A group call's bound on its body ([`GroupOptions::max_body`](crate::GroupOptions::max_body)),
/// and the call it answers for.
#[derive(Debug, Clone)]
struct Bound {
    after: Duration,
    scope: String,
    key: String,
}

impl Body {
    pub(crate) fn new(holder: Cow<'static, str>, span: tracing::Span) -> Body {
        Body {
            holder,
            span,
            bound: None,
        }
    }

    /// The body of a group's call: [`bounded`](Body::bounded) stops it `after` that long.
    pub(crate) fn within(mut self, after: Duration, scope: &str, key: &str) -> Body {
        let (scope, key) = (scope.to_owned(), key.to_owned());
        self.bound = Some(Bound { after, scope, key });
        self
    }

    /// Runs `body` in the call's span, marked as inside the claim's open transaction wherever
    /// it is polled.
    pub fn run<F: Future>(self, body: F) -> impl Future<Output = F::Output> {
        BODY.scope(self.holder, crate::observe::in_span(self.span, body))
    }

    /// [`run`](Body::run), for a group's call within its group's
    /// [`max_body`](crate::GroupOptions::max_body): past it the body is dropped and the answer
    /// is [`NotKept::TimedOut`], with which the guard's `finish` rolls back the call's
    /// savepoint, so that the calls kept before it commit. The same as `run` outside a group.
    pub async fn bounded<T, E: From<Error>>(
        self,
        body: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let Some(bound) = self.bound.clone() else {
            return self.run(body).await;
        };
        match tokio::time::timeout(bound.after, self.run(body)).await {
            Ok(done) => done,
            Err(_) => Err(E::from(Error::NotKept(NotKept::TimedOut {
                scope: bound.scope,
                key: bound.key,
                after: bound.after,
            }))),
        }
    }
}

/// Refuses a claim named `inner` with a store inside the body of another claim that holds an
/// open transaction (before any I/O): its own transaction would be another one than the open
/// one, and wait for it (SQLite) or commit apart from it.
pub(crate) fn refuse_nested(inner: &str) -> Result<(), Error> {
    match BODY.try_with(|outer| outer.to_string()) {
        Ok(outer) => Err(Error::Refused(Refusal::Nested {
            inner: inner.to_owned(),
            outer,
        })),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> Body {
        Body::new("outer".into(), tracing::Span::none())
    }

    #[tokio::test]
    async fn a_claim_inside_a_body_is_refused_and_beside_it_is_not() {
        let inside = body().run(async { refuse_nested("inner") });
        let beside = async { refuse_nested("inner") };
        let (inside, beside) = tokio::join!(inside, beside);
        assert!(
            matches!(
                &inside,
                Err(Error::Refused(Refusal::Nested { inner, outer }))
                    if inner == "inner" && outer == "outer"
            ),
            "{inside:?}"
        );
        assert!(beside.is_ok());
        assert!(refuse_nested("inner").is_ok());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_mark_travels_with_its_body() {
        let marked = body().run(async {
            tokio::task::yield_now().await;
            refuse_nested("inner")
        });
        let moved = tokio::spawn(marked).await.unwrap();
        assert!(matches!(moved, Err(Error::Refused(Refusal::Nested { .. }))));
    }
}
