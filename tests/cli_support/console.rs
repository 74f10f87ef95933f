//! `idem console`: the web console served by the tool, read-only and with `--admin`, spoken to
//! over plain HTTP on loopback. Failures grouped, a group requeued by an admin only (a
//! read-only visitor, a form without the token and a forged token refused with nothing
//! changed), the requeued jobs run again exactly once, one job and a parked outbox message
//! requeued, and every action in the audit log; every change counted in the database.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::outbox::{ParkedFilter, Relay};
use idem::{Claimed, FailedFilter, FailureGroup, Key, LeaseOptions, Outcome};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;
use tokio::process::Child;

use crate::Db;
use crate::cli_support::outbox::{Refusing, Taking};
use crate::cli_support::{Fixture, SCOPE, TIMEOUT};

const DECLINED: &str = "card declined";
const DECLINED_JOBS: i64 = 30;
const TIMEOUT_JOBS: i64 = 12;

/// One `idem console` process, killed with the test.
struct Served {
    _child: Child,
    address: String,
}

impl Served {
    async fn start<B: Db>(fx: &Fixture<B>, admin: bool) -> Served {
        let mut args = vec![
            "--database-url",
            fx.url.as_str(),
            "--table",
            fx.table(),
            "--actor",
            "carol",
            "console",
            "--listen",
            "127.0.0.1:0",
        ];
        if admin {
            args.push("--admin");
        }
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(&args)
            .env_remove("DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the idem binary starts");
        // Its first line says where it listens, once it does.
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let line = lines.next_line().await.unwrap().expect("a first line");
        let address = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_owned();
        let said = if admin {
            "acts as carol (--admin)"
        } else {
            "read-only"
        };
        assert!(line.contains(said), "{line}");
        Served {
            _child: child,
            address,
        }
    }

    async fn get(&self, path: &str) -> (u16, String) {
        self.send("GET", path, "").await
    }

    async fn post(&self, path: &str, form: &str) -> (u16, String) {
        self.send("POST", path, form).await
    }

    /// One HTTP/1.1 request on a connection of its own: the status and the body.
    async fn send(&self, method: &str, path: &str, form: &str) -> (u16, String) {
        let mut stream = TcpStream::connect(&self.address).await.expect("connect");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
            self.address,
            form.len()
        );
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        let (head, body) = response.split_once("\r\n\r\n").expect("a head");
        assert!(
            !head
                .to_ascii_lowercase()
                .contains("transfer-encoding: chunked"),
            "{head}"
        );
        let status = head[9..12].parse().expect("a status");
        (status, body.to_owned())
    }
}

/// The token of an admin's form on `page`.
fn token_of(page: &str) -> String {
    let at = page
        .find("name=\"token\" value=\"")
        .expect("a form with a token")
        + 20;
    page[at..at + 64].to_owned()
}

/// The table row of `page` that holds `text`.
fn row_with<'p>(page: &'p str, text: &str) -> &'p str {
    page.split("<tr>")
        .find(|row| row.contains(text))
        .unwrap_or_else(|| panic!("no row with {text} in {page}"))
}

async fn audit_rows<B: Db>(fx: &Fixture<B>) -> i64 {
    B::count(
        &fx.pool,
        &format!("SELECT COUNT(*) FROM {}_audit", fx.table()),
    )
    .await
}

