//! Headless Chromium for the browser tests, driven over WebDriver (chromedriver) on loopback.
//! Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder};
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// chromedriver on a free loopback port, killed with the test.
pub async fn chromedriver() -> (tokio::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start chromedriver ({e}): install Debian's chromium and chromium-driver")
        });
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let started = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = out.next_line().await.unwrap() {
            if line.contains("started successfully") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(started, Ok(true), "chromedriver did not start");
    tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
    (child, format!("http://127.0.0.1:{port}"))
}

/// A session of headless Chromium through `webdriver`, its profile in `profile`, its window
/// `width` by `height`.
pub async fn session(webdriver: &str, profile: &Path, width: u32, height: u32) -> Client {
    let args = [
        "--headless".to_owned(),
        "--no-sandbox".to_owned(),
        "--disable-gpu".to_owned(),
        "--disable-background-networking".to_owned(),
        "--disable-component-update".to_owned(),
        "--disable-sync".to_owned(),
        "--no-first-run".to_owned(),
        format!("--window-size={width},{height}"),
        format!("--user-data-dir={}", profile.display()),
    ];
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({ "binary": "/usr/bin/chromium", "args": args }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(webdriver)
        .await
        .expect("a WebDriver session with headless Chromium")
}
