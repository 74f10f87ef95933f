//! Code generation. This module holds what every mode shares (the signature, the key, the
//! scope, the conversion of errors); `transaction` holds the claim-run-commit of the
//! transaction mode, `lease` the claim-run-complete of the lease mode, `batch` the
//! claim-run-commit of a whole batch.

mod batch;
mod each;
mod gate;
mod lease;
mod spec;
mod transaction;

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{AttrStyle, FnArg, ItemFn, LitStr, Stmt};

use crate::args::{self, Args};
use crate::diag::Diag;
use crate::mode::Mode;
use crate::signature::{self, Db, Handler, Kind, Repair};
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
    let written = args.clone();
    let args = args::parse(args, &mut diag);
    let mode = validate::mode(&args, &item.sig, &mut diag);
    let mut repairs = Vec::new();
    let handler = signature::analyse(&item, mode, &mut diag, &mut repairs);
    let outbox = crate::outbox::find(&item.sig, mode, &mut diag);
    validate::required(&args, &written, &item.sig, &mut diag);
    let mut batch = None;
    let mut each = None;
    if mode == Mode::Batch {
        if let (Some(handler), Some((lit, name))) = (&handler, &args.batch) {
            batch = validate::batch(&item, lit, name, args.key.as_ref(), handler, &mut diag);
        }
    } else if let (Some(handler), Some((_, expr))) = (&handler, &args.key) {
        validate::key(expr, handler, &mut diag);
    }
    if let (Mode::Each, Some(handler), Some((lit, name))) = (mode, &handler, &args.each) {
        each = validate::each(&item, lit, name, handler, &mut diag);
    }
    if let (Some(handler), Mode::Lease) = (&handler, mode) {
        validate::steps(&item, handler, &mut diag);
    }
    // A batch refuses `fingerprint` altogether (`validate::mode`).
    if let (Some(handler), Some((_, expr)), false) =
        (&handler, &args.fingerprint, mode == Mode::Batch)
    {
        validate::fingerprint(expr, handler, &mut diag);
    }
    if let (Some(handler), Some((_, expr)), false) = (&handler, &args.link, mode == Mode::Batch) {
        validate::link(expr, handler, &mut diag);
    }
    match (diag.finish(), handler) {
        (Ok(()), Some(handler)) if mode == Mode::Each && each.is_some() => {
            let each = each.as_ref().expect("checked");
            let expanded = each::expand(&args, &item, &handler, each, outbox.as_ref());
            gate::by_feature(&item, &handler, expanded, &private_path(&args))
        }
        (Ok(()), Some(handler))
            if matches!(mode, Mode::Transaction | Mode::Group | Mode::Lease) =>
        {
            let expanded = expand(&args, mode, &item, &handler, outbox.as_ref());
            gate::by_feature(&item, &handler, expanded, &private_path(&args))
        }
        (Ok(()), Some(handler)) if mode == Mode::Batch && batch.is_some() => {
            let batch = batch.as_ref().expect("checked");
            let expanded = batch::expand(&args, &item, &handler, batch, outbox.as_ref());
            gate::by_feature(&item, &handler, expanded, &private_path(&args))
        }
        (result, _) => {
            // Give rustc the function as written, so one mistake is one error and the IDE
            // keeps resolving the body.
            let errors = result.err().map(|e| e.to_compile_error());
            let item = repaired(item, repairs, &private_path(&args));
            quote!(#errors #item)
        }
    }
}

