//! The checks, in the order they run: each reads what it needs and gives one [`Finding`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::schema::{Expected, expected};
use super::{Checkup, Diagnosis, Finding, Severity};
use crate::backend::Backend;
use crate::backend::{Bloat, COUNT_CAP};
use crate::error::Error;
use crate::store::Store;

/// `n`, or "at least `n`" when a count reached [`COUNT_CAP`].
fn count(n: i64) -> String {
    if n >= COUNT_CAP {
        format!("at least {n}")
    } else {
        n.to_string()
    }
}

/// A duration as an operator writes it: `90s`, `30m`, `12h`, `7d`.
fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        _ if s.is_multiple_of(86_400) && s > 0 => format!("{}d", s / 86_400),
        _ if s.is_multiple_of(3_600) && s > 0 => format!("{}h", s / 3_600),
        _ if s.is_multiple_of(60) && s > 0 => format!("{}m", s / 60),
        _ if d.subsec_millis() == 0 => format!("{s}s"),
        _ => format!("{}ms", d.as_millis()),
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(super) async fn run<DB: Backend>(
    store: &Store<DB>,
    checkup: &Checkup,
) -> Result<Diagnosis, Error> {
    let (pool, sql) = (store.pool(), store.sql());
    let table = store.table().to_owned();
    let mut findings = Vec::new();

    let (tables, indexes, columns) = sql.catalog(pool).await?;
    let want = expected(&store.ddl());
    let has_table = |t: &str| tables.iter().any(|x| x.eq_ignore_ascii_case(t));
    findings.push(schema(&want, &has_table, &columns, store));
    findings.push(index_check(&want, &has_table, &indexes));
    let markers = has_table(&table);
    let outbox = has_table(&format!("{table}_outbox"));
    let windows = has_table(&format!("{table}_retention"));
    let absent = |check| {
        Finding::new(
            check,
            Severity::Skipped,
            "not checked: the table it reads is missing (see `schema`)",
        )
    };

    if markers {
        findings.push(bloat(&table, sql.bloat(pool).await?));
    } else {
        findings.push(absent("bloat"));
    }
    if markers && windows {
        findings.push(retention(store, checkup).await?);
    } else {
        findings.push(absent("retention"));
    }
    if markers {
        let stuck = sql.count_stuck(pool, ms(checkup.stuck_after)).await?;
        findings.push(leases(stuck, checkup));
    } else {
        findings.push(absent("leases"));
    }
    if outbox {
        let (parked, overdue) = sql.count_outbox(pool, ms(checkup.relay_lag)).await?;
        findings.push(outbox_check(parked, overdue, checkup));
    } else {
        findings.push(absent("outbox"));
    }
    let pool_size = checkup
        .pool_size
        .unwrap_or_else(|| pool.options().get_max_connections());
    let server_max = sql.max_connections(pool).await?;
    findings.push(pool_check(pool_size, checkup.concurrency, server_max));
    findings.push(ack_timeout(checkup));
    findings.push(pooler(sql.ports(pool).await?, sql.table.is_unnamed()));
    let before = SystemTime::now();
    let db_ms = sql.clock_ms(pool).await?;
    let after = SystemTime::now();
    findings.push(clock(db_ms, before, after, checkup.clock_tolerance));
    let slots = sql.slots(pool).await?;
    findings.push(super::slots::slots(slots, checkup.slot_lag));
    Ok(Diagnosis { table, findings })
}

fn schema<DB: Backend>(
    want: &[Expected],
    has_table: &dyn Fn(&str) -> bool,
    columns: &[(String, String)],
    store: &Store<DB>,
) -> Finding {
    let missing: Vec<&Expected> = want
        .iter()
        .filter(|e| e.index.is_none() && !has_table(&e.table))
        .collect();
    if missing.is_empty() {
        return schema_columns(want, has_table, columns);
    }
    let names: Vec<&str> = missing.iter().map(|e| e.table.as_str()).collect();
    let severity = Severity::Problem;
    let summary = if has_table(store.table()) {
        format!(
            "missing tables: {} (the schema is older than this version of idem)",
            names.join(", ")
        )
    } else {
        format!(
            "the marker table {} does not exist (missing: {}); handlers on this table fail",
            store.table(),
            names.join(", ")
        )
    };
    Finding::new("schema", severity, summary).fix(
        "call `Store::migrate()` at start-up, or run the statements of `Store::ddl()` \
         (schema/<database>.sql; the upgrade files schema/<database>.v*-to-v*.sql) in your \
         migrations; if the table should exist, check the name the handlers' store was given \
         with `Store::with_table` (`idem --table`)",
    )
}

