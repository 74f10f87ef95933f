//! The fault schedule: drawn from the seed before the run starts (so that a seed names one
//! schedule), then applied at its times. A fault that takes something away (a killed worker,
//! a stopped one, a server down, a frozen connection) schedules its own repair after a drawn
//! delay, so that faults overlap.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::harness::Env;
use crate::rng::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Pg,
    My,
    Amqp,
}

#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// SIGKILL of a worker, started again after `down`.
    KillWorker {
        worker: usize,
        down: Duration,
    },
    /// SIGSTOP of a worker, SIGCONT after `hold`.
    StopWorker {
        worker: usize,
        hold: Duration,
    },
    /// `pg_terminate_backend` of every worker session.
    TerminatePg,
    /// MariaDB `KILL CONNECTION` of every worker session.
    KillMyConnections,
    /// `pg_ctl stop -m immediate` of the owned cluster, started again after `down`.
    RestartPg {
        down: Duration,
    },
    /// SIGKILL of the owned `mariadbd`, started again after `down`.
    RestartMy {
        down: Duration,
    },
    /// SIGKILL of the owned RabbitMQ node, started again after `down`.
    RestartRabbit {
        down: Duration,
    },
    /// SIGKILL of the JetStream stream's leader, started again after `down`.
    KillNatsLeader {
        down: Duration,
    },
    Latency {
        target: Target,
        ms: u64,
        hold: Duration,
    },
    Reset {
        target: Target,
    },
    /// Every `nth` connection left half-open for `hold`, then reset.
    HalfOpen {
        target: Target,
        nth: usize,
        hold: Duration,
    },
}

impl Fault {
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillWorker { .. } => "worker SIGKILL",
            Fault::StopWorker { .. } => "worker SIGSTOP/SIGCONT",
            Fault::TerminatePg => "pg_terminate_backend",
            Fault::KillMyConnections => "MariaDB KILL CONNECTION",
            Fault::RestartPg { .. } => "PostgreSQL restart (immediate)",
            Fault::RestartMy { .. } => "MariaDB SIGKILL + restart",
            Fault::RestartRabbit { .. } => "RabbitMQ node SIGKILL + restart",
            Fault::KillNatsLeader { .. } => "JetStream leader SIGKILL + restart",
            Fault::Latency { .. } => "proxy latency",
            Fault::Reset { .. } => "proxy reset (RST)",
            Fault::HalfOpen { .. } => "proxy half-open",
        }
    }
}

fn target(rng: &mut Rng) -> Target {
    [Target::Pg, Target::My, Target::Amqp][rng.range(0, 3) as usize]
}

