//! Change-stream wakeups on a real replica set: a commit wakes the host, the stream is resumed
//! after the server kills it, and a stream that cannot be opened is replaced by logged polling.
//! (Its own test process: killing every session would disturb tests sharing the server.)

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bson::doc;
use common::{Fixture, MongoFixture, event, publish_all};
use relayhost::store::mongo::{EventWakeups, MongoLocation, MongoStore};
use relayhost::store::StoreOptions;
use tokio::sync::Notify;

/// Every log line of this process, for the tests to read.
fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs: Arc<Mutex<Vec<u8>>> = Arc::default();
        let sink = logs.clone();
        tracing_subscriber::fmt()
            .with_env_filter("relayhost=debug")
            .with_ansi(false)
            .with_writer(move || LogWriter(sink.clone()))
            .init();
        logs
    })
    .clone()
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logged(text: &str) -> bool {
    String::from_utf8_lossy(&logs().lock().unwrap()).contains(text)
}

async fn woken(waker: &Notify) -> bool {
    tokio::time::timeout(Duration::from_secs(10), waker.notified()).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_wake_the_host_and_a_killed_stream_is_resumed() {
    logs();
    let fixture = MongoFixture::new().await;
    let waker = Arc::new(Notify::new());
    let task = EventWakeups::default().spawn(fixture.store(), waker.clone());
    // The opened stream pokes once (events may have come while it was down); take that first.
    assert!(woken(&waker).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = tokio::time::timeout(Duration::from_millis(10), waker.notified()).await;

    publish_all(fixture.store(), vec![event("e-1", "t")]).await;
    assert!(woken(&waker).await, "a commit wakes the host");

    // The server kills every session's cursors, the change stream's among them.
    fixture.client.database("admin").run_command(doc! { "killAllSessions": [] }).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !logged("change stream on the events collection failed") {
        assert!(std::time::Instant::now() < deadline, "the failure is logged with its reason");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Reopened from where it stopped: a later commit wakes the host again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    publish_all(fixture.store(), vec![event("e-2", "t")]).await;
    assert!(woken(&waker).await, "the resumed stream wakes the host");
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_cannot_open_is_replaced_by_logged_polling() {
    logs();
    // Nothing listens on this port: every attempt to open the stream fails.
    let port = relayhost::mongod::free_port().unwrap();
    let uri = format!("mongodb://127.0.0.1:{port}/?serverSelectionTimeoutMS=100&connectTimeoutMS=100");
    let client = mongodb::Client::with_uri_str(uri).await.unwrap();
    let store = MongoStore::new(client, MongoLocation::with_default_prefix("unreachable").unwrap(), StoreOptions::default());
    let waker = Arc::new(Notify::new());
    let wakeups = EventWakeups { fallback_poll: Duration::from_millis(50) };
    let task = wakeups.spawn(&store, waker.clone());
    let started = std::time::Instant::now();
    for _ in 0..5 {
        assert!(woken(&waker).await, "polling pokes the host while the stream is down");
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(logged("polling until it reopens"), "the fallback is logged");
    assert!(logged("Server selection timeout") || logged("server selection"), "with the reason");
    task.abort();
}
