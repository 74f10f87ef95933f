//! MySQL / MariaDB only: a migration cancelled while it waits for the table's named lock
//! (`GET_LOCK('idem.migrate.<table>')`, a lock of the session, not of a transaction) must not
//! leave the lock held by a connection the pool hands out again.
//!
//! Not on PostgreSQL: its migration takes `pg_advisory_xact_lock`, which ends with the
//! transaction, so there is no session lock to leak. Not on SQLite: its migration takes no
//! named lock. The SQL below (`GET_LOCK`, `IS_USED_LOCK`, `information_schema.PROCESSLIST`)
//! is MySQL's.

use idem::Store;

use crate::conformance::ctx::Ctx;
use crate::conformance::db::{Bind, TestDb};
use crate::conformance::util::{until, within};
use crate::conformance::{Server, Support};

pub(crate) async fn cancelled_migration_does_not_leak_its_named_lock<S: Server>() {
    let ctx = Ctx::<S>::new("miglock", 2).await;
    let mut lock = format!("idem.migrate.{}", ctx.store.table());
    lock.truncate(64);
    let name = || [Bind::Str(lock.clone())];

    // Another session holds the migration lock of the table.
    let holder_pool = S::connect(&ctx.url, 1).await;
    let mut holder = holder_pool.acquire().await.expect("a connection");
    let got = S::Db::fetch_i64(&mut holder, "SELECT GET_LOCK($1, 60)", &name())
        .await
        .expect("GET_LOCK");
    assert_eq!(got, 1, "the test could not take the lock {lock:?}");

    // A migration on a pool of one connection, whose session id is known: the pool hands
    // the migration its only (idle) connection.
    let single = S::connect(&ctx.url, 1).await;
    let session = {
        let mut conn = single.acquire().await.expect("the pool's connection");
        S::connection_id(&mut conn).await
    };
    let store = Store::new(single.clone())
        .with_table(ctx.store.table())
        .expect("the test's table name");
    let migration = tokio::spawn(async move { store.migrate().await });
    until(60, "the migration waiting in GET_LOCK", || async {
        ctx.scalar_with(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE ID = $1 AND INFO LIKE 'SELECT GET_LOCK%'",
            &[Bind::I64(session)],
        )
        .await
            == 1
    })
    .await;
    assert!(!migration.is_finished(), "the migration got a held lock");

    // Cancelled while it waits; then the lock is freed.
    migration.abort();
    match migration.await {
        Err(e) if e.is_cancelled() => {}
        other => panic!("expected the migration to be cancelled, got {other:?}"),
    }
    let released = S::Db::fetch_i64(&mut holder, "SELECT RELEASE_LOCK($1)", &name())
        .await
        .expect("RELEASE_LOCK");
    assert_eq!(released, 1, "the test's session no longer held {lock:?}");
    drop(holder);
    holder_pool.close().await;

    // The same pool migrates again: no connection of it holds (or later takes) the lock.
    let store = Store::new(single.clone())
        .with_table(ctx.store.table())
        .expect("the test's table name");
    within(30, "a second migration on the same pool", store.migrate())
        .await
        .expect("the second migration");
    until(30, "the migration lock to be free", || async {
        ctx.scalar_with("SELECT CAST(IS_USED_LOCK($1) IS NULL AS SIGNED)", &name())
            .await
            == 1
    })
    .await;
    // Still free with the pool's connection back in the pool, idle.
    {
        let mut conn = single.acquire().await.expect("the pool's connection");
        let free = S::Db::fetch_i64(
            &mut conn,
            "SELECT CAST(IS_FREE_LOCK($1) AS SIGNED)",
            &name(),
        )
        .await
        .expect("IS_FREE_LOCK");
        assert_eq!(free, 1, "the pool's connection sees {lock:?} taken");
    }
    single.close().await;
    ctx.cleanup().await;
}
