//! `idem doctor`: the checkup from the command line, the diagnosis as text or one JSON
//! document, and the exit code a cron job acts on.

use std::fmt::Write as _;

use idem::{Checkup, Diagnosis, Severity};
use serde_json::{Value, json};

use crate::args::DoctorArgs;
use crate::render::document;

/// Exit code of a diagnosis with warnings and no problem.
const WARNINGS: u8 = 6;

/// Exit code of a diagnosis with a problem.
const PROBLEMS: u8 = 7;

pub(crate) fn checkup(args: &DoctorArgs) -> Checkup {
    let mut checkup = Checkup::new().stuck_after(args.stuck_after.duration);
    if let Some(age) = &args.retention {
        checkup = checkup.retention(age.duration);
    }
    if let Some(n) = args.concurrency {
        checkup = checkup.concurrency(n);
    }
    if let Some(n) = args.pool_size {
        checkup = checkup.pool_size(n);
    }
    if let Some(age) = &args.wait {
        checkup = checkup.wait(age.duration);
    }
    if let Some(age) = &args.lease {
        checkup = checkup.lease(age.duration);
    }
    if let Some(age) = &args.ack_timeout {
        checkup = checkup.ack_timeout(age.duration);
    }
    checkup
}

pub(crate) fn exit_code(diagnosis: &Diagnosis) -> u8 {
    match diagnosis.worst() {
        Severity::Problem => PROBLEMS,
        Severity::Warning => WARNINGS,
        _ => 0,
    }
}

pub(crate) fn render(diagnosis: &Diagnosis, url: &str, json: bool) -> String {
    let count = |s| {
        diagnosis
            .findings
            .iter()
            .filter(|f| f.severity == s)
            .count()
    };
    let (problems, warnings) = (count(Severity::Problem), count(Severity::Warning));
    if json {
        let findings: Vec<Value> = diagnosis
            .findings
            .iter()
            .map(|f| {
                json!({
                    "check": f.check,
                    "severity": f.severity.as_str(),
                    "summary": f.summary,
                    "fix": f.fix,
                })
            })
            .collect();
        return document(&json!({
            "table": diagnosis.table,
            "healthy": diagnosis.is_healthy(),
            "worst": diagnosis.worst().as_str(),
            "problems": problems,
            "warnings": warnings,
            "findings": findings,
        }));
    }
    let mut out = format!("idem doctor: table {} at {url}\n", diagnosis.table);
    let width = diagnosis
        .findings
        .iter()
        .map(|f| f.check.len())
        .max()
        .unwrap_or(0);
    for f in &diagnosis.findings {
        let _ = writeln!(
            out,
            "{:<8} {:<width$}  {}",
            f.severity.as_str(),
            f.check,
            f.summary
        );
        if let Some(fix) = &f.fix {
            let _ = writeln!(out, "{:<8} {:<width$}  fix: {fix}", "", "");
        }
    }
    let _ = match (problems, warnings) {
        (0, 0) => writeln!(out, "healthy"),
        (p, w) => writeln!(out, "{p} problem(s), {w} warning(s)"),
    };
    out
}
