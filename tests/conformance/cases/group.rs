//! Group commit: concurrent single-job deliveries in one transaction, a savepoint each, one
//! commit. Each caller gets its own outcome once the group's commit is confirmed; a failure,
//! a cancelled caller or a lost connection costs only what it must.

use std::sync::Arc;
use std::time::Duration;

use idem::{ClaimOptions, Claimed, Error, Group, GroupOptions, Key, NotKept, Outcome};

use crate::conformance::ctx::Ctx;
use crate::conformance::group_handlers::*;
use crate::conformance::handlers::*;
use crate::conformance::util::{SplitMix, until, within};
use crate::conformance::{Server, Support};

fn jobs<S: Support>(ctx: &Ctx<S>, ids: impl IntoIterator<Item = i64>) -> Vec<Job> {
    ids.into_iter()
        .map(|i| ctx.job(&format!("job-{i}"), i, 10 * i))
        .collect()
}

fn group<S: Support>(ctx: &Ctx<S>, options: GroupOptions) -> Group<S::Db> {
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

pub(crate) async fn group_commits_concurrent_deliveries_of_each_key_once<S: Support>() {
    let ctx = Ctx::<S>::new("group", 36).await;
    // One lane: every call meets the others in one group at a time.
    let group = group(
        &ctx,
        GroupOptions::new()
            .lanes(1)
            .max_delay(Duration::from_millis(50)),
    );
    let mut deliveries: Vec<Job> = jobs(&ctx, 1..=16)
        .into_iter()
        .flat_map(|j| [j.clone(), j])
        .collect();
    SplitMix::new(30).shuffle(&mut deliveries);
    let waiting = Arc::new(Waiting::default());
    let tasks: Vec<_> = deliveries
        .into_iter()
        .map(|job| {
            let (group, waiting) = (group.clone(), waiting.clone());
            tokio::spawn(async move {
                let done = apply_grouped_counted(&group, &job, &waiting).await;
                (job.id, done)
            })
        })
        .collect();
    let mut applied = [0; 17];
    let mut duplicates = [0; 17];
    for task in tasks {
        let (id, done) = within(120, "a grouped delivery", task)
            .await
            .expect("no panic");
        match done {
            Ok(Outcome::Applied(v)) => {
                assert_eq!(v, 10 * id);
                applied[id as usize] += 1;
            }
            Ok(Outcome::Duplicate) => duplicates[id as usize] += 1,
            other => panic!("job {id}: {other:?}"),
        }
    }
    for id in 1..=16 {
        assert_eq!((applied[id], duplicates[id]), (1, 1), "job {id}");
        assert_eq!(ctx.effects(id as i64).await, 1, "job {id}");
    }
    assert_eq!((ctx.effects_total().await, ctx.markers().await), (16, 16));
    let most = waiting.most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(most > 1, "no two calls ever waited for one commit ({most})");
    ctx.cleanup().await;
}

pub(crate) async fn group_member_failure_rolls_back_only_its_savepoint<S: Support>() {
    let ctx = Ctx::<S>::new("groupfail", 12).await;
    let group = group(&ctx, GroupOptions::new().lanes(1));
    let hold = Arc::new(Hold::default());
    let batch = jobs(&ctx, 1..=6);
    // Job 1 parks in its body, holding the group's turn, while the others queue behind it.
    let first = {
        let (group, hold, job) = (group.clone(), hold.clone(), batch[0].clone());
        tokio::spawn(async move { apply_grouped_holding(&group, &job, &hold).await })
    };
    within(60, "the first call parking in its body", hold.entered()).await;
    let others: Vec<_> = batch[1..]
        .iter()
        .cloned()
        .map(|job| {
            let group = group.clone();
            tokio::spawn(async move {
                let then = if job.id == 3 {
                    Then::Fail
                } else {
                    Then::Commit
                };
                let done = match job.id % 2 {
                    0 => apply_grouped_by_hand(&group, &job, then).await,
                    _ => apply_grouped(&group, &job, then).await,
                };
                (job.id, done)
            })
        })
        .collect();
    until_queued(&group, 6).await;
    hold.release();
    assert_eq!(
        applied(within(60, "job 1", first).await.expect("no panic")),
        10
    );
    for task in others {
        let (id, done) = within(60, "a grouped delivery", task)
            .await
            .expect("no panic");
        match (id, done) {
            (3, Err(TestError::Refused)) => {}
            (id, Ok(Outcome::Applied(v))) if id != 3 => assert_eq!(v, 10 * id),
            (id, other) => panic!("job {id}: {other:?}"),
        }
    }
    assert_eq!((ctx.effects(3).await, ctx.effects_total().await), (0, 5));
    assert_eq!(ctx.markers().await, 5);
    assert_eq!(
        applied(apply_grouped(&group, &batch[2], Then::Commit).await),
        30
    );
    duplicate(apply(&ctx.store, &batch[2], Then::Commit).await);
    assert_eq!(ctx.effects_total().await, 6);
    ctx.cleanup().await;
}

/// A member whose body swallows a failed statement, with calls queued behind it (so that its
/// release also opens the next call's savepoint, in one message): on PostgreSQL its savepoint was
/// aborted, so it alone is rolled back, as `NotKept::RolledBack`; elsewhere the failed statement
/// undid only itself, and it is applied. Every other member commits either way. The same member
/// alone in its group is answered the same way.
pub(crate) async fn group_member_that_swallows_a_statement_error<S: Support>() {
    let mut ctx = Ctx::<S>::new("groupswallow", 12).await;
    let table = ctx
        .create_table("p", "(id BIGINT NOT NULL PRIMARY KEY)")
        .await;
    ctx.exec(&format!("INSERT INTO {table} (id) VALUES (0)"))
        .await;
    let group = group(&ctx, GroupOptions::new().lanes(1));
    let hold = Arc::new(Hold::default());
    let batch = jobs(&ctx, 1..=5);
    let first = {
        let (group, hold, job) = (group.clone(), hold.clone(), batch[0].clone());
        tokio::spawn(async move { apply_grouped_holding(&group, &job, &hold).await })
    };
    within(60, "the first call parking in its body", hold.entered()).await;
    // Queued one at a time, so that the lane takes them in this order: job 3 has two behind it.
    let mut others = Vec::new();
    for (queued, job) in (2..).zip(batch[1..].iter().cloned()) {
        let (member, table) = (group.clone(), table.clone());
        others.push(tokio::spawn(async move {
            let done = apply_grouped_swallowing(&member, &job, &table, 3).await;
            (job.id, done)
        }));
        until_queued(&group, queued).await;
    }
    hold.release();
    assert_eq!(
        applied(within(60, "job 1", first).await.expect("no panic")),
        10
    );
    let aborts = S::FAILED_STATEMENT_ABORTS;
    for task in others {
        let (id, done) = within(60, "a grouped delivery", task)
            .await
            .expect("no panic");
        match (id, done) {
            (3, Err(TestError::Idem(Error::NotKept(NotKept::RolledBack { key, .. }))))
                if aborts =>
            {
                assert_eq!(key, "job-3");
            }
            (id, Ok(Outcome::Applied(v))) if id != 3 || !aborts => assert_eq!(v, 10 * id),
            (id, other) => panic!("job {id}: {other:?}"),
        }
    }
    let kept = if aborts { 4 } else { 5 };
    assert_eq!(
        (ctx.effects_total().await, ctx.markers().await),
        (kept, kept)
    );
    assert_eq!(ctx.effects(3).await, kept - 4);
    // Alone in its group, the member leaves its savepoint for the commit to release; the
    // commit finds the savepoint aborted, and the member is told as one with company is.
    let lone = ctx.job("job-6", 6, 60);
    match apply_grouped_swallowing(&group, &lone, &table, 6).await {
        Err(TestError::Idem(Error::NotKept(NotKept::RolledBack { key, .. }))) if aborts => {
            assert_eq!(key, "job-6")
        }
        Ok(Outcome::Applied(60)) if !aborts => {}
        other => panic!("the lone swallowing member: {other:?}"),
    }
    assert_eq!(ctx.effects(6).await, kept - 4);
    let again = apply_grouped_swallowing(&group, &lone, &table, 0).await;
    match again {
        Ok(Outcome::Applied(60)) if aborts => {}
        Ok(Outcome::Duplicate) if !aborts => {}
        other => panic!("the lone member's redelivery: {other:?}"),
    }
    assert_eq!((ctx.effects(6).await, ctx.markers().await), (1, kept + 1));
    ctx.cleanup().await;
}

/// A grouped claim with `wait` behind a key another delivery holds gives up within it
/// (`InProgress`, nothing written), then finds the marker once that delivery committed; a free
/// key with `wait` is applied. Each is the first call of its group, whose savepoint the
/// group's `BEGIN` opened without the wait: the claim opens one that has it. The servers only:
/// on SQLite the group's `BEGIN` itself waits for the one writer.
pub(crate) async fn group_claim_that_stops_waiting_is_in_progress<S: Server>() {
    let ctx = Ctx::<S>::new("groupwait", 6).await;
    let group = group(&ctx, GroupOptions::new().lanes(1));
    let (held, free) = (ctx.job("job-held", 1, 10), ctx.job("job-free", 2, 20));
    let hold = Arc::new(Hold::default());
    let first = tokio::spawn({
        let (store, job, hold) = (ctx.store.clone(), held.clone(), hold.clone());
        async move { apply_holding(&store, &job, &hold).await }
    });
    within(60, "the first delivery parking in its body", hold.entered()).await;
    let options = ClaimOptions::new().wait(Duration::from_millis(300));
    let key = Key::new(&held.key).expect("a valid key");
    let claim = group.claim_with("apply", &key, options);
    match within(60, "the grouped claim", claim).await {
        Err(Error::InProgress { key: k, .. }) => assert_eq!(k, held.key),
        other => panic!("expected InProgress, got {:?}", other.map(|_| ())),
    }
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (0, 0));
    hold.release();
    assert_eq!(
        applied(within(60, "the first", first).await.expect("no panic")),
        10
    );
    let again = group.claim_with("apply", &key, options).await;
    assert!(
        matches!(again, Ok(Claimed::Duplicate)),
        "{:?}",
        again.map(|_| ())
    );
    let key = Key::new(&free.key).expect("a valid key");
    let Ok(Claimed::Fresh(mut guard)) = group.claim_with("apply", &key, options).await else {
        panic!("the free key was not claimed fresh");
    };
    insert_effect(guard.tx(), &free, "group")
        .await
        .expect("the effect");
    let done: Result<Outcome<i64>, TestError> = guard.finish(Ok(free.amount)).await;
    assert_eq!(applied(done), 20);
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (2, 2));
    ctx.cleanup().await;
}

