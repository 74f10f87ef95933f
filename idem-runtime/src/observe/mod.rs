//! What a generated handler call tells the outside: one `idem.claim` span per call, one
//! `idem call finished` event in it, a few events from the claim, and two metrics through the
//! `metrics` facade.
//!
//! Everything is logged with the target `idem`, at these levels:
//!
//! | level | what |
//! |---|---|
//! | WARN | a call ended by an error of idem's own (its text once, in `error`); a claim that lost a race and is retried; a stored `replay` value that no longer reads |
//! | INFO | the `idem.claim` span; a call that found another delivery holding the key (`in_progress`); a lease taken over from an earlier delivery |
//! | DEBUG | the end of every other call (`applied`, `duplicate`, `replayed`, or the body's own error, which the caller gets back) |
//! | TRACE | what the claim decided (`fresh`, `takeover`, `duplicate`, `replayed`, `in_progress`) |
//!
//! At the usual INFO a worker logs nothing per healthy job; `RUST_LOG=info,idem=debug`
//! (tracing-subscriber's `EnvFilter`) shows one line per call with its span's fields.
//!
//! With no `tracing` subscriber and no `metrics` recorder installed this costs a few clock
//! reads per call and nothing else: the span is disabled by its callsite's cached interest
//! (its fields, the key included, are then never evaluated), the metric keys are statics of
//! the handler (no allocation, no formatting), and the claim's counts travel in a
//! thread-local cell rather than in anything allocated.

use std::cell::Cell;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::time::{Duration, Instant};

use metrics::{Key, Label, Metadata};
use tracing::Span;
use tracing::field::Empty;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::options::Mode;
use crate::{Batch, Failed, Outcome};

mod keys;
mod verdict;

pub use keys::{KeyInSpans, observe_keys};
use verdict::{COUNT, Verdict};

/// The counter of finished handler calls, labelled `scope` and `outcome`.
///
/// The outcomes: `applied`, `duplicate`, `replayed` (the call's [`Outcome`]); one per kind of
/// idem's [`Error`](crate::Error) that asks for its own action: `in_progress`, `rolled_back`
/// (`RolledBack`), `timeout`, `key_reused`, `lease_lost`, `value_not_stored`, `invalid` (a key,
/// scope, lease or value refused as given, or a nested call: a redelivery fails the same way);
/// and `error` for the rest (the body's own errors, database failures). A batch counts each of
/// its jobs.
pub const OUTCOMES_TOTAL: &str = "idem_outcomes_total";

/// The histogram of claim latency in seconds, labelled `scope`: from the start of the claim
/// (a connection from the pool, the begin; lease mode: the lease statement) to its answer
/// (fresh, duplicate, replayed, in progress, or a failure), retries after a lost race
/// included.
pub const CLAIM_SECONDS: &str = "idem_claim_seconds";

/// Describes [`OUTCOMES_TOTAL`] and [`CLAIM_SECONDS`] to the installed `metrics` recorder
/// (their help text and unit), for exporters that publish descriptions, such as Prometheus's.
///
/// Call it once after installing the recorder; recording works without it.
pub fn describe_metrics() {
    metrics::describe_counter!(
        OUTCOMES_TOTAL,
        metrics::Unit::Count,
        "Idempotent handler calls by scope and outcome (applied, duplicate, replayed, \
         in_progress, rolled_back, timeout, key_reused, lease_lost, value_not_stored, invalid, \
         error)."
    );
    metrics::describe_histogram!(
        CLAIM_SECONDS,
        metrics::Unit::Seconds,
        "Time from the claim's first statement to its answer, by scope."
    );
}

/// A handler's labels, built at compile time into a `static` of the generated code, so that
/// recording a metric neither allocates nor formats.
#[doc(hidden)]
pub struct Site {
    scope: &'static str,
    outcomes: [[Label; 2]; COUNT],
    scope_only: [Label; 1],
}

