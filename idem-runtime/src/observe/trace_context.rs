//! W3C trace context through idem: the `traceparent` a producer's message carries, and the
//! link from a consumer's `idem.claim` span back to it, so that one key's producer and
//! consumer spans join in one trace.
//!
//! The consumer's span is linked, not parented: the message may be processed long after it was
//! sent, again after a redelivery, or in a batch with messages of other traces, which is what
//! OpenTelemetry's messaging conventions link rather than nest.
//!
//! With the feature `opentelemetry` a link is an OpenTelemetry span link
//! (`tracing_opentelemetry::OpenTelemetrySpanExt::add_link`) and the producer's side reads the
//! current span's context; without it the claim's span records the traceparent in its field
//! [`FIELD`], and the producer's side has no span context to read: it sends the traceparent
//! the work carries (the HTTP layer carries its request's). Either way nothing runs for a
//! call given no traceparent, nor for a span no subscriber wants.

use tracing::Span;

use crate::traceparent::TraceParent;

/// The `idem.claim` span's field that holds the traceparents it is linked to when the feature
/// `opentelemetry` is off (space-separated when a batch has several). OpenTelemetry's semantic
/// conventions name no attribute for it: they carry the producer's context as a span link,
/// which is what the feature makes instead.
#[cfg_attr(feature = "opentelemetry", allow(dead_code))]
pub(crate) const FIELD: &str = "traceparent";

impl TraceParent {
    /// The context of the current `tracing` span, as OpenTelemetry sees it through
    /// `tracing-opentelemetry`'s layer: what a producer puts in its message's `traceparent`
    /// header. `None` outside any span, or when no OpenTelemetry layer gives the span a valid
    /// context.
    #[cfg(feature = "opentelemetry")]
    pub fn current() -> Option<Self> {
        use opentelemetry::trace::TraceContextExt as _;
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;

        let span = Span::current();
        if span.is_none() {
            return None;
        }
        let context = span.context();
        let of = context.span();
        let of = of.span_context();
        if !of.is_valid() {
            return None;
        }
        TraceParent::new(
            of.trace_id().to_bytes(),
            of.span_id().to_bytes(),
            of.trace_flags().to_u8(),
        )
        .ok()
    }

    /// The producer's span, as a link's remote context.
    #[cfg(feature = "opentelemetry")]
    fn remote(&self) -> opentelemetry::trace::SpanContext {
        use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
        SpanContext::new(
            TraceId::from_bytes(self.trace_id()),
            SpanId::from_bytes(self.span_id()),
            TraceFlags::new(self.flags()),
            true,
            TraceState::default(),
        )
    }
}

/// Links `span` (a claim's) to the producers' spans of `parents`: OpenTelemetry span links with
/// the feature `opentelemetry`, else the traceparents in the span's field [`FIELD`]. Nothing
/// for a span no subscriber wants.
pub(crate) fn link(span: &Span, parents: &[TraceParent]) {
    if parents.is_empty() || span.is_disabled() {
        return;
    }
    #[cfg(feature = "opentelemetry")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        for parent in parents {
            span.add_link(parent.remote());
        }
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        match parents {
            [one] => {
                span.record(FIELD, tracing::field::display(one));
            }
            many => {
                let all: Vec<String> = many.iter().map(ToString::to_string).collect();
                span.record(FIELD, all.join(" ").as_str());
            }
        }
    }
}

tokio::task_local! {
    /// The traceparent of the request a call serves (the HTTP layer's), for the messages its
    /// handler writes: carried, since no span context holds it without OpenTelemetry.
    static CARRIED: Option<TraceParent>;
}

/// Runs `work` with `parent` as the traceparent its outbox messages carry where no span
/// context gives one ([`ambient_traceparent`]).
#[cfg(feature = "axum")]
pub(crate) async fn carrying<F: std::future::Future>(
    parent: Option<TraceParent>,
    work: F,
) -> F::Output {
    CARRIED.scope(parent, work).await
}

fn carried() -> Option<String> {
    CARRIED
        .try_with(|parent| parent.as_ref().map(ToString::to_string))
        .ok()
        .flatten()
}

/// The traceparent for a message the producer writes (the outbox's `traceparent` header): with
/// the feature `opentelemetry`, the current span's OpenTelemetry context when it is valid;
/// else the one the work carries (the request an HTTP layer's handler serves), if any.
#[cfg(feature = "opentelemetry")]
pub(crate) fn ambient_traceparent() -> Option<String> {
    TraceParent::current()
        .map(|parent| parent.to_string())
        .or_else(carried)
}

/// Without the feature `opentelemetry` no span context can be read: the traceparent the work
/// carries (the request an HTTP layer's handler serves), if any.
#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn ambient_traceparent() -> Option<String> {
    carried()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_span_no_ambient_traceparent() {
        assert_eq!(ambient_traceparent(), None);
    }
}