/// A caller dropped while its body holds the group's turn: its savepoint is rolled back
/// before the next call runs, the others commit, and its redelivery applies it.
pub(crate) async fn cancelled_caller_in_a_group_keeps_nothing_and_others_commit<S: Support>() {
    let ctx = Ctx::<S>::new("groupcancel", 12).await;
    let group = group(&ctx, GroupOptions::new().lanes(1));
    let hold = Arc::new(Hold::default());
    let batch = jobs(&ctx, 1..=5);
    let cancelled = {
        let (group, hold, job) = (group.clone(), hold.clone(), batch[0].clone());
        tokio::spawn(async move { apply_grouped_holding(&group, &job, &hold).await })
    };
    within(60, "the first call parking in its body", hold.entered()).await;
    let others: Vec<_> = batch[1..]
        .iter()
        .cloned()
        .map(|job| {
            let group = group.clone();
            tokio::spawn(async move { (job.id, apply_grouped(&group, &job, Then::Commit).await) })
        })
        .collect();
    until_queued(&group, 5).await;
    cancelled.abort();
    assert!(within(60, "the cancelled call", cancelled).await.is_err());
    for task in others {
        let (id, done) = within(60, "a grouped delivery", task)
            .await
            .expect("no panic");
        assert_eq!(applied(done), 10 * id);
    }
    assert_eq!((ctx.effects(1).await, ctx.effects_total().await), (0, 4));
    assert_eq!(ctx.markers().await, 4);
    assert_eq!(
        applied(apply_grouped(&group, &batch[0], Then::Commit).await),
        10
    );
    assert_eq!(ctx.effects_total().await, 5);
    ctx.cleanup().await;
}

