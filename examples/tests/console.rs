//! The operators' web console (`idem::console`) in a real browser: headless Chromium over
//! WebDriver, against PostgreSQL. Jobs fail for good with two errors; an admin finds the
//! failures grouped by error, reads the group's dry run and requeues it from one page; the
//! next deliveries run exactly those jobs once (effects counted); the audit page lists the
//! action. A read-only visitor sees no action, and a form another site makes the admin's
//! browser send is refused (403) with nothing changed.
//!
//! The console is mounted at `/idem` in an application whose own layer grants admin (here to
//! every request of one listener, as after its login); another listener has no grant.
//! Screenshots go to the test's temporary directory, and with `IDEM_BLESS_SCREENSHOT=1` to
//! `docs/console-*.png`.

mod browser;

use std::fmt;
use std::time::Duration;

use axum::Router;
use axum::response::Html;
use axum::routing::get;
use fantoccini::{Client, Locator};
use idem::console::{Admin, Console};
use idem::{Claimed, FailureGroup, Key, LeaseOptions, Outcome, Store};
use sqlx::PgPool;

const SCOPE: &str = "billing.charge";
const TIMEOUT: &str = "gateway timeout after 30s";
const DECLINED: &str = "card declined";
/// Jobs 0 to 5 hit the gateway's timeout while it is down; 6 and 7 a declined card.
const JOBS: usize = 8;
const TIMED_OUT: usize = 6;

/// The body's error, its text what the marker keeps.
#[derive(Debug)]
enum ChargeError {
    Gateway,
    Declined,
    Idem(idem::Error),
}

impl fmt::Display for ChargeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChargeError::Gateway => f.write_str(TIMEOUT),
            ChargeError::Declined => f.write_str(DECLINED),
            ChargeError::Idem(e) => e.fmt(f),
        }
    }
}

impl From<idem::Error> for ChargeError {
    fn from(e: idem::Error) -> Self {
        ChargeError::Idem(e)
    }
}

/// One delivery of job `n`, in lease mode: its effect is a row of `charges` (no key of its
/// own there, so that a second run would show as a second row).
async fn deliver(store: &Store<sqlx::Postgres>, pool: &PgPool, n: usize, up: bool) -> String {
    let key = Key::new(&format!("job-{n}")).unwrap();
    let options = LeaseOptions::new(Duration::from_secs(30));
    let lease = match store.lease(SCOPE, &key, options).await.unwrap() {
        Claimed::Fresh(lease) => lease,
        Claimed::Duplicate => return "duplicate".into(),
        Claimed::Failed(_) => return "failed".into(),
        Claimed::Replayed(_) => return "replayed".into(),
    };
    let result = match (n, up) {
        (n, _) if n >= TIMED_OUT => Err(lease.permanent(ChargeError::Declined)),
        (_, false) => Err(lease.permanent(ChargeError::Gateway)),
        (_, true) => {
            let table = format!("{}_charges", store.table());
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (job) VALUES ($1)"
            )))
            .bind(key.as_str())
            .execute(pool)
            .await
            .unwrap();
            Ok(())
        }
    };
    match lease.finish(result).await {
        Ok(Outcome::Applied(())) => "applied".into(),
        Ok(Outcome::Failed(_)) => "failed".into(),
        other => panic!("job-{n}: {other:?}"),
    }
}

/// Serves `app` on a loopback port; its address.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

async fn text(browser: &Client, id: &str) -> String {
    let found = browser
        .wait()
        .at_most(Duration::from_secs(60))
        .for_element(Locator::Id(id))
        .await;
    match found {
        Ok(element) => element.text().await.unwrap(),
        Err(e) => panic!("no #{id} ({e}): {}", browser.source().await.unwrap()),
    }
}

