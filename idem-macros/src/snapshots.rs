//! Expansion snapshots: each `tests/expand/NAME.rs` holds one attributed function; its expansion,
//! pretty-printed, must equal `NAME.expanded.rs`. Re-bless with `IDEM_BLESS=1 cargo test -p
//! idem-macros`.

use std::fs;
use std::path::Path;

use quote::ToTokens;

#[test]
fn expansions_match_their_snapshots() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/expand");
    let bless = std::env::var_os("IDEM_BLESS").is_some();
    let mut cases = 0;
    let mut stale = Vec::new();
    let mut entries: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for input in entries {
        let name = input.file_name().unwrap().to_str().unwrap();
        if !name.ends_with(".rs") || name.ends_with(".expanded.rs") {
            continue;
        }
        cases += 1;
        let expanded = expand_file(&fs::read_to_string(&input).unwrap());
        let snapshot = input.with_extension("expanded.rs");
        if bless {
            fs::write(&snapshot, &expanded).unwrap();
        } else if fs::read_to_string(&snapshot).ok().as_deref() != Some(&expanded) {
            stale.push(format!(
                "{name}: expansion differs from {}:\n{expanded}",
                snapshot.display()
            ));
        }
    }
    assert!(
        cases >= 3,
        "expected the snapshot inputs in {}",
        dir.display()
    );
    assert!(
        stale.is_empty(),
        "{}\n(re-bless with IDEM_BLESS=1)",
        stale.join("\n")
    );
}

fn expand_file(source: &str) -> String {
    let mut file: syn::File = syn::parse_str(source).unwrap();
    let syn::Item::Fn(mut item) = file.items.remove(0) else {
        panic!("a snapshot input holds one function");
    };
    let pos = item
        .attrs
        .iter()
        .position(|a| a.path().is_ident("idempotent"))
        .expect("the function carries #[idempotent]");
    let attr = item.attrs.remove(pos);
    let args = match attr.meta {
        syn::Meta::List(list) => list.tokens,
        _ => panic!("#[idempotent(...)] takes arguments"),
    };
    let out = crate::expand::idempotent(args, item.into_token_stream());
    let expanded: syn::File = syn::parse2(out).expect("the expansion parses");
    match ungated(&expanded) {
        Some((gate, handler, stand_in)) => format!(
            "// {gate}: the handler when the database's feature is on\n{}\n\
             // {gate}: the stand-in when it is off\n{}",
            prettyplease::unparse(&handler),
            prettyplease::unparse(&stand_in)
        ),
        None => prettyplease::unparse(&expanded),
    }
}

/// The two sides of a feature gate (`__private::if_postgres! { {handler} {stand-in} }`), so
/// that each prints as code rather than as one macro's tokens.
fn ungated(file: &syn::File) -> Option<(String, syn::File, syn::File)> {
    let [syn::Item::Macro(gate)] = file.items.as_slice() else {
        return None;
    };
    let name = gate.mac.path.segments.last()?.ident.to_string();
    if !name.starts_with("if_") {
        return None;
    }
    let mut sides = gate.mac.tokens.clone().into_iter().map(|side| match side {
        proc_macro2::TokenTree::Group(g) => syn::parse2::<syn::File>(g.stream()).ok(),
        _ => None,
    });
    Some((name, sides.next()??, sides.next()??))
}

/// The messages of an expansion that failed, in order; empty if it succeeded.
fn errors_of(args: &str, function: &str) -> Vec<String> {
    let out = crate::expand::idempotent(args.parse().unwrap(), function.parse().unwrap());
    let file: syn::File = syn::parse2(out).expect("the expansion parses");
    file.items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Macro(m) if m.mac.path.segments.last().unwrap().ident == "compile_error" => {
                Some(m.mac.parse_body::<syn::LitStr>().unwrap().value())
            }
            _ => None,
        })
        .collect()
}

const TX: &str = "tx: &mut sqlx::Transaction<'_, Sqlite>";

/// What the missing `scope` error says after its example, for a function named `name`.
fn keep_markers(name: &str) -> String {
    format!(
        "Two handlers share markers only if they name the same scope; keep it when the code \
         moves. A handler that ran before without `scope` used its function name: write \
         `scope = \"{name}\"` to keep its markers"
    )
}

