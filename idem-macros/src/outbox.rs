//! The handler's outbox parameter (`outbox: &mut idem::Outbox`, a batch's `&mut
//! idem::BatchOutbox`): found by its type, removed from the generated signature, bound inside
//! the body to the claim's outbox.

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

/// Which outbox a parameter's type names: `&mut Outbox` (one job's) or `&mut BatchOutbox` (a
/// batch's), by the last segment of its path.
fn outbox_kind(ty: &Type) -> Option<Kind> {
    let Type::Reference(r) = ty else { return None };
    let Type::Path(p) = &*r.elem else {
        return None;
    };
    if r.mutability.is_none() || p.qself.is_some() {
        return None;
    }
    match p.path.segments.last()?.ident.to_string().as_str() {
        "Outbox" => Some(Kind::Job),
        "BatchOutbox" => Some(Kind::Batch),
        _ => None,
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Job,
    Batch,
}

/// The outbox parameter, if the handler takes one; reports one whose kind is another mode's (a
/// batch's outbox names the job of each message, one job's does not). A lease handler's
/// messages are written with the statement that completes its lease.
pub(crate) fn find(sig: &Signature, mode: Mode, diag: &mut Diag) -> Option<OutboxParam> {
    let (index, pt, kind) = sig
        .inputs
        .iter()
        .enumerate()
        .find_map(|(i, arg)| match arg {
            FnArg::Typed(pt) => outbox_kind(&pt.ty).map(|kind| (i, pt, kind)),
            FnArg::Receiver(_) => None,
        })?;
    let refused = match (mode, kind) {
        (Mode::Transaction | Mode::Group | Mode::Each | Mode::Lease, Kind::Job)
        | (Mode::Batch, Kind::Batch) => None,
        (Mode::Lease, Kind::Batch) => Some(
            "`BatchOutbox` is a batch handler's outbox: a lease handler takes `outbox: &mut \
             idem::Outbox`, whose messages are written as its lease completes",
        ),
        (Mode::Batch, Kind::Job) => Some(
            "a batch handler's outbox names the job of each message: take `outbox: &mut \
             idem::BatchOutbox` and send with `outbox.send(&job_key, destination, &payload)`",
        ),
        (Mode::Transaction | Mode::Group | Mode::Each, Kind::Batch) => Some(
            "`BatchOutbox` is a batch handler's outbox: a handler of one job takes `outbox: \
             &mut idem::Outbox`",
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
