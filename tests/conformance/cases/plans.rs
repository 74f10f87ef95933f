//! PostgreSQL's plans for idem's own statements, read from the prepared statements of the
//! connection that ran them.

use sqlx::Postgres;

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::each_handlers::*;
use crate::conformance::handlers::*;

/// A batch's statements that read, take over or give back its markers (`key = ANY(...)`) look
/// each key up in the marker table's index, even in a scope the table's statistics say holds
/// no markers (one new since the last `ANALYZE`), instead of reading every marker of the scope.
pub(crate) async fn batch_statements_look_up_keys_in_a_scope_the_statistics_miss<S>()
where
    S: Support<Db = Postgres>,
{
    // One connection: the statements the batch prepares are the ones read back below.
    let mut ctx = Ctx::<S>::new("plans", 1).await;
    let markers = ctx.tables[0].clone();
    let fill = |scope: &str| {
        format!(
            "INSERT INTO {markers} (scope, key, token, completed_at) \
             SELECT '{scope}', md5(g::text), 1, now() FROM generate_series(1, 5000) g"
        )
    };
    ctx.exec(&fill("other")).await;
    ctx.exec(&format!("ANALYZE {markers}")).await;
    ctx.exec(&fill("apply")).await;
    let table = ctx
        .create_table("p", "(id BIGINT NOT NULL PRIMARY KEY)")
        .await;
    ctx.exec(&format!("INSERT INTO {table} (id) VALUES (0)"))
        .await;
    let batch: Vec<Job> = (1..=3)
        .map(|i| ctx.job(&format!("job-{i}"), i, 10 * i))
        .collect();
    // A duplicate (its marker read) and a poisoned job (its marker given back).
    assert!(apply(&ctx.store, &batch[0], Then::Commit).await.is_ok());
    let poison = Poison {
        table: &table,
        ids: &[3],
        swallow: false,
    };
    let done = apply_each_by_hand(&ctx.store, &batch, poison).await;
    assert!(done.expect("the batch commits").results()[2].is_err());
    let mut conn = ctx.pool.acquire().await.expect("the connection");
    let prepared: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT name, statement, cardinality(parameter_types) FROM pg_prepared_statements \
         WHERE statement LIKE '%key = ANY(%' AND statement NOT LIKE '%pg_prepared%'",
    )
    .fetch_all(&mut *conn)
    .await
    .expect("the prepared statements");
    let kinds = ["SELECT", "DELETE"].map(|k| prepared.iter().any(|p| p.1.starts_with(k)));
    assert_eq!(
        kinds,
        [true, true],
        "the read and the give-back ran: {prepared:?}"
    );
    for (name, statement, params) in prepared {
        let args = ["'apply'", "ARRAY[md5('7')]", "1"];
        let args = args[..params as usize].join(", ");
        let plan: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "EXPLAIN EXECUTE {name}({args})"
        )))
        .fetch_all(&mut *conn)
        .await
        .expect("its plan");
        let plan: Vec<String> = plan.into_iter().map(|(line,)| line).collect();
        assert!(
            plan.iter()
                .any(|line| line.contains("Index Cond") && line.contains("key = ANY")),
            "{statement}\nreads the whole scope:\n{}",
            plan.join("\n")
        );
    }
    drop(conn);
    ctx.cleanup().await;
}
