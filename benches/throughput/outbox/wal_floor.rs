//! `--outbox --wal-floor`: the handler's side of a relay fed by the write-ahead log. How a
//! job's messages should reach the WAL, as outbox rows (which logical decoding turns into
//! inserts) or as transactional logical decoding messages (`pg_logical_emit_message`: a WAL
//! record and nothing else, no heap row, no index entry), measured as the outbox floor
//! (`floor.rs`) measures the rows: pgbench, prepared, `WORKERS` clients, on tables of their
//! own with idem's schema, each round every variant once, every other round in reverse order,
//! medians.
//!
//! On a PostgreSQL of the bench's own (`idem_scale::standby::Server`): a relay fed by the WAL
//! needs `wal_level = logical`, and its write-ahead log must be flushed as a production
//! server's is (`fsync` and `synchronous_commit` on), since what a commit costs is the
//! question. The variants: the job alone, with 1 and 10 outbox rows (the floor's own
//! statement), with 1 and 10 emitted messages (one statement, a call a message, as the rows
//! are one `INSERT`) and with the 10 in one emitted payload; then the job alone and with one
//! row or one message while a `pgoutput` slot is consumed by `pg_recvlogical`, as a relay
//! would consume it. Each run's WAL is `pg_current_wal_lsn()` after it less before it,
//! divided by its transactions, and so is the server's CPU time (`server_cpu`).
//!
//! Before the runs, one transaction of each variant is decoded through a `test_decoding`
//! slot, to check that the emitted messages are there, whole, in the job's transaction.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use idem_scale::standby::{Server, find_pg_bin};
use sqlx::{AssertSqlSafe, PgPool};

use super::floor::{check, script as rows_script};
use super::{ACCOUNTS, WORKERS, median};
use crate::pgbench::{Pgbench, PgbenchLength, find_pgbench, on_own_tables, top_up_script};
use crate::{Res, config};

/// The scope the floor's rows are written under: the messages carry the same.
const SCOPE: &str = "bench.outbox";
/// The prefix of every emitted message, by which a relay would tell idem's from others'.
const PREFIX: &str = "idem";
/// The publication and slot the consumed runs decode through.
const SLOT: &str = "idem_wal_floor";

/// What a job writes besides its claim and its effect.
#[derive(Clone, Copy)]
enum Writes {
    Nothing,
    /// `n` outbox rows in one `INSERT`.
    Rows(usize),
    /// `n` messages, a `pg_logical_emit_message` each, in one `SELECT`.
    Emits(usize),
    /// `n` messages in one emitted payload, a JSON array.
    Framed(usize),
}

impl Writes {
    fn rows(self) -> usize {
        match self {
            Writes::Rows(n) => n,
            _ => 0,
        }
    }
}

const VARIANTS: [(&str, Writes); 6] = [
    ("(a) no outbox", Writes::Nothing),
    ("(b) 1 outbox row", Writes::Rows(1)),
    ("(c) 1 emitted message", Writes::Emits(1)),
    ("(d) 10 outbox rows", Writes::Rows(10)),
    ("(e) 10 emitted messages, a call each", Writes::Emits(10)),
    (
        "(e') 10 messages in one emitted payload",
        Writes::Framed(10),
    ),
];

/// The variants run again while the slot is consumed: (a), (b) and (c).
const CONSUMED: [usize; 3] = [0, 1, 2];

/// A run's rate, its WAL and the server's CPU time per transaction and, while the slot is
/// consumed, how far the decoder was behind the WAL when the run ended.
struct Measured {
    rate: f64,
    wal: f64,
    cpu_us: f64,
    behind: Option<f64>,
}

