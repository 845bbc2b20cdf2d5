//! The plugin runtime with real components built from `plugins/` in this repository: loading
//! and refusing files, limits, the sandbox and its grants, the transaction capability, and a
//! well-behaved plugin that keeps working beside a hostile one.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{DateTime, doc};
use relayhost::event::{EventRecord, NewEvent};
use relayhost::plugin::capability::http::Grant as HttpGrant;
use relayhost::plugin::capability::transaction::Grant as TransactionGrant;
use common::{plugin_runtime, plugins_dir};
use relayhost::plugin::{
    CapabilityFuture, DeliveryInfo, Grants, Limits, LoadedPlugin, Outcome, PluginError, PluginPolicy,
    PluginRuntime, TransactionCapability,
};

fn plugin_file(name: &str) -> PathBuf {
    plugins_dir().join(format!("{name}.wasm"))
}

fn runtime() -> PluginRuntime {
    plugin_runtime()
}

fn quick_limits() -> Limits {
    Limits {
        fuel: 200_000_000,
        memory_bytes: 32 * 1024 * 1024,
        wall_time: Duration::from_secs(2),
        log: relayhost::plugin::capability::log::Limits { output_bytes: 8 * 1024 },
        ..Limits::default()
    }
}

fn policy(grants: Grants) -> PluginPolicy {
    PluginPolicy { limits: quick_limits(), grants }
}

async fn load(runtime: &PluginRuntime, name: &str, grants: Grants) -> LoadedPlugin {
    runtime.load(&plugin_file(name), policy(grants)).await.unwrap_or_else(|e| panic!("{e}"))
}

fn event(event_type: &str, payload: bson::Document) -> EventRecord {
    EventRecord {
        id: format!("e-{}", bson::oid::ObjectId::new()),
        event_type: event_type.to_string(),
        payload,
        key: Some("k-1".to_string()),
        sequence: Some(1),
        headers: BTreeMap::new(),
        correlation_id: None,
        causation_id: None,
        priority: None,
        chain_depth: 0,
        chain_budget: None,
        created_at: DateTime::now(),
    }
}

fn delivery(handler: &str) -> DeliveryInfo {
    DeliveryInfo { handler: handler.to_string(), attempt: 1, max_attempts: 5, deadline: DateTime::now().timestamp_millis() + 2_000, trace_context: Vec::new() }
}

async fn attack(runtime: &PluginRuntime, plugin: &LoadedPlugin, handler: &str, target: &str) -> Outcome {
    runtime.invoke(plugin, &event("attack", doc! { "target": target }), &delivery(handler)).await.outcome
}

fn assert_blocked(outcome: &Outcome, why: &str) {
    match outcome {
        Outcome::Unprocessable(reason) if reason.starts_with("blocked:") => {}
        other => panic!("{why}: expected the sandbox to hold, got {other:?}"),
    }
}

