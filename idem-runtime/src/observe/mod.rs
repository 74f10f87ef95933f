//! What a claim tells the outside, whatever made it (the attribute, a hand-written call, the
//! HTTP layer): one `idem.claim` span per call, one `idem call finished` event in it, a few
//! events from the claim, and two metrics through the `metrics` facade. The claim core opens
//! an [`Observed`] when a claim starts; it ends with the claim when the claim decides the call
//! (a duplicate, an error), else it travels in the holder, whose finish ends it.
//!
//! Everything is logged with the target `idem`, at these levels:
//!
//! | level | what |
//! |---|---|
//! | WARN | a call ended by an error of idem's own (its text once, in `error`); a holder dropped before it finished (a panic, a cancelled future); a claim that lost a race and is retried; a stored `replay` value that no longer reads |
//! | INFO | the `idem.claim` span; a call that found another delivery holding the key (`in_progress`); a lease taken over from an earlier delivery |
//! | DEBUG | the end of every other call (`applied`, `duplicate`, `replayed`, or the body's own error, which the caller gets back) |
//! | TRACE | what the claim decided (`fresh`, `takeover`, `duplicate`, `replayed`, `in_progress`) |
//!
//! At the usual INFO a worker logs nothing per healthy job; `RUST_LOG=info,idem=debug`
//! (tracing-subscriber's `EnvFilter`) shows one line per call with its span's fields.
//!
//! With no `tracing` subscriber and no `metrics` recorder installed this costs a few clock
//! reads per call and nothing else: the span is disabled by its callsite's cached interest
//! (its fields, the key included, are then never evaluated), and the metric keys are the
//! scope's labels, built once ([`Site`]): no allocation, no formatting.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use metrics::Metadata;
use tracing::Span;
use tracing::field::Empty;

use crate::error::Error;
use crate::options::Mode;
use crate::outcome::{Batch, Failed, Outcome};

mod in_span;
mod keys;
pub(crate) mod semconv;
mod site;
pub(crate) mod trace_context;
mod verdict;

pub(crate) use in_span::in_span;

pub use keys::{KeyInSpans, observe_keys};
use semconv::About;
pub use site::Site;
pub(crate) use trace_context::ambient_traceparent;
#[cfg(feature = "axum")]
pub(crate) use trace_context::carrying;
use verdict::{Ended, Verdict};

/// The counter of finished calls, labelled `scope` and `outcome`.
///
/// The outcomes: `applied`, `duplicate`, `replayed` (the call's [`Outcome`]); one per kind of
/// idem's [`Error`](crate::Error) that asks for its own action: `in_progress`, `rolled_back`
/// (`NotKept::RolledBack`), `timeout`, `key_reused`, `lease_lost`, `value_not_stored`, `invalid` (a
/// key, scope, lease or value refused as given, or a nested call: a redelivery fails the same way);
/// and `error` for the rest (the body's own errors, database failures, a holder dropped before it
/// finished). A batch counts each of its jobs. Every path counts alike: the attribute's calls,
/// hand-written claims and the HTTP layer's requests.
pub const OUTCOMES_TOTAL: &str = "idem_outcomes_total";

/// The histogram of claim latency in seconds, labelled `scope`: from the start of the claim
/// (a connection from the pool, the begin; lease mode: the lease statement) to its answer
/// (fresh, duplicate, replayed, in progress, or a failure), retries after a lost race
/// included.
pub const CLAIM_SECONDS: &str = "idem_claim_seconds";

/// Describes [`OUTCOMES_TOTAL`], [`CLAIM_SECONDS`] and
/// [`MESSAGING_PROCESS_DURATION`](semconv::MESSAGING_PROCESS_DURATION) to the installed
/// `metrics` recorder
/// (their help text and unit), for exporters that publish descriptions, such as
/// Prometheus's.
///
/// Call it once after installing the recorder; recording works without it.
pub fn describe_metrics() {
    metrics::describe_counter!(
        OUTCOMES_TOTAL,
        metrics::Unit::Count,
        "Idempotent calls by scope and outcome (applied, duplicate, replayed, in_progress, \
         rolled_back, timeout, key_reused, lease_lost, value_not_stored, invalid, error)."
    );
    metrics::describe_histogram!(
        CLAIM_SECONDS,
        metrics::Unit::Seconds,
        "Time from the claim's first statement to its answer, by scope."
    );
    metrics::describe_histogram!(
        semconv::MESSAGING_PROCESS_DURATION,
        metrics::Unit::Seconds,
        "Duration of processing operation (OpenTelemetry messaging conventions): from the \
         claim's start to the call's end, for calls that know their broker."
    );
    metrics::describe_counter!(
        crate::settle::SETTLED_TOTAL,
        metrics::Unit::Count,
        "Deliveries the consumer loop settled, by disposition (ack, retry, dead_letter) and \
         by what the handler answered (applied, duplicate, replayed, failed, error, \
         unparsable, panicked)."
    );
}