impl Site {
    #[doc(hidden)]
    pub const fn new(scope: &'static str) -> Site {
        const fn pair(scope: &'static str, outcome: usize) -> [Label; 2] {
            [
                Label::from_static_parts("scope", scope),
                Label::from_static_parts("outcome", Verdict::ALL[outcome]),
            ]
        }
        Site {
            scope,
            outcomes: [
                pair(scope, 0),
                pair(scope, 1),
                pair(scope, 2),
                pair(scope, 3),
                pair(scope, 4),
                pair(scope, 5),
                pair(scope, 6),
                pair(scope, 7),
                pair(scope, 8),
                pair(scope, 9),
                pair(scope, 10),
            ],
            scope_only: [Label::from_static_parts("scope", scope)],
        }
    }
}

/// What the claim of the running call reports, kept in [`CURRENT`] while the call is polled.
#[derive(Clone, Copy, Default)]
struct Stats {
    attempts: u32,
    waited: Duration,
    claim: Option<Duration>,
}

thread_local! {
    /// The stats of the generated call being polled on this thread, if any: set and put back
    /// around each poll, so that a joined call inside another's body counts its own claim.
    static CURRENT: Cell<Option<Stats>> = const { Cell::new(None) };
}

fn with_current(f: impl FnOnce(&mut Stats)) {
    CURRENT.with(|cell| {
        if let Some(mut stats) = cell.get() {
            f(&mut stats);
            cell.set(Some(stats));
        }
    });
}

/// Puts a call's stats into [`CURRENT`] for one poll, and takes them back out even if the
/// poll panics.
struct Installed<'a> {
    stats: &'a mut Stats,
    previous: Option<Stats>,
}

impl<'a> Installed<'a> {
    fn new(stats: &'a mut Stats) -> Self {
        let previous = CURRENT.with(|cell| cell.replace(Some(*stats)));
        Installed { stats, previous }
    }
}

impl Drop for Installed<'_> {
    fn drop(&mut self) {
        if let Some(stats) = CURRENT.with(|cell| cell.replace(self.previous)) {
            *self.stats = stats;
        }
    }
}

/// One generated call, between its key and its outcome.
#[doc(hidden)]
pub struct Call {
    site: &'static Site,
    span: Span,
}

impl Call {
    /// Opens the `idem.claim` span (when a subscriber wants it; `key` is read only then, and
    /// shown as [`observe_keys`] says).
    pub(crate) fn start(site: &'static Site, mode: Mode, key: Option<&str>) -> Call {
        let span = tracing::info_span!(
            target: "idem",
            "idem.claim",
            scope = site.scope,
            key = Empty,
            key_hash = Empty,
            mode = mode.as_str(),
            outcome = Empty,
            retries = Empty,
            waited_ms = Empty,
            jobs = Empty,
            applied = Empty,
            duplicate = Empty,
        );
        if let Some(key) = key.filter(|_| !span.is_disabled()) {
            match keys::setting() {
                KeyInSpans::Plain => {
                    span.record("key", key);
                }
                KeyInSpans::Hashed => {
                    span.record("key_hash", keys::hash(key).as_str());
                }
                KeyInSpans::Omitted => {}
            }
        }
        Call { site, span }
    }

    /// Runs the call's claim, body and end in the span, then records how it ended.
    ///
    /// Not an `async fn` (nor is [`run_batch`](Call::run_batch)): the handler's future is
    /// moved once, into `observed`, so that it is stored once in the state
    /// of the generated call.
    pub fn run<T, E, F>(self, future: F) -> impl Future<Output = F::Output>
    where
        F: Future<Output = Result<Outcome<T>, Failed<E>>>,
    {
        self.observed(future, |result| {
            let verdict = Verdict::of(result);
            Judged {
                verdict,
                counts: [(verdict, 1), (verdict, 0)],
                batch: None,
            }
        })
    }

