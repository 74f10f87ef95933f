//! The `static` a handler claims with: its scope, its name and its options, and the labels of
//! its metrics, built at compile time, so that a call with no recorder installed neither
//! allocates nor formats them.

use proc_macro2::TokenStream;
use quote::quote;
use syn::LitStr;

/// The `static __IDEM_SPEC` of a handler in transaction or batch mode; `options` is an
/// expression of type `ClaimOptions`.
pub(super) fn claim(
    private: &TokenStream,
    scope: &LitStr,
    name: &str,
    options: TokenStream,
) -> TokenStream {
    quote! {
        static __IDEM_SPEC: #private::Spec = #private::Spec::new(#scope, #name, #options);
    }
}

/// The `static __IDEM_SPEC` of a lease-mode handler; `options` is an expression of type
/// `LeaseOptions`.
pub(super) fn lease(
    private: &TokenStream,
    scope: &LitStr,
    name: &str,
    options: TokenStream,
) -> TokenStream {
    quote! {
        static __IDEM_SPEC: #private::LeaseSpec = #private::LeaseSpec::new(#scope, #name, #options);
    }
}
