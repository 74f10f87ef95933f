//! The examples are run here with their own code (included as modules), and what they report
//! is checked against the database, so an example that stops telling the truth fails CI.

#[allow(dead_code)]
#[path = "../quickstart.rs"]
mod quickstart;

#[allow(dead_code)]
#[path = "../top_up.rs"]
mod top_up;

#[tokio::test]
async fn quickstart_applies_each_top_up_once() {
    let dir = std::env::temp_dir().join(format!("idem-test-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    let (outcomes, balances) = quickstart::run(&dir.join("jobs.db"), &mut out)
        .await
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

#[tokio::test]
async fn top_up_applies_once_in_three_deliveries() {
    let url = top_up::database_url();
    let mut out = Vec::new();
    let balances = top_up::run(&url, &mut out)
        .await
        .unwrap_or_else(|e| panic!("top_up example against {url} (IDEM_POSTGRES_URL): {e}"));
    assert_eq!(balances, [150, 150, 150]);
    let text = String::from_utf8(out).unwrap();
    assert_eq!(text.matches(": applied;").count(), 1, "{text}");
    assert_eq!(text.matches("duplicate, nothing ran").count(), 2, "{text}");
}
