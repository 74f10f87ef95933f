//! A boxed future: plain data that layers of every height name (a lease's keep-alive, the
//! relay's wake-ups, the test kit's hooks), so it sits below all of them.

/// A boxed, sendable future.
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
