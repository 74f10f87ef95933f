//! What each command prints: aligned text for people, one JSON document with `--json`.
//!
//! Both show the same fields under the same names, and keys as stored, so that a key copied
//! from the output is what `inspect` and `forget` take.

use std::fmt::Write as _;

use idem::{Key, Marker, MarkerState};
use serde_json::{Value, json};

use crate::args::Age;

/// Where a marker that was not found could be instead: another table.
fn elsewhere(table: &str) -> String {
    format!(
        "looked in table {table}; a store given another table with `Store::with_table` keeps \
         its markers there: pass it with --table or IDEM_TABLE"
    )
}

pub(crate) fn inspect(
    table: &str,
    scope: &str,
    key: &Key,
    marker: Option<&Marker>,
    json: bool,
) -> String {
    match (marker, json) {
        (Some(m), true) => {
            let mut doc = marker_json(m);
            doc["found"] = Value::Bool(true);
            document(&doc)
        }
        (Some(m), false) => fields(&marker_fields(m)),
        (None, true) => document(&json!({
            "table": table,
            "scope": scope,
            "key": key.as_str(),
            "found": false,
        })),
        (None, false) => format!(
            "no marker for scope {scope:?}, key {:?}: no delivery claimed it, or it was \
             forgotten or purged ({})\n",
            key.as_str(),
            elsewhere(table)
        ),
    }
}

pub(crate) fn forget(table: &str, scope: &str, key: &Key, gone: bool, json: bool) -> String {
    if json {
        return document(&json!({
            "table": table,
            "scope": scope,
            "key": key.as_str(),
            "forgotten": gone,
        }));
    }
    if gone {
        format!(
            "forgot scope {scope:?}, key {:?}: its next delivery runs again\n",
            key.as_str()
        )
    } else {
        format!(
            "no marker for scope {scope:?}, key {:?}: nothing to forget ({})\n",
            key.as_str(),
            elsewhere(table)
        )
    }
}

pub(crate) fn purge(age: Option<&Age>, table: &str, deleted: u64, json: bool) -> String {
    if json {
        let ms = age.map(|a| u64::try_from(a.duration.as_millis()).unwrap_or(u64::MAX));
        return document(&json!({
            "table": table,
            "older_than": age.map(|a| &a.text),
            "older_than_ms": ms,
            "deleted": deleted,
        }));
    }
    let markers = if deleted == 1 { "marker" } else { "markers" };
    match age {
        Some(age) => format!(
            "deleted {deleted} {markers} of jobs completed more than {} ago (or longer ago \
             than their scope's retention window) from {table}\n",
            age.text
        ),
        None => format!(
            "deleted {deleted} {markers} of jobs completed longer ago than their scope's \
             retention window from {table} (scopes without a window: give --older-than)\n"
        ),
    }
}

pub(crate) fn stuck(
    table: &str,
    scope: Option<&str>,
    limit: u32,
    markers: &[Marker],
    json: bool,
) -> String {
    if json {
        let list: Vec<Value> = markers.iter().map(marker_json).collect();
        return document(
            &json!({ "table": table, "scope": scope, "limit": limit, "markers": list }),
        );
    }
    if markers.is_empty() {
        return match scope {
            Some(scope) => {
                format!("no marker of scope {scope:?} is in progress in table {table}\n")
            }
            None => format!("no marker is in progress in table {table}\n"),
        };
    }
    let head = ["SCOPE", "KEY", "ATTEMPTS", "TOKEN", "LEASE", "LOCKED_UNTIL"];
    let mut rows = vec![head.map(str::to_owned)];
    for m in markers {
        rows.push([
            m.scope.clone(),
            m.key.clone(),
            m.attempts.to_string(),
            optional(m.token),
            lease_text(m),
            m.locked_until.clone().unwrap_or_else(|| "-".to_owned()),
        ]);
    }
    let mut out = columns(&rows);
    if markers.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit}: raise --limit for more)");
    }
    out
}

/// Where a marker's lease stands: what decides whether the next delivery runs.
/// Rows as columns, each as wide as its widest cell, two spaces apart.
pub(crate) fn columns<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0; N];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn lease_state(m: &Marker) -> Option<&'static str> {
    match (m.state, m.lease_ms_left) {
        (MarkerState::InProgress, None) => Some("released"),
        (MarkerState::InProgress, Some(left)) if left > 0 => Some("live"),
        (MarkerState::InProgress, Some(_)) => Some("expired"),
        _ => None,
    }
}