/// The function as written, but for the transaction parameters that named no database: they
/// get a stand-in one, located at their type.
fn repaired(mut item: ItemFn, repairs: Vec<Repair>, private: &TokenStream) -> ItemFn {
    for Repair { index, ty } in repairs {
        if let Some(FnArg::Typed(pt)) = item.sig.inputs.iter_mut().nth(index) {
            let db = located_at(quote!(#private::db::Placeholder), ty.span());
            *pt.ty = signature::with_database(&ty, db);
        }
    }
    item
}

/// The database of a transaction parameter, as the store's type parameter.
fn database(db: &Db, private: &TokenStream) -> TokenStream {
    match db {
        Db::Written(db) => quote!(#db),
        Db::Sqlx(name, span) => {
            // sqlx's alias named the database; the re-export names it for the store.
            let name = Ident::new(name, *span);
            located_at(quote!(#private::db::#name), *span)
        }
    }
}

/// Rewrites the handler's `Result<T, E>` into `Result<wrap(T), E>` and returns `T`: as
/// written, or read through `HandlerResult` (spanning the return type, so that every use of an
/// alias of something else is the same error at the same place, reported once).
fn rewrite_output(
    sig: &mut syn::Signature,
    handler: &Handler,
    private: &TokenStream,
    wrap: impl FnOnce(&syn::Type) -> syn::Type,
) -> syn::Type {
    let ret = &handler.ret;
    let ok: syn::Type = match &handler.ok {
        Some(ok) => ok.clone(),
        None => syn::parse2(spanning(quote!(<#ret as #private::HandlerResult>::Ok), ret))
            .expect("a qualified path"),
    };
    let wrapped = wrap(&ok);
    if let syn::ReturnType::Type(_, ty) = &mut sig.output {
        **ty = match &handler.ok {
            Some(_) => signature::with_ok(&ret.ty, wrapped),
            None => {
                // All of it at the return type: rustc reports the signature's unmet bound on
                // the whole type, not on the projection within it.
                let err = quote!(<#ret as #private::HandlerResult>::Err);
                let rewritten = quote!(::core::result::Result<#wrapped, #err>);
                syn::parse2(spanning(rewritten, ret)).expect("a path type")
            }
        };
    }
    ok
}

/// `::idem::__private`, re-rooted by `crate = "..."`.
fn private_path(args: &Args) -> TokenStream {
    match &args.krate {
        Some(krate) => quote!(#krate::__private),
        None => quote!(::idem::__private),
    }
}

/// What a mode's claim-and-run code needs from the shared part: where idem is, the scope,
/// the handler, and the locals it reads (`store`, the key) and binds (the outcome).
struct Shared<'a> {
    /// `::idem::__private`, re-rooted by `crate = "..."`.
    private: TokenStream,
    scope: LitStr,
    handler: &'a Handler,
    /// The parameter that replaces the transaction.
    store: Ident,
    /// The encoded key, bound before any I/O.
    key_var: Ident,
    /// `Some(fingerprint)` of the payload, bound before any I/O, if `fingerprint` was given.
    print_var: Option<Ident>,
    /// The JSON codec of `T`, if `replay` was given.
    codec_var: Option<Ident>,
    /// `Option<TraceParent>` of the message, bound before any I/O, if `link` was given.
    link_var: Option<Ident>,
    /// `Option<u64>`, the hash of what picks a group's lane, if `lane` was given.
    lane_var: Option<Ident>,
    /// The `Result<Outcome<T>, Failed<E>>` that `settle` converts.
    outcome_var: Ident,
    /// The outbox parameter, if the handler takes one.
    outbox: Option<&'a crate::outbox::OutboxParam>,
    /// Transaction, group or lease mode.
    mode: Mode,
}

/// The signature without the outbox parameter: the outbox is the claim's, the caller passes
/// none.
fn without_outbox(sig: &mut syn::Signature, outbox: Option<&crate::outbox::OutboxParam>) {
    if let Some(outbox) = outbox {
        sig.inputs = std::mem::take(&mut sig.inputs)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i != outbox.index)
            .map(|(_, arg)| arg)
            .collect();
    }
}

/// The codec argument of a finish: `Some(codec)` with `replay`, else `None`.
fn codec_arg(codec_var: Option<&Ident>) -> TokenStream {
    match codec_var {
        Some(codec) => quote!(::core::option::Option::Some(#codec)),
        None => quote!(::core::option::Option::None),
    }
}

/// The link argument of a claim: the bound `Option<TraceParent>` with `link`, else `None`.
fn link_arg(link_var: Option<&Ident>) -> TokenStream {
    match link_var {
        Some(link) => quote!(#link),
        None => quote!(::core::option::Option::None),
    }
}

/// A local of the generated code: invisible to the body's names, and they to it.
fn local(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

fn expand(
    args: &Args,
    mode: Mode,
    item: &ItemFn,
    handler: &Handler,
    outbox: Option<&crate::outbox::OutboxParam>,
) -> TokenStream {
    let ident = &item.sig.ident;
    let private = private_path(args);
    // An alias of `Result` that does not name `T` (`Fallible<T>`): `T` and `E` are read
    // through `HandlerResult`, and the body's value converted by `Returned`, so that an alias
    // of something else is the one unmet bound of the signature, on the return type.
    let projected;
    let handler = match &handler.ok {
        Some(_) => handler,
        None => {
            let mut through = handler.clone();
            through.ret.through = Some(private.clone());
            projected = through;
            &projected
        }
    };
    let shared = Shared {
        private,
        scope: args.scope.clone().expect("checked by `validate::required`"),
        handler,
        store: local("store"),
        key_var: local("__idem_key"),
        print_var: args.fingerprint.as_ref().map(|_| local("__idem_print")),
        codec_var: args.replay.then(|| local("__idem_codec")),
        link_var: args.link.as_ref().map(|_| local("__idem_link")),
        lane_var: args.lane.as_ref().map(|_| local("__idem_lane")),
        outcome_var: local("__idem_outcome"),
        outbox,
        mode,
    };
    let Shared {
        private,
        scope,
        store,
        key_var,
        outcome_var,
        ..
    } = &shared;

    let mut sig = item.sig.clone();
    let db = match &handler.kind {
        Kind::Transaction { db, .. } => database(db, private),
        Kind::Lease { .. } => {
            // A lease handler names no database: the store's type parameter is the caller's
            // to infer. Added after the user's own, so their turbofish (if any) still fits.
            let db = local("__IdemDb");
            sig.generics
                .params
                .push(syn::parse_quote!(#db: #private::Backend));
            quote!(#db)
        }
    };
    let store_arg: FnArg = match &handler.kind {
        // Group commit: the calls share the group's transactions.
        Kind::Transaction { .. } if mode == Mode::Group => {
            syn::parse_quote!(#store: &dyn #private::GroupTarget<#db>)
        }
        // `&Store<DB>`, or `store.join(tx)` to run inside the caller's transaction.
        Kind::Transaction { .. } => syn::parse_quote!(#store: impl #private::Target<#db>),
        Kind::Lease { .. } => syn::parse_quote!(#store: &#private::Store<#db>),
    };
    *sig.inputs
        .iter_mut()
        .nth(handler.index)
        .expect("index from analyse") = store_arg;
    without_outbox(&mut sig, outbox);
    let ret = &handler.ret;
    let ok = rewrite_output(
        &mut sig,
        handler,
        private,
        |ok| syn::parse_quote!(#private::Outcome<#ok>),
    );
    let ok = &ok;

    let (key_lit, key) = args.key.as_ref().expect("checked by the caller");
    // Errors about the key's type land on the `key` literal.
    let key = unsuggested_fields(by_reference(key));
    let key_eval = quote_spanned! {key_lit.span()=>
        let #key_var = #private::key(&#key);
    };
    // Errors about the payload's type land on the `fingerprint` literal.
    let print_eval = args.fingerprint.as_ref().map(|(lit, expr)| {
        let var = shared.print_var.as_ref().expect("set with the fingerprint");
        let expr = unsuggested_fields(by_reference(expr));
        quote_spanned! {lit.span()=>
            let #var = ::core::option::Option::Some(#private::fingerprint(&#expr));
        }
    });
    // Errors about the traceparent's type land on the `link` literal.
    let link_eval = args.link.as_ref().map(|(lit, expr)| {
        let var = shared.link_var.as_ref().expect("set with the link");
        let expr = unsuggested_fields(by_reference(expr));
        quote_spanned! {lit.span()=>
            let #var = #private::link(&#expr);
        }
    });
    // Errors about the lane's type land on the `lane` literal.
    let lane_eval = args.lane.as_ref().map(|(lit, expr)| {
        let var = shared.lane_var.as_ref().expect("set with the lane");
        let expr = unsuggested_fields(by_reference(expr));
        quote_spanned! {lit.span()=>
            let #var = ::core::option::Option::Some(#private::lane(&#expr));
        }
    });
    // `replay` stores `T` and reads it back through a codec picked by autoref: a `T` that
    // cannot be replayed is one error, on the return type where `T` is written.
    let replayable = shared.codec_var.as_ref().map(|codec| {
        let pick = located_at(
            quote!({
                use #private::{ReplayCodec as _, ReplayFallback as _};
                (&#private::Replay::<#ok>::new()).codec()
            }),
            ret.span(),
        );
        quote!(let #codec = #pick;)
    });
    let run = match handler.kind {
        Kind::Transaction { .. } => transaction::run(&shared, args, ident, &item.block.stmts),
        Kind::Lease { .. } => lease::run(&shared, args, ident, &item.block.stmts),
    };
    let const_checks = lease::const_checks(args, private);
    // Every idem error reaches the handler's error type through the one `settle` call, spanned
    // on the return type: a missing `From<idem::Error>` is one error, on the user's type.
    let settle = spanning(quote!(#private::settle(#outcome_var)), ret);

    // syn keeps the body's `#![...]` among the fn's attributes; before the `fn` they would
    // be inner attributes of the enclosing module, so they go back inside the body.
    let (attrs, inner): (Vec<_>, Vec<_>) = item
        .attrs
        .iter()
        .partition(|a| matches!(a.style, AttrStyle::Outer));
    let vis = &item.vis;
    let has_docs = attrs.iter().any(|a| a.path().is_ident("doc"));
    let note = has_docs.then(|| {
        let effect = match handler.kind {
            Kind::Transaction { .. } if mode == Mode::Group => {
                "the effect commits once per key, in a group commit shared with concurrent calls"
            }
            Kind::Transaction { .. } => "the effect commits once per key",
            Kind::Lease { .. } => "the body runs to completion once per key, under a lease",
        };
        let text = format!(
            "\n\n*Idempotent* (scope `{}`): {effect}; a later delivery of the same key \
             returns `Outcome::Duplicate` without running.",
            scope.value()
        );
        quote!(#[doc = #text])
    });
    quote! {
        #(#attrs)*
        #note
        #vis #sig {
            #(#inner)*
            #const_checks
            #replayable
            #key_eval
            #print_eval
            #link_eval
            #lane_eval
            #run
            #settle
        }
    }
}

/// The `key` or `fingerprint` expression, parenthesised, to be borrowed: a tuple borrows each
/// element (`(job.tenant, job.id)` gives `(&job.tenant, &job.id)`), so that owned fields are
/// read through the handler's `&Job` rather than moved out of it. References and tuples encode
/// like what they point to and hold, so the stored key (and the digest) stay the same.
fn by_reference(expr: &syn::Expr) -> TokenStream {
    match expr {
        syn::Expr::Tuple(t) if !t.elems.is_empty() => {
            let elems = t.elems.iter().map(|e| {
                let e = by_reference(e);
                quote_spanned!(e.span()=> &#e)
            });
            let mut group = Group::new(Delimiter::Parenthesis, quote!(#(#elems,)*));
            group.set_span(t.paren_token.span.join());
            group.into_token_stream()
        }
        syn::Expr::Paren(p) if matches!(*p.expr, syn::Expr::Tuple(_)) => by_reference(&p.expr),
        other => {
            let mut group = Group::new(Delimiter::Parenthesis, other.to_token_stream());
            group.set_span(other.span());
            group.into_token_stream()
        }
    }
}

/// The expression parsed from a string literal, with the field and method names after each
/// `.` given the expansion's hygiene (at the same place). Every token of it sits at the whole
/// literal, so rustc's "a field with a similar name exists" would rewrite the literal into the
/// bare field (`key = id` for `key = "job.idd"`); for a name from an expansion rustc still
/// names the field it did not find, and makes no such rewrite. Fields and methods resolve the
/// same under either hygiene.
fn unsuggested_fields(tokens: TokenStream) -> TokenStream {
    let mut after_dot = false;
    tokens
        .into_iter()
        .map(|tt| {
            let tt = match tt {
                TokenTree::Ident(mut ident) if after_dot => {
                    ident.set_span(Span::mixed_site().located_at(ident.span()));
                    TokenTree::Ident(ident)
                }
                TokenTree::Group(g) => {
                    let mut group = Group::new(g.delimiter(), unsuggested_fields(g.stream()));
                    group.set_span(g.span());
                    TokenTree::Group(group)
                }
                other => other,
            };
            after_dot = matches!(&tt, TokenTree::Punct(p) if p.as_char() == '.');
            tt
        })
        .collect()
}

/// `let var: Ret = async move { prelude body }.await;`: the body's type is pinned to the
/// declared return type, with `return` and `?` ending the inner block as they ended the
/// function. The block's own tokens sit at the return type, so a body of the wrong type is
/// reported there and states the user's type, not the expansion's. With `span` (the private
/// path and the local holding the claim's `Body`), the block runs as the claim's body: in its
/// span, marked as inside its transaction.
///
/// For an alias that does not name `T`, the value then goes through `Returned`, which turns a
/// `Result` into itself and anything else into an unconstrained `Result` (its one error is the
/// signature's, on the return type).
///
/// A `bounded` body (a group's) runs through `Body::bounded`, under its group's bound.
fn pinned_body(
    ret: &signature::Returned,
    var: &Ident,
    prelude: TokenStream,
    stmts: &[Stmt],
    span: Option<(&TokenStream, &Ident)>,
    bounded: bool,
) -> TokenStream {
    let run = match bounded {
        true => quote!(bounded),
        false => quote!(run),
    };
    pinned(ret, var, prelude, stmts, span, quote!(async move), run)
}

/// [`pinned_body`] for a body that runs once per job of a batch: an `async` block that
/// borrows the handler's other parameters instead of taking them, so that the next job's
/// body has them too (a body that consumes one does not compile, which is the truth: it
/// cannot run twice).
fn pinned_body_each(
    ret: &signature::Returned,
    var: &Ident,
    prelude: TokenStream,
    stmts: &[Stmt],
    span: (&TokenStream, &Ident),
) -> TokenStream {
    pinned(
        ret,
        var,
        prelude,
        stmts,
        Some(span),
        quote!(async),
        quote!(run),
    )
}

fn pinned(
    ret: &signature::Returned,
    var: &Ident,
    prelude: TokenStream,
    stmts: &[Stmt],
    span: Option<(&TokenStream, &Ident)>,
    head: TokenStream,
    run: TokenStream,
) -> TokenStream {
    // The expression runs from `async` to `await`: at the return type's first and last
    // tokens, rustc underlines the whole type (a joined span needs nightly).
    let tokens: Vec<TokenTree> = ret.to_token_stream().into_iter().collect();
    let first = tokens.first().map_or_else(|| ret.span(), TokenTree::span);
    let last = tokens.last().map_or(first, TokenTree::span);
    let head = located_at(head, first);
    let mut block = Group::new(Delimiter::Brace, quote!(#prelude #(#stmts)*));
    block.set_span(block.span().located_at(last));
    let tail = located_at(quote!(.await), last);
    let (head, block) = match span {
        None => (head, block.into_token_stream()),
        Some((private, span)) => {
            let mut args = Group::new(Delimiter::Parenthesis, quote!(#span, #head #block));
            args.set_span(args.span().located_at(last));
            (
                located_at(quote!(#private::Body::#run), first),
                args.into_token_stream(),
            )
        }
    };
    let convert = ret.through.as_ref().map(|private| {
        quote! {
            let #var = {
                use #private::{IntoResult as _, NotAResult as _};
                #private::Returned(#var).into_result()
            };
        }
    });
    quote!(let #var: #ret = #head #block #tail; #convert)
}

/// Moves `tokens` to the range of `like` for diagnostics: every token to its first token, the
/// last one to its last, so that rustc underlines the whole of `like` (a joined span needs
/// nightly).
fn spanning(tokens: TokenStream, like: &impl ToTokens) -> TokenStream {
    let spans: Vec<Span> = like
        .to_token_stream()
        .into_iter()
        .map(|tt| tt.span())
        .collect();
    let (Some(&first), Some(&last)) = (spans.first(), spans.last()) else {
        return tokens;
    };
    let mut out: Vec<TokenTree> = located_at(tokens, first).into_iter().collect();
    if let Some(tt) = out.last_mut() {
        tt.set_span(tt.span().located_at(last));
    }
    out.into_iter().collect()
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
