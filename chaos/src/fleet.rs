//! The worker processes: copies of this binary started with `worker`, their stdout read line
//! by line into one tally, killed, stopped and continued by pid with real signals.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

use crate::servers::signal;
use crate::worker::{CONFIG_VAR, Config};

/// What the workers said they did.
#[derive(Default)]
pub struct Tally {
    pub deliveries: u64,
    pub redeliveries: u64,
    pub duplicates: u64,
    pub nacks: HashMap<String, u64>,
    /// `APPLIED` lines per job: idem returns `Applied` once per key at most.
    pub applied: HashMap<String, u64>,
    /// When each `APPLIED` line arrived, in order.
    pub applied_at: Vec<Instant>,
    pub starts: u64,
}

/// A running worker and the number of its deliveries under way.
type Slot = Option<(Child, Arc<AtomicI64>)>;

pub struct Fleet {
    exe: PathBuf,
    logs: PathBuf,
    configs: Vec<Config>,
    /// Each running worker and its deliveries under way (started, not yet acked or nacked).
    slots: tokio::sync::Mutex<Vec<Slot>>,
    pub tally: Arc<Mutex<Tally>>,
}

impl Fleet {
    pub fn new(exe: PathBuf, logs: PathBuf, configs: Vec<Config>) -> Fleet {
        let slots = tokio::sync::Mutex::new(configs.iter().map(|_| None).collect());
        Fleet {
            exe,
            logs,
            configs,
            slots,
            tally: Arc::new(Mutex::new(Tally::default())),
        }
    }

    pub fn len(&self) -> usize {
        self.configs.len()
    }

    /// Starts worker `i` unless it is running.
    pub async fn spawn(&self, i: usize) -> Result<(), String> {
        let mut slots = self.slots.lock().await;
        if let Some((child, _)) = slots[i].as_mut()
            && matches!(child.try_wait(), Ok(None))
        {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("worker-{i}.log")))
            .map_err(|e| format!("worker log: {e}"))?;
        let config = serde_json::to_string(&self.configs[i]).expect("a config serialises");
        let mut child = Command::new(&self.exe)
            .arg("worker")
            .env(CONFIG_VAR, config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start worker {i}: {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let tally = self.tally.clone();
        let in_flight = Arc::new(AtomicI64::new(0));
        let counter = in_flight.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                note(&tally, &counter, &line);
            }
        });
        slots[i] = Some((child, in_flight));
        Ok(())
    }

    fn pid(child: &Child) -> Option<String> {
        child.id().map(|p| p.to_string())
    }

    /// SIGKILL of worker `i`; returns whether one was running.
    pub async fn kill(&self, i: usize) -> bool {
        let mut slots = self.slots.lock().await;
        let Some((mut child, _)) = slots[i].take() else {
            return false;
        };
        if let Some(pid) = Self::pid(&child) {
            signal("KILL", &pid).await;
        }
        drop(child.wait().await);
        true
    }

    /// SIGSTOP (`stop`) or SIGCONT of worker `i`.
    pub async fn pause(&self, i: usize, stop: bool) -> bool {
        let slots = self.slots.lock().await;
        let Some(pid) = slots[i].as_ref().and_then(|(c, _)| Self::pid(c)) else {
            return false;
        };
        signal(if stop { "STOP" } else { "CONT" }, &pid).await;
        true
    }

    /// Deliveries the running workers have started and not yet acked or nacked (a killed
    /// worker's are the broker's again).
    pub async fn in_flight(&self) -> i64 {
        let slots = self.slots.lock().await;
        slots
            .iter()
            .flatten()
            .map(|(_, n)| n.load(Ordering::SeqCst))
            .sum()
    }

    pub async fn kill_all(&self) {
        for i in 0..self.len() {
            self.kill(i).await;
        }
    }
}

fn note(tally: &Mutex<Tally>, in_flight: &AtomicI64, line: &str) {
    let mut words = line.split(' ');
    if words.next() != Some("EV") {
        return;
    }
    let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
    match (words.next(), words.next()) {
        (Some("STARTED"), _) => t.starts += 1,
        (Some("DELIVERED"), Some(_)) => {
            in_flight.fetch_add(1, Ordering::SeqCst);
            t.deliveries += 1;
            if words.nth(1) == Some("true") {
                t.redeliveries += 1;
            }
        }
        (Some("APPLIED"), Some(job)) => {
            in_flight.fetch_sub(1, Ordering::SeqCst);
            *t.applied.entry(job.to_owned()).or_default() += 1;
            t.applied_at.push(Instant::now());
        }
        (Some("DUPLICATE"), Some(_)) => {
            in_flight.fetch_sub(1, Ordering::SeqCst);
            t.duplicates += 1;
        }
        (Some("NACK"), Some(_)) => {
            in_flight.fetch_sub(1, Ordering::SeqCst);
            let kind = words.next().unwrap_or("unknown").to_owned();
            *t.nacks.entry(kind).or_default() += 1;
        }
        _ => {}
    }
}
