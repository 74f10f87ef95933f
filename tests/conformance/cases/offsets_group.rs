//! Offset claims through group commit: consumers of several partitions share one transaction,
//! a savepoint each, one commit; a failing member's watermark stays back, a group that fails
//! as a whole fails each member, two members of one partition keep the watermark's order, and
//! a member meets a claim of a transaction of its own on the same partition.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{Error, Group, GroupOptions, NotKept, Outcome, Refusal};

use super::ambiguous::{through_proxy, until_session_gone};
use super::offsets::{A, D, GROUP, apply_fresh, at, deliver, effect_id, records, watermark};
use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::Hold;
use crate::conformance::proxy::CutAt;
use crate::conformance::util::{until, within};
use crate::conformance::{Server, Support, TestDb};

type Records = Vec<(String, i32, i64)>;

/// What a member's body does after its effects.
#[derive(Clone)]
enum Then {
    Commit,
    Fail,
    /// The guard is dropped after the effects (a panic, a cancelled call): `Ok([])`.
    Drop,
    /// Sends an outbox message for its first record, then, the first such body, parks
    /// until released, holding its lane.
    Park(Arc<Hold>),
    /// Counts the group's watermarks in its transaction and, from another session, those
    /// committed.
    Look(Arc<Looks>),
}

#[derive(Default)]
struct Looks {
    /// (seen in the member's transaction, committed) per member.
    seen: Mutex<Vec<(i64, usize)>>,
}

/// Claims `records` in `group`, runs their effects and `then`, and ends the claim.
async fn deliver_grouped<S: Support>(
    ctx: &Ctx<S>,
    group: &Group<S::Db>,
    records: &Records,
    then: Then,
) -> Result<Vec<Outcome<()>>, Error> {
    let mut claim = group.claim_offsets(GROUP, &at(records)).await?;
    let ran = apply_fresh(&mut claim, records, &ctx.effects).await;
    if let Then::Drop = then {
        drop(claim);
        return Ok(Vec::new());
    }
    if let (Then::Park(_), Some((_, partition, offset))) = (&then, records.first()) {
        let key = format!("orders/{partition}/{offset}");
        claim.outbox().send(&key, "receipts", offset)?;
    }
    let ran = match (ran, then, claim.tx()) {
        (Err(e), ..) => Err(e),
        (Ok(_), Then::Fail, _) => Err(Error::Refused(Refusal::Offsets {
            reason: "the body failed".into(),
        })),
        (Ok(_), Then::Park(hold), _) => {
            hold.park_first().await;
            Ok(())
        }
        (Ok(_), Then::Look(looks), Some(tx)) => {
            let sql = format!(
                "SELECT COUNT(*) FROM {}_offsets WHERE consumer_group = $1",
                ctx.store.table()
            );
            let binds = [Bind::Str(GROUP.to_owned())];
            let inside = S::Db::fetch_i64(&mut **tx, &sql, &binds).await?;
            let outside = ctx.store.watermarks(GROUP, "orders").await?.len();
            looks.seen.lock().unwrap().push((inside, outside));
            Ok(())
        }
        (Ok(_), ..) => Ok(()),
    };
    let batch = claim.finish(ran).await?;
    Ok(batch.outcomes().to_vec())
}

fn one_group<S: Support>(ctx: &Ctx<S>, lanes: usize) -> Group<S::Db> {
    let options = GroupOptions::new()
        .lanes(lanes)
        .max_delay(Duration::from_secs(1));
    ctx.store.group(options).expect("valid options")
}

/// Waits until `n` calls hold or wait for a turn of `group`.
async fn until_queued<DB: idem::Backend>(group: &Group<DB>, n: usize) {
    until(120, "the calls queuing in the group", || async {
        tokio::time::sleep(Duration::from_millis(1)).await;
        group.queued() == n
    })
    .await;
}

type Call = tokio::task::JoinHandle<Result<Vec<Outcome<()>>, Error>>;

