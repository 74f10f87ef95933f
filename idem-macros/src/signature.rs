//! A typed view of the handler's signature: which parameter is the transaction (and which
//! database it runs on) or the lease, what the body returns, and which names the parameters
//! bind.

use syn::{FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, ReturnType, Type};

use crate::diag::Diag;
use crate::validate::Mode;

pub(crate) struct Handler {
    /// Index in `sig.inputs` of the parameter that the store replaces: the transaction, or
    /// the lease.
    pub(crate) index: usize,
    /// Its pattern, bound inside the body to the claim's transaction or lease.
    pub(crate) pat: Pat,
    pub(crate) kind: Kind,
    /// The declared return type, `Result<T, E>`.
    pub(crate) ret: Type,
    /// `T` of that `Result`.
    pub(crate) ok: Type,
    /// Names bound by the other parameters, `self` included.
    pub(crate) params: Vec<Ident>,
}

pub(crate) enum Kind {
    Transaction {
        /// The transaction's type with every lifetime elided, to annotate its binding.
        ty: Box<Type>,
        /// `DB` of `&mut Transaction<'_, DB>`.
        db: Box<Type>,
    },
    /// `&Lease`: names no database, so the expansion adds a type parameter for it.
    Lease,
}

const TX_HINT: &str =
    "`tx: &mut sqlx::Transaction<'_, Postgres>` (or `&mut idem::Tx<'_, Postgres>`)";

pub(crate) fn analyse(item: &ItemFn, mode: Mode, diag: &mut Diag) -> Option<Handler> {
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
            if mode == Mode::Transaction {
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
                special = Some((i, (*pt.pat).clone(), Kind::Lease));
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
            TxParam::NoDb => {
                diag.error(
                    &pt.ty,
                    format!("name the database in the transaction type: {TX_HINT}"),
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
    if special.is_none() && ok && !misplaced {
        let message = match mode {
            Mode::Transaction => format!(
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
                let why = match mode {
                    Mode::Transaction => "an `Err` rolls the effect back",
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
        ret,
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
    NoDb,
    Yes(Box<Type>),
}

/// Recognises `&mut Transaction<'_, DB>` and `&mut Tx<'_, DB>` by the last path segment.
fn transaction_db(ty: &Type) -> TxParam {
    let (inner, mutable) = match ty {
        Type::Reference(r) => (&*r.elem, r.mutability.is_some()),
        other => (other, false),
    };
    let Type::Path(p) = inner else {
        return TxParam::No;
    };
    let Some(last) = p.path.segments.last() else {
        return TxParam::No;
    };
    if last.ident != "Transaction" && last.ident != "Tx" {
        return TxParam::No;
    }
    if !mutable {
        return TxParam::NotMut;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return TxParam::NoDb;
    };
    match args.args.iter().rev().find_map(|a| match a {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    }) {
        Some(db) => TxParam::Yes(Box::new(db)),
        None => TxParam::NoDb,
    }
}

/// `&'a mut Transaction<'a, DB>` -> `&mut Transaction<'_, DB>`: the claim's transaction is
/// `'static` and the borrow is local, so named lifetimes of the signature cannot apply.
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

/// `T` of `Result<T, E>` or of an alias whose name ends in `Result` and whose first
/// parameter is `T` (`anyhow::Result<T>`, `io::Result<T>`, `BoxResult<T>`).
fn result_ok(ty: &Type) -> Option<Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if !last.ident.to_string().ends_with("Result") {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first()? {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    }
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
