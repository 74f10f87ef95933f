//! The offset-watermark mode: records claimed by their offsets, the watermark moved with their
//! effects, a record below it a duplicate; stale deliveries of a rebalanced partition, failed
//! and rolled-back claims, the outbox, operators' calls, and a randomised run of consumers
//! that checks the watermark never moves back and every record's effect lands once.

use std::sync::Arc;

use idem::offsets::{OffsetGuard, RecordOffset};
use idem::{Error, NotKept, Outcome, Refusal, Store};

use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::util::{SplitMix, seed, until, within};
use crate::conformance::{Support, TestDb};

pub(super) const A: Outcome<()> = Outcome::Applied(());
pub(super) const D: Outcome<()> = Outcome::Duplicate;
pub(super) const GROUP: &str = "billing";

pub(super) fn records(
    topic: &str,
    partition: i32,
    offsets: impl IntoIterator<Item = i64>,
) -> Vec<(String, i32, i64)> {
    offsets
        .into_iter()
        .map(|o| (topic.to_owned(), partition, o))
        .collect()
}

pub(super) fn at(records: &[(String, i32, i64)]) -> Vec<RecordOffset<'_>> {
    records
        .iter()
        .map(|(topic, partition, offset)| RecordOffset {
            topic,
            partition: *partition,
            offset: *offset,
        })
        .collect()
}

/// The effect's id of a record: its partition and offset in one number.
pub(super) fn effect_id(partition: i32, offset: i64) -> i64 {
    i64::from(partition) * 1_000_000 + offset
}

/// Inserts one effect row per fresh record, in the claim's transaction.
pub(super) async fn apply_fresh<DB: TestDb>(
    claim: &mut OffsetGuard<DB>,
    records: &[(String, i32, i64)],
    effects: &str,
) -> Result<usize, Error> {
    let fresh: Vec<usize> = (0..records.len()).filter(|i| claim.is_fresh(*i)).collect();
    let Some(tx) = claim.tx() else {
        return Ok(0);
    };
    let sql = format!("INSERT INTO {effects} (id, amount, origin) VALUES ($1, 1, 'offsets')");
    for i in &fresh {
        let (_, partition, offset) = &records[*i];
        let id = Bind::I64(effect_id(*partition, *offset));
        DB::execute(&mut **tx, &DB::sql(&sql), &[id]).await?;
    }
    Ok(fresh.len())
}

/// Claims `records`, runs their effects and commits.
pub(super) async fn deliver<DB: TestDb>(
    store: &Store<DB>,
    records: &[(String, i32, i64)],
    effects: &str,
) -> Result<Vec<Outcome<()>>, Error> {
    let mut claim = store.claim_offsets(GROUP, &at(records)).await?;
    let ran = apply_fresh(&mut claim, records, effects).await;
    let batch = claim.finish(ran).await?;
    Ok(batch.outcomes().to_vec())
}

pub(super) async fn watermark<DB: TestDb>(
    store: &Store<DB>,
    topic: &str,
    partition: i32,
) -> Option<i64> {
    let marks = store
        .watermarks(GROUP, topic)
        .await
        .expect("read the watermarks");
    marks
        .into_iter()
        .find(|(p, _)| *p == partition)
        .map(|(_, n)| n)
}

pub(crate) async fn offset_claims_apply_each_record_once_and_the_watermark_only_rises<
    S: Support,
>() {
    let ctx = Ctx::<S>::new("ofs", 2).await;
    let first = records("orders", 0, 0..10);
    assert_eq!(
        deliver(&ctx.store, &first, &ctx.effects).await.unwrap(),
        [A; 10]
    );
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(10));
    // Redelivered from 5 (a consumer that died before its Kafka commit), with new records.
    let again = records("orders", 0, 5..15);
    let outcomes = deliver(&ctx.store, &again, &ctx.effects).await.unwrap();
    assert_eq!(outcomes, [D, D, D, D, D, A, A, A, A, A]);
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(15));
    // Only duplicates: nothing runs, nothing moves.
    let old = records("orders", 0, 3..8);
    assert_eq!(
        deliver(&ctx.store, &old, &ctx.effects).await.unwrap(),
        [D; 5]
    );
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(15));
    // A poll's batch of two partitions, interleaved; a gap in offsets (compaction, a
    // transaction's marker) is no hole: the watermark follows the last record.
    let mixed = vec![
        ("orders".to_owned(), 1, 0),
        ("orders".to_owned(), 0, 14),
        ("orders".to_owned(), 1, 7),
        ("orders".to_owned(), 0, 20),
    ];
    let outcomes = deliver(&ctx.store, &mixed, &ctx.effects).await.unwrap();
    assert_eq!(outcomes, [A, D, A, A]);
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(21));
    assert_eq!(watermark(&ctx.store, "orders", 1).await, Some(8));
    for o in (0..15).chain([20]) {
        assert_eq!(ctx.effects(effect_id(0, o)).await, 1, "offset {o}");
    }
    assert_eq!(ctx.effects_total().await, 16 + 2);
    assert_eq!(ctx.markers().await, 0, "no marker per record");
    ctx.cleanup().await;
}

