//! Which claim's body is running, so that a claim with a store made inside it (whose
//! transaction would not be the open one) is refused before any I/O.
//!
//! The mark is a task-local around the body's future ([`Body::run`]), not a mark on the task:
//! a task that runs two jobs side by side (`join_all` over a prefetched batch) runs two bodies,
//! neither inside the other, and their claims are not nested. The attribute and the HTTP
//! layer run every body this way; hand-written code does with [`Body::run`].

use std::borrow::Cow;
use std::future::Future;

use crate::error::{Error, Refusal};

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
}

impl Body {
    pub(crate) fn new(holder: Cow<'static, str>, span: tracing::Span) -> Body {
        Body { holder, span }
    }

    /// Runs `body` in the call's span, marked as inside the claim's open transaction wherever
    /// it is polled.
    pub fn run<F: Future>(self, body: F) -> impl Future<Output = F::Output> {
        BODY.scope(self.holder, crate::observe::in_span(self.span, body))
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
