//! An outside call over HTTP in a lease's body (feature `reqwest`): the idempotency key and the
//! time budget set on the request, and a failure classed for the lease's end by what it says
//! about the effect (nothing sent, refused for good, worth a retry, perhaps done).

use std::time::Duration;

use reqwest::{RequestBuilder, Response, StatusCode};

use super::{Class, Lease, MAX_ERROR_LEN, Step};
use crate::error::Error;
use crate::record::bounded;

/// How much of a refused request's answer the permanent error's text quotes: enough for a
/// provider's reason (`insufficient funds`), not a whole error page.
const BODY_START: usize = 200;

impl Step {
    /// Sets the step's [`idempotency_key`](Step::idempotency_key) as the request's
    /// `Idempotency-Key` header and its [`remaining`](Step::remaining) time as its timeout.
    /// Send it with [`Lease::send`].
    pub fn request(&self, builder: RequestBuilder) -> RequestBuilder {
        keyed(builder, self.idempotency_key(), self.remaining())
    }
}

impl Lease {
    /// Sets the lease's [`idempotency_key`](Lease::idempotency_key) as the request's
    /// `Idempotency-Key` header and its [`remaining`](Lease::remaining) time as its timeout,
    /// for a body that makes one outside call outside of any step. Send it with
    /// [`send`](Lease::send).
    pub fn request(&self, builder: RequestBuilder) -> RequestBuilder {
        keyed(builder, self.idempotency_key(), self.remaining())
    }

    /// Sends `request` while keeping the lease alive (as [`keep_alive`](Lease::keep_alive)
    /// does), and classes its failure for the lease's end: when the body returns the error, the
    /// class decides what happens to the key.
    ///
    /// | what happened | returns | class |
    /// |---|---|---|
    /// | an answer below 400 (2xx) | `Ok(Ok(response))` | none |
    /// | 408, 409, 425, 429, 5xx | `Ok(Err(e))`, `e` from `error_for_status` | [`transient`](Lease::transient): released, retried with the same key |
    /// | any other 4xx (402 card declined, 400, 422) | `Ok(Err(e))`, `e` from `error_for_status` | [`permanent`](Lease::permanent), with the status, the path and the start of the answer's body as its text |
    /// | no connection (refused, unreachable, DNS), or a request that could not be built | `Ok(Err(e))` | [`transient`](Lease::transient): nothing was sent |
    /// | a timeout, or a connection lost after the request went out | `Ok(Err(e))` | [`unknown`](Lease::unknown): the lease is kept until it runs out |
    /// | a renewal found the key taken over | `Err(LeaseError::Lost)` | (the new holder decides) |
    ///
    /// A 409 is what Stripe answers to a request whose key another request is still using; the
    /// `Idempotency-Key` is what makes every transient retry safe: a provider that had already
    /// done the work answers the retry with its first result. The class counts only if the
    /// body returns `Err` (the last class given wins); reading the answer's body is the caller's.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[derive(Debug)] enum AppError { Idem(idem::Error), Http(idem::reqwest::Error) }
    /// # impl From<idem::Error> for AppError { fn from(e: idem::Error) -> Self { AppError::Idem(e) } }
    /// # impl From<idem::reqwest::Error> for AppError { fn from(e: idem::reqwest::Error) -> Self { AppError::Http(e) } }
    /// # async fn f(lease: &idem::Lease, http: &idem::reqwest::Client) -> Result<String, AppError> {
    /// let id: String = lease
    ///     .step("charge", async |step| {
    ///         let request = step.request(http.post("http://payments/charges")).body("4200");
    ///         Ok::<_, AppError>(lease.send(request).await??.text().await?)
    ///     })
    ///     .await?;
    /// # Ok(id) }
    /// ```
    pub async fn send(
        &self,
        request: RequestBuilder,
    ) -> Result<Result<Response, reqwest::Error>, Error> {
        self.keep_alive(async {
            match request.send().await {
                Ok(response) => self.answered(response).await,
                Err(e) => {
                    self.classify(class_of(&e));
                    Err(e)
                }
            }
        })
        .await
    }

    async fn answered(&self, response: Response) -> Result<Response, reqwest::Error> {
        let error = match response.error_for_status_ref() {
            Ok(_) => return Ok(response),
            Err(error) => error,
        };
        let status = response.status();
        if retried(status) {
            self.classify(Class::Transient);
            return Err(error);
        }
        let text = format!("{status} from {}", response.url().path());
        let body = body_start(response).await;
        let text = if body.is_empty() {
            text
        } else {
            format!("{text}: {body}")
        };
        self.classify(Class::Permanent(bounded(&text, MAX_ERROR_LEN).into_owned()));
        Err(error)
    }
}

fn keyed(builder: RequestBuilder, key: &str, remaining: Duration) -> RequestBuilder {
    builder.header("Idempotency-Key", key).timeout(remaining)
}

/// A status whose retry with the same key may succeed: the server was busy, slow, limiting
/// the rate, or still working on the key (409, Stripe's answer to a concurrent request).
fn retried(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 409 | 425 | 429) || status.is_server_error()
}

/// A failure without an answer: transient only when the request cannot have been sent.
fn class_of(error: &reqwest::Error) -> Class {
    // A connection never made (refused, a connect timeout, a name that does not resolve) and a
    // request never built sent nothing; everything else may have reached the server.
    if error.is_connect() || error.is_builder() {
        Class::Transient
    } else {
        Class::Unknown
    }
}

/// The first [`BODY_START`] bytes of a refused request's answer, as text on one line; what the
/// body cannot give within the request's timeout is left out.
async fn body_start(mut response: Response) -> String {
    let mut start = Vec::new();
    while start.len() < BODY_START {
        match response.chunk().await {
            Ok(Some(chunk)) => start.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&start);
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    bounded(&line, BODY_START).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_worth_a_retry_are_busy_slow_limited_or_concurrent() {
        let retried_of = |code: u16| retried(StatusCode::from_u16(code).unwrap());
        for code in [408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(retried_of(code), "{code}");
        }
        for code in [400, 401, 402, 403, 404, 410, 422] {
            assert!(!retried_of(code), "{code}");
        }
    }
}