/// The schedule of a run of `duration` with `workers` workers, from `seed`.
pub fn schedule(seed: u64, duration: Duration, workers: usize) -> Vec<(Duration, Fault)> {
    let mut rng = Rng::new(seed);
    let workers = workers as u64;
    let end = duration.saturating_sub(Duration::from_secs(3));
    let mut at = Duration::from_secs(2);
    let mut faults = Vec::new();
    // The servers' restarts and half-open connections, at least once each per run, at drawn times in the first 80 %:
    // the random faults below make the rest.
    let span = duration.as_millis() as u64 * 8 / 10;
    for fault in [
        Fault::RestartPg {
            down: rng.millis(300, 2000),
        },
        Fault::RestartMy {
            down: rng.millis(300, 2000),
        },
        Fault::RestartRabbit {
            down: rng.millis(300, 2000),
        },
        Fault::KillNatsLeader {
            down: rng.millis(1000, 5000),
        },
        // The workers' database connections are there most of the time (the AMQP ones are
        // not while the node restarts), so that a short run leaves some half-open too.
        Fault::HalfOpen {
            target: Target::Pg,
            nth: 2,
            hold: rng.millis(1000, 12_000),
        },
        Fault::HalfOpen {
            target: Target::My,
            nth: 2,
            hold: rng.millis(1000, 12_000),
        },
    ] {
        faults.push((
            Duration::from_millis(rng.range(3000, span.max(3001))),
            fault,
        ));
    }
    loop {
        at += rng.millis(400, 2500);
        if at >= end {
            break;
        }
        let worker = rng.range(0, workers) as usize;
        let fault = match rng.range(0, 100) {
            0..25 => Fault::KillWorker {
                worker,
                down: rng.millis(100, 2500),
            },
            25..40 => Fault::StopWorker {
                worker,
                hold: rng.millis(500, 7000),
            },
            40..48 => Fault::TerminatePg,
            48..56 => Fault::KillMyConnections,
            56..66 => Fault::Latency {
                target: target(&mut rng),
                ms: rng.range(5, 200),
                hold: rng.millis(500, 4000),
            },
            66..76 => Fault::Reset {
                target: target(&mut rng),
            },
            76..86 => Fault::HalfOpen {
                target: target(&mut rng),
                nth: rng.range(1, 4) as usize,
                hold: rng.millis(1000, 12_000),
            },
            86..91 => Fault::RestartPg {
                down: rng.millis(300, 2000),
            },
            91..96 => Fault::RestartMy {
                down: rng.millis(300, 2000),
            },
            96..98 => Fault::KillNatsLeader {
                down: rng.millis(1000, 5000),
            },
            _ => Fault::RestartRabbit {
                down: rng.millis(300, 2000),
            },
        };
        faults.push((at, fault));
    }
    faults.sort_by_key(|(at, _)| *at);
    faults
}

/// A fault that was applied, and when.
pub struct Applied {
    pub kind: &'static str,
    pub at: Instant,
}

/// What the schedule did: faults applied; skipped, with nothing to act on (no connection to
/// reset, a server still restarting); failed (a server that refused the kill statement).
#[derive(Default)]
pub struct Ran {
    pub applied: Vec<Applied>,
    pub skipped: u64,
    pub failed: u64,
}

/// Servers being restarted: a restart drawn while the last one of the same server is still
/// under way is skipped (the schedule lists it; the table counts what ran).
#[derive(Default)]
pub struct Busy {
    pg: AtomicBool,
    my: AtomicBool,
    rabbit: AtomicBool,
    nats: AtomicBool,
}

/// Applies the schedule from `start`; repairs run in `repairs`, which the caller awaits.
pub async fn run(
    env: Arc<Env>,
    faults: Vec<(Duration, Fault)>,
    start: tokio::time::Instant,
    repairs: &mut JoinSet<()>,
) -> Ran {
    let busy = Arc::new(Busy::default());
    let mut ran = Ran::default();
    for (at, fault) in faults {
        tokio::time::sleep_until(start + at).await;
        let now = Instant::now();
        match apply(&env, &busy, fault, repairs).await {
            Ok(true) => {
                env.log(format_args!(
                    "fault at {:>6.1}s: {fault:?}",
                    at.as_secs_f64()
                ));
                ran.applied.push(Applied {
                    kind: fault.kind(),
                    at: now,
                });
            }
            Ok(false) => {
                ran.skipped += 1;
                env.log(format_args!(
                    "fault at {:>6.1}s skipped: {fault:?}",
                    at.as_secs_f64()
                ));
            }
            Err(e) => {
                ran.failed += 1;
                env.log(format_args!(
                    "fault at {:>6.1}s failed: {fault:?}: {e}",
                    at.as_secs_f64()
                ));
            }
        }
    }
    ran
}

fn claim(flag: &AtomicBool) -> bool {
    !flag.swap(true, Ordering::SeqCst)
}

