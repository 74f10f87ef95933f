//! What a request through the layer tells the outside, in transaction and lease mode: one
//! `idem.claim` span per request (the marker key, the mode, the outcome), the handler run
//! inside it, and `idem_outcomes_total` / `idem_claim_seconds` for every request, as for a job
//! handler's call. The facade's own subscriber and recorder (`tests/observe/capture.rs`) keep
//! what they see; they are the process's, so each test has scopes of its own, and runs on a
//! current-thread runtime (the subscriber keeps each thread's spans for that thread's test),
//! the server's tasks included.

#[path = "../../../tests/observe/capture.rs"]
#[allow(dead_code)]
mod capture;

use std::sync::Mutex;

use idem::http::{ClaimedLease, SINGLE_TENANT};

use super::*;

struct Observed<DB: Db> {
    effects: String,
    pool: sqlx::Pool<DB>,
    hold: Hold,
    /// The span each handler run was in, by the marker key it ran for.
    runs: Mutex<Vec<(String, Option<u64>)>>,
}

impl<DB: Db> Observed<DB> {
    /// The handler's own part: its claim's span (as `span()` gives it) noted, an event of its
    /// own sent, which the capture files under the span entered when it is sent. The event's
    /// target is `idem` only so that the capture's `idem_events` lists it. (The capture keeps
    /// its own stack of entered spans and does not answer `Span::current()`.)
    fn ran(&self, key: &str, claim: &tracing::Span) {
        tracing::info!(target: "idem", handler = key, "the handler ran");
        let id = claim.id().map(|id| id.into_u64());
        self.runs.lock().unwrap().push((key.to_owned(), id));
    }

    async fn hold_if_asked(&self, headers: &HeaderMap) {
        if headers.contains_key("x-hold") {
            self.hold.entered.notify_one();
            self.hold.release.notified().await;
        }
    }
}

fn asked_to_fail(headers: &HeaderMap) -> bool {
    headers.get("x-status").is_some_and(|v| v == "500")
}

/// Transaction mode: the write in the claimed transaction; `x-status: 500` after it.
async fn observed_tx<DB: Db>(
    State(app): State<Arc<Observed<DB>>>,
    mut tx: ClaimedTx<DB>,
    headers: HeaderMap,
    key: String,
) -> Response {
    let span = tx.span().clone();
    app.ran(&key, &span);
    DB::write(tx.conn(), &app.effects, key.clone())
        .await
        .unwrap();
    app.hold_if_asked(&headers).await;
    if asked_to_fail(&headers) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the handler failed").into_response();
    }
    (StatusCode::CREATED, key).into_response()
}

/// Lease mode: `x-status: 500` before the outside effect.
async fn observed_lease<DB: Db>(
    State(app): State<Arc<Observed<DB>>>,
    lease: ClaimedLease<DB>,
    headers: HeaderMap,
    key: String,
) -> Response {
    app.ran(&key, lease.span());
    app.hold_if_asked(&headers).await;
    if asked_to_fail(&headers) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the handler failed").into_response();
    }
    let mut conn = app.pool.acquire().await.unwrap();
    DB::write(&mut conn, &app.effects, key.clone())
        .await
        .unwrap();
    (StatusCode::CREATED, key).into_response()
}

/// The span's fields but `waited_ms` (a measured time, checked to be a number).
fn fields(span: &capture::SpanRec) -> capture::Fields {
    let mut fields = span.fields.clone();
    let waited = fields.remove("waited_ms");
    let waited = waited.unwrap_or_else(|| panic!("no waited_ms in {span:?}"));
    waited.parse::<u64>().expect("waited_ms is a number");
    fields
}

