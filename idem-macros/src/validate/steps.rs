//! A lease-mode body's steps, as far as the tokens show them: two calls of
//! `lease.step("name", ..)` (or `step_verified`, `tx_step`) with one literal name in one body
//! would fail at run time, on the second one, every time: refused here instead.

use proc_macro2::{Delimiter, Ident, TokenStream, TokenTree};
use syn::{ItemFn, LitStr, Pat};

use crate::diag::Diag;
use crate::signature::Handler;

/// The lease's methods that run a named step.
const STEP_METHODS: [&str; 3] = ["step", "step_verified", "tx_step"];

/// Reports every step call whose literal name an earlier call of the body used, at that
/// literal.
pub(crate) fn steps(item: &ItemFn, handler: &Handler, diag: &mut Diag) {
    let Pat::Ident(lease) = &handler.pat else {
        return;
    };
    let mut seen: Vec<LitStr> = Vec::new();
    let body = quote::ToTokens::to_token_stream(&item.block);
    scan(body, &lease.ident, &mut seen, diag);
}

fn scan(tokens: TokenStream, lease: &Ident, seen: &mut Vec<LitStr>, diag: &mut Diag) {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    for (i, token) in tokens.iter().enumerate() {
        if let TokenTree::Group(group) = token {
            scan(group.stream(), lease, seen, diag);
        }
        if let Some(name) = step_name(&tokens[i..], lease) {
            match seen.iter().find(|s| s.value() == name.value()) {
                Some(_) => diag.error(
                    &name,
                    format!(
                        "the step name {:?} is used twice in this body: each step of a body \
                         needs a name of its own, by which a redelivery finds its recorded \
                         value; rename this step",
                        name.value()
                    ),
                ),
                None => seen.push(name),
            }
        }
    }
}

/// The literal name of the step call `lease . step ( "name" , ..` (a turbofish after the
/// method allowed) that starts `tokens`.
fn step_name(tokens: &[TokenTree], lease: &Ident) -> Option<LitStr> {
    let mut rest = tokens.iter();
    match rest.next()? {
        TokenTree::Ident(ident) if ident == lease => {}
        _ => return None,
    }
    match rest.next()? {
        TokenTree::Punct(dot) if dot.as_char() == '.' => {}
        _ => return None,
    }
    match rest.next()? {
        TokenTree::Ident(method) if STEP_METHODS.iter().any(|m| method == m) => {}
        _ => return None,
    }
    // `::<..>` holds no parenthesised group: the first one is the call's arguments.
    let args = rest.find_map(|t| match t {
        TokenTree::Group(g) if g.delimiter() == Delimiter::Parenthesis => Some(g.stream()),
        TokenTree::Punct(p) if matches!(p.as_char(), ':' | '<' | '>' | ',' | '&' | '\'') => None,
        TokenTree::Ident(_) => None,
        _ => Some(TokenStream::new()),
    })?;
    let first = args.into_iter().next()?;
    match first {
        TokenTree::Literal(lit) => syn::parse2::<LitStr>(TokenTree::Literal(lit).into()).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use super::*;

    fn repeated(body: TokenStream) -> Vec<String> {
        let lease = Ident::new("lease", proc_macro2::Span::call_site());
        let mut diag = Diag::default();
        scan(body, &lease, &mut Vec::new(), &mut diag);
        match diag.finish() {
            Ok(()) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn a_literal_name_used_twice_is_one_error_per_repeat() {
        let errors = repeated(quote! {
            lease.step("a", f).await?;
            if x { lease.tx_step::<Pg, _, _, _>("a", g).await?; }
            lease.step_verified("b", f, v).await?;
            other.step("b", f).await?;
            lease.step(name, f).await?;
            lease.step(name, f).await?;
            lease.renew("b");
        });
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("\"a\" is used twice"), "{errors:?}");
    }
}
