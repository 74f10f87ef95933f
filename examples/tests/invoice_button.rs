//! The `invoice_button` example in a real browser: headless Chromium, driven over WebDriver
//! (chromedriver) on loopback, double-clicks "Send invoice", then goes Back and submits the
//! same form again. One invoice and one email are recorded, and both submissions show the same
//! confirmation.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them). The screenshot
//! after the double click goes to the test's temporary directory, and with
//! `IDEM_BLESS_SCREENSHOT=1` to `docs/invoice_button.png`.

mod browser;
#[allow(dead_code)]
#[path = "../invoice_button.rs"]
mod invoice_button;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::Method;
use axum::middleware::{Next, from_fn};
use axum::response::Response;
use fantoccini::Locator;
use fantoccini::actions::{InputSource as _, MOUSE_BUTTON_LEFT, MouseActions, PointerAction};
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::{Notify, watch};

/// Counts the POSTs that reach the server, and those it is done with: answered, or dropped
/// because the browser gave up on them (the first request of a double click is cancelled by
/// the second submission; whatever it had done in its transaction is rolled back with it, or
/// was committed with its stored response).
#[derive(Default)]
struct Posts {
    arrived: watch::Sender<u32>,
    settled: watch::Sender<u32>,
    dropped: AtomicU32,
    second: Notify,
}

/// Counts a request as settled when its future ends, completed or dropped.
struct Settle(Arc<Posts>, bool);

impl Drop for Settle {
    fn drop(&mut self) {
        if !self.1 {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
        }
        self.0.settled.send_modify(|n| *n += 1);
    }
}

async fn count_posts(posts: Arc<Posts>, request: Request, next: Next) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let mut n = 0;
    posts.arrived.send_modify(|a| {
        *a += 1;
        n = *a;
    });
    if n == 2 {
        posts.second.notify_one();
    }
    let mut settle = Settle(posts.clone(), false);
    let response = next.run(request).await;
    // The first answer (committed, with its stored response) is held back until the second
    // click's POST arrived: the page still shows the button, as it does on a slow server.
    if n == 1 {
        posts.second.notified().await;
    }
    settle.1 = true;
    response
}

async fn wait_for(counter: &watch::Sender<u32>, n: u32, what: &str) {
    let mut rx = counter.subscribe();
    let reached = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|v| *v >= n)).await;
    if reached.is_err() {
        panic!("{what}: {} of {n} within 60 s", *counter.borrow());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_click_and_back_send_one_invoice_and_show_one_confirmation() {
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("idem-test-invoice-button-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&dir));
    std::fs::create_dir_all(&dir).unwrap();
    let (pool, store) = invoice_button::open(&dir.join("invoices.db"))
        .await
        .unwrap();
    let posts = Arc::new(Posts::default());
    let app = invoice_button::router(store).layer(from_fn({
        let posts = posts.clone();
        move |request, next| count_posts(posts.clone(), request, next)
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let (_driver, webdriver) = browser::chromedriver().await;
    let browser = browser::session(&webdriver, &dir.join("chromium-profile"), 900, 600).await;

    browser.goto(&url).await.unwrap();
    let key_field = Locator::Css("input[name=idempotency_key]");
    let key = browser
        .find(key_field)
        .await
        .unwrap()
        .attr("value")
        .await
        .unwrap()
        .unwrap();
    let button = browser.find(Locator::Id("send")).await.unwrap();
    // A real double click: two presses of the left button on "Send invoice".
    let double_click = MouseActions::new("mouse".into())
        .then(PointerAction::MoveToElement {
            element: button,
            duration: None,
            x: 0.0,
            y: 0.0,
        })
        .then(PointerAction::Down {
            button: MOUSE_BUTTON_LEFT,
        })
        .then(PointerAction::Up {
            button: MOUSE_BUTTON_LEFT,
        })
        // A double click's interval; the first POST's answer is held back meanwhile.
        .then(PointerAction::Pause {
            duration: Duration::from_millis(100),
        })
        .then(PointerAction::Down {
            button: MOUSE_BUTTON_LEFT,
        })
        .then(PointerAction::Up {
            button: MOUSE_BUTTON_LEFT,
        });
    browser.perform_actions(double_click).await.unwrap();
    wait_for(&posts.arrived, 2, "POSTs of the double click").await;
    wait_for(&posts.settled, 2, "requests of the double click settled").await;
    let confirmation = browser
        .wait()
        .at_most(Duration::from_secs(60))
        .for_element(Locator::Id("confirmation"))
        .await
        .unwrap();
    let first_title = confirmation.text().await.unwrap();
    let first_page = browser
        .find(Locator::Css("body"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let png = browser.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    std::fs::write(dir.join("invoice_button.png"), &png).unwrap();
    if std::env::var_os("IDEM_BLESS_SCREENSHOT").is_some() {
        let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
        std::fs::write(docs.join("invoice_button.png"), &png).unwrap();
    }

    // Back: the browser shows the form from its history, with the same key; submit it again.
    browser.back().await.unwrap();
    let again = browser
        .wait()
        .at_most(Duration::from_secs(60))
        .for_element(key_field)
        .await
        .unwrap();
    assert_eq!(
        again.attr("value").await.unwrap().as_deref(),
        Some(key.as_str()),
        "Back rendered a new form"
    );
    browser
        .find(Locator::Id("send"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(&posts.settled, 3, "requests settled after Back").await;
    let shown = browser
        .wait()
        .at_most(Duration::from_secs(60))
        .for_element(Locator::Id("confirmation"))
        .await;
    let Ok(shown) = shown else {
        panic!(
            "no confirmation after Back: {}",
            browser.source().await.unwrap()
        )
    };
    let second_title = shown.text().await.unwrap();
    let second_page = browser
        .find(Locator::Css("body"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    browser.close().await.unwrap();
    server.abort();

    assert_eq!(first_title, "Invoice #1 sent");
    assert_eq!(second_title, first_title);
    assert_eq!(
        second_page, first_page,
        "the resubmission showed another confirmation"
    );
    assert!(first_page.contains(&key), "{first_page}");
    let counts: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM invoices), (SELECT COUNT(*) FROM emails_to_send), \
         (SELECT COUNT(*) FROM idem_processed)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(counts, (1, 1, 1), "invoices, emails, markers");
    assert_eq!(*posts.arrived.borrow(), 3);
    pool.close().await;
    std::fs::remove_dir_all(&dir).unwrap();
    eprintln!(
        "browser test ran in {:.1} s; {} of the 3 POSTs were dropped by the browser",
        started.elapsed().as_secs_f64(),
        posts.dropped.load(Ordering::SeqCst)
    );
}
