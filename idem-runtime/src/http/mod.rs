//! The `Idempotency-Key` layer for tower and axum (feature `axum`): the key is claimed in a
//! transaction that the handler's writes run on, and the handler's response is stored with
//! the marker in that transaction's commit.
//!
//! ```
//! # use idem_runtime as idem;
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::body::Body;
//! use axum::http::{Request, StatusCode};
//! use axum::{Router, routing::post};
//! use idem::http::{ClaimedTx, IdempotencyLayer};
//! use sqlx::Sqlite;
//! use tower::ServiceExt as _;
//!
//! async fn send_invoice(mut tx: ClaimedTx<Sqlite>, body: String) -> Result<String, StatusCode> {
//!     sqlx::query("INSERT INTO invoices (body) VALUES (?1)")
//!         .bind(&body)
//!         .execute(tx.conn()) // the claimed transaction: the layer commits it
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(format!("invoice sent: {body}"))
//! }
//!
//! let pool = sqlx::sqlite::SqlitePoolOptions::new()
//!     .max_connections(1)
//!     .connect("sqlite::memory:")
//!     .await?;
//! sqlx::query("CREATE TABLE invoices (body TEXT)").execute(&pool).await?;
//! let store = idem::Store::new(pool.clone());
//! store.migrate().await?;
//!
//! let app: Router = Router::new()
//!     .route("/invoices", post(send_invoice))
//!     .layer(
//!         IdempotencyLayer::new(store, "invoices")
//!             // Whose keys these are: here the API key the client sent.
//!             .principal(|parts| {
//!                 parts.headers.get("x-api-key")?.to_str().ok().map(str::to_owned)
//!             }),
//!     );
//!
//! let send = || {
//!     let request = Request::post("/invoices")
//!         .header("idempotency-key", "\"8e03978e-40d5\"")
//!         .header("x-api-key", "client-a")
//!         .body(Body::from("#7"))
//!         .unwrap();
//!     app.clone().oneshot(request)
//! };
//! let first = send().await?;
//! assert_eq!(first.status(), StatusCode::OK);
//! // The retry gets the first response back; the handler does not run again.
//! let retry = send().await?;
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let invoices: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM invoices")
//!     .fetch_one(&pool)
//!     .await?;
//! assert_eq!(invoices, 1);
//! # Ok(()) }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! For each request whose method is one of the layer's (POST and PATCH by default):
//!
//! | the request | the answer |
//! |---|---|
//! | no key, or a malformed one | 400 `application/problem+json` saying what to send, before any database I/O |
//! | a body over the limit | 413, before any database I/O |
//! | no principal (the function returned `None`) | 401 problem, before any database I/O |
//! | a new key | the handler runs on the claimed transaction; its response is stored and committed with its writes |
//! | the key of a request still running | 409 with `Retry-After` |
//! | the key of a completed request, another method, path or body | 422 |
//! | the key of a completed request, the same request | the first response, byte for byte, with `Idempotent-Replayed: true` |
//!
//! A 5xx response (an `Err` the handler turned into one), 408, 409, 423, 425 and 429 roll the
//! transaction back: nothing is stored and the retry runs again. Every other response is
//! stored (see [`kept`]). `docs/http.md` in the repository says why, and what a streamed or
//! oversized response leaves to the retry.

mod extract;
mod finish;
mod header;
mod problem;
mod service;
mod stored;

use std::sync::Arc;
use std::time::Duration;

use ::http::header::{CONTENT_TYPE, HeaderName, LOCATION};
use ::http::{Method, request::Parts};

pub use extract::{ClaimedLease, ClaimedTx};
pub use service::Idempotent;
pub use stored::{REPLAYED, kept};

use crate::backend::Backend;
use crate::error::Error;
use crate::observe::Site;
use crate::options::{ClaimOptions, LeaseOptions};
use crate::record::Fingerprint;
use crate::scope::check_scope;
use crate::store::Store;

