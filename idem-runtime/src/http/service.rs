//! The layer's service: reads and checks the request before any database I/O, claims its key,
//! runs the handler on the claimed transaction, then stores the response in its commit.

use std::sync::Arc;
use std::task::{Context, Poll};

use ::http::{Request, Response, StatusCode};
use axum_core::BoxError;
use axum_core::body::Body;
use bytes::Bytes;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use tower_service::Service;

use super::extract::{Holding, Slot};
use super::finish::{Finish, Panicked};
use super::header;
use super::problem::{self, problem};
use super::stored::{Stored, kept};
use super::{Config, Principal};
use crate::backend::Backend;
use crate::claim::{self, Claimed, run};
use crate::error::{Error, NotKept};
use crate::future::BoxFuture;
use crate::job_id::job_id;
use crate::key::Key;
use crate::lease::claim_lease;
use crate::observe;
use crate::observe::semconv::{self, About};
use crate::record::Fingerprint;
use crate::traceparent::{TRACEPARENT, TraceParent};

/// The service an [`IdempotencyLayer`](super::IdempotencyLayer) wraps around `S`.
pub struct Idempotent<S, DB: Backend, P> {
    inner: S,
    config: Arc<Config<DB>>,
    principal: P,
}

impl<S: Clone, DB: Backend, P: Clone> Clone for Idempotent<S, DB, P> {
    fn clone(&self) -> Self {
        Idempotent {
            inner: self.inner.clone(),
            config: self.config.clone(),
            principal: self.principal.clone(),
        }
    }
}

impl<S, DB: Backend, P> std::fmt::Debug for Idempotent<S, DB, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent")
            .field("scope", &self.config.scope)
            .finish_non_exhaustive()
    }
}

impl<S, DB: Backend, P> Idempotent<S, DB, P> {
    pub(crate) fn new(inner: S, config: Arc<Config<DB>>, principal: P) -> Self {
        Idempotent {
            inner,
            config,
            principal,
        }
    }
}

impl<S, DB, P, B, ResB> Service<Request<B>> for Idempotent<S, DB, P>
where
    S: Service<Request<Body>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    DB: Backend,
    P: Principal,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone that was polled ready serves this request (tower's usual hand-over).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        let principal = self.principal.clone();
        Box::pin(serve(config, principal, inner, request))
    }
}

/// What the service's own functions need of the service it wraps, whose responses' bodies are
/// `ResB`: the bounds of its `Service` impl, in one name.
trait Inner<ResB>:
    Service<Request<Body>, Response = Response<ResB>, Future: Send, Error: Send + 'static>
    + Send
    + 'static
{
}

impl<S, ResB> Inner<ResB> for S
where
    S: Service<Request<Body>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
{
}

/// What the service's own functions need of a request's or a response's body.
trait HttpBody: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

impl<B> HttpBody for B
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
}

/// What became of a request before its handler ran: refused, or answered from its marker.
type Early = Response<Body>;

async fn serve<S, DB, P, B, ResB>(
    config: Arc<Config<DB>>,
    principal: P,
    mut inner: S,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Inner<ResB>,
    ResB: HttpBody,
    B: HttpBody,
    DB: Backend,
    P: Principal,
{
    if !config.methods.contains(request.method()) {
        let response = inner.call(request.map(Body::new)).await?;
        return Ok(response.map(Body::new));
    }
    let (parts, body, key, fingerprint) = match read(&config, &principal, request).await {
        Ok(read) => read,
        Err(early) => return Ok(early),
    };
    // The caller's trace context: the claim's span links to it, and the messages the handler
    // writes to the outbox carry it (a valid `traceparent` header; anything else is ignored,
    // as W3C Trace Context asks).
    let traceparent = parts
        .headers
        .get(TRACEPARENT)
        .and_then(TraceParent::from_header);
    // A replay, a conflict or a refusal is answered here. A client that hangs up during the
    // claim drops it, which rolls it back: nothing ran yet, and the retry claims again.
    let hold = match claim(&config, &key, &fingerprint, &parts.method, traceparent).await {
        Ok(hold) => hold,
        Err(early) => return Ok(early),
    };
    // The handler and the commit are finished even if the client hangs up (`Finish`), in
    // this task unless it does.
    let fresh = observe::carrying(traceparent, run_fresh(config, inner, parts, body, hold));
    match Finish::new(fresh).await {
        Ok(answer) => answer,
        Err(Panicked) => Ok(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the handler panicked; its writes were rolled back and nothing was kept",
        )),
    }
}

