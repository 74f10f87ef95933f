//! The conformance suite on MySQL / MariaDB (`IDEM_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`).

mod conformance;

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{Connection as _, MySql, MySqlConnection};

struct My;

const URL_VAR: &str = "IDEM_MYSQL_URL";

impl conformance::Support for My {
    type Db = MySql;
    // The marker table stores keys as bytes (`VARBINARY`); read them back as UTF-8 text.
    const KEY_TEXT: &'static str = "CONVERT(`key` USING utf8mb4)";
    const BIGINT: &'static str = "SIGNED";
    const TWO_HOURS_AGO: &'static str = "CURRENT_TIMESTAMP(6) - INTERVAL 2 HOUR";

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

    fn sql(sql: &str) -> String {
        conformance::question_marks(sql)
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
}

conformance::suite!(My, server);
