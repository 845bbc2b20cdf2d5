//! The outbox end to end on an embedded MongoDB: a pymongo publisher commits orders with their
//! events (some transactions abort); the store fans them out to the handlers of the plugins
//! directory (a transactional Rust plugin and a Python and a JavaScript one); a worker claims
//! them in per-customer order and runs each in its sandboxed plugin, the transactional one
//! inside the delivery's transaction. The audit-log projection is printed at the end.
//!
//! Run through `scripts/demo`, which installs mongod and pymongo and builds the plugins first.
//! (The product's dispatcher, with retries, batching and renewals, is not built yet; this
//! example drives the store and the runtime directly.)

use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use bson::{DateTime, Document, doc};
use futures::TryStreamExt;
use relayhost::handler_transaction::MongoHandlerTransaction;
use relayhost::mongod::{Mongod, MongodOptions, cache_dir, find_binary};
use relayhost::plugin::{DeliveryInfo, Grants, Outcome, PluginPolicy, PluginRegistry, PluginRuntime};
use relayhost::store::mongo::{MongoLocation, MongoStore};
use relayhost::store::{ClaimedDelivery, Store, StoreOptions, StoreTransaction, Subscription, Subscriptions};

#[tokio::main]
async fn main() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().context("repository root")?;
    let data_dir = cache_dir().join("demo-data");
    println!("starting the embedded MongoDB (data in {})", data_dir.display());
    let mongod = Mongod::start(MongodOptions::new(find_binary()?, data_dir)).await?;
    let client = mongodb::Client::with_uri_str(mongod.uri()).await?;
    // A fresh database per run, so the output is the same every time.
    let database = format!("relayhost_demo_{}", std::process::id());
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database)?, StoreOptions::default());
    store.setup().await?;

    // The plugins directory: three plugins built from source by scripts/build-plugins.sh.
    let built = std::env::var("RELAYHOST_DEMO_PLUGINS").context("RELAYHOST_DEMO_PLUGINS (set by scripts/demo)")?;
    let plugins = cache_dir().join("demo-plugins");
    std::fs::create_dir_all(&plugins)?;
    for file in ["audit_log", "py_order_check", "js_order_check"] {
        std::fs::copy(std::path::Path::new(&built).join(format!("{file}.wasm")), plugins.join(format!("{file}.wasm")))?;
    }
    let runtime = Arc::new(PluginRuntime::new(Some(cache_dir().join("artifacts")))?);
    let registry = PluginRegistry::new(runtime.clone(), &plugins, |name| PluginPolicy {
        grants: Grants {
            collections: if name == "audit_log" { vec!["audit_log".into()] } else { vec![] },
            ..Grants::default()
        },
        ..PluginPolicy::default()
    });
    println!("loading plugins from {} (compiled once, then cached)", plugins.display());
    for change in registry.scan().await? {
        println!("  {change:?}");
    }

    println!("publishing 12 orders from Python (pymongo); the odd ones abort their transaction");
    let status = Command::new("python3")
        .arg(root.join("examples/publishers/python/publish.py"))
        .args([mongod.uri().as_str(), database.as_str(), "12", "--abort-odd"])
        .env("PYTHONPATH", std::env::var("RELAYHOST_PYTHONPATH").unwrap_or_default())
        .status()?;
    if !status.success() {
        bail!("the Python publisher failed: {status}");
    }

    let offered = registry.subscriptions();
    let subscriptions = Subscriptions::new(
        offered.iter().map(|s| Subscription::new(s.handler.clone(), s.event_types.iter().cloned())),
    )?;
    let report = store.fan_out(&subscriptions, 100, DateTime::now()).await?;
    println!("fanned out {} events into {} deliveries", report.events, report.deliveries);

    let handlers = subscriptions.handlers();
    loop {
        let claimed = store.claim(&handlers, 8, DateTime::now()).await?;
        if claimed.is_empty() {
            break;
        }
        for delivery in &claimed {
            let outcome = run(&store, &registry, delivery).await?;
            println!(
                "  {:<15} <- {:<17} key {:<10} sequence {}  {:?}",
                delivery.handler,
                delivery.event.id,
                delivery.event.key.as_deref().unwrap_or("-"),
                delivery.event.sequence.unwrap_or(0),
                outcome,
            );
        }
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
    store.relinquish().await?;
    drop(client);
    mongod.stop();
    println!("done: every committed order reached all three handlers; aborted orders left no event");
    Ok(())
}

/// Runs one claimed delivery in its plugin and settles it.
async fn run(store: &MongoStore, registry: &PluginRegistry, delivery: &ClaimedDelivery) -> Result<Outcome> {
    let plugin = registry.plugin_for(&delivery.handler).context("a plugin serves the handler")?;
    let info = DeliveryInfo {
        handler: delivery.handler.clone(),
        attempt: delivery.attempts + 1,
        max_attempts: 5,
        deadline: DateTime::now().timestamp_millis() + plugin.policy.limits.wall_time.as_millis() as i64,
    };
    let transactional = plugin.subscription(&delivery.handler).is_some_and(|s| s.transactional);
    let now = DateTime::now();
    if transactional {
        let shared = Arc::new(tokio::sync::Mutex::new(store.begin().await?));
        let capability =
            MongoHandlerTransaction::new(shared.clone(), store.database(), store.publisher().clone(), delivery.event.id.clone());
        let (ran, returned) =
            registry.runtime().invoke_transactional(&plugin, &delivery.event, &info, Box::new(capability)).await;
        drop(returned);
        let mut tx = Arc::try_unwrap(shared).ok().context("the handler released its transaction")?.into_inner();
        if ran.outcome == Outcome::Completed {
            store.complete_in(&mut tx, &delivery.lease, now).await?;
            tx.commit().await?;
        } else {
            tx.abort().await?;
            settle_failure(store, delivery, &ran.outcome).await?;
        }
        return Ok(ran.outcome);
    }
    let ran = registry.runtime().invoke(&plugin, &delivery.event, &info, None).await;
    match &ran.outcome {
        Outcome::Completed => {
            store.complete_many(&[delivery.lease], now).await?;
        }
        failure => settle_failure(store, delivery, failure).await?,
    }
    Ok(ran.outcome)
}

async fn settle_failure(store: &MongoStore, delivery: &ClaimedDelivery, outcome: &Outcome) -> Result<()> {
    let now = DateTime::now();
    match outcome {
        Outcome::Unprocessable(reason) => {
            store.bury(&delivery.lease, reason, true, now).await?;
        }
        Outcome::Retry { reason, .. } | Outcome::Failed(reason) => {
            let due = DateTime::from_millis(now.timestamp_millis() + 1_000);
            store.reschedule(&delivery.lease, due, reason, now).await?;
        }
        Outcome::Completed => {}
    }
    Ok(())
}
