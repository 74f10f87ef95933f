//! The checker: what the databases, the brokers and the payments API hold once the run has
//! drained, against what the jobs say they must hold; and the run's table.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

use crate::faults::Ran;
use crate::harness::{CONSUMER, Env, QUEUE, STREAM};
use crate::jobs::{CHARGE_SCOPE, Db, EFFECT_SCOPE, Job, Mode};
use crate::servers::{Res, until};

/// A marker as the checker reads it: key, state, attempts, lease past its expiry.
type Marker = (String, String, i64, bool);

struct Db2 {
    effects: HashMap<String, i64>,
    markers: HashMap<(String, String), Marker>,
}

async fn read_pg(env: &Env) -> Res<Db2> {
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT job, count(*) FROM chaos_effects GROUP BY job")
            .fetch_all(&env.pg_admin)
            .await
            .map_err(|e| e.to_string())?;
    let markers: Vec<(String, String, String, i32, bool)> = sqlx::query_as(
        "SELECT scope, key, state, attempts, coalesce(locked_until < now(), false) \
         FROM idem_processed",
    )
    .fetch_all(&env.pg_admin)
    .await
    .map_err(|e| e.to_string())?;
    Ok(Db2 {
        effects: effects.into_iter().collect(),
        markers: markers
            .into_iter()
            .map(|(s, k, st, a, past)| ((s, k.clone()), (k, st, i64::from(a), past)))
            .collect(),
    })
}

async fn read_my(env: &Env) -> Res<Db2> {
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT job, count(*) FROM chaos_effects GROUP BY job")
            .fetch_all(&env.my_admin)
            .await
            .map_err(|e| e.to_string())?;
    let markers: Vec<(String, String, String, i32, i64)> = sqlx::query_as(
        "SELECT CAST(scope AS CHAR), CAST(`key` AS CHAR), state, attempts, \
         CAST(COALESCE(locked_until < NOW(6), 0) AS SIGNED) FROM idem_processed",
    )
    .fetch_all(&env.my_admin)
    .await
    .map_err(|e| e.to_string())?;
    Ok(Db2 {
        effects: effects.into_iter().collect(),
        markers: markers
            .into_iter()
            .map(|(s, k, st, a, past)| ((s, k.clone()), (k, st, i64::from(a), past != 0)))
            .collect(),
    })
}

/// The PostgreSQL transactions that committed the effects of several single-job deliveries
/// (rows sharing their transaction's start, batches left out): group commits that held more
/// than one job. Their number, the jobs in them, the most in one.
async fn shared_commits(env: &Env) -> Res<(i64, i64, i64)> {
    sqlx::query_as(
        "SELECT count(*), coalesce(sum(n), 0)::bigint, coalesce(max(n), 0) FROM \
         (SELECT count(*) AS n FROM chaos_effects WHERE via <> 'batch' \
          GROUP BY began HAVING count(*) > 1) AS shared",
    )
    .fetch_one(&env.pg_admin)
    .await
    .map_err(|e| e.to_string())
}

fn scope(job: &Job) -> &'static str {
    match job.mode {
        Mode::Tx | Mode::Group => EFFECT_SCOPE,
        Mode::Lease => CHARGE_SCOPE,
    }
}

async fn queue_state(env: &Env) -> Res<(u32, u32)> {
    let conn = Connection::connect(&env.rabbit.url(), ConnectionProperties::default())
        .await
        .map_err(|e| e.to_string())?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let q = ch
        .queue_declare(QUEUE.into(), passive, FieldTable::default())
        .await
        .map_err(|e| e.to_string())?;
    drop(conn.close(200, "checked".into()).await);
    Ok((q.message_count(), q.consumer_count()))
}

async fn consumer_state(env: &Env) -> Res<(u64, usize)> {
    let stream = env.js.get_stream(STREAM).await.map_err(|e| e.to_string())?;
    let mut consumer: PullConsumer = stream
        .get_consumer(CONSUMER)
        .await
        .map_err(|e| e.to_string())?;
    let info = consumer.info().await.map_err(|e| e.to_string())?;
    Ok((info.num_pending, info.num_ack_pending))
}

/// Every job's marker completed, the queue empty, nothing pending on the consumer.
pub async fn drained(env: &Env, jobs: &[Job]) -> Res<bool> {
    let (pg, my) = (read_pg(env).await?, read_my(env).await?);
    let done = jobs.iter().all(|job| {
        let db = if job.db == Db::Pg { &pg } else { &my };
        db.markers
            .get(&(scope(job).to_owned(), job.id.clone()))
            .is_some_and(|m| m.1 == "completed")
    });
    Ok(done && queue_state(env).await?.0 == 0 && consumer_state(env).await? == (0, 0))
}

