//! A chaos soak of idem: worker processes consuming RabbitMQ and a three-node JetStream
//! cluster, applying jobs on PostgreSQL and MariaDB (transaction mode, batches) and charging
//! a payments API (lease mode), while a schedule drawn from a seed kills and stops workers,
//! kills database sessions, restarts the servers the harness owns, kills the stream's leader,
//! and has a proxy add latency, reset connections and leave some half-open. A checker then
//! verifies that every job took effect exactly once.
//!
//! ```text
//! cargo run -p idem-chaos --release -- --duration 10m --seed 7
//! ```
//! Options: `--seed N` (default: drawn from the clock, printed), `--duration 60s|10m`,
//! `--workers N` (default 4, at least 4), `--rate JOBS_PER_SECOND` (default 5), `--drain
//! 120s` (how long the drain may take), `--keep` (keep the servers' directory).
//! `idem-chaos group-restart` runs one deterministic case instead: the database restarted
//! while calls are inside a group (`restart.rs`). It runs as
//! root: the owned servers run as the users `postgres`, `mysql` and `rabbitmq`.

mod check;
mod faults;
mod fleet;
mod harness;
mod jobs;
mod payments;
mod proxy;
mod restart;
mod rng;
mod servers;
mod worker;

use std::time::Duration;

fn duration(text: &str) -> Result<Duration, String> {
    let (digits, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("not a duration: {text}"))?;
    match unit {
        "" | "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("not a duration: {text} (60s, 10m)")),
    }
}

fn parse(mut argv: impl Iterator<Item = String>) -> Result<harness::Args, String> {
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_secs());
    let mut args = harness::Args {
        seed: clock,
        duration: Duration::from_secs(60),
        workers: 4,
        rate: 5,
        drain: Duration::from_secs(120),
        keep: false,
    };
    while let Some(flag) = argv.next() {
        let mut value = || argv.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--seed" => args.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--duration" => args.duration = duration(&value()?)?,
            "--drain" => args.drain = duration(&value()?)?,
            "--workers" => {
                args.workers = value()?.parse().map_err(|e| format!("--workers: {e}"))?
            }
            "--rate" => args.rate = value()?.parse().map_err(|e| format!("--rate: {e}"))?,
            "--keep" => args.keep = true,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    if args.workers < 4 {
        return Err("--workers: at least 4".into());
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut argv = std::env::args().skip(1).peekable();
    if argv.peek().map(String::as_str) == Some("worker") {
        let config = std::env::var(worker::CONFIG_VAR)
            .ok()
            .and_then(|c| serde_json::from_str(&c).ok())
            .expect("a worker is started by the harness, with its configuration");
        worker::run(config).await
    }
    if argv.peek().map(String::as_str) == Some("group-restart") {
        return match restart::run().await {
            Ok(()) => {
                println!("group restart passed");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                println!("group restart FAILED: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let args = match parse(argv) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let seed = args.seed;
    match harness::run(args).await {
        Ok(violations) if violations.is_empty() => {
            println!("chaos soak passed (seed {seed})");
            std::process::ExitCode::SUCCESS
        }
        Ok(violations) => {
            for v in &violations {
                println!("VIOLATION: {v}");
            }
            println!(
                "chaos soak FAILED with {} violations (seed {seed}; replay with --seed {seed})",
                violations.len()
            );
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            println!("chaos soak could not run (seed {seed}): {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