#[test]
fn scope_is_required_on_every_function() {
    let cases = [
        (
            format!("async fn send({TX}, job: &Job) -> Result<(), E> {{ Ok(()) }}"),
            "send",
        ),
        (
            format!("async fn handle(&self, {TX}, job: &Job) -> Result<(), E> {{ Ok(()) }}"),
            "handle",
        ),
        (
            format!("async fn make({TX}, job: &Job) -> Result<Self, E> {{ todo!() }}"),
            "make",
        ),
        (
            format!("async fn run<J: Job>({TX}, job: &J) -> Result<(), E> {{ Ok(()) }}"),
            "run",
        ),
        (
            format!("async fn r#type<'a>({TX}, job: &'a Job) -> Result<&'a str, E> {{ todo!() }}"),
            "type",
        ),
        (
            "async fn charge(lease: &idem::Lease, job: &Job) -> Result<(), E> { Ok(()) }"
                .to_owned(),
            "charge",
        ),
    ];
    for (function, name) in &cases {
        let args = if function.contains("lease") {
            "key = \"job.id\", lease = \"30s\""
        } else {
            "key = \"job.id\""
        };
        assert_eq!(
            errors_of(args, function),
            [format!(
                "`#[idempotent]` needs `scope`, the stable name of this handler's markers: \
                 `#[idempotent(key = \"job.id\", scope = \"billing.send_invoice\")]`. {}",
                keep_markers(name)
            )],
            "{function}"
        );
        assert_eq!(
            errors_of(&format!("{args}, scope = \"s\""), function),
            Vec::<String>::new(),
            "{function}"
        );
    }
    let batch = format!("async fn top_up({TX}, jobs: &[Job]) -> Result<(), E> {{ Ok(()) }}");
    assert_eq!(
        errors_of("key = \"job.id\", batch = \"jobs\"", &batch),
        [format!(
            "`#[idempotent]` needs `scope`, the stable name of this handler's markers: \
             `#[idempotent(key = \"job.id\", scope = \"billing.send_invoice\")]`. {}",
            keep_markers("top_up")
        )]
    );
    // Neither `key` nor `scope`: one error names both.
    assert_eq!(
        errors_of("", &cases[0].0),
        [format!(
            "`#[idempotent]` needs `key`, the expression that reads the job's stable id, and \
             `scope`, the stable name of this handler's markers: \
             `#[idempotent(key = \"job.id\", scope = \"billing.send_invoice\")]`. {}",
            keep_markers("send")
        )]
    );
    // An unknown argument may be the misspelt `scope` (or `key`): it is the one error.
    assert_eq!(
        errors_of("key = \"job.id\", scoop = \"a\"", &cases[0].0),
        ["unknown argument `scoop`; did you mean `scope`?"]
    );
    assert_eq!(
        errors_of("kee = \"job.id\"", &cases[0].0),
        ["unknown argument `kee`; did you mean `key`?"]
    );
    // A refused `scope` has had its error.
    assert_eq!(
        errors_of("key = \"job.id\", scope = \"\"", &cases[0].0),
        ["`scope` must be 1 to 255 bytes with no NUL byte, like \"billing.top_up\""]
    );
}

#[test]
fn one_mistake_in_the_arguments_is_one_error() {
    let method = format!("async fn handle(&self, {TX}, job: &Job) -> Result<(), E> {{ Ok(()) }}");
    let cases = [
        (
            "kee = \"job.id\"",
            "unknown argument `kee`; did you mean `key`?",
        ),
        (
            "key = \"job.id\", scoop = \"a\"",
            "unknown argument `scoop`; did you mean `scope`?",
        ),
        (
            "key = \"job.id\", scope = \"\"",
            "`scope` must be 1 to 255 bytes with no NUL byte, like \"billing.top_up\"",
        ),
        (
            "key = \"job.id\", scope = \"a\", wait = \"30 seconds\"",
            "`wait` must be a duration: a whole number followed by `ms`, `s`, `m` or `h`, like \
             \"500ms\", \"30s\" or \"2m\"; got \"30 seconds\"",
        ),
        (
            "key = \"job.id\", scope = \"a\", isolation = \"read committed\"",
            "unknown isolation \"read committed\"; expected \"serializable\" or \"repeatable \
             read\" (leave `isolation` out for the database's default)",
        ),
    ];
    for (args, message) in cases {
        assert_eq!(errors_of(args, &method), [message], "{args}");
    }
}

