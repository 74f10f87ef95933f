//! The attribute's argument parser and the whole expansion behind it (`#[idempotent(...)]`).
//!
//! The macro's modules are included from `idem-macros/src` as they are (a proc-macro crate
//! cannot be linked as a library), at this crate's root so that their `crate::` paths resolve;
//! `proc_macro2` runs on its own outside a compiler. The input is `ARGS`, a NUL byte, then
//! the item; an item of at most one byte picks one of a few well-formed handlers instead, so
//! that most inputs reach past the signature checks. Checked, for any token streams: the
//! expansion never panics; when the item is a function, what comes out parses as Rust items;
//! `args::parse` alone gives arguments or errors, never a panic.
#![no_main]
#![allow(dead_code, unreachable_pub)]

/// The macro crate's modules, at the paths `idem-macros/src/lib.rs` gives them (an inline
/// module with a `path`, so that `validate.rs` finds `validate/batch.rs` as it does there).
#[path = "../../idem-macros/src"]
mod macros {
    pub(crate) mod args;
    pub(crate) mod diag;
    pub(crate) mod duration;
    pub(crate) mod expand;
    pub(crate) mod mode;
    pub(crate) mod outbox;
    pub(crate) mod signature;
    pub(crate) mod validate;
}

// Their `crate::args`, `crate::diag`... paths resolve through these.
use macros::{args, diag, duration, expand, mode, outbox, signature, validate};

use libfuzzer_sys::fuzz_target;
use proc_macro2::TokenStream;

/// One handler of each mode, and a few signatures the checks refuse.
const ITEMS: [&str; 6] = [
    "async fn top_up(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, job: &TopUp) \
     -> Result<u64, sqlx::Error> { let _ = (tx, job); Ok(1) }",
    "async fn charge(lease: &idem::Lease, job: &Charge) -> Result<(), sqlx::Error> \
     { let _ = (lease, job); Ok(()) }",
    "async fn apply(tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>, jobs: &[Job]) \
     -> Result<(), sqlx::Error> { let _ = (tx, jobs); Ok(()) }",
    "async fn joined(conn: &mut sqlx::SqliteConnection, job: Job) -> idem::Result<String> \
     { Ok(job.name) }",
    "fn not_async(job: &Job) -> Result<(), E> { Ok(()) }",
    "async fn generic<'a, T: Clone>(tx: &'a mut Transaction<'_, Db>, job: &'a T, n: u8) \
     -> Result<Vec<T>, MyError> where T: Send { todo!() }",
];

fn tokens(text: &[u8]) -> Option<TokenStream> {
    std::str::from_utf8(text).ok()?.parse().ok()
}

fuzz_target!(|data: &[u8]| {
    let (args, item) = match data.iter().position(|&b| b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (data, &[][..]),
    };
    let Some(args) = tokens(args) else { return };
    let item = match item {
        [] => ITEMS[0].parse().expect("a handler"),
        [pick] => ITEMS[usize::from(*pick) % ITEMS.len()]
            .parse()
            .expect("a handler"),
        text => match tokens(text) {
            Some(item) => item,
            None => return,
        },
    };

    let mut diag = diag::Diag::default();
    let _ = args::parse(args.clone(), &mut diag);
    let _ = diag.finish();

    let is_fn = syn::parse2::<syn::ItemFn>(item.clone()).is_ok();
    let out = expand::idempotent(args, item);
    if is_fn {
        if let Err(e) = syn::parse2::<syn::File>(out.clone()) {
            panic!("the expansion does not parse as items ({e}):\n{out}");
        }
    }
});