/// A kept call leaves its group open for the call waiting behind it, and that call is
/// cancelled in its body with no other call to come: the group's delay bound alone ends it,
/// rolling the cancelled call back and committing the first call's work.
pub(crate) async fn group_left_by_a_cancelled_call_commits_at_its_delay_bound<S: Support>() {
    let ctx = Ctx::<S>::new("groupbound", 12).await;
    let options = GroupOptions::new()
        .lanes(1)
        .max_delay(Duration::from_millis(100));
    let group = group(&ctx, options);
    let (first_hold, second_hold) = (Arc::new(Hold::default()), Arc::new(Hold::default()));
    let batch = jobs(&ctx, 1..=2);
    let call = |job: &Job, hold: &Arc<Hold>| {
        let (group, hold, job) = (group.clone(), hold.clone(), job.clone());
        tokio::spawn(async move { apply_grouped_holding(&group, &job, &hold).await })
    };
    let first = call(&batch[0], &first_hold);
    within(60, "the first call parking", first_hold.entered()).await;
    let second = call(&batch[1], &second_hold);
    until_queued(&group, 2).await;
    // The first call's turn ends with the second waiting: the group stays open for it.
    first_hold.release();
    within(60, "the second call parking", second_hold.entered()).await;
    second.abort();
    assert!(within(60, "the cancelled call", second).await.is_err());
    let done = within(60, "the first call's commit", first).await;
    assert_eq!(applied(done.expect("no panic")), 10);
    assert_eq!((ctx.effects(1).await, ctx.effects(2).await), (1, 0));
    assert_eq!(ctx.markers().await, 1);
    let again = apply_grouped(&group, &batch[1], Then::Commit).await;
    assert_eq!(applied(again), 20);
    assert_eq!(ctx.effects_total().await, 2);
    ctx.cleanup().await;
}

