//! `idem failed --group-by error`, `idem requeue --all` and `idem audit`: the failed jobs by
//! group, requeued many at once behind a dry run and a confirmation, and the log of what
//! operators changed.

use std::fmt::Write as _;

use idem::{AuditEntry, Backend, FailedFilter, FailureGroup, Marker, Store};
use serde_json::{Value, json};

use crate::Failure;
use crate::args::Age;
use crate::render;

/// Above this many rows a bulk action (`requeue --all`, `outbox requeue --all`, `forget
/// --stuck-older-than`) asks for `--yes`: a mistyped filter must not change a whole table's
/// rows at once.
pub(crate) const CONFIRM_ABOVE: u64 = 100;

/// How many of the jobs a dry run names.
const SHOWN: u32 = 20;

/// Exit code of a `requeue --all` that no group of that id was found for.
const NOT_FOUND: u8 = 3;

/// Exit code of a bulk action above [`CONFIRM_ABOVE`] rows without `--yes`.
pub(crate) const UNCONFIRMED: u8 = 8;

/// `requeue --all` and its filter, checked.
#[derive(Debug)]
pub(crate) struct BulkRequeue {
    pub(crate) scope: Option<String>,
    pub(crate) group: Option<String>,
    pub(crate) failed_before: Option<Age>,
    pub(crate) dry_run: bool,
    pub(crate) yes: bool,
}

/// `idem failed --group-by error`: each group's id, scope, count, first and last failure and
/// error, the largest first.
pub(crate) fn groups(
    table: &str,
    scope: Option<&str>,
    limit: u32,
    groups: &[FailureGroup],
    json: bool,
) -> String {
    if json {
        let list: Vec<Value> = groups
            .iter()
            .map(|g| {
                json!({
                    "id": g.id, "scope": g.scope, "error": g.error, "count": g.count,
                    "first_failed_at": g.first_failed_at, "last_failed_at": g.last_failed_at,
                })
            })
            .collect();
        let doc = json!({
            "table": table, "scope": scope, "limit": limit, "group_by": "error", "groups": list,
        });
        return format!("{doc:#}\n");
    }
    if groups.is_empty() {
        return match scope {
            Some(scope) => format!("no job of scope {scope:?} failed for good in table {table}\n"),
            None => format!("no job failed for good in table {table}\n"),
        };
    }
    let head = [
        "GROUP",
        "SCOPE",
        "COUNT",
        "FIRST_FAILED_AT",
        "LAST_FAILED_AT",
        "ERROR",
    ];
    let mut rows = vec![head.map(str::to_owned)];
    for g in groups {
        rows.push([
            g.id.clone(),
            g.scope.clone(),
            g.count.to_string(),
            g.first_failed_at.clone(),
            g.last_failed_at.clone(),
            render::one_line(&g.error),
        ]);
    }
    let mut out = render::columns(&rows);
    if groups.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit} groups: raise --limit for more)");
    }
    out
}

/// `idem requeue --all`: counts what the filter takes; a dry run lists it, more than
/// [`CONFIRM_ABOVE`] without `--yes` is refused, else every job is requeued in pages and the
/// action recorded in the audit log.
pub(crate) async fn requeue_all<DB: Backend>(
    store: &Store<DB>,
    bulk: &BulkRequeue,
    actor: &str,
    json: bool,
    refused: impl Fn(idem::Error) -> Failure,
) -> Result<String, Failure> {
    let table = store.table().to_owned();
    let mut filter = FailedFilter::new();
    let mut group = None;
    if let Some(id) = &bulk.group {
        let Some(found) = store.failure_group(id).await.map_err(&refused)? else {
            return Err(Failure::refused(
                NOT_FOUND,
                format!(
                    "no group of failed jobs with id {id} in table {table}: `idem failed \
                     --group-by error` lists them (its jobs may have been requeued already); \
                     nothing was changed"
                ),
            ));
        };
        filter = filter.group(&found);
        group = Some(found);
    }
    if let Some(age) = &bulk.failed_before {
        filter = filter.failed_before(age.duration);
    }
    // A `--scope` beside a group of another scope takes nothing.
    let other_scope = matches!((&bulk.scope, &group), (Some(s), Some(g)) if *s != g.scope);
    if let Some(scope) = &bulk.scope {
        filter = filter.scope(scope.clone());
    }
    let count = match other_scope {
        true => 0,
        false => store.count_failed(&filter).await.map_err(&refused)?,
    };
    let described = describe(bulk, group.as_ref());
    if bulk.dry_run {
        let shown = match count {
            0 => Vec::new(),
            _ => store
                .list_failed_matching(&filter, SHOWN)
                .await
                .map_err(&refused)?,
        };
        return Ok(dry_run(&table, &described, count, &shown, json));
    }
    if count > CONFIRM_ABOVE && !bulk.yes {
        return Err(Failure::refused(
            UNCONFIRMED,
            format!(
                "requeue --all would requeue {count} jobs of table {table}, more than \
                 {CONFIRM_ABOVE} at once: nothing was changed. Look at them with --dry-run, \
                 then run it again with --yes to requeue all {count}"
            ),
        ));
    }
    let requeued = match count {
        0 => 0,
        _ => store
            .requeue_failed(&filter, count)
            .await
            .map_err(&refused)?,
    };
    record(
        store,
        actor,
        "requeue --all",
        &described,
        requeued,
        &refused,
    )
    .await?;
    if json {
        let doc = json!({ "table": table, "filter": described, "requeued": requeued });
        return Ok(format!("{doc:#}\n"));
    }
    Ok(format!(
        "requeued {requeued} failed job{} of table {table} ({}): their next deliveries run them \
         again\n",
        if requeued == 1 { "" } else { "s" },
        described
    ))
}

