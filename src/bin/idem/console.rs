//! `idem console`: the web console (`idem::console`) served on an address of its own until
//! Ctrl-C.

use std::net::SocketAddr;

use idem::console::{Admin, Console};
use idem::{Backend, Store};

use crate::Failure;

/// What `idem console` was asked.
#[derive(Debug)]
pub(crate) struct Serve {
    pub(crate) listen: SocketAddr,
    /// Grant every request the actions, as the tool's actor.
    pub(crate) admin: bool,
}

/// Serves the console over `store` until Ctrl-C. It says where on standard error, so that a
/// script may wait for that line.
pub(crate) async fn serve<DB: Backend>(
    store: Store<DB>,
    serve: &Serve,
    actor: &str,
) -> Result<(), Failure> {
    let listener = tokio::net::TcpListener::bind(serve.listen)
        .await
        .map_err(|e| {
            Failure::input(format!(
                "cannot listen on {}: {e}; choose another --listen address",
                serve.listen
            ))
        })?;
    let address = listener
        .local_addr()
        .map_err(|e| Failure::input(e.to_string()))?;
    let mut router = Console::new(store).router();
    let who = match serve.admin {
        true => {
            let admin = Admin::new(actor);
            router = router.layer(axum::Extension(admin));
            format!("every visitor acts as {actor} (--admin)")
        }
        false => "read-only (no --admin)".to_owned(),
    };
    eprintln!("idem console on http://{address}/ ({who}); Ctrl-C stops it");
    let stop = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    axum::serve(listener, router)
        .with_graceful_shutdown(stop)
        .await
        .map_err(|e| Failure::database(format!("the console stopped: {e}")))
}