/// Starts a member on `records`, and waits until it queues in the group (its turn comes
/// after the ones started before it: the lane's lock is first come, first served).
async fn start<S: Support>(
    ctx: &Arc<Ctx<S>>,
    group: &Group<S::Db>,
    records: Records,
    then: Then,
    queued: usize,
) -> Call {
    let (ctx2, group2) = (ctx.clone(), group.clone());
    let call = tokio::spawn(async move { deliver_grouped(&ctx2, &group2, &records, then).await });
    until_queued(group, queued).await;
    call
}

async fn answer(call: Call) -> Result<Vec<Outcome<()>>, Error> {
    within(60, "a grouped offset claim", call)
        .await
        .expect("no panic")
}

/// Four consumers, one partition each, in one group: one transaction (the last body sees
/// every member's watermark in it while none is committed), one commit, each record's effect
/// once; the redelivery of every batch is a duplicate.
pub(crate) async fn grouped_offset_claims_of_partitions_share_one_commit<S: Support>() {
    const PARTITIONS: i32 = 4;
    let ctx = Arc::new(Ctx::<S>::new("ogroup", 8).await);
    let group = one_group(&ctx, 1);
    let hold = Arc::new(Hold::default());
    let looks = Arc::new(Looks::default());
    let batch = |p: i32| records("orders", p, 0..5);
    // Partition 0 parks in its body, holding the lane, while the others queue behind it.
    let mut calls = vec![{
        let (ctx, group, hold) = (ctx.clone(), group.clone(), hold.clone());
        tokio::spawn(
            async move { deliver_grouped(&ctx, &group, &batch(0), Then::Park(hold)).await },
        )
    }];
    within(60, "partition 0 parking in its body", hold.entered()).await;
    for p in 1..PARTITIONS {
        let then = Then::Look(looks.clone());
        calls.push(start(&ctx, &group, batch(p), then, p as usize + 1).await);
    }
    assert_eq!(ctx.store.watermarks(GROUP, "orders").await.unwrap(), []);
    hold.release();
    for call in calls {
        assert_eq!(answer(call).await.unwrap(), [A; 5]);
    }
    let seen = looks.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [(2, 0), (3, 0), (4, 0)],
        "one transaction, not committed meanwhile"
    );
    let marks = ctx.store.watermarks(GROUP, "orders").await.unwrap();
    assert_eq!(marks, (0..PARTITIONS).map(|p| (p, 5)).collect::<Vec<_>>());
    for p in 0..PARTITIONS {
        for o in 0..5 {
            assert_eq!(ctx.effects(effect_id(p, o)).await, 1, "{p}/{o}");
        }
        assert_eq!(
            deliver_grouped(&ctx, &group, &batch(p), Then::Commit)
                .await
                .unwrap(),
            [D; 5]
        );
    }
    assert_eq!(ctx.effects_total().await, i64::from(PARTITIONS) * 5);
    assert_eq!(ctx.markers().await, 0, "no marker per record");
    let outbox = format!("SELECT COUNT(*) FROM {}_outbox", ctx.store.table());
    assert_eq!(
        ctx.scalar(&outbox).await,
        1,
        "partition 0's message, with its watermark"
    );
    Arc::into_inner(ctx)
        .expect("the calls ended")
        .cleanup()
        .await;
}

