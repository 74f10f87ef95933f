//! The handler's run and its commit, finished even when the client hangs up, without a task
//! of their own unless it does.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

/// Runs `F` in the request's own task. Dropped before `F` is done (the client hung up: a
/// sender whose timeout ran out, a browser whose second click cancelled the first), it hands
/// what remains of `F` to a task of its own, so that the handler is not stopped halfway and
/// the retry gets the stored response. A panic in `F` ends it with `Err(Panicked)`; what `F`
/// held (the claimed transaction) is dropped, which rolls it back.
pub(super) struct Finish<F: Future + Send + 'static>(Option<Pin<Box<F>>>)
where
    F::Output: Send;

/// The handler panicked.
pub(super) struct Panicked;

impl<F: Future + Send + 'static> Finish<F>
where
    F::Output: Send,
{
    pub(super) fn new(run: F) -> Self {
        Finish(Some(Box::pin(run)))
    }
}

impl<F: Future + Send + 'static> Future for Finish<F>
where
    F::Output: Send,
{
    type Output = Result<F::Output, Panicked>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let run = this.0.as_mut().expect("not polled after it finished");
        let polled = catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(answer)) => {
                this.0 = None;
                Poll::Ready(Ok(answer))
            }
            Err(_) => {
                this.0 = None;
                Poll::Ready(Err(Panicked))
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for Finish<F>
where
    F::Output: Send,
{
    fn drop(&mut self) {
        if let Some(run) = self.0.take() {
            // Outside a runtime (the server itself shutting down) there is nothing to run it
            // on: dropping it rolls the claim back, and the retry runs again.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                drop(runtime.spawn(run));
            }
        }
    }
}
