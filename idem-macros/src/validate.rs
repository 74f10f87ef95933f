//! Checks of meaning, after parsing: does the key read the handler's own parameters, and can
//! the scope default to the function's name?

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{Expr, FnArg, GenericParam, Ident, Signature};

use crate::diag::Diag;
use crate::signature::Handler;

/// The key must be computed from the job, never from the transaction or from names the
/// handler does not have: report each such root on its own token.
pub(crate) fn key(expr: &Expr, handler: &Handler, diag: &mut Diag) {
    let mut found = Vec::new();
    roots(expr, &mut found);
    let mut tx_names = Vec::new();
    crate::signature::bound_names(&handler.tx_pat, &mut tx_names);
    for root in found {
        if tx_names.contains(root) {
            diag.error(
                root,
                format!(
                    "the key cannot come from the transaction `{root}`: read the job's id from \
                     another parameter, like \"job.id\""
                ),
            );
        } else if !handler.params.contains(root) {
            let names: Vec<String> = handler.params.iter().map(|p| format!("`{p}`")).collect();
            let list = if names.is_empty() {
                "the handler has no other parameter".to_owned()
            } else {
                format!("parameters: {}", names.join(", "))
            };
            diag.error(
                root,
                format!("`key` refers to `{root}`, which is not a parameter ({list})"),
            );
        }
    }
}

/// The variables an expression starts from: `job` in `job.id`, both in `(a.x, b.y)`.
/// Anything more elaborate (calls, macros, blocks) is left to rustc.
fn roots<'e>(expr: &'e Expr, out: &mut Vec<&'e Ident>) {
    match expr {
        Expr::Path(p) if p.qself.is_none() && p.path.leading_colon.is_none() => {
            if let Some(ident) = p.path.get_ident() {
                // `CONST` and unit structs start upper-case; they are not parameters.
                let first = ident.to_string().chars().next();
                if !first.is_some_and(char::is_uppercase) {
                    out.push(ident);
                }
            }
        }
        Expr::Field(f) => roots(&f.base, out),
        Expr::MethodCall(m) => roots(&m.receiver, out),
        Expr::Index(i) => roots(&i.expr, out),
        Expr::Reference(r) => roots(&r.expr, out),
        Expr::Unary(u) => roots(&u.expr, out),
        Expr::Paren(p) => roots(&p.expr, out),
        Expr::Group(g) => roots(&g.expr, out),
        Expr::Cast(c) => roots(&c.expr, out),
        Expr::Tuple(t) => t.elems.iter().for_each(|e| roots(e, out)),
        _ => {}
    }
}

/// The default scope is the bare function name, which is only unique for a free, non-generic
/// function: every type's `handle` method, and every instantiation of a generic function,
/// would otherwise claim keys in one scope and see each other's jobs as duplicates.
pub(crate) fn scope(sig: &Signature, diag: &mut Diag) {
    let name = sig.ident.unraw();
    let why = if sig.receiver().is_some() {
        format!(
            "`{name}` is a method: two types' `{name}` methods would share one scope and skip \
             each other's jobs"
        )
    } else if mentions(sig.to_token_stream(), "Self") {
        format!(
            "`{name}` names `Self`: two types' `{name}` functions would share one scope and skip \
             each other's jobs"
        )
    } else if sig
        .generics
        .params
        .iter()
        .any(|p| !matches!(p, GenericParam::Lifetime(_)))
    {
        format!(
            "`{name}` is generic: two instantiations would share one scope and skip each \
             other's jobs"
        )
    } else if sig.inputs.iter().any(|arg| match arg {
        FnArg::Typed(pt) => mentions(pt.ty.to_token_stream(), "impl"),
        FnArg::Receiver(_) => false,
    }) {
        format!(
            "`{name}` takes an `impl Trait`, so it is generic: two instantiations would share \
             one scope and skip each other's jobs"
        )
    } else {
        return;
    };
    diag.error(
        &sig.ident,
        format!("{why}; name it: `#[idempotent(key = \"...\", scope = \"email.{name}\")]`"),
    );
}

/// Whether the keyword or identifier `word` occurs anywhere in `tokens`, macro calls and
/// nested groups included.
fn mentions(tokens: TokenStream, word: &str) -> bool {
    tokens.into_iter().any(|tt| match tt {
        TokenTree::Ident(ident) => ident == word,
        TokenTree::Group(group) => mentions(group.stream(), word),
        _ => false,
    })
}
