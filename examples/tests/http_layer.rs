//! `idem::http::IdempotencyLayer` over real HTTP on loopback, against PostgreSQL, MariaDB and
//! SQLite: every status path, 32 concurrent requests with one key, principals kept apart, bad
//! input that writes nothing, and a server process SIGKILLed between its commit and its
//! response.

mod support;

use std::pin::Pin;
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
use idem::Store;
use idem::http::{ClaimedTx, IdempotencyLayer};
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres, Sqlite};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::Notify;

use support::{CHILD_MODE, Lines, Worker, child_env, stop_signal, within};

type BoxFuture<'a, T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What the tests need of a database besides idem's store: an effects table to write in the
/// claimed transaction, and counts.
trait Db: idem::Backend + sqlx::Database {
    fn create<'a>(pool: &'a Pool<Self>, table: &'a str) -> BoxFuture<'a, ()>;
    fn write<'a>(
        conn: &'a mut Self::Connection,
        table: &'a str,
        body: String,
    ) -> BoxFuture<'a, sqlx::Result<i64>>;
    fn run<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, ()>;
    fn scalar<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, i64>;
    fn count<'a>(pool: &'a Pool<Self>, table: &'a str) -> BoxFuture<'a, i64> {
        Self::scalar(pool, format!("SELECT COUNT(*) FROM {table}"))
    }
}

macro_rules! db {
    ($db:ty, $conn:ty, $id:literal, $ph:literal) => {
        impl Db for $db {
            fn create<'a>(pool: &'a Pool<Self>, table: &'a str) -> BoxFuture<'a, ()> {
                Box::pin(async move {
                    for sql in [
                        format!("DROP TABLE IF EXISTS {table}"),
                        format!("CREATE TABLE {table} (id {}, body TEXT NOT NULL)", $id),
                    ] {
                        sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
                    }
                })
            }
            fn write<'a>(
                conn: &'a mut $conn,
                table: &'a str,
                body: String,
            ) -> BoxFuture<'a, sqlx::Result<i64>> {
                let sql = format!("INSERT INTO {table} (body) VALUES ({}) RETURNING id", $ph);
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(body)
                        .fetch_one(conn)
                        .await
                })
            }
            fn run<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, ()> {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
                })
            }
            fn scalar<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, i64> {
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .fetch_one(pool)
                        .await
                        .unwrap()
                })
            }
        }
    };
}

db!(Postgres, sqlx::PgConnection, "BIGSERIAL PRIMARY KEY", "$1");
db!(Sqlite, sqlx::SqliteConnection, "INTEGER PRIMARY KEY", "?");
db!(
    MySql,
    sqlx::MySqlConnection,
    "BIGINT AUTO_INCREMENT PRIMARY KEY",
    "?"
);

fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

async fn postgres() -> Pool<Postgres> {
    support::postgres(40).await
}

async fn mariadb() -> Pool<MySql> {
    let url = mysql_url();
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(40)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach MariaDB at {url} (IDEM_MYSQL_URL): {e}"))
}

async fn sqlite(path: &std::path::Path) -> Pool<Sqlite> {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap()
}

fn temp_db(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-test-http-{name}-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&dir));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("app.db")
}

/// The test's own tables: markers and effects.
struct Tables<DB: Db> {
    pool: Pool<DB>,
    store: Store<DB>,
    effects: String,
    /// The tables' suffix, with this process's id: runs at once against one server (two
    /// worktrees) never share a table.
    name: String,
}

impl<DB: Db> Tables<DB> {
    async fn new(pool: Pool<DB>, name: &str) -> Self {
        let name = format!("{name}_p{}", std::process::id());
        let markers = format!("http_markers_{name}");
        let effects = format!("http_effects_{name}");
        DB::run(&pool, format!("DROP TABLE IF EXISTS {markers}")).await;
        let store = Store::new(pool.clone()).with_table(&markers).unwrap();
        store.migrate().await.unwrap();
        DB::create(&pool, &effects).await;
        Tables {
            pool,
            store,
            effects,
            name,
        }
    }

    /// Drops the test's tables once it passed.
    async fn drop_all(self) {
        for table in [self.store.table(), &self.effects] {
            DB::run(&self.pool, format!("DROP TABLE IF EXISTS {table}")).await;
        }
    }

    /// (markers, effects)
    async fn counts(&self) -> (i64, i64) {
        (
            DB::count(&self.pool, self.store.table()).await,
            DB::count(&self.pool, &self.effects).await,
        )
    }
}

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
/// controls in headers (outside the fingerprint): `x-hold` holds it after the write, `x-status`
/// answers 500 or 404 instead.
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

