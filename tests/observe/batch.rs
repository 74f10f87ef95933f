//! A batch handler's one span and its per-job counts.

use super::*;

#[derive(Clone)]
struct Item {
    id: i64,
}

#[idem::idempotent(key = "item.id", scope = "obs.lite.batch", batch = "items")]
async fn lite_batch(
    tx: &mut Transaction<'_, Sqlite>,
    items: &[Item],
) -> Result<usize, sqlx::Error> {
    for item in items {
        sqlx::query("INSERT INTO effects (id) VALUES (?)")
            .bind(item.id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(items.len())
}

/// A batch is one span (mode `batch`, no single key, `applied` if any job was, its jobs
/// counted in `jobs`, `applied` and `duplicate`) and one
/// claim latency, but the counter counts every job's outcome.
#[tokio::test]
async fn batch_is_one_span_and_counts_each_job() {
    const SCOPE: &str = "obs.lite.batch";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let first = [Item { id: 31 }, Item { id: 32 }];
    let done = lite_batch(&store, &first).await.unwrap();
    assert_eq!(done.applied(), 2);
    // 32 again and 33: one duplicate, one fresh; then all three again: all duplicates.
    let next = [Item { id: 32 }, Item { id: 33 }];
    assert_eq!(lite_batch(&store, &next).await.unwrap().applied(), 1);
    let again = [Item { id: 31 }, Item { id: 32 }, Item { id: 33 }];
    assert_eq!(lite_batch(&store, &again).await.unwrap().applied(), 0);
    for id in [31, 32, 33] {
        assert_eq!(count(&pool, "effects", id).await, 1, "effect of item {id}");
    }

    let claims = seen.claims();
    assert_eq!(claims.len(), 3, "one span per batch");
    for ((id, span), (outcome, decision, jobs, applied, duplicate)) in claims.iter().zip([
        ("applied", "fresh", "2", "2", "0"),
        ("applied", "fresh", "2", "1", "1"),
        ("duplicate", "duplicate", "3", "0", "3"),
    ]) {
        let (fields, _) = split(span);
        let want: Fields = [
            ("scope", SCOPE),
            ("mode", "batch"),
            ("outcome", outcome),
            ("retries", "0"),
            ("jobs", jobs),
            ("applied", applied),
            ("duplicate", duplicate),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(fields, want);
        assert_eq!(decisions(&seen, *id), [decision]);
    }
    assert_eq!(outcomes(SCOPE, "applied"), 3);
    assert_eq!(outcomes(SCOPE, "duplicate"), 4);
    assert_eq!(claim_samples(SCOPE).len(), 3, "a claim latency per batch");
}