/// A member whose body fails, and one dropped in its body, roll back their savepoints,
/// watermarks included: the others commit, and each redelivery applies its records once.
pub(crate) async fn failing_grouped_offset_member_keeps_only_its_watermark_back<S: Support>() {
    let ctx = Arc::new(Ctx::<S>::new("ogfail", 8).await);
    let group = one_group(&ctx, 1);
    let hold = Arc::new(Hold::default());
    let batch = |p: i32| records("orders", p, 10..14);
    let mut calls = vec![{
        let (ctx, group, hold) = (ctx.clone(), group.clone(), hold.clone());
        tokio::spawn(
            async move { deliver_grouped(&ctx, &group, &batch(0), Then::Park(hold)).await },
        )
    }];
    within(60, "partition 0 parking in its body", hold.entered()).await;
    for p in 1..4 {
        let then = match p {
            1 => Then::Drop,
            2 => Then::Fail,
            _ => Then::Commit,
        };
        calls.push(start(&ctx, &group, batch(p), then, p as usize + 1).await);
    }
    hold.release();
    for (p, call) in calls.into_iter().enumerate() {
        match (p, answer(call).await) {
            (1, Ok(dropped)) => assert_eq!(dropped, []),
            (2, Err(Error::Refused(Refusal::Offsets { .. }))) => {}
            (0 | 3, Ok(outcomes)) => assert_eq!(outcomes, [A; 4], "partition {p}"),
            (p, other) => panic!("partition {p}: {other:?}"),
        }
    }
    let marks = ctx.store.watermarks(GROUP, "orders").await.unwrap();
    assert_eq!(marks, [(0, 14), (3, 14)], "partitions 1 and 2 not moved");
    assert_eq!(ctx.effects_total().await, 8);
    for p in [1, 2] {
        let again = deliver_grouped(&ctx, &group, &batch(p), Then::Commit).await;
        assert_eq!(again.unwrap(), [A; 4]);
        let again = deliver_grouped(&ctx, &group, &batch(p), Then::Commit).await;
        assert_eq!(again.unwrap(), [D; 4]);
        assert_eq!(watermark(&ctx.store, "orders", p).await, Some(14));
        for o in 10..14 {
            assert_eq!(ctx.effects(effect_id(p, o)).await, 1, "{p}/{o}");
        }
    }
    assert_eq!(ctx.effects_total().await, 16);
    Arc::into_inner(ctx)
        .expect("the calls ended")
        .cleanup()
        .await;
}

/// Three members of one partition in one group, in this order: records 0..10, a redelivery
/// overlapping them (5..15), and a redelivery of 0..5 alone. The second takes only what the
/// first did not (the watermark the first moved, uncommitted, in the same transaction); the
/// third is a duplicate, answered once the group committed. One commit keeps 0..15 once, and
/// the watermark at 15; MySQL's commit check finds the last member's nonce on the row.
pub(crate) async fn grouped_offset_claims_of_one_partition_keep_its_order<S: Support>() {
    let ctx = Arc::new(Ctx::<S>::new("ogorder", 8).await);
    // Two lanes: the partition chooses the lane, so the three still meet in one.
    let group = one_group(&ctx, 2);
    let hold = Arc::new(Hold::default());
    let first = {
        let (ctx, group, hold) = (ctx.clone(), group.clone(), hold.clone());
        let batch = records("orders", 0, 0..10);
        tokio::spawn(async move { deliver_grouped(&ctx, &group, &batch, Then::Park(hold)).await })
    };
    within(60, "the first batch parking in its body", hold.entered()).await;
    let overlap = start(&ctx, &group, records("orders", 0, 5..15), Then::Commit, 2).await;
    let old = start(&ctx, &group, records("orders", 0, 0..5), Then::Commit, 3).await;
    hold.release();
    assert_eq!(answer(first).await.unwrap(), [A; 10]);
    let overlapping = answer(overlap).await.unwrap();
    assert_eq!(overlapping, [D, D, D, D, D, A, A, A, A, A]);
    assert_eq!(answer(old).await.unwrap(), [D; 5]);
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(15));
    for o in 0..15 {
        assert_eq!(ctx.effects(effect_id(0, o)).await, 1, "offset {o}");
    }
    assert_eq!(ctx.effects_total().await, 15);
    Arc::into_inner(ctx)
        .expect("the calls ended")
        .cleanup()
        .await;
}

