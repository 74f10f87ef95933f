//! The layer's holders and the rest of the claim core: a handler's outbox messages, written
//! with the stored response (transaction mode: in the claimed transaction's commit; lease
//! mode: with the completing statement), and a transaction-mode handler called with the store
//! from a lease-mode handler, which is not nested in anything.

use idem::http::{ClaimedLease, SINGLE_TENANT};
use sqlx::{Pool, Transaction};

use super::*;

struct Sending<DB: Db> {
    pool: Pool<DB>,
    effects: String,
}

fn payload(key: &str) -> serde_json::Value {
    serde_json::json!({ "effect": key })
}

/// Transaction mode: the effect and a message to `q`, both in the claimed transaction; with
/// `x-status: 500`, answered after both.
async fn sends_in_tx<DB: Db>(
    State(app): State<Arc<Sending<DB>>>,
    mut tx: ClaimedTx<DB>,
    headers: HeaderMap,
    key: String,
) -> Response {
    DB::write(tx.conn(), &app.effects, key.clone())
        .await
        .unwrap();
    let id = tx.outbox().send("q", &payload(&key)).unwrap().to_owned();
    if headers.contains_key("x-status") {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the handler failed").into_response();
    }
    (StatusCode::CREATED, id).into_response()
}

/// Lease mode: a message to `q` on the lease's outbox, then the outside effect; with
/// `x-status: 500`, the outside call failed (after the message was sent on the outbox).
async fn sends_in_lease<DB: Db>(
    State(app): State<Arc<Sending<DB>>>,
    mut lease: ClaimedLease<DB>,
    headers: HeaderMap,
    key: String,
) -> Response {
    let id = lease.outbox().send("q", &payload(&key)).unwrap().to_owned();
    if headers.contains_key("x-status") {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the handler failed").into_response();
    }
    let mut conn = app.pool.acquire().await.unwrap();
    DB::write(&mut conn, &app.effects, key.clone())
        .await
        .unwrap();
    (StatusCode::CREATED, id).into_response()
}

/// A request that fails (500) leaves neither its effect nor its message; its retry leaves
/// both, the message under the id of the job's first message; a replay of the retry adds
/// nothing.
async fn outbox_of_a_request<DB: Db>(tables: &Tables<DB>, url: &str, scope: &str, key: &str) {
    let marker = idem::job_id(SINGLE_TENANT, key).unwrap().into_string();
    let id = idem::job_id(scope, &(marker.as_str(), 0u32))
        .unwrap()
        .into_string();
    assert!(!id.contains('\'') && !marker.contains('\''), "SQL literals");
    let outbox = format!("{}_outbox", tables.store.table());
    let count = |sql: String| DB::scalar(&tables.pool, sql);
    let messages = || {
        count(format!(
            "SELECT COUNT(*) FROM {outbox} WHERE scope = '{scope}'"
        ))
    };
    let the_message = || {
        count(format!(
            "SELECT COUNT(*) FROM {outbox} WHERE id = '{id}' AND scope = '{scope}' \
             AND destination = 'q' AND seq = 0"
        ))
    };
    let effects = || {
        count(format!(
            "SELECT COUNT(*) FROM {} WHERE body = '{marker}'",
            tables.effects
        ))
    };
    let header = format!("\"{key}\"");
    let key = Some(header.as_str());

    let failed = send(url, key, None, &marker, &[("x-status", "500")]).await;
    assert_eq!((failed.status, failed.text()), (500, "the handler failed"));
    assert_eq!(
        (effects().await, messages().await),
        (0, 0),
        "{scope}: (effects, messages) after a 500"
    );

    // The caller's trace context reaches the message, with or without the `opentelemetry`
    // feature (these tests build idem without it).
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let sent = send(url, key, None, &marker, &[("traceparent", traceparent)]).await;
    assert_eq!(
        (sent.status, sent.replayed()),
        (201, false),
        "{}",
        sent.text()
    );
    assert_eq!(sent.text(), id, "{scope}: the message's id");
    assert_eq!(
        (effects().await, messages().await, the_message().await),
        (1, 1, 1),
        "{scope}: (effects, messages, the message) after a 201"
    );
    let traced = count(format!(
        "SELECT COUNT(*) FROM {outbox} WHERE id = '{id}' AND headers LIKE \
         '%\"traceparent\":\"{traceparent}\"%'"
    ))
    .await;
    assert_eq!(
        traced, 1,
        "{scope}: the message carries the request's traceparent"
    );

    let again = send(url, key, None, &marker, &[]).await;
    assert_eq!(
        (again.status, again.replayed()),
        (201, true),
        "{}",
        again.text()
    );
    assert_eq!(again.body, sent.body);
    assert_eq!(
        (effects().await, messages().await, the_message().await),
        (1, 1, 1),
        "{scope}: (effects, messages, the message) after the replay"
    );
}