/// CPU seconds the server has spent: the postmaster's own and its reaped children's (the
/// backends of earlier runs, gone with their connections), and every living child's (this
/// run's backends, the WAL writer, the walsender). Unlike a rate, it does not move with what
/// else the machine runs, which on a shared machine moves the rates by more than the
/// differences measured.
fn server_cpu(postmaster: u32, ticks: f64) -> Res<f64> {
    // The fields after the command's closing parenthesis, from the state (field 3) on.
    let fields = |stat: &str| -> Vec<u64> {
        stat.rsplit_once(')')
            .map(|(_, rest)| rest)
            .unwrap_or_default()
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect()
    };
    let own = fields(&std::fs::read_to_string(format!(
        "/proc/{postmaster}/stat"
    ))?);
    let mut total: u64 = own.get(11..15).map_or(0, |t| t.iter().sum());
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // A process that ended since the listing has no stat any more: nothing to add.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let f = fields(&stat);
        if f.get(1) == Some(&u64::from(postmaster)) {
            total += f.get(11..13).map_or(0, |t| t.iter().sum());
        }
    }
    Ok(total as f64 / ticks)
}

/// One message as a relay would read it back: the row's columns (its id, destination, scope,
/// key, position, ordering key, headers and payload, base64) as JSON, built by the script
/// around the job's key `:k`, the payload `[1,0]` as the floor's rows hold it. Its commit
/// time is the decoded transaction's, as a row's `created_at` is its statement's. A space
/// follows each colon: pgbench would read `:0` as a variable.
fn message(seq: usize) -> String {
    format!(
        "'{{\"id\": \"' || :k::text || '-{seq}\", \"destination\": \"bench.receipts\", \
         \"scope\": \"{SCOPE}\", \"key\": \"' || :k::text || '\", \"seq\": {seq}, \
         \"ordering_key\": \"' || :k::text || '\", \
         \"headers\": {{\"content-type\": \"application/json\"}}, \"payload\": \"WzEsMF0=\"}}'"
    )
}

fn emit(content: &str) -> String {
    format!("pg_logical_emit_message(true, '{PREFIX}', {content})")
}

fn script(accounts: &str, markers: &str, writes: Writes) -> String {
    let before_commit = match writes {
        Writes::Nothing => String::new(),
        Writes::Rows(n) => return rows_script(accounts, markers, n),
        Writes::Emits(n) => {
            let calls: Vec<String> = (0..n).map(|seq| emit(&message(seq))).collect();
            format!("SELECT {};\n", calls.join(", "))
        }
        Writes::Framed(n) => {
            let parts: Vec<String> = (0..n).map(message).collect();
            format!(
                "SELECT {};\n",
                emit(&format!("'[' || {} || ']'", parts.join(" || ', ' || ")))
            )
        }
    };
    top_up_script(accounts, ACCOUNTS, markers, SCOPE, &before_commit)
}

/// `--outbox --wal-floor [--quick] [--rounds N] [--run-ms MS]`: the Markdown report.
pub(crate) async fn run(quick: bool, rounds: usize, run: Duration) -> Res<String> {
    // Said before anything starts, with what to install: the server would panic deep in
    // `initdb` otherwise.
    find_pgbench().ok_or(
        "--wal-floor runs pgbench, and found none on PATH or in /usr/lib/postgresql/*/bin \
         (Debian: apt-get install postgresql-client)",
    )?;
    let bin = find_pg_bin().ok_or(
        "--wal-floor starts a PostgreSQL of its own (`runuser -u postgres -- \
         /usr/lib/postgresql/<version>/bin/initdb`, then `pg_ctl start`), and found no pg_ctl \
         under /usr/lib/postgresql/*/bin (Debian: apt-get install postgresql)",
    )?;
    for tool in ["initdb", "pg_recvlogical"] {
        if !bin.join(tool).is_file() {
            return Err(format!("--wal-floor needs {}", bin.join(tool).display()).into());
        }
    }
    eprintln!("wal floor: starting a PostgreSQL of its own, wal_level = logical");
    let server = Server::start("wal_level = logical\n");
    let url = server.url();
    config::use_postgres(url.clone());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .map_err(|e| {
            format!(
                "the bench's own PostgreSQL at {url} (log {}): {e}",
                server.log().display()
            )
        })?;
    let dir = std::env::temp_dir().join(format!("idem-bench-wal-{}", std::process::id()));
    let measured = measure(&server, &pool, &dir, quick, rounds, run).await;
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    // The server stops here, after its clients, whatever the runs returned.
    drop(server);
    measured
}

