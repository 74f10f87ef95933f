//! The span and metrics around every call: one `__private::observe` before the call's future,
//! whose `run` wraps it. The labels are a `static` of the handler, built at compile time, so
//! that a call with no recorder installed neither allocates nor formats them.

use proc_macro2::{Ident, TokenStream};
use quote::quote;
use syn::LitStr;

use super::local;

/// The `static` labels of the handler whose scope is `scope`.
fn site(private: &TokenStream, scope: &LitStr) -> TokenStream {
    let site = local("__IDEM_SITE");
    quote! {
        {
            static #site: #private::Site = #private::Site::new(#scope);
            &#site
        }
    }
}

/// [`call`] for a batch handler, whose span has no single key.
pub(super) fn batch_call(private: &TokenStream, scope: &LitStr) -> (Ident, TokenStream) {
    let call = local("__idem_call");
    let site = site(private, scope);
    let tokens = quote! {
        let #call = #private::observe_batch(#site);
    };
    (call, tokens)
}

/// Binds the returned local to the call's `Call`; `mode` is an expression of type `Mode`.
pub(super) fn call(
    private: &TokenStream,
    scope: &LitStr,
    mode: TokenStream,
    key_var: &Ident,
) -> (Ident, TokenStream) {
    let call = local("__idem_call");
    let site = site(private, scope);
    let tokens = quote! {
        let #call = #private::observe(#site, #mode, &#key_var);
    };
    (call, tokens)
}
