//! A typed view of the handler's signature: which parameter is the transaction (and which
//! database it runs on) or the lease, what the body returns, and which names the parameters
//! bind.

use proc_macro2::{Span, TokenStream};
use syn::{FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, ReturnType, Type};

use crate::diag::Diag;
use crate::mode::Mode;

#[derive(Clone)]
pub(crate) struct Handler {
    /// Index in `sig.inputs` of the parameter that the store replaces: the transaction, or
    /// the lease.
    pub(crate) index: usize,
    /// Its pattern, bound inside the body to the claim's transaction or lease.
    pub(crate) pat: Pat,
    pub(crate) kind: Kind,
    /// The declared return type, `Result<T, E>` or an alias of it.
    pub(crate) ret: Returned,
    /// `T` of that `Result` where the type names it (`Result<T, E>`, `anyhow::Result<T>`);
    /// `None` for other aliases (`Fallible<T>`), whose `T` and `E` the expansion reads through
    /// `__private::HandlerResult`.
    pub(crate) ok: Option<Type>,
    /// Names bound by the other parameters, `self` included.
    pub(crate) params: Vec<Ident>,
}

#[derive(Clone)]
pub(crate) enum Kind {
    Transaction {
        /// The transaction's type with every lifetime elided, to annotate its binding.
        ty: Box<Type>,
        db: Db,
    },
    /// `&Lease`: names no database, so the expansion adds a type parameter for it.
    Lease {
        /// The parameter's type as written (`&Lease`, `&idem::Lease`), lifetimes elided, to
        /// annotate its binding inside the body: the user's own path, so that their
        /// `use idem::Lease` stays used.
        ty: Box<Type>,
    },
}

/// The declared return type, and how the body's value reaches the runtime's `Result<T, E>`.
#[derive(Clone)]
pub(crate) struct Returned {
    pub(crate) ty: Type,
    /// `Some(__private)` for an alias that does not name `T`: the body's value goes through
    /// `__private::Returned(..).into_result()`.
    pub(crate) through: Option<TokenStream>,
}

impl quote::ToTokens for Returned {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        self.ty.to_tokens(tokens);
    }
}