async fn outbox_from_handlers<DB: Db>(tables: Tables<DB>) {
    let app = Arc::new(Sending {
        pool: tables.pool.clone(),
        effects: tables.effects.clone(),
    });
    let lease = idem::LeaseOptions::new(Duration::from_secs(30));
    let router = Router::new()
        .route("/tx", post(sends_in_tx::<DB>))
        .layer(IdempotencyLayer::new(tables.store.clone(), "tests.http.outbox.tx").single_tenant())
        .merge(
            Router::new()
                .route("/lease", post(sends_in_lease::<DB>))
                .layer(
                    IdempotencyLayer::new(tables.store.clone(), "tests.http.outbox.lease")
                        .single_tenant()
                        .lease(lease),
                ),
        )
        .with_state(app);
    let server = serve(router).await;
    let tx_url = format!("{}/tx", server.url);
    within(
        60,
        "transaction mode",
        outbox_of_a_request(&tables, &tx_url, "tests.http.outbox.tx", "m-tx"),
    )
    .await;
    let lease_url = format!("{}/lease", server.url);
    within(
        60,
        "lease mode",
        outbox_of_a_request(&tables, &lease_url, "tests.http.outbox.lease", "m-lease"),
    )
    .await;
    drop(server);
    let outbox = format!("{}_outbox", tables.store.table());
    DB::run(&tables.pool, format!("DROP TABLE IF EXISTS {outbox}")).await;
    tables.drop_all().await;
}

/// Writes `key` into `effects` in a claim of its own (transaction mode, with the store).
#[idem::idempotent(key = "key", scope = "tests.http.lease_inner")]
async fn inner_in_tx<DB: Db>(
    tx: &mut Transaction<'_, DB>,
    key: &str,
    effects: &str,
) -> Result<i64, idem::Error> {
    Ok(DB::write(&mut **tx, effects, key.to_owned()).await?)
}

struct Calling<DB: Db> {
    store: idem::Store<DB>,
    inner_effects: String,
}

/// `POST /outer` behind a lease-mode layer: calls [`inner_in_tx`] with the store; answers 201
/// and its outcome, or 422 and idem's error.
async fn calls_with_the_store<DB: Db>(
    State(app): State<Arc<Calling<DB>>>,
    _lease: ClaimedLease<DB>,
    key: String,
) -> Response {
    match inner_in_tx(&app.store, &key, &app.inner_effects).await {
        Ok(outcome) => (StatusCode::CREATED, format!("{outcome:?}")).into_response(),
        Err(e) => (StatusCode::UNPROCESSABLE_ENTITY, format!("{e:?}")).into_response(),
    }
}

/// Behind the layer in transaction mode, a call with the store is refused as nested
/// (`seams.rs`): the handler runs inside the claimed transaction, and the call's own
/// transaction would commit apart from it (on SQLite, wait behind its write lock). A lease
/// holds no transaction (its marker was committed by the lease statement, and it completes in
/// a statement of its own after the handler), so there is nothing for the call to nest in: it
/// claims and commits on its own, and applies. Its marker is then that call's, as with a job
/// handler in lease mode that calls another handler with the store.
async fn lease_handler_calls_with_the_store<DB: Db>(tables: Tables<DB>) {
    let inner_effects = format!("http_lease_inner_{}", tables.name);
    DB::create(&tables.pool, &inner_effects).await;
    let app = Arc::new(Calling {
        store: tables.store.clone(),
        inner_effects: inner_effects.clone(),
    });
    let lease = idem::LeaseOptions::new(Duration::from_secs(30));
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.lease_outer")
        .single_tenant()
        .lease(lease);
    let router = Router::new()
        .route("/outer", post(calls_with_the_store::<DB>))
        .layer(layer)
        .with_state(app);
    let server = serve(router).await;
    let url = format!("{}/outer", server.url);
    let markers = |scope: &str| {
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE scope = '{scope}' AND state = 'completed'",
            tables.store.table()
        );
        DB::scalar(&tables.pool, sql)
    };
    let rows = || DB::count(&tables.pool, &inner_effects);

    let reply = within(
        60,
        "the request",
        send(&url, Some("\"o1\""), None, "inner-1", &[]),
    )
    .await;
    assert_eq!(
        (reply.status, reply.replayed(), reply.text()),
        (201, false, "Applied(1)"),
        "(status, replayed, the inner call's outcome)"
    );
    let state = (
        markers("tests.http.lease_inner").await,
        markers("tests.http.lease_outer").await,
        rows().await,
    );
    assert_eq!(
        state,
        (1, 1, 1),
        "(inner markers, outer markers, inner rows)"
    );

    // The retry gets the stored response; neither handler runs again.
    let again = within(
        60,
        "the retry",
        send(&url, Some("\"o1\""), None, "inner-1", &[]),
    )
    .await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, reply.body);
    assert_eq!(rows().await, 1, "the inner call ran again");
    drop(server);
    DB::run(&tables.pool, format!("DROP TABLE {inner_effects}")).await;
    tables.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_outbox_messages_of_a_request_are_kept_with_its_response() {
    outbox_from_handlers(Tables::new(postgres().await, "pg_outbox").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_outbox_messages_of_a_request_are_kept_with_its_response() {
    outbox_from_handlers(Tables::new(mariadb().await, "my_outbox").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_outbox_messages_of_a_request_are_kept_with_its_response() {
    let pool = sqlite(&temp_db("outbox")).await;
    outbox_from_handlers(Tables::new(pool, "outbox").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_lease_handler_calling_with_the_store_is_not_nested_and_applies() {
    let tables = Tables::new(postgres().await, "pg_lease_nested").await;
    lease_handler_calls_with_the_store(tables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_lease_handler_calling_with_the_store_is_not_nested_and_applies() {
    let tables = Tables::new(mariadb().await, "my_lease_nested").await;
    lease_handler_calls_with_the_store(tables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_lease_handler_calling_with_the_store_is_not_nested_and_applies() {
    let pool = sqlite(&temp_db("lease_nested")).await;
    lease_handler_calls_with_the_store(Tables::new(pool, "lease_nested").await).await;
}