pub(crate) async fn failed_offset_claim_keeps_nothing_and_redelivery_applies<S: Support>() {
    let ctx = Ctx::<S>::new("ofail", 2).await;
    let batch = records("orders", 2, 0..5);
    let mut claim = ctx.store.claim_offsets(GROUP, &at(&batch)).await.unwrap();
    apply_fresh(&mut claim, &batch, &ctx.effects).await.unwrap();
    let failed: Result<(), Error> = Err(Error::Refused(Refusal::Offsets {
        reason: "the body failed".into(),
    }));
    assert!(claim.finish(failed).await.is_err());
    assert_eq!(ctx.effects_total().await, 0, "the effects were rolled back");
    assert_eq!(
        watermark(&ctx.store, "orders", 2).await,
        None,
        "and the watermark"
    );
    // Dropped mid-body (a panic, a cancelled future): the same.
    let mut claim = ctx.store.claim_offsets(GROUP, &at(&batch)).await.unwrap();
    apply_fresh(&mut claim, &batch, &ctx.effects).await.unwrap();
    drop(claim);
    assert_eq!(ctx.effects_total().await, 0);
    assert_eq!(
        deliver(&ctx.store, &batch, &ctx.effects).await.unwrap(),
        [A; 5]
    );
    assert_eq!(
        deliver(&ctx.store, &batch, &ctx.effects).await.unwrap(),
        [D; 5]
    );
    assert_eq!(ctx.effects_total().await, 5);
    ctx.cleanup().await;
}

/// A rebalance: the old owner of a partition still holds a batch's transaction when the new
/// owner, started at the stored watermark, claims the same records and more. The new owner
/// waits for the row, then takes only what the old one did not commit; the old one, which
/// keeps reading a partition it lost, moves nothing back.
pub(crate) async fn revoked_consumer_never_moves_the_watermark_back<S: Support>() {
    let ctx = Ctx::<S>::new("orevoke", 4).await;
    let store = Arc::new(ctx.store.clone());
    let first = records("orders", 0, [0]);
    assert_eq!(deliver(&store, &first, &ctx.effects).await.unwrap(), [A]);
    let old_batch = records("orders", 0, 1..10);
    let mut old = store.claim_offsets(GROUP, &at(&old_batch)).await.unwrap();
    apply_fresh(&mut old, &old_batch, &ctx.effects)
        .await
        .unwrap();
    let effects = ctx.effects.clone();
    let new_owner = tokio::spawn({
        let store = store.clone();
        async move {
            let batch = records("orders", 0, 1..20);
            deliver(&store, &batch, &effects).await
        }
    });
    // The new owner's claim waits for the old one's transaction: shown on the servers (its
    // `UPDATE` of the watermark queued behind the row lock); SQLite's second writer waits
    // for the write lock, which no other session can see.
    if let Some(running) = S::UPDATES_RUNNING_LONGER_THAN {
        let table = format!("{}_offsets", ctx.store.table());
        until(60, "the new owner's claim to wait", || {
            let binds = [Bind::Str(table.clone()), Bind::I64(0)];
            let ctx = &ctx;
            async move { ctx.scalar_with(running, &binds).await > 0 }
        })
        .await;
    }
    let committed = old.finish(Ok::<_, Error>(())).await.unwrap();
    assert_eq!(committed.outcomes(), [A; 9]);
    let outcomes = within(60, "the new owner's claim", new_owner)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&outcomes[..9], [D; 9]);
    assert_eq!(&outcomes[9..], [A; 10]);
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(20));
    // The old owner's next batches, read before it learnt of the rebalance.
    for stale in [records("orders", 0, 10..15), records("orders", 0, 5..12)] {
        let outcomes = deliver(&ctx.store, &stale, &ctx.effects).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == D), "{outcomes:?}");
        assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(20));
    }
    for o in 0..20 {
        assert_eq!(ctx.effects(effect_id(0, o)).await, 1, "offset {o}");
    }
    ctx.cleanup().await;
}

