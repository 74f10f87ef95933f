//! The console's actions: an admin's form, its token checked before anything is read or
//! changed, the change made as the `idem` tool makes it, and one row of the audit log.

use std::sync::Arc;

use axum::Form;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Path, Request, State};
use axum::response::{IntoResponse as _, Response};
use http::StatusCode;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::html::{esc, failure, page};
use super::pages::error_page;
use super::{Admin, Shared, Viewer};
use crate::backend::Backend;
use crate::bulk::{FailedFilter, FailureGroup};

/// The largest form an action reads.
const FORM_LIMIT: usize = 64 * 1024;

/// An admin's form, its token checked before its other fields are read: a request that is not
/// an admin's, or a form without this admin's token (another site's, or one served for
/// someone else), is refused (403) whatever else it holds.
pub(super) struct Acting<F> {
    pub(super) viewer: Viewer,
    pub(super) admin: Admin,
    pub(super) form: F,
}

#[derive(Deserialize)]
struct Token {
    #[serde(default)]
    token: String,
}

impl<DB: Backend, F: DeserializeOwned + Send> FromRequest<Arc<Shared<DB>>> for Acting<F> {
    type Rejection = Response;

    async fn from_request(request: Request, c: &Arc<Shared<DB>>) -> Result<Self, Response> {
        let (parts, body) = request.into_parts();
        let viewer = Viewer::of(&parts);
        let bytes = axum::body::to_bytes(body, FORM_LIMIT).await.map_err(|e| {
            let what = format!("the form could not be read: {e}; nothing was changed");
            failure(&viewer, StatusCode::BAD_REQUEST, &what)
        })?;
        let again = |bytes: Bytes| Request::from_parts(parts.clone(), Body::from(bytes));
        let Form(Token { token }) = Form::<Token>::from_request(again(bytes.clone()), &())
            .await
            .map_err(|e| e.into_response())?;
        let admin = admin(c, &viewer, &token)
            .map_err(|why| failure(&viewer, StatusCode::FORBIDDEN, why))?;
        let Form(form) = Form::<F>::from_request(again(bytes), &())
            .await
            .map_err(|e| e.into_response())?;
        Ok(Acting {
            viewer,
            admin,
            form,
        })
    }
}

/// The admin a form comes from, or why it is refused: not an admin, or not this admin's
/// token.
fn admin<DB: Backend>(c: &Shared<DB>, viewer: &Viewer, token: &str) -> Result<Admin, &'static str> {
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
    /// What the group's page counted: the requeue takes at most that many, so that jobs that
    /// failed after the admin looked wait for the next look.
    count: u64,
}

/// Requeues the failed jobs of a group, at most as many as its page showed.
pub(super) async fn requeue_group<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    Path(id): Path<String>,
    acting: Acting<GroupForm>,
) -> Response {
    let Acting {
        viewer,
        admin,
        form,
    } = acting;
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
    scope: String,
    key: String,
}

/// Requeues one failed job.
pub(super) async fn requeue_job<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    acting: Acting<JobForm>,
) -> Response {
    let Acting {
        viewer,
        admin,
        form,
    } = acting;
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
    id: String,
}

/// Makes a parked outbox message pending again.
pub(super) async fn requeue_message<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    acting: Acting<MessageForm>,
) -> Response {
    let Acting {
        viewer,
        admin,
        form,
    } = acting;
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
