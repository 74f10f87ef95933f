//! A handler on a database named in its signature (`Postgres`, `Sqlite`, `MySql`, or sqlx's
//! alias of one) goes to rustc through the runtime's gate for that database's feature. With
//! the feature on, the gate gives the handler back as expanded. With it off, the gate gives a
//! stand-in instead: one `compile_error!` at the database's name, naming the feature, and a
//! function of the same signature whose store parameter takes anything, so that the callers
//! compile around it. Without the gate, every use of the store's type in the expansion and at
//! each call reports the missing `Backend` again (eight errors for one handler and one call).
//! Which features are on is known only to the runtime, which is why the choice is made there.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::{FnArg, Ident, ItemFn, ReturnType, Type};

use crate::signature::{Db, Handler, Kind};

pub(super) fn by_feature(
    written: &ItemFn,
    handler: &Handler,
    expanded: TokenStream,
    private: &TokenStream,
) -> TokenStream {
    let Kind::Transaction { db, .. } = &handler.kind else {
        // A lease handler names no database: the store's type at the call says which.
        return expanded;
    };
    let Some((feature, span)) = named(db) else {
        // An alias of the user's own hides the name: the runtime's `Backend` bound reports
        // a missing feature instead, once per use.
        return expanded;
    };
    let Ok(item) = syn::parse2::<ItemFn>(expanded.clone()) else {
        return expanded;
    };
    let Some(FnArg::Typed(tx)) = written.sig.inputs.iter().nth(handler.index) else {
        return expanded;
    };
    let stand_in = stand_in(item, &tx.ty, feature, span);
    let gate = Ident::new(&format!("if_{feature}"), span);
    quote!(#private::#gate! { { #expanded } { #stand_in } })
}

/// The feature of the database the transaction parameter names, and where it names it.
fn named(db: &Db) -> Option<(&'static str, Span)> {
    let (name, span) = match db {
        Db::Sqlx(name, span) => ((*name).to_owned(), *span),
        Db::Written(ty) => match &**ty {
            Type::Path(path) if path.qself.is_none() => {
                let last = path.path.segments.last()?;
                (last.ident.to_string(), last.ident.span())
            }
            _ => return None,
        },
    };
    let feature = match name.as_str() {
        "Postgres" => "postgres",
        "Sqlite" => "sqlite",
        "MySql" => "mysql",
        _ => return None,
    };
    Some((feature, span))
}

fn stand_in(mut item: ItemFn, tx: &Type, feature: &str, span: Span) -> TokenStream {
    for input in &mut item.sig.inputs {
        // The store parameter is the one whose type the expansion wrote (`impl Target<DB>`);
        // the user's own types never name idem's private module.
        if let FnArg::Typed(pt) = input
            && pt.ty.to_token_stream().to_string().contains("__private")
        {
            *pt.ty = syn::parse_quote!(impl ::core::marker::Sized);
        }
    }
    // Not an `async fn`: its future would capture the store's type, and a caller's store of
    // the missing database would be reported again at the call and at its `.await`.
    item.sig.asyncness = None;
    let output = match &item.sig.output {
        ReturnType::Type(_, ty) => quote!(#ty),
        ReturnType::Default => quote!(()),
    };
    item.sig.output = syn::parse_quote!(-> ::core::future::Pending<#output>);
    // The transaction's type as written stays in use, so that its imports raise no warning.
    item.block = syn::parse_quote!({
        let _: ::core::option::Option<#tx> = ::core::option::Option::None;
        ::core::future::pending()
    });
    item.attrs
        .push(syn::parse_quote!(#[allow(unused_variables)]));
    let message = format!(
        "this build of idem cannot keep markers in this database: enable idem's `{feature}` \
         feature, e.g. `idem = {{ version = \"..\", features = [\"{feature}\"] }}`"
    );
    let error = quote_spanned!(span=> ::core::compile_error!(#message););
    quote!(#error #item)
}