/// A body that never ends in a group: past `max_body` it is stopped and fails alone
/// (`NotKept::TimedOut`, nothing of it kept), the call kept before it in its group commits, and
/// the redelivery applies it once; the same for a body run by hand with `Body::bounded`.
pub(crate) async fn group_body_past_its_bound_fails_alone_and_the_group_commits<S: Support>() {
    let ctx = Ctx::<S>::new("groupbody", 12).await;
    // The delay bound at its longest, so that the first call's group is still open when the
    // hanging call's turn comes (unless the machine stalls for a second; the outcomes hold
    // either way).
    let options = GroupOptions::new()
        .lanes(1)
        .max_delay(Duration::from_secs(1))
        .max_body(Duration::from_millis(100));
    let group = group(&ctx, options);
    let hold = Arc::new(Hold::default());
    let batch = jobs(&ctx, 1..=3);
    let first = {
        let (group, hold, job) = (group.clone(), hold.clone(), batch[0].clone());
        tokio::spawn(async move { apply_grouped_by_hand_parking(&group, &job, &hold).await })
    };
    within(60, "the first call parking", hold.entered()).await;
    let hanging = {
        let (group, job) = (group.clone(), batch[1].clone());
        tokio::spawn(async move { apply_grouped(&group, &job, Then::Hang).await })
    };
    until_queued(&group, 2).await;
    hold.release();
    let done = within(60, "the first call's commit", first).await;
    assert_eq!(applied(done.expect("no panic")), 10);
    let hung = within(60, "the hanging call", hanging).await;
    let by_hand = apply_grouped_by_hand(&group, &batch[2], Then::Hang).await;
    for (hung, job) in [(hung.expect("no panic"), &batch[1]), (by_hand, &batch[2])] {
        match hung {
            Err(TestError::Idem(Error::NotKept(NotKept::TimedOut { key, after, .. }))) => {
                assert_eq!((key, after), (job.key.clone(), Duration::from_millis(100)));
            }
            other => panic!("expected NotKept::TimedOut for {}, got {other:?}", job.key),
        }
    }
    let effects = (
        ctx.effects(1).await,
        ctx.effects(2).await,
        ctx.effects(3).await,
    );
    assert_eq!((effects, ctx.markers().await), ((1, 0, 0), 1));
    let again = apply_grouped(&group, &batch[1], Then::Commit).await;
    assert_eq!(applied(again), 20);
    let again = apply_grouped_by_hand(&group, &batch[2], Then::Commit).await;
    assert_eq!(applied(again), 30);
    assert_eq!((ctx.effects_total().await, ctx.markers().await), (3, 3));
    ctx.cleanup().await;
}

