//! Code generation: the claim, the body on the claim's transaction, the commit.

use proc_macro2::{Group, Ident, Literal, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{AttrStyle, FnArg, ItemFn, LitStr, Path};

use crate::args::{self, Args, Isolation};
use crate::diag::Diag;
use crate::signature::{self, Handler};
use crate::validate;

pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let item: ItemFn = match syn::parse2(item.clone()) {
        Ok(item) => item,
        Err(_) => {
            // Not a function at all: say so on the item, and give it back untouched.
            let err = syn::Error::new(
                Span::call_site(),
                "`#[idempotent]` goes on an `async fn` that takes a transaction and returns a `Result`",
            )
            .to_compile_error();
            return quote!(#err #item);
        }
    };
    let mut diag = Diag::default();
    let args = args::parse(args, &mut diag);
    let handler = signature::analyse(&item, &mut diag);
    if !args.gave("key") && !args.unknown {
        diag.error_at(
            Span::call_site(),
            "`#[idempotent]` needs `key`, the expression that reads the job's stable id: \
             `#[idempotent(key = \"job.id\")]`",
        );
    }
    if !args.gave("scope") && !args.unknown {
        validate::scope(&item.sig, &mut diag);
    }
    if let (Some(handler), Some((_, expr))) = (&handler, &args.key) {
        validate::key(expr, handler, &mut diag);
    }
    match (diag.finish(), handler) {
        (Ok(()), Some(handler)) => expand(&args, &item, &handler),
        (result, _) => {
            // Give rustc the function as written, so one mistake is one error and the IDE
            // keeps resolving the body.
            let errors = result.err().map(|e| e.to_compile_error());
            quote!(#errors #item)
        }
    }
}

fn expand(args: &Args, item: &ItemFn, handler: &Handler) -> TokenStream {
    let krate: Path = args
        .krate
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(::idem));
    let private = quote!(#krate::__private);
    let (key_lit, key) = args.key.as_ref().expect("checked by the caller");
    let scope = args
        .scope
        .clone()
        .unwrap_or_else(|| LitStr::new(&item.sig.ident.unraw().to_string(), item.sig.ident.span()));

    let local = |name: &str| Ident::new(name, Span::mixed_site());
    let store = local("store");
    let key_var = local("__idem_key");
    let guard = local("__idem_guard");
    let tx_var = local("__idem_tx");
    let result = local("__idem_result");
    let err = local("__idem_err");
    let outcome_var = local("__idem_outcome");

    let mut sig = item.sig.clone();
    let db = &handler.db;
    let store_arg: FnArg = syn::parse_quote!(#store: &#private::Store<#db>);
    *sig.inputs
        .iter_mut()
        .nth(handler.tx_index)
        .expect("index from analyse") = store_arg;
    let ok = &handler.ok;
    let outcome: syn::Type = syn::parse_quote!(#private::Outcome<#ok>);
    let ret = &handler.ret;
    if let syn::ReturnType::Type(_, ty) = &mut sig.output {
        **ty = signature::with_ok(ret, outcome);
    }

    let options = claim_options(args, &private);

    // Errors about the key's type land on the `key` literal.
    let key_eval = quote_spanned! {key_lit.span()=>
        let #key_var = #private::key(&(#key));
    };
    let tx_pat = &handler.tx_pat;
    let tx_ty = &handler.tx_ty;
    let stmts = &item.block.stmts;
    // Every idem error reaches the handler's error type through the one `settle` call, spanned
    // on the return type: a missing `From<idem::Error>` is one error, on the user's type.
    let settle = located_at(quote!(#private::settle(#outcome_var)), ret.span());
    let body = quote! {
        #key_eval
        let #outcome_var = async move {
            let mut #guard = match #private::claim(#store, #scope, #options, #key_var).await {
                ::core::result::Result::Ok(#private::Claim::Fresh(#guard)) => #guard,
                ::core::result::Result::Ok(#private::Claim::Duplicate) => {
                    return ::core::result::Result::Ok(#private::Outcome::Duplicate);
                }
                ::core::result::Result::Err(#err) => {
                    return ::core::result::Result::Err(#private::Failed::Idem(#err));
                }
            };
            let #tx_var = #guard.tx();
            let #result: #ret = async move {
                let #tx_pat: #tx_ty = #tx_var;
                #(#stmts)*
            }
            .await;
            #private::finish(#guard, #result).await
        }
        .await;
        #settle
    };

    // syn keeps the body's `#![...]` among the fn's attributes; before the `fn` they would
    // be inner attributes of the enclosing module, so they go back inside the body.
    let (attrs, inner): (Vec<_>, Vec<_>) = item
        .attrs
        .iter()
        .partition(|a| matches!(a.style, AttrStyle::Outer));
    let vis = &item.vis;
    let has_docs = attrs.iter().any(|a| a.path().is_ident("doc"));
    let note = has_docs.then(|| {
        let text = format!(
            "\n\n*Idempotent* (scope `{}`): the effect commits once per key; a later delivery \
             of the same key returns `Outcome::Duplicate` without running.",
            scope.value()
        );
        quote!(#[doc = #text])
    });
    let mut out = TokenStream::new();
    for a in attrs {
        a.to_tokens(&mut out);
    }
    quote! {
        #note
        #vis #sig {
            #(#inner)*
            #body
        }
    }
    .to_tokens(&mut out);
    out
}

/// The `options` argument of the claim: `ClaimOptions::new()` and one call per argument given,
/// so that a handler without `wait` or `isolation` keeps the database's own behaviour.
fn claim_options(args: &Args, private: &TokenStream) -> TokenStream {
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
    options
}

/// Moves every token to `at` for diagnostics while keeping how its names resolve (hygiene),
/// so that rustc's errors about these tokens point at the user's code.
fn located_at(tokens: TokenStream, at: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut tt| {
            if let TokenTree::Group(g) = &tt {
                let mut group = Group::new(g.delimiter(), located_at(g.stream(), at));
                group.set_span(g.span().located_at(at));
                tt = TokenTree::Group(group);
            } else {
                tt.set_span(tt.span().located_at(at));
            }
            tt
        })
        .collect()
}