fn expected(scope: &str, key: &str, mode: &str, outcome: &str) -> capture::Fields {
    [
        ("scope", scope),
        ("key", key),
        ("mode", mode),
        ("outcome", outcome),
        ("retries", "0"),
        // OpenTelemetry's HTTP attribute; the claim runs inside the server's span.
        ("http.request.method", "POST"),
        ("otel.kind", "internal"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The `message`s of idem's events in span `id` (the handler's included), but the trace
/// events of the claim's decision, which `decisions` lists.
fn messages(seen: &capture::Seen, id: u64) -> Vec<String> {
    let events = seen.idem_events(id);
    let events = events.iter().filter(|e| e.level != tracing::Level::TRACE);
    events.map(|e| e.fields["message"].clone()).collect()
}

fn decisions(seen: &capture::Seen, id: u64) -> Vec<String> {
    let events = seen.idem_events(id);
    let events = events.iter().filter(|e| e.level == tracing::Level::TRACE);
    events.map(|e| e.fields["decision"].clone()).collect()
}

/// One mode's requests at `url`: a new key (applied) and its retry (replayed), a key still
/// running (the second request 409, `in_progress`), a 500 (`error`, nothing kept) and its
/// retry (applied).
async fn requests<DB: Db>(
    seen: &capture::Seen,
    tables: &Tables<DB>,
    app: &Observed<DB>,
    url: &str,
    (scope, mode): (&str, &str),
) {
    // Each mode's own keys (the effects table is shared): the header's, and the marker's.
    let header = |k: &str| format!("\"{mode}-{k}\"");
    let (ha, hb, hc) = (header("a"), header("b"), header("c"));
    let (ka, kb, kc) = (Some(ha.as_str()), Some(hb.as_str()), Some(hc.as_str()));
    let key = |k: &str| {
        let header = format!("{mode}-{k}");
        idem::job_id(SINGLE_TENANT, header.as_str())
            .unwrap()
            .into_string()
    };
    let (a, b, c) = (key("a"), key("b"), key("c"));
    let first = send(url, ka, None, &a, &[]).await;
    assert_eq!((first.status, first.replayed()), (201, false), "{first:?}");
    let again = send(url, ka, None, &a, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true), "{again:?}");

    let held = tokio::spawn({
        let (url, b, hb) = (url.to_owned(), b.clone(), hb.clone());
        async move { send(&url, Some(&hb), None, &b, &[("x-hold", "1")]).await }
    });
    within(60, "the held request", app.hold.entered.notified()).await;
    let busy = within(60, "the request meanwhile", send(url, kb, None, &b, &[])).await;
    assert_problem(&busy, 409, "still being processed");
    app.hold.release.notify_one();
    let held = within(60, "the held request's end", held).await.unwrap();
    assert_eq!(held.status, 201, "{held:?}");

    let completed = format!(
        "SELECT COUNT(*) FROM {} WHERE scope = '{scope}' AND state = 'completed'",
        tables.store.table()
    );
    let failed = send(url, kc, None, &c, &[("x-status", "500")]).await;
    assert_eq!((failed.status, failed.text()), (500, "the handler failed"));
    assert_eq!(
        DB::scalar(&tables.pool, completed.clone()).await,
        2,
        "a 500 kept its key"
    );
    let effects = format!("SELECT COUNT(*) FROM {} WHERE body = '{c}'", tables.effects);
    assert_eq!(
        DB::scalar(&tables.pool, effects).await,
        0,
        "a 500 kept its write"
    );
    let retried = send(url, kc, None, &c, &[]).await;
    assert_eq!(
        (retried.status, retried.replayed()),
        (201, false),
        "{retried:?}"
    );
    assert_eq!(DB::scalar(&tables.pool, completed).await, 3);

    // One span per request, in the order they began.
    let claims: Vec<(u64, capture::SpanRec)> = seen
        .claims()
        .into_iter()
        .filter(|(_, span)| span.fields.get("scope").map(String::as_str) == Some(scope))
        .collect();
    // Lease mode's 500 released the lease, which the retry takes over; a transaction's rolled
    // its marker back, so the retry claims afresh.
    let retry = match mode {
        "lease" => "takeover",
        _ => "fresh",
    };
    let want = [
        (&a, "applied", "fresh"),
        (&a, "replayed", "replayed"),
        (&b, "applied", "fresh"),
        (&b, "in_progress", "in_progress"),
        (&c, "error", "fresh"),
        (&c, "applied", retry),
    ];
    let got: Vec<capture::Fields> = claims.iter().map(|(_, span)| fields(span)).collect();
    let wanted: Vec<capture::Fields> = want
        .iter()
        .map(|(key, outcome, _)| expected(scope, key, mode, outcome))
        .collect();
    assert_eq!(got, wanted, "the {mode} requests' spans");
    let took_over =
        "idem lease taken over from an earlier delivery whose lease expired or was released";
    for ((id, _), (_, outcome, decision)) in claims.iter().zip(want) {
        assert_eq!(decisions(seen, *id), [decision], "{outcome} in {mode} mode");
        let said: &[&str] = match decision {
            "fresh" => &["the handler ran", "idem call finished"],
            "takeover" => &[took_over, "the handler ran", "idem call finished"],
            _ => &["idem call finished"],
        };
        assert_eq!(messages(seen, *id), said, "{outcome} in {mode} mode");
    }
    // The handler ran in the span of each request that ran it, and in no other.
    let ran_in: Vec<(String, Option<u64>)> = [0, 2, 4, 5]
        .into_iter()
        .map(|i| (want[i].0.clone(), Some(claims[i].0)))
        .collect();
    assert_eq!(
        *app.runs.lock().unwrap(),
        ran_in,
        "the {mode} handler's runs"
    );
    app.runs.lock().unwrap().clear();

    let counted = |outcome: &str| {
        let labels = [("scope", scope), ("outcome", outcome)];
        capture::metrics().counter(idem::OUTCOMES_TOTAL, &labels)
    };
    let counts: Vec<(&str, u64)> = ["applied", "replayed", "in_progress", "error"]
        .into_iter()
        .map(|o| (o, counted(o)))
        .collect();
    let by_label = capture::metrics().counters_with(idem::OUTCOMES_TOTAL, ("scope", scope));
    assert_eq!(
        counts,
        [
            ("applied", 3),
            ("replayed", 1),
            ("in_progress", 1),
            ("error", 1)
        ],
        "{mode} mode: {by_label:?}"
    );
    assert_eq!(by_label.len(), 4, "no other outcome: {by_label:?}");
    let samples = capture::metrics().samples(idem::CLAIM_SECONDS, &[("scope", scope)]);
    assert_eq!(
        samples.len(),
        6,
        "a claim latency per request in {mode} mode"
    );
}

async fn spans_and_metrics<DB: Db>(tables: Tables<DB>, db: &str) {
    capture::metrics();
    let (seen, _watching) = capture::subscribe();
    let app = Arc::new(Observed {
        effects: tables.effects.clone(),
        pool: tables.pool.clone(),
        hold: Hold::default(),
        runs: Mutex::new(Vec::new()),
    });
    let (tx_scope, lease_scope) = (
        format!("tests.http.obs.{db}.tx"),
        format!("tests.http.obs.{db}.lease"),
    );
    // A request behind a running one waits 200 ms for it (the transaction's lock).
    let tx_layer = IdempotencyLayer::new(tables.store.clone(), &tx_scope)
        .single_tenant()
        .wait(Duration::from_millis(200));
    let lease = idem::LeaseOptions::new(Duration::from_secs(30));
    let lease_layer = IdempotencyLayer::new(tables.store.clone(), &lease_scope)
        .single_tenant()
        .lease(lease);
    let router = Router::new()
        .route("/tx", post(observed_tx::<DB>))
        .layer(tx_layer)
        .merge(
            Router::new()
                .route("/lease", post(observed_lease::<DB>))
                .layer(lease_layer),
        )
        .with_state(app.clone());
    let server = serve(router).await;
    let tx_url = format!("{}/tx", server.url);
    requests(&seen, &tables, &app, &tx_url, (&tx_scope, "transaction")).await;
    let lease_url = format!("{}/lease", server.url);
    requests(&seen, &tables, &app, &lease_url, (&lease_scope, "lease")).await;
    drop(server);
    tables.drop_all().await;
}

// Current-thread runtimes: the capture keeps the spans of the test's own thread.

#[tokio::test]
async fn postgres_requests_have_a_claim_span_and_count_their_outcomes() {
    let tables = Tables::new(postgres().await, "pg_observed").await;
    spans_and_metrics(tables, "pg").await;
}

#[tokio::test]
async fn mariadb_requests_have_a_claim_span_and_count_their_outcomes() {
    let tables = Tables::new(mariadb().await, "my_observed").await;
    spans_and_metrics(tables, "my").await;
}

#[tokio::test]
async fn sqlite_requests_have_a_claim_span_and_count_their_outcomes() {
    let pool = sqlite(&temp_db("observed")).await;
    spans_and_metrics(Tables::new(pool, "observed").await, "lite").await;
}