const LEASE: &str = "lease: &idem::Lease";

#[test]
fn lease_mode_checks() {
    let plain = format!("async fn charge({LEASE}, job: &Job) -> Result<(), E> {{ Ok(()) }}");
    assert_eq!(
        errors_of("key = \"job.id\", scope = \"s\", lease = \"30s\"", &plain),
        Vec::<String>::new()
    );
    let cases = [
        (
            "key = \"job.id\", scope = \"s\", lease = \"30s\", timeout = \"0ms\"",
            plain.clone(),
            "`timeout = \"0ms\"` is out of bounds: a timeout must be longer than zero and \
             shorter than the lease; leave `timeout` out for the lease minus a fifth of it, at \
             most 5s",
        ),
        (
            "key = \"job.id\", scope = \"s\", lease = \"30s\", timeout = \"99999999999999999999h\"",
            plain.clone(),
            "`timeout = \"99999999999999999999h\"` is out of bounds: a timeout must be longer \
             than zero and shorter than the lease; leave `timeout` out for the lease minus a \
             fifth of it, at most 5s",
        ),
        (
            "key = \"job.id\", scope = \"s\", wait = \"99999999999999999999h\"",
            "async fn charge(tx: &mut sqlx::Transaction<'_, Sqlite>, job: &Job) -> Result<(), E> { Ok(()) }"
                .to_owned(),
            "`wait = \"99999999999999999999h\"` is too long: a duration must fit in 64 bits of \
             milliseconds (about 584 million years)",
        ),
        (
            "key = \"job.id\", scope = \"s\", lease = \"2s\", timeout = \"3s\"",
            plain.clone(),
            "`timeout` must be shorter than `lease = \"2s\"`: the lease has to outlast the body, \
             or another delivery may take the key over while this one still runs; leave \
             `timeout` out for \"1600ms\" (the lease minus a fifth of it, at most 5s)",
        ),
        // A misspelt `lease` next to a `&Lease` parameter is one mistake.
        (
            "key = \"job.id\", leese = \"30s\"",
            plain.clone(),
            "unknown argument `leese`; did you mean `lease`?",
        ),
        (
            "key = \"lease.key()\", scope = \"s\", lease = \"30s\"",
            plain.clone(),
            "the key cannot come from the lease `lease`: read the job's id from another \
             parameter, like \"job.id\"",
        ),
        (
            "key = \"job.id\", scope = \"s\", lease = \"30s\"",
            "async fn charge(lease: &mut idem::Lease, job: &Job) -> Result<(), E> { Ok(()) }"
                .to_owned(),
            "lease mode needs the lease as a parameter, to give its key and remaining time to \
             the outside call: add `lease: &idem::Lease`",
        ),
        (
            "key = \"job.id\", scope = \"s\", lease = \"30s\"",
            format!("async fn charge({LEASE}, job: &Job) -> Option<()> {{ None }}"),
            "`#[idempotent]` handlers return `Result<T, E>`: an `Err` releases the key and lets \
             the job be redelivered",
        ),
    ];
    for (args, function, message) in &cases {
        assert_eq!(errors_of(args, function), [*message], "{args} {function}");
    }
    // A lease is at least 1s and at most 24h; the error quotes what was written.
    for lease in [
        "0s",
        "999ms",
        "500ms",
        "25h",
        "86400001ms",
        "100000000h",
        "99999999999999999999h",
    ] {
        assert_eq!(
            errors_of(
                &format!("key = \"job.id\", scope = \"s\", lease = \"{lease}\""),
                &plain
            ),
            [format!(
                "`lease = \"{lease}\"` is out of bounds: a lease must be at least 1s and at \
                 most 24h (a job that runs longer renews its lease with `Lease::renew`)"
            )],
            "{lease}"
        );
        // A timeout beside it is not compared with a lease that was refused.
        assert_eq!(
            errors_of(
                &format!("key = \"job.id\", scope = \"s\", lease = \"{lease}\", timeout = \"2s\""),
                &plain
            )
            .len(),
            1,
            "{lease}"
        );
    }
    for lease in ["1s", "1000ms", "24h", "1440m", "86400000ms"] {
        assert_eq!(
            errors_of(
                &format!("key = \"job.id\", scope = \"s\", lease = \"{lease}\""),
                &plain
            ),
            Vec::<String>::new(),
            "{lease}"
        );
    }
}
