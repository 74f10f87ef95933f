//! `idem outbox`: what `list`, `show` and `requeue` print, as text for people or one JSON
//! document.

use std::fmt::Write as _;

use idem::outbox::{OutboxEntry, OutboxState};
use serde_json::{Value, json};

/// Which unsent messages `list` shows.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Filter {
    All,
    Parked,
    Pending,
}

impl Filter {
    pub(crate) fn of(parked: bool, pending: bool) -> Filter {
        match (parked, pending) {
            (true, _) => Filter::Parked,
            (false, true) => Filter::Pending,
            (false, false) => Filter::All,
        }
    }

    /// Whether parked and pending messages are shown.
    pub(crate) fn shows(self) -> (bool, bool) {
        match self {
            Filter::All => (true, true),
            Filter::Parked => (true, false),
            Filter::Pending => (false, true),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Filter::All => "all",
            Filter::Parked => "parked",
            Filter::Pending => "pending",
        }
    }
}

pub(crate) fn state_name(state: OutboxState) -> &'static str {
    match state {
        OutboxState::Parked => "parked",
        OutboxState::Sent => "sent",
        _ => "pending",
    }
}

/// A message's headers as one JSON object (every header, the content type and the
/// `traceparent` first under their names), `null` when it has none.
fn headers_json(m: &OutboxEntry) -> Value {
    if m.headers.is_empty() {
        return Value::Null;
    }
    let all: serde_json::Map<String, Value> = m
        .headers
        .all()
        .map(|(name, value)| (name.to_owned(), Value::String(value.to_owned())))
        .collect();
    Value::Object(all)
}

pub(crate) fn entry_json(m: &OutboxEntry) -> Value {
    json!({
        "id": m.id,
        "destination": m.destination,
        "scope": m.scope,
        "key": m.key,
        "ordering_key": m.ordering_key,
        "headers": headers_json(m),
        "seq": m.seq,
        "state": state_name(m.state),
        "attempts": m.attempts,
        "last_error": m.last_error,
        "created_at": m.created_at,
        "age_ms": m.age_ms,
        "due_in_ms": m.due_in_ms,
    })
}

pub(crate) fn list(
    table: &str,
    filter: Filter,
    limit: u32,
    messages: &[OutboxEntry],
    json: bool,
) -> String {
    if json {
        let list: Vec<Value> = messages.iter().map(entry_json).collect();
        return format!(
            "{:#}\n",
            json!({ "table": table, "filter": filter.name(), "limit": limit, "messages": list })
        );
    }
    if messages.is_empty() {
        return match filter {
            Filter::All => {
                format!("no unsent message in table {table}: every committed message was sent\n")
            }
            Filter::Parked => format!("no parked message in table {table}\n"),
            Filter::Pending => format!("no pending message in table {table}\n"),
        };
    }
    let head = [
        "ID",
        "DESTINATION",
        "ORDERING_KEY",
        "STATE",
        "ATTEMPTS",
        "AGE",
        "LAST_ERROR",
    ];
    let mut rows = vec![head.map(str::to_owned)];
    for m in messages {
        rows.push([
            m.id.clone(),
            m.destination.clone(),
            m.ordering_key.clone(),
            state_name(m.state).to_owned(),
            m.attempts.to_string(),
            crate::render::human(m.age_ms),
            // One line per message, whatever the broker's error said.
            m.last_error.as_deref().map_or_else(
                || "-".to_owned(),
                |e| e.split_whitespace().collect::<Vec<_>>().join(" "),
            ),
        ]);
    }
    let mut out = crate::render::columns(&rows);
    if messages.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit}: raise --limit for more)");
    }
    out
}

pub(crate) fn requeued(table: &str, m: &OutboxEntry, json: bool) -> String {
    if json {
        let mut doc = entry_json(m);
        doc["table"] = Value::String(table.to_owned());
        doc["requeued"] = Value::Bool(true);
        return format!("{doc:#}\n");
    }
    format!(
        "requeued message {} to {}: pending, with no failed attempts; the relay publishes it \
         at its next round\n",
        m.id, m.destination
    )
}

/// One message: where it stands, its ordering key and its headers, one per line.
pub(crate) fn show(table: &str, m: &OutboxEntry, json: bool) -> String {
    if json {
        let mut doc = entry_json(m);
        doc["table"] = Value::String(table.to_owned());
        return format!("{doc:#}\n");
    }
    let mut out = String::new();
    let _ = writeln!(out, "message {} in table {table}", m.id);
    let _ = writeln!(out, "  destination:  {}", m.destination);
    let _ = writeln!(
        out,
        "  job:          {} {}, message {}",
        m.scope, m.key, m.seq
    );
    let _ = writeln!(out, "  ordering key: {}", m.ordering_key);
    let _ = writeln!(
        out,
        "  state:        {} ({} failed attempts)",
        state_name(m.state),
        m.attempts
    );
    let _ = writeln!(
        out,
        "  written:      {} ({} ago)",
        m.created_at,
        crate::render::human(m.age_ms)
    );
    if let Some(error) = &m.last_error {
        let error = error.split_whitespace().collect::<Vec<_>>().join(" ");
        let _ = writeln!(out, "  last error:   {error}");
    }
    if m.headers.is_empty() {
        let _ = writeln!(out, "  headers:      none (written before headers)");
    } else {
        let _ = writeln!(out, "  headers:");
        for (name, value) in m.headers.all() {
            let _ = writeln!(out, "    {name}: {value}");
        }
    }
    out
}
