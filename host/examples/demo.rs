//! The outbox end to end on an embedded MongoDB: a pymongo publisher commits orders with their
//! events (some transactions abort); the store fans them out to the handlers of the plugins
//! directory (a transactional Rust plugin and a Python and a JavaScript one); a worker claims
//! them in per-customer order and runs each in its sandboxed plugin, the transactional one
//! inside the delivery's transaction. The audit-log projection is printed at the end.
//!
//! Run through `scripts/demo`, which installs mongod and pymongo and builds the plugins first.
//! (The `relayhost` binary, its configuration and change-stream wakeups are not built yet;
//! this example assembles the store, the plugin registry and the dispatcher itself.)

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bson::{DateTime, Document, doc};
use futures::TryStreamExt;
use relayhost::dispatch::{Dispatcher, DispatcherOptions, RetryPolicy};
use relayhost::mongod::{Mongod, MongodOptions, cache_dir, find_binary};
use relayhost::plugin::{Grants, PluginPolicy, PluginRegistry, PluginRuntime};
use relayhost::plugin_runner::PluginRunner;
use relayhost::store::mongo::{MongoLocation, MongoStore};
use relayhost::store::{Store, StoreOptions};

#[tokio::main]
async fn main() -> Result<()> {
    // Plugins' log lines go to `tracing` under the plugin's name: show them.
    tracing_subscriber::fmt().with_env_filter("relayhost=info").with_target(false).compact().init();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().context("repository root")?;
    let data_dir = cache_dir().join("demo-data");
    println!("starting the embedded MongoDB (data in {})", data_dir.display());
    let mongod = Mongod::start(MongodOptions::new(find_binary()?, data_dir)).await?;
    let client = mongodb::Client::with_uri_str(mongod.uri()).await?;
    // A fresh database per run, so the output is the same every time.
    let database = format!("relayhost_demo_{}", std::process::id());
    let options = StoreOptions { completion_history: true, ..StoreOptions::default() };
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database)?, options);
    store.setup().await?;

    // The plugins directory: three plugins built from source by scripts/build-plugins.sh.
    let built = std::env::var("RELAYHOST_DEMO_PLUGINS").context("RELAYHOST_DEMO_PLUGINS (set by scripts/demo)")?;
    let plugins = cache_dir().join("demo-plugins");
    std::fs::create_dir_all(&plugins)?;
    for file in ["audit_log", "py_order_check", "js_order_check"] {
        std::fs::copy(std::path::Path::new(&built).join(format!("{file}.wasm")), plugins.join(format!("{file}.wasm")))?;
    }
    let runtime = Arc::new(PluginRuntime::new(Some(cache_dir().join("artifacts")))?);
    let registry = Arc::new(PluginRegistry::new(runtime.clone(), &plugins, |name| PluginPolicy {
        grants: Grants {
            collections: if name == "audit_log" { vec!["audit_log".into(), "audit_order".into()] } else { vec![] },
            ..Grants::default()
        },
        ..PluginPolicy::default()
    }));
    println!("loading plugins from {} (compiled once, then cached)", plugins.display());
    registry.scan().await?;

    println!("publishing 12 orders from Python (pymongo); the odd ones abort their transaction");
    let status = Command::new("python3")
        .arg(root.join("examples/publishers/python/publish.py"))
        .args([mongod.uri().as_str(), database.as_str(), "12", "--abort-odd"])
        .env("PYTHONPATH", std::env::var("RELAYHOST_PYTHONPATH").unwrap_or_default())
        .status()?;
    if !status.success() {
        bail!("the Python publisher failed: {status}");
    }

    // The dispatcher fans the events out to the plugins' handlers, claims them in
    // per-customer order and runs each in its sandbox; the transactional audit-log handler
    // writes and completes inside the delivery's transaction.
    let store = Arc::new(store);
    let runner = Arc::new(PluginRunner::new(registry, store.clone(), Arc::new(|_: &str| RetryPolicy::default())));
    let options = DispatcherOptions { poll_interval: Duration::from_millis(50), ..DispatcherOptions::default() };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dispatching = tokio::spawn({
        let store = store.clone();
        async move { Dispatcher::new(store, runner, options).run(async { let _ = stopped.await; }).await }
    });
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stats = store.statistics(DateTime::now()).await?;
        let unfanned = store.events_collection().count_documents(doc! { "fannedOutAt": null }).await?;
        if unfanned == 0 && stats.iter().all(|s| s.pending == 0 && s.running == 0) {
            break;
        }
    }
    let _ = stop.send(());
    dispatching.await??;
    for stats in store.statistics(DateTime::now()).await? {
        println!("{:<15} completed {:>2}, dead {}", stats.handler, stats.completed.unwrap_or(0), stats.dead);
    }

    println!("the audit-log projection, written by the Rust plugin inside each delivery's transaction:");
    let audit: Vec<Document> = client
        .database(&database)
        .collection::<Document>("audit_log")
        .find(doc! {})
        .sort(doc! { "key": 1, "sequence": 1 })
        .await?
        .try_collect()
        .await?;
    for record in &audit {
        println!(
            "  {:<17} {:<10} #{} total {}",
            record.get_str("_id").unwrap_or("?"),
            record.get_str("key").unwrap_or("?"),
            record.get("sequence").map(ToString::to_string).unwrap_or_default(),
            record.get_document("payload").ok().and_then(|p| p.get("total")).map(ToString::to_string).unwrap_or_default(),
        );
    }
    client.database(&database).drop().await?;
    drop(client);
    mongod.stop();
    println!("done: every committed order reached all three handlers; aborted orders left no event");
    Ok(())
}