impl<DB: Db> Tables<DB> {
    /// The tables the parent test made.
    fn open(pool: Pool<DB>, name: &str) -> Self {
        let store = Store::new(pool.clone())
            .with_table(&format!("http_markers_{name}"))
            .unwrap();
        Tables {
            pool,
            store,
            effects: format!("http_effects_{name}"),
            name: name.to_owned(),
        }
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

// Lease mode: the effect lives in another system (here a counter standing for a payments API
// that deduplicates on the key it is given).

#[derive(Default)]
struct Payments {
    calls: std::sync::Mutex<Vec<String>>,
    hold: Hold,
}

/// `POST /charges`: "charges" by calling the outside system with the lease's idempotency key.
async fn charge<DB: Db>(
    State(payments): State<Arc<Payments>>,
    lease: idem::http::ClaimedLease<DB>,
    headers: HeaderMap,
) -> Response {
    payments
        .calls
        .lock()
        .unwrap()
        .push(lease.idempotency_key().to_owned());
    if headers.contains_key("x-hold") {
        payments.hold.entered.notify_one();
        payments.hold.release.notified().await;
    }
    if headers.contains_key("x-hang") {
        std::future::pending::<()>().await;
    }
    match headers.get("x-status").map(|v| v.as_bytes()) {
        Some(b"502") => (StatusCode::BAD_GATEWAY, "the payments API failed").into_response(),
        _ => {
            let n = RUN.fetch_add(1, Ordering::Relaxed);
            (
                StatusCode::CREATED,
                format!("charge {n}, attempt {}", lease.attempt()),
            )
                .into_response()
        }
    }
}

/// A transaction-mode extractor behind a lease-mode layer.
async fn wrong(_tx: ClaimedTx<DB0>) -> StatusCode {
    StatusCode::OK
}
type DB0 = Sqlite;

async fn lease_paths<DB: Db>(tables: Tables<DB>) {
    let payments = Arc::new(Payments::default());
    let lease = idem::LeaseOptions::new(Duration::from_secs(5)).timeout(Duration::from_millis(300));
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.lease")
        .principal(|parts| {
            parts
                .headers
                .get("x-api-key")?
                .to_str()
                .ok()
                .map(str::to_owned)
        })
        .lease(lease);
    let app = Router::new()
        .route("/charges", post(charge::<DB>))
        .layer(layer)
        .with_state(payments.clone());
    let server = serve(app).await;
    let url = format!("{}/charges", server.url);
    let alice = Some("alice");

    let first = send(&url, Some("\"c1\""), alice, "{}", &[]).await;
    assert_eq!(
        (first.status, first.replayed()),
        (201, false),
        "{}",
        first.text()
    );
    let again = send(&url, Some("\"c1\""), alice, "{}", &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, first.body);
    assert_eq!(
        send(&url, Some("\"c1\""), alice, "{\"x\":1}", &[])
            .await
            .status,
        422
    );
    assert_eq!(payments.calls.lock().unwrap().len(), 1);

    // A request while the lease is held: 409 at once.
    let held = tokio::spawn({
        let url = url.clone();
        async move { send(&url, Some("\"c2\""), alice, "{}", &[("x-hold", "1")]).await }
    });
    payments.hold.entered.notified().await;
    assert_problem(
        &send(&url, Some("\"c2\""), alice, "{}", &[]).await,
        409,
        "still being processed",
    );
    payments.hold.release.notify_one();
    let held = held.await.unwrap();
    assert_eq!(held.status, 201);
    assert_eq!(
        send(&url, Some("\"c2\""), alice, "{}", &[]).await.body,
        held.body
    );

    // A 5xx releases the lease: the retry runs again, with the same idempotency key to pass on.
    assert_eq!(
        send(&url, Some("\"c3\""), alice, "{}", &[("x-status", "502")])
            .await
            .status,
        502
    );
    let retried = send(&url, Some("\"c3\""), alice, "{}", &[]).await;
    assert_eq!((retried.status, retried.replayed()), (201, false));
    // Over the timeout: 504, and the key is free for the retry.
    let hung = send(&url, Some("\"c4\""), alice, "{}", &[("x-hang", "1")]).await;
    assert_problem(&hung, 504, "did not finish within 300 ms");
    assert_eq!(
        send(&url, Some("\"c4\""), alice, "{}", &[]).await.status,
        201
    );
    let calls = payments.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 6, "{calls:?}");
    assert_eq!(
        calls[2], calls[3],
        "a retry passed on another idempotency key"
    );
    assert_eq!(
        calls[4], calls[5],
        "a retry passed on another idempotency key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_lease_mode() {
    lease_paths(Tables::new(postgres().await, "pg_lease").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_lease_mode_and_the_wrong_extractor() {
    let tables = Tables::new(sqlite(&temp_db("lease")).await, "lease").await;
    let lease = idem::LeaseOptions::new(Duration::from_secs(5));
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.wrong")
        .single_tenant()
        .lease(lease);
    let server = serve(Router::new().route("/wrong", post(wrong)).layer(layer)).await;
    let r = send(
        &format!("{}/wrong", server.url),
        Some("\"w\""),
        None,
        "",
        &[],
    )
    .await;
    assert_problem(&r, 500, "extract `ClaimedLease`");
    lease_paths(tables).await;
}
