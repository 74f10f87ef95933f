//! The examples are run here with their own code (included as modules), and what they report
//! is checked against the database, so an example that stops telling the truth fails CI. The
//! quickstart's test is in its own package (`examples/quickstart/tests/quickstart.rs`).

#[allow(dead_code)]
#[path = "../top_up.rs"]
mod top_up;

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
