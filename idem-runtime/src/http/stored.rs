//! The response a completed key replays: what is kept of it with the marker, in the commit of
//! the handler's own writes, and how it is sent again.

use ::http::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use ::http::{Response, StatusCode};
use axum_core::body::Body;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use serde_json::Value;

use crate::record::MAX_REPLAY_LEN;

/// The header a replayed response carries (draft-ietf-httpapi-idempotency-key-header's
/// examples; Stripe's `Idempotent-Replayed`).
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Whether a response with this status is kept (and the handler's writes with it), or rolled
/// back so that the retry runs again.
///
/// Kept: 2xx, 3xx, and the 4xx that answer the request itself (400, 403, 404, 422, ...): the
/// draft wants a retry to get the first result, success or error, and sending the same
/// request again cannot change them. Rolled back: every 5xx (the server failed, the retry
/// should run) and the 4xx that say "not now" rather than "not this": 408 Request Timeout,
/// 409 Conflict, 423 Locked, 425 Too Early and 429 Too Many Requests.
pub fn kept(status: StatusCode) -> bool {
    match status.as_u16() {
        408 | 409 | 423 | 425 | 429 => false,
        200..=499 => true,
        _ => false,
    }
}

/// The marker's stored value: the status, the chosen headers and the body (base64: bytes,
/// exactly as sent). `body` is `None` when the body was not kept (a streamed or oversized
/// one): the retry then gets the status and headers with an empty body.
#[derive(Debug)]
pub(crate) struct Stored {
    status: u16,
    headers: Vec<(String, String)>,
    body: Option<String>,
}

impl Stored {
    /// What is kept of `parts`: its status and those of `names` it has whose values are UTF-8
    /// (a header that is not is left out); with the body, or without (`None`).
    pub(crate) fn new(
        parts: &::http::response::Parts,
        names: &[HeaderName],
        body: Option<&[u8]>,
    ) -> Stored {
        let mut headers = Vec::new();
        for name in names {
            // Without the body, its type is not sent again either.
            if body.is_none() && name == CONTENT_TYPE {
                continue;
            }
            for value in parts.headers.get_all(name) {
                if let Ok(v) = std::str::from_utf8(value.as_bytes()) {
                    headers.push((name.as_str().to_owned(), v.to_owned()));
                }
            }
        }
        Stored {
            status: parts.status.as_u16(),
            headers,
            body: body.map(|b| STANDARD.encode(b)),
        }
    }

    /// The JSON stored with the marker, if it fits in [`MAX_REPLAY_LEN`].
    pub(crate) fn encode(&self) -> Option<String> {
        let json = serde_json::to_string(self).expect("strings and numbers serialise");
        (json.len() <= MAX_REPLAY_LEN).then_some(json)
    }

    /// Reads a stored value back; `None` if it is not one the layer wrote.
    pub(crate) fn decode(json: &str) -> Option<Stored> {
        let value: Value = serde_json::from_str(json).ok()?;
        let status = u16::try_from(value.get("status")?.as_u64()?).ok()?;
        let mut headers = Vec::new();
        for pair in value.get("headers")?.as_array()? {
            let [name, value] = pair.as_array()?.as_slice() else {
                return None;
            };
            headers.push((name.as_str()?.to_owned(), value.as_str()?.to_owned()));
        }
        let body = match value.get("body")? {
            Value::Null => None,
            body => Some(body.as_str()?.to_owned()),
        };
        Some(Stored {
            status,
            headers,
            body,
        })
    }

    /// The response again, byte for byte, marked as replayed.
    pub(crate) fn replay(self) -> Option<Response<Body>> {
        let body = match self.body {
            Some(b64) => Bytes::from(STANDARD.decode(b64).ok()?),
            None => Bytes::new(),
        };
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::from_u16(self.status).ok()?;
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            let name = HeaderName::try_from(name).ok()?;
            headers.append(name, HeaderValue::try_from(value).ok()?);
        }
        headers.insert(REPLAYED, HeaderValue::from_static("true"));
        Some(response)
    }
}

// Written straight into the string, without a `serde_json::Value` first: this runs while the
// claimed transaction (on SQLite, the database's one write lock) is held.
impl serde::Serialize for Stored {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut json = serializer.serialize_struct("Stored", 3)?;
        json.serialize_field("status", &self.status)?;
        json.serialize_field("headers", &self.headers)?;
        json.serialize_field("body", &self.body)?;
        json.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_statuses_are_kept() {
        for s in [200, 201, 204, 303, 400, 403, 404, 410, 422] {
            assert!(kept(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [408, 409, 423, 425, 429, 500, 502, 503] {
            assert!(!kept(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[test]
    fn a_stored_response_replays_byte_for_byte() {
        let (mut parts, ()) = Response::new(()).into_parts();
        parts.status = StatusCode::CREATED;
        parts
            .headers
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/html"));
        parts
            .headers
            .insert("location", HeaderValue::from_static("/invoices/7"));
        parts
            .headers
            .insert("x-other", HeaderValue::from_static("no"));
        let names = [CONTENT_TYPE, HeaderName::from_static("location")];
        let body = b"\x00\xffbytes";
        let json = Stored::new(&parts, &names, Some(body)).encode().unwrap();
        let replayed = Stored::decode(&json).unwrap().replay().unwrap();
        assert_eq!(replayed.status(), StatusCode::CREATED);
        assert_eq!(replayed.headers()["content-type"], "text/html");
        assert_eq!(replayed.headers()["location"], "/invoices/7");
        assert_eq!(replayed.headers()["idempotent-replayed"], "true");
        assert!(replayed.headers().get("x-other").is_none());

        // The shape `idem inspect` reads a stored response's status from.
        let doc: Value = serde_json::from_str(&json).unwrap();
        assert_eq!(doc["status"], 201);
        assert!(
            doc["headers"].is_array() && doc["body"].is_string(),
            "{doc}"
        );

        let without = Stored::new(&parts, &names, None).encode().unwrap();
        let replayed = Stored::decode(&without).unwrap().replay().unwrap();
        assert!(replayed.headers().get("content-type").is_none());
        assert_eq!(replayed.headers()["location"], "/invoices/7");
    }

    #[test]
    fn an_oversized_record_is_not_encoded() {
        let (parts, ()) = Response::new(()).into_parts();
        let big = vec![0_u8; MAX_REPLAY_LEN];
        assert!(Stored::new(&parts, &[], Some(&big)).encode().is_none());
    }
}