/// The schema's tables are there: whether each has the columns of this version (a column a
/// later version added to a table an earlier one made is missing until `migrate` adds it).
fn schema_columns(
    want: &[Expected],
    has_table: &dyn Fn(&str) -> bool,
    columns: &[(String, String)],
) -> Finding {
    let has = |table: &str, column: &str| {
        columns
            .iter()
            .any(|(t, c)| t.eq_ignore_ascii_case(table) && c.eq_ignore_ascii_case(column))
    };
    let missing: Vec<String> = want
        .iter()
        .filter(|e| e.index.is_none() && has_table(&e.table))
        .flat_map(|e| {
            e.columns
                .iter()
                .filter(|c| !has(&e.table, c))
                .map(|c| format!("{}.{c}", e.table))
        })
        .collect();
    if missing.is_empty() {
        return Finding::new(
            "schema",
            Severity::Ok,
            format!("every table of the schema is there ({})", want_tables(want)),
        );
    }
    Finding::new(
        "schema",
        Severity::Problem,
        format!(
            "missing columns: {} (the tables are older than this version of idem)",
            missing.join(", ")
        ),
    )
    .fix(
        "call `Store::migrate()` at start-up (it adds the missing columns), or run the upgrade \
         files schema/<database>.v*-to-v*.sql in your migrations",
    )
}

fn want_tables(want: &[Expected]) -> String {
    let names: Vec<&str> = want
        .iter()
        .filter(|e| e.index.is_none())
        .map(|e| e.table.as_str())
        .collect();
    names.join(", ")
}

fn index_check(
    want: &[Expected],
    has_table: &dyn Fn(&str) -> bool,
    indexes: &[(String, String)],
) -> Finding {
    let missing: Vec<&Expected> = want
        .iter()
        .filter(|e| has_table(&e.table))
        .filter(|e| {
            e.index.as_deref().is_some_and(|name| {
                !indexes
                    .iter()
                    .any(|(t, i)| t.eq_ignore_ascii_case(&e.table) && i.eq_ignore_ascii_case(name))
            })
        })
        .collect();
    if missing.is_empty() {
        return Finding::new(
            "indexes",
            Severity::Ok,
            "every index of the schema is there",
        );
    }
    let names: Vec<String> = missing
        .iter()
        .map(|e| format!("{} on {}", e.index.as_deref().unwrap_or_default(), e.table))
        .collect();
    let statements: Vec<&str> = missing.iter().map(|e| e.statement.as_str()).collect();
    Finding::new(
        "indexes",
        Severity::Problem,
        format!(
            "missing indexes: {} (purge and the relay scan the whole table without them)",
            names.join(", ")
        ),
    )
    .fix(format!(
        "run: {}; (PostgreSQL: add CONCURRENTLY after CREATE INDEX to build it without \
         blocking writes)",
        statements.join("; ")
    ))
}

fn bloat(table: &str, measured: Option<Bloat>) -> Finding {
    let Some(measured) = measured else {
        return Finding::new(
            "bloat",
            Severity::Skipped,
            "not measurable: the database keeps no statistics of this table yet",
        );
    };
    let (bloated, summary, fix) = match measured {
        Bloat::Rows { dead, live } => (
            dead > 10_000 && dead * 5 > live,
            format!("{dead} dead row versions beside {live} live ones"),
            format!(
                "VACUUM (ANALYZE) {table}; if it comes back, let autovacuum visit the table \
                 sooner (ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = 0.05)): \
                 purge deletes in batches"
            ),
        ),
        Bloat::Bytes { free, used } => (
            free > 64 << 20 && free * 2 > used,
            format!("{free} bytes free in the table's space beside {used} in use"),
            format!("OPTIMIZE TABLE {table} (an online rebuild on InnoDB)"),
        ),
        Bloat::Pages { free, total } => (
            free > 1_000 && free * 4 > total,
            format!("{free} free pages of {total} in the database file"),
            "VACUUM (it rewrites the file and holds the write lock while it runs), or \
             PRAGMA auto_vacuum = INCREMENTAL with PRAGMA incremental_vacuum after purges"
                .to_owned(),
        ),
    };
    match bloated {
        true => Finding::new("bloat", Severity::Warning, summary).fix(fix),
        false => Finding::new("bloat", Severity::Ok, summary),
    }
}

