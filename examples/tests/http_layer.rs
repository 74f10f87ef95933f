//! `idem::http::IdempotencyLayer` over real HTTP on loopback, against PostgreSQL, MariaDB and
//! SQLite: every status path, 32 concurrent requests with one key, principals kept apart, bad
//! input that writes nothing, a client that hangs up mid-handler, and a server process
//! SIGKILLed between its commit and its response.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::{CONTENT_TYPE, LOCATION, RETRY_AFTER};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::http::{ClaimedTx, IdempotencyLayer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::Notify;

use support::{CHILD_MODE, Lines, Worker, child_env, stop_signal, within};

#[path = "http_layer/db.rs"]
mod db;
#[path = "http_layer/hangup.rs"]
mod hangup;
#[path = "http_layer/holders.rs"]
mod holders;
#[path = "http_layer/holders_held.rs"]
mod holders_held;
#[path = "http_layer/holders_observed.rs"]
mod holders_observed;
#[path = "http_layer/holders_outbox.rs"]
mod holders_outbox;
#[path = "http_layer/lease.rs"]
mod lease;
#[path = "http_layer/seams.rs"]
mod seams;

use db::{Db, Tables, mariadb, postgres, sqlite, temp_db};

/// Holds a request inside its handler, after its write, until the test lets it go.
#[derive(Default)]
struct Hold {
    entered: Notify,
    release: Notify,
}

struct App<DB: Db> {
    effects: String,
    hold: Hold,
    db: std::marker::PhantomData<fn() -> DB>,
}

/// Distinguishes the handler's runs, so that a replay that ran again would show.
static RUN: AtomicU64 = AtomicU64::new(1);