fn lease_text(m: &Marker) -> String {
    match (lease_state(m), m.lease_ms_left) {
        (Some("live"), Some(left)) => format!("live, {} left", human(left)),
        (Some("expired"), Some(left)) => format!(
            "expired {} ago: the next delivery takes it over",
            human(-left)
        ),
        (Some(_), _) => "released: the next delivery takes it over".to_owned(),
        (None, _) => "-".to_owned(),
    }
}

pub(crate) fn state_name(state: MarkerState) -> &'static str {
    match state {
        MarkerState::Completed => "completed",
        MarkerState::Failed => "failed",
        _ => "in_progress",
    }
}

/// What is stored with a marker, as `(value_bytes, response_status)`: the length of the stored
/// JSON (a handler's `replay` value, or a response the HTTP layer replays), and the status of
/// the HTTP layer's response.
fn stored(m: &Marker) -> (Option<usize>, Option<u16>) {
    let Some(json) = m.value.as_deref() else {
        return (None, None);
    };
    (Some(json.len()), response_status(json))
}

/// The HTTP layer stores `{"status": 201, "headers": [[name, value], ...], "body": base64}`;
/// any other value is a handler's `replay` value.
fn response_status(json: &str) -> Option<u16> {
    let value: Value = serde_json::from_str(json).ok()?;
    let object = value.as_object()?;
    let status = u16::try_from(object.get("status")?.as_u64()?).ok()?;
    let layer = (100..=599).contains(&status)
        && object.get("headers").is_some_and(Value::is_array)
        && object.contains_key("body");
    layer.then_some(status)
}

pub(crate) fn marker_json(m: &Marker) -> Value {
    let (value_bytes, response_status) = stored(m);
    json!({
        "scope": m.scope,
        "key": m.key,
        "state": state_name(m.state),
        "lease": lease_state(m),
        "attempts": m.attempts,
        "token": m.token,
        "created_at": m.created_at,
        "completed_at": m.completed_at,
        "locked_until": m.locked_until,
        "lease_ms_left": m.lease_ms_left,
        "value_bytes": value_bytes,
        "response_status": response_status,
        "error": m.error,
    })
}

fn marker_fields(m: &Marker) -> Vec<(&'static str, String)> {
    let or_dash = |t: &Option<String>| t.clone().unwrap_or_else(|| "-".to_owned());
    let (value_bytes, response_status) = stored(m);
    let or_dash_n = |n: Option<String>| n.unwrap_or_else(|| "-".to_owned());
    vec![
        ("scope", m.scope.clone()),
        ("key", m.key.clone()),
        ("state", state_name(m.state).to_owned()),
        ("lease", lease_text(m)),
        ("attempts", m.attempts.to_string()),
        ("token", optional(m.token)),
        ("created_at", m.created_at.clone()),
        ("completed_at", or_dash(&m.completed_at)),
        ("locked_until", or_dash(&m.locked_until)),
        ("lease_ms_left", optional(m.lease_ms_left)),
        ("value_bytes", or_dash_n(value_bytes.map(|n| n.to_string()))),
        (
            "response_status",
            or_dash_n(response_status.map(|n| n.to_string())),
        ),
        // One line, whatever the error said.
        (
            "error",
            m.error.as_deref().map_or_else(
                || "-".to_owned(),
                |e| e.split_whitespace().collect::<Vec<_>>().join(" "),
            ),
        ),
    ]
}

fn fields(fields: &[(&str, String)]) -> String {
    let width = fields.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    fields
        .iter()
        .map(|(name, value)| format!("{name:<width$}  {value}\n"))
        .collect()
}

fn optional(n: Option<i64>) -> String {
    n.map_or_else(|| "-".to_owned(), |n| n.to_string())
}

pub(crate) fn document(value: &Value) -> String {
    format!("{value:#}\n")
}

/// `ms` as people read a lease: `29s`, `4m 10s`, `2h 0m`, `3d 1h`.
pub(crate) fn human(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3_600 => format!("{}m {}s", s / 60, s % 60),
        3_600..86_400 => format!("{}h {}m", s / 3_600, s % 3_600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3_600),
    }
}

/// Text on one line, whatever it held.
pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn lease_times_read_like_durations() {
        assert_eq!(human(29_999), "29s");
        assert_eq!(human(250_000), "4m 10s");
        assert_eq!(human(7_200_000), "2h 0m");
        assert_eq!(human(90_000_000), "1d 1h");
        assert_eq!(human(-5), "0s");
    }
}
