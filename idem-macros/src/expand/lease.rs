//! The lease mode: claim the key for a lease, run the body outside any transaction under the
//! lease's timeout, and complete the marker if this delivery still holds the key.

use proc_macro2::{Ident, Literal, Span, TokenStream};
use quote::quote;
use syn::Stmt;
use syn::ext::IdentExt as _;
use syn::spanned::Spanned;

use super::{Shared, codec_arg, link_arg, local, located_at, pinned_body};
use crate::args::{Args, Length};
use crate::duration;
use crate::signature::Kind;

/// Binds `outcome_var` to the call's `Result<Outcome<T>, Failed<E>>`.
pub(super) fn run(shared: &Shared<'_>, args: &Args, name: &Ident, stmts: &[Stmt]) -> TokenStream {
    let Shared {
        private,
        scope,
        handler,
        store,
        key_var,
        print_var,
        codec_var,
        link_var,
        outcome_var,
        outbox,
        ..
    } = shared;
    let lease = local("__idem_lease");
    let recorded = local("__idem_recorded");
    let lease_ref = local("__idem_lease_ref");
    let result = local("__idem_result");
    let err = local("__idem_err");
    let name = name.unraw().to_string();
    let options = lease_options(args, private);
    let body_var = local("__idem_body");
    let pat = &handler.pat;
    let Kind::Lease { ty } = &handler.kind else {
        unreachable!("lease mode has a lease parameter")
    };
    // The body's outbox is its own while it borrows the lease; its messages go with the
    // completing statement.
    let outbox_var = local("__idem_outbox");
    let outbox_ref = local("__idem_outbox_ref");
    let (open_outbox, bind_outbox, sent) = match outbox {
        Some(o) => {
            let (pat, ty) = (&o.pat, &o.ty);
            (
                quote! {
                    let mut #outbox_var = #private::lease_outbox(&#lease);
                    let #outbox_ref = &mut #outbox_var;
                },
                quote!(let #pat: #ty = #outbox_ref;),
                quote!(::core::option::Option::Some(#outbox_var)),
            )
        }
        None => (
            TokenStream::new(),
            TokenStream::new(),
            quote!(::core::option::Option::None),
        ),
    };
    // Pinned inside `run`'s future rather than on `run`'s result, so that a body of the wrong
    // type is reported as the declared type, not wrapped in `run`'s `Result<_, Error>`. The
    // lease is bound with the type as the user wrote it, which keeps their import of `Lease`
    // used once the parameter has become the store.
    let body = pinned_body(
        &handler.ret,
        &body_var,
        quote!(let #pat: #ty = #lease_ref; #bind_outbox),
        stmts,
        None,
        false,
    );
    let print = match print_var {
        Some(print) => quote!(#print),
        None => quote!(::core::option::Option::None),
    };
    // Without `replay` the claim never answers `Replayed`; the arm keeps the match whole.
    let replayed = match codec_var {
        Some(codec) => quote!(return #private::replayed(#codec, &#recorded)),
        None => quote!(return ::core::result::Result::Ok(#private::Outcome::Duplicate)),
    };
    let codec = codec_arg(codec_var.as_ref());
    let finish = quote!(#private::lease_finish(#codec, #lease, #result, #sent));
    let link = link_arg(link_var.as_ref());
    let spec = super::spec::lease(private, scope, &name, options);
    quote! {
        #spec
        let #outcome_var = async move {
            let #lease = match #private::lease(#store, &__IDEM_SPEC, #key_var, #print, #link).await {
                ::core::result::Result::Ok(#private::Claimed::Fresh(#lease)) => #lease,
                ::core::result::Result::Ok(#private::Claimed::Duplicate) => {
                    return ::core::result::Result::Ok(#private::Outcome::Duplicate);
                }
                ::core::result::Result::Ok(#private::Claimed::Failed(#err)) => {
                    return ::core::result::Result::Ok(#private::Outcome::Failed(#err));
                }
                ::core::result::Result::Ok(#private::Claimed::Replayed(#recorded)) => {
                    #replayed;
                }
                ::core::result::Result::Err(#err) => {
                    return ::core::result::Result::Err(#private::Failed::Idem(#err));
                }
            };
            #open_outbox
            // The body borrows the lease while `run` holds it too; both only read it.
            let #lease_ref = &#lease;
            let #result = #private::Lease::run(&#lease, async move {
                #body
                #body_var
            })
            .await;
            #finish.await
        }
        .await;
    }
}

/// The claim's `LeaseOptions`, built in the handler's `static` spec (a const context): literal
/// durations were checked when the attribute was read; a const path (`lease = LEASE`) is
/// checked by [`const_checks`].
fn lease_options(args: &Args, private: &TokenStream) -> TokenStream {
    let lease = args.lease.as_ref().expect("lease mode has a lease");
    let lease = duration(lease, LEASE_CONST, private);
    let mut options = quote!(#private::LeaseOptions::new(#lease));
    if let Some(timeout) = &args.timeout {
        let timeout = duration(timeout, TIMEOUT_CONST, private);
        options.extend(quote!(.timeout(#timeout)));
    }
    if args.replay {
        options.extend(quote!(.replay()));
    }
    options
}

/// The consts that [`const_checks`] binds a `lease = PATH` and a `timeout = PATH` to.
const LEASE_CONST: &str = "__IDEM_LEASE";
const TIMEOUT_CONST: &str = "__IDEM_TIMEOUT";

/// A `Duration` expression of the argument: its milliseconds, or the const it is bound to.
fn duration(length: &Length, name: &str, private: &TokenStream) -> TokenStream {
    match length {
        Length::Literal(_, ms) => {
            let ms = Literal::u64_unsuffixed(*ms);
            quote!(#private::Duration::from_millis(#ms))
        }
        Length::Const(_) => {
            let name = Ident::new(name, Span::call_site());
            quote!(#name)
        }
    }
}

/// For a `lease` or `timeout` given as a const path, what the attribute checks of a literal,
/// as items evaluated when the crate is checked (not only when the generic handler is
/// instantiated): the path is bound once to a `Duration` const (so a const of another type is
/// one error), then `const _` assertions check the lease's bounds and a timeout longer than
/// zero and shorter than the lease. Each error lands on the path.
pub(super) fn const_checks(args: &Args, private: &TokenStream) -> TokenStream {
    let mut checks = TokenStream::new();
    let Some(lease) = &args.lease else {
        return checks;
    };
    for (length, name) in [
        (Some(lease), LEASE_CONST),
        (args.timeout.as_ref(), TIMEOUT_CONST),
    ] {
        if let Some(Length::Const(path)) = length {
            let name = Ident::new(name, Span::call_site());
            let bound = quote!(const #name: ::core::time::Duration = #path;);
            checks.extend(located_at(bound, path.span()));
        }
    }
    let lease_value = duration(lease, LEASE_CONST, private);
    if let Length::Const(path) = lease {
        let message = format!(
            "`lease = {}` is out of bounds: {}",
            shown(path),
            duration::LEASE_BOUNDS
        );
        let (min, max) = (
            u128::from(duration::MIN_LEASE_MS),
            u128::from(duration::MAX_LEASE_MS),
        );
        let check = quote! {
            const _: () = {
                let ms = #lease_value.as_millis();
                ::core::assert!(ms >= #min && ms <= #max, #message);
            };
        };
        checks.extend(located_at(check, path.span()));
    }
    let Some(timeout) = &args.timeout else {
        return checks;
    };
    let path = match (lease, timeout) {
        (_, Length::Const(path)) | (Length::Const(path), _) => path,
        (Length::Literal(..), Length::Literal(..)) => return checks,
    };
    let timeout_value = duration(timeout, TIMEOUT_CONST, private);
    let message = format!(
        "`timeout = {}` is out of bounds: a timeout must be longer than zero and shorter than \
         the lease (`lease = {}`)",
        written(timeout),
        written(lease)
    );
    let check = quote! {
        const _: () = ::core::assert!(
            !#timeout_value.is_zero() && #timeout_value.as_nanos() < #lease_value.as_nanos(),
            #message
        );
    };
    checks.extend(located_at(check, path.span()));
    checks
}

/// The argument as written: `"30s"` or `LEASE`.
fn written(length: &Length) -> String {
    match length {
        Length::Literal(lit, _) => format!("\"{}\"", lit.value()),
        Length::Const(path) => shown(path),
    }
}

fn shown(path: &syn::Path) -> String {
    quote!(#path).to_string().replace(' ', "")
}
