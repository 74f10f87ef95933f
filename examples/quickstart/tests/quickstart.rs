//! The quickstart is run here with its own code (included as a module), and what it reports is
//! checked against the database, so that the example cannot stop telling the truth unnoticed.

#[allow(dead_code)]
#[path = "../quickstart.rs"]
mod quickstart;

// No `#[tokio::test]`: an example builds with its package's dev-dependencies, so tokio's
// macros here would be compiled into the quickstart's first build too.
#[test]
fn quickstart_applies_each_top_up_once() {
    let dir = std::env::temp_dir().join(format!("idem-test-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (outcomes, balances) = runtime
        .block_on(quickstart::run(&dir.join("jobs.db"), &mut out))
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        outcomes,
        [
            "applied",
            "duplicate, skipped",
            "failed (the worker died before committing), rolled back",
            "applied",
        ]
    );
    assert_eq!(
        balances,
        [("alice".to_owned(), 150), ("bob".to_owned(), 125)]
    );
    let text = String::from_utf8(out).unwrap();
    assert!(text.ends_with("balances: alice 150, bob 125\n"), "{text}");
}
