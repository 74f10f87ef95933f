//! `idem retention`: what `set`, `list` and `clear` print, as text or one JSON document.

use idem::Retention;
use serde_json::{Value, json};

use crate::args::Age;
use crate::render::{columns, document};

fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn set(table: &str, scope: &str, keep: &Age, json: bool) -> String {
    if json {
        return document(&json!({
            "table": table,
            "scope": scope,
            "keep": keep.text,
            "keep_ms": ms(keep.duration),
        }));
    }
    format!(
        "scope {scope:?} keeps its completed markers for {} (in {table}_retention): purge \
         deletes them after that, whatever --older-than says\n",
        keep.text
    )
}

pub(crate) fn list(table: &str, windows: &[Retention], json: bool) -> String {
    if json {
        let list: Vec<Value> = windows
            .iter()
            .map(|w| json!({"scope": w.scope, "keep_ms": ms(w.keep)}))
            .collect();
        return document(&json!({"table": table, "retention": list}));
    }
    if windows.is_empty() {
        return format!(
            "no scope of {table} has a retention window: purge --older-than decides for all\n"
        );
    }
    let mut rows = vec![["SCOPE".to_owned(), "KEEP".to_owned()]];
    for w in windows {
        rows.push([w.scope.clone(), crate::render::human(ms(w.keep) as i64)]);
    }
    columns(&rows)
}

pub(crate) fn clear(table: &str, scope: &str, had: bool, json: bool) -> String {
    if json {
        return document(&json!({"table": table, "scope": scope, "cleared": had}));
    }
    match had {
        true => format!(
            "scope {scope:?} has no retention window now: purge --older-than decides for it\n"
        ),
        false => format!("scope {scope:?} had no retention window in {table}_retention\n"),
    }
}
