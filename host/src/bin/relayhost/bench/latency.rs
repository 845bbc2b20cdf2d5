//! The latency measurement of `relayhost bench`: events published one at a time at a steady
//! rate beside hosts assembled as for a drain, each timed from its commit to its handler's
//! start. It owns the timing; the hosts, stores and dispatcher options are the drain's.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bson::doc;
use relayhost::dispatch::{Dispatcher, HandlerSpec, RetryPolicy, RunResult, Runner};
use relayhost::event::NewEvent;
use relayhost::plugin::PluginRegistry;
use relayhost::plugin_runner::PluginRunner;
use relayhost::store::mongo::EventWakeups;
use relayhost::store::{ClaimedDelivery, Outbox, StoreTransaction};

use super::{BenchArgs, dispatcher_options, hosts, percentiles, store};

/// Notes when each event's handler run starts (its first run; later ones are counted), then
/// runs it.
struct Timed<R: Runner> {
    inner: R,
    started: Arc<Mutex<HashMap<String, Instant>>>,
    again: Arc<AtomicU64>,
}

impl<R: Runner> Runner for Timed<R> {
    fn handlers(&self) -> Vec<HandlerSpec> {
        self.inner.handlers()
    }

    fn run(&self, delivery: ClaimedDelivery) -> Pin<Box<dyn Future<Output = RunResult> + Send>> {
        match self.started.lock().expect("timings").entry(delivery.event.id.clone()) {
            Entry::Vacant(first) => {
                first.insert(Instant::now());
            }
            Entry::Occupied(_) => {
                self.again.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.inner.run(delivery)
    }
}

/// p50 and p99 in milliseconds from a commit to its handler's start, at a steady rate.
pub(super) struct Latency {
    /// From sending the commit: an upper bound, which includes the commit's own durable write.
    pub from_sent: (f64, f64),
    /// From the publisher learning that it committed: a lower bound.
    pub from_acknowledged: (f64, f64),
    /// The publisher's commits themselves: what one durable write costs on this disk in this
    /// run, the unit the path from commit to handler is made of.
    pub commit: (f64, f64),
    /// Handler runs beyond the first of an event (hosts racing for it).
    pub again: u64,
}

/// Latency of events published one at a time at `args.rate`, over `keys` keys (0: unkeyed).
pub(super) async fn latency(args: &BenchArgs, keys: usize, client: &mongodb::Client, registry: &Arc<PluginRegistry>) -> Result<Latency> {
    let database = format!("bench_latency_{keys}_{}", args.hosts);
    client.database(&database).drop().await?;
    let store = store(client, &database)?;
    store.setup().await?;
    let started: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let again: Arc<AtomicU64> = Arc::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut running = Vec::new();
    let mut wakeups = Vec::new();
    for host in hosts(&store, args.hosts) {
        let runner = PluginRunner::new(registry.clone(), host.clone(), Arc::new(|_: &str, _: &str| RetryPolicy::default()));
        let runner = Arc::new(Timed { inner: runner, started: started.clone(), again: again.clone() });
        let dispatcher = Dispatcher::new(host.clone(), runner, dispatcher_options(args));
        wakeups.push(EventWakeups::default().spawn(&host, dispatcher.waker()));
        let mut stopped = stopped.clone();
        running.push(tokio::spawn(async move {
            dispatcher
                .run(async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                })
                .await
        }));
    }
    // Let the change stream open and the lanes settle before measuring.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut committed = HashMap::new();
    let mut acknowledged = HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_secs(1) / args.rate);
    for n in 0..args.latency_events {
        ticker.tick().await;
        let mut event = NewEvent::new(format!("latency-{n}"), "bench", doc! { "n": n as i64 });
        if keys > 0 {
            event = event.with_key(format!("key-{}", n % keys));
        }
        let mut tx = store.begin().await?;
        store.publish(&mut tx, &event).await?;
        // Measured from the moment the commit is sent: an upper bound of the true latency.
        committed.insert(event.id.clone(), Instant::now());
        tx.commit().await?;
        acknowledged.insert(event.id.clone(), Instant::now());
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while started.lock().expect("timings").len() < args.latency_events {
        if Instant::now() > deadline {
            bail!("not every latency event was handled within a minute");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(true);
    for host in running {
        host.await.context("a dispatcher task")??;
    }
    for wakeup in wakeups {
        wakeup.abort();
    }
    let started = started.lock().expect("timings");
    let between = |from: &HashMap<String, Instant>, to: &HashMap<String, Instant>| {
        percentiles(from.iter().map(|(id, at)| to[id].saturating_duration_since(*at).as_secs_f64() * 1_000.0).collect())
    };
    Ok(Latency {
        from_sent: between(&committed, &started),
        from_acknowledged: between(&acknowledged, &started),
        commit: between(&committed, &acknowledged),
        again: again.load(Ordering::Relaxed),
    })
}