async fn measure(
    server: &Server,
    pool: &PgPool,
    dir: &Path,
    quick: bool,
    rounds: usize,
    run: Duration,
) -> Res<String> {
    let pid = std::process::id();
    let (accounts, markers) = (
        format!("idem_bench_wal_accounts_p{pid}"),
        format!("idem_bench_wal_markers_p{pid}"),
    );
    let pgbench = on_own_tables(pool, &accounts, &markers, ACCOUNTS, SCOPE, dir.into()).await?;
    let mut scripts = Vec::new();
    for (v, (_, writes)) in VARIANTS.iter().enumerate() {
        let path = pgbench.dir.join(format!("wal_{v}.sql"));
        std::fs::write(&path, script(&accounts, &markers, *writes))?;
        scripts.push(path);
    }
    let mut bytes = Vec::new();
    for (v, (name, writes)) in VARIANTS.iter().enumerate() {
        bytes.push(decoded(pool, &pgbench, &scripts[v], &markers, *writes).await?);
        eprintln!(
            "wal floor: {name}: decoded as written, {} bytes a job",
            bytes[v]
        );
    }
    let length = if quick {
        PgbenchLength::PerClient(50)
    } else {
        PgbenchLength::Secs(run.as_secs().max(1))
    };
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await?;
    let stat = std::fs::read_to_string(format!("/proc/{backend}/stat"))?;
    let postmaster = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|ppid| ppid.parse().ok())
        .ok_or("no postmaster's pid in a backend's /proc stat")?;
    let ticks = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(100.0);
    let each = Each {
        pool,
        pgbench: &pgbench,
        scripts: &scripts,
        markers: &markers,
        length,
        postmaster,
        ticks,
    };
    eprintln!("wal floor: {rounds} rounds of each variant, no slot");
    let free = each.rounds(&[0, 1, 2, 3, 4, 5], rounds, false).await?;

    eprintln!("wal floor: a pgoutput slot consumed by pg_recvlogical");
    for sql in [
        format!("CREATE PUBLICATION {SLOT} FOR TABLE {markers}_outbox"),
        format!("SELECT pg_create_logical_replication_slot('{SLOT}', 'pgoutput')::text"),
    ] {
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await?;
    }
    let mut consumer = consume(server)?;
    let consumed = async {
        streaming(pool, &mut consumer).await?;
        each.rounds(&CONSUMED, rounds, true).await
    }
    .await;
    if let Ok(Some(status)) = consumer.try_wait() {
        return Err(format!("pg_recvlogical ended ({status}) before the runs did").into());
    }
    consumer.kill().await?;
    let consumed = consumed?;

    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(pool)
        .await?;
    Ok(report(
        &version, quick, rounds, run, &bytes, &free, &consumed,
    ))
}

/// What every run shares.
struct Each<'a> {
    pool: &'a PgPool,
    pgbench: &'a Pgbench,
    scripts: &'a [PathBuf],
    markers: &'a str,
    length: PgbenchLength,
    postmaster: u32,
    ticks: f64,
}

