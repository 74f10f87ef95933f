//! A future polled in a call's span only when the span is enabled.
//!
//! `tracing`'s `Instrumented` enters and leaves its span at every poll. A span no subscriber
//! wants is disabled, but with `tracing`'s `log` feature on (sqlx turns it on) each enter and
//! leave of it still checks whether `log` wants a record: a few hundred instructions per
//! call across a claim's polls, for nothing. A disabled span is not entered at all here.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tracing::Span;
use tracing::instrument::{Instrument as _, Instrumented};

pin_project_lite::pin_project! {
    #[project = Projected]
    pub(crate) enum InSpan<F> {
        Traced { #[pin] future: Instrumented<F> },
        Bare { #[pin] future: F },
    }
}

/// `future`, polled (and dropped) in `span` if a subscriber wants `span`.
pub(crate) fn in_span<F: Future>(span: Span, future: F) -> InSpan<F> {
    match span.is_disabled() {
        true => InSpan::Bare { future },
        false => InSpan::Traced {
            future: future.instrument(span),
        },
    }
}

impl<F: Future> Future for InSpan<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        match self.project() {
            Projected::Traced { future } => future.poll(cx),
            Projected::Bare { future } => future.poll(cx),
        }
    }
}
