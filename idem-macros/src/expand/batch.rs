//! The batch mode: claim the keys of every job of a batch with one statement, run the body
//! once on the fresh jobs, and commit their markers and effects together (one commit for the
//! batch instead of one per job).
//!
//! The body's batch parameter keeps its declared type, `&[Job]`, and holds only the fresh
//! jobs: the batch itself when every job is fresh, else clones of the fresh ones, so the jobs
//! must be `Clone` (a job's key and payload are plain data; a handler for jobs that cannot be
//! cloned claims by hand with `Store::claim_batch`). The body does not run when every job is
//! a duplicate.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::ext::IdentExt as _;
use syn::spanned::Spanned as _;
use syn::{FnArg, ItemFn};

use super::transaction::claim_options;
use super::{
    by_reference, local, located_at, pinned_body, private_path, unsuggested_fields, without_outbox,
};
use crate::args::Args;
use crate::outbox::OutboxParam;
use crate::signature::{Handler, Kind};
use crate::validate::BatchParam;

pub(super) fn expand(
    args: &Args,
    item: &ItemFn,
    handler: &Handler,
    batch: &BatchParam,
    outbox: Option<&OutboxParam>,
) -> TokenStream {
    let ident = &item.sig.ident;
    let private = private_path(args);
    let mut handler = handler.clone();
    if handler.ok.is_none() {
        handler.ret.through = Some(private.clone());
    }
    let handler = &handler;
    let scope = args.scope.clone().expect("checked by `validate::required`");
    let store = local("store");
    let keys = local("__idem_keys");
    let claim = local("__idem_claim");
    let fresh = local("__idem_fresh");
    let tx_var = local("__idem_tx");
    let result = local("__idem_result");
    let err = local("__idem_err");
    let outcome = local("__idem_outcome");
    let span = local("__idem_body_of");
    let name = ident.unraw().to_string();

    let Kind::Transaction { ty: tx_ty, db } = &handler.kind else {
        unreachable!("batch mode has a transaction parameter")
    };
    let db = super::database(db, &private);
    let mut sig = item.sig.clone();
    // A batch runs in a transaction of its own: joining the caller's (`store.join(tx)`)
    // would commit one batch's jobs with unrelated work.
    let store_arg: FnArg = syn::parse_quote!(#store: &#private::Store<#db>);
    *sig.inputs
        .iter_mut()
        .nth(handler.index)
        .expect("index from analyse") = store_arg;
    without_outbox(&mut sig, outbox);
    let ret = &handler.ret;
    super::rewrite_output(
        &mut sig,
        handler,
        &private,
        |ok| syn::parse_quote!(#private::Batch<#ok>),
    );

    let (key_lit, key) = args.key.as_ref().expect("checked by the caller");
    let key = unsuggested_fields(by_reference(key));
    let BatchParam {
        ident: jobs,
        elem,
        ty: jobs_ty,
        element,
    } = batch;
    // Errors about the key's type land on the `key` literal.
    let key_eval = quote_spanned! {key_lit.span()=>
        let #keys = #private::batch_keys(
            ::core::iter::Iterator::map(
                ::core::iter::IntoIterator::into_iter(#jobs),
                |#element| #private::Key::new(&#key),
            ),
        );
    };
    // A job type that is not `Clone` is one error, on the batch parameter's type.
    let fresh_jobs = located_at(quote!(#private::fresh_jobs(#jobs, &#claim)), jobs_ty.span());
    let options = claim_options(args, &private);
    let tx_pat = &handler.pat;
    let outbox_ref = local("__idem_outbox_ref");
    // As in transaction mode: the body binds references made outside its `async move`.
    let (borrow, bind_outbox) = match outbox {
        Some(o) => {
            let (pat, ty) = (&o.pat, &o.ty);
            (
                quote!(let (#span, #tx_var, #outbox_ref) = #private::batch_open(&mut #claim);),
                quote!(let #pat: #ty = #outbox_ref;),
            )
        }
        None => (
            quote!(let (#span, #tx_var, _) = #private::batch_open(&mut #claim);),
            TokenStream::new(),
        ),
    };
    let body = pinned_body(
        &handler.ret,
        &result,
        quote! {
            let #tx_pat: #tx_ty = #tx_var;
            let #jobs: &[#elem] = &*#fresh;
            #bind_outbox
        },
        &item.block.stmts,
        Some((&private, &span)),
        false,
    );
    let settle = located_at(quote!(#private::settle(#outcome)), ret.span());
    let spec = super::spec::claim(&private, &scope, &name, options);
    let count = local("__idem_jobs");

    let (attrs, inner): (Vec<_>, Vec<_>) = item
        .attrs
        .iter()
        .partition(|a| matches!(a.style, syn::AttrStyle::Outer));
    let vis = &item.vis;
    let note = attrs.iter().any(|a| a.path().is_ident("doc")).then(|| {
        let text = format!(
            "\n\n*Idempotent batch* (scope `{}`): each job's effect commits once per key; the \
             body runs on the jobs no earlier delivery committed, and returns one `Outcome` \
             per job.",
            scope.value()
        );
        quote!(#[doc = #text])
    });
    quote! {
        #(#attrs)*
        #note
        #vis #sig {
            #(#inner)*
            #spec
            #key_eval
            let #count = <[_]>::len(#jobs);
            let #outcome = async move {
                let mut #claim = match #private::claim_batch(#store, &__IDEM_SPEC, #keys, #count).await {
                    ::core::result::Result::Ok(#claim) => #claim,
                    ::core::result::Result::Err(#err) => {
                        return ::core::result::Result::Err(#private::Failed::Idem(#err));
                    }
                };
                if !#claim.any_fresh() {
                    return ::core::result::Result::Ok(#private::all_duplicates(&#claim));
                }
                let #fresh = #fresh_jobs;
                #borrow
                #body
                #private::finish_batch(#claim, #result).await
            }
            .await;
            #settle
        }
    }
}