async fn apply(
    env: &Arc<Env>,
    busy: &Arc<Busy>,
    fault: Fault,
    repairs: &mut JoinSet<()>,
) -> Result<bool, String> {
    let (env2, busy2) = (env.clone(), busy.clone());
    match fault {
        Fault::KillWorker { worker, down } => {
            if !env.fleet.kill(worker).await {
                return Ok(false);
            }
            repairs.spawn(async move {
                tokio::time::sleep(down).await;
                if let Err(e) = env2.fleet.spawn(worker).await {
                    env2.log(format_args!("restart of worker {worker} failed: {e}"));
                }
            });
        }
        Fault::StopWorker { worker, hold } => {
            if !env.fleet.pause(worker, true).await {
                return Ok(false);
            }
            repairs.spawn(async move {
                tokio::time::sleep(hold).await;
                env2.fleet.pause(worker, false).await;
            });
        }
        Fault::TerminatePg => {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name = 'idem-chaos-worker'",
            )
            .fetch_one(&env.pg_admin)
            .await
            .map_err(|e| e.to_string())?;
            return Ok(n > 0);
        }
        Fault::KillMyConnections => {
            let ids: Vec<i64> = sqlx::query_scalar(
                "SELECT CAST(id AS SIGNED) FROM information_schema.processlist WHERE user = 'chaos'",
            )
            .fetch_all(&env.my_admin)
            .await
            .map_err(|e| e.to_string())?;
            for id in &ids {
                // Gone already is fine.
                drop(
                    sqlx::query(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
                        .execute(&env.my_admin)
                        .await,
                );
            }
            return Ok(!ids.is_empty());
        }
        Fault::RestartPg { down } => {
            if !claim(&busy.pg) {
                return Ok(false);
            }
            env.pg.stop_immediate().await?;
            repairs.spawn(async move {
                tokio::time::sleep(down).await;
                if let Err(e) = env2.pg.start().await {
                    env2.log(format_args!("PostgreSQL did not come back: {e}"));
                }
                busy2.pg.store(false, Ordering::SeqCst);
            });
        }
        Fault::RestartMy { down } => {
            if !claim(&busy.my) {
                return Ok(false);
            }
            env.my.kill().await;
            repairs.spawn(async move {
                tokio::time::sleep(down).await;
                if let Err(e) = env2.my.start().await {
                    env2.log(format_args!("MariaDB did not come back: {e}"));
                }
                busy2.my.store(false, Ordering::SeqCst);
            });
        }
        Fault::RestartRabbit { down } => {
            if !claim(&busy.rabbit) {
                return Ok(false);
            }
            env.rabbit.kill().await;
            repairs.spawn(async move {
                tokio::time::sleep(down).await;
                if let Err(e) = env2.rabbit.start().await {
                    env2.log(format_args!("RabbitMQ did not come back: {e}"));
                }
                busy2.rabbit.store(false, Ordering::SeqCst);
            });
        }
        Fault::KillNatsLeader { down } => {
            if !claim(&busy.nats) {
                return Ok(false);
            }
            let leader = match env.stream_leader().await {
                Ok(leader) => leader,
                Err(e) => {
                    busy.nats.store(false, Ordering::SeqCst);
                    return Err(e);
                }
            };
            env.nats.kill(leader).await;
            env.log(format_args!(
                "  the stream's leader was node {}",
                leader + 1
            ));
            repairs.spawn(async move {
                tokio::time::sleep(down).await;
                if let Err(e) = env2.nats.start(leader).await {
                    env2.log(format_args!("the JetStream node did not come back: {e}"));
                }
                busy2.nats.store(false, Ordering::SeqCst);
            });
        }
        Fault::Latency { target, ms, hold } => {
            env.proxy(target).set_latency(Duration::from_millis(ms));
            repairs.spawn(async move {
                tokio::time::sleep(hold).await;
                env2.proxy(target).set_latency(Duration::ZERO);
            });
        }
        Fault::Reset { target } => return Ok(env.proxy(target).reset_all() > 0),
        Fault::HalfOpen { target, nth, hold } => {
            let frozen = env.proxy(target).freeze(nth, 0);
            if frozen.is_empty() {
                return Ok(false);
            }
            repairs.spawn(async move {
                tokio::time::sleep(hold).await;
                env2.proxy(target).reset(&frozen);
            });
        }
    }
    Ok(true)
}