/// A group member and a claim in a transaction of its own on one partition: each waits for
/// the other's transaction and decides on what it committed, whichever comes first.
pub(crate) async fn grouped_and_plain_offset_claims_of_one_partition_apply_once<S: Support>() {
    let ctx = Arc::new(Ctx::<S>::new("ogmix", 8).await);
    let group = one_group(&ctx, 1);
    // The partition's first watermark, so that the claims below meet on its row (a first
    // insert waits on the other's uncommitted one instead).
    let seed = records("orders", 0, [0]);
    assert_eq!(deliver(&ctx.store, &seed, &ctx.effects).await.unwrap(), [A]);
    // The plain claim first: it holds records 1..10 open while a member claims 1..20.
    let plain_batch = records("orders", 0, 1..10);
    let mut plain = ctx
        .store
        .claim_offsets(GROUP, &at(&plain_batch))
        .await
        .unwrap();
    apply_fresh(&mut plain, &plain_batch, &ctx.effects)
        .await
        .unwrap();
    let member = {
        let (ctx, group) = (ctx.clone(), group.clone());
        let batch = records("orders", 0, 1..20);
        tokio::spawn(async move { deliver_grouped(&ctx, &group, &batch, Then::Commit).await })
    };
    until_waiting(&ctx).await;
    assert_eq!(
        plain.finish(Ok::<_, Error>(())).await.unwrap().outcomes(),
        [A; 9]
    );
    let mut want = vec![D; 9];
    want.extend([A; 10]);
    assert_eq!(answer(member).await.unwrap(), want);
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(20));
    // The member first: it holds 20..30 in its open group while a plain claim takes 20..40.
    let hold = Arc::new(Hold::default());
    let member = {
        let (ctx, group, hold) = (ctx.clone(), group.clone(), hold.clone());
        let batch = records("orders", 0, 20..30);
        tokio::spawn(async move { deliver_grouped(&ctx, &group, &batch, Then::Park(hold)).await })
    };
    within(60, "the member parking in its body", hold.entered()).await;
    let plain = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let batch = records("orders", 0, 20..40);
            deliver(&ctx.store, &batch, &ctx.effects).await
        })
    };
    until_waiting(&ctx).await;
    hold.release();
    assert_eq!(answer(member).await.unwrap(), [A; 10]);
    let mut want = vec![D; 10];
    want.extend([A; 10]);
    let plain = within(60, "the plain claim", plain)
        .await
        .expect("no panic");
    assert_eq!(plain.unwrap(), want);
    assert_eq!(watermark(&ctx.store, "orders", 0).await, Some(40));
    for o in 0..40 {
        assert_eq!(ctx.effects(effect_id(0, o)).await, 1, "offset {o}");
    }
    assert_eq!(ctx.effects_total().await, 40);
    Arc::into_inner(ctx)
        .expect("the calls ended")
        .cleanup()
        .await;
}

/// On the servers, until a session's `UPDATE` of the watermarks waits for the other
/// transaction's row lock; SQLite's second writer waits in `BEGIN` where no session can see
/// it, and decides the same way whenever it comes.
async fn until_waiting<S: Support>(ctx: &Ctx<S>) {
    if let Some(running) = S::UPDATES_RUNNING_LONGER_THAN {
        let table = format!("{}_offsets", ctx.store.table());
        until(60, "a claim waiting for the watermark's row", || {
            let binds = [Bind::Str(table.clone()), Bind::I64(0)];
            async move { ctx.scalar_with(running, &binds).await > 0 }
        })
        .await;
    }
}

/// The commit of a group of offset claims is cut before its answer: every member, the
/// duplicate whose records an earlier member's uncommitted watermark covered included, gets
/// `NotKept::Group { may_be_kept: true }`, never `Applied` or `Duplicate`; the watermarks hold all
/// of the group or none of it, and every redelivery settles by them with one effect a record.
pub(crate) async fn grouped_offset_commit_cut_fails_every_member_as_may_be_kept<S: Server>() {
    cut_offsets_commit::<S>("ogambig", CutAt::Commit, None).await;
}

