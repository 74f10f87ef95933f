//! pgbench running the handwritten transaction: the floor set by PostgreSQL's own client, to
//! tell the cost of sqlx and tokio apart from the cost of idem.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::config;
use crate::measure::Run;
use crate::{ACCOUNTS, Res, SCOPE};

/// How long a pgbench run lasts. A duration (`-T`) is what the other variants do, but pgbench
/// counts it in whole seconds and spends some 0.2 s connecting around it; `--quick` runs a
/// number of transactions per client instead (`-t`), aimed at its short runs, at the price of
/// a short tail where the first clients to finish leave the others alone.
#[derive(Clone, Copy)]
pub(crate) enum PgbenchLength {
    Secs(u64),
    PerClient(u64),
}

pub(crate) struct Pgbench {
    pub(crate) bin: PathBuf,
    pub(crate) dir: PathBuf,
    pub(crate) script: PathBuf,
}

pub(crate) fn find_pgbench() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("pgbench"));
    let versioned = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/pgbench"));
    on_path.chain(versioned).find(|p| p.is_file())
}

/// The handwritten top-up as a pgbench script: the claim of a fresh key in `markers`, the
/// effect on one of `count` accounts, then `before_commit` (statements ended by `;\n`).
pub(crate) fn top_up_script(
    accounts: &str,
    count: impl std::fmt::Display,
    markers: &str,
    scope: &str,
    before_commit: &str,
) -> String {
    format!(
        "\\set aid random(1, {count})\n\
         \\set k random(1, 9000000000000000000)\n\
         BEGIN;\n\
         INSERT INTO {markers} (scope, key, completed_at) VALUES ('{scope}', :k, now()) \
         ON CONFLICT DO NOTHING;\n\
         UPDATE {accounts} SET credits = credits + 1 WHERE id = :aid;\n\
         {before_commit}\
         COMMIT;\n"
    )
}

