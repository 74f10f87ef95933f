//! `Lease::send` end to end (feature `reqwest`): a lease handler on SQLite calls a server on
//! loopback that answers as it is told, and each class of failure does what its table says to
//! the key: a 402 fails the job for good, a 503 releases it for a retry with the same key, a
//! timeout keeps the lease, a refused connection releases it.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use idem::{Error, Outcome, Store};
use sqlx::Sqlite;
use tokio::sync::Notify;

/// What the server does with one request.
#[derive(Clone, Copy)]
enum Answer {
    Status(u16, &'static str),
    /// Answers 200 only once the test lets it ([`Server::unstall`]).
    Stall,
}

#[derive(Default)]
struct Shared {
    script: Mutex<VecDeque<Answer>>,
    /// The `Idempotency-Key` header of each request, in the order they came.
    keys: Mutex<Vec<Option<String>>>,
    unstall: Notify,
}

struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Server {
    /// A server that answers its requests with `script` in turn, then 200 `applied`.
    async fn start(script: &[Answer]) -> Server {
        let shared = Arc::new(Shared::default());
        shared.script.lock().unwrap().extend(script);
        let app = axum::Router::new()
            .route("/charges", post(answer))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Server { addr, shared }
    }

    fn keys(&self) -> Vec<Option<String>> {
        self.shared.keys.lock().unwrap().clone()
    }

    fn unstall(&self) {
        self.shared.unstall.notify_one();
    }
}

async fn answer(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> (StatusCode, String) {
    let key = headers
        .get("Idempotency-Key")
        .map(|v| v.to_str().unwrap().to_owned());
    shared.keys.lock().unwrap().push(key);
    let next = shared.script.lock().unwrap().pop_front();
    match next {
        Some(Answer::Status(code, body)) => (StatusCode::from_u16(code).unwrap(), body.to_owned()),
        Some(Answer::Stall) => {
            shared.unstall.notified().await;
            (StatusCode::OK, "applied late".to_owned())
        }
        None => (StatusCode::OK, "applied".to_owned()),
    }
}

struct Job {
    id: String,
}

struct Target {
    http: idem::reqwest::Client,
    url: String,
}

#[derive(Debug)]
enum CallError {
    Http(idem::reqwest::Error),
    Idem(Error),
}

impl From<idem::reqwest::Error> for CallError {
    fn from(e: idem::reqwest::Error) -> Self {
        CallError::Http(e)
    }
}

impl From<Error> for CallError {
    fn from(e: Error) -> Self {
        CallError::Idem(e)
    }
}

/// One step that calls the server through `Lease::send`. A 2 s lease: the body has 1.6 s, so
/// a stalled answer times out soon.
#[idem::idempotent(key = "job.id", scope = "test.outside", lease = "2s")]
async fn call(lease: &idem::Lease, job: &Job, target: &Target) -> Result<String, CallError> {
    let answer: String = lease
        .step("charge", async |step| {
            let request = step.request(target.http.post(&target.url)).body("4200");
            Ok::<_, CallError>(lease.send(request).await??.text().await?)
        })
        .await?;
    Ok(answer)
}

async fn store() -> (Store<Sqlite>, tempdir::Dir) {
    let dir = tempdir::Dir::new();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.0.join("jobs.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .connect_with(options)
        .await
        .unwrap();
    let store = Store::new(pool);
    store.migrate().await.unwrap();
    (store, dir)
}

mod tempdir {
    /// A directory of its own for each test's database, removed at the end.
    pub struct Dir(pub std::path::PathBuf);

    impl Dir {
        pub fn new() -> Dir {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("idem-test-outside-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            drop(std::fs::remove_dir_all(&self.0));
        }
    }
}

fn target(url: String) -> Target {
    Target {
        http: idem::reqwest::Client::new(),
        url,
    }
}

fn job() -> Job {
    Job {
        id: "order-7".into(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_402_fails_the_job_for_good_and_its_redelivery_calls_no_one() {
    let (store, _dir) = store().await;
    let server = Server::start(&[Answer::Status(402, "insufficient\n funds")]).await;
    let target = target(format!("http://{}/charges", server.addr));
    for delivery in 1..=2 {
        let Ok(Outcome::Failed(failure)) = call(&store, &job(), &target).await else {
            panic!("delivery {delivery}: expected Failed");
        };
        assert_eq!(
            failure.error(),
            "402 Payment Required from /charges: insufficient funds"
        );
    }
    assert_eq!(server.keys().len(), 1, "the redelivery called the server");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_503_releases_the_key_and_the_redelivery_sends_the_same_key() {
    let (store, _dir) = store().await;
    let server = Server::start(&[Answer::Status(503, "busy")]).await;
    let target = target(format!("http://{}/charges", server.addr));
    match call(&store, &job(), &target).await {
        Err(CallError::Http(e)) => assert_eq!(e.status().map(|s| s.as_u16()), Some(503)),
        other => panic!("expected the 503, got {other:?}"),
    }
    match call(&store, &job(), &target).await {
        Ok(Outcome::Applied(answer)) => assert_eq!(answer, "applied"),
        other => panic!("expected Applied, got {other:?}"),
    }
    let keys = server.keys();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);
    assert_eq!(
        keys[0].as_deref(),
        Some("12:test.outside|7:order-7|6:charge")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_keeps_the_lease_so_a_redelivery_right_after_is_in_progress() {
    let (store, _dir) = store().await;
    let server = Server::start(&[Answer::Stall]).await;
    let target = target(format!("http://{}/charges", server.addr));
    match call(&store, &job(), &target).await {
        Err(CallError::Http(e)) => assert!(e.is_timeout(), "{e}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    // The request may have been done: the lease is kept, not released.
    match call(&store, &job(), &target).await {
        Err(CallError::Idem(Error::InProgress { .. })) => {}
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert_eq!(server.keys().len(), 1);
    server.unstall();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_connection_releases_the_key_and_the_redelivery_runs_again() {
    let (store, _dir) = store().await;
    // A port that was free a moment ago and that nothing listens on now.
    let free = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/charges", free.local_addr().unwrap());
    drop(free);
    let target = target(url);
    for delivery in 1..=2 {
        match call(&store, &job(), &target).await {
            Err(CallError::Http(e)) => assert!(e.is_connect(), "delivery {delivery}: {e}"),
            other => panic!("delivery {delivery}: expected a refused connection, got {other:?}"),
        }
    }
    let marker = store.inspect("test.outside", "order-7").await.unwrap();
    let marker = marker.expect("the marker stays, released");
    assert_eq!(marker.attempts, 2, "{marker:?}");
}