async fn retention<DB: Backend>(store: &Store<DB>, checkup: &Checkup) -> Result<Finding, Error> {
    let (pool, sql) = (store.pool(), store.sql());
    let windows = store.retentions().await?;
    let mut old = Vec::new();
    for window in &windows {
        let n = sql
            .count_old(pool, Some(&window.scope), ms(window.keep))
            .await?;
        if n > 0 {
            old.push(format!(
                "{} of {} (window {})",
                count(n),
                window.scope,
                age(window.keep)
            ));
        }
    }
    if let Some(default) = checkup.retention {
        let n = sql.count_old(pool, None, ms(default)).await?;
        if n > 0 {
            old.push(format!(
                "{} of other scopes (older than {})",
                count(n),
                age(default)
            ));
        }
    } else if windows.is_empty() {
        return Ok(Finding::new(
            "retention",
            Severity::Skipped,
            "no retention given and no scope has a window: give the age purge runs with \
             (`--retention`, `Checkup::retention`)",
        ));
    }
    if old.is_empty() {
        return Ok(Finding::new(
            "retention",
            Severity::Ok,
            "no completed marker is older than its retention",
        ));
    }
    Ok(Finding::new(
        "retention",
        Severity::Warning,
        format!(
            "completed markers older than their retention: {}; purge is not running, or not \
             often enough, and the table keeps growing",
            old.join(", ")
        ),
    )
    .fix(
        "run `idem purge --older-than AGE` (it honours each scope's window) from cron, or \
         `Store::purge` on a timer, more often than the shortest window",
    ))
}

fn leases(stuck: i64, checkup: &Checkup) -> Finding {
    let after = age(checkup.stuck_after);
    if stuck == 0 {
        return Finding::new(
            "leases",
            Severity::Ok,
            format!("no lease stuck in progress for more than {after}"),
        );
    }
    Finding::new(
        "leases",
        Severity::Warning,
        format!(
            "{} markers in progress whose lease ran out (or was released) more than {after} \
             ago, and no delivery took them over: their jobs were not redelivered (a dead \
             letter queue, a broker that gave up, a job dropped by hand)",
            count(stuck)
        ),
    )
    .fix(
        "`idem stuck` lists them; redeliver each job (the next delivery takes the lease over \
         with the same idempotency key), or `idem forget` those known to be done elsewhere",
    )
}

fn outbox_check(parked: i64, overdue: i64, checkup: &Checkup) -> Finding {
    if parked > 0 {
        return Finding::new(
            "outbox",
            Severity::Problem,
            format!(
                "{} outbox messages are parked: the relay gave up on them, and their \
                 consumers never get them ({} more overdue)",
                count(parked),
                count(overdue)
            ),
        )
        .fix(
            "`idem outbox list --parked` shows each one's last error; fix its cause (a \
             missing queue or stream, a refused payload), then `idem outbox requeue ID`, or \
             `idem outbox requeue --all` with a filter for many",
        );
    }
    if overdue > 0 {
        return Finding::new(
            "outbox",
            Severity::Warning,
            format!(
                "{} outbox messages waited more than {} past their due time: no relay is \
                 running, or it falls behind",
                count(overdue),
                age(checkup.relay_lag)
            ),
        )
        .fix(
            "start `idem::outbox::Relay` (one per deployment at least), or give it larger rounds",
        );
    }
    Finding::new(
        "outbox",
        Severity::Ok,
        "no parked or overdue outbox message",
    )
}

fn pool_check(pool: u32, concurrency: Option<u32>, server_max: Option<i64>) -> Finding {
    if let Some(max) = server_max
        && i64::from(pool) > max
    {
        return Finding::new(
            "pool",
            Severity::Problem,
            format!("a pool of {pool} connections against a server limit of {max}"),
        )
        .fix(
            "lower the pool's max_connections (and count every worker's pool against the \
             server's limit), or raise the server's",
        );
    }
    let Some(jobs) = concurrency else {
        return Finding::new(
            "pool",
            Severity::Skipped,
            format!(
                "a pool of {pool} connections; give the jobs run at once (`--concurrency`, \
                 `Checkup::concurrency`) to check it against them"
            ),
        );
    };
    if pool <= jobs {
        return Finding::new(
            "pool",
            Severity::Warning,
            format!(
                "a pool of {pool} connections for {jobs} jobs at once: jobs wait for a \
                 connection, and a job waiting with its claim open holds up others"
            ),
        )
        .fix(format!(
            "give the pool {} connections, one more than the jobs it runs at once: build it \
             from `Store::pool_options({jobs})` (the `Store` docs, \"Pool settings\")",
            jobs + 1
        ));
    }
    Finding::new(
        "pool",
        Severity::Ok,
        format!("a pool of {pool} connections for {jobs} jobs at once"),
    )
}