/// pgbench on tables of its own, made afresh: `accounts` (`count` of them, no credits yet) and
/// `markers` with idem's schema and its outbox; scripts and logs in the directory `dir`, and
/// [`run`](Pgbench::run) running the top-up of `scope` on them.
pub(crate) async fn on_own_tables(
    pool: &sqlx::PgPool,
    accounts: &str,
    markers: &str,
    count: impl std::fmt::Display + Copy,
    scope: &str,
    dir: PathBuf,
) -> Res<Pgbench> {
    let bin = find_pgbench().ok_or("the floor rows need pgbench on PATH")?;
    std::fs::create_dir_all(&dir)?;
    drop_own_tables(pool, accounts, markers).await?;
    for sql in [
        format!("CREATE TABLE {accounts} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL)"),
        format!("INSERT INTO {accounts} SELECT g, 0 FROM generate_series(1, {count}) g"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await?;
    }
    idem::Store::new(pool.clone())
        .with_table(markers)?
        .migrate()
        .await?;
    let script = dir.join("top_up.sql");
    std::fs::write(&script, top_up_script(accounts, count, markers, scope, ""))?;
    Ok(Pgbench { bin, dir, script })
}

/// Drops what [`on_own_tables`] made.
pub(crate) async fn drop_own_tables(pool: &sqlx::PgPool, accounts: &str, markers: &str) -> Res<()> {
    let sql = format!("DROP TABLE IF EXISTS {accounts}, {markers}, {markers}_outbox");
    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await?;
    Ok(())
}

impl Pgbench {
    pub(crate) fn new(dir: &Path) -> Option<Pgbench> {
        let bin = find_pgbench()?;
        let script = dir.join("top_up.sql");
        // The handwritten transaction, statement for statement. Every key is fresh, so the
        // script needs no branch on the claim's row count.
        let (accounts, markers) = (&config().accounts, &config().pgbench);
        let text = top_up_script(accounts, ACCOUNTS, markers, SCOPE, "");
        std::fs::write(&script, text).ok()?;
        Some(Pgbench {
            bin,
            dir: dir.to_owned(),
            script,
        })
    }

    /// `clients` connections for a length of run; the run's rate is pgbench's own `tps`
    /// (without connection time), latencies come from its per-transaction log.
    pub(crate) async fn run(&self, clients: usize, length: PgbenchLength, tag: &str) -> Res<Run> {
        self.run_script(&self.script, clients, length, tag).await
    }

    /// The hand-written batch transaction of `size` jobs: one statement claims `size` fresh
    /// keys, one tops up their accounts, each client its own (account ≡ client mod clients),
    /// as the bench's batch workers do. Its rate counts transactions: `size` jobs each.
    pub(crate) async fn run_batch(
        &self,
        clients: usize,
        size: usize,
        length: PgbenchLength,
        tag: &str,
    ) -> Res<Run> {
        let script = self.dir.join(format!("batch_{size}_{clients}.sql"));
        let (accounts, markers) = (&config().accounts, &config().pgbench);
        let per_client = ACCOUNTS / clients as u64;
        let text = format!(
            "BEGIN;\n\
             INSERT INTO {markers} (scope, key, completed_at) \
             SELECT '{SCOPE}', md5(random()::text || clock_timestamp()::text || g), now() \
             FROM generate_series(1, {size}) AS g ORDER BY 2 ON CONFLICT DO NOTHING RETURNING key;\n\
             UPDATE {accounts} SET credits = credits + v.c FROM (SELECT \
             floor(random() * {per_client})::bigint * {clients} + :client_id + 1 AS id, \
             count(*) AS c FROM generate_series(1, {size}) GROUP BY 1) v \
             WHERE {accounts}.id = v.id;\n\
             COMMIT;\n"
        );
        std::fs::write(&script, text)?;
        self.run_script(&script, clients, length, tag).await
    }

    pub(crate) async fn run_script(
        &self,
        script: &Path,
        clients: usize,
        length: PgbenchLength,
        tag: &str,
    ) -> Res<Run> {
        let prefix = format!("pgbench-{tag}");
        let threads = clients.min(2);
        let mut cmd = tokio::process::Command::new(&self.bin);
        // The server is the bench's own URL, given as pgbench's database name: libpq takes a
        // `postgres://` URI there (a URL with sqlx-only parameters would not do). With the
        // default URL this is `-h 127.0.0.1 -p 5432 -U postgres test`, as it always was.
        cmd.arg("-n")
            .args(["-M", "prepared", "-f"])
            .arg(script)
            .args(["-c", &clients.to_string(), "-j", &threads.to_string()])
            .args(match length {
                PgbenchLength::Secs(secs) => ["-T".to_owned(), secs.to_string()],
                PgbenchLength::PerClient(n) => ["-t".to_owned(), n.to_string()],
            })
            .args(["-l", "--log-prefix"])
            .arg(self.dir.join(&prefix))
            .arg(&config().pg_url)
            .current_dir(&self.dir)
            .kill_on_drop(true);
        // libpq tries TLS first (`sslmode=prefer`) where the server offers it, and the bench's
        // sqlx has no TLS: unless told otherwise, pgbench talks in plain text as sqlx does,
        // or the floor would carry the cost of encryption.
        if std::env::var_os("PGSSLMODE").is_none() {
            cmd.env("PGSSLMODE", "disable");
        }
        let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
            .await
            .map_err(|_| "pgbench ran for more than 120 s")??;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!(
                "pgbench failed ({}): {}{}",
                out.status,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        let field = |name: &str| -> Res<f64> {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(name))
                .ok_or_else(|| format!("no `{name}` in pgbench's output: {stdout}"))?;
            let value = line[name.len()..]
                .trim_start_matches([' ', '=', ':'])
                .split(['/', ' '])
                .next()
                .unwrap_or_default();
            Ok(value.parse::<f64>()?)
        };
        let tps = field("tps")?;
        let jobs = field("number of transactions actually processed")? as u64;
        let mut lat_ns = Vec::with_capacity(jobs as usize);
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let is_log = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{prefix}.")));
            if !is_log {
                continue;
            }
            // client_id transaction_no time_us script_no epoch epoch_us
            for line in std::fs::read_to_string(&path)?.lines() {
                if let Some(us) = line.split(' ').nth(2) {
                    lat_ns.push(us.parse::<u64>()? * 1_000);
                }
            }
            std::fs::remove_file(&path)?;
        }
        Ok(Run {
            jobs,
            secs: jobs as f64 / tps,
            lat_ns,
            cpu_ns: None,
        })
    }
}
