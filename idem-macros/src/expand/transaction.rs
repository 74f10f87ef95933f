//! The transaction mode: claim the key in a transaction, run the body on that transaction, and
//! commit marker and effect together; or, given `store.join(tx)`, claim and run in a savepoint
//! of the caller's transaction and leave the commit to the caller. One function serves both,
//! so the body is compiled (and its mistakes reported) once.

use proc_macro2::{Ident, Literal, TokenStream};
use quote::quote;
use syn::Stmt;
use syn::ext::IdentExt as _;

use super::{Shared, codec_arg, link_arg, local, pinned_body};
use crate::args::{Args, Isolation};
use crate::mode::Mode;
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
        lane_var,
        outcome_var,
        outbox,
        mode,
    } = shared;
    let held = local("__idem_held");
    let recorded = local("__idem_recorded");
    let tx_var = local("__idem_tx");
    let span = local("__idem_body_of");
    let result = local("__idem_result");
    let err = local("__idem_err");
    // Names the handler in `Error::Refused(Refusal::Nested)`, both as the outer and as the inner
    // call.
    let name = name.unraw().to_string();
    let options = claim_options(args, private);
    let tx_pat = &handler.pat;
    let Kind::Transaction { ty: tx_ty, .. } = &handler.kind else {
        unreachable!("transaction mode has a transaction parameter")
    };
    let outbox_ref = local("__idem_outbox_ref");
    // The outbox is the claim's; the body binds a reference to it, made outside the body's
    // `async move` (which would otherwise take it), beside the transaction's.
    let (borrow, bind_outbox) = match outbox {
        Some(o) => {
            let (pat, ty) = (&o.pat, &o.ty);
            (
                quote!(let (#tx_var, #outbox_ref) = #held.parts();),
                quote!(let #pat: #ty = #outbox_ref;),
            )
        }
        None => (quote!(let #tx_var = #held.tx();), TokenStream::new()),
    };
    let body = pinned_body(
        &handler.ret,
        &result,
        quote!(let #tx_pat: #tx_ty = #tx_var; #bind_outbox),
        stmts,
        Some((private, &span)),
        matches!(mode, Mode::Group),
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
    // Group commit claims and ends through the group's adapters.
    let (claim, finish, target) = match *mode {
        Mode::Group => {
            let lane = match lane_var {
                Some(lane) => quote!(#lane),
                None => quote!(::core::option::Option::None),
            };
            (
                quote!(claim_group),
                quote!(finish_group),
                quote!(#private::GroupTarget::as_group(#store), &__IDEM_SPEC, #key_var, #lane),
            )
        }
        _ => (
            quote!(claim),
            quote!(finish),
            quote!(#store, &__IDEM_SPEC, #key_var),
        ),
    };
    let codec = codec_arg(codec_var.as_ref());
    let finish = quote!(#private::#finish(#codec, #held, #result));
    let link = link_arg(link_var.as_ref());
    let spec = super::spec::claim(private, scope, &name, options);
    // A store inside another claim's body is refused by the claim, before any I/O; this
    // claim's body runs marked as inside its transaction in turn.
    quote! {
        #spec
        let #outcome_var = async move {
            let mut #held = match #private::#claim(#target, #print, #link).await {
                ::core::result::Result::Ok(#private::Claimed::Fresh(#held)) => #held,
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
            let #span = #held.body();
            #borrow
            #body
            #finish.await
        }
        .await;
    }
}

/// The `options` argument of the claim: `ClaimOptions::new()` and one call per argument given,
/// so that a handler without `wait` or `isolation` keeps the database's own behaviour.
pub(super) fn claim_options(args: &Args, private: &TokenStream) -> TokenStream {
    let mut options = quote!(#private::ClaimOptions::new());
    if let Some(ms) = args.wait {
        let ms = Literal::u64_unsuffixed(ms);
        options.extend(quote!(.wait(#private::Duration::from_millis(#ms))));
    }
    if let Some(level) = args.isolation {
        let variant = match level {
            Isolation::Serializable => quote!(Serializable),
            Isolation::RepeatableRead => quote!(RepeatableRead),
        };
        options.extend(quote!(.isolation(#private::Isolation::#variant)));
    }
    if args.replay {
        options.extend(quote!(.replay()));
    }
    options
}
