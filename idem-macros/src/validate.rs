//! Checks of meaning, after parsing: which mode the handler runs in, were `key` and `scope`
//! given, and does the key read the handler's own parameters?

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt;
use syn::{Expr, FnArg, Ident, Signature};

use crate::args::{Args, Length};
use crate::diag::Diag;
use crate::duration;
use crate::mode::Mode;
use crate::signature::{self, Handler};

mod batch;
mod each;
mod steps;
pub(crate) use batch::{BatchParam, batch};
pub(crate) use each::{EachParam, each};
pub(crate) use steps::steps;

/// The mode the arguments select (`each`, `group`, `batch`, `lease`, else transaction mode).
/// Reports the arguments that do not fit it.
pub(crate) fn mode(args: &Args, sig: &Signature, diag: &mut Diag) -> Mode {
    // An unknown argument next to a `&Lease` parameter is most likely a misspelt `lease`:
    // assume lease mode, so that the misspelling is the only error.
    let lease_param = || {
        sig.inputs.iter().any(|arg| match arg {
            FnArg::Typed(pt) => signature::is_lease(&pt.ty),
            FnArg::Receiver(_) => false,
        })
    };
    let lease_mode = args.gave("lease") || (args.unknown && lease_param());
    if let (Some(span), false) = (args.span_of("lane"), args.gave("group")) {
        diag.error_at(
            span,
            "`lane` picks the lane of a group commit's call, and this handler has no `group`: \
             add `group`, or remove `lane`",
        );
    }
    if args.gave("each") {
        // One commit for the batch, each job behind its own savepoint: the same reasons as
        // `batch`'s, and a group of batches would be a batch.
        for (arg, why) in [
            (
                "lease",
                "a batch runs in transaction mode, its effects committed with the markers",
            ),
            (
                "timeout",
                "`timeout` bounds a lease-mode body, and a batch runs in transaction mode",
            ),
            (
                "replay",
                "a batch claims its keys without reading their stored values back",
            ),
            (
                "fingerprint",
                "a batch claims its keys without reading their markers back",
            ),
            (
                "batch",
                "`batch` runs the body once for the whole batch, `each` once per job",
            ),
            (
                "link",
                "the batch's jobs come from messages of their own, each with its traceparent",
            ),
            (
                "group",
                "a batch is one transaction already, committed once",
            ),
        ] {
            if let Some(span) = args.span_of(arg) {
                diag.error_at(
                    span,
                    format!(
                        "`{arg}` does not go with `each`: {why}; remove `{arg}`, or `each` \
                         for a handler of one job"
                    ),
                );
            }
        }
        return Mode::Each;
    }
    if let Some(span) = args.span_of("group") {
        // A group shares one transaction among its members: each member's claim, body and
        // marker run in that transaction.
        let why = if lease_mode {
            Some(
                "a group shares one database transaction among its calls, and a lease-mode body \
                 runs outside any transaction (its effect is elsewhere); remove `group`, or \
                 `lease` for transaction mode",
            )
        } else if args.gave("batch") {
            Some("a batch is one transaction already, committed once; remove `group` or `batch`")
        } else {
            None
        };
        if let Some(why) = why {
            diag.error_at(
                span,
                format!(
                    "`group` does not go with `{}`: {why}",
                    match lease_mode {
                        true => "lease",
                        false => "batch",
                    }
                ),
            );
            return match lease_mode {
                true => Mode::Lease,
                false => Mode::Batch,
            };
        }
        if let Some(span) = args.span_of("isolation") {
            diag.error_at(
                span,
                "`isolation` does not go with `group`: the group's transaction is begun once for \
                 all its calls, at the database's default level; remove `isolation`, or \
                 `group`",
            );
        }
        return Mode::Group;
    }
    if args.gave("batch") {
        // One batch commits once: a lease per job, or one value replayed to each of them,
        // would need a statement per job, which is what batches are for avoiding.
        for (arg, why) in [
            (
                "lease",
                "a batch runs in transaction mode, its effects committed with the markers",
            ),
            (
                "timeout",
                "`timeout` bounds a lease-mode body, and a batch runs in transaction mode",
            ),
            (
                "replay",
                "a batch's value belongs to the whole batch, not to one job to replay",
            ),
            (
                "fingerprint",
                "a batch claims its keys without reading their markers back",
            ),
            (
                "link",
                "the batch's jobs come from messages of their own, each with its traceparent",
            ),
        ] {
            if let Some(span) = args.span_of(arg) {
                diag.error_at(
                    span,
                    format!(
                        "`{arg}` does not go with `batch`: {why}; remove `{arg}`, or `batch` \
                         for a handler of one job"
                    ),
                );
            }
        }
        return Mode::Batch;
    }
    if !lease_mode {
        if let Some(span) = args.span_of("timeout") {
            diag.error_at(
                span,
                "`timeout` bounds a lease-mode body and needs `lease`: add `lease = \"30s\"` \
                 (longer than the timeout), or remove `timeout`",
            );
        }
        return Mode::Transaction;
    }
    if let Some(span) = args.span_of("wait") {
        diag.error_at(
            span,
            "`wait` is a transaction-mode setting: in lease mode a delivery that finds a live \
             lease returns `InProgress` at once, without waiting; remove `wait`, or drop `lease` \
             for transaction mode",
        );
    }
    if let Some(span) = args.span_of("isolation") {
        diag.error_at(
            span,
            "`isolation` is a transaction-mode setting: lease mode runs the body outside any \
             transaction; remove `isolation`, or drop `lease` for transaction mode",
        );
    }
    if let (Some(Length::Literal(lease_lit, lease)), Some(Length::Literal(timeout_lit, timeout))) =
        (&args.lease, &args.timeout)
        && timeout >= lease
    {
        diag.error(
            timeout_lit,
            format!(
                "`timeout` must be shorter than `lease = \"{}\"`: the lease has to outlast the \
                 body, or another delivery may take the key over while this one still runs; \
                 leave `timeout` out for \"{}\" (the lease minus a fifth of it, at most 5s)",
                lease_lit.value(),
                duration::show(duration::default_timeout(*lease)),
            ),
        );
    }
    Mode::Lease
}