    /// [`run`](Call::run) for a batch of `jobs` jobs: the span's `outcome` is `applied` if
    /// any job was, its `applied` and `duplicate` count the jobs, and the counter counts each
    /// job's outcome (a failed batch: every job's).
    pub fn run_batch<T, E, F>(self, jobs: usize, future: F) -> impl Future<Output = F::Output>
    where
        F: Future<Output = Result<Batch<T>, Failed<E>>>,
    {
        let jobs = jobs as u64;
        self.span.record("jobs", jobs);
        self.observed(future, move |result| match result {
            Ok(batch) => {
                let applied = batch.applied() as u64;
                let verdict = if applied > 0 {
                    Verdict::Applied
                } else {
                    Verdict::Duplicate
                };
                Judged {
                    verdict,
                    counts: [
                        (Verdict::Applied, applied),
                        (Verdict::Duplicate, jobs - applied),
                    ],
                    batch: Some((applied, jobs - applied)),
                }
            }
            Err(failed) => {
                let verdict = Verdict::of_failed(failed);
                Judged {
                    verdict,
                    counts: [(verdict, jobs), (verdict, 0)],
                    batch: None,
                }
            }
        })
    }

    /// Polls `future` inside the span, with the claim's stats installed for each poll, then
    /// records the verdict `judge` gives, its counts, and the call's one event.
    async fn observed<T, E, F: Future<Output = Result<T, Failed<E>>>>(
        self,
        future: F,
        judge: impl FnOnce(&Result<T, Failed<E>>) -> Judged,
    ) -> F::Output {
        let Call { site, span } = self;
        let mut stats = Stats::default();
        let mut future = pin!(future);
        let result = poll_fn(|cx| {
            let _entered = span.enter();
            let _installed = Installed::new(&mut stats);
            future.as_mut().poll(cx)
        })
        .await;
        let judged = judge(&result);
        record(site, &span, &judged, stats);
        verdict::finished(&span, judged.verdict, result.as_ref().err());
        result
    }
}

/// How a call ended: its verdict, the counter's increments (outcome, how many jobs), and a
/// batch's `(applied, duplicate)` counts.
struct Judged {
    verdict: Verdict,
    counts: [(Verdict, u64); 2],
    batch: Option<(u64, u64)>,
}

static METADATA: Metadata<'static> =
    Metadata::new("idem", metrics::Level::INFO, Some(module_path!()));

/// Records how the call ended on its span, and the counts on the counter.
fn record(site: &'static Site, span: &Span, judged: &Judged, stats: Stats) {
    span.record("outcome", judged.verdict.as_str());
    if stats.claim.is_some() {
        span.record("retries", stats.attempts.saturating_sub(1));
        span.record(
            "waited_ms",
            u64::try_from(stats.waited.as_millis()).unwrap_or(u64::MAX),
        );
    }
    if let Some((applied, duplicate)) = judged.batch {
        span.record("applied", applied);
        span.record("duplicate", duplicate);
    }
    metrics::with_recorder(|recorder| {
        for &(verdict, n) in judged.counts.iter().filter(|(_, n)| *n > 0) {
            let key = Key::from_static_parts(OUTCOMES_TOTAL, &site.outcomes[verdict as usize]);
            recorder.register_counter(&key, &METADATA).increment(n);
        }
        if let Some(claim) = stats.claim {
            let key = Key::from_static_parts(CLAIM_SECONDS, &site.scope_only);
            recorder
                .register_histogram(&key, &METADATA)
                .record(claim.as_secs_f64());
        }
    });
}

/// What a claim found, for its `trace` event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    Fresh,
    Takeover,
    Duplicate,
    Replayed,
    InProgress,
    Failed,
}

/// One claim attempt ended: its statements (begin and claim, or the lease statement) ran
/// from `sent` until now, which is the call's `waited_ms`.
pub(crate) fn attempted(sent: Instant) {
    with_current(|stats| {
        stats.attempts += 1;
        stats.waited += sent.elapsed();
    });
}

/// The claim that began at `started` has its answer.
pub(crate) fn decided(started: Instant, decision: Decision) {
    with_current(|stats| stats.claim = Some(started.elapsed()));
    let decision = match decision {
        Decision::Fresh => "fresh",
        Decision::Takeover => "takeover",
        Decision::Duplicate => "duplicate",
        Decision::Replayed => "replayed",
        Decision::InProgress => "in_progress",
        // The outcome (`error`) and the error itself say it.
        Decision::Failed => return,
    };
    tracing::trace!(target: "idem", decision, "idem claim decided");
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
