//! OpenTelemetry's semantic conventions on idem's span and metrics: what a call serves (a
//! message of a broker, an HTTP request), as the attributes an OpenTelemetry collector's
//! dashboards look for, and `messaging.process.duration` beside idem's own metrics.
//!
//! Nothing here runs unless asked: a call has messaging attributes only when its claim was
//! given a [`Messaging`] or its scope was ([`observe_messaging`]); a process that never says
//! so pays one relaxed atomic load per call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{OnceLock, RwLock};

use metrics::{Key, Label};

use super::verdict::{COUNT, Verdict};
use crate::options::Messaging;

/// The histogram OpenTelemetry's messaging conventions name for the time a consumer spends
/// on a message: from the claim's start to the call's end, in seconds. Recorded for calls
/// that know their [`Messaging`], beside [`CLAIM_SECONDS`](super::CLAIM_SECONDS) and
/// [`OUTCOMES_TOTAL`](super::OUTCOMES_TOTAL), with the attributes `messaging.system`,
/// `messaging.destination.name` (when given), `messaging.operation.name` (`process`), and
/// `error.type` (the outcome) on the calls that did not succeed.
pub const MESSAGING_PROCESS_DURATION: &str = "messaging.process.duration";

/// What a call serves, for its span's attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum About {
    /// A message of a broker.
    Message(Messaging),
    /// A request behind the HTTP layer: its method (as OpenTelemetry spells it) and route.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    Http {
        method: &'static str,
        route: Option<&'static str>,
    },
}

impl About {
    /// The span's `otel.kind`: a message's processing is a consumer span; a request's claim
    /// runs inside the server's span, so it is internal.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            About::Message(_) => "consumer",
            About::Http { .. } => "internal",
        }
    }
}

static ANY_SCOPE: AtomicBool = AtomicBool::new(false);

fn scopes() -> &'static RwLock<HashMap<String, Messaging>> {
    static SCOPES: OnceLock<RwLock<HashMap<String, Messaging>>> = OnceLock::new();
    SCOPES.get_or_init(Default::default)
}

/// Every call of `scope` in this process serves jobs of `messaging`: its span gets
/// OpenTelemetry's messaging attributes and it records [`MESSAGING_PROCESS_DURATION`],
/// whatever made the call (an `#[idempotent]` handler, a hand-written claim). A claim's own
/// [`Messaging`] takes precedence. Call it at start-up; calls that start after it see it.
pub fn observe_messaging(scope: &str, messaging: Messaging) {
    let mut scopes = scopes().write().unwrap_or_else(|e| e.into_inner());
    scopes.insert(scope.to_owned(), messaging);
    ANY_SCOPE.store(true, Ordering::Release);
}

/// The messaging of `scope`, if [`observe_messaging`] named it.
pub(crate) fn of_scope(scope: &str) -> Option<Messaging> {
    if !ANY_SCOPE.load(Ordering::Relaxed) {
        return None;
    }
    let scopes = scopes().read().unwrap_or_else(|e| e.into_inner());
    scopes.get(scope).copied()
}

/// The metric keys of one [`Messaging`], per outcome: made once, at its first recorded call.
pub(super) struct Keys {
    by_verdict: [Key; COUNT],
}

/// The most distinct [`Messaging`]s whose keys are kept; later ones are recorded without a
/// cache (each call builds its key). Brokers and destinations are a handful per process.
const MAX_KEYS: usize = 1_000;

impl Keys {
    fn new(m: Messaging) -> Keys {
        Keys {
            by_verdict: std::array::from_fn(|v| {
                let mut labels = vec![
                    Label::from_static_parts("messaging.system", m.system()),
                    Label::from_static_parts("messaging.operation.name", "process"),
                ];
                if let Some(destination) = m.destination_name() {
                    labels.push(Label::from_static_parts(
                        "messaging.destination.name",
                        destination,
                    ));
                }
                let verdict = Verdict::ALL[v];
                if !matches!(verdict, "applied" | "duplicate" | "replayed") {
                    labels.push(Label::from_static_parts("error.type", verdict));
                }
                Key::from_parts(MESSAGING_PROCESS_DURATION, labels)
            }),
        }
    }

    /// The key of `m`'s calls that ended with `verdict`, passed to `f`.
    pub(super) fn with(m: Messaging, verdict: Verdict, f: impl FnOnce(&Key)) {
        static KEYS: OnceLock<RwLock<HashMap<Messaging, &'static Keys>>> = OnceLock::new();
        let keys = KEYS.get_or_init(Default::default);
        if let Some(found) = keys.read().unwrap_or_else(|e| e.into_inner()).get(&m) {
            return f(&found.by_verdict[verdict as usize]);
        }
        let mut keys = keys.write().unwrap_or_else(|e| e.into_inner());
        if keys.len() >= MAX_KEYS {
            return f(&Keys::new(m).by_verdict[verdict as usize]);
        }
        // Kept for the process's life: at most MAX_KEYS of them.
        let made: &'static Keys = keys
            .entry(m)
            .or_insert_with(|| Box::leak(Box::new(Keys::new(m))));
        f(&made.by_verdict[verdict as usize])
    }
}

/// An HTTP method as OpenTelemetry's `http.request.method` spells it: the standard ones,
/// and `_OTHER` for any other (which would make the attribute unbounded).
#[cfg(feature = "axum")]
pub(crate) fn http_method(method: &::http::Method) -> &'static str {
    match method.as_str() {
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "CONNECT" => "CONNECT",
        "OPTIONS" => "OPTIONS",
        "TRACE" => "TRACE",
        "PATCH" => "PATCH",
        _ => "_OTHER",
    }
}
