//! The pages of stuck leases and of the outbox, and their actions on all at once: forget the
//! stuck leases no delivery holds, requeue every parked message. Each action's page counts
//! first (the dry run), and the action takes at most that count.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::Response;
use http::request::Parts;
use serde::Deserialize;

use super::actions::{Acting, record};
use super::html::{esc, messages, page, token_field};
use super::pages::{Console, ROWS, error_page, markers};
use super::{Shared, Viewer};
use crate::backend::Backend;
use crate::relay::{OutboxState, ParkedFilter};

/// How many parked messages the dry run of a requeue lists.
const PARKED_ROWS: u32 = 20;

#[derive(Deserialize)]
pub(super) struct StuckQuery {
    minutes: Option<u64>,
}

/// Leases in progress for longer than a bound (15 minutes unless `?minutes=` says); for an
/// admin, the form that forgets those no delivery holds.
pub(super) async fn stuck<DB: Backend>(
    State(c): Console<DB>,
    Query(q): Query<StuckQuery>,
    parts: Parts,
) -> Response {
    let viewer = Viewer::of(&parts);
    let minutes = q.minutes.unwrap_or(15);
    let older = Duration::from_secs(minutes.saturating_mul(60));
    let read = async {
        let counted = c.store.count_stuck(None, older).await?;
        let list = c.store.list_stuck(None, older, ROWS).await?;
        Ok::<_, crate::Error>((counted, list))
    };
    let ((all, held), list) = match read.await {
        Ok(read) => read,
        Err(e) => return error_page(&viewer, e),
    };
    let free = all - held.min(all);
    let mut body = format!(
        "<p id=\"stuck-count\">{all} markers in progress since more than {minutes} minutes, \
         not let go; a delivery still holds the lease of {held} of them. Forgetting one lets \
         its next delivery take it over; one still held is left (<code>idem forget \
         --stuck-older-than --force</code> forces it, with what that risks).</p>"
    );
    if let (Some(admin), true) = (&viewer.admin, free > 0) {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}/stuck/forget\">{}\
             <input type=\"hidden\" name=\"minutes\" value=\"{minutes}\">\
             <input type=\"hidden\" name=\"count\" value=\"{all}\">\
             <button id=\"forget\">Forget the {free} not held</button></form>",
            esc(&viewer.base),
            token_field(&c.token(admin)),
        );
    }
    body += &markers(&viewer, "stuck", &list);
    page(&viewer, "Stuck leases", &body)
}

#[derive(Deserialize)]
pub(super) struct ForgetForm {
    minutes: u64,
    /// What the page counted: at most that many are forgotten.
    count: u64,
}

/// Forgets the stuck leases of the bound that no delivery holds.
pub(super) async fn forget_stuck<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    acting: Acting<ForgetForm>,
) -> Response {
    let Acting {
        viewer,
        admin,
        form,
    } = acting;
    let older = Duration::from_secs(form.minutes.saturating_mul(60));
    let forgot = match c.store.forget_stuck(None, older, false, form.count).await {
        Ok(n) => n,
        Err(e) => return error_page(&viewer, e),
    };
    let target = serde_json::json!({ "older_than_minutes": form.minutes, "force": false });
    let what = format!(
        "forgot {forgot} leases in progress since more than {} minutes: their next \
         deliveries take them over",
        form.minutes
    );
    let action = "forget --stuck-older-than";
    record(
        &c,
        &viewer,
        &admin,
        action,
        &target.to_string(),
        forgot,
        what,
    )
    .await
}

/// The parked messages, then the oldest pending ones; for an admin, a parked one's requeue
/// and the way to the requeue of all.
pub(super) async fn outbox<DB: Backend>(State(c): Console<DB>, parts: Parts) -> Response {
    let viewer = Viewer::of(&parts);
    let list = match c.store.list_outbox(true, true, ROWS).await {
        Ok(list) => list,
        Err(e) => return error_page(&viewer, e),
    };
    let token = viewer.admin.as_ref().map(|admin| c.token(admin));
    let mut body = format!(
        "<p class=\"note\">Unsent messages, parked first, then the oldest pending (at most \
         {ROWS}).</p>"
    );
    if list.iter().any(|m| m.state == OutboxState::Parked) {
        let _ = write!(
            body,
            "<p><a id=\"all-parked\" href=\"{}/outbox/parked\">Every parked message</a>: how \
             many, and their requeue.</p>",
            esc(&viewer.base)
        );
    }
    body += &messages(&viewer, token.as_deref(), &list);
    page(&viewer, "Outbox", &body)
}

/// Every parked message: how many a requeue would take and the first of them (the dry
/// run); for an admin, the requeue of all.
pub(super) async fn parked<DB: Backend>(State(c): Console<DB>, parts: Parts) -> Response {
    let viewer = Viewer::of(&parts);
    let every = ParkedFilter::new();
    let read = async {
        let count = c.store.count_parked(&every).await?;
        let first = c.store.list_parked_matching(&every, PARKED_ROWS).await?;
        Ok::<_, crate::Error>((count, first))
    };
    let (count, first) = match read.await {
        Ok(read) => read,
        Err(e) => return error_page(&viewer, e),
    };
    let mut body = format!(
        "<p id=\"dry-run\">A requeue would take <b id=\"count\">{count}</b> parked messages \
         (the first {} below, in the relay's order); nothing is changed until it runs.</p>",
        first.len()
    );
    if let (Some(admin), true) = (&viewer.admin, count > 0) {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}/outbox/requeue-all\">{}\
             <input type=\"hidden\" name=\"count\" value=\"{count}\">\
             <button id=\"requeue\">Requeue these {count} messages</button></form>",
            esc(&viewer.base),
            token_field(&c.token(admin)),
        );
    }
    body += &messages(&viewer, None, &first);
    page(&viewer, "Parked messages", &body)
}

#[derive(Deserialize)]
pub(super) struct CountForm {
    /// What the page counted: at most that many are requeued.
    count: u64,
}

/// Requeues every parked message, at most as many as the page counted.
pub(super) async fn requeue_parked<DB: Backend>(
    State(c): State<Arc<Shared<DB>>>,
    acting: Acting<CountForm>,
) -> Response {
    let Acting {
        viewer,
        admin,
        form,
    } = acting;
    let requeued = match c
        .store
        .requeue_parked(&ParkedFilter::new(), form.count)
        .await
    {
        Ok(n) => n,
        Err(e) => return error_page(&viewer, e),
    };
    let target = serde_json::json!({ "destination": null, "error": null, "parked_before": null });
    let what =
        format!("requeued {requeued} parked messages: the relay sends them when it next runs");
    let action = "outbox requeue --all";
    record(
        &c,
        &viewer,
        &admin,
        action,
        &target.to_string(),
        requeued,
        what,
    )
    .await
}
