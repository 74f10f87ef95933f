//! Upgrades: a schema made by an earlier version of idem, migrated, is the schema the current
//! version makes (the same tables, columns and indexes), whether `Store::migrate()` upgrades it
//! or the published upgrade file does; and a marker written before the upgrade is still a
//! duplicate after it.

use idem::Store;

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{Then, apply, duplicate};
use crate::conformance::util::unique_name;

/// The statements of a published SQL file: comments dropped, split on `;`.
pub(crate) fn statements(sql: &str) -> Vec<String> {
    let text: Vec<&str> = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect();
    text.join("\n")
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The tables of one marker table, `{t}` for its name, as the catalog describes them: each
/// column (type, nullability, default) and each index, sorted, the marker table's name
/// replaced by `t`. An index of a partitioned table (`IDEM_CONFORMANCE_PARTITIONED`) is
/// described as the same index of a plain table: an upgrade keeps a table as it was.
async fn describe<S: Support>(ctx: &Ctx<S>, table: &str) -> Vec<String> {
    let mut described = Vec::new();
    for of in [
        table.to_owned(),
        format!("{table}_outbox"),
        format!("{table}_steps"),
    ] {
        for query in [S::COLUMNS_OF, S::INDEXES_OF] {
            let sql = query.replace("{table}", &of);
            let mut conn = ctx.pool.acquire().await.expect("a connection");
            let rows = <S::Db as crate::conformance::TestDb>::fetch_strings(&mut conn, &sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            let suffix = &of[table.len()..];
            described.extend(
                rows.into_iter()
                    .map(|r| format!("t{suffix}: {}", r.replace(table, "t")))
                    .map(|r| r.replacen(" ON ONLY ", " ON ", 1)),
            );
        }
    }
    described.sort();
    described
}

/// Makes `table` as schema version 2 made it, with one completed marker of `key`.
pub(crate) async fn version_2<S: Support>(ctx: &mut Ctx<S>, table: &str, key: &str) {
    for stmt in statements(S::SCHEMA_V2) {
        ctx.exec(&stmt.replace("idem_processed", table)).await;
    }
    ctx.tables.push(table.to_owned());
    // The completed marker of a transaction-mode job, as version 2 wrote it (the current
    // claim statements read columns of version 3, which this table does not have yet).
    let at = S::TWO_HOURS_AGO;
    ctx.exec(&format!(
        "INSERT INTO {table} VALUES ('apply', '{key}', 'completed', NULL, NULL, NULL, -1, 1, \
         {at}, {at})"
    ))
    .await;
}

pub(crate) async fn migrate_brings_a_version_2_schema_to_the_current_one<S: Support>() {
    let mut ctx = Ctx::<S>::new("upgrade", 2).await;
    let current = describe(&ctx, ctx.store.table()).await;
    assert!(
        current.iter().any(|c| c.starts_with("t_outbox: ")),
        "the catalog query finds the current tables: {current:?}"
    );

    // Upgraded by `migrate`, twice (a second run finds nothing to add).
    let old = unique_name("m", "upgrade");
    version_2(&mut ctx, &old, "before-migrate").await;
    let store = Store::new(ctx.pool.clone())
        .with_table(&old)
        .expect("a generated table name");
    store.migrate().await.expect("migrate a version 2 schema");
    store.migrate().await.expect("migrate it again");
    assert_eq!(
        describe(&ctx, &old).await,
        current,
        "migrate's upgrade of version 2"
    );
    // A marker written by version 2 is still a duplicate.
    duplicate(apply(&store, &ctx.job("before-migrate", 1, 10), Then::Commit).await);

    // Upgraded by the published file, as a user's own migration tool runs it.
    let copied = unique_name("m", "upgrade");
    version_2(&mut ctx, &copied, "before-file").await;
    for upgrade in [
        S::UPGRADE_V2_TO_V3,
        S::UPGRADE_V3_TO_V4,
        S::UPGRADE_V4_TO_V5,
        S::UPGRADE_V5_TO_V6,
    ] {
        for stmt in statements(upgrade) {
            ctx.exec(&stmt.replace("idem_processed", &copied)).await;
        }
    }
    assert_eq!(
        describe(&ctx, &copied).await,
        current,
        "the published upgrade files' upgrade of version 2"
    );
    let store = Store::new(ctx.pool.clone())
        .with_table(&copied)
        .expect("a generated table name");
    duplicate(apply(&store, &ctx.job("before-file", 1, 10), Then::Commit).await);
    ctx.cleanup().await;
}