/// Group commit beside transaction mode and lease mode on the same scope and keys: every key
/// applied once, every delivery's outcome right.
pub(crate) async fn group_beside_transaction_and_lease_mode_applies_each_key_once<S: Support>() {
    let ctx = Ctx::<S>::new("groupmix", 40).await;
    let group = group(&ctx, GroupOptions::new());
    let batch = jobs(&ctx, 1..=12);
    let mut tasks = Vec::new();
    for job in &batch {
        for mode in 0..3 {
            let (group, store, job) = (group.clone(), ctx.store.clone(), job.clone());
            tasks.push(tokio::spawn(async move {
                let done = match mode {
                    0 => apply_grouped(&group, &job, Then::Commit).await,
                    1 => apply(&store, &job, Then::Commit).await,
                    _ => lease_apply(&store, &job).await,
                };
                (job.id, mode, done)
            }));
        }
    }
    let mut applied = [0; 13];
    for task in tasks {
        let (id, mode, done) = within(120, "a delivery", task).await.expect("no panic");
        match done {
            Ok(Outcome::Applied(v)) => {
                assert_eq!(v, 10 * id);
                applied[id as usize] += 1;
            }
            Ok(Outcome::Duplicate) => {}
            // A delivery that met a live lease, or a lease delivery that met a transaction
            // holding the key: nothing ran (the caller nacks, and its redelivery is below).
            Err(TestError::Idem(Error::InProgress { .. })) => {}
            other => panic!("job {id} in mode {mode}: {other:?}"),
        }
    }
    for (id, applied) in applied.iter().enumerate().skip(1) {
        assert_eq!(*applied, 1, "job {id}");
        assert_eq!(ctx.effects(id as i64).await, 1, "job {id}");
    }
    // Later deliveries of every mode are duplicates.
    for job in &batch {
        duplicate(apply_grouped(&group, job, Then::Commit).await);
        duplicate(apply(&ctx.store, job, Then::Commit).await);
        duplicate(lease_apply(&ctx.store, job).await);
    }
    ctx.cleanup().await;
}

/// `replay`, a fingerprint and the outbox in a group: the first value replayed, another
/// payload refused, one message per applied job.
pub(crate) async fn group_keeps_replay_fingerprint_and_outbox<S: Support>() {
    let ctx = Ctx::<S>::new("groupreplay", 12).await;
    let group = group(&ctx, GroupOptions::new());
    let batch = jobs(&ctx, 1..=4);
    let firsts = futures_join(batch.iter().map(|job| apply_grouped_replay(&group, job))).await;
    for (done, job) in firsts.into_iter().zip(&batch) {
        assert_eq!(applied(done), job.amount);
    }
    for job in &batch {
        match apply_grouped_replay(&group, job).await {
            Ok(Outcome::Replayed(v)) => assert_eq!(v, job.amount),
            other => panic!("expected Replayed, got {other:?}"),
        }
    }
    let sent = futures_join(batch.iter().map(|job| apply_grouped_sending(&group, job))).await;
    assert!(
        sent.into_iter()
            .all(|d| matches!(d, Ok(Outcome::Applied(_))))
    );
    let mut other = batch[0].clone();
    other.amount += 1;
    match apply_grouped_sending(&group, &other).await {
        Err(TestError::Idem(Error::KeyReused { .. })) => {}
        other => panic!("expected KeyReused, got {other:?}"),
    }
    duplicate(apply_grouped_sending(&group, &batch[1]).await);
    let outbox = format!("{}_outbox", ctx.store.table());
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {outbox}")).await,
        4
    );
    assert_eq!(ctx.effects_total().await, 8);
    ctx.cleanup().await;
}

