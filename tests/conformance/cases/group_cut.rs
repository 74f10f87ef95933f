//! Servers only: a group whose commit is cut by a proxy, so that no member can know whether the
//! group's work was kept. Every member gets `NotKept::Group { may_be_kept: true }`, never
//! `Applied`, and each one's redelivery settles it by its marker. (SQLite's commit is a call into a
//! file the process holds: it returns, or the process is gone with its callers.)

use std::sync::Arc;
use std::time::Duration;

use idem::{Error, GroupOptions, NotKept};

use super::ambiguous::{through_proxy, until_session_gone};
use crate::conformance::Server;
use crate::conformance::ctx::Ctx;
use crate::conformance::group_handlers::*;
use crate::conformance::handlers::*;
use crate::conformance::proxy::CutAt;
use crate::conformance::util::{until, within};

/// The group's commit message reaches the server; its answer never reaches the client. Every
/// member of the group is told its work may have been kept; the markers say whether it was
/// (all of the group or none of it), and each redelivery agrees: `Duplicate` if the commit
/// landed, `Applied` once if not.
pub(crate) async fn group_commit_cut_before_its_answer_fails_every_member_as_may_be_kept<
    S: Server,
>() {
    cut_group_commit::<S>("gambig", CutAt::Commit, None).await;
}

/// The same cut with the commit message dropped: the members see the same error (they cannot
/// tell the two apart), nothing was kept, and every redelivery applies once.
pub(crate) async fn group_commit_never_delivered_fails_every_member_and_redelivery_applies<
    S: Server,
>() {
    cut_group_commit::<S>("gnocommit", CutAt::InsteadOfCommit, Some(0)).await;
}

/// `expect`: the markers the cut must leave, when that is known.
async fn cut_group_commit<S: Server>(tag: &str, at: CutAt, expect: Option<i64>) {
    const MEMBERS: i64 = 4;
    let ctx = Ctx::<S>::new(tag, 4).await;
    let (mut proxy, pool, store) = through_proxy(&ctx, at).await;
    // One lane, and a delay bound far above what the calls take to queue: the four calls
    // make one group, whose one commit the proxy cuts.
    let cut_group = store
        .group(
            GroupOptions::new()
                .lanes(1)
                .max_delay(Duration::from_secs(1)),
        )
        .expect("valid options");
    let jobs: Vec<Job> = (1..=MEMBERS)
        .map(|i| ctx.job(&format!("job-{i}"), i, 10 * i))
        .collect();
    // Job 1 parks in its body, holding the lane, while the others queue behind it: once it
    // goes on, each is kept in turn and the last one, alone, closes the group.
    let hold = Arc::new(Hold::default());
    let first = {
        let (group, job, hold) = (cut_group.clone(), jobs[0].clone(), hold.clone());
        tokio::spawn(async move { apply_grouped_holding(&group, &job, &hold).await })
    };
    within(60, "job 1 parking in its body", hold.entered()).await;
    let mut calls = vec![first];
    for job in &jobs[1..] {
        let (group, job) = (cut_group.clone(), job.clone());
        calls.push(tokio::spawn(async move {
            apply_grouped(&group, &job, Then::Commit).await
        }));
    }
    until(120, "the calls queuing in the group", || async {
        tokio::time::sleep(Duration::from_millis(1)).await;
        cut_group.queued() == jobs.len()
    })
    .await;
    hold.release();
    for (job, call) in jobs.iter().zip(calls) {
        match within(60, "a member of the cut group", call)
            .await
            .expect("no panic")
        {
            Err(TestError::Idem(Error::NotKept(NotKept::Group {
                key, may_be_kept, ..
            }))) => {
                assert_eq!(key, job.key);
                assert!(
                    may_be_kept,
                    "{}: a lost commit answer may have landed",
                    job.key
                );
            }
            other => panic!("{}: expected NotKept::Group, got {other:?}", job.key),
        }
    }
    let cut = within(60, "the proxy cutting at the commit", proxy.cut()).await;
    until_session_gone(&ctx, cut).await;
    // All of the group or none of it.
    let landed = ctx.markers().await;
    assert!(landed == 0 || landed == MEMBERS, "{landed} markers");
    if let Some(want) = expect {
        assert_eq!(landed, want, "markers after the cut");
    }
    assert_eq!(
        ctx.effects_total().await,
        landed,
        "effects and markers commit together"
    );
    let direct = ctx.store.group(GroupOptions::new()).expect("valid options");
    for job in &jobs {
        let again = within(
            60,
            "a redelivery",
            apply_grouped(&direct, job, Then::Commit),
        )
        .await;
        match landed {
            0 => assert_eq!(applied(again), job.amount),
            _ => duplicate(again),
        }
        duplicate(apply_grouped(&direct, job, Then::Commit).await);
        assert_eq!(ctx.effects(job.id).await, 1, "{}", job.key);
    }
    assert_eq!(ctx.effects_total().await, MEMBERS);
    assert_eq!(ctx.markers().await, MEMBERS);
    pool.close().await;
    drop(proxy);
    ctx.cleanup().await;
}
