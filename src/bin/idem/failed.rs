//! `idem failed`, `idem requeue` and `idem steps`: the jobs that failed for good (a lease-mode
//! body's permanent error), letting one run again, and the steps a lease recorded.

use std::fmt::Write as _;

use idem::{Backend, Key, Marker, RecordedStep, Store};
use serde_json::{Value, json};

use crate::Failure;
use crate::render;

/// Exit code of a `requeue` that found no marker.
const NOT_FOUND: u8 = 3;

/// Exit code of a `requeue` of a marker that did not fail.
const NOT_FAILED: u8 = 4;

/// `idem failed`: the failed markers, newest first, each with its error on one line.
pub(crate) fn list(
    table: &str,
    scope: Option<&str>,
    limit: u32,
    markers: &[Marker],
    json: bool,
) -> String {
    if json {
        let list: Vec<Value> = markers.iter().map(render::marker_json).collect();
        return format!(
            "{:#}\n",
            json!({ "table": table, "scope": scope, "limit": limit, "markers": list })
        );
    }
    if markers.is_empty() {
        return match scope {
            Some(scope) => format!("no job of scope {scope:?} failed for good in table {table}\n"),
            None => format!("no job failed for good in table {table}\n"),
        };
    }
    let head = ["SCOPE", "KEY", "ATTEMPTS", "FAILED_AT", "ERROR"];
    let mut rows = vec![head.map(str::to_owned)];
    for m in markers {
        rows.push([
            m.scope.clone(),
            m.key.clone(),
            m.attempts.to_string(),
            m.completed_at.clone().unwrap_or_else(|| "-".to_owned()),
            render::one_line(m.error.as_deref().unwrap_or("-")),
        ]);
    }
    let mut out = render::columns(&rows);
    if markers.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit}: raise --limit for more)");
    }
    out
}

/// `idem requeue SCOPE KEY`: the failed marker becomes a released lease, so that the next
/// delivery runs the job again after its recorded steps.
pub(crate) async fn requeue<DB: Backend>(
    store: &Store<DB>,
    scope: &str,
    key: &Key,
    json: bool,
    refused: impl Fn(idem::Error) -> Failure,
) -> Result<String, Failure> {
    let table = store.table().to_owned();
    if store.requeue(scope, key).await.map_err(&refused)? {
        let steps = store.steps(scope, key).await.map_err(&refused)?.len();
        if json {
            let doc = json!({
                "table": table, "scope": scope, "key": key.as_str(), "requeued": true,
                "steps": steps,
            });
            return Ok(format!("{doc:#}\n"));
        }
        return Ok(format!(
            "requeued scope {scope:?}, key {:?}: its next delivery runs it again, after its {steps} \
             recorded step{}\n",
            key.as_str(),
            if steps == 1 { "" } else { "s" }
        ));
    }
    match store.inspect(scope, key).await.map_err(&refused)? {
        None => Err(Failure::refused(
            NOT_FOUND,
            format!(
                "no marker for scope {scope:?}, key {:?} in table {table}: nothing to requeue \
                 (`idem failed` lists the jobs that failed; check --table)",
                key.as_str()
            ),
        )),
        Some(m) => Err(Failure::refused(
            NOT_FAILED,
            format!(
                "the job of scope {scope:?}, key {:?} did not fail (it is {}): only a job that \
                 failed for good is requeued; nothing was changed",
                key.as_str(),
                render::state_name(m.state)
            ),
        )),
    }
}

/// `idem steps SCOPE KEY`: the steps the job's lease recorded, in their body's order.
pub(crate) fn steps(
    table: &str,
    scope: &str,
    key: &Key,
    steps: &[RecordedStep],
    json: bool,
) -> String {
    if json {
        let list: Vec<Value> = steps
            .iter()
            .map(|s| {
                json!({
                    "name": s.name,
                    "position": s.position,
                    "token": s.token,
                    "recorded_at": s.recorded_at,
                    "value": serde_json::from_str::<Value>(&s.value).unwrap_or(Value::Null),
                })
            })
            .collect();
        let doc = json!({ "table": table, "scope": scope, "key": key.as_str(), "steps": list });
        return format!("{doc:#}\n");
    }
    if steps.is_empty() {
        return format!(
            "no step recorded for scope {scope:?}, key {:?} in table {table}\n",
            key.as_str()
        );
    }
    let head = ["POSITION", "NAME", "RECORDED_AT", "VALUE"];
    let mut rows = vec![head.map(str::to_owned)];
    for s in steps {
        rows.push([
            s.position.to_string(),
            s.name.clone(),
            s.recorded_at.clone(),
            render::one_line(&s.value),
        ]);
    }
    render::columns(&rows)
}
