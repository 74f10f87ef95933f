//! The operators' web console (feature `console`): what the store holds, as pages an operator
//! reads in a browser, and the actions that rerun work, for an admin only.
//!
//! [`Console::router`] is an axum [`Router`] that an application mounts (with
//! [`Router::nest`], behind its own authentication) or that `idem console` serves. Every page
//! is server-rendered HTML without scripts: the overview (jobs applied and failed per scope over
//! the last day, the outbox's backlog and the relay's lag), failures grouped by error, one
//! group with what a requeue would take, a job's marker and steps, stuck leases, unsent outbox
//! messages, the audit log and the doctor's findings.
//!
//! Read-only is the default. A request is an admin's when the application put an [`Admin`]
//! in its extensions (a tower layer after its own login); only then are actions shown and
//! accepted. Each action's form carries a token derived from the console's secret and the
//! admin's name, which a page of another site cannot read: a request without it, or from a
//! user who is not an admin, is refused (403) before anything is changed. Every action is one
//! row of the audit log ([`Store::record_action`]), with the admin's name.
//!
//! ```
//! # use idem_runtime as idem;
//! # #[cfg(feature = "sqlite")]
//! # async fn mount(store: idem::Store<sqlx::Sqlite>) {
//! use axum::{Router, middleware::{self, Next}, extract::Request};
//! use idem::console::{Admin, Console};
//!
//! // The application's own check: here a header its proxy sets after login.
//! async fn admins(mut request: Request, next: Next) -> axum::response::Response {
//!     let user = request.headers().get("x-user").and_then(|v| v.to_str().ok());
//!     if let Some(user @ ("alice" | "bob")) = user {
//!         let admin = Admin::new(user);
//!         request.extensions_mut().insert(admin);
//!     }
//!     next.run(request).await
//! }
//!
//! let app: Router = Router::new()
//!     .nest("/idem", Console::new(store).router())
//!     .layer(middleware::from_fn(admins));
//! # }
//! ```
//!
//! [`Store::record_action`]: crate::Store::record_action

mod actions;
mod html;
mod pages;
mod sweep;

use std::sync::Arc;

use axum::Router;
use axum::extract::NestedPath;
use axum::routing::{get, post};
use http::request::Parts;
use sha2::{Digest as _, Sha256};

use crate::backend::Backend;
use crate::store::Store;

/// The web console over one store's tables: build it, then mount its [`router`](Self::router).
#[derive(Debug)]
pub struct Console<DB: Backend> {
    store: Store<DB>,
    secret: [u8; 32],
}

/// Who may act: put one in a request's extensions (`request.extensions_mut().insert(..)`)
/// to grant that request the console's actions under this name, which the audit log keeps.
/// Without one, a request reads and changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admin {
    actor: String,
}

impl Admin {
    /// An admin named `actor` (the application's user name, written to the audit log).
    pub fn new(actor: impl Into<String>) -> Admin {
        Admin {
            actor: actor.into(),
        }
    }

    /// The name the audit log keeps.
    pub fn actor(&self) -> &str {
        &self.actor
    }
}

impl<DB: Backend> Console<DB> {
    /// A console over `store`'s tables (the table it was given with
    /// [`with_table`](Store::with_table)), with a secret of its own for the forms' tokens.
    pub fn new(store: Store<DB>) -> Console<DB> {
        Console {
            store,
            secret: fresh_secret(),
        }
    }

    /// The secret the forms' tokens are made from, for consoles on several machines behind
    /// one address: with the same secret, a page served by one is accepted by the others.
    /// Keep it as you keep a session key; the default is fresh in each process.
    pub fn secret(mut self, secret: [u8; 32]) -> Console<DB> {
        self.secret = secret;
        self
    }

    /// The console's pages and actions, for [`Router::nest`] (links follow the path it is
    /// mounted at) or for serving on their own.
    pub fn router(self) -> Router {
        let shared = Arc::new(Shared {
            store: self.store,
            secret: self.secret,
        });
        Router::new()
            .route("/", get(pages::overview::<DB>))
            .route("/failures", get(pages::failures::<DB>))
            .route("/failures/{id}", get(pages::group::<DB>))
            .route("/failures/{id}/requeue", post(actions::requeue_group::<DB>))
            .route("/job", get(pages::job::<DB>))
            .route("/job/requeue", post(actions::requeue_job::<DB>))
            .route("/stuck", get(sweep::stuck::<DB>))
            .route("/stuck/forget", post(sweep::forget_stuck::<DB>))
            .route("/outbox", get(sweep::outbox::<DB>))
            .route("/outbox/parked", get(sweep::parked::<DB>))
            .route("/outbox/requeue", post(actions::requeue_message::<DB>))
            .route("/outbox/requeue-all", post(sweep::requeue_parked::<DB>))
            .route("/audit", get(pages::audit::<DB>))
            .route("/doctor", get(pages::doctor::<DB>))
            .with_state(shared)
    }
}

/// What every handler shares.
struct Shared<DB: Backend> {
    store: Store<DB>,
    secret: [u8; 32],
}

impl<DB: Backend> Shared<DB> {
    /// The token an admin's forms carry: SHA-256 of the secret and the admin's name, so that
    /// it is the same on every page of a process and useless to another admin or another
    /// console.
    fn token(&self, admin: &Admin) -> String {
        let mut hash = Sha256::new();
        hash.update(self.secret);
        hash.update(admin.actor.as_bytes());
        hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What a page needs of its request: where the console is mounted, and who asks.
struct Viewer {
    base: String,
    admin: Option<Admin>,
}

impl Viewer {
    fn of(parts: &Parts) -> Viewer {
        Viewer {
            base: parts
                .extensions
                .get::<NestedPath>()
                .map(|p| p.as_str().trim_end_matches('/').to_owned())
                .unwrap_or_default(),
            admin: parts.extensions.get::<Admin>().cloned(),
        }
    }
}

/// 32 bytes no other process has: SHA-256 over the standard library's per-process random
/// hash keys (drawn from the operating system), the time and the process id, so that the
/// runtime needs no random-number crate of its own.
fn fresh_secret() -> [u8; 32] {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut hash = Sha256::new();
    for i in 0..4u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        hash.update(h.finish().to_le_bytes());
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    hash.update(now.as_nanos().to_le_bytes());
    hash.update(std::process::id().to_le_bytes());
    hash.finalize().into()
}
