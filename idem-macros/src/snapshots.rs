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
    prettyplease::unparse(&expanded)
}