/// The database of the transaction parameter.
#[derive(Clone)]
pub(crate) enum Db {
    /// `DB` of `&mut Transaction<'_, DB>`, as the user wrote it.
    Written(Box<Type>),
    /// The database of sqlx's alias (`PgTransaction<'_>`): the name of its `__private::db`
    /// re-export, and the alias's span.
    Sqlx(&'static str, Span),
}

/// sqlx's transaction aliases and the database each names.
const SQLX_ALIASES: [(&str, &str); 3] = [
    ("PgTransaction", "Postgres"),
    ("SqliteTransaction", "Sqlite"),
    ("MySqlTransaction", "MySql"),
];

/// A transaction parameter that names no database (`&mut Transaction`): as written it does not
/// compile either, so the function goes back with a stand-in database in its type, and the
/// attribute's error is the only one.
pub(crate) struct Repair {
    pub(crate) index: usize,
    pub(crate) ty: Type,
}

const TX_HINT: &str =
    "`tx: &mut sqlx::Transaction<'_, Postgres>` (or `&mut idem::Tx<'_, Postgres>`)";

pub(crate) fn analyse(
    item: &ItemFn,
    mode: Mode,
    diag: &mut Diag,
    repairs: &mut Vec<Repair>,
) -> Option<Handler> {
    let sig = &item.sig;
    let mut ok = true;
    if sig.asyncness.is_none() {
        diag.error(
            sig.fn_token,
            "`#[idempotent]` needs an `async fn`: the claim and the commit await the database",
        );
        ok = false;
    }

    let mut special: Option<(usize, Pat, Kind)> = None;
    // A parameter of the other mode was reported: the missing one of this mode is the same
    // mistake.
    let mut misplaced = false;
    let mut params = Vec::new();
    for (i, arg) in sig.inputs.iter().enumerate() {
        let pt = match arg {
            FnArg::Receiver(r) => {
                params.push(Ident::new("self", r.self_token.span));
                continue;
            }
            FnArg::Typed(pt) => pt,
        };
        let tx = transaction_db(&pt.ty);
        if mode == Mode::Lease && !matches!(tx, TxParam::No) {
            diag.error(
                pt,
                "lease mode runs the body outside any transaction: remove the transaction \
                 parameter, or drop `lease` for transaction mode",
            );
            ok = false;
            misplaced = true;
            continue;
        }
        if is_lease(&pt.ty) {
            if mode != Mode::Lease {
                diag.error(
                    &pt.ty,
                    "a `Lease` parameter needs `lease = \"30s\"` on the attribute: lease mode \
                     claims the key for that long and runs the body outside any transaction; \
                     or take a transaction instead for transaction mode",
                );
                ok = false;
                misplaced = true;
            } else if special.is_some() {
                diag.error(
                    pt,
                    "only one `Lease` parameter is allowed: it is this delivery's one hold on \
                     the key; remove this one",
                );
                ok = false;
            } else {
                let kind = Kind::Lease {
                    ty: Box::new(elide_lifetimes(&pt.ty)),
                };
                special = Some((i, (*pt.pat).clone(), kind));
            }
            continue;
        }
        match tx {
            TxParam::No => bound_names(&pt.pat, &mut params),
            TxParam::NotMut => {
                diag.error(
                    &pt.ty,
                    format!("the transaction must be taken by `&mut`: {TX_HINT}"),
                );
                ok = false;
            }
            TxParam::Yes(db) => {
                if special.is_some() {
                    diag.error(
                        pt,
                        "only one transaction parameter is allowed: idem opens one transaction \
                         for the marker and the effect; remove this one",
                    );
                    ok = false;
                } else {
                    let kind = Kind::Transaction {
                        ty: Box::new(elide_lifetimes(&pt.ty)),
                        db,
                    };
                    special = Some((i, (*pt.pat).clone(), kind));
                }
            }
        }
    }
    if special.is_none() && ok && !misplaced && mode != Mode::Lease {
        ok = !mistaken_transaction(sig, diag, repairs);
    }
    if special.is_none() && ok && !misplaced {
        let message = match mode {
            Mode::Transaction | Mode::Group | Mode::Batch | Mode::Each => format!(
                "`#[idempotent]` needs a transaction parameter to run the effect on, so the \
                 marker and the effect commit together: add {TX_HINT}"
            ),
            Mode::Lease => "lease mode needs the lease as a parameter, to give its key and \
                            remaining time to the outside call: add `lease: &idem::Lease`"
                .to_owned(),
        };
        diag.error_at(sig.paren_token.span.join(), message);
    }

    let ret = match &sig.output {
        ReturnType::Type(_, ty) => match result_ok(ty) {
            Some(ok_ty) => Some(((**ty).clone(), ok_ty)),
            None => {
                // Anything else is not a `Result`: `Option<T>`, `()`, `impl Future`.
                let why = match mode {
                    Mode::Transaction | Mode::Group | Mode::Batch | Mode::Each => {
                        "an `Err` rolls the effect back"
                    }
                    Mode::Lease => "an `Err` releases the key",
                };
                diag.error(
                    ty,
                    format!(
                        "`#[idempotent]` handlers return `Result<T, E>`: {why} and lets the job \
                         be redelivered"
                    ),
                );
                None
            }
        },
        ReturnType::Default => {
            diag.error_at(
                sig.paren_token.span.close(),
                "`#[idempotent]` handlers return `Result<T, E>`: add `-> Result<(), YourError>`",
            );
            None
        }
    };

    let (index, pat, kind) = special?;
    let (ret, ok_ty) = ret?;
    ok.then_some(Handler {
        index,
        pat,
        kind,
        ret: Returned {
            ty: ret,
            through: None,
        },
        ok: ok_ty,
        params,
    })
}

/// `&Lease`, `&idem::Lease`, `&::idem::Lease`: any path ending in `Lease` behind a shared
/// reference (the body only reads it; `&mut` is left alone as some other type).
pub(crate) fn is_lease(ty: &Type) -> bool {
    let Type::Reference(r) = ty else { return false };
    if r.mutability.is_some() {
        return false;
    }
    let Type::Path(p) = &*r.elem else {
        return false;
    };
    p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "Lease")
}