/// Once the workers are dead: RabbitMQ requeues what a dead consumer had not acked, so an
/// empty queue with no consumer left means every message was acked; JetStream's consumer
/// must have nothing pending or awaiting an ack.
pub async fn all_acked(env: &Env) -> Res<()> {
    until(
        Duration::from_secs(60),
        "RabbitMQ to drop the dead workers' consumers",
        || async {
            queue_state(env)
                .await
                .is_ok_and(|(_, consumers)| consumers == 0)
        },
    )
    .await?;
    let (ready, _) = queue_state(env).await?;
    let (pending, ack_pending) = consumer_state(env).await?;
    if ready != 0 || pending != 0 || ack_pending != 0 {
        return Err(format!(
            "not every message was acked: {ready} back in the RabbitMQ queue, JetStream \
             {pending} pending and {ack_pending} awaiting an ack"
        ));
    }
    Ok(())
}

pub struct Report {
    pub violations: Vec<String>,
}

pub async fn check(env: &Env, jobs: &[Job], ran: &Ran, published: u64, print: bool) -> Res<Report> {
    let faults = &ran.applied;
    let (pg, my) = (read_pg(env).await?, read_my(env).await?);
    let (groups, grouped, largest) = shared_commits(env).await?;
    let ledger = env.payments.ledger();
    let tally = env.fleet.tally.lock().unwrap_or_else(|e| e.into_inner());
    let mut v = Vec::new();
    let mut takeovers = 0;
    for job in jobs {
        let db = if job.db == Db::Pg { &pg } else { &my };
        let marker = db.markers.get(&(scope(job).to_owned(), job.id.clone()));
        match marker {
            Some((_, state, attempts, past)) => {
                if state != "completed" {
                    let expiry = if *past { ", past its expiry" } else { "" };
                    v.push(format!("{}: marker left {state}{expiry}", job.id));
                }
                if job.mode == Mode::Lease {
                    takeovers += attempts - 1;
                }
            }
            None => v.push(format!("{}: no marker", job.id)),
        }
        let effects = db.effects.get(&job.id).copied().unwrap_or(0);
        let charges = ledger.charges.get(&job.id).copied().unwrap_or(0);
        match job.mode {
            Mode::Tx | Mode::Group if effects != 1 => {
                v.push(format!("{}: {effects} effects", job.id))
            }
            Mode::Lease if charges != 1 => v.push(format!("{}: charged {charges} times", job.id)),
            Mode::Lease if effects != 0 => v.push(format!("{}: a lease job wrote effects", job.id)),
            _ => {}
        }
        if let Some(n @ 2..) = tally.applied.get(&job.id) {
            v.push(format!("{}: Applied returned {n} times", job.id));
        }
    }
    let ids: std::collections::HashSet<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
    for (name, db) in [("PostgreSQL", &pg), ("MariaDB", &my)] {
        let effects: i64 = db.effects.values().sum();
        let completed = db.markers.values().filter(|m| m.1 == "completed").count();
        let tx_jobs = db.markers.keys().filter(|(s, _)| s == EFFECT_SCOPE).count();
        if db.effects.keys().any(|k| !ids.contains(k.as_str())) {
            v.push(format!("{name}: effects of jobs never published"));
        }
        if usize::try_from(effects).ok() != Some(tx_jobs) {
            v.push(format!(
                "{name}: {effects} effect rows for {tx_jobs} transaction-mode markers"
            ));
        }
        if print {
            println!("  {name}: {completed} markers completed, {effects} effect rows");
        }
    }
    let lease_jobs = jobs.iter().filter(|j| j.mode == Mode::Lease).count();
    if ledger.by_key.len() != lease_jobs {
        v.push(format!(
            "the payments API saw {} keys for {lease_jobs} lease jobs",
            ledger.by_key.len()
        ));
    }

    let mut by_kind: BTreeMap<&str, (u64, Duration)> = BTreeMap::new();
    let mut longest = Duration::ZERO;
    for fault in faults {
        let gap = tally
            .applied_at
            .iter()
            .find(|t| **t >= fault.at)
            .map(|t| t.duration_since(fault.at));
        let entry = by_kind.entry(fault.kind).or_default();
        entry.0 += 1;
        if let Some(gap) = gap {
            entry.1 = entry.1.max(gap);
            longest = longest.max(gap);
        }
    }
    if !print {
        return Ok(Report { violations: v });
    }
    let count = |db: Db, mode: Mode| jobs.iter().filter(|j| j.db == db && j.mode == mode).count();
    println!("| what | count |");
    println!("|---|---:|");
    println!(
        "| jobs (PostgreSQL tx / group / lease, MariaDB tx / group / lease) | {} ({} / {} / {}, {} / {} / {}) |",
        jobs.len(),
        count(Db::Pg, Mode::Tx),
        count(Db::Pg, Mode::Group),
        count(Db::Pg, Mode::Lease),
        count(Db::My, Mode::Tx),
        count(Db::My, Mode::Group),
        count(Db::My, Mode::Lease)
    );
    println!("| messages published (every job at least twice) | {published} |");
    println!(
        "| deliveries (redelivered flag) | {} ({}) |",
        tally.deliveries, tally.redeliveries
    );
    println!(
        "| duplicates suppressed (acked without running) | {} |",
        tally.duplicates
    );
    let nacks: u64 = tally.nacks.values().sum();
    let mut kinds: Vec<_> = tally.nacks.iter().collect();
    kinds.sort();
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!("| nacks ({}) | {nacks} |", kinds.join(", "));
    println!("| lease takeovers and retries (attempts - 1) | {takeovers} |");
    println!(
        "| PostgreSQL group commits of several jobs (their jobs, the largest) | {groups} ({grouped}, {largest}) |"
    );
    println!(
        "| payments API: requests / charges / answers replayed | {} / {} / {} |",
        ledger.attempts,
        ledger.charges.values().sum::<u64>(),
        ledger.replayed
    );
    println!("| worker starts | {} |", tally.starts);
    println!(
        "| faults applied (skipped: nothing to act on; failed) | {} ({}; {}) |",
        faults.len(),
        ran.skipped,
        ran.failed
    );
    for (kind, (n, gap)) in &by_kind {
        println!(
            "| - {kind} (longest to the next applied job) | {n} ({:.2} s) |",
            gap.as_secs_f64()
        );
    }
    println!(
        "| longest time from a fault to the next applied job | {:.2} s |",
        longest.as_secs_f64()
    );
    println!("| violations | {} |", v.len());
    Ok(Report { violations: v })
}