async fn noop_still_works(runtime: &PluginRuntime, noop: &LoadedPlugin) {
    let ran = runtime.invoke(noop, &event("order.placed", doc! {}), &delivery("noop")).await;
    assert_eq!(ran.outcome, Outcome::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_load_with_their_subscriptions_and_version() {
    let runtime = runtime();
    let audit = load(&runtime, "audit_log", Grants::default()).await;
    assert_eq!(&*audit.name, "audit_log");
    assert_eq!(audit.content_hash.len(), 64);
    let subscription = audit.subscription("audit-log").unwrap();
    assert!(subscription.transactional);
    assert_eq!(subscription.event_types, ["order.placed", "order.paid"]);
    let hostile = load(&runtime, "hostile", Grants::default()).await;
    assert_eq!(hostile.subscriptions.len(), 24);
    assert!(hostile.subscription("write-collection").unwrap().transactional);
}

#[tokio::test]
async fn broken_files_are_refused_naming_the_file_and_the_reason() {
    let runtime = runtime();
    let dir = std::env::temp_dir().join(format!("relayhost-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let foreign = r#"(component (import "acme:evil/backdoor" (instance (export "open" (func)))))"#;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("garbage.wasm", b"definitely not wasm".to_vec(), "not a WebAssembly binary"),
        // Text is never read as the WebAssembly text format: its error would quote it.
        ("text.wasm", b"(component)".to_vec(), "not a WebAssembly binary"),
        ("core-module.wasm", b"\0asm\x01\0\0\0".to_vec(), "not a valid WebAssembly component"),
        ("empty-component.wasm", wat::parse_str("(component)").unwrap(), "does not implement relayhost:plugin/handler@0.1.0"),
        ("foreign-import.wasm", wat::parse_str(foreign).unwrap(), "needs an import relayhost does not provide"),
    ];
    for (name, bytes, expected) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let error = runtime.load(&path, PluginPolicy::default()).await.unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, PluginError::Refused { .. }), "{message}");
        assert!(message.contains(name) && message.contains(expected), "{message}");
    }
    // A link to a secret, and a file that says it is empty and is not, are refused without a
    // word of what they hold.
    let secret = dir.join("secret.txt");
    std::fs::write(&secret, "SECRET_TOKEN=hunter2\n").unwrap();
    std::os::unix::fs::symlink(&secret, dir.join("secret.wasm")).unwrap();
    std::os::unix::fs::symlink("/proc/self/environ", dir.join("environ.wasm")).unwrap();
    for name in ["secret.wasm", "environ.wasm"] {
        let message = runtime.load(&dir.join(name), PluginPolicy::default()).await.unwrap_err().to_string();
        assert!(message.contains(name) && message.contains("not a WebAssembly binary"), "{message}");
        assert!(!message.contains("hunter2") && !message.contains("PATH="), "{message}");
    }
    // A file over the size limit is refused before it is read (a sparse one here).
    let huge = std::fs::File::create(dir.join("huge.wasm")).unwrap();
    huge.set_len(relayhost::plugin::MAX_PLUGIN_FILE_BYTES + 1).unwrap();
    let message = runtime.load(&dir.join("huge.wasm"), PluginPolicy::default()).await.unwrap_err().to_string();
    assert!(message.contains("over the 268435456 bytes a plugin file may have"), "{message}");
    // A half-written copy of a real plugin is refused too.
    let real = std::fs::read(plugin_file("noop")).unwrap();
    let half = dir.join("half.wasm");
    std::fs::write(&half, &real[..real.len() / 2]).unwrap();
    assert!(runtime.load(&half, PluginPolicy::default()).await.is_err());
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_contain_cpu_memory_stack_and_time() {
    let runtime = runtime();
    let hostile = load(&runtime, "hostile", Grants::default()).await;
    let noop = load(&runtime, "noop", Grants::default()).await;

    assert_eq!(attack(&runtime, &hostile, "spin", "").await, Outcome::Failed("fuel exhausted".into()));
    noop_still_works(&runtime, &noop).await;
    assert_eq!(
        attack(&runtime, &hostile, "memory-bomb", "").await,
        Outcome::Failed(format!("memory limit of {} bytes reached", 32 * 1024 * 1024))
    );
    noop_still_works(&runtime, &noop).await;
    // Rust keeps deep frames on a shadow stack in linear memory: the overflow traps either on
    // the engine's call stack or at the bottom of that memory.
    match attack(&runtime, &hostile, "recursion", "").await {
        Outcome::Failed(reason) => assert!(reason.starts_with("trap:"), "{reason}"),
        other => panic!("{other:?}"),
    }
    noop_still_works(&runtime, &noop).await;
    let started = std::time::Instant::now();
    match attack(&runtime, &hostile, "sleep", "").await {
        Outcome::Failed(reason) => assert!(reason.contains("wall-clock limit"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(30), "the sleep was cut short");
    noop_still_works(&runtime, &noop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_plugin_never_starves_other_deliveries() {
    let runtime = Arc::new(runtime());
    let generous = PluginPolicy { limits: Limits { fuel: u64::MAX / 2, wall_time: Duration::from_secs(5), ..quick_limits() }, ..Default::default() };
    let hostile = Arc::new(runtime.load(&plugin_file("hostile"), generous).await.unwrap());
    let noop = load(&runtime, "noop", Grants::default()).await;
    // Two spinners on a two-thread runtime: without fuel yields they would hold both threads.
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let (runtime, hostile) = (runtime.clone(), hostile.clone());
            tokio::spawn(async move { attack(&runtime, &hostile, "spin", "").await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    for _ in 0..20 {
        noop_still_works(&runtime, &noop).await;
    }
    let noop_time = started.elapsed();
    for spinner in spinners {
        assert!(matches!(spinner.await.unwrap(), Outcome::Failed(reason) if reason.contains("wall-clock")));
    }
    assert!(noop_time < Duration::from_secs(4), "noop deliveries waited for the spinners: {noop_time:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_holds_without_grants() {
    let runtime = runtime();
    let hostile = load(&runtime, "hostile", Grants::default()).await;
    let noop = load(&runtime, "noop", Grants::default()).await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();

    assert_blocked(&attack(&runtime, &hostile, "read-passwd", "").await, "/etc/passwd");
    // SAFETY: tests in this file do not read the environment concurrently with this write.
    unsafe { std::env::set_var("RELAYHOST_TEST_SECRET", "hunter2") };
    assert_blocked(&attack(&runtime, &hostile, "read-env", "").await, "environment");
    assert_blocked(&attack(&runtime, &hostile, "read-data", "/data/secret.txt").await, "directory");
    assert_blocked(&attack(&runtime, &hostile, "socket", &address).await, "socket");
    assert_blocked(&attack(&runtime, &hostile, "http", &address).await, "HTTP");
    match attack(&runtime, &hostile, "untransactional-write", "audit_log").await {
        Outcome::Unprocessable(reason) => assert!(reason.contains("only available to transactional handlers"), "{reason}"),
        other => panic!("{other:?}"),
    }
    noop_still_works(&runtime, &noop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_open_exactly_what_they_name() {
    let dir = std::env::temp_dir().join(format!("relayhost-grant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("secret.txt"), "granted").unwrap();
    // SAFETY: see the_sandbox_holds_without_grants.
    unsafe { std::env::set_var("RELAYHOST_TEST_GRANTED", "yes") };
    let server = HttpServer::start(vec![(200, None)]);
    let grants = Grants {
        read_only_directory: Some(dir.clone()),
        environment: vec!["RELAYHOST_TEST_GRANTED".into()],
        http: HttpGrant { hosts: vec![server.authority()], private_networks: true },
        ..Default::default()
    };
    let runtime = runtime();
    let hostile = load(&runtime, "hostile", grants).await;
    assert_eq!(attack(&runtime, &hostile, "read-data", "/data/secret.txt").await, Outcome::Completed);
    assert_blocked(&attack(&runtime, &hostile, "write-data", "/data/secret.txt").await, "read-only directory");
    assert_eq!(std::fs::read_to_string(dir.join("secret.txt")).unwrap(), "granted");
    assert_eq!(attack(&runtime, &hostile, "read-env", "").await, Outcome::Completed);
    assert_eq!(attack(&runtime, &hostile, "http", &server.authority()).await, Outcome::Completed);
    assert_eq!(server.requests().len(), 1);
    // Another port of the same host is not granted.
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    assert_blocked(&attack(&runtime, &hostile, "http", &other).await, "ungranted port");
    // The same grant without private networks: the loopback address is refused.
    let public_only = Grants { http: HttpGrant { hosts: vec![server.authority()], private_networks: false }, ..Default::default() };
    let hostile = load(&runtime, "hostile", public_only).await;
    assert_blocked(&attack(&runtime, &hostile, "http", &server.authority()).await, "loopback without private networks");
    assert_eq!(server.requests().len(), 1, "nothing more reached the server");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_floods_are_capped_and_the_delivery_still_completes() {
    let runtime = runtime();
    let limits = Limits { wall_time: Duration::from_secs(60), fuel: u64::MAX / 2, ..quick_limits() };
    let hostile = runtime.load(&plugin_file("hostile"), PluginPolicy { limits, ..Default::default() }).await.unwrap();
    let ran = runtime.invoke(&hostile, &event("attack", doc! {}), &delivery("log-flood")).await;
    assert_eq!(ran.outcome, Outcome::Completed);
    assert!(ran.output_kept <= 8 * 1024, "{}", ran.output_kept);
    // 20,000 log lines and 20,000 printed lines of 1,000 bytes each, nearly all dropped.
    assert!(ran.output_dropped > 39_000_000, "{}", ran.output_dropped);
}

/// A transaction capability over an in-test map of collections, recording what it is asked.
#[derive(Clone, Default)]
struct RecordingTransaction {
    inserted: Arc<Mutex<Vec<(String, serde_json::Value)>>>,
    published: Arc<Mutex<Vec<NewEvent>>>,
}

impl TransactionCapability for RecordingTransaction {
    fn insert<'a>(&'a mut self, collection: &'a str, document: &'a str) -> CapabilityFuture<'a, String> {
        Box::pin(async move {
            let value: serde_json::Value = serde_json::from_str(document).map_err(|e| e.to_string())?;
            self.inserted.lock().unwrap().push((collection.to_string(), value.clone()));
            Ok(value["_id"].to_string())
        })
    }
    fn update<'a>(&'a mut self, _: &'a str, _: &'a str, _: &'a str) -> CapabilityFuture<'a, u64> {
        Box::pin(async { Ok(0) })
    }
    fn delete<'a>(&'a mut self, _: &'a str, _: &'a str) -> CapabilityFuture<'a, u64> {
        Box::pin(async { Ok(0) })
    }
    fn find<'a>(&'a mut self, _: &'a str, _: &'a str, _: u32, _: usize) -> CapabilityFuture<'a, Vec<String>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    fn publish(&mut self, event: NewEvent) -> CapabilityFuture<'_, ()> {
        self.published.lock().unwrap().push(event);
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_handlers_write_only_granted_collections() {
    let runtime = runtime();
    let grants = Grants { transaction: TransactionGrant { collections: vec!["audit_log".into(), "audit_order".into()], ..Default::default() }, ..Default::default() };
    let audit = load(&runtime, "audit_log", grants.clone()).await;
    let recording = RecordingTransaction::default();
    let order = event("order.placed", doc! { "orderId": "o-1", "total": 12.5 });
    let (ran, returned) =
        runtime.invoke_transactional(&audit, &order, &delivery("audit-log"), Box::new(recording.clone())).await;
    assert_eq!(ran.outcome, Outcome::Completed);
    assert!(returned.is_some(), "the capability comes back for the commit");
    let inserted = recording.inserted.lock().unwrap().clone();
    assert_eq!(inserted.len(), 2, "the audit record, then its key's first order entry (no entry matched): {inserted:?}");
    assert_eq!(inserted[0].0, "audit_log");
    assert_eq!(inserted[1].0, "audit_order");
    assert_eq!(inserted[1].1["events"][0], order.id);
    assert_eq!(inserted[0].1["_id"], order.id);
    assert_eq!(inserted[0].1["payload"]["orderId"], "o-1");
    assert_eq!(inserted[0].1["sequence"], 1);

    // A collection not granted is refused before the capability sees it.
    let hostile = load(&runtime, "hostile", grants).await;
    let recording = RecordingTransaction::default();
    let (ran, _) = runtime
        .invoke_transactional(&hostile, &event("attack", doc! { "target": "secrets" }), &delivery("write-collection"), Box::new(recording.clone()))
        .await;
    match ran.outcome {
        Outcome::Unprocessable(reason) => assert!(reason.contains("collection \"secrets\" is not granted to plugin `hostile`"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(recording.inserted.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_posts_and_honours_retry_after() {
    let server = HttpServer::start(vec![(503, Some("7")), (429, None), (200, None), (404, None)]);
    // SAFETY: see the_sandbox_holds_without_grants.
    unsafe { std::env::set_var("WEBHOOK_URL", format!("http://{}/hooks/orders", server.authority())) };
    let grants = Grants {
        environment: vec!["WEBHOOK_URL".into()],
        http: HttpGrant { hosts: vec![server.authority()], private_networks: true },
        ..Default::default()
    };
    let runtime = runtime();
    let webhook = load(&runtime, "webhook", grants).await;
    let order = event("order.placed", doc! { "orderId": "o-9" });
    let before = DateTime::now().timestamp_millis();
    let outcomes: Vec<Outcome> = futures_in_order(&runtime, &webhook, &order, 4).await;
    match &outcomes[0] {
        Outcome::Retry { reason, not_before: Some(at) } => {
            assert_eq!(reason, "HTTP 503");
            assert!((before + 7_000..before + 9_000).contains(at), "{at} vs {before}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(outcomes[1], Outcome::Retry { reason: "HTTP 429".into(), not_before: None });
    assert_eq!(outcomes[2], Outcome::Completed);
    assert_eq!(outcomes[3], Outcome::Unprocessable("HTTP 404".into()));
    let requests = server.requests();
    assert_eq!(requests.len(), 4);
    assert!(requests[0].starts_with("POST /hooks/orders HTTP/1.1"), "{}", requests[0]);
    assert!(requests[0].contains(&format!("idempotency-key: {}", order.id)), "{}", requests[0]);
    assert!(requests[0].contains("\"orderId\":\"o-9\""), "{}", requests[0]);
}

async fn futures_in_order(runtime: &PluginRuntime, plugin: &LoadedPlugin, event: &EventRecord, times: usize) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    for attempt in 1..=times as u32 {
        let info = DeliveryInfo { attempt, ..delivery("webhook") };
        outcomes.push(runtime.invoke(plugin, event, &info).await.outcome);
    }
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compiled_artifacts_are_reused_across_restarts() {
    let cache = std::env::temp_dir().join(format!("relayhost-artifacts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let first = PluginRuntime::new(Some(cache.clone())).unwrap();
    let plugin = first.load(&plugin_file("noop"), PluginPolicy::default()).await.unwrap();
    let artifacts: Vec<PathBuf> = walk(&cache);
    assert_eq!(artifacts.len(), 1, "{artifacts:?}");
    assert!(artifacts[0].ends_with(format!("{}.cwasm", plugin.content_hash)));
    let written = std::fs::metadata(&artifacts[0]).unwrap().modified().unwrap();
    drop(first);
    let second = PluginRuntime::new(Some(cache.clone())).unwrap();
    let again = second.load(&plugin_file("noop"), PluginPolicy::default()).await.unwrap();
    assert_eq!(again.content_hash, plugin.content_hash);
    assert_eq!(std::fs::metadata(&artifacts[0]).unwrap().modified().unwrap(), written, "not compiled again");
    noop_still_works(&second, &again).await;
    // A corrupt artifact is ignored and replaced, never trusted.
    std::fs::write(&artifacts[0], b"garbage").unwrap();
    let third = PluginRuntime::new(Some(cache.clone())).unwrap();
    let rebuilt = third.load(&plugin_file("noop"), PluginPolicy::default()).await.unwrap();
    noop_still_works(&third, &rebuilt).await;
    std::fs::remove_dir_all(cache).unwrap();
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.path().is_dir() {
            files.extend(walk(&entry.path()));
        } else {
            files.push(entry.path());
        }
    }
    files
}

/// A real HTTP/1.1 server on 127.0.0.1 that answers with the given statuses in turn and
/// records each request (head and body) as text.
struct HttpServer {
    address: std::net::SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
}

impl HttpServer {
    fn start(answers: Vec<(u16, Option<&'static str>)>) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let requests: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = requests.clone();
        std::thread::spawn(move || {
            for (stream, (status, retry_after)) in listener.incoming().zip(answers.into_iter().cycle()) {
                let Ok(mut stream) = stream else { continue };
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let n = stream.read(&mut buf).unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request);
                    if let Some(head_end) = text.find("\r\n\r\n") {
                        let length = text[..head_end]
                            .lines()
                            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                            .unwrap_or(0);
                        if request.len() >= head_end + 4 + length {
                            break;
                        }
                    }
                }
                log.lock().unwrap().push(String::from_utf8_lossy(&request).into_owned());
                let extra = retry_after.map(|s| format!("retry-after: {s}\r\n")).unwrap_or_default();
                let response = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n{extra}\r\n");
                let _ = stream.write_all(response.as_bytes());
            }
        });
        Self { address, requests }
    }

    fn authority(&self) -> String {
        self.address.to_string()
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_javascript_and_c_plugins_handle_real_events() {
    let runtime = runtime();
    let plugins = [("py_order_check", "py-order-check"), ("js_order_check", "js-order-check"), ("c_order_check", "c-order-check")];
    for (file, handler) in plugins {
        let limits = Limits { fuel: u64::MAX / 2, memory_bytes: 256 * 1024 * 1024, wall_time: Duration::from_secs(20), ..quick_limits() };
        let plugin = runtime
            .load(&plugin_file(file), PluginPolicy { limits, ..Default::default() })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plugin.subscriptions.len(), 1, "{file}");
        assert_eq!(plugin.subscriptions[0].handler, handler);
        assert_eq!(plugin.subscriptions[0].event_types, ["order.placed"]);
        let run = |payload: bson::Document| {
            let plugin = &plugin;
            let runtime = &runtime;
            async move { runtime.invoke(plugin, &event("order.placed", payload), &delivery(handler)).await }
        };
        let ran = run(doc! { "orderId": "o-1", "total": 3 }).await;
        assert_eq!(ran.outcome, Outcome::Completed, "{file}");
        assert!(ran.output_kept > 0, "{file} logged through the log import");
        assert_eq!(run(doc! { "total": 3 }).await.outcome, Outcome::Unprocessable("order without orderId".into()), "{file}");
        assert_eq!(
            run(doc! { "orderId": "o-2", "total": -1 }).await.outcome,
            Outcome::Retry { reason: "negative total, asking again later".into(), not_before: None },
            "{file}"
        );
    }
}
