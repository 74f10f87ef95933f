//! The conformance suite on PostgreSQL (`IDEM_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`).

mod conformance;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, Postgres};

struct Pg;

const URL_VAR: &str = "IDEM_POSTGRES_URL";

impl conformance::Support for Pg {
    type Db = Postgres;
    const KEY_TEXT: &'static str = "key";
    const BIGINT: &'static str = "BIGINT";
    const TWO_HOURS_AGO: &'static str = "now() - interval '2 hours'";

    fn url() -> String {
        conformance::server_url(URL_VAR, "postgres://postgres@127.0.0.1:5432/test")
    }

    async fn connect(url: &str, max: u32) -> PgPool {
        let opts: PgConnectOptions = url
            .parse()
            .unwrap_or_else(|e| conformance::unreachable("PostgreSQL", url, URL_VAR, &e));
        // One direct connection first: the pool would retry a refused connection until its
        // acquire timeout instead of failing at once.
        match tokio::time::timeout(Duration::from_secs(10), PgConnection::connect_with(&opts)).await
        {
            Ok(Ok(conn)) => drop(conn.close().await),
            Ok(Err(e)) => conformance::unreachable("PostgreSQL", url, URL_VAR, &e),
            Err(e) => conformance::unreachable("PostgreSQL", url, URL_VAR, &e),
        }
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_lazy_with(opts)
    }
}

impl conformance::Server for Pg {
    const URL_VAR: &'static str = URL_VAR;
    const UNREACHABLE_URL: &'static str = "postgres://postgres@127.0.0.1:1/test";

    async fn connection_id(conn: &mut PgConnection) -> i64 {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("pg_backend_pid()");
        i64::from(pid)
    }

    async fn kill(pool: &PgPool, id: i64) {
        // With a timeout, pg_terminate_backend waits until the backend has exited.
        let pid = i32::try_from(id).expect("a backend pid is an int4");
        let gone: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 30000)")
            .bind(pid)
            .fetch_one(pool)
            .await
            .expect("pg_terminate_backend");
        assert!(gone, "backend {pid} did not exit");
    }
}

conformance::suite!(Pg, server);
