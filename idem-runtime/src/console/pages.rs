//! The console's pages: each reads a bounded number of rows, through the store's operator
//! queries, and renders them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::response::Response;
use http::StatusCode;
use http::request::Parts;
use serde::Deserialize;

use super::html::{
    self as html, age, bars, esc, failure, job_link, page, query_value, table, token_field,
};
use super::{Shared, Viewer};
use crate::backend::Backend;
use crate::bulk::{FailedFilter, FailureGroup};
use crate::doctor::Checkup;
use crate::error::Error;
use crate::inspect::{Marker, MarkerState};

/// The overview's window, and its stretches.
const DAY: Duration = Duration::from_secs(86_400);
const HOUR: i64 = 3_600;

/// How many rows a listing shows at most.
pub(super) const ROWS: u32 = 100;

/// How many of a group's jobs its page lists.
const GROUP_ROWS: u32 = 20;

/// How many of a job's outbox messages its page looks for.
const JOB_MESSAGES: u32 = 20;

/// How many of the day's jobs the overview reads at most, the newest: at 330 000 jobs a day,
/// about the last four hours. Its page answers in a bounded time whatever the table holds.
const OVERVIEW_JOBS: u32 = 50_000;

pub(super) type Console<DB> = State<Arc<Shared<DB>>>;

