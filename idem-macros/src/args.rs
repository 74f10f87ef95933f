//! The attribute's arguments: `key`, `scope`, `lease`, `timeout`, `wait`, `isolation`,
//! `fingerprint`, `link`, `batch`, `each`, `crate`, each `= "..."`, and the flags `replay`
//! and `group`.

use proc_macro2::{Span, TokenStream};
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::{Expr, LitStr, Path};

use crate::diag::Diag;
use crate::duration;

#[derive(Default)]
pub(crate) struct Args {
    /// The literal (for spans) and the expression parsed from it.
    pub(crate) key: Option<(LitStr, Expr)>,
    pub(crate) scope: Option<LitStr>,
    pub(crate) lease: Option<Length>,
    pub(crate) timeout: Option<Length>,
    /// Milliseconds of `wait`.
    pub(crate) wait: Option<u64>,
    pub(crate) isolation: Option<Isolation>,
    /// `replay` was written.
    pub(crate) replay: bool,
    /// The literal (for spans) and the expression parsed from it.
    pub(crate) fingerprint: Option<(LitStr, Expr)>,
    /// The literal (for spans) and the expression parsed from it: the message's traceparent.
    pub(crate) link: Option<(LitStr, Expr)>,
    /// The literal (for spans) and the expression parsed from it: what picks a group's lane.
    pub(crate) lane: Option<(LitStr, Expr)>,
    pub(crate) krate: Option<Path>,
    /// The literal (for spans) and the parameter it names, which holds the batch of jobs.
    pub(crate) batch: Option<(LitStr, syn::Ident)>,
    /// The literal (for spans) and the parameter it names, which holds one job of a batch
    /// run job by job.
    pub(crate) each: Option<(LitStr, syn::Ident)>,
    /// Arguments written, even with a refused value: a refused `key` has had its error, so
    /// "missing key" would be a second one for the same mistake. With the span of the name, for
    /// errors about the argument as a whole (`wait` in lease mode).
    pub(crate) given: Vec<(&'static str, Span)>,
    /// An unknown argument was written: it may be the misspelt `key` or `scope`, whose absence
    /// is then not reported again.
    pub(crate) unknown: bool,
}

impl Args {
    pub(crate) fn gave(&self, name: &str) -> bool {
        self.span_of(name).is_some()
    }

