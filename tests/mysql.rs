//! The conformance suite on MySQL / MariaDB (`IDEM_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`).

mod conformance;

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{Connection as _, MySql, MySqlConnection};

struct My;

/// Sessions in the middle of a claim `INSERT` (a batch's is `INSERT IGNORE`) into the marker
/// table named `?`. A statement bounded by `SET STATEMENT .. FOR` shows that prefix (in its
/// executable comment) before the `INSERT`.
const CLAIMS_RUNNING: &str = "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
     WHERE INFO LIKE CONCAT('%INSERT %INTO ', $1, ' %')";

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
    const SCHEMA_V2: &'static str = include_str!("conformance/schema_v2/mysql.sql");
    const UPGRADE_V2_TO_V3: &'static str = include_str!("../schema/mysql.v2-to-v3.sql");
    const UPGRADE_V3_TO_V4: &'static str = include_str!("../schema/mysql.v3-to-v4.sql");
    const UPGRADE_V4_TO_V5: &'static str = include_str!("../schema/mysql.v4-to-v5.sql");
    const UPGRADE_V5_TO_V6: &'static str = include_str!("../schema/mysql.v5-to-v6.sql");
    const COLUMNS_OF: &'static str = "SELECT CONCAT_WS(' ', column_name, column_type, \
         is_nullable, coalesce(column_default, '')) FROM information_schema.columns \
         WHERE table_schema = DATABASE() AND table_name = '{table}'";
    const INDEXES_OF: &'static str = "SELECT CONCAT_WS(' ', index_name, non_unique, \
         GROUP_CONCAT(column_name ORDER BY seq_in_index)) FROM information_schema.statistics \
         WHERE table_schema = DATABASE() AND table_name = '{table}' GROUP BY index_name, non_unique";
    const LOCK_WAIT_MS: &'static str =
        "SELECT CAST(@@SESSION.innodb_lock_wait_timeout * 1000 AS SIGNED)";
    // MariaDB's `TIME_MS`: how long the session's running statement has run.
    const UPDATES_RUNNING_LONGER_THAN: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE INFO LIKE CONCAT('UPDATE ', $1, ' %') AND TIME_MS > $2",
    );
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
// a second writer's serialization failure, a named lock, a second writer beside an open group.
conformance::tests!(My;
    job_begun_first_and_committed_last_is_published_second,
    killed_connection_fails_its_group_and_redelivery_applies_once,
    group_claim_that_stops_waiting_is_in_progress,
    group_calls_naming_the_same_rows_take_turns_in_one_lane,
    connection_killed_in_a_job_fails_the_batch_and_keeps_nothing,
    connection_killed_before_commit_keeps_nothing,
    unreachable_server_fails_the_test_naming_url_and_variable,
    commit_cut_before_its_answer_is_an_error_and_redelivery_settles_it,
    commit_never_delivered_is_an_error_and_redelivery_applies,
    group_commit_cut_before_its_answer_fails_every_member_as_may_be_kept,
    group_commit_never_delivered_fails_every_member_and_redelivery_applies,
    grouped_offset_commit_cut_fails_every_member_as_may_be_kept,
    grouped_offset_commit_never_delivered_fails_every_member,
    connection_cut_after_the_claim_keeps_nothing_and_redelivery_applies,
    cancelled_migration_does_not_leak_its_named_lock,
    lease_is_live_for_a_session_in_another_time_zone,
    body_statement_waits_longer_than_the_claims_wait,
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

/// A handler with `wait`, whose body can park until its future is dropped.
#[idem::idempotent(key = "job", scope = "mysql.wait", wait = "2s")]
async fn waiting(
    tx: &mut sqlx::Transaction<'_, MySql>,
    job: &str,
    entered: Option<tokio::sync::mpsc::Sender<()>>,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    if let Some(entered) = entered {
        entered.send(()).await.expect("the test listens");
        std::future::pending::<()>().await;
    }
    Ok(())
}

/// The pool's only connection still has the server's lock wait.
async fn lock_wait_is_the_servers(pool: &MySqlPool, after: &str) {
    let same: i64 = sqlx::query_scalar(
        "SELECT CAST(@@SESSION.innodb_lock_wait_timeout = @@GLOBAL.innodb_lock_wait_timeout \
         AS SIGNED)",
    )
    .fetch_one(pool)
    .await
    .expect("read the lock wait");
    assert_eq!(same, 1, "the session's lock wait changed after {after}");
}

/// `wait` never reaches the pooled connection: not after an applied call, a duplicate, a
/// cancelled body (the future dropped mid-transaction) or a claim that failed. On MariaDB it
/// bounds each claim statement (`SET STATEMENT .. FOR`), and nothing is set on the session.
#[tokio::test(flavor = "multi_thread")]
async fn wait_never_reaches_the_pooled_connection() {
    let url = <My as conformance::Support>::url();
    let pool = <My as conformance::Support>::connect(&url, 1).await;
    let table = conformance::unique_name("m", "waitleak");
    let store = idem::Store::new(pool.clone())
        .with_table(&table)
        .expect("a name");
    store.migrate().await.expect("migrate");
    let ok = waiting(&store, "job-1", None).await.expect("applies");
    assert!(ok.is_applied());
    lock_wait_is_the_servers(&pool, "an applied call").await;
    assert!(
        !waiting(&store, "job-1", None)
            .await
            .expect("a duplicate")
            .is_applied()
    );
    lock_wait_is_the_servers(&pool, "a duplicate").await;
    let (entered, mut inside) = tokio::sync::mpsc::channel(1);
    tokio::select! {
        _ = waiting(&store, "job-2", Some(entered)) => panic!("the body never returns"),
        _ = inside.recv() => {}
    }
    lock_wait_is_the_servers(&pool, "a cancelled body").await;
    let missing = idem::Store::new(pool.clone())
        .with_table("idem_no_such_table")
        .expect("a name");
    assert!(waiting(&missing, "job-3", None).await.is_err());
    lock_wait_is_the_servers(&pool, "a failed claim").await;
    for t in [table.clone(), format!("{table}_outbox")] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}")))
            .execute(&pool)
            .await
            .expect("drop");
    }
}