async fn screenshot(browser: &Client, dir: &std::path::Path, name: &str) {
    let png = browser.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    std::fs::write(dir.join(name), &png).unwrap();
    if std::env::var_os("IDEM_BLESS_SCREENSHOT").is_some() {
        let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
        std::fs::write(docs.join(name), &png).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_requeues_a_failure_group_from_the_browser_and_the_jobs_run_once() {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}; start PostgreSQL"));
    let table = format!("console_browser_{}", std::process::id());
    let store = Store::new(pool.clone()).with_table(&table).unwrap();
    store.migrate().await.unwrap();
    let charges = format!("{table}_charges");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {charges} (job TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let effects = |job: Option<String>| {
        let pool = pool.clone();
        let sql = match job {
            Some(_) => format!("SELECT COUNT(*) FROM {charges} WHERE job = $1"),
            None => format!("SELECT COUNT(*) FROM {charges} WHERE $1::text IS NULL"),
        };
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .bind(job)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // The gateway is down: every job fails for good, with one of two errors.
    for n in 0..JOBS {
        assert_eq!(deliver(&store, &pool, n, false).await, "failed");
    }
    let timeout_id = FailureGroup::id_of(SCOPE, TIMEOUT);
    let declined_id = FailureGroup::id_of(SCOPE, DECLINED);

    let console = || Router::new().nest("/idem", Console::new(store.clone()).router());
    let admin = serve(console().layer(axum::Extension(Admin::new("alice")))).await;
    let reader = serve(console()).await;
    // Another site's page, which makes the visitor's browser post to the admin's console.
    let forged = format!(
        "<form id=\"f\" method=\"post\" action=\"{admin}/idem/failures/{timeout_id}/requeue\">\
         <input name=\"count\" value=\"{TIMED_OUT}\"><button id=\"go\">win a prize</button></form>"
    );
    let evil = serve(Router::new().route("/", get(move || async { Html(forged) }))).await;

    let dir = std::env::temp_dir().join(format!("idem-test-console-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&dir));
    std::fs::create_dir_all(&dir).unwrap();
    let (_driver, webdriver) = browser::chromedriver().await;
    let browser = browser::session(&webdriver, &dir.join("profile"), 1100, 700).await;

    // The admin opens the failures, grouped by error, and follows the larger group's link.
    browser.goto(&format!("{admin}/idem")).await.unwrap();
    browser
        .find(Locator::LinkText("Failures"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let groups = text(&browser, "groups").await;
    assert!(
        groups.contains(TIMEOUT) && groups.contains(DECLINED),
        "{groups}"
    );
    screenshot(&browser, &dir, "console-failures.png").await;
    browser
        .find(Locator::LinkText(&timeout_id))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // The dry run: how many, which, and nothing changed yet.
    assert_eq!(text(&browser, "count").await, TIMED_OUT.to_string());
    let listed = text(&browser, "jobs").await;
    assert_eq!(listed.matches(TIMEOUT).count(), TIMED_OUT, "{listed}");
    screenshot(&browser, &dir, "console-group.png").await;

    // A page of another site makes the admin's browser send the requeue without the token.
    browser.goto(&evil).await.unwrap();
    browser
        .find(Locator::Id("go"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let refused = text(&browser, "error").await;
    assert!(refused.contains("token is missing"), "{refused}");
    assert!(browser.source().await.unwrap().contains("<title>Forbidden"));
    let failed = store
        .count_failed(&idem::FailedFilter::new())
        .await
        .unwrap();
    assert_eq!(failed, JOBS as u64, "the forged post changed nothing");
    assert!(store.audit_log(10).await.unwrap().is_empty());

    // The admin's own click.
    browser
        .goto(&format!("{admin}/idem/failures/{timeout_id}"))
        .await
        .unwrap();
    browser
        .find(Locator::Id("requeue"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let done = text(&browser, "done").await;
    assert!(
        done.starts_with(&format!("requeued {TIMED_OUT} failed jobs")),
        "{done}"
    );
    browser
        .find(Locator::LinkText("The audit log"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let audit = text(&browser, "audit").await;
    assert!(
        audit.contains("alice") && audit.contains("console requeue --all"),
        "{audit}"
    );
    screenshot(&browser, &dir, "console-audit.png").await;

    // The gateway is back; every job is delivered twice more. Exactly the requeued ones run,
    // once each; the declined ones stay failed.
    for n in 0..JOBS {
        let first = deliver(&store, &pool, n, true).await;
        let second = deliver(&store, &pool, n, true).await;
        let want = if n < TIMED_OUT {
            ("applied", "duplicate")
        } else {
            ("failed", "failed")
        };
        assert_eq!((first.as_str(), second.as_str()), want, "job-{n}");
        let ran = effects(Some(format!("job-{n}"))).await;
        assert_eq!(ran, i64::from(n < TIMED_OUT), "job-{n}");
    }
    assert_eq!(effects(None).await, TIMED_OUT as i64);

    // A read-only visitor sees the same pages, and no action.
    browser
        .goto(&format!("{reader}/idem/failures/{declined_id}"))
        .await
        .unwrap();
    assert_eq!(
        text(&browser, "count").await,
        (JOBS - TIMED_OUT).to_string()
    );
    assert_eq!(text(&browser, "who").await, "read-only");
    assert!(
        browser.find(Locator::Id("requeue")).await.is_err(),
        "a reader's button"
    );
    browser.goto(&format!("{reader}/idem")).await.unwrap();
    let overview = text(&browser, "outcomes").await;
    let want = format!("{SCOPE} {TIMED_OUT} {}", JOBS - TIMED_OUT);
    assert!(overview.contains(&want), "{overview}");
    screenshot(&browser, &dir, "console-overview.png").await;
    browser.close().await.unwrap();

    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {charges}")))
        .execute(&pool)
        .await
        .unwrap();
    for suffix in ["", "_outbox", "_retention", "_steps", "_audit"] {
        let drop = format!("DROP TABLE IF EXISTS {table}{suffix}");
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(&pool)
            .await
            .unwrap();
    }
    drop(std::fs::remove_dir_all(&dir));
}