enum TxParam {
    No,
    NotMut,
    Yes(Db),
}

/// The type behind `&mut` (or `&`, or none), whether it was `&mut`, and its last path segment.
fn last_segment(ty: &Type) -> Option<(bool, &syn::PathSegment)> {
    let (inner, mutable) = match ty {
        Type::Reference(r) => (&*r.elem, r.mutability.is_some()),
        other => (other, false),
    };
    let Type::Path(p) = inner else { return None };
    if p.qself.is_some() {
        return None;
    }
    Some((mutable, p.path.segments.last()?))
}

/// The generic arguments of a segment: `<'_, Postgres>` gives `['_, Postgres]`.
fn arguments(segment: &syn::PathSegment) -> Vec<&GenericArgument> {
    match &segment.arguments {
        PathArguments::AngleBracketed(args) => args.args.iter().collect(),
        _ => Vec::new(),
    }
}

/// Recognises the transaction by its shape as written: `Transaction<'_, DB>` or `Tx<'_, DB>`
/// (a lifetime, then the database), or one of sqlx's aliases `PgTransaction<'_>`,
/// `SqliteTransaction<'_>`, `MySqlTransaction<'_>`, under any path. A type of the user's own
/// named `Tx` or `Transaction` with other arguments is some other parameter.
fn transaction_db(ty: &Type) -> TxParam {
    let Some((mutable, last)) = last_segment(ty) else {
        return TxParam::No;
    };
    let db = match arguments(last)[..] {
        [GenericArgument::Lifetime(_), GenericArgument::Type(db)]
            if last.ident == "Transaction" || last.ident == "Tx" =>
        {
            Db::Written(Box::new(db.clone()))
        }
        [GenericArgument::Lifetime(_)] => {
            match SQLX_ALIASES.iter().find(|(alias, _)| last.ident == alias) {
                Some((_, db)) => Db::Sqlx(db, last.ident.span()),
                None => return TxParam::No,
            }
        }
        _ => return TxParam::No,
    };
    if mutable {
        TxParam::Yes(db)
    } else {
        TxParam::NotMut
    }
}

/// With no transaction parameter, a `&mut` parameter that was meant to be it: reports it (and
/// returns true), so that the mistake is named on its type rather than as a missing parameter.
///
/// - `&mut Transaction` or `&mut Tx` without arguments: the database (and lifetime) are
///   missing (a type of the user's own by that name, with no transaction beside it, is
///   reported the same way: either way the transaction is missing).
/// - `&mut PgTx<'_>`, a name ending in `Tx` or `Transaction` with only a lifetime: an alias of
///   the user's own, which hides the database from the attribute.
fn mistaken_transaction(sig: &syn::Signature, diag: &mut Diag, repairs: &mut Vec<Repair>) -> bool {
    for (index, arg) in sig.inputs.iter().enumerate() {
        let FnArg::Typed(pt) = arg else { continue };
        let Some((true, last)) = last_segment(&pt.ty) else {
            continue;
        };
        let name = last.ident.to_string();
        let args = arguments(last);
        if (name == "Transaction" || name == "Tx") && args.is_empty() {
            diag.error(
                &pt.ty,
                format!("name the database in the transaction type: {TX_HINT}"),
            );
            repairs.push(Repair {
                index,
                ty: (*pt.ty).clone(),
            });
            return true;
        }
        if (name.ends_with("Tx") || name.ends_with("Transaction"))
            && matches!(args[..], [GenericArgument::Lifetime(_)])
        {
            diag.error(
                &pt.ty,
                format!(
                    "the transaction's type must name its database where `#[idempotent]` can \
                     read it, and the alias `{name}` hides it: write {TX_HINT}, with the \
                     database of `{name}`"
                ),
            );
            return true;
        }
    }
    false
}

