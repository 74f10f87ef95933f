//! `--http`: requests per second through `idem::http::IdempotencyLayer` against the same axum
//! handler claiming by hand (`Store::claim_with` in the handler, the response stored with
//! `Guard::finish_replay`), in one run, on PostgreSQL and SQLite; fresh keys and replayed ones.
//!
//! Both servers run in this process on loopback; the client is reqwest, `WORKERS` tasks each
//! sending one request after another. Each round runs every variant once, every other round in
//! reverse order; the report gives each variant's median and the ratio layer / hand-written.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::http::{ClaimedTx, IdempotencyLayer};
use idem::{Backend, ClaimOptions, Claimed, Fingerprint, Key, Store};
use sqlx::{AssertSqlSafe, Pool, Postgres, Sqlite};

use crate::Res;
use crate::config::config;

const WORKERS: usize = 8;
const ACCOUNTS: i64 = 1_000;
const SCOPE: &str = "bench.http";

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
type Effect<DB> = for<'a> fn(
    &'a mut <DB as sqlx::Database>::Connection,
    &'a str,
    i64,
) -> BoxFuture<'a, sqlx::Result<()>>;

struct App<DB: Backend + sqlx::Database> {
    store: Store<DB>,
    accounts: String,
    effect: Effect<DB>,
}

fn account(body: &[u8]) -> i64 {
    std::str::from_utf8(body)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or(1)
        % ACCOUNTS
        + 1
}

fn receipt(account: i64) -> String {
    format!("{{\"account\":{account},\"credited\":1}}")
}

/// The handler under the layer.
async fn layered<DB: Backend + sqlx::Database>(
    State(app): State<Arc<App<DB>>>,
    mut tx: ClaimedTx<DB>,
    body: Bytes,
) -> Response {
    let account = account(&body);
    match (app.effect)(tx.conn(), &app.accounts, account).await {
        Ok(()) => ([("content-type", "application/json")], receipt(account)).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The same handler with the claim written in it.
async fn by_hand<DB: Backend + sqlx::Database>(
    State(app): State<Arc<App<DB>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let failed =
        |e: idem::Error| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|k| k.trim_matches('"').to_owned())
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Ok(key) = Key::new(&key) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let fingerprint = match Fingerprint::of(&body[..]) {
        Ok(f) => f,
        Err(e) => return failed(e),
    };
    let options = ClaimOptions::new()
        .replay()
        .wait(Duration::from_secs(1))
        .fingerprint(fingerprint);
    match app.store.claim_with(SCOPE, &key, options).await {
        Ok(Claimed::Fresh(mut guard)) => {
            let account = account(&body);
            let done = (app.effect)(&mut **guard.tx(), &app.accounts, account).await;
            let body = receipt(account);
            let end = done.map_err(idem::Error::from).map(|()| body.clone());
            match guard.finish_replay(end).await {
                Ok(_) => ([("content-type", "application/json")], body).into_response(),
                Err(e) => failed(e),
            }
        }
        Ok(Claimed::Replayed(recorded)) => {
            let stored: String = recorded.decode().ok().flatten().unwrap_or_default();
            (
                [
                    ("content-type", "application/json"),
                    ("idempotent-replayed", "true"),
                ],
                stored,
            )
                .into_response()
        }
        Ok(Claimed::Duplicate | Claimed::Failed(_)) => StatusCode::CONFLICT.into_response(),
        Err(idem::Error::InProgress { .. }) => StatusCode::CONFLICT.into_response(),
        Err(idem::Error::KeyReused { .. }) => StatusCode::UNPROCESSABLE_ENTITY.into_response(),
        Err(e) => failed(e),
    }
}

fn pg_effect<'a>(
    conn: &'a mut sqlx::PgConnection,
    table: &'a str,
    account: i64,
) -> BoxFuture<'a, sqlx::Result<()>> {
    let sql = format!("UPDATE {table} SET credits = credits + 1 WHERE id = $1");
    Box::pin(async move {
        sqlx::query(AssertSqlSafe(sql))
            .bind(account)
            .execute(conn)
            .await?;
        Ok(())
    })
}