/// The key must be computed from the job, never from the transaction or the lease (which
/// exist only once the key is claimed) or from names the handler does not have: report each
/// such root on its own token.
pub(crate) fn key(expr: &Expr, handler: &Handler, diag: &mut Diag) {
    reads_parameters("key", "the job's id", "job.id", expr, handler, diag);
}

/// The fingerprint is the job's payload, read like the key from the handler's parameters.
pub(crate) fn fingerprint(expr: &Expr, handler: &Handler, diag: &mut Diag) {
    reads_parameters(
        "fingerprint",
        "the job's payload",
        "job.id",
        expr,
        handler,
        diag,
    );
}

/// The link is the message's traceparent, read like the key from the handler's parameters:
/// the claim's span links to it when the claim starts, before the transaction or the lease
/// exist.
pub(crate) fn link(expr: &Expr, handler: &Handler, diag: &mut Diag) {
    let read = "the message's traceparent";
    reads_parameters("link", read, "msg.traceparent", expr, handler, diag);
}

pub(crate) fn reads_parameters(
    arg: &str,
    read: &str,
    like: &str,
    expr: &Expr,
    handler: &Handler,
    diag: &mut Diag,
) {
    let mut found = Vec::new();
    roots(expr, &mut found);
    let mut special = Vec::new();
    signature::bound_names(&handler.pat, &mut special);
    let what = match handler.kind {
        signature::Kind::Transaction { .. } => "transaction",
        signature::Kind::Lease { .. } => "lease",
    };
    for root in found {
        if special.contains(root) {
            diag.error(
                root,
                format!(
                    "the {arg} cannot come from the {what} `{root}`: read {read} from \
                     another parameter, like \"{like}\""
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
                format!("`{arg}` refers to `{root}`, which is not a parameter ({list})"),
            );
        }
    }
}

/// The variables an expression starts from: `job` in `job.id`, both in `(a.x, b.y)`.
/// Anything more elaborate (calls, macros, blocks) is left to rustc.
pub(crate) fn roots<'e>(expr: &'e Expr, out: &mut Vec<&'e Ident>) {
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

/// `key` and `scope` have no default. A scope derived from the function's name made every
/// `send` of the crate share markers (and skip each other's jobs), and one derived from the
/// module path would change, and run every job again, when the code moves: a handler names its
/// scope. Both are reported as one error when both are missing; neither when an unknown argument
/// may be one of them misspelt.
pub(crate) fn required(args: &Args, written: &TokenStream, sig: &Signature, diag: &mut Diag) {
    if args.unknown {
        return;
    }
    let name = sig.ident.unraw();
    let keep = format!(
        "Two handlers share markers only if they name the same scope; keep it when the code \
         moves. A handler that ran before without `scope` used its function name: write \
         `scope = \"{name}\"` to keep its markers"
    );
    match (args.gave("key"), args.gave("scope")) {
        (true, true) => {}
        (false, true) => diag.error_at(
            Span::call_site(),
            "`#[idempotent]` needs `key`, the expression that reads the job's stable id: \
             `#[idempotent(key = \"job.id\")]`",
        ),
        (true, false) => diag.error(
            written,
            format!(
                "`#[idempotent]` needs `scope`, the stable name of this handler's markers: \
                 `#[idempotent(key = \"job.id\", scope = \"billing.send_invoice\")]`. {keep}"
            ),
        ),
        (false, false) => diag.error_at(
            Span::call_site(),
            format!(
                "`#[idempotent]` needs `key`, the expression that reads the job's stable id, \
                 and `scope`, the stable name of this handler's markers: \
                 `#[idempotent(key = \"job.id\", scope = \"billing.send_invoice\")]`. {keep}"
            ),
        ),
    }
}
