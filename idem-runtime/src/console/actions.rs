//! The console's actions: an admin's form, its token checked before anything is read or
//! changed, the change made as the `idem` tool makes it, and one row of the audit log.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, State};
use axum::response::Response;
use http::StatusCode;
use http::request::Parts;
use serde::Deserialize;

use super::html::{esc, failure, page};
use super::pages::error_page;
use super::{Admin, Shared, Viewer};
use crate::backend::Backend;
use crate::bulk::{FailedFilter, FailureGroup};

/// The admin a form comes from, or why it is refused (403): not an admin, or a form without
/// this admin's token (another site's, or one served for someone else).
pub(super) fn admin<DB: Backend>(
    c: &Shared<DB>,
    viewer: &Viewer,
    token: &str,
) -> Result<Admin, &'static str> {
    let Some(admin) = &viewer.admin else {
        return Err(
            "this console is read-only for you: the application grants actions to \
                    its admins only; nothing was changed",
        );
    };
    let expected = c.token(admin);
    // Compared in full whatever differs first: how long a comparison takes says nothing.
    let same = expected.len() == token.len()
        && expected
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if !same {
        return Err(
            "the form's token is missing or not this console's: reload the page and \
                    send its form again; nothing was changed",
        );
    }
    Ok(admin.clone())
}

/// The page after an action: what changed, and where the audit log shows it.
fn done(viewer: &Viewer, what: &str) -> Response {
    let body = format!(
        "<p id=\"done\">{}</p><p><a href=\"{}/audit\">The audit log</a> keeps it.</p>",
        esc(what),
        esc(&viewer.base)
    );
    page(viewer, "Done", &body)
}

#[derive(Deserialize)]
pub(super) struct GroupForm {
    #[serde(default)]
    token: String,
    /// What the group's page counted: the requeue takes at most that many, so that jobs that
    /// failed after the admin looked wait for the next look.
    count: u64,
}

/// Requeues the failed jobs of a group, at most as many as its page showed.
pub(super) async fn requeue_group<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    Path(id): Path<String>,
    parts: Parts,
    Form(form): Form<GroupForm>,
) -> Response {
    let viewer = Viewer::of(&parts);
    let admin = match admin(&c, &viewer, &form.token) {
        Ok(admin) => admin,
        Err(why) => return failure(&viewer, StatusCode::FORBIDDEN, why),
    };
    if !FailureGroup::is_id(&id) {
        let what = format!("{id:?} is not a group id (12 lower-case hex digits)");
        return failure(&viewer, StatusCode::BAD_REQUEST, &what);
    }
    let group = match c.store.failure_group(&id).await {
        Ok(Some(group)) => group,
        Ok(None) => {
            let what = format!("no failed job is in group {id}: requeued already; nothing done");
            return failure(&viewer, StatusCode::NOT_FOUND, &what);
        }
        Err(e) => return error_page(&viewer, e),
    };
    let filter = FailedFilter::new().group(&group);
    let requeued = match c.store.requeue_failed(&filter, form.count).await {
        Ok(n) => n,
        Err(e) => return error_page(&viewer, e),
    };
    let target = serde_json::json!({
        "group": id,
        "scope": group.scope,
        "error": group.error,
    });
    let what = format!(
        "requeued {requeued} failed jobs of group {id}: their next deliveries run them again"
    );
    record(
        &c,
        &viewer,
        &admin,
        "requeue --all",
        &target.to_string(),
        requeued,
        what,
    )
    .await
}

#[derive(Deserialize)]
pub(super) struct JobForm {
    #[serde(default)]
    token: String,
    scope: String,
    key: String,
}

/// Requeues one failed job.
pub(super) async fn requeue_job<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    parts: Parts,
    Form(form): Form<JobForm>,
) -> Response {
    let viewer = Viewer::of(&parts);
    let admin = match admin(&c, &viewer, &form.token) {
        Ok(admin) => admin,
        Err(why) => return failure(&viewer, StatusCode::FORBIDDEN, why),
    };
    let requeued = match c.store.requeue(&form.scope, form.key.as_str()).await {
        Ok(requeued) => requeued,
        Err(e) => return error_page(&viewer, e),
    };
    if !requeued {
        let what = "that job has not failed (requeued already, or never failed): nothing done";
        return failure(&viewer, StatusCode::CONFLICT, what);
    }
    let target = serde_json::json!({ "scope": form.scope, "key": form.key });
    let what = format!(
        "requeued {} of scope {}: its next delivery runs it again",
        form.key, form.scope
    );
    record(&c, &viewer, &admin, "requeue", &target.to_string(), 1, what).await
}

#[derive(Deserialize)]
pub(super) struct MessageForm {
    #[serde(default)]
    token: String,
    id: String,
}

/// Makes a parked outbox message pending again.
pub(super) async fn requeue_message<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    parts: Parts,
    Form(form): Form<MessageForm>,
) -> Response {
    let viewer = Viewer::of(&parts);
    let admin = match admin(&c, &viewer, &form.token) {
        Ok(admin) => admin,
        Err(why) => return failure(&viewer, StatusCode::FORBIDDEN, why),
    };
    let requeued = match c.store.requeue_outbox(&form.id).await {
        Ok(requeued) => requeued,
        Err(e) => return error_page(&viewer, e),
    };
    if !requeued {
        let what = format!("message {} is not parked: nothing done", form.id);
        return failure(&viewer, StatusCode::CONFLICT, &what);
    }
    let what = format!(
        "message {} is pending again: the relay sends it when it next runs",
        form.id
    );
    record(&c, &viewer, &admin, "outbox requeue", &form.id, 1, what).await
}

/// Writes the action's row of the audit log, then says what was done; if the row cannot be
/// written, says what was changed all the same (500), as the `idem` tool does.
pub(super) async fn record<DB: Backend>(
    c: &Shared<DB>,
    viewer: &Viewer,
    admin: &Admin,
    action: &str,
    target: &str,
    changed: u64,
    what: String,
) -> Response {
    let action = format!("console {action}");
    match c
        .store
        .record_action(admin.actor(), &action, target, changed)
        .await
    {
        Ok(()) => done(viewer, &what),
        Err(e) => {
            let what = format!("{what}; but the audit log could not be written: {e}");
            failure(viewer, StatusCode::INTERNAL_SERVER_ERROR, &what)
        }
    }
}
