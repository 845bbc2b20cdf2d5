//! The dashboard in a real browser: Debian's `chromium`, driven over WebDriver by
//! `chromedriver` (both installed by `scripts/ensure-chromium.sh`, which `scripts/test` runs),
//! against a host process on the test replica set. Signing in with the token, seeing a dead
//! letter, pressing requeue, and the delivery then really running and completing; a wrong
//! token refused; every text escaped. Screenshots go to `target/test-artifacts/`.

mod common;

use relayhost::store::Administration;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::deployment::{Deployment, repo_root};
use common::{Fixture, event, publish_all};
use fantoccini::{Client, ClientBuilder, Locator};
use relayhost::store::{DeliveryFilter, DeliveryStatus};

/// `chromedriver` on a free loopback port, killed when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn driver() -> Driver {
    let path = which("chromedriver").expect("chromedriver is missing: run scripts/ensure-chromium.sh (as root), as scripts/test does");
    let port = relayhost::mongod::free_port().unwrap();
    let child = Command::new(path).arg(format!("--port={port}")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    Driver { child, url: format!("http://127.0.0.1:{port}") }
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| std::path::Path::new(dir).join(program)).find(|path| path.is_file())
}

async fn browser(driver: &Driver) -> Client {
    // Only plain HTTP to chromedriver here, but the client is built with one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut capabilities = serde_json::Map::new();
    let profile = std::env::temp_dir().join(format!("relayhost-chromium-{}", std::process::id()));
    capabilities.insert(
        "goog:chromeOptions".to_string(),
        serde_json::json!({
            "binary": which("chromium").expect("chromium is missing: run scripts/ensure-chromium.sh"),
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     format!("--user-data-dir={}", profile.display()), "--window-size=1280,1600"],
        }),
    );
    ClientBuilder::rustls().expect("a TLS client").capabilities(capabilities).connect(&driver.url).await.expect("a browser session")
}

/// Waits until the page shows `text` (a click returns before the next page has loaded).
async fn wait_for_text(client: &Client, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let source = client.source().await.unwrap();
        if source.contains(text) {
            return;
        }
        assert!(Instant::now() < deadline, "the page never showed {text:?}:\n{source}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn screenshot(client: &Client, name: &str) {
    let dir = repo_root().join("target/test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("dashboard-{name}.png")), client.screenshot().await.unwrap()).unwrap();
}

/// A webhook receiver on `port` answering 200, recording each request's first line.
fn receiver(port: u16) -> Arc<Mutex<Vec<String>>> {
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buffer = [0u8; 65536];
            let read = stream.read(&mut buffer).unwrap_or(0);
            let request = String::from_utf8_lossy(&buffer[..read]).into_owned();
            log.lock().unwrap().push(request.lines().next().unwrap_or("").to_string());
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_signs_in_sees_a_dead_letter_and_requeues_it_until_it_completes() {
    let admin: SocketAddr = format!("127.0.0.1:{}", relayhost::mongod::free_port().unwrap()).parse().unwrap();
    let hook = relayhost::mongod::free_port().unwrap();
    let token = "dashboard-token-0123456789";
    let extra = format!(
        "poll_interval = \"200ms\"\n\n[admin]\nlisten = \"{admin}\"\ntoken = \"{token}\"\n\n[plugin.webhook]\n\
         retry = {{ max_attempts = 1 }}\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"127.0.0.1:{hook}\"], private_networks = true }}"
    );
    let deployment = Deployment::new(&["webhook"], &extra).await;
    let url = format!("http://127.0.0.1:{hook}/hook");
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    let store = deployment.fixture.store();
    // Nothing listens on the webhook's port yet: both die at their one attempt. One's id is
    // markup, which the page must show as text.
    let markup = "<img src=x onerror=alert(1)>";
    publish_all(store, vec![event("order-dash", "order.placed"), event(markup, "order.placed")]).await;
    deployment
        .wait_until("both died", Duration::from_secs(30), async |d| {
            let filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), limit: 10, ..Default::default() };
            d.fixture.store.list_deliveries(&filter).await.unwrap().deliveries.len() == 2
        })
        .await;
    let dead = store.list_deliveries(&DeliveryFilter { event_id: Some("order-dash".into()), limit: 1, ..Default::default() }).await.unwrap();
    let delivery = dead.deliveries[0].id.clone();
    let seen = receiver(hook);

    let driver = driver();
    let client = browser(&driver).await;
    // Not signed in: sent to sign in; a wrong token is refused.
    client.goto(&format!("http://{admin}/")).await.unwrap();
    assert!(client.current_url().await.unwrap().as_str().ends_with("/login"));
    client.find(Locator::Id("token")).await.unwrap().send_keys("not-the-token-at-all").await.unwrap();
    client.find(Locator::Id("sign-in")).await.unwrap().click().await.unwrap();
    wait_for_text(&client, "That is not the admin token").await;
    // Signed in: the dead letter with its reason, the markup shown as text.
    client.goto(&format!("http://{admin}/login")).await.unwrap();
    client.find(Locator::Id("token")).await.unwrap().send_keys(token).await.unwrap();
    client.find(Locator::Id("sign-in")).await.unwrap().click().await.unwrap();
    wait_for_text(&client, "Dead letters").await;
    let dead_table = client.find(Locator::Id("dead")).await.unwrap().text().await.unwrap();
    assert!(dead_table.contains("order-dash") && dead_table.contains("webhook"), "{dead_table}");
    assert!(dead_table.contains(markup), "the markup is shown as text: {dead_table}");
    assert!(client.find_all(Locator::Css("#dead img")).await.unwrap().is_empty(), "and never becomes an element");
    let handlers = client.find(Locator::Id("handlers")).await.unwrap().text().await.unwrap();
    assert!(handlers.contains("webhook"), "{handlers}");
    screenshot(&client, "dead-letter").await;
    // Requeue: the delivery really runs again, and completes.
    client.find(Locator::Id(&format!("requeue-{delivery}"))).await.unwrap().click().await.unwrap();
    wait_for_text(&client, "id=\"outcome\"").await;
    let outcome = client.find(Locator::Id("outcome")).await.unwrap().text().await.unwrap();
    assert!(outcome.contains("Requeued"), "{outcome}");
    deployment
        .wait_until("the requeued delivery completed", Duration::from_secs(30), async |d| {
            let filter = DeliveryFilter { event_id: Some("order-dash".into()), limit: 1, ..Default::default() };
            d.fixture.store.list_deliveries(&filter).await.unwrap().deliveries.is_empty()
        })
        .await;
    assert!(seen.lock().unwrap().iter().any(|line| line.starts_with("POST /hook")), "{:?}", seen.lock().unwrap());
    client.goto(&format!("http://{admin}/")).await.unwrap();
    wait_for_text(&client, "Dead letters").await;
    let dead_table = client.find(Locator::Id("dead")).await.unwrap().text().await.unwrap();
    assert!(!dead_table.contains("order-dash") && dead_table.contains(markup), "{dead_table}");
    screenshot(&client, "after-requeue").await;
    client.close().await.unwrap();
    host.stop();
}