/// The page for a store error: refused input is the asker's (400), the rest the database's.
pub(super) fn error_page(viewer: &Viewer, error: Error) -> Response {
    let status = match error {
        Error::Refused(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    failure(viewer, status, &error.to_string())
}

/// Applied and failed jobs per scope over the last day, and the outbox at a glance.
pub(super) async fn overview<DB: Backend>(State(c): Console<DB>, parts: Parts) -> Response {
    let viewer = Viewer::of(&parts);
    let read = async {
        let counts = c
            .store
            .outcomes(None, DAY, Duration::from_secs(HOUR as u64), OVERVIEW_JOBS);
        let parked = c.store.list_outbox(true, false, ROWS);
        let oldest = c.store.list_outbox(false, true, 1);
        Ok::<_, Error>((counts.await?, parked.await?, oldest.await?))
    };
    let (counts, parked, oldest) = match read.await {
        Ok(read) => read,
        Err(e) => return error_page(&viewer, e),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let mut by_scope: BTreeMap<&str, Vec<(i64, u64, u64)>> = BTreeMap::new();
    for c in &counts {
        by_scope
            .entry(&c.scope)
            .or_default()
            .push((c.from, c.applied, c.failed));
    }
    let b = esc(&viewer.base);
    let rows: Vec<Vec<String>> = by_scope
        .iter()
        .map(|(scope, hours)| {
            let applied: u64 = hours.iter().map(|h| h.1).sum();
            let failed: u64 = hours.iter().map(|h| h.2).sum();
            let failed = match failed {
                0 => "0".to_owned(),
                n => format!(
                    "<a href=\"{b}/failures?scope={}\">{n}</a>",
                    query_value(scope)
                ),
            };
            vec![
                esc(scope),
                applied.to_string(),
                failed,
                bars(hours, now, HOUR, 24),
            ]
        })
        .collect();
    let read: u64 = counts.iter().map(|c| c.applied + c.failed).sum();
    let since = match counts.iter().map(|c| c.from).min() {
        Some(from) if read == u64::from(OVERVIEW_JOBS) => format!(
            "the newest {OVERVIEW_JOBS} jobs completed (since about {:02}:00 UTC; the \
             earliest hour is partly counted)",
            from.rem_euclid(86_400) / HOUR
        ),
        _ => "jobs completed in the last 24 hours".to_owned(),
    };
    let mut body = format!(
        "<p class=\"note\" id=\"window\">Per scope and hour (UTC), {since}: applied in \
         green, failed for good in red. Duplicates write no marker: the metric \
         <code>idem_outcomes_total</code> counts them.</p>",
    );
    body += &table(
        "outcomes",
        &["Scope", "Applied", "Failed", "Per hour"],
        &rows,
    );
    body += "<h2>Outbox</h2>";
    let lag = match oldest.first() {
        Some(m) => format!(
            "the oldest unsent message was written {} ago (the relay's lag)",
            age(m.age_ms)
        ),
        None => "no message waits to be sent".to_owned(),
    };
    let parked = match parked.len() as u32 {
        0 => "none is parked".to_owned(),
        ROWS => format!("at least {ROWS} are <a href=\"{b}/outbox\">parked</a>"),
        n => format!("{n} <a href=\"{b}/outbox\">parked</a>"),
    };
    let _ = write!(body, "<p id=\"outbox\">{lag}; {parked}.</p>");
    page(&viewer, "Overview", &body)
}

#[derive(Deserialize)]
pub(super) struct ScopeQuery {
    scope: Option<String>,
}

/// The failed jobs grouped by scope and error, the largest groups first.
pub(super) async fn failures<DB: Backend>(
    State(c): Console<DB>,
    Query(q): Query<ScopeQuery>,
    parts: Parts,
) -> Response {
    let viewer = Viewer::of(&parts);
    let scope = q.scope.as_deref().filter(|s| !s.is_empty());
    let groups = match c.store.failure_groups(scope, ROWS).await {
        Ok(groups) => groups,
        Err(e) => return error_page(&viewer, e),
    };
    let b = esc(&viewer.base);
    let rows: Vec<Vec<String>> = groups
        .iter()
        .map(|g| {
            vec![
                format!("<a href=\"{b}/failures/{id}\">{id}</a>", id = esc(&g.id)),
                esc(&g.scope),
                g.count.to_string(),
                esc(&g.first_failed_at),
                esc(&g.last_failed_at),
                esc(&g.error),
            ]
        })
        .collect();
    let header = [
        "Group",
        "Scope",
        "Jobs",
        "First failed",
        "Last failed",
        "Error",
    ];
    let mut body = String::from(
        "<p class=\"note\">Jobs that failed for good, grouped by scope and error text, the \
         largest groups first. A group's page shows its jobs and requeues them.</p>",
    );
    body += &table("groups", &header, &rows);
    page(&viewer, "Failures", &body)
}

/// One group: how many jobs a requeue would take and the newest of them (the dry run), and
/// for an admin the form that requeues them.
pub(super) async fn group<DB: Backend>(
    State(c): Console<DB>,
    Path(id): Path<String>,
    parts: Parts,
) -> Response {
    let viewer = Viewer::of(&parts);
    if !FailureGroup::is_id(&id) {
        let what = format!("{id:?} is not a group id (12 lower-case hex digits)");
        return failure(&viewer, StatusCode::BAD_REQUEST, &what);
    }
    let Some(group) = (match c.store.failure_group(&id).await {
        Ok(group) => group,
        Err(e) => return error_page(&viewer, e),
    }) else {
        let what = format!("no failed job is in group {id}: requeued already, or mistyped");
        return failure(&viewer, StatusCode::NOT_FOUND, &what);
    };
    let filter = FailedFilter::new().group(&group);
    let read = async {
        let count = c.store.count_failed(&filter).await?;
        let newest = c.store.list_failed_matching(&filter, GROUP_ROWS).await?;
        Ok::<_, Error>((count, newest))
    };
    let (count, newest) = match read.await {
        Ok(read) => read,
        Err(e) => return error_page(&viewer, e),
    };
    let mut body = format!(
        "<p>Scope <code>{}</code>, error <code>{}</code>.</p>\
         <p id=\"dry-run\">A requeue would take <b id=\"count\">{count}</b> failed jobs \
         (the newest {} below); nothing is changed until it runs.</p>",
        esc(&group.scope),
        esc(&group.error),
        newest.len(),
    );
    if let Some(admin) = &viewer.admin {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}/failures/{}/requeue\">{}\
             <input type=\"hidden\" name=\"count\" value=\"{count}\">\
             <button id=\"requeue\">Requeue these {count} jobs</button></form>",
            esc(&viewer.base),
            esc(&id),
            token_field(&c.token(admin)),
        );
    }
    body += &markers(&viewer, "jobs", &newest);
    page(&viewer, &format!("Failure group {id}"), &body)
}

#[derive(Deserialize)]
pub(super) struct JobQuery {
    scope: String,
    key: String,
}

/// One job: its marker, its stored value or error, its recorded steps.
pub(super) async fn job<DB: Backend>(
    State(c): Console<DB>,
    Query(q): Query<JobQuery>,
    parts: Parts,
) -> Response {
    let viewer = Viewer::of(&parts);
    let read = async {
        let marker = c.store.inspect(&q.scope, q.key.as_str()).await?;
        let steps = c.store.steps(&q.scope, q.key.as_str()).await?;
        Ok::<_, Error>((marker, steps))
    };
    let (marker, steps) = match read.await {
        Ok(read) => read,
        Err(e) => return error_page(&viewer, e),
    };
    let Some(m) = marker else {
        let what = format!(
            "no marker for key {:?} of scope {:?}: never claimed, forgotten or purged",
            q.key, q.scope
        );
        return failure(&viewer, StatusCode::NOT_FOUND, &what);
    };
    let opt = |v: &Option<String>| v.as_deref().map(esc).unwrap_or_default();
    let rows = vec![
        vec!["Scope".into(), esc(&m.scope)],
        vec!["Key".into(), esc(&m.key)],
        vec!["State".into(), state(m.state).into()],
        vec!["Attempts".into(), m.attempts.to_string()],
        vec![
            "Token".into(),
            m.token.map(|t| t.to_string()).unwrap_or_default(),
        ],
        vec!["Claimed at".into(), esc(&m.created_at)],
        vec!["Completed at".into(), opt(&m.completed_at)],
        vec!["Lease until".into(), opt(&m.locked_until)],
        vec!["Error".into(), opt(&m.error)],
        vec!["Stored value".into(), opt(&m.value)],
    ];
    let mut body = table("marker", &["", ""], &rows);
    if let (Some(admin), MarkerState::Failed) = (&viewer.admin, m.state) {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}/job/requeue\">{}\
             <input type=\"hidden\" name=\"scope\" value=\"{}\">\
             <input type=\"hidden\" name=\"key\" value=\"{}\">\
             <button id=\"requeue\">Requeue this job</button></form>",
            esc(&viewer.base),
            token_field(&c.token(admin)),
            esc(&m.scope),
            esc(&m.key),
        );
    }
    body += "<h2>Steps</h2>";
    let steps: Vec<Vec<String>> = steps
        .iter()
        .map(|s| {
            vec![
                s.position.to_string(),
                esc(&s.name),
                s.token.to_string(),
                esc(&s.recorded_at),
                format!("<code>{}</code>", esc(&s.value)),
            ]
        })
        .collect();
    body += &table(
        "steps",
        &["#", "Step", "Token", "Recorded at", "Value"],
        &steps,
    );
    // A job's messages have ids made from its scope, its key and their place among its
    // messages (`job_id`): each is read by the outbox's primary key, until one is not there.
    let mut messages = Vec::new();
    for seq in 0..JOB_MESSAGES {
        let found = match crate::job_id(&m.scope, &(m.key.as_str(), seq)) {
            Ok(id) => c.store.outbox_message(id.as_str()).await,
            Err(_) => break,
        };
        match found {
            Ok(Some(message)) => messages.push(message),
            Ok(None) => break,
            Err(e) => return error_page(&viewer, e),
        }
    }
    let token = viewer.admin.as_ref().map(|admin| c.token(admin));
    let _ = write!(
        body,
        "<h2>Outbox messages</h2><p class=\"note\">What the job sent with its effect, in its \
         order (at most {JOB_MESSAGES}; a sent message is gone once the outbox is purged).</p>{}",
        html::messages(&viewer, token.as_deref(), &messages)
    );
    page(&viewer, "Job", &body)
}

