//! The layer's own answers: RFC 9457 problem details (`application/problem+json`).

use ::http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use ::http::{Response, StatusCode};
use axum_core::body::Body;

/// A problem response: `{"type":"about:blank","title":..,"status":..,"detail":..}`.
pub(crate) fn problem(status: StatusCode, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// 409: the first request with this key is still running.
pub(crate) fn in_progress(header: &str, retry_after_secs: u64) -> Response<Body> {
    let mut response = problem(
        StatusCode::CONFLICT,
        &format!(
            "a request with this `{header}` is still being processed; retry it unchanged \
             after {retry_after_secs} s: it then gets that request's response"
        ),
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs));
    response
}

/// 422: the key was used for another request.
pub(crate) fn key_reused(header: &str) -> Response<Body> {
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        &format!(
            "this `{header}` was already used for a different request (another method, path \
             or body); send a new key for a new request"
        ),
    )
}