impl Each<'_> {
    /// `rounds` rounds of `variants`, every other one in reverse order: each variant's runs.
    async fn rounds(
        &self,
        variants: &[usize],
        rounds: usize,
        consumed: bool,
    ) -> Res<Vec<Vec<Measured>>> {
        let mut runs: Vec<Vec<Measured>> = variants.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            let mut order: Vec<usize> = (0..variants.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let m = self.once(variants[i], consumed).await?;
                eprintln!(
                    "wal floor: round {round}: {}{}: {:.0} jobs/s, {:.0} WAL bytes and {:.0} \
                     server CPU µs a job{}",
                    VARIANTS[variants[i]].0,
                    if consumed { ", consumed" } else { "" },
                    m.rate,
                    m.wal,
                    m.cpu_us,
                    m.behind
                        .map(|b| format!(", decoder {:.0} kB behind", b / 1e3))
                        .unwrap_or_default()
                );
                runs[i].push(m);
            }
        }
        Ok(runs)
    }

    async fn once(&self, v: usize, consumed: bool) -> Res<Measured> {
        let start: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(self.pool)
            .await?;
        let cpu = server_cpu(self.postmaster, self.ticks)?;
        let tag = format!("wal{v}");
        let done = self
            .pgbench
            .run_script(&self.scripts[v], WORKERS, self.length, &tag)
            .await?;
        let wal: f64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8")
                .bind(&start)
                .fetch_one(self.pool)
                .await?;
        // pgbench's backends exit as it disconnects: once the postmaster has reaped them
        // their time is in its children's, and none is lost in between.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let cpu = server_cpu(self.postmaster, self.ticks)? - cpu;
        let behind = if consumed {
            // `sent_lsn` is as far as the walsender decoded and sent: the WAL after it is
            // what the relay would still have to read when the jobs stop.
            let sent: Option<f64> = sqlx::query_scalar(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), sent_lsn)::float8 \
                 FROM pg_stat_replication WHERE application_name = 'pg_recvlogical'",
            )
            .fetch_optional(self.pool)
            .await?
            .flatten();
            Some(sent.ok_or("pg_recvlogical no longer streams")?)
        } else {
            None
        };
        check(self.pool, self.markers, done.jobs, VARIANTS[v].1.rows()).await?;
        Ok(Measured {
            rate: done.jobs as f64 / done.secs,
            wal: wal / done.jobs as f64,
            cpu_us: cpu * 1e6 / done.jobs as f64,
            behind,
        })
    }
}

/// One transaction of `script` decoded through a `test_decoding` slot of its own: its
/// messages checked (the expected count, with idem's prefix, transactional, each whole JSON
/// with its id), then the bytes the job wrote for them (the emitted payloads, or the outbox
/// rows' tuples).
async fn decoded(
    pool: &PgPool,
    pgbench: &Pgbench,
    script: &Path,
    markers: &str,
    writes: Writes,
) -> Res<u64> {
    let check_slot = format!("{SLOT}_check");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT pg_create_logical_replication_slot('{check_slot}', 'test_decoding')::text"
    )))
    .execute(pool)
    .await?;
    let done = pgbench
        .run_script(script, 1, PgbenchLength::PerClient(1), "walcheck")
        .await?;
    let changes: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT data FROM pg_logical_slot_get_changes('{check_slot}', NULL, NULL)"
    )))
    .fetch_all(pool)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "SELECT pg_drop_replication_slot('{check_slot}')"
    )))
    .execute(pool)
    .await?;
    let head = format!("message: transactional: 1 prefix: {PREFIX}, sz: ");
    let mut documents = Vec::new();
    let mut emitted = 0;
    for line in changes.iter().filter_map(|l| l.strip_prefix(&head)) {
        let (size, content) = line
            .split_once(" content:")
            .ok_or_else(|| format!("a decoded message without content: {line}"))?;
        let size: u64 = size.parse()?;
        if size != content.len() as u64 {
            return Err(format!("a message of {size} bytes decoded as {content}").into());
        }
        emitted += size;
        match serde_json::from_str::<serde_json::Value>(content)? {
            serde_json::Value::Array(framed) => documents.extend(framed),
            one => documents.push(one),
        }
    }
    // (emitted messages, messages in them, outbox rows)
    let expected = match writes {
        Writes::Nothing => (0, 0, 0),
        Writes::Rows(n) => (0, 0, n),
        Writes::Emits(n) => (n, n, 0),
        Writes::Framed(n) => (1, n, 0),
    };
    let count = |head: &str| changes.iter().filter(|l| l.starts_with(head)).count();
    let found = (
        count(&head),
        documents.iter().filter(|d| d["id"].is_string()).count(),
        count(&format!("table public.{markers}_outbox: INSERT: ")),
    );
    if done.jobs != 1 || found != expected || documents.len() != expected.1 {
        return Err(format!(
            "one transaction of {} decoded as {changes:?}",
            script.display()
        )
        .into());
    }
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COALESCE(SUM(pg_column_size(o.*)), 0)::int8 FROM {markers}_outbox o"
    )))
    .fetch_one(pool)
    .await?;
    check(pool, markers, 1, writes.rows()).await?;
    Ok(emitted + rows as u64)
}