/// `POST /effects`: writes one row in the claimed transaction and answers 201 with it. Test
/// controls in headers (outside the fingerprint): `x-hold` holds it after the write, `x-panic`
/// panics there, `x-status` answers 500 or 404 instead.
async fn effect<DB: Db>(
    State(app): State<Arc<App<DB>>>,
    mut tx: ClaimedTx<DB>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let id = match DB::write(tx.conn(), &app.effects, body).await {
        Ok(id) => id,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    if headers.contains_key("x-hold") {
        app.hold.entered.notify_one();
        app.hold.release.notified().await;
    }
    if headers.contains_key("x-panic") {
        panic!("the handler panics after its write, on purpose");
    }
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    match headers.get("x-status").map(|v| v.as_bytes()) {
        Some(b"500") => (StatusCode::INTERNAL_SERVER_ERROR, "the handler failed").into_response(),
        Some(b"404") => (
            StatusCode::NOT_FOUND,
            format!("no such account (run {run})"),
        )
            .into_response(),
        _ => (
            StatusCode::CREATED,
            [(LOCATION, format!("/effects/{id}"))],
            axum::Json(serde_json::json!({ "effect": id, "run": run })),
        )
            .into_response(),
    }
}

/// `POST /stream`: a streamed body, which the layer sends without storing.
async fn stream<DB: Db>(State(app): State<Arc<App<DB>>>, mut tx: ClaimedTx<DB>) -> Response {
    let id = DB::write(tx.conn(), &app.effects, "stream".into())
        .await
        .unwrap();
    let chunks = futures_util::stream::iter(
        ["a ", "streamed ", "answer"].map(|c| Ok::<_, std::io::Error>(Bytes::from(c))),
    );
    (
        StatusCode::CREATED,
        [(LOCATION, format!("/effects/{id}"))],
        Body::from_stream(chunks),
    )
        .into_response()
}

fn router<DB: Db>(tables: &Tables<DB>, app: Arc<App<DB>>) -> Router {
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http")
        .principal(|parts| {
            let key = parts.headers.get("x-api-key")?;
            key.to_str().ok().map(str::to_owned)
        })
        .body_limit(1024)
        .wait(Duration::from_millis(300));
    Router::new()
        .route("/effects", post(effect::<DB>))
        .route("/other", post(effect::<DB>))
        .route("/stream", post(stream::<DB>))
        .layer(layer)
        .with_state(app)
}

struct Server {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server { url, task }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Reply {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }
}

/// One request: `key` is the header's raw value, `who` the API key.
async fn send(
    url: &str,
    key: Option<&str>,
    who: Option<&str>,
    body: &str,
    extra: &[(&str, &str)],
) -> Reply {
    let mut request = reqwest::Client::new().post(url).body(body.to_owned());
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    if let Some(who) = who {
        request = request.header("x-api-key", who);
    }
    for (k, v) in extra {
        request = request.header(*k, *v);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await.unwrap();
    Reply {
        status,
        headers,
        body,
    }
}

/// A request with bytes reqwest refuses to put in a header, over a plain socket; its status.
async fn raw_status(url: &str, key: &[u8]) -> u16 {
    let addr = url.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = b"POST /effects HTTP/1.1\r\nHost: test\r\nx-api-key: alice\r\n".to_vec();
    request.extend_from_slice(b"Idempotency-Key: ");
    request.extend_from_slice(key);
    request.extend_from_slice(b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi");
    socket.write_all(&request).await.unwrap();
    let mut answer = Vec::new();
    socket.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"))
}

fn assert_problem(reply: &Reply, status: u16, says: &str) {
    assert_eq!(reply.status, status, "{}", reply.text());
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    let problem: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(problem["status"], status);
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains(says), "{detail:?} does not say {says:?}");
}

/// Every status path, in order, on one database.
async fn status_paths<DB: Db>(tables: Tables<DB>) {
    let app = Arc::new(App {
        effects: tables.effects.clone(),
        hold: Hold::default(),
        db: std::marker::PhantomData,
    });
    let server = serve(router(&tables, app.clone())).await;
    let url = format!("{}/effects", server.url);
    let alice = Some("alice");

    // Bad input: refused before any database I/O, nothing written.
    let r = send(&url, None, alice, "{}", &[]).await;
    assert_problem(&r, 400, "has no `idempotency-key` header");
    assert_problem(&r, 400, "e.g. `idempotency-key: \"");
    let long = format!("\"{}\"", "k".repeat(256));
    assert_problem(
        &send(&url, Some(&long), alice, "{}", &[]).await,
        400,
        "256 bytes",
    );
    assert_problem(
        &send(&url, Some("\"\""), alice, "{}", &[]).await,
        400,
        "empty key",
    );
    assert_problem(
        &send(&url, Some("a b"), alice, "{}", &[]).await,
        400,
        "quote it",
    );
    assert_problem(
        &send(&url, Some("\"k\";v=1"), alice, "{}", &[]).await,
        400,
        "parameters",
    );
    assert_problem(
        &send(&url, Some("\"k"), alice, "{}", &[]).await,
        400,
        "closing",
    );
    assert_eq!(
        raw_status(&server.url, "\"cl\u{e9}\"".as_bytes()).await,
        400
    );
    assert_eq!(raw_status(&server.url, b"\"a\x00b\"").await, 400);
    let big = "x".repeat(1025);
    assert_problem(
        &send(&url, Some("\"big\""), alice, &big, &[]).await,
        413,
        "1024 bytes",
    );
    assert_problem(
        &send(&url, Some("\"k\""), None, "{}", &[]).await,
        401,
        "credentials",
    );
    assert_eq!(tables.counts().await, (0, 0), "bad input wrote something");

    // A new key runs the handler; its retry gets the first response byte for byte.
    let first = send(&url, Some("\"k1\""), alice, "{\"n\":1}", &[]).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    let again = send(&url, Some("k1"), alice, "{\"n\":1}", &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body, "the replay is not the first body");
    assert_eq!(again.header("content-type"), first.header("content-type"));
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(tables.counts().await, (1, 1));

    // The same key for another request: another body, another path.
    let other = send(&url, Some("\"k1\""), alice, "{\"n\":2}", &[]).await;
    assert_problem(&other, 422, "different request");
    let path = send(
        &format!("{}/other", server.url),
        Some("\"k1\""),
        alice,
        "{\"n\":1}",
        &[],
    )
    .await;
    assert_problem(&path, 422, "different request");

    // Another principal with the same key runs on its own and never sees alice's response.
    let bob = send(&url, Some("\"k1\""), Some("bob"), "{\"n\":1}", &[]).await;
    assert_eq!(bob.status, 201);
    assert!(!bob.replayed());
    assert_ne!(bob.body, first.body);
    let alice_again = send(&url, Some("\"k1\""), alice, "{\"n\":1}", &[]).await;
    assert_eq!(alice_again.body, first.body);
    assert_eq!(tables.counts().await, (2, 2));

    // A 5xx rolls the handler's write back with the claim; the retry runs.
    let failed = send(&url, Some("\"k2\""), alice, "{}", &[("x-status", "500")]).await;
    assert_eq!(failed.status, 500);
    assert_eq!(tables.counts().await, (2, 2), "a 500 kept its write");
    let retried = send(&url, Some("\"k2\""), alice, "{}", &[]).await;
    assert_eq!(retried.status, 201);
    assert!(!retried.replayed());
    assert_eq!(tables.counts().await, (3, 3));

    // A 404 is the request's own answer: stored, with its write, and replayed.
    let missing = send(&url, Some("\"k3\""), alice, "{}", &[("x-status", "404")]).await;
    assert_eq!(missing.status, 404);
    let missing_again = send(&url, Some("\"k3\""), alice, "{}", &[]).await;
    assert_eq!(
        (missing_again.status, missing_again.replayed()),
        (404, true)
    );
    assert_eq!(missing_again.body, missing.body);
    assert_eq!(tables.counts().await, (4, 4));

    // While the first request with a key runs, a second gets 409 with Retry-After; once the
    // first completed, the replay of its response.
    let held = tokio::spawn({
        let url = url.clone();
        async move { send(&url, Some("\"k4\""), alice, "{}", &[("x-hold", "1")]).await }
    });
    app.hold.entered.notified().await;
    let busy = send(&url, Some("\"k4\""), alice, "{}", &[]).await;
    assert_problem(&busy, 409, "still being processed");
    assert_eq!(busy.headers.get(RETRY_AFTER).unwrap(), "1");
    app.hold.release.notify_one();
    let held = held.await.unwrap();
    assert_eq!((held.status, held.replayed()), (201, false));
    let after = send(&url, Some("\"k4\""), alice, "{}", &[]).await;
    assert!(after.replayed());
    assert_eq!(after.body, held.body);
    assert_eq!(tables.counts().await, (5, 5));

    // A streamed body is sent as it comes, not stored: the retry gets the status and the
    // Location, with an empty body.
    let stream_url = format!("{}/stream", server.url);
    let streamed = send(&stream_url, Some("\"k5\""), alice, "", &[]).await;
    assert_eq!(
        (streamed.status, streamed.text()),
        (201, "a streamed answer")
    );
    let restream = send(&stream_url, Some("\"k5\""), alice, "", &[]).await;
    assert_eq!((restream.status, restream.replayed()), (201, true));
    assert_eq!(restream.header("location"), streamed.header("location"));
    assert!(restream.body.is_empty());
    assert_eq!(restream.headers.get(CONTENT_TYPE), None);
    assert_eq!(tables.counts().await, (6, 6));
    tables.drop_all().await;
}

/// 32 requests with one key at once: one effect; every other answer is 409 or the replay of
/// the first.
async fn concurrent<DB: Db>(tables: Tables<DB>) {
    let app = Arc::new(App {
        effects: tables.effects.clone(),
        hold: Hold::default(),
        db: std::marker::PhantomData,
    });
    let server = serve(router(&tables, app)).await;
    let url = format!("{}/effects", server.url);
    let replies: Vec<Reply> = futures_util::future::join_all((0..32).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { send(&url, Some("\"same\""), Some("alice"), "{}", &[]).await })
    }))
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    let fresh: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "{replies:#?}");
    for r in &replies {
        match r.status {
            409 => assert_eq!(r.headers.get(RETRY_AFTER).unwrap(), "1"),
            201 if r.replayed() => assert_eq!(r.body, fresh[0].body),
            201 => {}
            _ => panic!("unexpected answer {r:?}"),
        }
    }
    assert_eq!(tables.counts().await, (1, 1));
    // Once it completed, the key replays to everyone who retries.
    let late = send(&url, Some("\"same\""), Some("alice"), "{}", &[]).await;
    assert_eq!(late.body, fresh[0].body);
    tables.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_status_paths() {
    status_paths(Tables::new(postgres().await, "pg_paths").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_32_concurrent_requests_one_effect() {
    concurrent(Tables::new(postgres().await, "pg_concurrent").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_status_paths() {
    let pool = sqlite(&temp_db("paths")).await;
    status_paths(Tables::new(pool, "paths").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_32_concurrent_requests_one_effect() {
    let pool = sqlite(&temp_db("concurrent")).await;
    concurrent(Tables::new(pool, "concurrent").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_status_paths() {
    status_paths(Tables::new(mariadb().await, "my_paths").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_32_concurrent_requests_one_effect() {
    concurrent(Tables::new(mariadb().await, "my_concurrent").await).await;
}

// The server process killed between its commit and its response.

const CHILD_SQLITE: &str = "IDEM_HTTP_SQLITE";
const CHILD_NAME: &str = "IDEM_HTTP_NAME";

/// Wraps the layer: a request with `x-die` prints `COMMITTED` once the layer returned its
/// response (the commit is done, nothing is written to the socket yet) and waits to be killed.
async fn die_after_commit(request: Request, next: Next) -> Response {
    let die = request.headers().contains_key("x-die");
    let response = next.run(request).await;
    if die {
        println!("COMMITTED {}", response.status().as_u16());
        std::future::pending::<()>().await;
    }
    response
}

async fn child_serve<DB: Db>(tables: Tables<DB>) {
    let app = Arc::new(App {
        effects: tables.effects.clone(),
        hold: Hold::default(),
        db: std::marker::PhantomData,
    });
    let router = router(&tables, app).layer(from_fn(die_after_commit));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("READY http://{}", listener.local_addr().unwrap());
    tokio::select! {
        served = axum::serve(listener, router).into_future() => served.unwrap(),
        () = stop_signal() => {}
    }
}

/// The server process of the kill tests (`IDEM_BROKER_CHILD` names its database).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a server process that the tests start themselves"]
async fn child_process() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        panic!("child_process is a server process that the tests start with {CHILD_MODE} set")
    };
    let name = child_env(CHILD_NAME);
    match mode.as_str() {
        "postgres" => child_serve(Tables::open(postgres().await, &name)).await,
        "mariadb" => child_serve(Tables::open(mariadb().await, &name)).await,
        "sqlite" => {
            let pool = sqlite(std::path::Path::new(&child_env(CHILD_SQLITE))).await;
            child_serve(Tables::open(pool, &name)).await;
        }
        other => panic!("unknown database {other}"),
    }
}

async fn killed_after_commit<DB: Db>(tables: Tables<DB>, mode: &str, extra: &[(&str, String)]) {
    let mut env = vec![(CHILD_NAME, tables.name.clone())];
    env.extend_from_slice(extra);
    let env = &env[..];
    let mut lines = Lines::new();
    let first = Worker::spawn(0, mode, env, lines.tx.clone());
    let (_, ready) = lines.expect("READY ", 120).await;
    let url = format!("{}/effects", &ready["READY ".len()..]);
    let request = tokio::spawn({
        let url = url.clone();
        async move {
            reqwest::Client::new()
                .post(&url)
                .header("Idempotency-Key", "\"order-7\"")
                .header("x-api-key", "alice")
                .header("x-die", "1")
                .body("{\"order\":7}")
                .send()
                .await
        }
    });
    lines.expect("COMMITTED 201", 60).await;
    // Committed, and not a byte of the response written: the effect and the stored response
    // are in.
    assert_eq!(tables.counts().await, (1, 1));
    assert!(!first.kill().await.success());
    let lost = within(60, "the first request", request).await.unwrap();
    assert!(lost.is_err(), "the killed server answered: {lost:?}");

    // The client retries against the restarted server: the stored response, and one effect.
    let second = Worker::spawn(1, mode, env, lines.tx.clone());
    let (_, ready) = lines.expect("READY ", 120).await;
    let url = format!("{}/effects", &ready["READY ".len()..]);
    let retry = send(
        &url,
        Some("\"order-7\""),
        Some("alice"),
        "{\"order\":7}",
        &[],
    )
    .await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, true),
        "{}",
        retry.text()
    );
    let answer: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    let only = DB::scalar(
        &tables.pool,
        format!("SELECT MAX(id) FROM {}", tables.effects),
    )
    .await;
    assert_eq!(answer["effect"], only);
    assert_eq!(
        retry.header("location"),
        Some(format!("/effects/{only}").as_str())
    );
    assert_eq!(tables.counts().await, (1, 1));
    let mut second = second;
    second.stop().await;
    second.succeed().await;
    tables.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_server_killed_after_commit_the_retry_gets_the_stored_response() {
    let tables = Tables::new(postgres().await, "pg_killed").await;
    killed_after_commit(tables, "postgres", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_server_killed_after_commit_the_retry_gets_the_stored_response() {
    let tables = Tables::new(mariadb().await, "my_killed").await;
    killed_after_commit(tables, "mariadb", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_server_killed_after_commit_the_retry_gets_the_stored_response() {
    let path = temp_db("killed");
    let tables = Tables::new(sqlite(&path).await, "killed").await;
    let env = [(CHILD_SQLITE, path.display().to_string())];
    killed_after_commit(tables, "sqlite", &env).await;
}
