//! Host processes for end-to-end tests: a fresh database on the test replica set, a plugins
//! directory with copies of this repository's plugins, a configuration, and `relayhost run`
//! processes with their logs, signals and stop counters.

use relayhost::store::Administration;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use bson::{Document, doc};
use futures::TryStreamExt;
use relayhost::event::NewEvent;

use super::{Fixture, MongoFixture, keyed, plugins_dir, publish_all};

pub const RELAYHOST: &str = env!("CARGO_BIN_EXE_relayhost");

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// One configuration for host processes: a fresh database on the test replica set, a
/// plugins directory with copies of the named plugins, and extra TOML.
pub struct Deployment {
    pub fixture: MongoFixture,
    pub dir: PathBuf,
    pub config: PathBuf,
}

impl Deployment {
    pub async fn new(plugins: &[&str], extra: &str) -> Self {
        Self::with_history(plugins, extra, true).await
    }

    /// With or without completion history (without it, what a fan-out hands out has no
    /// delivery document while it runs).
    pub async fn with_history(plugins: &[&str], extra: &str, completion_history: bool) -> Self {
        let fixture = MongoFixture::new().await;
        let uri = relayhost::mongod::process_server().unwrap();
        let dir = std::env::temp_dir().join(format!("relayhost-host-{}", fixture.database));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("plugins")).unwrap();
        for plugin in plugins {
            let file = format!("{plugin}.wasm");
            std::fs::copy(plugins_dir().join(&file), dir.join("plugins").join(&file)).unwrap();
        }
        let artifacts = repo_root().join("target/relayhost-test-artifacts");
        let config = dir.join("relayhost.toml");
        let mut text = format!(
            "[mongodb]\nuri = {uri:?}\ndatabase = {database:?}\n\n[plugins]\ndirectory = {plugins:?}\n\n\
             [host]\nartifact_cache = {artifacts:?}\ncompletion_history = {completion_history}\n{extra}\n",
            database = fixture.database,
            plugins = dir.join("plugins"),
        );
        // The collections the transactional example plugins write.
        for (plugin, collections) in [("audit_log", "\"audit_log\", \"audit_order\""), ("dead_letter_alert", "\"dead_letter_alerts\"")] {
            if plugins.contains(&plugin) {
                text += &format!("\n[plugin.{plugin}]\ngrants = {{ collections = [{collections}] }}\n");
            }
        }
        std::fs::write(&config, text).unwrap();
        Self { fixture, dir, config }
    }

    /// Starts `relayhost run` and waits until it says it is running.
    pub fn start(&self, name: &str) -> Host {
        self.start_with(name, &[])
    }

    pub fn start_with(&self, name: &str, env: &[(&str, &str)]) -> Host {
        let host = self.spawn_with(name, env);
        host.wait_for_log("relayhost is running", Duration::from_secs(120));
        host
    }

    /// Starts `relayhost run` without waiting for it.
    pub fn spawn_with(&self, name: &str, env: &[(&str, &str)]) -> Host {
        let log = self.dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let child = Command::new(RELAYHOST)
            .args(["run", "--config"])
            .arg(&self.config)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        Host { child, log, started_at: std::fs::metadata(self.dir.join(format!("{name}.log"))).unwrap().len() }
    }

    /// Runs an admin subcommand of the same configuration.
    pub fn relayhost(&self, args: &[&str]) -> Output {
        self.relayhost_with(args, &[])
    }

    pub fn relayhost_with(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        Command::new(RELAYHOST)
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .envs(env.iter().copied())
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap()
    }

    pub fn collection(&self, name: &str) -> mongodb::Collection<Document> {
        self.fixture.client.database(&self.fixture.database).collection(name)
    }

    pub async fn documents(&self, name: &str) -> Vec<Document> {
        self.collection(name).find(doc! {}).await.unwrap().try_collect().await.unwrap()
    }

    /// Waits until `done` holds, checking every 100 ms.
    pub async fn wait_until<F: AsyncFn(&Self) -> bool>(&self, what: &str, timeout: Duration, done: F) {
        let deadline = Instant::now() + timeout;
        while !done(self).await {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every handler has nothing pending or running.
    pub async fn drained(&self) -> bool {
        let unfanned = self.fixture.store.events_collection().count_documents(doc! { "fannedOutAt": null }).await.unwrap();
        let stats = self.fixture.store.statistics(bson::DateTime::now()).await.unwrap();
        unfanned == 0 && stats.iter().all(|s| s.pending == 0 && s.running == 0)
    }

    /// The audit projection's event ids, sorted, and each key's handling order.
    pub async fn audit(&self) -> (Vec<String>, BTreeMap<String, Vec<String>>) {
        let mut ids: Vec<String> = self.documents("audit_log").await.iter().map(|d| d.get_str("_id").unwrap().to_string()).collect();
        ids.sort();
        (ids, handling_order(&self.documents("audit_order").await))
    }
}

/// Each key's events in the order the audit-log plugin handled them, from its `audit_order`
/// documents.
pub fn handling_order(audit_order: &[Document]) -> BTreeMap<String, Vec<String>> {
    audit_order
        .iter()
        .map(|d| {
            let events = d.get_array("events").unwrap().iter().map(|e| e.as_str().unwrap().to_string()).collect();
            (d.get_str("_id").unwrap().to_string(), events)
        })
        .collect()
}

impl Deployment {
    /// Waits until `orders` are all audited and nothing is left to deliver, then checks that
    /// the projection holds exactly those events (no gap, no duplicate) and that each key's
    /// events were handled one at a time, in sequence.
    pub async fn assert_audited_exactly(&self, orders: &[(String, String)], timeout: Duration, what: &str) {
        let count = orders.len();
        self.wait_until(&format!("all {count} orders are audited"), timeout, async |d| {
            d.documents("audit_log").await.len() >= count && d.drained().await
        })
        .await;
        let (ids, order) = self.audit().await;
        let mut expected: Vec<String> = orders.iter().map(|(id, _)| id.clone()).collect();
        expected.sort();
        assert_eq!(ids, expected, "{what}: the projection is the set of events, no gap, no duplicate");
        assert_eq!(order, by_key(orders), "{what}: every key was handled one event at a time, in sequence");
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the hosts' logs are kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A `relayhost run` process; killed if a test ends without stopping it.
pub struct Host {
    pub child: Child,
    pub log: PathBuf,
    /// Where this process's lines start in a log shared across restarts.
    pub started_at: u64,
}

impl Host {
    pub fn log(&self) -> String {
        let text = std::fs::read(&self.log).unwrap_or_default();
        String::from_utf8_lossy(&text[(self.started_at as usize).min(text.len())..]).into_owned()
    }

    pub fn wait_for_log(&self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(text) {
            assert!(Instant::now() < deadline, "the host did not log {text:?} in time:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: a plain kill(2) of our own child.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// Waits for the process to exit and returns whether it succeeded.
    pub fn wait(mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.success();
            }
            assert!(Instant::now() < deadline, "the host did not exit in time:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the counters it logged as it stopped.
    pub fn stop(self) -> BTreeMap<String, u64> {
        self.stop_with(libc::SIGTERM)
    }

    pub fn stop_with(self, signal: i32) -> BTreeMap<String, u64> {
        self.signal(signal);
        let log = self.log.clone();
        let started_at = self.started_at;
        assert!(self.wait(Duration::from_secs(60)), "a graceful stop exits successfully");
        let text = std::fs::read_to_string(&log).unwrap();
        let line = text[started_at as usize..].lines().find(|l| l.contains("relayhost stopped")).expect("the stop is logged").to_string();
        if line.starts_with('{') {
            // log_format = "json": one object per line, the fields flattened into it.
            let fields: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&line).expect("a JSON log line");
            return fields.iter().filter_map(|(name, value)| Some((name.clone(), value.as_u64()?))).collect();
        }
        line.split_whitespace()
            .filter_map(|field| field.split_once('='))
            .filter_map(|(name, value)| Some((name.to_string(), value.parse().ok()?)))
            .collect()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A whole number however the driver or a plugin's JSON stored it.
pub fn integer(value: &bson::Bson) -> Option<i64> {
    match value {
        bson::Bson::Int32(n) => Some(i64::from(*n)),
        bson::Bson::Int64(n) => Some(*n),
        _ => None,
    }
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}

/// The expected handling order of each key: its events in sequence order.
pub fn by_key(events: &[(String, String)]) -> BTreeMap<String, Vec<String>> {
    let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (id, key) in events {
        order.entry(key.clone()).or_default().push(id.clone());
    }
    order
}

pub fn keyed_orders(range: std::ops::Range<usize>, keys: usize) -> Vec<(String, String)> {
    range.map(|n| (format!("order-{n:04}"), format!("customer-{:02}", n % keys))).collect()
}

/// Publishes the orders in transactions of 100: one of 600 keyed events can outlast the
/// store's 5 s transaction budget on a loaded 2-core machine with a debug build.
pub async fn publish_orders(deployment: &Deployment, orders: &[(String, String)]) {
    for chunk in orders.chunks(100) {
        let events: Vec<NewEvent> = chunk.iter().map(|(id, key)| keyed(id, "order.placed", key)).collect();
        publish_all(deployment.fixture.store(), events).await;
    }
}

/// One HTTP/1.0 GET: the status code and the body.
pub fn http_get(address: std::net::SocketAddr, path: &str) -> (u16, String) {
    try_http_get(address, path).unwrap()
}

/// One HTTP/1.0 GET, or why it could not be asked (nothing listening yet, a reset).
pub fn try_http_get(address: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nhost: relayhost\r\n\r\n").as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default();
    Ok((status, body))
}
