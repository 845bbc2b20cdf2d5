//! `relayhost bench --purge-beside N`: what a purge costs a drain running beside it. N
//! completed events (old enough for the purge) are written beside each drained backlog; three
//! drains of the same backlog run, without, with and again without the purge (which starts
//! with the drain's clock, on its own store instance), and the drain with it is compared with
//! the mean of the two without, measured in the same run.

use relayhost::store::Administration;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use bson::{DateTime, doc};
use relayhost::plugin::{PluginPolicy, PluginRegistry, PluginRuntime};
use relayhost::store::mongo::MongoStore;
use relayhost::store::{PurgeOptions, PurgeReport, StoreOptions};
use tokio::task::JoinHandle;

use super::{BenchArgs, Server, Workload, drain};

/// Writes `count` completed events, created, fanned out and completed a day ago.
pub(super) async fn write_completed(store: &MongoStore, count: usize) -> Result<()> {
    let old = DateTime::from_millis(DateTime::now().timestamp_millis() - 86_400_000);
    for start in (0..count).step_by(10_000) {
        let documents: Vec<bson::Document> = (start..(start + 10_000).min(count))
            .map(|n| doc! {
                "_id": format!("old-{n}"), "type": "old", "payload": { "n": n as i64 }, "createdAt": old,
                "fannedOutAt": old, "completedAt": old, "handlers": ["noop"],
            })
            .collect();
        store.events_collection().insert_many(documents).await?;
    }
    Ok(())
}

/// Starts purging what is an hour old on another instance of `store`, if `count` events were
/// written for it.
pub(super) fn beside(store: &Arc<MongoStore>, count: usize, pace: f64) -> Option<JoinHandle<(Instant, Result<PurgeReport, relayhost::store::StoreError>)>> {
    (count > 0).then(|| {
        let purger = store.instance_with("bench-purge", StoreOptions { purge_pace: pace, ..store.options().clone() });
        tokio::spawn(async move {
            let started = Instant::now();
            let hour_ago = DateTime::from_millis(DateTime::now().timestamp_millis() - 3_600_000);
            let report = purger.purge(&PurgeOptions { completed_before: Some(hour_ago), dead_before: None }, DateTime::now()).await;
            (started, report)
        })
    })
}

/// Prints how far the purge got while the drain ran, and waits for it to end.
pub(super) async fn report(purging: JoinHandle<(Instant, Result<PurgeReport, relayhost::store::StoreError>)>, drained_in: Duration) -> Result<()> {
    let (started, report) = purging.await?;
    let report = report?;
    let took = started.elapsed();
    println!(
        "  purge beside it: {} events in {:.1} s ({:.0}/s); the drain took {:.1} s of it",
        report.events,
        took.as_secs_f64(),
        report.events as f64 / took.as_secs_f64(),
        drained_in.as_secs_f64()
    );
    Ok(())
}

pub(super) async fn run(args: &BenchArgs, server: &Server, plugins: &std::path::Path) -> Result<()> {
    let runtime = Arc::new(PluginRuntime::new(None)?);
    let registry = Arc::new(PluginRegistry::new(runtime, plugins, |_| PluginPolicy::default()));
    registry.scan().await?;
    let mut rates = Vec::new();
    for (round, beside) in [0, args.purge_beside, 0].into_iter().enumerate() {
        let workload = Workload { purged_beside: beside, database: format!("bench_purge_{round}"), ..Workload::of(args) };
        let drained = drain(args, &workload, server, &registry).await?;
        let alone = if beside > 0 { format!("beside a purge of {beside} completed events") } else { "alone".to_string() };
        println!("drain {alone}: {:.0} deliveries/s", drained.rate);
        rates.push(drained.rate);
    }
    let without = (rates[0] + rates[2]) / 2.0;
    println!("with the purge (pace {}): {:.2}x the drain without it (goal >= 0.90)", args.purge_pace, rates[1] / without);
    Ok(())
}