pub(crate) async fn console_requeues_a_failure_group_for_an_admin_only<B: Db>() {
    let fx = Fixture::<B>::new("console").await;
    fx.fail_many("declined", 0..DECLINED_JOBS, DECLINED).await;
    fx.fail_many("timeout", 0..TIMEOUT_JOBS, TIMEOUT).await;
    let declined_id = FailureGroup::id_of(SCOPE, DECLINED);
    let timeout_id = FailureGroup::id_of(SCOPE, TIMEOUT);
    let reader = Served::start(&fx, false).await;
    let admin = Served::start(&fx, true).await;

    // Grouped, the larger group first, each linked to its page.
    let (status, page) = reader.get("/failures").await;
    assert_eq!(status, 200, "{page}");
    let declined_at = page.find(&format!("/failures/{declined_id}\"")).unwrap();
    let timeout_at = page.find(&format!("/failures/{timeout_id}\"")).unwrap();
    assert!(declined_at < timeout_at, "{page}");
    assert!(row_with(&page, &timeout_id).contains(&format!("<td>{TIMEOUT_JOBS}</td>")));
    assert!(row_with(&page, &declined_id).contains(&format!("<td>{DECLINED_JOBS}</td>")));

    // The group's page is the dry run: it counts, lists, and offers a reader no action.
    let group = format!("/failures/{timeout_id}");
    let (status, page) = reader.get(&group).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains(&format!("<b id=\"count\">{TIMEOUT_JOBS}</b>")),
        "{page}"
    );
    assert_eq!(page.matches("/job?scope=").count(), TIMEOUT_JOBS as usize);
    assert!(
        !page.contains("method=\"post\"") && page.contains("read-only"),
        "{page}"
    );
    let (status, page) = admin.get(&group).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("carol (admin)"), "{page}");
    let token = token_of(&page);

    // Refused, nothing changed: a reader's post (even with an admin's token), an admin's
    // post without the token, and with a token not this console's.
    let before = (DECLINED_JOBS, TIMEOUT_JOBS, 0);
    let action = format!("{group}/requeue");
    for (console, form, says) in [
        (
            &reader,
            format!("token={token}&count=12"),
            "read-only for you",
        ),
        (&admin, "count=12".to_owned(), "token is missing"),
        (
            &admin,
            format!("token={}&count=12", "0".repeat(64)),
            "token is missing",
        ),
    ] {
        let (status, page) = console.post(&action, &form).await;
        assert_eq!(status, 403, "{form}: {page}");
        assert!(
            page.contains(says) && page.contains("nothing was changed"),
            "{page}"
        );
        assert_eq!(fx.counts(DECLINED).await, before);
    }
    assert_eq!(audit_rows(&fx).await, 0);

    // The admin's requeue: that group, at most what the page counted, audited.
    let (status, page) = admin
        .post(&action, &format!("token={token}&count={TIMEOUT_JOBS}"))
        .await;
    assert_eq!(status, 200, "{page}");
    let said = format!("requeued {TIMEOUT_JOBS} failed jobs of group {timeout_id}");
    assert!(page.contains(&said), "{page}");
    assert_eq!(fx.counts(DECLINED).await, (DECLINED_JOBS, 0, TIMEOUT_JOBS));
    let log = fx.store.audit_log(10).await.unwrap();
    let row = (
        log[0].actor.as_str(),
        log[0].action.as_str(),
        log[0].changed,
    );
    assert_eq!(
        (log.len(), row),
        (1, ("carol", "console requeue --all", 12))
    );
    assert!(log[0].target.contains(&timeout_id), "{:?}", log[0]);
    let (_, page) = reader.get("/audit").await;
    assert!(
        row_with(&page, "console requeue --all").contains("<td>carol</td>"),
        "{page}"
    );
    // Sent again (the page reloaded): the group is gone, nothing more is changed.
    let (status, _) = admin
        .post(&action, &format!("token={token}&count={TIMEOUT_JOBS}"))
        .await;
    assert_eq!(status, 404);
    assert_eq!(audit_rows(&fx).await, 1);

    // The requeued jobs run again, each exactly once: the next delivery takes the released
    // lease and completes it; the one after is a duplicate.
    let options = LeaseOptions::new(Duration::from_secs(30));
    let mut ran = 0;
    for n in 0..TIMEOUT_JOBS {
        let key = Key::new(&format!("timeout-{n}")).unwrap();
        for delivery in 0..2 {
            match fx.store.lease(SCOPE, &key, options).await.unwrap() {
                Claimed::Fresh(lease) if delivery == 0 => {
                    ran += 1;
                    let done = lease.finish::<(), idem::Error>(Ok(())).await.unwrap();
                    assert_eq!(done, Outcome::Applied(()));
                }
                Claimed::Duplicate if delivery == 1 => {}
                other => panic!("delivery {delivery} of {key}: {other:?}"),
            }
        }
    }
    assert_eq!(ran, TIMEOUT_JOBS);
    assert_eq!(fx.counts(DECLINED).await, (DECLINED_JOBS, 0, 0));

    // The overview counts them: applied now, failed two hours ago, in the last day.
    let day = Duration::from_secs(86_400);
    let counts = fx
        .store
        .outcomes(Some(SCOPE), day, Duration::from_secs(3_600), 100)
        .await
        .unwrap();
    let sums = counts
        .iter()
        .fold((0, 0), |(a, f), c| (a + c.applied, f + c.failed));
    assert_eq!(
        sums,
        (TIMEOUT_JOBS as u64, DECLINED_JOBS as u64),
        "{counts:?}"
    );
    assert!(
        counts
            .iter()
            .all(|c| c.from % 3_600 == 0 && c.scope == SCOPE)
    );
    let (status, page) = reader.get("/").await;
    assert_eq!(status, 200, "{page}");
    let row = row_with(&page, SCOPE);
    assert!(row.contains(&format!("<td>{TIMEOUT_JOBS}</td>")), "{row}");
    assert!(row.contains(&format!(">{DECLINED_JOBS}</a>")), "{row}");

    // One job: its page, and its requeue by the admin alone.
    let job = "/job?scope=billing.charge&key=declined-3";
    let (status, page) = reader.get(job).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("<td>failed</td>") && page.contains(DECLINED),
        "{page}"
    );
    assert!(!page.contains("method=\"post\""), "{page}");
    let (_, page) = admin.get(job).await;
    let form = format!(
        "token={}&scope=billing.charge&key=declined-3",
        token_of(&page)
    );
    let (status, _) = reader.post("/job/requeue", &form).await;
    assert_eq!(status, 403);
    let (status, page) = admin.post("/job/requeue", &form).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(fx.counts(DECLINED).await, (DECLINED_JOBS - 1, 0, 1));
    let (status, _) = admin.post("/job/requeue", &form).await;
    assert_eq!(status, 409, "not failed any more: nothing changed");
    assert_eq!(audit_rows(&fx).await, 2);
    let filter = FailedFilter::new().scope(SCOPE);
    assert_eq!(fx.store.count_failed(&filter).await.unwrap(), 29);

    // Bad input is the asker's; a group that is not there is not found.
    assert_eq!(reader.get("/failures/XYZ").await.0, 400);
    assert_eq!(reader.get("/failures/0123456789ab").await.0, 404);
    assert_eq!(
        reader.get("/job?scope=billing.charge&key=nobody").await.0,
        404
    );
    assert_eq!(reader.get("/job?scope=&key=k").await.0, 400);
    fx.cleanup().await;
}

