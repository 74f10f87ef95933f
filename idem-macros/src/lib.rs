//! The `#[idempotent]` attribute. Use it through the `idem` crate, whose documentation
//! describes it; this crate only rewrites the function, the work happens in `idem-runtime`.

#![warn(missing_docs, unreachable_pub)]

mod args;
mod diag;
mod duration;
mod expand;
mod mode;
mod outbox;
mod signature;
mod validate;

#[cfg(test)]
mod snapshots;

/// Turns an async handler into claim-then-run code. See the `idem` crate.
#[proc_macro_attribute]
pub fn idempotent(
    args: proc_macro::TokenStream,
    item: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
