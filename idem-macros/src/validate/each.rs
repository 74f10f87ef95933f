//! Checks of a handler run job by job over a batch (`each = "job"`): the parameter `each`
//! names is one job, taken by shared reference, which the caller passes as a slice of jobs.

use syn::{FnArg, Ident, ItemFn, LitStr, Pat, Type, TypeReference};

use crate::diag::Diag;
use crate::signature::Handler;

/// The parameter that holds one job.
pub(crate) struct EachParam {
    /// Its name, as `each` gives it: the body's job, and the caller's slice of jobs.
    pub(crate) ident: Ident,
    /// Its type as written (`&Job`), to bind each job inside the body.
    pub(crate) ty: TypeReference,
}

/// Finds the parameter `each` names; reports each mistake once.
pub(crate) fn each(
    item: &ItemFn,
    lit: &LitStr,
    name: &Ident,
    handler: &Handler,
    diag: &mut Diag,
) -> Option<EachParam> {
    let param = item.sig.inputs.iter().find_map(|arg| match arg {
        FnArg::Typed(pt) => match &*pt.pat {
            Pat::Ident(pi) if pi.ident == *name => Some(pt),
            _ => None,
        },
        FnArg::Receiver(_) => None,
    });
    let Some(param) = param else {
        let names: Vec<String> = handler.params.iter().map(|p| format!("`{p}`")).collect();
        diag.error(
            lit,
            format!(
                "`each` names `{name}`, which is not a parameter: add `{name}: &Job`, one job of \
                 the batch (parameters: {})",
                if names.is_empty() {
                    "none besides the transaction".to_owned()
                } else {
                    names.join(", ")
                }
            ),
        );
        return None;
    };
    match &*param.ty {
        Type::Reference(r) if r.mutability.is_none() && !matches!(*r.elem, Type::Slice(_)) => {
            Some(EachParam {
                ident: name.clone(),
                ty: r.clone(),
            })
        }
        _ => {
            diag.error(
                &param.ty,
                format!(
                    "the job `{name}` must be one job by shared reference, like `{name}: &Job`: \
                     the caller passes the batch as `&[Job]`, and the body runs once per job"
                ),
            );
            None
        }
    }
}