/// The name a refused nested claim gives the layer's claim.
const CALLER: &str = "IdempotencyLayer";

/// Claims the key: the claim to run the handler under, or the answer without it (the stored
/// response of a completed key, a conflict, a reused key, an error).
async fn claim<DB: Backend>(
    config: &Config<DB>,
    key: &Key,
    fingerprint: &Fingerprint,
    method: &::http::Method,
    traceparent: Option<TraceParent>,
) -> Result<Holding<DB>, Early> {
    let options = config.options.fingerprint(*fingerprint).link(traceparent);
    let mut request = claim::Request::of(
        config.scope.clone().into(),
        key.clone(),
        options,
        config.site,
        CALLER.into(),
    );
    // OpenTelemetry's HTTP attributes on the claim's span.
    request.about = Some(About::Http {
        method: semconv::http_method(method),
        route: config.route,
    });
    let claim = match config.lease {
        None => run::own(&config.store, request)
            .await
            .map(|c| c.map(Holding::Tx)),
        Some(lease) => {
            let mut lease = lease.replay().fingerprint(*fingerprint);
            if let (None, Some(wait)) = (lease.wait, config.wait) {
                lease = lease.wait(wait);
            }
            claim_lease(&config.store, request, lease)
                .await
                .map(|c| c.map(Holding::Lease))
        }
    };
    let header = config.header.as_str();
    match claim {
        Ok(Claimed::Fresh(holding)) => Ok(holding),
        Ok(Claimed::Replayed(recorded)) => {
            let replayed = recorded
                .result_json()
                .and_then(Stored::decode)
                .and_then(Stored::replay);
            Err(replayed.unwrap_or_else(|| not_kept(header)))
        }
        Ok(Claimed::Duplicate) => Err(not_kept(header)),
        Ok(Claimed::Failed(_)) => Err(failed_for_good(header)),
        Err(Error::InProgress { .. }) => Err(problem::in_progress(header, config.retry_after)),
        Err(Error::KeyReused { .. }) => Err(problem::key_reused(header)),
        Err(e) => Err(failed(&e, "the key could not be claimed")),
    }
}

/// Runs the handler on a fresh claim and stores its response in the commit (or the lease's
/// completion). A transaction-mode handler runs marked as inside its claim's transaction, so
/// that a claim with a store in it is refused; a lease-mode one under the lease's time limit,
/// which moves with each renewal.
async fn run_fresh<S, DB, ResB>(
    config: Arc<Config<DB>>,
    mut inner: S,
    mut parts: ::http::request::Parts,
    body: Bytes,
    holding: Holding<DB>,
) -> Result<Response<Body>, S::Error>
where
    S: Inner<ResB>,
    ResB: HttpBody,
    DB: Backend,
{
    let run = match &holding {
        Holding::Tx(held) => Ok(held.body()),
        Holding::Lease(lease) => Err((lease.span().clone(), lease.clock())),
    };
    let slot = Slot::new(holding);
    parts.extensions.insert(slot.clone());
    let call = inner.call(Request::from_parts(parts, Body::from(body)));
    let response = match run {
        Ok(body) => body.run(call).await,
        // Lease mode: the handler must be done before another request may take the key over.
        Err((span, clock)) => match clock.run(crate::observe::in_span(span, call)).await {
            Ok(response) => response,
            Err(after) => {
                if let Some(Holding::Lease(lease)) = slot.take() {
                    lease.timed_out(after).await;
                }
                return Ok(problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    &format!(
                        "the handler did not finish within {} ms (of its claim or its last \
                         renewal); nothing was recorded and the key is free again: retry \
                         with the same key",
                        after.as_millis()
                    ),
                ));
            }
        },
    };
    let Some(holding) = slot.take() else {
        // The handler kept its claim beyond its return (moved into a task): it is rolled
        // back (or the lease runs out) when that lets go of it.
        return Ok(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the handler kept its claim after it returned; nothing was kept",
        ));
    };
    let response = match response {
        Ok(response) => response,
        Err(e) => {
            holding.release().await;
            return Err(e);
        }
    };
    let (parts, body) = response.into_parts();
    if !kept(parts.status) {
        holding.release().await;
        return Ok(Response::from_parts(parts, Body::new(body)));
    }
    // A body of known size within the limit is read and stored; any other (streamed, or
    // larger) is sent as it comes after the commit, and only the status and headers are kept.
    let fits = body
        .size_hint()
        .upper()
        .is_some_and(|n| n <= config.stored_limit as u64);
    let (record, body) = if fits {
        let collected = body.collect().await.map_err(Into::<BoxError>::into);
        match collected {
            Ok(collected) => {
                let bytes = collected.to_bytes();
                let stored = Stored::new(&parts, &config.headers, Some(&bytes));
                (stored.encode(), Body::from(bytes))
            }
            Err(e) => {
                holding.release().await;
                tracing::warn!(target: "idem", error = %e, "idem: the handler's response body failed");
                return Ok(problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the handler's response body failed; nothing was kept",
                ));
            }
        }
    } else {
        (None, Body::new(body))
    };
    let json = match record {
        Some(json) => json,
        None => Stored::new(&parts, &config.headers, None)
            .encode()
            .unwrap_or_else(|| {
                Stored::new(&parts, &[], None)
                    .encode()
                    .expect("a status alone fits")
            }),
    };
    match holding.keep(json).await {
        Ok(()) => Ok(Response::from_parts(parts, body)),
        Err(e) => Ok(failed(&e, "the handler's work and response were not kept")),
    }
}

