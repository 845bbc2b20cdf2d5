//! The outbox store end to end on an embedded MongoDB: a pymongo publisher commits orders
//! with their events (some transactions abort), the store fans them out to two handlers, and
//! a worker claims and completes them in per-customer order.
//!
//! Run through `scripts/demo`, which installs mongod and pymongo first.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bson::DateTime;
use relayhost::mongod::{Mongod, MongodOptions, cache_dir, find_binary};
use relayhost::store::mongo::{MongoLocation, MongoStore};
use relayhost::store::{Store, StoreOptions, Subscription, Subscriptions};

#[tokio::main]
async fn main() -> Result<()> {
    let data_dir = cache_dir().join("demo-data");
    println!("starting the embedded MongoDB (data in {})", data_dir.display());
    let mongod = Mongod::start(MongodOptions::new(find_binary()?, data_dir)).await?;
    let client = mongodb::Client::with_uri_str(mongod.uri()).await?;
    // A fresh database per run, so the output is the same every time.
    let database = format!("relayhost_demo_{}", std::process::id());
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database)?, StoreOptions::default());
    store.setup().await?;

    println!("publishing 12 orders from Python (pymongo); the odd ones abort their transaction");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().context("repository root")?;
    let status = Command::new("python3")
        .arg(root.join("examples/publishers/python/publish.py"))
        .args([mongod.uri().as_str(), database.as_str(), "12", "--abort-odd"])
        .env("PYTHONPATH", std::env::var("RELAYHOST_PYTHONPATH").unwrap_or_default())
        .status()?;
    if !status.success() {
        bail!("the Python publisher failed: {status}");
    }

    let subscriptions = Subscriptions::new([
        Subscription::new("audit-log", ["order.placed"]),
        Subscription::new("mailer", ["order.placed"]),
    ])?;
    let report = store.fan_out(&subscriptions, 100, DateTime::now()).await?;
    println!("fanned out {} events into {} deliveries", report.events, report.deliveries);

    let handlers = subscriptions.handlers();
    loop {
        let claimed = store.claim(&handlers, 4, DateTime::now()).await?;
        if claimed.is_empty() {
            break;
        }
        for delivery in &claimed {
            println!(
                "  {:<9} <- {:<16} key {:<10} sequence {}  lease {}",
                delivery.handler,
                delivery.event.id,
                delivery.event.key.as_deref().unwrap_or("-"),
                delivery.event.sequence.unwrap_or(0),
                delivery.lease.token(),
            );
        }
        let leases: Vec<_> = claimed.iter().map(|d| d.lease).collect();
        store.complete_many(&leases, DateTime::now()).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for stats in store.statistics(DateTime::now()).await? {
        println!("{}: {} pending, {} dead", stats.handler, stats.pending, stats.dead);
    }
    client.database(&database).drop().await?;
    store.relinquish().await?;
    drop(client);
    mongod.stop();
    println!("done: every committed order was delivered to both handlers; aborted orders left no event");
    Ok(())
}