/// Consumers that start at the stored watermark and read on in batches of random sizes, some
/// failing, some stale, all at once: the watermark, read after every batch, never moves back,
/// and every offset below the final watermark has its effect exactly once.
pub(crate) async fn watermark_never_moves_back_under_random_consumers<S: Support>() {
    let ctx = Ctx::<S>::new("oprop", 6).await;
    let seed = seed();
    let store = Arc::new(ctx.store.clone());
    let mut tasks = Vec::new();
    for consumer in 0..4_u64 {
        let (store, effects) = (store.clone(), ctx.effects.clone());
        let mut rng = SplitMix::new(seed ^ (consumer << 32));
        tasks.push(tokio::spawn(async move {
            let mut seen = 0;
            for _ in 0..30 {
                // Assigned the partition: start at the stored watermark (or at 0), sometimes
                // a little behind it (a stale position, as after a rebalance).
                let stored = watermark(&store, "orders", 0).await.unwrap_or(0);
                let behind = (rng.next_u64() % 3) as i64;
                let start = (stored - behind).max(0);
                let size = 1 + (rng.next_u64() % 8) as i64;
                let batch = records("orders", 0, start..start + size);
                let mut claim = store.claim_offsets(GROUP, &at(&batch)).await.unwrap();
                let ran = apply_fresh(&mut claim, &batch, &effects).await;
                let fail = rng.next_u64().is_multiple_of(5);
                let result = if fail {
                    claim.release().await;
                    None
                } else {
                    Some(claim.finish(ran).await)
                };
                if let Some(result) = result {
                    drop(result.unwrap());
                }
                let now = watermark(&store, "orders", 0).await.unwrap_or(0);
                assert!(
                    now >= seen,
                    "seed {seed}: the watermark moved back from {seen} to {now}"
                );
                seen = now;
            }
        }));
    }
    for task in tasks {
        within(120, "a random consumer", task).await.unwrap();
    }
    let end = watermark(&ctx.store, "orders", 0).await.unwrap_or(0);
    for o in 0..end {
        assert_eq!(
            ctx.effects(effect_id(0, o)).await,
            1,
            "seed {seed}: offset {o} below the watermark {end}"
        );
    }
    assert_eq!(
        ctx.effects_total().await,
        end,
        "seed {seed}: no effect at or above {end}"
    );
    ctx.cleanup().await;
}

/// The body swallowed an error that rolled its transaction back: the claim is
/// `NotKept::RolledBack`, never applied, and the watermark did not move (MySQL's commit looks for
/// the watermark holding the claim's nonce).
pub(crate) async fn offset_claim_rolled_back_under_its_body_is_not_applied<S: Support>() {
    let mut ctx = Ctx::<S>::new("oroll", 2).await;
    let rows = ctx
        .create_table("r", "(id BIGINT NOT NULL PRIMARY KEY, v BIGINT NOT NULL)")
        .await;
    let values: Vec<String> = (1..=100).map(|i| format!("({i}, 0)")).collect();
    ctx.exec(&format!(
        "INSERT INTO {rows} (id, v) VALUES {}",
        values.join(", ")
    ))
    .await;
    let other = S::connect(&ctx.url, 2).await;
    // The partition has a watermark already: the commit's check must find this claim's
    // nonce on it, not just the row.
    let first = records("orders", 0, [0]);
    assert_eq!(
        deliver(&ctx.store, &first, &ctx.effects).await.unwrap(),
        [A]
    );
    let batch = records("orders", 0, 1..4);
    let mut claim = ctx.store.claim_offsets(GROUP, &at(&batch)).await.unwrap();
    apply_fresh(&mut claim, &batch, &ctx.effects).await.unwrap();
    // The outbox's message must go with the rollback too.
    claim.outbox().send("orders/0/1", "receipts", &1).unwrap();
    let tx = claim.tx().expect("fresh");
    within(
        120,
        "the swallowing body",
        S::swallow_a_rollback(&mut **tx, &other, &rows),
    )
    .await;
    match claim.finish(Ok::<_, Error>(())).await {
        Err(Error::NotKept(NotKept::RolledBack { scope, key })) => {
            assert_eq!((scope.as_str(), key.as_str()), (GROUP, "orders/0/1"));
        }
        other => panic!("expected NotKept::RolledBack, got {other:?}"),
    }
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(1));
    if !S::STATEMENT_AFTER_ROLLBACK_KEPT {
        assert_eq!(ctx.effects_total().await, 1);
    }
    let outbox = format!("SELECT COUNT(*) FROM {}_outbox", ctx.store.table());
    assert_eq!(
        ctx.scalar(&outbox).await,
        0,
        "no message without its watermark"
    );
    other.close().await;
    ctx.cleanup().await;
}