fn lite_effect<'a>(
    conn: &'a mut sqlx::SqliteConnection,
    table: &'a str,
    account: i64,
) -> BoxFuture<'a, sqlx::Result<()>> {
    let sql = format!("UPDATE {table} SET credits = credits + 1 WHERE id = ?1");
    Box::pin(async move {
        sqlx::query(AssertSqlSafe(sql))
            .bind(account)
            .execute(conn)
            .await?;
        Ok(())
    })
}

struct Servers {
    layer: String,
    hand: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn serve(app: Router) -> Res<(String, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/top_up", listener.local_addr()?);
    let task = tokio::spawn(async move {
        drop(axum::serve(listener, app).await);
    });
    Ok((url, task))
}

async fn servers<DB: Backend + sqlx::Database>(pool: Pool<DB>, effect: Effect<DB>) -> Res<Servers> {
    let cfg = config();
    let layer_store = Store::new(pool.clone()).with_table(&cfg.http_layer)?;
    let hand_store = Store::new(pool).with_table(&cfg.http_hand)?;
    layer_store.migrate().await?;
    hand_store.migrate().await?;
    let layer_app = Arc::new(App {
        store: layer_store.clone(),
        accounts: cfg.http_accounts.clone(),
        effect,
    });
    let hand_app = Arc::new(App {
        store: hand_store,
        accounts: cfg.http_accounts.clone(),
        effect,
    });
    let layer = IdempotencyLayer::new(layer_store, SCOPE).single_tenant();
    let (layer_url, a) = serve(
        Router::new()
            .route("/top_up", post(layered::<DB>))
            .layer(layer)
            .with_state(layer_app),
    )
    .await?;
    let (hand_url, b) = serve(
        Router::new()
            .route("/top_up", post(by_hand::<DB>))
            .with_state(hand_app),
    )
    .await?;
    Ok(Servers {
        layer: layer_url,
        hand: hand_url,
        tasks: vec![a, b],
    })
}

/// Sends requests from `WORKERS` tasks for `run`; fresh keys (`next` counts them) or the keys
/// `0..replay` again. Returns requests per second.
async fn load(url: &str, run: Duration, fresh: Option<&Arc<AtomicU64>>, replay: u64) -> Res<f64> {
    let client = reqwest::Client::new();
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WORKERS as u64 {
        let (client, url, done) = (client.clone(), url.to_owned(), done.clone());
        let fresh = fresh.cloned();
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while started.elapsed() < run && i < 10_000_000 {
                let n = match &fresh {
                    Some(next) => next.fetch_add(1, Ordering::Relaxed),
                    None => i % replay,
                };
                // A 409 is a client's cue to retry (on SQLite: the write lock's wait ran out).
                for attempt in 0.. {
                    let response = client
                        .post(&url)
                        .header("idempotency-key", format!("\"k{n}\""))
                        .body(n.to_string())
                        .send()
                        .await?;
                    let status = response.status();
                    response.bytes().await?;
                    if status.is_success() {
                        break;
                    }
                    if status != reqwest::StatusCode::CONFLICT || attempt == 100 {
                        return Err(format!("{url}: {status}").into());
                    }
                    BUSY.fetch_add(1, Ordering::Relaxed);
                }
                done.fetch_add(1, Ordering::Relaxed);
                i += WORKERS as u64;
            }
            Ok::<_, BoxErr>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// 409s answered (and retried) during the run.
static BUSY: AtomicU64 = AtomicU64::new(0);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One database: (layer fresh, hand fresh, layer replayed, hand replayed) medians.
async fn measure(servers: &Servers, rounds: usize, run: Duration) -> Res<[f64; 4]> {
    let (layer_next, hand_next) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // Warm-up, which also completes the keys the replay rounds send again.
    load(&servers.layer, run / 2, Some(&layer_next), 0).await?;
    load(&servers.hand, run / 2, Some(&hand_next), 0).await?;
    let replay = layer_next
        .load(Ordering::Relaxed)
        .min(hand_next.load(Ordering::Relaxed));
    let mut got: [Vec<f64>; 4] = Default::default();
    for round in 0..rounds {
        let mut order = [0, 1, 2, 3];
        if round % 2 == 1 {
            order.reverse();
        }
        for v in order {
            let rate = match v {
                0 => load(&servers.layer, run, Some(&layer_next), 0).await?,
                1 => load(&servers.hand, run, Some(&hand_next), 0).await?,
                2 => load(&servers.layer, run, None, replay).await?,
                _ => load(&servers.hand, run, None, replay).await?,
            };
            got[v].push(rate);
        }
    }
    Ok(got.map(median))
}

/// `--http [--quick]`: the report on stdout.
pub(crate) async fn run(quick: bool) -> Res<()> {
    let cfg = config();
    let (rounds, run) = if quick {
        (3, Duration::from_millis(300))
    } else {
        (7, Duration::from_secs(2))
    };
    let mut rows = Vec::new();

    let pg = sqlx::postgres::PgPoolOptions::new()
        .max_connections(WORKERS as u32 + 1)
        .test_before_acquire(false)
        .connect(&cfg.pg_url)
        .await?;
    let tables = format!(
        "{}, {}, {}",
        cfg.http_accounts, cfg.http_layer, cfg.http_hand
    );
    for sql in [
        format!("DROP TABLE IF EXISTS {tables}"),
        format!(
            "CREATE TABLE {} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL)",
            cfg.http_accounts
        ),
        format!(
            "INSERT INTO {} SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g",
            cfg.http_accounts
        ),
    ] {
        sqlx::query(AssertSqlSafe(sql)).execute(&pg).await?;
    }
    eprintln!("http: PostgreSQL");
    let s = servers::<Postgres>(pg.clone(), pg_effect).await?;
    rows.push((
        "PostgreSQL",
        measure(&s, rounds, run).await?,
        BUSY.swap(0, Ordering::Relaxed),
    ));
    s.tasks.iter().for_each(tokio::task::JoinHandle::abort);
    sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {tables}")))
        .execute(&pg)
        .await?;

    let dir = std::env::temp_dir().join(format!("idem-bench-http-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let lite = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(WORKERS as u32 + 1)
        .connect_with(crate::measure::sqlite_options(&dir.join("bench.db")))
        .await?;
    for sql in [
        format!(
            "CREATE TABLE {} (id INTEGER PRIMARY KEY, credits INTEGER NOT NULL)",
            cfg.http_accounts
        ),
        format!(
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {ACCOUNTS}) \
             INSERT INTO {} SELECT n, 0 FROM g",
            cfg.http_accounts
        ),
    ] {
        sqlx::query(AssertSqlSafe(sql)).execute(&lite).await?;
    }
    eprintln!("http: SQLite");
    let s = servers::<Sqlite>(lite.clone(), lite_effect).await?;
    rows.push((
        "SQLite",
        measure(&s, rounds, run).await?,
        BUSY.swap(0, Ordering::Relaxed),
    ));
    s.tasks.iter().for_each(tokio::task::JoinHandle::abort);
    lite.close().await;
    drop(std::fs::remove_dir_all(&dir));

    println!(
        "## HTTP: requests/s through the layer against a hand-written claim ({WORKERS} clients)\n"
    );
    println!(
        "| database | layer fresh | hand fresh | ratio | layer replayed | hand replayed | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (db, [lf, hf, lr, hr], _) in &rows {
        println!(
            "| {db} | {lf:.0} | {hf:.0} | {:.2} | {lr:.0} | {hr:.0} | {:.2} |",
            lf / hf,
            lr / hr
        );
    }
    for (db, _, busy) in &rows {
        println!("\n{db}: {busy} answers were 409 and retried (both variants together)");
    }
    Ok(())
}