static METADATA: Metadata<'static> =
    Metadata::new("idem", metrics::Level::INFO, Some(module_path!()));

/// What a claim found, for its `trace` event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    Fresh,
    Takeover,
    Duplicate,
    Replayed,
    InProgress,
    Failed,
}

/// One call, from the start of its claim to its end: its span, its labels, and what its claim
/// did. Dropped before it ended (a holder dropped by a panic or a cancelled future), it counts
/// the call as `error` and says so.
pub(crate) struct Observed {
    site: &'static Site,
    span: Span,
    started: Instant,
    attempts: u32,
    waited: Duration,
    jobs: Option<u64>,
    /// What the call serves, in OpenTelemetry's terms (a broker's message, an HTTP request).
    about: Option<About>,
    ended: bool,
}

impl std::fmt::Debug for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observed")
            .field("span", &self.span)
            .field("attempts", &self.attempts)
            .finish_non_exhaustive()
    }
}

impl Observed {
    /// Opens the `idem.claim` span of a call (when a subscriber wants it; `key` is read only
    /// then, and shown as [`observe_keys`] says).
    ///
    /// `about` is what the call serves, for OpenTelemetry's attributes; without it, what
    /// [`semconv::observe_messaging`] said of the scope, if anything.
    pub(crate) fn start(
        site: &'static Site,
        scope: &str,
        mode: Mode,
        key: Option<&str>,
        about: Option<About>,
    ) -> Self {
        let about = about.or_else(|| semconv::of_scope(scope).map(About::Message));
        let message = match about {
            Some(About::Message(m)) => Some(m),
            _ => None,
        };
        let http = match about {
            Some(About::Http { method, route }) => Some((method, route)),
            _ => None,
        };
        // The field values are read only when the span is enabled.
        let span = tracing::info_span!(
            target: "idem",
            "idem.claim",
            scope,
            key = Empty,
            key_hash = Empty,
            mode = mode.as_str(),
            outcome = Empty,
            retries = Empty,
            waited_ms = Empty,
            jobs = Empty,
            applied = Empty,
            duplicate = Empty,
            otel.kind = about.map(|a| a.kind()),
            messaging.system = message.map(|m| m.system()),
            messaging.operation.type = message.map(|_| "process"),
            messaging.destination.name = message.and_then(|m| m.destination_name()),
            messaging.message.id = Empty,
            http.request.method = http.map(|(method, _)| method),
            http.route = http.and_then(|(_, route)| route),
            traceparent = Empty,
        );
        if let Some(key) = key.filter(|_| !span.is_disabled()) {
            match keys::setting() {
                KeyInSpans::Plain => {
                    span.record("key", key);
                    // One key end to end: a consumer claims the message's id.
                    if message.is_some() {
                        span.record("messaging.message.id", key);
                    }
                }
                KeyInSpans::Hashed => {
                    span.record("key_hash", keys::hash(key).as_str());
                }
                KeyInSpans::Omitted => {}
            }
        }
        Observed {
            site,
            span,
            started: Instant::now(),
            attempts: 0,
            waited: Duration::ZERO,
            jobs: None,
            about,
            ended: false,
        }
    }

    /// [`start`](Observed::start) for a batch of `jobs` jobs, whose span names no key.
    pub(crate) fn batch(
        site: &'static Site,
        scope: &str,
        jobs: usize,
        about: Option<About>,
    ) -> Self {
        Observed::counted(site, scope, Mode::Batch, jobs, about)
    }

    /// [`start`](Observed::start) for a call of `jobs` jobs in `mode` (a batch, an offset
    /// claim), whose span names no key.
    pub(crate) fn counted(
        site: &'static Site,
        scope: &str,
        mode: Mode,
        jobs: usize,
        about: Option<About>,
    ) -> Self {
        let mut observed = Observed::start(site, scope, mode, None, about);
        let jobs = jobs as u64;
        observed.span.record("jobs", jobs);
        observed.jobs = Some(jobs);
        observed
    }

    /// The call's span: the claim's statements run in it, and so does a handler's body.
    pub(crate) fn span(&self) -> &Span {
        &self.span
    }

