//! The conformance suite on MySQL / MariaDB (`IDEM_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`).

mod conformance;

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{Connection as _, MySql, MySqlConnection};

struct My;

/// Sessions in the middle of a claim `INSERT` (a batch's is `INSERT IGNORE`) into the marker
/// table named `?`.
const CLAIMS_RUNNING: &str = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
     WHERE INFO LIKE CONCAT('INSERT %INTO ', $1, ' %')";

const URL_VAR: &str = "IDEM_MYSQL_URL";

impl conformance::Support for My {
    type Db = MySql;
    // The marker table stores keys as bytes (`VARBINARY`); read them back as UTF-8 text.
    const KEY_TEXT: &'static str = "CONVERT(`key` USING utf8mb4)";
    const BIGINT: &'static str = "SIGNED";
    const TWO_HOURS_AGO: &'static str = "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR";

    fn url() -> String {
        conformance::server_url(URL_VAR, "mysql://root@127.0.0.1:3306/test")
    }

    async fn connect(url: &str, max: u32) -> MySqlPool {
        let opts: MySqlConnectOptions = url
            .parse()
            .unwrap_or_else(|e| conformance::unreachable("MySQL", url, URL_VAR, &e));
        // One direct connection first: the pool would retry a refused connection until its
        // acquire timeout instead of failing at once.
        match tokio::time::timeout(
            Duration::from_secs(10),
            MySqlConnection::connect_with(&opts),
        )
        .await
        {
            Ok(Ok(conn)) => drop(conn.close().await),
            Ok(Err(e)) => conformance::unreachable("MySQL", url, URL_VAR, &e),
            Err(e) => conformance::unreachable("MySQL", url, URL_VAR, &e),
        }
        MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_lazy_with(opts)
    }

    // A claim queued behind the key is a session still executing its claim `INSERT` while the
    // holder is parked (it cannot finish before the holder does). MariaDB's InnoDB views
    // (`INNODB_TRX` in `LOCK WAIT`, `INNODB_LOCK_WAITS`) were tried first: in full runs they
    // listed 24 of 31 waiters for minutes while the process list showed all 31 in the INSERT.
    const LOCK_WAITERS: Option<&'static str> = Some(CLAIMS_RUNNING);
    const STATEMENT_AFTER_ROLLBACK_KEPT: bool = true;
    const WAIT_RESTORED: Option<(&'static str, &'static str)> = Some((
        "SELECT CAST(CONNECTION_ID() AS SIGNED)",
        "SELECT CAST(@@SESSION.innodb_lock_wait_timeout = @@GLOBAL.innodb_lock_wait_timeout \
         AS SIGNED)",
    ));

    async fn swallow_a_rollback(conn: &mut MySqlConnection, other: &MySqlPool, rows: &str) {
        deadlock_as_victim(conn, other, rows).await;
    }
}

impl conformance::Server for My {
    const URL_VAR: &'static str = URL_VAR;
    const UNREACHABLE_URL: &'static str = "mysql://root@127.0.0.1:1/test";

    async fn connection_id(conn: &mut MySqlConnection) -> i64 {
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(conn)
            .await
            .expect("CONNECTION_ID()");
        i64::try_from(id).expect("connection ids fit in i64")
    }

    async fn kill(pool: &MySqlPool, id: i64) {
        // KILL takes no placeholder; `id` is an integer.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(pool)
            .await
            .expect("KILL CONNECTION");
    }

    const WIRE: conformance::proxy::Wire = conformance::proxy::Wire::MySql;
    // `HOST` is `host:port` of the client, the host as the server resolved it.
    const SESSIONS_FROM_PORT: &'static str = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE HOST LIKE CONCAT('%:', $1)";

    fn address(url: &str) -> String {
        conformance::proxy::upstream(url, 3306)
    }

    fn with_address(url: &str, addr: std::net::SocketAddr) -> String {
        conformance::proxy::with_address(url, addr, "ssl-mode=DISABLED")
    }
}

conformance::every_backend_tests!(My);

// The cases SQLite cannot run: a connection to cut, a server to miss, a session's own settings,
// a second writer's serialization failure, a named lock.
conformance::tests!(My;
    connection_killed_before_commit_keeps_nothing,
    unreachable_server_fails_the_test_naming_url_and_variable,
    commit_cut_before_its_answer_is_an_error_and_redelivery_settles_it,
    commit_never_delivered_is_an_error_and_redelivery_applies,
    connection_cut_after_the_claim_keeps_nothing_and_redelivery_applies,
    cancelled_migration_does_not_leak_its_named_lock,
    lease_is_live_for_a_session_in_another_time_zone,
);

/// The worker process of the multi-process cases (this binary, started again by them).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a worker process: started by four_processes_apply_every_job_exactly_once and \
            worker_killed_inside_the_body_keeps_nothing, with its orders in \
            IDEM_CONFORMANCE_* variables"]
async fn child_process() {
    conformance::worker::child_process::<My>().await;
}

/// A real deadlock (1213) between the body's transaction on `conn` and a second one: ours
/// locks row 1, theirs rows 2 to 100 and then asks for row 1 (and waits); ours then asks for
/// row 2. InnoDB rolls back the transaction that changed fewer rows, ours (the marker, the
/// effect, one row against their 99), and the error is swallowed.
async fn deadlock_as_victim(conn: &mut MySqlConnection, other: &MySqlPool, rows: &str) {
    let update =
        |which: &str| sqlx::AssertSqlSafe(format!("UPDATE {rows} SET v = v + 1 WHERE {which}"));
    sqlx::query(update("id = 1"))
        .execute(&mut *conn)
        .await
        .expect("lock row 1");
    let (locked, is_locked) = tokio::sync::oneshot::channel();
    let theirs = tokio::spawn({
        let (other, row_1, rest) = (other.clone(), update("id = 1"), update("id >= 2"));
        async move {
            let mut tx = other.begin().await.expect("begin");
            sqlx::query(rest)
                .execute(&mut *tx)
                .await
                .expect("lock rows 2..");
            locked.send(()).expect("the body waits for this");
            // Waits for the body's transaction, then gets row 1 once the deadlock undid it.
            sqlx::query(row_1)
                .execute(&mut *tx)
                .await
                .expect("lock row 1 after the victim");
            tx.commit().await.expect("commit the survivor");
        }
    });
    conformance::util::within(60, "the second transaction locking rows 2..", is_locked)
        .await
        .expect("the second transaction signals");
    // Only once theirs visibly waits for row 1 does ours ask for row 2, closing the cycle.
    let running = format!("UPDATE {rows} SET v = v + 1 WHERE id = 1%");
    conformance::util::until(60, "the second transaction waiting for row 1", || {
        let (other, running) = (other.clone(), running.clone());
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE ?",
            )
            .bind(running)
            .fetch_one(&other)
            .await
            .expect("PROCESSLIST");
            n == 1
        }
    })
    .await;
    match sqlx::query(update("id = 2")).execute(&mut *conn).await {
        Err(e) if mysql_number(&e) == Some(1213) => {}
        other => panic!("expected the body's transaction to be the deadlock victim, got {other:?}"),
    }
    conformance::util::within(60, "the surviving transaction", theirs)
        .await
        .expect("no panic");
}

fn mysql_number(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(sqlx::mysql::MySqlDatabaseError::number)
}
