//! The handler's outbox parameter (`outbox: &mut idem::Outbox`): found by its type, removed
//! from the generated signature, bound inside the body to the claim's outbox.

use syn::{FnArg, Pat, Signature, Type};

use crate::diag::Diag;
use crate::mode::Mode;

/// The outbox parameter: where it is, its pattern and its type as written.
#[derive(Clone)]
pub(crate) struct OutboxParam {
    pub(crate) index: usize,
    pub(crate) pat: Pat,
    pub(crate) ty: Type,
}

fn is_outbox(ty: &Type) -> bool {
    let Type::Reference(r) = ty else { return false };
    let Type::Path(p) = &*r.elem else {
        return false;
    };
    r.mutability.is_some()
        && p.qself.is_none()
        && p.path.segments.last().is_some_and(|s| s.ident == "Outbox")
}

/// The outbox parameter, if the handler takes one; reports one where the mode has no
/// transaction to write it in (lease mode), or where a batch would need one per job.
pub(crate) fn find(sig: &Signature, mode: Mode, diag: &mut Diag) -> Option<OutboxParam> {
    let (index, pt) = sig
        .inputs
        .iter()
        .enumerate()
        .find_map(|(i, arg)| match arg {
            FnArg::Typed(pt) if is_outbox(&pt.ty) => Some((i, pt)),
            _ => None,
        })?;
    let refused = match mode {
        Mode::Transaction => None,
        Mode::Lease => Some(
            "the outbox writes its messages in the claim's transaction, and lease mode has \
             none: take a transaction (transaction mode), or send from the outside call",
        ),
        Mode::Batch => Some(
            "a batch handler has no outbox yet: its messages would need one job's key each; \
             send from a single-job handler",
        ),
    };
    if let Some(message) = refused {
        diag.error(&pt.ty, message);
        return None;
    }
    Some(OutboxParam {
        index,
        pat: (*pt.pat).clone(),
        ty: elided(&pt.ty),
    })
}

/// `&'a mut Outbox` as `&mut Outbox`, to annotate the binding inside the body.
fn elided(ty: &Type) -> Type {
    let mut ty = ty.clone();
    if let Type::Reference(r) = &mut ty {
        r.lifetime = None;
    }
    ty
}