/// `pg_recvlogical` reading the slot as a relay would, with `pgoutput` (protocol 1, the
/// publication of the outbox table, logical decoding messages included), its flush position
/// reported every second so that the server can recycle what it read. Killed when dropped.
fn consume(server: &Server) -> Res<tokio::process::Child> {
    let program = server.bin().join("pg_recvlogical");
    let conninfo = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        server.port
    );
    let child = tokio::process::Command::new(&program)
        .args(["-d", &conninfo, "--slot", SLOT, "--start", "--no-loop"])
        .args(["-o", "proto_version=1"])
        .args(["-o", &format!("publication_names={SLOT}")])
        .args(["-o", "messages=true"])
        .args(["-s", "1", "-F", "1", "-f", "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    Ok(child)
}

/// Waits until the consumer's walsender streams.
async fn streaming(pool: &PgPool, consumer: &mut tokio::process::Child) -> Res<()> {
    // Polling a process coming up: readiness, not a measurement.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state: Option<String> = sqlx::query_scalar(
            "SELECT state FROM pg_stat_replication WHERE application_name = 'pg_recvlogical'",
        )
        .fetch_optional(pool)
        .await?;
        if state.as_deref() == Some("streaming") {
            return Ok(());
        }
        if let Some(status) = consumer.try_wait()? {
            return Err(format!("pg_recvlogical ended ({status}) before it streamed").into());
        }
        if Instant::now() > deadline {
            return Err(format!("pg_recvlogical did not stream within 30 s ({state:?})").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn report(
    version: &str,
    quick: bool,
    rounds: usize,
    run: Duration,
    bytes: &[u64],
    free: &[Vec<Measured>],
    consumed: &[Vec<Measured>],
) -> String {
    let medians = |runs: &[Measured]| {
        let of = |f: fn(&Measured) -> Option<f64>| {
            let v: Vec<f64> = runs.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(v))
        };
        (
            of(|m| Some(m.rate)).unwrap_or_default(),
            of(|m| Some(m.wal)).unwrap_or_default(),
            of(|m| Some(m.cpu_us)).unwrap_or_default(),
            of(|m| m.behind),
        )
    };
    let length = if quick {
        "50 transactions a client".to_owned()
    } else {
        format!("{} s", run.as_secs().max(1))
    };
    let mut out = format!(
        "## The outbox through the WAL: the handler's side (PostgreSQL {version} of the \
         bench's own, wal_level = logical, fsync and synchronous_commit on; pgbench -M \
         prepared, {WORKERS} clients; {rounds} rounds of {length}, medians)\n\n\
         | job | jobs/s | vs (a) | WAL bytes a job | server CPU µs a job | message bytes a job \
         | decoder behind at the end |\n\
         |---|---:|---:|---:|---:|---:|---:|\n"
    );
    let mut rows = |runs: &[Vec<Measured>], variants: &[usize], suffix: &str| {
        let base = medians(&runs[0]).0;
        for (i, &v) in variants.iter().enumerate() {
            let (rate, wal, cpu, behind) = medians(&runs[i]);
            let _ = writeln!(
                out,
                "| {}{suffix} | {rate:.0} | {:.2} | {wal:.0} | {cpu:.0} | {} | {} |",
                VARIANTS[v].0,
                rate / base,
                bytes[v],
                behind.map_or("".to_owned(), |b| format!("{:.0} kB", b / 1e3)),
            );
        }
    };
    rows(free, &[0, 1, 2, 3, 4, 5], "");
    rows(consumed, &CONSUMED, ", slot consumed");
    out.push_str(
        "\nWith the slot consumed, `vs (a)` is to (a) with the slot consumed. Message bytes: \
         the emitted payloads, or the outbox rows' tuples (`pg_column_size`). The decoder's \
         lag is `pg_current_wal_lsn()` less the walsender's `sent_lsn` as the run ended. Server \
         CPU: the postmaster's processes' user and system time over the run (the walsender's \
         included, `pg_recvlogical`'s not), by transaction.\n",
    );
    out
}
