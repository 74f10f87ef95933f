//! A batch run job by job (`each = "job"`): claim the keys of every job of a batch with one
//! statement, as `batch` does, then run the body once per fresh job behind a savepoint of its
//! own, and commit the jobs whose body returned `Ok` together. The caller gets one result per
//! job (`idem::Each`): a job whose body failed is rolled back alone and reported with its
//! error.
//!
//! The job parameter (`job: &Job`) becomes the batch (`job: &[Job]`) for the caller; inside
//! the body it is one job, as written. The body borrows the handler's other parameters rather
//! than taking them, since it runs once per job.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::ext::IdentExt as _;
use syn::spanned::Spanned as _;
use syn::{FnArg, GenericArgument, ItemFn, PathArguments, Type};

use super::transaction::claim_options;
use super::{
    by_reference, local, located_at, pinned_body_each, private_path, unsuggested_fields,
    without_outbox,
};
use crate::args::Args;
use crate::outbox::OutboxParam;
use crate::signature::{Handler, Kind};
use crate::validate::EachParam;

pub(super) fn expand(
    args: &Args,
    item: &ItemFn,
    handler: &Handler,
    each: &EachParam,
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
    let guard = local("__idem_job");
    let at = local("__idem_at");
    let tx_var = local("__idem_tx");
    let result = local("__idem_result");
    let err = local("__idem_err");
    let outcome = local("__idem_outcome");
    let body_of = local("__idem_body_of");
    let span = local("__idem_span");
    let count = local("__idem_jobs");
    let name = ident.unraw().to_string();

    let Kind::Transaction { ty: tx_ty, db } = &handler.kind else {
        unreachable!("a batch runs in transaction mode")
    };
    let db = super::database(db, &private);
    let mut sig = item.sig.clone();
    // A batch runs in a transaction of its own, as `batch`'s does.
    let store_arg: FnArg = syn::parse_quote!(#store: &#private::Store<#db>);
    *sig.inputs
        .iter_mut()
        .nth(handler.index)
        .expect("index from analyse") = store_arg;
    let job = &each.ident;
    // The caller passes the batch where the body takes one job.
    for arg in &mut sig.inputs {
        if let FnArg::Typed(pt) = arg
            && matches!(&*pt.pat, syn::Pat::Ident(pi) if pi.ident == *job)
            && let Type::Reference(r) = &mut *pt.ty
        {
            let elem = &r.elem;
            *r.elem = syn::parse_quote!([#elem]);
        }
    }
    without_outbox(&mut sig, outbox);
    let ret = &handler.ret;
    let err_ty = error_type(&ret.ty, &private);
    super::rewrite_output(
        &mut sig,
        handler,
        &private,
        |ok| syn::parse_quote!(#private::Each<#ok, #err_ty>),
    );

    let (key_lit, key) = args.key.as_ref().expect("checked by the caller");
    let key = unsuggested_fields(by_reference(key));
    // Errors about the key's type land on the `key` literal; `job` there is each job.
    let key_eval = quote_spanned! {key_lit.span()=>
        let #keys = #private::batch_keys(
            ::core::iter::Iterator::map(
                ::core::iter::IntoIterator::into_iter(#job),
                |#job| #private::Key::new(&#key),
            ),
        );
    };
    let options = claim_options(args, &private);
    let tx_pat = &handler.pat;
    let mut job_ty = each.ty.clone();
    job_ty.lifetime = None;
    let outbox_ref = local("__idem_outbox_ref");
    let (borrow, bind_outbox) = match outbox {
        Some(o) => {
            let (pat, ty) = (&o.pat, &o.ty);
            (
                quote!(let (#tx_var, #outbox_ref) = #private::JobGuard::parts(&mut #guard);),
                quote!(let #pat: #ty = #outbox_ref;),
            )
        }
        None => (
            quote!(let #tx_var = #private::JobGuard::tx(&mut #guard);),
            TokenStream::new(),
        ),
    };
    let body = pinned_body_each(
        ret,
        &result,
        quote! {
            let #tx_pat: #tx_ty = #tx_var;
            let #job: #job_ty = #job;
            #bind_outbox
        },
        &item.block.stmts,
        (&private, &body_of),
    );
    let settle = located_at(quote!(#private::settle(#outcome)), ret.span());
    let spec = super::spec::claim(&private, &scope, &name, options);

    let (attrs, inner): (Vec<_>, Vec<_>) = item
        .attrs
        .iter()
        .partition(|a| matches!(a.style, syn::AttrStyle::Outer));
    let vis = &item.vis;
    let note = attrs.iter().any(|a| a.path().is_ident("doc")).then(|| {
        let text = format!(
            "\n\n*Idempotent batch, job by job* (scope `{}`): each job's effect commits once \
             per key; the body runs once for each job no earlier delivery committed, a job \
             whose body fails is rolled back alone, and the call returns one result per job \
             (`Ok`: ack it; `Err`: nack it).",
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
            let #count = <[_]>::len(#job);
            let #outcome = async move {
                let mut #claim = match #private::claim_batch(#store, &__IDEM_SPEC, #keys, #count).await {
                    ::core::result::Result::Ok(#claim) => #private::BatchGuard::each(#claim),
                    ::core::result::Result::Err(#err) => {
                        return ::core::result::Result::Err(#private::Failed::Idem(#err));
                    }
                };
                if let ::core::option::Option::Some(#span) = #private::EachGuard::body(&#claim) {
                    for (#at, #job) in ::core::iter::Iterator::enumerate(
                        ::core::iter::IntoIterator::into_iter(#job),
                    ) {
                        let mut #guard = match #private::EachGuard::job(&mut #claim, #at).await {
                            ::core::result::Result::Ok(::core::option::Option::Some(#guard)) => #guard,
                            ::core::result::Result::Ok(::core::option::Option::None) => continue,
                            ::core::result::Result::Err(#err) => {
                                return ::core::result::Result::Err(#private::Failed::Handler(#err));
                            }
                        };
                        let #body_of = ::core::clone::Clone::clone(&#span);
                        #borrow
                        #body
                        if let ::core::result::Result::Err(#err) = #private::JobGuard::finish(#guard, #result).await {
                            return ::core::result::Result::Err(#private::Failed::Handler(#err));
                        }
                    }
                }
                #private::finish_each(#claim).await
            }
            .await;
            #settle
        }
    }
}

/// `E` of the declared `Result<T, E>`: as written when the type names it, else read through
/// `HandlerResult` (an alias like `anyhow::Result<T>`).
fn error_type(ret: &Type, private: &TokenStream) -> TokenStream {
    if let Type::Path(p) = ret
        && let Some(last) = p.path.segments.last()
        && let PathArguments::AngleBracketed(args) = &last.arguments
        && let Some(GenericArgument::Type(e)) = args.args.iter().nth(1)
    {
        return quote!(#e);
    }
    quote!(<#ret as #private::HandlerResult>::Err)
}