fn ack_timeout(checkup: &Checkup) -> Finding {
    let Some(ack) = checkup.ack_timeout else {
        return Finding::new(
            "ack_timeout",
            Severity::Skipped,
            "give the broker's ack timeout (`--ack-timeout`, `Checkup::ack_timeout`) to \
             check `wait` and the lease against it",
        );
    };
    if let Some(wait) = checkup.wait
        && wait >= ack
    {
        return Finding::new(
            "ack_timeout",
            Severity::Problem,
            format!(
                "`wait` ({}) is not shorter than the broker's ack timeout ({}): the broker \
                 hands the job to another consumer while this one still waits for its key",
                age(wait),
                age(ack)
            ),
        )
        .fix("make `wait` a fraction of the ack timeout (a few seconds), or lengthen the timeout");
    }
    if let Some(lease) = checkup.lease
        && lease >= ack
    {
        return Finding::new(
            "ack_timeout",
            Severity::Warning,
            format!(
                "the lease ({}) outlasts the broker's ack timeout ({}): the broker redelivers \
                 jobs still running, and those deliveries are answered InProgress and nacked",
                age(lease),
                age(ack)
            ),
        )
        .fix(
            "lengthen the ack timeout beyond the lease (SQS: extend the message's \
             visibility while the lease is renewed), or shorten the lease and renew it",
        );
    }
    Finding::new(
        "ack_timeout",
        Severity::Ok,
        format!("`wait` and the lease fit in the ack timeout ({})", age(ack)),
    )
}

fn pooler(ports: Option<(u16, i64)>, told: bool) -> Finding {
    match ports {
        Some((ours, server)) if i64::from(ours) != server && told => Finding::new(
            "pooler",
            Severity::Ok,
            format!(
                "the pool connects to port {ours} and the server listens on {server}: a \
                 pooler is in between, and the store was told (`behind_transaction_pooler`)"
            ),
        ),
        Some((ours, server)) if i64::from(ours) != server => Finding::new(
            "pooler",
            Severity::Warning,
            format!(
                "the pool connects to port {ours} and the server listens on {server}: a \
                 pooler or proxy is in between (PgBouncer, say)"
            ),
        )
        .fix(
            "behind a pooler in transaction mode (PgBouncer's pool_mode = transaction), call \
             `Store::behind_transaction_pooler()`: sqlx's named statements, statements with \
             binds outside a transaction and the relay's LISTEN do not work there \
             (docs/scaling.md); in session mode nothing needs to change",
        ),
        Some((ours, _)) => Finding::new(
            "pooler",
            Severity::Ok,
            format!("the pool talks to the server itself (port {ours})"),
        ),
        None => Finding::new(
            "pooler",
            Severity::Skipped,
            "not measurable here (PostgreSQL over TCP only)",
        ),
    }
}

fn clock(
    db_ms: Option<i64>,
    before: SystemTime,
    after: SystemTime,
    tolerance: Duration,
) -> Finding {
    let Some(db_ms) = db_ms else {
        return Finding::new(
            "clock",
            Severity::Skipped,
            "the database runs in this process: its clock is this host's",
        );
    };
    let at = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    };
    let (before, after) = (at(before), at(after));
    let mid = before + (after - before) / 2;
    let skew = db_ms - mid;
    let allowed = ms(tolerance) + (after - before) / 2;
    if skew.abs() <= allowed {
        return Finding::new(
            "clock",
            Severity::Ok,
            format!("the database's clock is within {allowed} ms of this host's"),
        );
    }
    Finding::new(
        "clock",
        Severity::Warning,
        format!(
            "the database's clock is {} ms {} this host's",
            skew.abs(),
            if skew > 0 { "ahead of" } else { "behind" }
        ),
    )
    .fix(
        "leases run on the database's clock, so they stay correct; but `Lease::remaining`, \
         the times `idem stuck` prints and your logs disagree by that much: run NTP (chrony, \
         systemd-timesyncd) on both hosts",
    )
}

#[cfg(test)]
#[path = "checks_tests.rs"]
mod tests;