pub(crate) async fn offset_claim_outbox_commits_with_its_watermark<S: Support>() {
    let ctx = Ctx::<S>::new("oout", 2).await;
    let batch = records("orders", 3, 7..9);
    let mut claim = ctx.store.claim_offsets(GROUP, &at(&batch)).await.unwrap();
    let id = claim
        .outbox()
        .send("orders/3/8", "receipts", &8)
        .unwrap()
        .to_owned();
    assert_eq!(
        id,
        idem::job_id(GROUP, &("orders/3/8", 0_u32))
            .unwrap()
            .as_str()
    );
    // A record that is not fresh in this claim cannot send.
    assert!(matches!(
        claim.outbox().send("orders/3/6", "receipts", &6),
        Err(Error::Refused(Refusal::Message { .. }))
    ));
    // A message's ordering key and headers are kept with the watermark as with a marker.
    claim
        .outbox()
        .message("orders/3/7", "receipts")
        .json(&7)
        .key("customer-9")
        .header("tenant", "acme")
        .send()
        .unwrap();
    apply_fresh(&mut claim, &batch, &ctx.effects).await.unwrap();
    assert_eq!(claim.finish(Ok::<_, Error>(())).await.unwrap().applied(), 2);
    let outbox = format!("SELECT COUNT(*) FROM {}_outbox", ctx.store.table());
    assert_eq!(ctx.scalar(&outbox).await, 2);
    let entries = ctx.store.list_outbox(true, true, 10).await.unwrap();
    let keyed = entries
        .iter()
        .find(|e| e.ordering_key == "customer-9")
        .expect("the message keeps its ordering key");
    assert_eq!(keyed.headers.get("tenant"), Some("acme"));
    // A redelivery is a duplicate and sends nothing more.
    let mut again = ctx.store.claim_offsets(GROUP, &at(&batch)).await.unwrap();
    assert!(!again.any_fresh());
    assert!(again.outbox().send("orders/3/8", "receipts", &8).is_err());
    assert_eq!(again.finish(Ok::<_, Error>(())).await.unwrap().applied(), 0);
    assert_eq!(ctx.scalar(&outbox).await, 2);
    ctx.cleanup().await;
}

pub(crate) async fn offsets_refuse_bad_input_before_any_io<S: Support>() {
    let ctx = Ctx::<S>::new("obad", 1).await;
    let store = &ctx.store;
    let one = |topic: &'static str, partition, offset| {
        vec![RecordOffset {
            topic,
            partition,
            offset,
        }]
    };
    for (group, records) in [
        ("", one("t", 0, 0)),
        (GROUP, one("", 0, 0)),
        (GROUP, one("t", -1, 0)),
        (GROUP, one("t", 0, -5)),
        (GROUP, [one("t", 0, 3), one("t", 0, 2)].concat()),
    ] {
        let got = store.claim_offsets(group, &records).await;
        assert!(
            matches!(got, Err(Error::Refused(Refusal::Offsets { .. }))),
            "{records:?}: {got:?}"
        );
    }
    assert!(matches!(
        store.set_watermark(GROUP, "t", 0, -1).await,
        Err(Error::Refused(Refusal::Offsets { .. }))
    ));
    assert!(matches!(
        store.watermarks("", "t").await,
        Err(Error::Refused(Refusal::Offsets { .. }))
    ));
    let empty = store.claim_offsets(GROUP, &[]).await.unwrap();
    assert!(empty.is_empty() && !empty.any_fresh());
    assert_eq!(store.watermarks(GROUP, "t").await.unwrap(), []);
    // A claim inside another claim's body is refused, as in every mode.
    let key = idem::Key::new("outer").unwrap();
    let idem::Claimed::Fresh(guard) = store.claim("s", &key).await.unwrap() else {
        panic!("fresh");
    };
    let inner = guard
        .body()
        .run(store.claim_offsets(GROUP, &one("t", 0, 0)))
        .await;
    assert!(
        matches!(inner, Err(Error::Refused(Refusal::Nested { .. }))),
        "{inner:?}"
    );
    guard.release().await;
    ctx.cleanup().await;
}

pub(crate) async fn set_watermark_replays_and_forget_starts_over<S: Support>() {
    let ctx = Ctx::<S>::new("oset", 2).await;
    let batch = records("orders", 0, 0..4);
    assert_eq!(
        deliver(&ctx.store, &batch, &ctx.effects).await.unwrap(),
        [A; 4]
    );
    // An operator replays from 2.
    ctx.store
        .set_watermark(GROUP, "orders", 0, 2)
        .await
        .unwrap();
    assert_eq!(
        deliver(&ctx.store, &batch, &ctx.effects).await.unwrap(),
        [D, D, A, A]
    );
    assert_eq!(ctx.effects(effect_id(0, 2)).await, 2, "replayed on purpose");
    // A topic made anew: its log starts at 0 again, below the old watermark.
    ctx.store.set_watermark(GROUP, "fresh", 5, 0).await.unwrap();
    assert_eq!(watermark(&ctx.store, "fresh", 5).await, Some(0));
    assert_eq!(
        ctx.store
            .forget_watermarks(GROUP, Some("orders"))
            .await
            .unwrap(),
        1
    );
    assert_eq!(watermark(&ctx.store, "orders", 0).await, None);
    assert_eq!(ctx.store.forget_watermarks(GROUP, None).await.unwrap(), 1);
    ctx.cleanup().await;
}