/// Checks the request and reads its body, before any database I/O: its key, its principal,
/// its body within the limit; then the marker's key and the request's fingerprint.
async fn read<DB: Backend, P: Principal, B: HttpBody>(
    config: &Config<DB>,
    principal: &P,
    request: Request<B>,
) -> Result<(::http::request::Parts, Bytes, Key, Fingerprint), Early> {
    let header = config.header.as_str();
    let (parts, body) = request.into_parts();
    let key = header::parse(parts.headers.get_all(&config.header), config.bare)
        .map_err(|why| problem(StatusCode::BAD_REQUEST, &why.detail(header)))?;
    let Some(principal) = principal.of(&parts) else {
        return Err(problem(
            StatusCode::UNAUTHORIZED,
            &format!(
                "an `{header}` belongs to a client, and this request does not say which \
                 client it comes from; send your credentials"
            ),
        ));
    };
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!(
                "the body is over the {} bytes this endpoint reads",
                config.body_limit
            ),
        )
    };
    if body.size_hint().lower() > config.body_limit as u64 {
        return Err(too_large());
    }
    let body = match Limited::new(body, config.body_limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => return Err(too_large()),
        Err(e) => {
            return Err(problem(
                StatusCode::BAD_REQUEST,
                &format!("the request body could not be read: {e}"),
            ));
        }
    };
    // `(principal, key)`, or its digest when longer than a key may be: another principal's
    // request with the same key claims another marker.
    let marker = job_id(&principal, key.as_str())
        .map_err(Error::from)
        .and_then(|id| Key::new(&id).map_err(Error::from))
        .map_err(|e| failed(&e, "the principal function returned an unusable principal"))?;
    let fingerprint = config.fingerprint(&parts, &body);
    Ok((parts, body, marker, fingerprint))
}

/// A completed key whose response the marker does not hold (written by something other than
/// this layer under the same scope).
fn not_kept(header: &str) -> Response<Body> {
    problem(
        StatusCode::CONFLICT,
        &format!(
            "a request with this `{header}` was completed, but its response was not kept; \
             send a new key for a new request"
        ),
    )
}

/// 409: a request with this key failed for good (a lease-mode handler said its error was
/// permanent). Its error's text is the application's, not the client's: it is not sent.
fn failed_for_good(header: &str) -> Response<Body> {
    problem(
        StatusCode::CONFLICT,
        &format!(
            "a request with this `{header}` failed for good and is not run again; send a new \
             key for a new request"
        ),
    )
}

/// A 500 for an error of idem's or the database's: the client gets what it may do, never the
/// database's text (table names, statements); the call's span and its WARN event carry the
/// error, and so does this log line.
///
/// "Retry" only where a retry may succeed ([`Error::is_transient`]): a refusal that lasts (a
/// principal that makes no key, a schema the database refuses) tells the client that retrying
/// will not help.
fn failed(e: &Error, what: &str) -> Response<Body> {
    tracing::warn!(target: "idem", error = %e, "idem: {what}");
    let detail = match e {
        Error::NotKept(NotKept::RolledBack { .. }) => {
            format!("{what}: the database rolled them back; nothing was kept, retry")
        }
        _ if e.is_transient() => format!(
            "{what} (the server's log says why); retry with the same key: the retry gets this \
             request's response if its work was kept, or runs it again if not"
        ),
        _ => format!(
            "{what}: the server refused it for a reason a retry does not change (its log says \
             why); nothing was kept, and retrying will not help until the server is fixed"
        ),
    };
    problem(StatusCode::INTERNAL_SERVER_ERROR, &detail)
}