    /// When a claim attempt's statements are sent, if anyone reads how long they took: the
    /// span's `waited_ms` alone does, so with the span disabled the clock is not read.
    pub(crate) fn sending(&self) -> Option<Instant> {
        match self.span.is_disabled() {
            true => None,
            false => Some(Instant::now()),
        }
    }

    /// One claim attempt ended: its statements (begin and claim, or the lease statement) ran
    /// from `sent` ([`sending`](Observed::sending)) until now, which is the call's
    /// `waited_ms`.
    pub(crate) fn attempted(&mut self, sent: Option<Instant>) {
        self.attempts += 1;
        if let Some(sent) = sent {
            self.waited += sent.elapsed();
        }
    }

    /// The claim has its answer: the span's `retries` and `waited_ms`, the claim's latency,
    /// and the `trace` event of what it decided.
    pub(crate) fn decided(&mut self, answer: Answer) {
        // A disabled span records nothing, but with `tracing`'s `log` feature each `record`
        // still asks `log` whether it wants the field: skipped when nobody listens.
        if !self.span.is_disabled() {
            self.span.record("retries", self.attempts.saturating_sub(1));
            self.span.record(
                "waited_ms",
                u64::try_from(self.waited.as_millis()).unwrap_or(u64::MAX),
            );
        }
        metrics::with_recorder(|recorder| {
            recorder
                .register_histogram(self.site.claim_seconds_key(), &METADATA)
                .record(Since(self.started));
        });
        let decision = match answer {
            Answer::Fresh => "fresh",
            Answer::Takeover => "takeover",
            Answer::Duplicate => "duplicate",
            Answer::Replayed => "replayed",
            Answer::InProgress => "in_progress",
            // The outcome (`error`) and the error itself say it.
            Answer::Failed => return,
        };
        tracing::trace!(target: "idem", parent: &self.span, decision, "idem claim decided");
    }

    /// The call ended with `result`.
    pub(crate) fn ended<T, E>(mut self, result: &Result<Outcome<T>, Failed<E>>) {
        crate::testing::probe::settled(result);
        let verdict = Verdict::of(result);
        let ended = match result {
            Ok(_) => Ended::Ok,
            Err(Failed::Idem(e)) => Ended::Idem(e),
            Err(Failed::Handler(_)) => Ended::Handler,
        };
        self.record(verdict, &[(verdict, 1)], None);
        verdict::finished(&self.span, verdict, ended);
        self.ended = true;
    }

    /// The call ended before it held anything, with idem's `error` (its claim failed).
    pub(crate) fn refused(mut self, error: &Error) {
        crate::testing::probe::refused(error);
        let verdict = Verdict::of_error(error);
        let jobs = self.jobs.unwrap_or(1);
        self.record(verdict, &[(verdict, jobs)], None);
        verdict::finished(&self.span, verdict, Ended::Idem(error));
        self.ended = true;
    }

    /// A batch call ended with `result`: the span's `outcome` is `applied` if any job was, its
    /// `applied` and `duplicate` count the jobs, and the counter counts each job's outcome (a
    /// failed batch: every job's).
    pub(crate) fn ended_batch<T, E>(mut self, result: &Result<Batch<T>, Failed<E>>) {
        let jobs = self.jobs.unwrap_or(0);
        match result {
            Ok(batch) => {
                let applied = batch.applied() as u64;
                let verdict = match applied {
                    0 => Verdict::Duplicate,
                    _ => Verdict::Applied,
                };
                let counts = [
                    (Verdict::Applied, applied),
                    (Verdict::Duplicate, jobs - applied),
                ];
                self.record(verdict, &counts, Some((applied, jobs - applied)));
                verdict::finished(&self.span, verdict, Ended::Ok);
            }
            Err(failed) => self.failed_whole(jobs, failed),
        }
        self.ended = true;
    }

    /// A batch run job by job ended: `Ok((applied, failed))` counts its jobs (the others were
    /// duplicates), each job that failed alone as `error`; a batch that failed whole counts
    /// every job with its error. The span's `outcome` is `applied` if any job was, else
    /// `error` if any failed.
    pub(crate) fn ended_each<E>(mut self, result: Result<(u64, u64), &Failed<E>>) {
        let jobs = self.jobs.unwrap_or(0);
        match result {
            Ok((applied, failed)) => {
                let duplicate = jobs.saturating_sub(applied + failed);
                let verdict = match (applied, failed) {
                    (0, 0) => Verdict::Duplicate,
                    (0, _) => Verdict::Error,
                    _ => Verdict::Applied,
                };
                let counts = [
                    (Verdict::Applied, applied),
                    (Verdict::Duplicate, duplicate),
                    (Verdict::Error, failed),
                ];
                self.record(verdict, &counts, Some((applied, duplicate)));
                let ended = match failed {
                    0 => Ended::Ok,
                    _ => Ended::Handler,
                };
                verdict::finished(&self.span, verdict, ended);
            }
            Err(failed) => self.failed_whole(jobs, failed),
        }
        self.ended = true;
    }