/// The request header the layer reads by default.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The largest request body read by default: 2 MiB (axum's own default limit).
pub const DEFAULT_BODY_LIMIT: usize = 2 << 20;

/// The largest response body stored by default: 512 KiB, which stays within the marker's
/// [`MAX_REPLAY_LEN`](crate::MAX_REPLAY_LEN) once base64-encoded.
pub const DEFAULT_STORED_LIMIT: usize = 512 << 10;

/// The principal every key of a [`single_tenant`](IdempotencyLayer::single_tenant) layer is
/// filed under.
pub const SINGLE_TENANT: &str = "_";

/// Tells clients apart, so that the marker is keyed by `(principal, key)`: client B sending
/// client A's key runs on its own and never receives A's response.
#[diagnostic::on_unimplemented(
    message = "this `IdempotencyLayer` does not say whose keys it holds",
    label = "call `.principal(|parts| ...)` (an API key, a user id) or `.single_tenant()` on it",
    note = "keys belong to a client: without a principal, client B sending client A's key would get A's response"
)]
pub trait Principal: Clone + Send + Sync + 'static {
    /// The principal of a request; `None` refuses it with 401 before any database I/O.
    fn of(&self, parts: &Parts) -> Option<String>;
}

/// No principal chosen yet: a layer in this state is not a tower `Layer`.
#[derive(Debug, Clone, Copy)]
pub struct NoPrincipal;

/// Every request has the principal [`SINGLE_TENANT`].
#[derive(Debug, Clone, Copy)]
pub struct SingleTenant;

impl Principal for SingleTenant {
    fn of(&self, _: &Parts) -> Option<String> {
        Some(SINGLE_TENANT.to_owned())
    }
}

/// A principal function (`.principal(|parts| ...)`).
#[derive(Clone)]
pub struct PrincipalFn<F>(F);

impl<F> std::fmt::Debug for PrincipalFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrincipalFn")
    }
}

impl<F> Principal for PrincipalFn<F>
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    fn of(&self, parts: &Parts) -> Option<String> {
        (self.0)(parts)
    }
}

type FingerprintFn = dyn Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync;

/// What of the request the fingerprint covers.
#[derive(Clone)]
enum Covers {
    /// The method, the path with its query, and the raw body bytes.
    Request,
    /// The raw body bytes only.
    Body,
    /// Bytes of the application's choosing.
    Custom(Arc<FingerprintFn>),
}

/// The `Idempotency-Key` layer: made by [`new`](IdempotencyLayer::new), then given a principal
/// ([`principal`](IdempotencyLayer::principal) or
/// [`single_tenant`](IdempotencyLayer::single_tenant)); only then is it a tower `Layer`.
pub struct IdempotencyLayer<DB: Backend, P = NoPrincipal> {
    config: Config<DB>,
    principal: P,
}

impl<DB: Backend, P: Clone> Clone for IdempotencyLayer<DB, P> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            config: self.config.clone(),
            principal: self.principal.clone(),
        }
    }
}

impl<DB: Backend, P> std::fmt::Debug for IdempotencyLayer<DB, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("scope", &self.config.scope)
            .field("header", &self.config.header)
            .field("methods", &self.config.methods)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Config<DB: Backend> {
    pub(crate) store: Store<DB>,
    pub(crate) scope: String,
    /// The scope's metric labels.
    pub(crate) site: &'static Site,
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) body_limit: usize,
    pub(crate) stored_limit: usize,
    pub(crate) headers: Vec<HeaderName>,
    covers: Covers,
    pub(crate) options: ClaimOptions,
    /// The wait given to [`IdempotencyLayer::wait`], if any: a lease claim waits only that
    /// long (or as its own options say), not the transaction mode's default.
    pub(crate) wait: Option<Duration>,
    pub(crate) retry_after: u64,
    pub(crate) bare: bool,
    pub(crate) lease: Option<LeaseOptions>,
    /// The route template, for OpenTelemetry's `http.route`.
    pub(crate) route: Option<&'static str>,
}