pub(crate) async fn console_requeues_a_parked_message_that_the_relay_then_sends<B: Db>() {
    let fx = Fixture::<B>::new("console_outbox").await;
    let first = B::place(&fx.store, "order-1", 1).await;
    let second = B::place(&fx.store, "order-2", 1).await;
    let refused = Relay::new(fx.store.clone(), Refusing)
        .max_attempts(1)
        .backoff(Duration::ZERO);
    assert_eq!(refused.relay_once().await.unwrap().parked, 2);
    let reader = Served::start(&fx, false).await;
    let admin = Served::start(&fx, true).await;

    let (status, page) = reader.get("/outbox").await;
    assert_eq!(status, 200, "{page}");
    assert!(
        row_with(&page, &first[0]).contains("<td>parked</td>"),
        "{page}"
    );
    assert!(!page.contains("method=\"post\""), "{page}");
    let (_, page) = admin.get("/outbox").await;
    assert_eq!(page.matches("/outbox/requeue\"").count(), 2, "{page}");
    // The job's page lists what it sent, found by the messages' ids.
    let stored = fx.store.outbox_message(&second[0]).await.unwrap().unwrap();
    let job = format!("/job?scope={}&key={}", stored.scope, stored.key);
    let (status, shown) = reader.get(&job).await;
    assert_eq!(status, 200, "{shown}");
    let table = &shown[shown.find("id=\"messages\"").expect("the job's messages")..];
    assert_eq!(
        table.matches("<tr>").count(),
        2,
        "a header and one message: {shown}"
    );
    assert!(
        row_with(table, &second[0]).contains("<td>parked</td>"),
        "{shown}"
    );
    let form = format!("token={}&id={}", token_of(&page), first[0]);
    let (status, _) = reader.post("/outbox/requeue", &form).await;
    assert_eq!(status, 403);
    assert_eq!(
        fx.store.count_parked(&ParkedFilter::new()).await.unwrap(),
        2
    );
    let (status, page) = admin.post("/outbox/requeue", &form).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(
        fx.store.count_parked(&ParkedFilter::new()).await.unwrap(),
        1
    );
    let log = fx.store.audit_log(10).await.unwrap();
    let row = (
        log[0].actor.as_str(),
        log[0].action.as_str(),
        log[0].target.as_str(),
    );
    assert_eq!(
        (log.len(), row),
        (1, ("carol", "console outbox requeue", first[0].as_str()))
    );

    // The relay sends it, and only it: the other stays parked.
    let published = Arc::new(Mutex::new(Vec::new()));
    let taking = Relay::new(fx.store.clone(), Taking(published.clone()));
    assert_eq!(taking.relay_once().await.unwrap().sent, 1);
    assert_eq!(*published.lock().unwrap(), first);
    let (_, page) = reader.get("/outbox").await;
    assert!(
        row_with(&page, &second[0]).contains("<td>parked</td>"),
        "{page}"
    );
    assert!(!page.contains(&first[0]), "{page}");

    // Every parked message at once, behind its count: the one left.
    let (status, page) = reader.get("/outbox/parked").await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("<b id=\"count\">1</b>") && page.contains(&second[0]),
        "{page}"
    );
    assert!(!page.contains("method=\"post\""), "{page}");
    let (_, page) = admin.get("/outbox/parked").await;
    let form = format!("token={}&count=1", token_of(&page));
    assert_eq!(reader.post("/outbox/requeue-all", &form).await.0, 403);
    assert_eq!(
        fx.store.count_parked(&ParkedFilter::new()).await.unwrap(),
        1
    );
    let (status, page) = admin.post("/outbox/requeue-all", &form).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("requeued 1 parked messages"), "{page}");
    assert_eq!(
        fx.store.count_parked(&ParkedFilter::new()).await.unwrap(),
        0
    );
    let log = fx.store.audit_log(10).await.unwrap();
    let row = (
        log[0].actor.as_str(),
        log[0].action.as_str(),
        log[0].changed,
    );
    assert_eq!(
        (log.len(), row),
        (2, ("carol", "console outbox requeue --all", 1))
    );
    assert_eq!(taking.relay_once().await.unwrap().sent, 1);
    assert_eq!(
        *published.lock().unwrap(),
        [first[0].clone(), second[0].clone()]
    );
    let (_, page) = reader.get(&job).await;
    assert!(
        row_with(&page, &second[0]).contains("<td>sent</td>"),
        "{page}"
    );
    fx.cleanup().await;
}

