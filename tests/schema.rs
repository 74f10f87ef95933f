//! The published schema (`schema/*.sql`) is what `Store::ddl()` runs: users copy those files
//! into their own migrations, so the two must never drift apart.

use idem::Store;

/// The statements of a published file: comments dropped, split on `;`.
fn statements(sql: &str) -> Vec<String> {
    let text: String = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    text.split(';')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

fn normalise(stmts: Vec<String>) -> Vec<String> {
    stmts
        .into_iter()
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

fn check(file: &str, published: &str, ddl: Vec<String>) {
    if std::env::var_os("IDEM_BLESS").is_some() {
        println!("---- {file}\n{};", ddl.join(";\n\n"));
    }
    assert!(
        published.contains("schema version 6"),
        "{file} names its schema version"
    );
    assert_eq!(
        normalise(statements(published)),
        normalise(ddl),
        "{file} differs from Store::ddl()"
    );
}

#[tokio::test]
async fn published_postgres_schema_is_what_migrate_runs() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://localhost/unused")
        .unwrap();
    let published = include_str!("../schema/postgres.sql");
    check("schema/postgres.sql", published, Store::new(pool).ddl());
}

#[tokio::test]
async fn published_mysql_schema_is_what_migrate_runs() {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .connect_lazy("mysql://localhost/unused")
        .unwrap();
    let published = include_str!("../schema/mysql.sql");
    check("schema/mysql.sql", published, Store::new(pool).ddl());
}

#[tokio::test]
async fn published_sqlite_schema_is_what_migrate_runs() {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .connect_lazy("sqlite::memory:")
        .unwrap();
    let published = include_str!("../schema/sqlite.sql");
    check("schema/sqlite.sql", published, Store::new(pool).ddl());
}