impl<DB: Backend> Clone for Config<DB> {
    fn clone(&self) -> Self {
        Config {
            store: self.store.clone(),
            scope: self.scope.clone(),
            site: self.site,
            header: self.header.clone(),
            methods: self.methods.clone(),
            body_limit: self.body_limit,
            stored_limit: self.stored_limit,
            headers: self.headers.clone(),
            covers: self.covers.clone(),
            options: self.options,
            wait: self.wait,
            retry_after: self.retry_after,
            bare: self.bare,
            lease: self.lease,
            route: self.route,
        }
    }
}

impl<DB: Backend> IdempotencyLayer<DB> {
    /// A layer keeping its markers in `store`, under `scope` (the stable name of this
    /// endpoint's keys, as a handler's `scope`). Defaults: the `Idempotency-Key` header on
    /// POST and PATCH; a fingerprint over the method, path and body; `Content-Type` and
    /// `Location` stored with the body; a concurrent request with the same key waits up to
    /// 1 s for the first before it gets 409.
    ///
    /// # Panics
    ///
    /// If `scope` is not a valid scope (1 to 255 bytes, no NUL byte): every request would
    /// fail, so the mistake stops the router's construction, as axum's own refusals of a
    /// route do. Use [`try_new`](Self::try_new) for a scope read at run time.
    #[track_caller]
    pub fn new(store: Store<DB>, scope: impl Into<String>) -> Self {
        match Self::try_new(store, scope) {
            Ok(layer) => layer,
            Err(e) => panic!("IdempotencyLayer::new: {e}"),
        }
    }

    /// [`new`](Self::new), returning [`Refusal::Scope`](crate::Refusal::Scope) for an invalid scope instead of
    /// panicking.
    pub fn try_new(store: Store<DB>, scope: impl Into<String>) -> Result<Self, Error> {
        let scope = scope.into();
        check_scope(&scope)?;
        Ok(IdempotencyLayer {
            config: Config {
                store,
                site: Site::of(&scope),
                scope,
                header: IDEMPOTENCY_KEY,
                methods: vec![Method::POST, Method::PATCH],
                body_limit: DEFAULT_BODY_LIMIT,
                stored_limit: DEFAULT_STORED_LIMIT,
                headers: vec![CONTENT_TYPE, LOCATION],
                covers: Covers::Request,
                options: ClaimOptions::new().replay().wait(Duration::from_secs(1)),
                wait: None,
                retry_after: 1,
                bare: true,
                lease: None,
                route: None,
            },
            principal: NoPrincipal,
        })
    }
}

impl<DB: Backend, P> IdempotencyLayer<DB, P> {
    /// Keys belong to the principal `f` returns for a request (an API key, a user id an
    /// authentication layer put in the extensions); `None` is refused with 401.
    pub fn principal<F>(self, f: F) -> IdempotencyLayer<DB, PrincipalFn<F>>
    where
        F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
    {
        IdempotencyLayer {
            config: self.config,
            principal: PrincipalFn(f),
        }
    }

    /// Every client shares one key space (an internal service with one caller, a webhook
    /// sender): the explicit choice of no principal. Keys are filed under [`SINGLE_TENANT`].
    pub fn single_tenant(self) -> IdempotencyLayer<DB, SingleTenant> {
        IdempotencyLayer {
            config: self.config,
            principal: SingleTenant,
        }
    }

    /// Reads the key from `header` instead of `Idempotency-Key` (`webhook-id` for Standard
    /// Webhooks).
    pub fn key_header(mut self, header: HeaderName) -> Self {
        self.config.header = header;
        self
    }

