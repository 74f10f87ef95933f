//! The console's HTML: one layout, escaped text, tables and a bar chart drawn as SVG on the
//! server. No template engine: the pages are few and small, and `format!` with one escaping
//! function keeps the crate's dependencies what they were.

use std::fmt::Write as _;

use axum::response::{Html, IntoResponse, Response};
use http::StatusCode;

use super::Viewer;
use crate::relay::{OutboxEntry, OutboxState};

/// `text` safe inside an element or a quoted attribute.
pub(super) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one value of a URL's query.
pub(super) fn query_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            b => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}\
nav{background:#1d2733;padding:.5em 1em;display:flex;gap:1em;flex-wrap:wrap;align-items:center}\
nav a{color:#fff;text-decoration:none}nav .who{margin-left:auto;color:#cbd5e1}\
main{padding:1em 1.5em;max-width:80em}table{border-collapse:collapse;margin:.5em 0}\
th,td{border-bottom:1px solid #ddd;padding:.25em .75em;text-align:left;vertical-align:top}\
.note{color:#555}\
.ok{color:#166534}.warning{color:#a16207}.problem,.err{color:#b91c1c}\
form.inline{display:inline}button{cursor:pointer}code{font-size:90%}";

/// A whole page: the navigation, who is looking, `body`.
pub(super) fn page(viewer: &Viewer, title: &str, body: &str) -> Response {
    let b = esc(&viewer.base);
    let who = match &viewer.admin {
        Some(admin) => format!("{} (admin)", esc(admin.actor())),
        None => "read-only".to_owned(),
    };
    // Nested at `/idem`, the overview is `/idem` (axum matches no `/idem/`); alone, `/`.
    let home = if b.is_empty() { "/" } else { &b };
    let html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\"><title>{t} · idem</title>\
         <style>{STYLE}</style></head><body><nav>\
         <a href=\"{home}\">Overview</a><a href=\"{b}/failures\">Failures</a>\
         <a href=\"{b}/stuck\">Stuck</a><a href=\"{b}/outbox\">Outbox</a>\
         <a href=\"{b}/audit\">Audit</a><a href=\"{b}/doctor\">Doctor</a>\
         <form method=\"get\" action=\"{b}/job\"><input name=\"scope\" placeholder=\"scope\" \
         size=\"14\"> <input name=\"key\" placeholder=\"key\" size=\"20\"> \
         <button>Find job</button></form><span class=\"who\" id=\"who\">{who}</span></nav>\
         <main><h1>{t}</h1>{body}</main></body></html>",
        t = esc(title),
    );
    Html(html).into_response()
}

/// A page that says what went wrong, with `status`.
pub(super) fn failure(viewer: &Viewer, status: StatusCode, what: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    let body = format!("<p class=\"err\" id=\"error\">{}</p>", esc(what));
    let mut response = page(viewer, title, &body);
    *response.status_mut() = status;
    response
}

/// A table: the header's cells, then each row's cells (HTML already escaped).
pub(super) fn table(id: &str, header: &[&str], rows: &[Vec<String>]) -> String {
    if rows.is_empty() {
        return format!("<p class=\"note\" id=\"{id}\">None.</p>");
    }
    let mut out = format!("<table id=\"{id}\"><thead><tr>");
    for h in header {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            let _ = write!(out, "<td>{cell}</td>");
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    out
}

/// The hidden fields that make a form an admin's: the token of `token`.
pub(super) fn token_field(token: &str) -> String {
    format!(
        "<input type=\"hidden\" name=\"token\" value=\"{}\">",
        esc(token)
    )
}

/// Bars of applied (green) and failed (red, on top) jobs per stretch, `slots` of them ending
/// with the stretch that holds `now`: each bar's height is its count against the largest.
pub(super) fn bars(counts: &[(i64, u64, u64)], now: i64, bucket: i64, slots: i64) -> String {
    const W: i64 = 8;
    const H: u64 = 40;
    let last = now - now.rem_euclid(bucket);
    let first = last - (slots - 1) * bucket;
    let top = counts
        .iter()
        .map(|(_, a, f)| a + f)
        .max()
        .unwrap_or(0)
        .max(1);
    let mut svg = format!(
        "<svg width=\"{}\" height=\"{H}\" role=\"img\" aria-label=\"jobs per hour\">",
        slots * W
    );
    for &(from, applied, failed) in counts {
        if from < first || from > last {
            continue;
        }
        let x = (from - first) / bucket * W;
        let ha = applied * H / top;
        let hf = failed * H / top;
        let label = format!("{} UTC: {applied} applied, {failed} failed", hour(from));
        let _ = write!(
            svg,
            "<g><title>{label}</title>\
             <rect x=\"{x}\" y=\"{}\" width=\"{}\" height=\"{ha}\" fill=\"#16a34a\"/>\
             <rect x=\"{x}\" y=\"{}\" width=\"{}\" height=\"{hf}\" fill=\"#dc2626\"/></g>",
            H - ha,
            W - 1,
            H - ha - hf,
            W - 1,
        );
    }
    svg.push_str("</svg>");
    svg
}

/// `HH:00` of a time in seconds since 1970 (UTC).
fn hour(secs: i64) -> String {
    format!("{:02}:00", secs.rem_euclid(86_400) / 3_600)
}

pub(super) fn job_link(viewer: &Viewer, scope: &str, key: &str) -> String {
    format!(
        "<a href=\"{}/job?scope={}&amp;key={}\">{}</a>",
        esc(&viewer.base),
        query_value(scope),
        query_value(key),
        esc(key)
    )
}

/// Milliseconds as an operator reads them.
pub(super) fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3_600 => format!("{} min", s / 60),
        3_600..86_400 => format!("{} h {} min", s / 3_600, s % 3_600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3_600),
    }
}

/// A table of outbox messages: id, state, destination, its job, attempts, age, last error,
/// and for an admin (`token`) a parked one's requeue.
pub(super) fn messages(viewer: &Viewer, token: Option<&str>, list: &[OutboxEntry]) -> String {
    let rows: Vec<Vec<String>> = list.iter().map(|m| message_row(viewer, token, m)).collect();
    let header = [
        "Id",
        "State",
        "Destination",
        "Job",
        "Attempts",
        "Age",
        "Last error",
        "",
    ];
    table("messages", &header, &rows)
}

fn message_row(viewer: &Viewer, token: Option<&str>, m: &OutboxEntry) -> Vec<String> {
    let action = match (token, m.state) {
        (Some(token), OutboxState::Parked) => format!(
            "<form class=\"inline\" method=\"post\" action=\"{}/outbox/requeue\">{}\
             <input type=\"hidden\" name=\"id\" value=\"{}\"><button>Requeue</button></form>",
            esc(&viewer.base),
            token_field(token),
            esc(&m.id),
        ),
        _ => String::new(),
    };
    let state = match m.state {
        OutboxState::Parked => "parked",
        OutboxState::Pending => "pending",
        OutboxState::Sent => "sent",
    };
    vec![
        format!("<code>{}</code>", esc(&m.id)),
        state.into(),
        esc(&m.destination),
        job_link(viewer, &m.scope, &m.key),
        m.attempts.to_string(),
        age(m.age_ms),
        m.last_error.as_deref().map(esc).unwrap_or_default(),
        action,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_elements_attributes_and_queries() {
        assert_eq!(
            esc("<a href=\"x\">it's & co</a>"),
            "&lt;a href=&quot;x&quot;&gt;it&#39;s &amp; co&lt;/a&gt;"
        );
        assert_eq!(query_value("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn bars_place_each_stretch_by_its_hour_and_scale_to_the_largest() {
        let now = 10 * 3_600 + 120;
        let svg = bars(&[(9 * 3_600, 10, 10), (10 * 3_600, 5, 0)], now, 3_600, 24);
        // The last slot (x = 23 * 8) is 10:00, 09:00 the one before (x = 22 * 8); 20 jobs top.
        assert!(
            svg.contains("x=\"176\" y=\"20\" width=\"7\" height=\"20\""),
            "{svg}"
        );
        assert!(svg.contains("x=\"176\" y=\"0\" width=\"7\" height=\"20\" fill=\"#dc2626\""));
        assert!(
            svg.contains("x=\"184\" y=\"30\" width=\"7\" height=\"10\""),
            "{svg}"
        );
        assert!(svg.contains("10:00 UTC: 5 applied, 0 failed"));
    }
}