/// The checker checked: after a passing run, one violation of each kind is planted (an effect
/// row written twice, for a transaction-mode job and for a group-commit one, a lease marker set back to `in_progress` past its expiry, a second
/// charge at the payments API, a second `Applied` reported for a job), and the checker must
/// report each of them. Returns what it missed.
pub async fn self_check(env: &Env, jobs: &[Job], ran: &Ran, published: u64) -> Res<Vec<String>> {
    let pick = |db: Db, mode: Mode| {
        jobs.iter()
            .find(|j| j.db == db && j.mode == mode)
            .map(|j| j.id.clone())
            .ok_or("too few jobs for the checker's own check")
    };
    let (twice, stuck, charged, reported, grouped) = (
        pick(Db::Pg, Mode::Tx)?,
        pick(Db::My, Mode::Lease)?,
        pick(Db::Pg, Mode::Lease)?,
        pick(Db::My, Mode::Tx)?,
        pick(Db::My, Mode::Group)?,
    );
    sqlx::query("INSERT INTO chaos_effects (job, via) VALUES ($1, 'planted')")
        .bind(&twice)
        .execute(&env.pg_admin)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query("INSERT INTO chaos_effects (job, via) VALUES (?, 'planted')")
        .bind(&grouped)
        .execute(&env.my_admin)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query(
        "UPDATE idem_processed SET state = 'in_progress', \
         locked_until = NOW(6) - INTERVAL 1 SECOND WHERE scope = ? AND `key` = ?",
    )
    .bind(CHARGE_SCOPE)
    .bind(&stuck)
    .execute(&env.my_admin)
    .await
    .map_err(|e| e.to_string())?;
    env.payments.plant_charge(&charged);
    *env.fleet
        .tally
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .applied
        .entry(reported.clone())
        .or_default() += 1;
    let found = check(env, jobs, ran, published, false).await?.violations;
    let expected = [
        format!("{twice}: 2 effects"),
        format!("{stuck}: marker left in_progress, past its expiry"),
        format!("{charged}: charged 2 times"),
        format!("{reported}: Applied returned 2 times"),
        format!("{grouped}: 2 effects"),
    ];
    let missed: Vec<String> = expected
        .into_iter()
        .filter(|e| !found.contains(e))
        .map(|e| format!("the checker missed a planted violation: {e}"))
        .collect();
    println!(
        "checker's own check: {} planted violations, {} reported ({} missed)",
        5,
        found.len(),
        missed.len()
    );
    Ok(missed)
}