    /// The methods that require a key (default POST and PATCH); others pass through.
    ///
    /// # Panics
    ///
    /// If `methods` is empty: the layer would protect nothing.
    #[track_caller]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        assert!(
            !self.config.methods.is_empty(),
            "IdempotencyLayer::methods: no method given, so no request would need a key and \
             the layer would protect nothing; name the methods whose requests have effects \
             (POST, PATCH), or remove the layer"
        );
        self
    }

    /// The largest request body read (default [`DEFAULT_BODY_LIMIT`]); a larger one is 413.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// The largest response body stored (default [`DEFAULT_STORED_LIMIT`]).
    pub fn stored_limit(mut self, bytes: usize) -> Self {
        self.config.stored_limit = bytes;
        self
    }

    /// Stores `header` of the response too (besides `Content-Type` and `Location`).
    pub fn store_header(mut self, header: HeaderName) -> Self {
        self.config.headers.push(header);
        self
    }

    /// The fingerprint covers the body only (a webhook, whose signature headers change on
    /// every retry while its body does not).
    pub fn fingerprint_body(mut self) -> Self {
        self.config.covers = Covers::Body;
        self
    }

    /// The fingerprint covers the bytes `f` picks from the request.
    pub fn fingerprint_with(
        mut self,
        f: impl Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync + 'static,
    ) -> Self {
        self.config.covers = Covers::Custom(Arc::new(f));
        self
    }

    /// How long a request waits for a request still running with its key before it gets
    /// 409 (default 1 s; MariaDB rounds up to whole seconds). On SQLite the wait is for the
    /// database's write lock, which any writer holds: a write running longer than this, for
    /// any key, makes the request a 409 too, which its client retries.
    ///
    /// In [lease mode](Self::lease) a live lease is 409 at once; the wait bounds only how long
    /// the claim waits behind a request of this key holding it in a transaction, and there
    /// the default is the [`LeaseOptions`]' own (no wait on PostgreSQL).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.config.options = self.config.options.wait(wait);
        self.config.wait = Some(wait);
        self
    }

    /// The `Retry-After` of a 409, in seconds (default 1).
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.config.retry_after = secs;
        self
    }

    /// Lease mode, for handlers whose effect lives in another system (a payment provider, a
    /// mailer): the key is claimed with a lease instead of a transaction, the handler extracts
    /// [`ClaimedLease`] (not [`ClaimedTx`]) and runs under the lease's timeout, which moves
    /// with each [`Lease::renew`](crate::Lease::renew), and its response is stored in the
    /// statement that completes the marker. A request that finds the lease held gets 409 at
    /// once; a handler over its timeout is cancelled and answered 504, the key released for
    /// the retry.
    ///
    /// # Panics
    ///
    /// If the lease lies outside [`MIN_LEASE`](crate::MIN_LEASE) and
    /// [`MAX_LEASE`](crate::MAX_LEASE): every request would be refused.
    #[track_caller]
    pub fn lease(mut self, lease: LeaseOptions) -> Self {
        if let Err(e) = lease.check() {
            panic!("IdempotencyLayer::lease: {e}");
        }
        self.config.lease = Some(lease);
        self
    }

    /// The route this layer serves, as a template (`/invoices/{id}`): the claim's span gets it
    /// as OpenTelemetry's `http.route` (beside `http.request.method`, which it always has). A
    /// tower layer cannot see axum's `MatchedPath` without depending on axum, so it is given
    /// here; without it the span has no `http.route` (never the raw path, whose values are
    /// unbounded).
    pub fn route(mut self, template: &'static str) -> Self {
        self.config.route = Some(template);
        self
    }

    /// Accepts only quoted keys (`"k"`), as the draft's field syntax says; by default a bare
    /// key of token characters (`k`) is accepted too.
    pub fn strict(mut self) -> Self {
        self.config.bare = false;
        self
    }
}

