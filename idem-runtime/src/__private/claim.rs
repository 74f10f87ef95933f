//! A transaction-mode handler's claim, as the expansion awaits it: the claim's own future, in
//! no `async fn` of this module's. Each layer of `async fn` copies the future it awaits into
//! its own state and the answer out again (a held claim is some hundreds of bytes), on every
//! call (`docs/BENCHMARKS.md`, "Instructions per job").

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::{Spec, checked};
use crate::backend::Backend;
use crate::claim::{Claimed, TxHeld, run};
use crate::error::Error;
use crate::join::{Target, Via};
use crate::key::Key;
use crate::options::Mode;
use crate::record::Fingerprint;
use crate::traceparent::TraceParent;

/// A transaction-mode handler's claim: in a transaction of its own (`&store`, refused inside
/// another claim's open transaction of this task) or in the caller's (`store.join(tx)`); its
/// span links to the producer's when the handler was given `link = ".."`.
///
/// The key and the fingerprint are checked (a refusal observed) when it is called, which the
/// expansion does where it awaits it: the claim's future is then the entry's own.
pub fn claim<'a, DB: Backend, S: Target<DB> + 'a>(
    store: S,
    spec: &'static Spec,
    key: Result<Key, Error>,
    print: Option<Result<Fingerprint, Error>>,
    link: Option<TraceParent>,
) -> impl Future<Output = Result<Claimed<TxHeld<'a, DB>>, Error>> {
    let via = store.via();
    let mode = match via {
        Via::Store(_) => Mode::Transaction,
        Via::Joined(_) => Mode::Joined,
    };
    let checked = checked(spec, mode, key, print);
    let request = checked.map(|(key, print)| spec.request(key, spec.options(print).link(link)));
    match (via, request) {
        (Via::Store(store), Ok(request)) => Claiming::Own {
            future: run::own(store, request),
        },
        (Via::Joined(joined), Ok(request)) => Claiming::Joined {
            future: joined.claim_request(request),
        },
        (_, Err(error)) => Claiming::Refused { error: Some(error) },
    }
}

pin_project_lite::pin_project! {
    /// The claim of one entry, or its refusal before any I/O.
    #[project = Projected]
    enum Claiming<O, J> {
        Refused { error: Option<Error> },
        Own { #[pin] future: O },
        Joined { #[pin] future: J },
    }
}

// A claim of its own holds a `'static` transaction, a joined one the caller's: the answer is
// the shorter-lived of the two.
impl<'a, DB, O, J> Future for Claiming<O, J>
where
    DB: Backend,
    O: Future<Output = Result<Claimed<TxHeld<'static, DB>>, Error>>,
    J: Future<Output = Result<Claimed<TxHeld<'a, DB>>, Error>>,
{
    type Output = Result<Claimed<TxHeld<'a, DB>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            Projected::Refused { error } => {
                Poll::Ready(Err(error.take().expect("a refused claim is polled once")))
            }
            Projected::Own { future } => future.poll(cx),
            Projected::Joined { future } => future.poll(cx),
        }
    }
}