/// A body whose DDL commits implicitly (MariaDB and MySQL end the transaction there): marker
/// and effect were committed together by it, and the call says `Applied`, found by the claim's
/// nonce (not by `@@in_transaction`, which MySQL 8 lacks).
#[idem::idempotent(key = "job", scope = "mysql.ddl")]
async fn with_ddl(
    tx: &mut sqlx::Transaction<'_, MySql>,
    job: &str,
    effects: &str,
) -> Result<(), sqlx::Error> {
    let insert = format!("INSERT INTO {effects} (id) VALUES (1)");
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .execute(&mut **tx)
        .await?;
    let ddl = format!("CREATE TABLE IF NOT EXISTS {effects}_ddl (id INT)");
    sqlx::query(sqlx::AssertSqlSafe(ddl))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_whose_ddl_commits_implicitly_is_applied() {
    let url = <My as conformance::Support>::url();
    let pool = <My as conformance::Support>::connect(&url, 2).await;
    let table = conformance::unique_name("m", "ddl");
    let effects = conformance::unique_name("e", "ddl");
    let store = idem::Store::new(pool.clone())
        .with_table(&table)
        .expect("a name");
    store.migrate().await.expect("migrate");
    let create = format!("CREATE TABLE {effects} (id INT)");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&pool)
        .await
        .expect("effects");
    let first = with_ddl(&store, "job-1", &effects)
        .await
        .expect("committed");
    assert!(first.is_applied(), "{first:?}");
    let again = with_ddl(&store, "job-1", &effects)
        .await
        .expect("a duplicate");
    assert_eq!(again, idem::Outcome::Duplicate);
    let count = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    assert_eq!(count(format!("SELECT COUNT(*) FROM {effects}")).await, 1);
    assert_eq!(count(format!("SELECT COUNT(*) FROM {table}")).await, 1);
    for t in [
        format!("{table}_outbox"),
        table,
        effects.clone(),
        format!("{effects}_ddl"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}")))
            .execute(&pool)
            .await
            .expect("drop");
    }
}