/// The filter as the output and the audit log name it.
fn describe(bulk: &BulkRequeue, group: Option<&FailureGroup>) -> Value {
    json!({
        "scope": bulk.scope,
        "group": bulk.group,
        "error": group.map(|g| g.error.as_str()),
        "failed_before": bulk.failed_before.as_ref().map(|a| a.text.as_str()),
    })
}

/// What a dry run prints: the count, and the first [`SHOWN`] jobs.
fn dry_run(table: &str, filter: &Value, count: u64, shown: &[Marker], json: bool) -> String {
    if json {
        let list: Vec<Value> = shown.iter().map(render::marker_json).collect();
        let doc = json!({
            "table": table, "filter": filter, "dry_run": true, "count": count, "markers": list,
        });
        return format!("{doc:#}\n");
    }
    let mut out = format!(
        "dry run: would requeue {count} failed job{} of table {table} ({filter}); nothing was \
         changed\n",
        if count == 1 { "" } else { "s" }
    );
    if shown.is_empty() {
        return out;
    }
    let head = ["SCOPE", "KEY", "FAILED_AT", "ERROR"];
    let mut rows = vec![head.map(str::to_owned)];
    for m in shown {
        rows.push([
            m.scope.clone(),
            m.key.clone(),
            m.completed_at.clone().unwrap_or_else(|| "-".to_owned()),
            render::one_line(m.error.as_deref().unwrap_or("-")),
        ]);
    }
    out.push_str(&render::columns(&rows));
    if count > shown.len() as u64 {
        let _ = writeln!(out, "(the newest {} of {count})", shown.len());
    }
    out
}

/// Records an action that changed state in the audit log. It runs after the action: a
/// failure here says what was done, and that the log lacks it.
pub(crate) async fn record<DB: Backend>(
    store: &Store<DB>,
    actor: &str,
    action: &str,
    target: &Value,
    changed: u64,
    refused: impl Fn(idem::Error) -> Failure,
) -> Result<(), Failure> {
    let target = target.to_string();
    store
        .record_action(actor, action, &target, changed)
        .await
        .map_err(|e| {
            let failure = refused(e);
            Failure::database(format!(
                "`{action}` changed {changed} row(s) ({target}), but the audit log {}_audit \
                 could not record it: {}; `Store::migrate()` creates the table (schema \
                 version 5)",
                store.table(),
                failure.message()
            ))
        })
}

/// `idem audit`: the newest actions first.
pub(crate) fn audit(table: &str, limit: u32, entries: &[AuditEntry], json: bool) -> String {
    let log = format!("{table}_audit");
    if json {
        let list: Vec<Value> = entries
            .iter()
            .map(|e| {
                json!({
                    "id": e.id, "at": e.at, "actor": e.actor, "action": e.action,
                    "target": serde_json::from_str::<Value>(&e.target)
                        .unwrap_or_else(|_| Value::String(e.target.clone())),
                    "changed": e.changed,
                })
            })
            .collect();
        let doc = json!({ "table": log, "limit": limit, "entries": list });
        return format!("{doc:#}\n");
    }
    if entries.is_empty() {
        return format!("no action recorded in {log}\n");
    }
    let head = ["AT", "ACTOR", "ACTION", "CHANGED", "TARGET"];
    let mut rows = vec![head.map(str::to_owned)];
    for e in entries {
        rows.push([
            e.at.clone(),
            e.actor.clone(),
            e.action.clone(),
            e.changed.to_string(),
            e.target.clone(),
        ]);
    }
    let mut out = render::columns(&rows);
    if entries.len() == limit as usize {
        let _ = writeln!(out, "(the newest {limit}: raise --limit for more)");
    }
    out
}
