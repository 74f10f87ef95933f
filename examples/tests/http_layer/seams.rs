//! Where the layer meets the rest of idem: a lease handler that renews its lease, a handler
//! that calls an idempotent handler with the store, and the answer to a database failure.

use std::time::Instant;

use idem::http::ClaimedLease;
use sqlx::{Pool, Transaction};

use super::*;

/// Counts the handler's runs: each is one call to the outside system.
#[derive(Default)]
struct Outside {
    calls: AtomicU64,
}

/// `POST /long`: one outside call that takes longer than the 2 s lease; it renews the lease
/// every 500 ms until more than 2.5 s have passed and two renewals went through.
async fn long_call<DB: Db>(
    State(outside): State<Arc<Outside>>,
    lease: ClaimedLease<DB>,
) -> Response {
    let started = Instant::now();
    outside.calls.fetch_add(1, Ordering::SeqCst);
    let mut renewals = 0;
    loop {
        if let Err(e) = lease.renew().await {
            let why = format!("renewal {} failed: {e}", renewals + 1);
            return (StatusCode::INTERNAL_SERVER_ERROR, why).into_response();
        }
        renewals += 1;
        if renewals >= 2 && started.elapsed() > Duration::from_millis(2500) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let answer = format!("charged once, renewed {renewals} times");
    (StatusCode::CREATED, answer).into_response()
}

/// A handler that renews its lease runs past the layer's timeout (1.6 s of a 2 s lease), and
/// its response is stored and replayed.
async fn renewing_handler<DB: Db>(tables: Tables<DB>) {
    let outside = Arc::new(Outside::default());
    let lease = idem::LeaseOptions::new(Duration::from_secs(2));
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.renew")
        .single_tenant()
        .lease(lease);
    let app = Router::new()
        .route("/long", post(long_call::<DB>))
        .layer(layer)
        .with_state(outside.clone());
    let server = serve(app).await;
    let url = format!("{}/long", server.url);
    let first = within(
        60,
        "the renewing request",
        send(&url, Some("\"r1\""), None, "", &[]),
    )
    .await;
    let calls = outside.calls.load(Ordering::SeqCst);
    assert_eq!(
        (first.status, first.replayed(), calls),
        (201, false, 1),
        "(status, replayed, outside calls): {}",
        first.text()
    );
    let again = within(60, "the retry", send(&url, Some("\"r1\""), None, "", &[])).await;
    let calls = outside.calls.load(Ordering::SeqCst);
    assert_eq!(
        (again.status, again.replayed(), calls),
        (201, true, 1),
        "(status, replayed, outside calls) of the retry: {}",
        again.text()
    );
    assert_eq!(again.body, first.body);
    tables.drop_all().await;
}

/// Writes `key` into `effects` in its own claim.
#[idem::idempotent(key = "key", scope = "tests.http.inner")]
async fn inner<DB: Db>(
    tx: &mut Transaction<'_, DB>,
    key: &str,
    effects: &str,
) -> Result<i64, idem::Error> {
    Ok(DB::write(&mut **tx, effects, key.to_owned()).await?)
}

struct Nesting<DB: Db> {
    store: idem::Store<DB>,
    effects: String,
    inner_effects: String,
}

/// `POST /outer`: writes its row in the claimed transaction, then calls [`inner`] with the
/// store; answers 201 and the outcome, or 422 and the kind of idem's error.
async fn outer<DB: Db>(State(app): State<Arc<Nesting<DB>>>, mut tx: ClaimedTx<DB>) -> Response {
    if let Err(e) = DB::write(tx.conn(), &app.effects, "outer".into()).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
    }
    match inner(&app.store, "inner-1", &app.inner_effects).await {
        Ok(outcome) => (StatusCode::CREATED, format!("{outcome:?}")).into_response(),
        Err(e) => {
            let debug = format!("{e:?}");
            // The variant, and the family's variant it holds: `Refused::Nested`.
            let kind: Vec<&str> = debug
                .split(|c: char| !c.is_alphanumeric())
                .take_while(|word| !word.is_empty())
                .collect();
            (StatusCode::UNPROCESSABLE_ENTITY, kind.join("::")).into_response()
        }
    }
}

/// An idempotent handler called with the store behind the layer would claim in a transaction
/// apart from the layer's (SQLite: behind its write lock): refused at once, nothing written.
async fn nested_call<DB: Db>(tables: Tables<DB>) {
    let inner_effects = format!("http_inner_{}", tables.name);
    DB::create(&tables.pool, &inner_effects).await;
    let app = Arc::new(Nesting {
        store: tables.store.clone(),
        effects: tables.effects.clone(),
        inner_effects: inner_effects.clone(),
    });
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.outer").single_tenant();
    let server = serve(
        Router::new()
            .route("/outer", post(outer::<DB>))
            .layer(layer)
            .with_state(app),
    )
    .await;
    let url = format!("{}/outer", server.url);
    let reply = within(
        60,
        "a request nesting a call",
        send(&url, Some("\"n1\""), None, "", &[]),
    )
    .await;
    let inner_markers = DB::scalar(
        &tables.pool,
        format!(
            "SELECT COUNT(*) FROM {} WHERE scope = 'tests.http.inner'",
            tables.store.table()
        ),
    )
    .await;
    let inner_rows = DB::count(&tables.pool, &inner_effects).await;
    assert_eq!(
        (reply.status, reply.text(), inner_markers, inner_rows),
        (422, "Refused::Nested", 0, 0),
        "(status, answer, the inner's markers, the inner's rows)"
    );
    DB::run(&tables.pool, format!("DROP TABLE {inner_effects}")).await;
    tables.drop_all().await;
}