pub(crate) async fn console_forgets_the_stuck_leases_no_delivery_holds<B: Db>() {
    let fx = Fixture::<B>::new("console_stuck").await;
    let held = fx.lease(SCOPE, "held", 300).await;
    // Two holders that stopped (kept, never finished): their leases ran out.
    let mut stopped = Vec::new();
    for key in ["gone-1", "gone-2"] {
        stopped.push(fx.lease(SCOPE, key, 300).await);
        fx.expire(SCOPE, key).await;
    }
    let token = |m: idem::Marker| m.token.expect("a lease's token");
    let before = token(fx.store.inspect(SCOPE, "gone-1").await.unwrap().unwrap());
    let held_token = token(fx.store.inspect(SCOPE, "held").await.unwrap().unwrap());
    let reader = Served::start(&fx, false).await;
    let admin = Served::start(&fx, true).await;

    let (status, page) = reader.get("/stuck?minutes=0").await;
    assert_eq!(status, 200, "{page}");
    let counted = page.contains("3 markers in progress") && page.contains("holds the lease of 1");
    assert!(counted, "{page}");
    assert_eq!(page.matches("/job?scope=").count(), 3, "{page}");
    assert!(!page.contains("method=\"post\""), "{page}");
    let (_, page) = admin.get("/stuck?minutes=0").await;
    assert!(page.contains("Forget the 2 not held"), "{page}");
    let form = format!("token={}&minutes=0&count=3", token_of(&page));
    assert_eq!(reader.post("/stuck/forget", &form).await.0, 403);
    assert_eq!(audit_rows(&fx).await, 0);
    let (status, page) = admin.post("/stuck/forget", &form).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("forgot 2 leases"), "{page}");
    let log = fx.store.audit_log(10).await.unwrap();
    let row = (log[0].action.as_str(), log[0].changed);
    assert_eq!(
        (log.len(), row),
        (1, ("console forget --stuck-older-than", 2))
    );

    // The run-out leases are let go (their tokens up), the held one is left to its holder.
    for key in ["gone-1", "gone-2"] {
        let m = fx.store.inspect(SCOPE, key).await.unwrap().unwrap();
        assert!(
            m.locked_until.is_none() && m.token > Some(before),
            "{key}: {m:?}"
        );
    }
    let m = fx.store.inspect(SCOPE, "held").await.unwrap().unwrap();
    assert!(
        m.locked_until.is_some() && m.token == Some(held_token),
        "{m:?}"
    );
    let done = held.finish::<(), idem::Error>(Ok(())).await.unwrap();
    assert_eq!(done, Outcome::Applied(()));
    // Each let-go job's next delivery takes it over and runs it once.
    let options = LeaseOptions::new(Duration::from_secs(30));
    for key in ["gone-1", "gone-2"] {
        let key = Key::new(key).unwrap();
        match fx.store.lease(SCOPE, &key, options).await.unwrap() {
            Claimed::Fresh(lease) => {
                assert_eq!(lease.attempt(), 2, "{key}");
                let done = lease.finish::<(), idem::Error>(Ok(())).await.unwrap();
                assert_eq!(done, Outcome::Applied(()));
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    let (_, page) = reader.get("/stuck?minutes=0").await;
    assert!(page.contains("0 markers in progress"), "{page}");
    drop(stopped);
    fx.cleanup().await;
}