/// Runs `futures` at once (on this task), their outputs in their order.
pub(super) async fn futures_join<F: std::future::Future>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output> {
    let mut out = Vec::new();
    let pinned: Vec<_> = futures.map(Box::pin).collect();
    let mut pending: Vec<_> = pinned.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (slot, result) in pending.iter_mut().zip(results.iter_mut()) {
            if let Some(fut) = slot {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *result = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(results.into_iter().map(|r| r.expect("ready")));
    out
}

/// The group's connection killed while a call's body runs in it: the call before it, kept in the
/// same group, gets `NotKept::Group` (nothing kept), the calls after it commit in a new group, and
/// redelivery applies the lost ones once.
pub(crate) async fn killed_connection_fails_its_group_and_redelivery_applies_once<S: Server>() {
    let ctx = Ctx::<S>::new("groupkill", 12).await;
    let killer = S::connect(&ctx.url, 1).await;
    let group = group(
        &ctx,
        GroupOptions::new()
            .lanes(1)
            .max_delay(Duration::from_secs(1)),
    );
    let batch = jobs(&ctx, 1..=4);
    let hold = Arc::new(Hold::default());
    // Job 1 parks in its body while job 2 queues, so that job 1 is kept into a group that
    // stays open for job 2.
    let first = {
        let (group, hold, job) = (group.clone(), hold.clone(), batch[0].clone());
        tokio::spawn(async move { apply_grouped_holding(&group, &job, &hold).await })
    };
    within(60, "job 1 parking in its body", hold.entered()).await;
    let (entered, go) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let second = {
        let (group, job, killer) = (group.clone(), batch[1].clone(), killer.clone());
        let (entered, go) = (entered.clone(), go.clone());
        tokio::spawn(async move {
            let key = idem::Key::new(&job.key).map_err(idem::Error::from)?;
            match group.claim("apply", &key).await? {
                idem::Claimed::Fresh(mut guard) => {
                    insert_effect(guard.tx(), &job, "group").await?;
                    entered.notify_one();
                    go.notified().await;
                    let id = S::connection_id(&mut **guard.tx()).await;
                    S::kill(&killer, id).await;
                    let result = insert_effect(guard.tx(), &job, "group").await;
                    guard
                        .finish(result.map(|()| job.amount).map_err(TestError::from))
                        .await
                }
                _ => panic!("job 2 was fresh"),
            }
        })
    };
    until_queued(&group, 2).await;
    hold.release();
    within(60, "job 2 in its body", entered.notified()).await;
    let rest: Vec<_> = batch[2..]
        .iter()
        .cloned()
        .map(|job| {
            let group = group.clone();
            tokio::spawn(async move { (job.id, apply_grouped(&group, &job, Then::Commit).await) })
        })
        .collect();
    until_queued(&group, 3).await;
    go.notify_one();
    match within(60, "job 1", first).await.expect("no panic") {
        Err(TestError::Idem(Error::NotKept(NotKept::Group {
            key, may_be_kept, ..
        }))) => {
            assert_eq!((key.as_str(), may_be_kept), ("job-1", false));
        }
        other => panic!("job 1: expected NotKept::Group, got {other:?}"),
    }
    match within(60, "job 2", second).await.expect("no panic") {
        Err(TestError::Db(_) | TestError::Idem(_)) => {}
        other => panic!("job 2: expected its error, got {other:?}"),
    }
    for task in rest {
        let (id, done) = within(60, "a later delivery", task)
            .await
            .expect("no panic");
        assert_eq!(applied(done), 10 * id);
    }
    assert_eq!((ctx.effects(1).await, ctx.effects(2).await), (0, 0));
    assert_eq!(ctx.markers().await, 2);
    for job in &batch[..2] {
        assert_eq!(
            applied(apply_grouped(&group, job, Then::Commit).await),
            job.amount
        );
    }
    for job in &batch {
        duplicate(apply_grouped(&group, job, Then::Commit).await);
        assert_eq!(ctx.effects(job.id).await, 1, "job {}", job.id);
    }
    killer.close().await;
    ctx.cleanup().await;
}

/// The hot-row workload on the default options: 50 jobs on 10 accounts, each job delivered
/// twice, every delivery at once. No error reaches a caller (no deadlock between the group's
/// transactions), each job is applied once and the balances are exact.
pub(crate) async fn group_on_its_defaults_applies_hot_rows_without_deadlock<S: Support>() {
    hot_rows::<S>("hot", GroupOptions::new(), Lane::Key).await;
}

/// The hot-row workload on four lanes, each call in the lane of its account (`lane = ..` and
/// `Group::claim_in_lane`, deliveries alternating between the two): as on one lane, no error
/// reaches a caller, and the balances are exact.
pub(crate) async fn group_lanes_by_account_apply_hot_rows_without_deadlock<S: Support>() {
    let options = GroupOptions::new().lanes(4);
    hot_rows::<S>("hotlane", options, Lane::Account).await;
}

/// Four lanes, each call in the lane of its account: while a call (by hand) holds its lane's
/// turn, a call of the macro naming the same account waits for it, as calls in one lane do,
/// and calls naming the other accounts go on and commit in the other lanes. (Not on SQLite,
/// where an open group holds the database's one write lock and no other lane commits.)
pub(crate) async fn group_calls_naming_the_same_rows_take_turns_in_one_lane<S: Server>() {
    const ACCOUNTS: i64 = 10;
    const PARKED: i64 = 7;
    let mut ctx = Ctx::<S>::new("lanerows", 20).await;
    let accounts = ctx
        .create_table("a", "(id BIGINT PRIMARY KEY, credits BIGINT NOT NULL)")
        .await;
    let rows: Vec<String> = (1..=ACCOUNTS).map(|a| format!("({a}, 0)")).collect();
    ctx.exec(&format!(
        "INSERT INTO {accounts} VALUES {}",
        rows.join(", ")
    ))
    .await;
    let group = group(&ctx, GroupOptions::new().lanes(4));
    let hold = Arc::new(Hold::default());
    // Job 1 parks on account 7, job 2 names account 7 too; jobs 3 to 11 name the others.
    let batch = jobs(&ctx, 1..=ACCOUNTS + 1);
    let account_of = |id: i64| match id {
        1 | 2 => PARKED,
        id => (1..=ACCOUNTS)
            .filter(|a| *a != PARKED)
            .nth(id as usize - 3)
            .expect("9 others"),
    };
    let first = {
        let (group, hold, job, accounts) = (
            group.clone(),
            hold.clone(),
            batch[0].clone(),
            accounts.clone(),
        );
        tokio::spawn(async move {
            top_up_in_its_lane_by_hand(&group, &job, &accounts, PARKED, Some(&hold)).await
        })
    };
    within(60, "the first call parking", hold.entered()).await;
    let same = {
        let (group, job, accounts) = (group.clone(), batch[1].clone(), accounts.clone());
        tokio::spawn(async move { top_up_in_its_lane(&group, &job, &accounts, PARKED).await })
    };
    until_queued(&group, 2).await;
    let others: Vec<_> = batch[2..]
        .iter()
        .map(|job| {
            let (group, job, accounts) = (group.clone(), job.clone(), accounts.clone());
            let to = account_of(job.id);
            tokio::spawn(async move {
                top_up_in_its_lane_by_hand(&group, &job, &accounts, to, None).await
            })
        })
        .collect();
    // Nine accounts over four lanes: some are not in the parked call's lane (all nine in it
    // is a chance of one in 4^9), and those commit while it is parked.
    until(120, "a call in another lane committing", || async {
        tokio::time::sleep(Duration::from_millis(1)).await;
        ctx.effects_total().await > 0
    })
    .await;
    assert_eq!(
        ctx.effects(2).await,
        0,
        "the call naming the parked call's account ran beside it"
    );
    assert!(!same.is_finished());
    hold.release();
    let answers = [first, same].into_iter().chain(others);
    for (task, job) in answers.zip(&batch) {
        let answer = within(60, "a call's answer", task).await.expect("no panic");
        assert!(
            matches!(answer, Ok(Outcome::Applied(()))),
            "job {}: {answer:?}",
            job.id
        );
    }
    for a in 1..=ACCOUNTS {
        let expected: i64 = batch
            .iter()
            .filter(|j| account_of(j.id) == a)
            .map(|j| j.amount)
            .sum();
        let credits = ctx
            .scalar(&format!("SELECT credits FROM {accounts} WHERE id = {a}"))
            .await;
        assert_eq!(credits, expected, "account {a}");
    }
    assert_eq!(
        (ctx.effects_total().await, ctx.markers().await),
        (ACCOUNTS + 1, ACCOUNTS + 1)
    );
    ctx.cleanup().await;
}

/// How the hot-row calls pick their lanes.
#[derive(Clone, Copy)]
enum Lane {
    /// By the job's key (no `lane`).
    Key,
    /// By the account, through the macro and by hand in turn.
    Account,
}

async fn hot_rows<S: Support>(name: &str, options: GroupOptions, lane: Lane) {
    const JOBS: i64 = 50;
    const ACCOUNTS: i64 = 10;
    let lanes = options.get_lanes() as u32;
    let mut ctx = Ctx::<S>::new(name, 12 + 2 * lanes).await;
    let accounts = ctx
        .create_table("a", "(id BIGINT PRIMARY KEY, credits BIGINT NOT NULL)")
        .await;
    let rows: Vec<String> = (1..=ACCOUNTS).map(|a| format!("({a}, 0)")).collect();
    ctx.exec(&format!(
        "INSERT INTO {accounts} VALUES {}",
        rows.join(", ")
    ))
    .await;
    let group = group(&ctx, options);
    let account = |id: i64| id % ACCOUNTS + 1;
    let mut deliveries: Vec<Job> = jobs(&ctx, 1..=JOBS)
        .into_iter()
        .flat_map(|j| [j.clone(), j])
        .collect();
    SplitMix::new(48).shuffle(&mut deliveries);
    let tasks: Vec<_> = deliveries
        .into_iter()
        .enumerate()
        .map(|(n, job)| {
            let (group, accounts) = (group.clone(), accounts.clone());
            tokio::spawn(async move {
                let to = account(job.id);
                let done = match (lane, n % 2) {
                    (Lane::Key, _) => top_up_grouped(&group, &job, &accounts, to).await,
                    (Lane::Account, 0) => top_up_in_its_lane(&group, &job, &accounts, to).await,
                    (Lane::Account, _) => {
                        top_up_in_its_lane_by_hand(&group, &job, &accounts, to, None).await
                    }
                };
                (job.id, done)
            })
        })
        .collect();
    let mut applied = vec![0; JOBS as usize + 1];
    for task in tasks {
        let (id, done) = within(120, "a grouped delivery", task)
            .await
            .expect("no panic");
        match done {
            Ok(Outcome::Applied(())) => applied[id as usize] += 1,
            Ok(Outcome::Duplicate) => {}
            other => panic!("job {id} on {options:?}: {other:?}"),
        }
    }
    assert!(applied[1..].iter().all(|n| *n == 1), "{applied:?}");
    assert_eq!(
        (ctx.effects_total().await, ctx.markers().await),
        (JOBS, JOBS)
    );
    for a in 1..=ACCOUNTS {
        // Job i (amount 10 i) tops up account i % 10 + 1.
        let expected: i64 = (1..=JOBS)
            .filter(|i| account(*i) == a)
            .map(|i| 10 * i)
            .sum();
        let credits = ctx
            .scalar(&format!("SELECT credits FROM {accounts} WHERE id = {a}"))
            .await;
        assert_eq!(credits, expected, "account {a}");
    }
}
