//! A run interrupted: a client that hangs up while its handler runs does not stop the handler
//! halfway (it finishes and commits, and the retry gets the stored response, without running
//! the handler again); a handler that panics keeps nothing, and the retry runs it again.

use super::*;

async fn client_hangs_up_mid_handler<DB: Db>(tables: Tables<DB>) {
    let app = Arc::new(App {
        effects: tables.effects.clone(),
        hold: Hold::default(),
        db: std::marker::PhantomData,
    });
    let server = serve(router(&tables, app.clone())).await;
    let url = format!("{}/effects", server.url);
    let alice = Some("alice");

    let client = tokio::spawn({
        let url = url.clone();
        async move { send(&url, Some("\"gone\""), alice, "{}", &[("x-hold", "1")]).await }
    });
    // The handler has written its row in the claimed transaction; the client goes away.
    app.hold.entered.notified().await;
    client.abort();
    assert!(client.await.unwrap_err().is_cancelled());
    // The server sees the connection close while the handler waits; then the handler
    // goes on.
    app.hold.release.notify_one();

    // Until the handler's commit, the key is in progress (409); then the replay.
    let retry = within(60, "the hung-up request's commit", async {
        loop {
            let reply = send(&url, Some("\"gone\""), alice, "{}", &[]).await;
            if reply.status != 409 {
                return reply;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.replayed(), "the first run's response, not a new run");
    assert_eq!(tables.counts().await, (1, 1));
    drop(server);
    tables.drop_all().await;
}

async fn handler_panics<DB: Db>(tables: Tables<DB>) {
    let app = Arc::new(App {
        effects: tables.effects.clone(),
        hold: Hold::default(),
        db: std::marker::PhantomData,
    });
    let server = serve(router(&tables, app)).await;
    let url = format!("{}/effects", server.url);
    let alice = Some("alice");
    let panicked = send(&url, Some("\"boom\""), alice, "{}", &[("x-panic", "1")]).await;
    assert_problem(&panicked, 500, "the handler panicked");
    assert_eq!(
        tables.counts().await,
        (0, 0),
        "its write rolled back, no marker"
    );
    let retry = send(&url, Some("\"boom\""), alice, "{}", &[]).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, false),
        "{}",
        retry.text()
    );
    assert_eq!(tables.counts().await, (1, 1));
    drop(server);
    tables.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_handler_panics_nothing_is_kept_and_the_retry_runs() {
    handler_panics(Tables::new(postgres().await, "pg_panics").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_handler_panics_nothing_is_kept_and_the_retry_runs() {
    let pool = sqlite(&temp_db("panics")).await;
    handler_panics(Tables::new(pool, "panics").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_handler_panics_nothing_is_kept_and_the_retry_runs() {
    handler_panics(Tables::new(mariadb().await, "my_panics").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_client_hangs_up_mid_handler_the_retry_gets_the_stored_response() {
    client_hangs_up_mid_handler(Tables::new(postgres().await, "pg_hangup").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_client_hangs_up_mid_handler_the_retry_gets_the_stored_response() {
    let pool = sqlite(&temp_db("hangup")).await;
    client_hangs_up_mid_handler(Tables::new(pool, "hangup").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_client_hangs_up_mid_handler_the_retry_gets_the_stored_response() {
    client_hangs_up_mid_handler(Tables::new(mariadb().await, "my_hangup").await).await;
}