    /// Where the argument's name was written.
    pub(crate) fn span_of(&self, name: &str) -> Option<Span> {
        self.given.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
    }
}

/// A `lease` or `timeout`: a literal checked here, or the path of a `Duration` const, checked by
/// a `const` assertion in the expansion.
pub(crate) enum Length {
    /// The literal (for spans) and its milliseconds.
    Literal(LitStr, u64),
    /// `lease = LEASE`.
    Const(Path),
}

#[derive(Clone, Copy)]
pub(crate) enum Isolation {
    RepeatableRead,
    Serializable,
}

const NAMES: [&str; 14] = [
    "key",
    "scope",
    "lease",
    "timeout",
    "wait",
    "isolation",
    "replay",
    "fingerprint",
    "link",
    "batch",
    "each",
    "group",
    "lane",
    "crate",
];

pub(crate) fn parse(tokens: TokenStream, diag: &mut Diag) -> Args {
    let mut args = Args::default();
    let parser = syn::meta::parser(|meta| {
        let written = meta
            .path
            .get_ident()
            .map(ToString::to_string)
            .unwrap_or_default();
        let Some(name) = NAMES.into_iter().find(|n| *n == written) else {
            args.unknown = true;
            let path = &meta.path;
            let shown = quote::quote!(#path).to_string().replace(' ', "");
            diag.error(&meta.path, unknown_message(&shown));
            return skip_value(&meta);
        };
        if name == "replay" || name == "group" {
            return flag(name, &meta, &mut args, diag);
        }
        let value = string_value(&meta, name, diag)?;
        if args.gave(name) {
            diag.error(&meta.path, format!("`{name}` is given twice; keep one"));
            return Ok(());
        }
        args.given
            .push((name, syn::spanned::Spanned::span(&meta.path)));
        let lit = match value {
            Some(Value::Str(lit)) => lit,
            Some(Value::Path(path)) => {
                if name == "lease" {
                    args.lease = Some(Length::Const(path));
                } else {
                    args.timeout = Some(Length::Const(path));
                }
                return Ok(());
            }
            None => return Ok(()),
        };
        match name {
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
            "fingerprint" => match lit.parse::<Expr>() {
                Ok(expr) => args.fingerprint = Some((lit, expr)),
                Err(e) => diag.error(
                    &lit,
                    format!(
                        "`fingerprint` must hold a Rust expression that reads the job's \
                         payload, like \"job.body\": {e}"
                    ),
                ),
            },
            "link" => match lit.parse::<Expr>() {
                Ok(expr) => args.link = Some((lit, expr)),
                Err(e) => diag.error(
                    &lit,
                    format!(
                        "`link` must hold a Rust expression that reads the message's W3C \
                         traceparent, like \"msg.traceparent\": {e}"
                    ),
                ),
            },
            "lane" => match lit.parse::<Expr>() {
                Ok(expr) => args.lane = Some((lit, expr)),
                Err(e) => diag.error(
                    &lit,
                    format!(
                        "`lane` must hold a Rust expression that reads what the body's rows are \
                         chosen by, like \"job.account\": {e}"
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
            "batch" => match lit.parse::<syn::Ident>() {
                Ok(ident) => args.batch = Some((lit, ident)),
                Err(_) => diag.error(
                    &lit,
                    "`batch` names the parameter that holds the jobs, like \"jobs\" for \
                     `jobs: &[Job]`",
                ),
            },
            "each" => match lit.parse::<syn::Ident>() {
                Ok(ident) => args.each = Some((lit, ident)),
                Err(_) => diag.error(
                    &lit,
                    "`each` names the parameter that holds one job of the batch, like \"job\" \
                     for `job: &Job`",
                ),
            },
            "wait" => args.wait = wait_value(&lit, diag),
            "lease" => args.lease = lease_value(&lit, diag).map(|ms| Length::Literal(lit, ms)),
            "timeout" => {
                args.timeout = timeout_value(&lit, diag).map(|ms| Length::Literal(lit, ms));
            }
            "isolation" => match lit.value().as_str() {
                "serializable" => args.isolation = Some(Isolation::Serializable),
                "repeatable read" => args.isolation = Some(Isolation::RepeatableRead),
                other => diag.error(
                    &lit,
                    format!(
                        "unknown isolation \"{other}\"; expected \"serializable\" or \
                         \"repeatable read\" (leave `isolation` out for the database's default)"
                    ),
                ),
            },
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

/// `replay` and `group` take no value: they are on or off.
fn flag(
    name: &'static str,
    meta: &ParseNestedMeta<'_>,
    args: &mut Args,
    diag: &mut Diag,
) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        diag.error(
            &meta.path,
            format!(
                "`{name}` is a flag: write `{name}`, without a value (leave it out to turn it off)"
            ),
        );
        return skip_value(meta);
    }
    if args.gave(name) {
        diag.error(&meta.path, format!("`{name}` is given twice; keep one"));
        return Ok(());
    }
    args.given
        .push((name, syn::spanned::Spanned::span(&meta.path)));
    // `group` is read from `given`: it selects a mode (`validate::mode`).
    if name == "replay" {
        args.replay = true;
    }
    Ok(())
}

/// The milliseconds of a duration argument, or `Err(TooLong)` for the caller to report with
/// the argument's bounds; a refused spelling is reported here.
fn duration_value(
    name: &str,
    lit: &LitStr,
    diag: &mut Diag,
) -> Option<Result<u64, duration::Refused>> {
    let parsed = duration::parse(&lit.value());
    if parsed == Err(duration::Refused::Form) {
        diag.error(
            lit,
            format!(
                "`{name}` must be a duration: {}; got \"{}\"",
                duration::FORMS,
                lit.value()
            ),
        );
        return None;
    }
    Some(parsed)
}

fn wait_value(lit: &LitStr, diag: &mut Diag) -> Option<u64> {
    match duration_value("wait", lit, diag)? {
        Ok(ms) => Some(ms),
        Err(_) => {
            diag.error(
                lit,
                format!(
                    "`wait = \"{}\"` is too long: a duration must fit in 64 bits of \
                     milliseconds (about 584 million years)",
                    lit.value()
                ),
            );
            None
        }
    }
}

/// A lease shorter than a second may run out before the claim's answer is back, and a longer
/// one than a day keeps the key from every other delivery for that long when the worker dies
/// (and overflows SQLite's date arithmetic long before `u64` does).
fn lease_value(lit: &LitStr, diag: &mut Diag) -> Option<u64> {
    match duration_value("lease", lit, diag)? {
        Ok(ms) if duration::lease_in_bounds(ms) => Some(ms),
        _ => {
            diag.error(
                lit,
                format!(
                    "`lease = \"{}\"` is out of bounds: {}",
                    lit.value(),
                    duration::LEASE_BOUNDS
                ),
            );
            None
        }
    }
}

/// A timeout of zero cuts every body short; one that does not fit in `u64` milliseconds is
/// longer than any lease. Shorter than the lease is checked with the mode.
fn timeout_value(lit: &LitStr, diag: &mut Diag) -> Option<u64> {
    match duration_value("timeout", lit, diag)? {
        Ok(ms) if ms > 0 => Some(ms),
        _ => {
            diag.error(
                lit,
                format!(
                    "`timeout = \"{}\"` is out of bounds: a timeout must be longer than zero \
                     and shorter than the lease; leave `timeout` out for the lease minus a fifth \
                     of it, at most 5s",
                    lit.value()
                ),
            );
            None
        }
    }
}

/// Names the nearest known argument when the written one is plausibly a typo of it, and all
/// of them otherwise: a wrong guess would send the reader after the wrong fix.
fn unknown_message(written: &str) -> String {
    let nearest = NAMES
        .into_iter()
        .map(|n| (edit_distance(&written.to_lowercase(), n), n))
        .min_by_key(|(d, _)| *d);
    match nearest {
        Some((d, name)) if d <= name.len().div_ceil(3) => {
            format!("unknown argument `{written}`; did you mean `{name}`?")
        }
        _ => format!(
            "unknown argument `{written}`; expected `key`, `scope`, `lease`, `timeout`, `wait`, \
             `isolation`, `replay`, `fingerprint` or `crate`"
        ),
    }
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// The `= "..."` of an argument; anything but a string literal is reported with the fix.
/// An argument's value: a string literal, or (`lease` and `timeout` only) a path.
enum Value {
    Str(LitStr),
    Path(Path),
}

fn string_value(
    meta: &ParseNestedMeta<'_>,
    name: &str,
    diag: &mut Diag,
) -> syn::Result<Option<Value>> {
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
        return Ok(Some(Value::Str(lit)));
    }
    let durations = matches!(name, "lease" | "timeout");
    if let Expr::Path(syn::ExprPath {
        qself: None, path, ..
    }) = &value
        && durations
    {
        return Ok(Some(Value::Path(path.clone())));
    }
    let shown = quote::quote!(#value).to_string();
    let message = if durations {
        format!(
            "`{name}` takes a duration literal, like `{name} = \"30s\"`, or the path of a \
             `Duration` const, like `{name} = LEASE`"
        )
    } else {
        format!("`{name}` takes a string literal: write `{name} = \"{shown}\"`")
    };
    diag.error(&value, message);
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

#[cfg(test)]
mod tests {
    use super::{edit_distance, unknown_message};

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("kee", "key"), 1);
        assert_eq!(edit_distance("ky", "key"), 1);
        assert_eq!(edit_distance("keys", "key"), 1);
        assert_eq!(edit_distance("", "key"), 3);
        assert_eq!(edit_distance("isolaton", "isolation"), 1);
        assert_eq!(edit_distance("retries", "crate"), 5);
        assert_eq!(edit_distance("timout", "timeout"), 1);
    }

    #[test]
    fn suggests_only_close_names() {
        assert_eq!(
            unknown_message("kee"),
            "unknown argument `kee`; did you mean `key`?"
        );
        assert_eq!(
            unknown_message("Scope"),
            "unknown argument `Scope`; did you mean `scope`?"
        );
        assert_eq!(
            unknown_message("scpoe"),
            "unknown argument `scpoe`; did you mean `scope`?"
        );
        assert_eq!(
            unknown_message("isolatoin"),
            "unknown argument `isolatoin`; did you mean `isolation`?"
        );
        assert_eq!(
            unknown_message("retries"),
            "unknown argument `retries`; expected `key`, `scope`, `lease`, `timeout`, `wait`, \
             `isolation`, `replay`, `fingerprint` or `crate`"
        );
        // Nothing in common: a guess would mislead.
        assert_eq!(
            unknown_message("id"),
            "unknown argument `id`; expected `key`, `scope`, `lease`, `timeout`, `wait`, \
             `isolation`, `replay`, `fingerprint` or `crate`"
        );
    }
}
