//! The attribute's arguments: `key = "..."`, `scope = "..."`, `crate = "..."`.

use proc_macro2::TokenStream;
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::{Expr, LitStr, Path};

use crate::diag::Diag;

#[derive(Default)]
pub(crate) struct Args {
    /// The literal (for spans) and the expression parsed from it.
    pub(crate) key: Option<(LitStr, Expr)>,
    pub(crate) scope: Option<LitStr>,
    pub(crate) krate: Option<Path>,
    /// `key` was written, even if its value was refused (so "missing key" is not said too).
    pub(crate) key_given: bool,
}

const KNOWN: &str = "expected `key`, `scope` or `crate`";

pub(crate) fn parse(tokens: TokenStream, diag: &mut Diag) -> Args {
    let mut args = Args::default();
    let mut seen: Vec<String> = Vec::new();
    let parser = syn::meta::parser(|meta| {
        let name = meta
            .path
            .get_ident()
            .map(ToString::to_string)
            .unwrap_or_default();
        if !matches!(name.as_str(), "key" | "scope" | "crate") {
            let path = &meta.path;
            let shown = quote::quote!(#path).to_string().replace(' ', "");
            diag.error(&meta.path, format!("unknown argument `{shown}`; {KNOWN}"));
            return skip_value(&meta);
        }
        let lit = string_value(&meta, &name, diag)?;
        if seen.contains(&name) {
            diag.error(&meta.path, format!("`{name}` is given twice; keep one"));
            return Ok(());
        }
        seen.push(name.clone());
        args.key_given |= name == "key";
        let Some(lit) = lit else { return Ok(()) };
        match name.as_str() {
            "key" => match lit.parse::<Expr>() {
                Ok(expr) => args.key = Some((lit, expr)),
                Err(e) => diag.error(
                    &lit,
                    format!(
                        "`key` must hold a Rust expression that reads the job's id, \
                         like \"job.id\": {e}"
                    ),
                ),
            },
            "scope" => {
                let value = lit.value();
                if value.is_empty() || value.len() > 255 || value.contains('\0') {
                    diag.error(
                        &lit,
                        "`scope` must be 1 to 255 bytes with no NUL byte, \
                         like \"billing.top_up\"",
                    );
                } else {
                    args.scope = Some(lit);
                }
            }
            _ => match lit.parse::<Path>() {
                Ok(path) => args.krate = Some(path),
                Err(_) => diag.error(
                    &lit,
                    "`crate` must be the path under which idem is reachable, like \"::my_app::idem\"",
                ),
            },
        }
        Ok(())
    });
    if let Err(e) = parser.parse2(tokens) {
        diag.push(e);
    }
    args
}

/// The `= "..."` of an argument; anything but a string literal is reported with the fix.
fn string_value(
    meta: &ParseNestedMeta<'_>,
    name: &str,
    diag: &mut Diag,
) -> syn::Result<Option<LitStr>> {
    if !meta.input.peek(syn::Token![=]) {
        diag.error(
            &meta.path,
            format!("`{name}` needs a value: `{name} = \"...\"`"),
        );
        return Ok(None);
    }
    let value: Expr = meta.value()?.parse()?;
    if let Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Str(lit),
        ..
    }) = value
    {
        return Ok(Some(lit));
    }
    let shown = quote::quote!(#value).to_string();
    diag.error(
        &value,
        format!("`{name}` takes a string literal: write `{name} = \"{shown}\"`"),
    );
    Ok(None)
}

fn skip_value(meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        let _: Expr = meta.value()?.parse()?;
    } else if meta.input.peek(syn::token::Paren) {
        meta.parse_nested_meta(|inner| skip_value(&inner))?;
    }
    Ok(())
}