/// `&mut Transaction` -> `&mut Transaction<'_, DB>`.
pub(crate) fn with_database(ty: &Type, db: TokenStream) -> Type {
    let mut ty = ty.clone();
    if let Type::Reference(r) = &mut ty
        && let Type::Path(p) = &mut *r.elem
        && let Some(last) = p.path.segments.last_mut()
    {
        last.arguments = PathArguments::AngleBracketed(syn::parse_quote!(<'_, #db>));
    }
    ty
}

/// `&'a mut Transaction<'a, DB>` -> `&mut Transaction<'_, DB>`, `&'a Lease` -> `&Lease`: the
/// claim's transaction (or lease) is a local of the expansion, borrowed locally, so named
/// lifetimes of the signature cannot apply.
fn elide_lifetimes(ty: &Type) -> Type {
    let mut ty = ty.clone();
    if let Type::Reference(r) = &mut ty {
        r.lifetime = None;
        if let Type::Path(p) = &mut *r.elem
            && let Some(last) = p.path.segments.last_mut()
            && let PathArguments::AngleBracketed(args) = &mut last.arguments
        {
            for arg in &mut args.args {
                if let GenericArgument::Lifetime(l) = arg {
                    *l = syn::Lifetime::new("'_", l.span());
                }
            }
        }
    }
    ty
}

/// Types that are certainly not a `Result`, whatever the user's module holds.
const NOT_RESULT: [&str; 22] = [
    "Option", "Vec", "String", "Box", "Poll", "Pin", "Cow", "bool", "char", "str", "u8", "u16",
    "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128", "isize",
];

/// `Some(Some(T))` for `Result<T, E>` or an alias whose name ends in `Result` and whose first
/// parameter is `T` (`anyhow::Result<T>`, `io::Result<T>`, `BoxResult<T>`); `Some(None)` for
/// any other path, which may be an alias of `Result` (`Fallible<T>`) and is checked by rustc
/// through `__private::HandlerResult`; `None` for what cannot be a `Result`.
fn result_ok(ty: &Type) -> Option<Option<Type>> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    let name = last.ident.to_string();
    if p.qself.is_none()
        && name.ends_with("Result")
        && let Some(GenericArgument::Type(t)) = arguments(last).first()
    {
        return Some(Some((*t).clone()));
    }
    if p.qself.is_none() && NOT_RESULT.contains(&name.as_str()) {
        return None;
    }
    Some(None)
}

/// Replaces `T` in the return type by `outcome` (keeping the user's own `Result` path).
pub(crate) fn with_ok(ret: &Type, outcome: Type) -> Type {
    let mut ret = ret.clone();
    if let Type::Path(p) = &mut ret
        && let Some(last) = p.path.segments.last_mut()
        && let PathArguments::AngleBracketed(args) = &mut last.arguments
        && let Some(GenericArgument::Type(t)) = args.args.first_mut()
    {
        *t = outcome;
    }
    ret
}

pub(crate) fn bound_names(pat: &Pat, out: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(p) => {
            out.push(p.ident.clone());
            if let Some((_, sub)) = &p.subpat {
                bound_names(sub, out);
            }
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| bound_names(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| bound_names(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| bound_names(&f.pat, out)),
        Pat::Reference(r) => bound_names(&r.pat, out),
        Pat::Paren(p) => bound_names(&p.pat, out),
        Pat::Slice(s) => s.elems.iter().for_each(|p| bound_names(p, out)),
        Pat::Type(t) => bound_names(&t.pat, out),
        _ => {}
    }
}