impl<DB: Backend> Config<DB> {
    /// The bytes the request's fingerprint is the digest of.
    pub(crate) fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        match &self.covers {
            Covers::Request => {
                let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                Fingerprint::of_bytes(&[
                    b"request",
                    parts.method.as_str().as_bytes(),
                    target.as_bytes(),
                    body,
                ])
            }
            Covers::Body => Fingerprint::of_bytes(&[b"body", body]),
            Covers::Custom(f) => Fingerprint::of_bytes(&[b"custom", &f(parts, body)]),
        }
    }
}

impl<S, DB: Backend, P: Principal> tower_layer::Layer<S> for IdempotencyLayer<DB, P> {
    type Service = Idempotent<S, DB, P>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent::new(inner, Arc::new(self.config.clone()), self.principal.clone())
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use ::http::{Request, StatusCode};
    use axum_core::body::Body;
    use http_body_util::BodyExt as _;
    use tower_layer::Layer as _;
    use tower_service::Service as _;

    use super::*;
    use crate::error::Refusal;

    fn store() -> Store<sqlx::Sqlite> {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_lazy("sqlite::memory:")
            .expect("an in-memory URL");
        Store::new(pool)
    }

    #[tokio::test]
    #[should_panic(
        expected = "IdempotencyLayer::new: invalid scope \"\": a scope is 1 to 255 \
                               bytes with no NUL byte"
    )]
    async fn an_empty_scope_stops_the_router_being_built() {
        let _ = IdempotencyLayer::new(store(), "");
    }

    #[tokio::test]
    async fn try_new_says_what_is_wrong_with_the_scope() {
        for bad in [String::new(), "a\0b".to_owned(), "s".repeat(256)] {
            match IdempotencyLayer::try_new(store(), bad.clone()) {
                Err(Error::Refused(Refusal::Scope { scope })) => assert_eq!(scope, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert!(IdempotencyLayer::try_new(store(), "invoices.send").is_ok());
    }

    #[tokio::test]
    #[should_panic(expected = "no method given")]
    async fn no_methods_is_refused() {
        let _ = IdempotencyLayer::new(store(), "s").methods([]);
    }

    #[tokio::test]
    #[should_panic(expected = "a lease must be at least 1s and at most 24h")]
    async fn a_lease_out_of_bounds_is_refused() {
        let lease = LeaseOptions::new(Duration::from_millis(10));
        let _ = IdempotencyLayer::new(store(), "s").lease(lease);
    }

    /// A principal that can make no key is the server's mistake: 500, and no advice to retry.
    #[tokio::test]
    async fn a_lasting_refusal_is_not_answered_with_retry() {
        let layer = IdempotencyLayer::new(store(), "s").principal(|_| Some("a\0b".to_owned()));
        let mut service = layer.layer(tower_service_fn());
        let request = Request::post("/x")
            .header("idempotency-key", "\"k\"")
            .body(Body::empty())
            .expect("a request");
        let response = service.call(request).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = response.into_body().collect().await.expect("a body");
        let text = String::from_utf8(body.to_bytes().to_vec()).expect("UTF-8");
        assert!(
            text.contains("retrying will not help") && !text.contains("retry with"),
            "{text}"
        );
    }

    /// A handler that must not run: the request is refused before it.
    fn tower_service_fn() -> impl tower_service::Service<
        Request<Body>,
        Response = ::http::Response<Body>,
        Error = std::convert::Infallible,
        Future = std::future::Ready<Result<::http::Response<Body>, std::convert::Infallible>>,
    > + Clone
    + Send
    + 'static {
        #[derive(Clone)]
        struct Unreached;
        impl tower_service::Service<Request<Body>> for Unreached {
            type Response = ::http::Response<Body>;
            type Error = std::convert::Infallible;
            type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
            fn poll_ready(
                &mut self,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Result<(), Self::Error>> {
                std::task::Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: Request<Body>) -> Self::Future {
                panic!("the handler ran for a request the layer had to refuse")
            }
        }
        Unreached
    }
}
