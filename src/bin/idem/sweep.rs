//! `idem outbox requeue --all` and `idem forget --stuck-older-than`: many parked messages, or
//! many stuck leases, at once, behind the dry run, the confirmation and the audit log of
//! `requeue --all` (`bulk.rs`).

use std::fmt::Write as _;

use idem::outbox::{OutboxEntry, ParkedFilter};
use idem::{Backend, Marker, Store};
use serde_json::{Value, json};

use crate::Failure;
use crate::args::Age;
use crate::bulk::{self, CONFIRM_ABOVE, UNCONFIRMED};
use crate::{outbox, render};

/// How many of the rows a dry run names.
const SHOWN: u32 = 20;

/// Exit code of a `forget --stuck-older-than` without `--force` while a delivery holds one
/// of the leases (as a single `forget`).
const HELD: u8 = 5;

/// `outbox requeue --all` and its filter, checked.
#[derive(Debug)]
pub(crate) struct BulkOutbox {
    pub(crate) destination: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) parked_before: Option<Age>,
    pub(crate) dry_run: bool,
    pub(crate) yes: bool,
}

/// `forget --stuck-older-than` and its scope, checked.
#[derive(Debug)]
pub(crate) struct BulkForget {
    pub(crate) older_than: Age,
    pub(crate) scope: Option<String>,
    pub(crate) force: bool,
    pub(crate) dry_run: bool,
    pub(crate) yes: bool,
}

