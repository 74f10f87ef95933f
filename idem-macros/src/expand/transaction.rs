//! The transaction mode: claim the key in a transaction, run the body on that transaction, and
//! commit marker and effect together; or, given `store.join(tx)`, claim and run in a savepoint
//! of the caller's transaction and leave the commit to the caller. One function serves both,
//! so the body is compiled (and its mistakes reported) once.

use proc_macro2::{Ident, Literal, TokenStream};
use quote::quote;
use syn::Stmt;
use syn::ext::IdentExt as _;

use super::{Shared, local, pinned_body};
use crate::args::{Args, Isolation};
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
        outcome_var,
        outbox,
    } = shared;
    let guard = local("__idem_guard");
    let recorded = local("__idem_recorded");
    let tx_var = local("__idem_tx");
    let result = local("__idem_result");
    let err = local("__idem_err");
    let via = local("__idem_via");
    // Names the handler in `Error::Nested`, both as the outer and as the inner call.
    let name = name.unraw().to_string();
    let options = claim_options(args, private);
    let tx_pat = &handler.pat;
    let Kind::Transaction { ty: tx_ty, .. } = &handler.kind else {
        unreachable!("transaction mode has a transaction parameter")
    };
    let outbox_var = local("__idem_outbox");
    let outbox_ref = local("__idem_outbox_ref");
    // The outbox is the claim's, made once it is fresh; the body binds a reference to it
    // (made outside the body's `async move`, which would otherwise take the outbox itself).
    let (open_outbox, bind_outbox) = match outbox {
        Some(o) => {
            let (pat, ty) = (&o.pat, &o.ty);
            (
                quote! {
                    let mut #outbox_var = #guard.outbox();
                    let #outbox_ref = &mut #outbox_var;
                },
                quote!(let #pat: #ty = #outbox_ref;),
            )
        }
        None => (TokenStream::new(), TokenStream::new()),
    };
    let body = pinned_body(
        &handler.ret,
        &result,
        quote!(let #tx_pat: #tx_ty = #tx_var; #bind_outbox),
        stmts,
    );
    let claim = match print_var {
        Some(print) => {
            quote!(#private::claim_checked(#via, #scope, #options, #key_var, #print))
        }
        None => quote!(#private::claim(#via, #scope, #options, #key_var)),
    };
    // Without `replay` the claim never answers `Replayed`; the arm keeps the match whole.
    let replayed = match codec_var {
        Some(codec) => quote!(return #private::replayed(#codec, &#recorded)),
        None => quote!(return ::core::result::Result::Ok(#private::Outcome::Duplicate)),
    };
    let finish = match (codec_var, outbox) {
        (Some(codec), Some(_)) => {
            quote!(#private::finish_replay_sending(#codec, #guard, #result, #outbox_var))
        }
        (Some(codec), None) => quote!(#private::finish_replay(#codec, #guard, #result)),
        (None, Some(_)) => quote!(#private::finish_sending(#guard, #result, #outbox_var)),
        (None, None) => quote!(#private::finish(#guard, #result)),
    };
    // A store inside another handler's body is refused here, before any I/O; the claim, body
    // and end then run marked as this handler's (a task-local), so that a store call in the
    // body is refused in turn.
    let (call, observe) =
        super::observe::call(private, scope, quote!(#private::mode(&#via)), key_var);
    quote! {
        let #via = #private::via(#store, #name);
        #observe
        let #outcome_var = #private::Call::run(#call, #private::in_body(#name, async move {
            let mut #guard = match #claim.await {
                ::core::result::Result::Ok(#private::Claimed::Fresh(#guard)) => #guard,
                ::core::result::Result::Ok(#private::Claimed::Duplicate) => {
                    return ::core::result::Result::Ok(#private::Outcome::Duplicate);
                }
                ::core::result::Result::Ok(#private::Claimed::Replayed(#recorded)) => {
                    #replayed;
                }
                ::core::result::Result::Err(#err) => {
                    return ::core::result::Result::Err(#private::Failed::Idem(#err));
                }
            };
            #open_outbox
            let #tx_var = #guard.tx();
            #body
            #finish.await
        }))
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
