//! Checks of a batch handler: the parameter `batch` names is a slice of jobs, and the key
//! reads one job of it, through a name of its own for the element.

use syn::{FnArg, Ident, ItemFn, LitStr, Pat, Type};

use crate::diag::Diag;
use crate::signature::{self, Handler};

/// The batch parameter and the name the key gives one of its jobs.
pub(crate) struct BatchParam {
    /// The parameter, as named by `batch`.
    pub(crate) ident: Ident,
    /// `T` of its `&[T]`.
    pub(crate) elem: Type,
    /// Its type as written, for errors about the jobs (they must be `Clone`).
    pub(crate) ty: Type,
    /// The key's root that is no parameter: one job of the batch (`job` in `"job.id"`).
    pub(crate) element: Ident,
}

/// Finds the parameter `batch` names and the key's element; reports each mistake once.
pub(crate) fn batch(
    item: &ItemFn,
    lit: &LitStr,
    name: &Ident,
    key: Option<&(LitStr, syn::Expr)>,
    handler: &Handler,
    diag: &mut Diag,
) -> Option<BatchParam> {
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
                "`batch` names `{name}`, which is not a parameter: add `{name}: &[Job]`, the \
                 jobs of the batch (parameters: {})",
                if names.is_empty() {
                    "none besides the transaction".to_owned()
                } else {
                    names.join(", ")
                }
            ),
        );
        return None;
    };
    let elem = match &*param.ty {
        Type::Reference(r) if r.mutability.is_none() => match &*r.elem {
            Type::Slice(slice) => Some((*slice.elem).clone()),
            _ => None,
        },
        _ => None,
    };
    let Some(elem) = elem else {
        diag.error(
            &param.ty,
            format!(
                "the batch `{name}` must be a slice of jobs, like `{name}: &[Job]`: the body \
                 gets the fresh ones in the same type"
            ),
        );
        return None;
    };
    let (key_lit, key) = key?;
    let element = element(key_lit, name, key, handler, diag)?;
    Some(BatchParam {
        ident: name.clone(),
        elem,
        ty: (*param.ty).clone(),
        element,
    })
}

/// The key's one root that is not a parameter: the name of one job of the batch.
fn element(
    key_lit: &LitStr,
    batch: &Ident,
    key: &syn::Expr,
    handler: &Handler,
    diag: &mut Diag,
) -> Option<Ident> {
    let mut found = Vec::new();
    super::roots(key, &mut found);
    let mut special = Vec::new();
    signature::bound_names(&handler.pat, &mut special);
    let mut element: Option<&Ident> = None;
    let mut ok = true;
    for root in found {
        if special.contains(root) {
            diag.error(
                root,
                format!(
                    "the key cannot come from the transaction `{root}`: read the job's id \
                     from one job of `{batch}`, like \"job.id\""
                ),
            );
            ok = false;
        } else if root == batch {
            diag.error(
                root,
                format!(
                    "the key reads one job, not the batch `{batch}`: give the job a name of \
                     its own, like \"job.id\" (`job` then stands for each job of `{batch}`)"
                ),
            );
            ok = false;
        } else if handler.params.contains(root) {
            // Another parameter (a tenant, say) may be part of every job's key.
        } else if let Some(first) = element {
            if first != root {
                diag.error(
                    root,
                    format!(
                        "the key reads one job of `{batch}`, named `{first}` here; `{root}` is \
                         neither that job nor a parameter"
                    ),
                );
                ok = false;
            }
        } else {
            element = Some(root);
        }
    }
    if ok && element.is_none() {
        diag.error(
            key_lit,
            format!(
                "the key of a batch handler reads each job: name one job of `{batch}` in it, \
                 like \"job.id\""
            ),
        );
    }
    element.filter(|_| ok).cloned()
}
