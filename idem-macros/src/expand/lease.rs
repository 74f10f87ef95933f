//! The lease mode: claim the key for a lease, run the body outside any transaction under the
//! lease's timeout, and complete the marker if this delivery still holds the key.

use proc_macro2::{Literal, TokenStream};
use quote::quote;
use syn::Stmt;

use super::{Shared, local, pinned_body};
use crate::args::Args;
use crate::signature::Kind;

/// Binds `outcome_var` to the call's `Result<Outcome<T>, Failed<E>>`.
pub(super) fn run(shared: &Shared<'_>, args: &Args, stmts: &[Stmt]) -> TokenStream {
    let Shared {
        private,
        scope,
        handler,
        store,
        key_var,
        print_var,
        codec_var,
        outcome_var,
        ..
    } = shared;
    let lease = local("__idem_lease");
    let recorded = local("__idem_recorded");
    let lease_ref = local("__idem_lease_ref");
    let result = local("__idem_result");
    let err = local("__idem_err");
    let options = lease_options(args, private);
    let body_var = local("__idem_body");
    let pat = &handler.pat;
    let Kind::Lease { ty } = &handler.kind else {
        unreachable!("lease mode has a lease parameter")
    };
    // Pinned inside `run`'s future rather than on `run`'s result, so that a body of the wrong
    // type is reported as the declared type, not wrapped in `run`'s `Result<_, Error>`. The
    // lease is bound with the type as the user wrote it, which keeps their import of `Lease`
    // used once the parameter has become the store.
    let body = pinned_body(
        &handler.ret,
        &body_var,
        quote!(let #pat: #ty = #lease_ref;),
        stmts,
    );
    let claim = match print_var {
        Some(print) => {
            quote!(#private::lease_checked(#store, #scope, #options, #key_var, #print))
        }
        None => quote!(#private::lease(#store, #scope, #options, #key_var)),
    };
    // Without `replay` the claim never answers `Replayed`; the arm keeps the match whole.
    let replayed = match codec_var {
        Some(codec) => quote!(return #private::replayed(#codec, &#recorded)),
        None => quote!(return ::core::result::Result::Ok(#private::Outcome::Duplicate)),
    };
    let finish = if let Some(codec) = codec_var {
        quote!(#private::lease_finish_replay(#codec, #lease, #result))
    } else {
        quote!(#private::lease_finish(#lease, #result))
    };
    let (call, observe) =
        super::observe::call(private, scope, quote!(#private::Mode::Lease), key_var);
    quote! {
        #observe
        let #outcome_var = #private::Call::run(#call, async move {
            let #lease = match #claim.await {
                ::core::result::Result::Ok(#private::Leased::Fresh(#lease)) => #lease,
                ::core::result::Result::Ok(#private::Leased::Duplicate) => {
                    return ::core::result::Result::Ok(#private::Outcome::Duplicate);
                }
                ::core::result::Result::Ok(#private::Leased::Replayed(#recorded)) => {
                    #replayed;
                }
                ::core::result::Result::Err(#err) => {
                    return ::core::result::Result::Err(#private::Failed::Idem(#err));
                }
            };
            // The body borrows the lease while `run` holds it too; both only read it.
            let #lease_ref = &#lease;
            let #result = #private::lease_run(&#lease, async move {
                #body
                #body_var
            })
            .await;
            #finish.await
        })
        .await;
    }
}

/// The claim's `LeaseOptions`, built in a `const` block: the durations were checked when the
/// attribute was read, so nothing about them is left to run time.
fn lease_options(args: &Args, private: &TokenStream) -> TokenStream {
    let (_, lease_ms) = args.lease.as_ref().expect("lease mode has a lease");
    let lease_ms = Literal::u64_unsuffixed(*lease_ms);
    let mut options =
        quote!(#private::LeaseOptions::new(#private::Duration::from_millis(#lease_ms)));
    if let Some((_, ms)) = &args.timeout {
        let ms = Literal::u64_unsuffixed(*ms);
        options.extend(quote!(.timeout(#private::Duration::from_millis(#ms))));
    }
    if args.replay {
        options.extend(quote!(.replay()));
    }
    quote!(const { #options })
}