/// What a database says of a missing table, which belongs in the server's logs, not in a
/// client's answer.
const DATABASE_TEXT: [&str; 5] = [
    "no such table",
    "does not exist",
    "doesn't exist",
    "relation",
    "error returned from database",
];

fn assert_no_database_text(reply: &Reply, table: &str, what: &str) {
    assert_eq!(
        (reply.status, reply.header("content-type")),
        (500, Some("application/problem+json")),
        "{what}: {}",
        reply.text()
    );
    let body = reply.text().to_lowercase();
    let leaked: Vec<&str> = std::iter::once(table)
        .chain(DATABASE_TEXT)
        .filter(|text| body.contains(&text.to_lowercase()))
        .collect();
    assert!(
        leaked.is_empty(),
        "{what} says {leaked:?}: {}",
        reply.text()
    );
}

async fn counted_tx<DB: Db>(State(runs): State<Arc<AtomicU64>>, _tx: ClaimedTx<DB>) -> StatusCode {
    runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::CREATED
}

async fn counted_lease<DB: Db>(
    State(runs): State<Arc<AtomicU64>>,
    _lease: ClaimedLease<DB>,
) -> StatusCode {
    runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::CREATED
}

/// A claim that fails in the database (its marker table was never made) is a 500 whose body
/// names neither the table nor anything the database said, in both modes.
async fn database_failure<DB: Db>(pool: Pool<DB>) {
    let table = format!("http_never_made_p{}", std::process::id());
    let store = idem::Store::new(pool).with_table(&table).unwrap();
    let runs = Arc::new(AtomicU64::new(0));
    let lease = idem::LeaseOptions::new(Duration::from_secs(5));
    let app = Router::new()
        .route("/tx", post(counted_tx::<DB>))
        .layer(IdempotencyLayer::new(store.clone(), "tests.http.broken").single_tenant())
        .merge(
            Router::new()
                .route("/lease", post(counted_lease::<DB>))
                .layer(
                    IdempotencyLayer::new(store, "tests.http.broken")
                        .single_tenant()
                        .lease(lease),
                ),
        )
        .with_state(runs.clone());
    let server = serve(app).await;
    for path in ["tx", "lease"] {
        let url = format!("{}/{path}", server.url);
        let reply = within(60, "a request", send(&url, Some("\"b1\""), None, "", &[])).await;
        assert_no_database_text(&reply, &table, &format!("the 500 of /{path}"));
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "a handler ran without a claim"
    );
}

struct Dropping<DB: Db> {
    pool: Pool<DB>,
    markers: String,
}

/// `POST /dropping`: drops the marker table under its own lease, so that completing it fails.
async fn drops_the_markers<DB: Db>(
    State(app): State<Arc<Dropping<DB>>>,
    _lease: ClaimedLease<DB>,
) -> StatusCode {
    DB::run(&app.pool, format!("DROP TABLE {}", app.markers)).await;
    StatusCode::CREATED
}

/// The statement that stores the handler's response fails in the database: the 500 names
/// neither the table nor anything the database said.
async fn failure_after_the_handler<DB: Db>(tables: Tables<DB>) {
    let markers = tables.store.table().to_owned();
    let app = Arc::new(Dropping {
        pool: tables.pool.clone(),
        markers: markers.clone(),
    });
    let lease = idem::LeaseOptions::new(Duration::from_secs(5));
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.dropped")
        .single_tenant()
        .lease(lease);
    let app = Router::new()
        .route("/dropping", post(drops_the_markers::<DB>))
        .layer(layer)
        .with_state(app);
    let server = serve(app).await;
    let url = format!("{}/dropping", server.url);
    let reply = within(60, "a request", send(&url, Some("\"d1\""), None, "", &[])).await;
    assert_no_database_text(&reply, &markers, "the 500 of a failed completion");
    tables.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_lease_handler_that_renews_outlives_the_timeout_and_is_replayed() {
    renewing_handler(Tables::new(postgres().await, "pg_renew").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_lease_handler_that_renews_outlives_the_timeout_and_is_replayed() {
    renewing_handler(Tables::new(mariadb().await, "my_renew").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_lease_handler_that_renews_outlives_the_timeout_and_is_replayed() {
    let pool = sqlite(&temp_db("renew")).await;
    renewing_handler(Tables::new(pool, "renew").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_handler_called_with_the_store_behind_the_layer_is_refused_as_nested() {
    nested_call(Tables::new(postgres().await, "pg_nested").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_handler_called_with_the_store_behind_the_layer_is_refused_as_nested() {
    nested_call(Tables::new(mariadb().await, "my_nested").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_handler_called_with_the_store_behind_the_layer_is_refused_as_nested() {
    let pool = sqlite(&temp_db("nested")).await;
    nested_call(Tables::new(pool, "nested").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_database_failure_answers_500_without_the_databases_text() {
    database_failure(postgres().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_database_failure_answers_500_without_the_databases_text() {
    database_failure(mariadb().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_database_failure_answers_500_without_the_databases_text() {
    database_failure(sqlite(&temp_db("broken")).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_failure_to_store_the_response_answers_500_without_the_databases_text() {
    failure_after_the_handler(Tables::new(postgres().await, "pg_dropped").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_failure_to_store_the_response_answers_500_without_the_databases_text() {
    failure_after_the_handler(Tables::new(mariadb().await, "my_dropped").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_failure_to_store_the_response_answers_500_without_the_databases_text() {
    let pool = sqlite(&temp_db("dropped")).await;
    failure_after_the_handler(Tables::new(pool, "dropped").await).await;
}
