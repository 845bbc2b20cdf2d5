//! Hot swap of plugin files under load: replacing a plugin 20 times (valid versions, broken
//! files, half-written files, empty files) while deliveries run, with the directory watcher.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{DateTime, doc};
use common::{plugin_runtime, plugins_dir};
use relayhost::event::EventRecord;
use relayhost::plugin::{Change, DeliveryInfo, Outcome, PluginPolicy, PluginRegistry, PluginRuntime};
use sha2::{Digest, Sha256};

fn runtime() -> Arc<PluginRuntime> {
    Arc::new(plugin_runtime())
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("relayhost-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The same component with a custom section appended: a new, valid version of it.
fn variant(component: &[u8], n: u32) -> Vec<u8> {
    let name = b"relayhost-test-version";
    let payload = n.to_le_bytes();
    let mut section = vec![name.len() as u8];
    section.extend_from_slice(name);
    section.extend_from_slice(&payload);
    let mut bytes = component.to_vec();
    bytes.push(0x00);
    bytes.push(section.len() as u8);
    bytes.extend_from_slice(&section);
    bytes
}

/// Writes a file the way careful tools do: to a hidden temporary name, then a rename.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) {
    let temporary = dir.join(format!(".{name}.partial"));
    std::fs::write(&temporary, bytes).unwrap();
    std::fs::rename(temporary, dir.join(name)).unwrap();
}

async fn wait_for(registry: &PluginRegistry, what: &str, check: impl Fn(&PluginRegistry) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check(registry) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn event() -> EventRecord {
    EventRecord {
        id: bson::oid::ObjectId::new().to_hex(),
        event_type: "order.placed".into(),
        payload: doc! {},
        key: None,
        sequence: None,
        headers: Default::default(),
        correlation_id: None,
        causation_id: None,
        priority: None,
        chain_depth: 0,
        chain_budget: None,
        created_at: DateTime::now(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_a_plugin_twenty_times_under_load_loses_nothing() {
    let original = std::fs::read(plugins_dir().join("noop.wasm")).unwrap();
    let dir = scratch_dir("hot-swap");
    write_atomically(&dir, "noop.wasm", &original);
    let registry = Arc::new(PluginRegistry::new(runtime(), &dir, |_| PluginPolicy::default()));
    registry.scan().await.unwrap();
    let _watching = registry.watch().unwrap();

    let mut valid: HashSet<String> = HashSet::from([hash(&original)]);
    let used: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let (registry, used, stop) = (registry.clone(), used.clone(), stop.clone());
            tokio::spawn(async move {
                let runtime = registry.runtime().clone();
                while !stop.load(Ordering::SeqCst) {
                    let plugin = registry.plugin_for("noop").expect("the handler is served during every swap");
                    let info = DeliveryInfo { handler: "noop".into(), attempt: 1, max_attempts: 5, deadline: 0, trace_context: Vec::new() };
                    let ran = runtime.invoke(&plugin, &event(), &info).await;
                    assert_eq!(ran.outcome, Outcome::Completed);
                    used.lock().unwrap().push(plugin.content_hash.clone());
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        })
        .collect();

    let mut current = hash(&original);
    for round in 0..20_u32 {
        match round % 5 {
            0 | 4 => {
                let bytes = variant(&original, round);
                valid.insert(hash(&bytes));
                write_atomically(&dir, "noop.wasm", &bytes);
                current = hash(&bytes);
            }
            1 => std::fs::write(dir.join("noop.wasm"), b"this is not a component").unwrap(),
            2 => {
                // Half-written in place, then completed: the complete file wins.
                let bytes = variant(&original, 1_000 + round);
                valid.insert(hash(&bytes));
                std::fs::write(dir.join("noop.wasm"), &bytes[..bytes.len() / 2]).unwrap();
                tokio::time::sleep(Duration::from_millis(30)).await;
                std::fs::write(dir.join("noop.wasm"), &bytes).unwrap();
                current = hash(&bytes);
            }
            _ => std::fs::write(dir.join("noop.wasm"), b"").unwrap(),
        }
        let expected = current.clone();
        if matches!(round % 5, 1 | 3) {
            // Refused: the previous version keeps serving.
            tokio::time::sleep(relayhost::plugin::DEBOUNCE * 3).await;
        }
        wait_for(&registry, "the expected version", |r| r.versions().get("noop") == Some(&expected)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }
    let used = std::mem::take(&mut *used.lock().unwrap());
    assert!(used.len() > 50, "deliveries ran during the swaps: {}", used.len());
    assert!(used.iter().all(|h| valid.contains(h)), "a delivery ran on a refused version");
    assert!(used.iter().collect::<HashSet<_>>().len() >= 3, "deliveries ran on several versions");

    // Removing the file stops serving its handlers.
    std::fs::remove_file(dir.join("noop.wasm")).unwrap();
    wait_for(&registry, "the removal", |r| r.plugin_for("noop").is_none()).await;
    assert!(registry.subscriptions().is_empty());
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_id_belongs_to_one_plugin_and_broken_files_do_not_stop_the_others() {
    let noop = std::fs::read(plugins_dir().join("noop.wasm")).unwrap();
    let dir = scratch_dir("registry");
    write_atomically(&dir, "a-noop.wasm", &noop);
    write_atomically(&dir, "b-noop-copy.wasm", &variant(&noop, 1));
    write_atomically(&dir, "broken.wasm", b"garbage");
    std::fs::copy(plugins_dir().join("audit_log.wasm"), dir.join("audit.wasm")).unwrap();
    std::fs::write(dir.join("README.txt"), "not a plugin").unwrap();
    // Over the size limit (sparse): refused without being read.
    std::fs::File::create(dir.join("huge.wasm")).unwrap().set_len(relayhost::plugin::MAX_PLUGIN_FILE_BYTES + 1).unwrap();
    let registry = PluginRegistry::new(runtime(), &dir, |_| PluginPolicy::default());
    let changes = registry.scan().await.unwrap();
    let refused: Vec<&Change> = changes.iter().filter(|c| matches!(c, Change::Refused { .. })).collect();
    assert_eq!(refused.len(), 4, "{changes:?}");
    // Two files offering one handler at startup: both refused, whatever their names' order.
    for (plugin_name, other) in [("a-noop", "b-noop-copy"), ("b-noop-copy", "a-noop")] {
        assert!(changes.iter().any(|c| matches!(c, Change::Refused { plugin, reason }
            if plugin == plugin_name && reason.contains("handler `noop` is also offered by plugin(s)") && reason.contains(other))),
            "{changes:?}");
    }
    assert!(changes.iter().any(|c| matches!(c, Change::Refused { plugin, reason }
        if plugin == "broken" && reason.contains("broken.wasm") && reason.contains("not a WebAssembly binary"))));
    assert_eq!(registry.versions().keys().cloned().collect::<Vec<_>>(), ["audit"]);
    assert!(registry.plugin_for("noop").is_none());
    assert_eq!(&*registry.plugin_for("audit-log").unwrap().name, "audit");
    // An unchanged broken or unreadable file is not loaded again on the next scan (even when
    // touched, which makes the registry look at it again); the contested ones are, until only
    // one offers the handler.
    let touched = std::fs::File::options().write(true).open(dir.join("huge.wasm")).unwrap();
    touched.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5)).unwrap();
    let again = registry.scan().await.unwrap();
    assert_eq!(again.len(), 2, "{again:?}");
    assert!(again.iter().all(|c| matches!(c, Change::Refused { plugin, .. } if plugin.contains("noop"))), "{again:?}");
    std::fs::remove_file(dir.join("b-noop-copy.wasm")).unwrap();
    let changes = registry.scan().await.unwrap();
    assert!(matches!(&changes[..], [Change::Loaded { plugin, .. }] if plugin == "a-noop"), "{changes:?}");
    // A newcomer offering a served handler is refused; the serving plugin stays.
    write_atomically(&dir, "c-noop.wasm", &variant(&noop, 2));
    let changes = registry.scan().await.unwrap();
    assert!(matches!(&changes[..], [Change::Refused { plugin, reason }]
        if plugin == "c-noop" && reason.contains("handler `noop` is already provided by plugin `a-noop`")), "{changes:?}");
    assert_eq!(&*registry.plugin_for("noop").unwrap().name, "a-noop");
    std::fs::remove_dir_all(dir).unwrap();
}

/// The operator's limits and grants change (a reload of the configuration): a plugin refused
/// under the old limits is loaded under the new, and one serving under old grants is loaded
/// again with the new (the same version); nothing changes while they stay the same.
#[tokio::test]
async fn a_change_of_the_operators_policy_loads_again_what_it_changed() {
    let dir = scratch_dir("reapply");
    std::fs::copy(plugins_dir().join("noop.wasm"), dir.join("noop.wasm")).unwrap();
    let mut none = PluginPolicy::default();
    none.limits.handlers = 0;
    let policy = Arc::new(Mutex::new(none));
    let in_force = policy.clone();
    let registry = PluginRegistry::new(runtime(), &dir, move |_| in_force.lock().unwrap().clone());
    let changes = registry.scan().await.unwrap();
    assert!(matches!(changes.as_slice(), [Change::Refused { .. }]), "{changes:?}");
    assert!(registry.plugin_for("noop").is_none());

    *policy.lock().unwrap() = PluginPolicy::default();
    let changes = registry.reapply_policies().await.unwrap();
    assert!(matches!(changes.as_slice(), [Change::Loaded { .. }]), "{changes:?}");
    let version = registry.plugin_for("noop").expect("loaded under the new limits").content_hash.clone();
    assert!(registry.reapply_policies().await.unwrap().is_empty(), "nothing changed, nothing loaded");

    let mut granted = PluginPolicy::default();
    granted.grants.environment = vec!["WEBHOOK_URL".into()];
    *policy.lock().unwrap() = granted.clone();
    let changes = registry.reapply_policies().await.unwrap();
    assert!(
        matches!(changes.as_slice(), [Change::Replaced { old_version, new_version, .. }] if *old_version == version && *new_version == version),
        "{changes:?}"
    );
    assert_eq!(*registry.plugin_for("noop").unwrap().policy, granted, "serving with the new grants");
}