/// The refusal of more than [`CONFIRM_ABOVE`] rows without `--yes`.
fn unconfirmed(command: &str, count: u64, what: &str, table: &str) -> Failure {
    Failure::refused(
        UNCONFIRMED,
        format!(
            "{command} would change {count} {what} of table {table}, more than {CONFIRM_ABOVE} \
             at once: nothing was changed. Look at them with --dry-run, then run it again \
             with --yes to change all {count}"
        ),
    )
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// `idem outbox requeue --all`: counts what the filter takes; a dry run lists it, more than
/// [`CONFIRM_ABOVE`] without `--yes` is refused, else every message is requeued in pages
/// (each key's in the relay's order) and the action recorded in the audit log.
pub(crate) async fn outbox_requeue_all<DB: Backend>(
    store: &Store<DB>,
    bulk: &BulkOutbox,
    actor: &str,
    json: bool,
    refused: impl Fn(idem::Error) -> Failure,
) -> Result<String, Failure> {
    let table = format!("{}_outbox", store.table());
    let mut filter = ParkedFilter::new();
    if let Some(destination) = &bulk.destination {
        filter = filter.destination(destination.clone());
    }
    if let Some(error) = &bulk.error {
        filter = filter.error(error.clone());
    }
    if let Some(age) = &bulk.parked_before {
        filter = filter.parked_before(age.duration);
    }
    let described = json!({
        "destination": bulk.destination,
        "error": bulk.error,
        "parked_before": bulk.parked_before.as_ref().map(|a| a.text.as_str()),
    });
    let count = store.count_parked(&filter).await.map_err(&refused)?;
    if bulk.dry_run {
        let shown = match count {
            0 => Vec::new(),
            _ => store
                .list_parked_matching(&filter, SHOWN)
                .await
                .map_err(&refused)?,
        };
        return Ok(outbox_dry_run(&table, &described, count, &shown, json));
    }
    if count > CONFIRM_ABOVE && !bulk.yes {
        return Err(unconfirmed(
            "outbox requeue --all",
            count,
            "parked messages",
            &table,
        ));
    }
    let requeued = match count {
        0 => 0,
        _ => store
            .requeue_parked(&filter, count)
            .await
            .map_err(&refused)?,
    };
    let action = "outbox requeue --all";
    bulk::record(store, actor, action, &described, requeued, &refused).await?;
    if json {
        let doc = json!({ "table": table, "filter": described, "requeued": requeued });
        return Ok(format!("{doc:#}\n"));
    }
    Ok(format!(
        "requeued {requeued} parked message{} of table {table} ({described}): pending, with no \
         failed attempts; the relay publishes them at its next round, each key's in order\n",
        plural(requeued)
    ))
}

/// What a dry run of `outbox requeue --all` prints: the count, and the first [`SHOWN`]
/// messages in the order they would be requeued.
fn outbox_dry_run(
    table: &str,
    filter: &Value,
    count: u64,
    shown: &[OutboxEntry],
    json: bool,
) -> String {
    if json {
        let list: Vec<Value> = shown.iter().map(outbox::entry_json).collect();
        let doc = json!({
            "table": table, "filter": filter, "dry_run": true, "count": count, "messages": list,
        });
        return format!("{doc:#}\n");
    }
    let mut out = format!(
        "dry run: would requeue {count} parked message{} of table {table} ({filter}); nothing \
         was changed\n",
        plural(count)
    );
    if shown.is_empty() {
        return out;
    }
    let head = [
        "ID",
        "DESTINATION",
        "ORDERING_KEY",
        "ATTEMPTS",
        "LAST_ERROR",
    ];
    let mut rows = vec![head.map(str::to_owned)];
    for m in shown {
        rows.push([
            m.id.clone(),
            m.destination.clone(),
            m.ordering_key.clone(),
            m.attempts.to_string(),
            render::one_line(m.last_error.as_deref().unwrap_or("-")),
        ]);
    }
    out.push_str(&render::columns(&rows));
    if count > shown.len() as u64 {
        let _ = writeln!(out, "(the first {} of {count})", shown.len());
    }
    out
}

/// `idem forget --stuck-older-than`: counts the stuck leases; a dry run lists them, one still
/// held without `--force` is refused (exit 5, as a single `forget`), more than
/// [`CONFIRM_ABOVE`] without `--yes` too, else every one is forgotten in pages and the action
/// recorded in the audit log.
pub(crate) async fn forget_stuck<DB: Backend>(
    store: &Store<DB>,
    bulk: &BulkForget,
    actor: &str,
    json: bool,
    refused: impl Fn(idem::Error) -> Failure,
) -> Result<String, Failure> {
    let table = store.table().to_owned();
    let (scope, age) = (bulk.scope.as_deref(), bulk.older_than.duration);
    let described = json!({
        "scope": bulk.scope,
        "stuck_older_than": bulk.older_than.text,
        "force": bulk.force,
    });
    let (count, held) = store.count_stuck(scope, age).await.map_err(&refused)?;
    if bulk.dry_run {
        let shown = match count {
            0 => Vec::new(),
            _ => store
                .list_stuck(scope, age, SHOWN)
                .await
                .map_err(&refused)?,
        };
        return Ok(forget_dry_run(
            &table, &described, count, held, &shown, json,
        ));
    }
    if held > 0 && !bulk.force {
        return Err(Failure::refused(
            HELD,
            format!(
                "{held} of the {count} stuck lease{} of table {table} older than {} {} still \
                 held by a delivery, which may still be calling the outside system: nothing \
                 was changed. Wait for them to run out, or add --force if their holders are \
                 known to be gone",
                plural(count),
                bulk.older_than.text,
                if held == 1 { "is" } else { "are" },
            ),
        ));
    }
    if count > CONFIRM_ABOVE && !bulk.yes {
        return Err(unconfirmed(
            "forget --stuck-older-than",
            count,
            "stuck markers",
            &table,
        ));
    }
    let forgot = match count {
        0 => 0,
        _ => store
            .forget_stuck(scope, age, bulk.force, count)
            .await
            .map_err(&refused)?,
    };
    let action = "forget --stuck-older-than";
    bulk::record(store, actor, action, &described, forgot, &refused).await?;
    if json {
        let doc = json!({ "table": table, "filter": described, "forgotten": forgot });
        return Ok(format!("{doc:#}\n"));
    }
    Ok(format!(
        "forgot {forgot} stuck lease{} of table {table} ({described}): each let go, its token \
         up; their next deliveries take them over\n",
        plural(forgot)
    ))
}

/// What a dry run of `forget --stuck-older-than` prints: the count (and how many are still
/// held), and the first [`SHOWN`] markers.
fn forget_dry_run(
    table: &str,
    filter: &Value,
    count: u64,
    held: u64,
    shown: &[Marker],
    json: bool,
) -> String {
    if json {
        let list: Vec<Value> = shown.iter().map(render::marker_json).collect();
        let doc = json!({
            "table": table, "filter": filter, "dry_run": true, "count": count, "held": held,
            "markers": list,
        });
        return format!("{doc:#}\n");
    }
    let mut out = format!(
        "dry run: would forget {count} stuck lease{} of table {table} ({filter}), {held} of \
         them still held by a delivery; nothing was changed\n",
        plural(count)
    );
    if shown.is_empty() {
        return out;
    }
    let head = ["SCOPE", "KEY", "ATTEMPTS", "CREATED_AT", "LOCKED_UNTIL"];
    let mut rows = vec![head.map(str::to_owned)];
    for m in shown {
        rows.push([
            m.scope.clone(),
            m.key.clone(),
            m.attempts.to_string(),
            m.created_at.clone(),
            m.locked_until.clone().unwrap_or_else(|| "-".to_owned()),
        ]);
    }
    out.push_str(&render::columns(&rows));
    if count > shown.len() as u64 {
        let _ = writeln!(out, "(the first {} of {count})", shown.len());
    }
    out
}