    /// A batch that failed whole: every job counted with its error.
    fn failed_whole<E>(&self, jobs: u64, failed: &Failed<E>) {
        let verdict = Verdict::of_failed(failed);
        self.record(verdict, &[(verdict, jobs)], None);
        let ended = match failed {
            Failed::Idem(e) => Ended::Idem(e),
            Failed::Handler(_) => Ended::Handler,
        };
        verdict::finished(&self.span, verdict, ended);
    }

    /// Records how the call ended on its span, and the counts on the counter.
    fn record(&self, verdict: Verdict, counts: &[(Verdict, u64)], batch: Option<(u64, u64)>) {
        if !self.span.is_disabled() {
            self.span.record("outcome", verdict.as_str());
            if let Some((applied, duplicate)) = batch {
                self.span.record("applied", applied);
                self.span.record("duplicate", duplicate);
            }
        }
        metrics::with_recorder(|recorder| {
            for &(verdict, n) in counts.iter().filter(|(_, n)| *n > 0) {
                let key = self.site.outcome_key(verdict);
                recorder.register_counter(key, &METADATA).increment(n);
            }
            if let Some(About::Message(m)) = self.about {
                let took = self.started.elapsed().as_secs_f64();
                semconv::Keys::with(m, verdict, |key| {
                    recorder.register_histogram(key, &METADATA).record(took);
                });
            }
        });
    }
}

/// The seconds since an instant, read when a histogram takes the value: a recorder's does, the
/// no-op one (no recorder installed) never reads the clock.
struct Since(Instant);

impl metrics::IntoF64 for Since {
    fn into_f64(self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

impl Drop for Observed {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let jobs = self.jobs.unwrap_or(1);
        self.record(Verdict::Error, &[(Verdict::Error, jobs)], None);
        verdict::finished(&self.span, Verdict::Error, Ended::Dropped);
    }
}

/// A lease-mode claim took the key over from an earlier delivery whose lease expired or was
/// released: `attempt` is this delivery's [`Lease::attempt`](crate::Lease::attempt) (and the
/// marker's `attempts`). INFO, not WARN: a released lease (the body failed) or an expired one
/// (a worker died) being taken over is the recovery working.
pub(crate) fn took_over(token: i64, attempt: u32) {
    tracing::info!(
        target: "idem",
        token,
        attempt,
        "idem lease taken over from an earlier delivery whose lease expired or was released"
    );
}

static CLAIM_RETRIES: AtomicU64 = AtomicU64::new(0);

/// Claims retried after a lost race (serialization failure, deadlock victim) in this process
/// so far; the race tests print it.
pub(crate) fn claim_retries() -> u64 {
    CLAIM_RETRIES.load(Ordering::Relaxed)
}

/// A claim lost a race and is tried again: `retry` is the number of this retry (1 for the
/// first), as the span's `retries` counts them. WARN: a few are normal under contention, a
/// storm of them says the isolation level or the batch sizes fight each other.
pub(crate) fn retry(lost: u32, error: &sqlx::Error) {
    CLAIM_RETRIES.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        target: "idem",
        retry = lost,
        error = %error,
        "idem claim lost a race to another delivery of the key; trying again"
    );
}

/// A stored `replay` value no longer reads as the handler's type: the job was applied, so the
/// delivery is a duplicate without its value.
pub(crate) fn undecodable(error: &serde_json::Error) {
    tracing::warn!(
        target: "idem",
        error = %error,
        "idem: the value an earlier delivery stored for replay no longer reads as the \
         handler's type; answering Duplicate (the job was applied)"
    );
}

/// A taken outbox message's stored headers no longer read (edited by hand): it is published
/// without them rather than holding back the whole outbox.
pub(crate) fn unreadable_headers(id: &str, error: &serde_json::Error) {
    tracing::warn!(
        target: "idem",
        id,
        error = %error,
        "idem relay: an outbox message's stored headers do not read as a JSON object of \
         texts; publishing it without headers"
    );
}