/// The same with the commit dropped on the way: nothing kept, every redelivery applies once.
pub(crate) async fn grouped_offset_commit_never_delivered_fails_every_member<S: Server>() {
    cut_offsets_commit::<S>("ognocommit", CutAt::InsteadOfCommit, Some(false)).await;
}

async fn cut_offsets_commit<S: Server>(tag: &str, at_cut: CutAt, expect: Option<bool>) {
    let ctx = Ctx::<S>::new(tag, 4).await;
    let (mut proxy, pool, store) = through_proxy(&ctx, at_cut).await;
    let cut_group = store
        .group(
            GroupOptions::new()
                .lanes(1)
                .max_delay(Duration::from_secs(1)),
        )
        .expect("valid options");
    let batches: Vec<Records> = vec![
        records("orders", 0, 0..5),
        records("orders", 1, 0..5),
        records("orders", 2, 0..5),
        // A second delivery of partition 0's batch: duplicates of the first member's work,
        // which is not committed yet.
        records("orders", 0, 0..5),
    ];
    let effects = ctx.effects.clone();
    let hold = Arc::new(Hold::default());
    let mut calls = Vec::new();
    for (i, batch) in batches.iter().cloned().enumerate() {
        let (group, effects, parked) = (cut_group.clone(), effects.clone(), hold.clone());
        calls.push(tokio::spawn(async move {
            let mut claim = group.claim_offsets(GROUP, &at(&batch)).await?;
            let ran = apply_fresh(&mut claim, &batch, &effects).await;
            if i == 0 {
                parked.park_first().await;
            }
            Ok::<_, Error>(claim.finish(ran).await?.outcomes().to_vec())
        }));
        match i {
            0 => within(60, "the first member parking", hold.entered()).await,
            _ => until_queued(&cut_group, i + 1).await,
        }
    }
    hold.release();
    for (i, call) in calls.into_iter().enumerate() {
        match within(60, "a member of the cut group", call)
            .await
            .expect("no panic")
        {
            Err(Error::NotKept(NotKept::Group {
                scope, may_be_kept, ..
            })) => {
                assert_eq!(scope, GROUP);
                assert!(
                    may_be_kept,
                    "member {i}: a lost commit answer may have landed"
                );
            }
            other => panic!("member {i}: expected NotKept::Group, got {other:?}"),
        }
    }
    let cut = within(60, "the proxy cutting at the commit", proxy.cut()).await;
    until_session_gone(&ctx, cut).await;
    let marks = ctx.store.watermarks(GROUP, "orders").await.unwrap();
    let landed = match marks.as_slice() {
        [] => false,
        [(0, 5), (1, 5), (2, 5)] => true,
        other => panic!("all of the group or none of it: {other:?}"),
    };
    if let Some(want) = expect {
        assert_eq!(landed, want, "watermarks after the cut");
    }
    assert_eq!(ctx.effects_total().await, if landed { 15 } else { 0 });
    let direct = ctx.store.group(GroupOptions::new()).expect("valid options");
    let ctx = Arc::new(ctx);
    for batch in &batches[..3] {
        let again = deliver_grouped(&ctx, &direct, batch, Then::Commit).await;
        assert_eq!(again.unwrap(), if landed { [D; 5] } else { [A; 5] });
        let again = deliver_grouped(&ctx, &direct, batch, Then::Commit).await;
        assert_eq!(again.unwrap(), [D; 5]);
    }
    for p in 0..3 {
        for o in 0..5 {
            assert_eq!(ctx.effects(effect_id(p, o)).await, 1, "{p}/{o}");
        }
    }
    assert_eq!(ctx.effects_total().await, 15);
    pool.close().await;
    drop(proxy);
    Arc::into_inner(ctx).expect("no call left").cleanup().await;
}
