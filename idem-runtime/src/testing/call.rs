//! What the cases take: the handler's call and the check, as closures.

use std::fmt::Debug;
use std::future::Future;

use crate::outcome::Outcome;

/// The handler's call a case makes for each delivery (`|| top_up(&store, &job)`): a closure
/// returning the call's future, whose output is the handler's `Result<Outcome<T>, E>` with
/// `T` and `E` printable (`Debug`). Sealed: implemented for those closures only.
pub trait Deliver: Sealed {
    #[doc(hidden)]
    type Value: Debug;
    #[doc(hidden)]
    type Error: Debug;
    #[doc(hidden)]
    type Call: Future<Output = Result<Outcome<Self::Value>, Self::Error>>;
    #[doc(hidden)]
    fn call(&mut self) -> Self::Call;
}

impl<D, F, T, E> Deliver for D
where
    D: FnMut() -> F,
    F: Future<Output = Result<Outcome<T>, E>>,
    T: Debug,
    E: Debug,
{
    type Value = T;
    type Error = E;
    type Call = F;

    fn call(&mut self) -> F {
        self()
    }
}

/// The check a case reads the job's effect with (`|| balance(&pool, 1)`): a closure returning
/// a future of the value read, which the case compares (`PartialEq`) and prints (`Debug`).
/// Sealed: implemented for those closures only.
pub trait Check: Sealed {
    /// What the check reads.
    type Value: PartialEq + Debug;
    #[doc(hidden)]
    type Read: Future<Output = Self::Value>;
    #[doc(hidden)]
    fn read(&mut self) -> Self::Read;
}

impl<C, G, V> Check for C
where
    C: FnMut() -> G,
    G: Future<Output = V>,
    V: PartialEq + Debug,
{
    type Value = V;
    type Read = G;

    fn read(&mut self) -> G {
        self()
    }
}

mod sealed {
    pub trait Sealed {}

    impl<C: FnMut() -> F, F> Sealed for C {}
}
use sealed::Sealed;