/// The newest actions of the audit log.
pub(super) async fn audit<DB: Backend>(State(c): Console<DB>, parts: Parts) -> Response {
    let viewer = Viewer::of(&parts);
    let log = match c.store.audit_log(ROWS).await {
        Ok(log) => log,
        Err(e) => return error_page(&viewer, e),
    };
    let rows: Vec<Vec<String>> = log
        .iter()
        .map(|a| {
            vec![
                esc(&a.at),
                esc(&a.actor),
                esc(&a.action),
                a.changed.to_string(),
                format!("<code>{}</code>", esc(&a.target)),
            ]
        })
        .collect();
    let header = ["At", "Actor", "Action", "Changed", "Target"];
    page(&viewer, "Audit log", &table("audit", &header, &rows))
}

/// The doctor's findings, on the defaults of `idem doctor`.
pub(super) async fn doctor<DB: Backend>(State(c): Console<DB>, parts: Parts) -> Response {
    let viewer = Viewer::of(&parts);
    let diagnosis = match c.store.doctor(&Checkup::new()).await {
        Ok(diagnosis) => diagnosis,
        Err(e) => return error_page(&viewer, e),
    };
    let rows: Vec<Vec<String>> = diagnosis
        .findings
        .iter()
        .map(|f| {
            let severity = f.severity.as_str();
            vec![
                esc(f.check),
                format!("<span class=\"{severity}\">{severity}</span>"),
                esc(&f.summary),
                f.fix.as_deref().map(esc).unwrap_or_default(),
            ]
        })
        .collect();
    let body = format!(
        "<p class=\"note\">What <code>idem doctor</code> finds, on its defaults. It counts \
         the leases in progress, which have no index: on a table of many millions of markers, \
         open this page off-peak.</p>{}",
        table("findings", &["Check", "Severity", "Finding", "Fix"], &rows)
    );
    page(&viewer, "Doctor", &body)
}

/// A listing of markers, each linked to its job's page.
pub(super) fn markers(viewer: &Viewer, id: &str, list: &[Marker]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|m| {
            let lease = match m.lease_ms_left {
                Some(ms) if ms > 0 => format!("held, {} left", age(ms)),
                Some(_) => "run out".to_owned(),
                None => String::new(),
            };
            vec![
                esc(&m.scope),
                job_link(viewer, &m.scope, &m.key),
                state(m.state).into(),
                m.attempts.to_string(),
                esc(m.completed_at.as_deref().unwrap_or(&m.created_at)),
                lease,
                m.error.as_deref().map(esc).unwrap_or_default(),
            ]
        })
        .collect();
    let header = ["Scope", "Key", "State", "Attempts", "At", "Lease", "Error"];
    table(id, &header, &rows)
}

fn state(state: MarkerState) -> &'static str {
    match state {
        MarkerState::InProgress => "in progress",
        MarkerState::Completed => "completed",
        MarkerState::Failed => "failed",
    }
}
