//! `relayhost bench`: drain throughput and wakeup latency, with the raw floor measured on the
//! same mongod in the same run, printed as ratios against that floor and against the goals.
//!
//! A fresh single-node replica set is started for the run (so nothing else shares it), and
//! the host's own pieces are used as `relayhost run` assembles them: the MongoDB store, the
//! plugin registry with the no-op Rust plugin, the dispatcher, change-stream wakeups.
//! `--matrix` runs every workload the delivery path must serve on that one `mongod` and prints
//! them as one table ([`matrix`]). `--store-only` completes each drained delivery at once
//! instead of running the plugin: what the store and the dispatcher alone reach, so that the
//! sandbox's share of a drain shows beside the floor.
//!
//! The drain and the floor are here, with the workload, the hosts and the dispatcher options
//! every measurement shares; the measurements that reuse them live beside it (`latency`,
//! `matrix`, `purge`, `tracing_cost`), and the server they run on (`server`).

mod latency;
mod matrix;
mod purge;
mod server;
mod tracing_cost;

use relayhost::store::Outbox;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bson::{Document, doc};
use clap::Args;
use futures::{StreamExt, TryStreamExt};
use relayhost::dispatch::{
    AttemptResult, Controls, Dispatcher, DispatcherCounters, DispatcherOptions, HandlerSpec, RetryPolicy, RunResult, Runner, Throttle,
};
use relayhost::event::NewEvent;
use relayhost::mongod::{Mongod, MongodOptions, find_binary};
use relayhost::plugin::{PluginPolicy, PluginRegistry, PluginRuntime};
use relayhost::plugin_runner::PluginRunner;
use relayhost::store::mongo::{MongoLocation, MongoStore};
use relayhost::store::limiter::GlobalRate;
use relayhost::store::{ClaimedDelivery, StoreOptions, run_in_transaction};
use latency::latency;
use server::{Server, ServerWork};

#[derive(Args, Clone)]
pub struct BenchArgs {
    /// Events in the drained backlog (and documents of the raw floor).
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Events published one by one for the latency measurement.
    #[arg(long, default_value_t = 500)]
    latency_events: usize,
    /// Their rate, per second.
    #[arg(long, default_value_t = 50)]
    rate: u32,
    /// Directory holding `noop.wasm` (built by scripts/build-plugins.sh).
    #[arg(long, default_value = "plugins/target/wasm32-wasip2/release")]
    plugins: PathBuf,
    /// Deliveries running at once.
    #[arg(long, default_value_t = DispatcherOptions::default().concurrency)]
    concurrency: usize,
    /// Deliveries a claim may take beyond the free run slots (`host.claim_ahead`; default: 4
    /// per run slot, as in the host).
    #[arg(long)]
    claim_ahead: Option<usize>,
    /// Spread the drained events, and the latency events, over this many ordering keys (0, the
    /// default: unkeyed). Keyed events run one at a time per key.
    #[arg(long, default_value_t = 0)]
    keys: usize,
    /// Put every `hot_every`-th drained event on one hot key instead (0, the default: none; the
    /// matrix's hot-key row is `--keys 1000 --hot-every 10`).
    #[arg(long, default_value_t = 0)]
    hot_every: usize,
    /// Hosts sharing the drain and the latency events: each its own store instance (lane
    /// owner), dispatcher and change stream, all in this process, as separate `relayhost run`
    /// processes would on this machine. They split the lanes, as separate hosts do.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    hosts: u16,
    /// Start every host but the first this many milliseconds into the drain: hosts joining a
    /// running drain, which the lanes' split then moves (0, the default: all at once).
    #[arg(long, default_value_t = 0)]
    join_after: u64,
    /// Give up on a drain that completes nothing for this many seconds.
    #[arg(long, default_value_t = 60)]
    stall_after: u64,
    /// Complete each drained delivery at once instead of running the no-op plugin: the store
    /// and the dispatcher alone, so that what the plugin runs cost shows (the latency events
    /// still run the plugin). The matrix measures both.
    #[arg(long)]
    store_only: bool,
    /// Limit the drained handler across hosts to 64 at once and a rate far above the drain's
    /// (a million a second): what keeping to limits across hosts costs when they do not bind.
    #[arg(long)]
    limited: bool,
    /// Run the whole matrix instead (unkeyed, keyed, a hot key; 1, 2 and 4 hosts; latency
    /// unkeyed and keyed on 1 and 2 hosts) and print one table with ratios and goals.
    #[arg(long)]
    matrix: bool,
    /// Measure instead what purging this many completed events beside a drain costs it: drains
    /// without, with and again without the purge, and the ratio (see `bench/purge.rs`).
    #[arg(long, default_value_t = 0)]
    purge_beside: usize,
    /// The share of its time that purge works (`retention.pace`).
    #[arg(long, default_value_t = 0.25)]
    purge_pace: f64,
    /// Measure instead what tracing every attempt costs a drain: drains without, with (spans
    /// and metrics exported over OTLP/HTTP to a local receiver) and again without, and the
    /// ratio (see `bench/tracing_cost.rs`).
    #[arg(long)]
    tracing_cost: bool,
}

/// One drain's workload.
#[derive(Debug, Clone)]
struct Workload {
    events: usize,
    /// Ordering keys the events are spread over (0: unkeyed).
    keys: usize,
    /// Every `hot_every`-th event goes to one hot key instead (0: none).
    hot_every: usize,
    hosts: u16,
    /// Complete each delivery at once, without running the plugin (see `--store-only`).
    store_only: bool,
    /// The database it runs in, fresh.
    database: String,
    /// Completed events written beside the backlog, purged while it drains (see `--purge-beside`).
    purged_beside: usize,
    /// Each attempt traced, exported to this OTLP/HTTP base address (see `--tracing-cost`).
    traced_to: Option<String>,
    /// The drained handler limited across hosts, far above what the drain reaches (see
    /// `--limited`).
    limited: bool,
}

impl Workload {
    fn of(args: &BenchArgs) -> Self {
        Self {
            events: args.events,
            keys: args.keys,
            hot_every: args.hot_every,
            hosts: args.hosts,
            store_only: args.store_only,
            database: "bench_drain".into(),
            purged_beside: 0,
            traced_to: None,
            limited: args.limited,
        }
    }

    fn key_of(&self, n: usize) -> Option<String> {
        if self.hot_every > 0 && n % self.hot_every == 0 {
            return Some(HOT_KEY.to_string());
        }
        (self.keys > 0).then(|| format!("key-{}", n % self.keys))
    }
}

const HOT_KEY: &str = "hot";

/// What a drain measured: its rate, `mongod`'s work, and the rate of the events off the hot
/// key (when there is one).
struct Drained {
    rate: f64,
    work: ServerWork,
    others_rate: Option<f64>,
    /// Deliveries that ran the plugin (none with `--store-only`).
    plugin_runs: u64,
}

pub async fn run(args: BenchArgs) -> Result<()> {
    if args.latency_events == 0 || args.rate == 0 {
        bail!("--latency-events and --rate must be at least 1: the latency measurement times events published at that rate");
    }
    let noop = args.plugins.join("noop.wasm");
    if !noop.is_file() {
        bail!("{} does not exist: run scripts/build-plugins.sh, or pass --plugins", noop.display());
    }
    let scratch = std::env::temp_dir().join(format!("relayhost-bench-{}", std::process::id()));
    let plugins = scratch.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    std::fs::copy(&noop, plugins.join("noop.wasm"))?;
    println!("starting a fresh mongod for this run");
    let options = MongodOptions { die_with_parent: true, ..MongodOptions::new(find_binary()?, scratch.join("data")) };
    let mongod = Mongod::start(options).await?;
    let client = mongodb::Client::with_uri_str(mongod.uri()).await?;
    let pid = mongod.pid().context("mongod exited")?;
    let server = Server { client, pid };
    let result = if args.matrix {
        matrix::run(&args, &server, &plugins).await
    } else if args.purge_beside > 0 {
        purge::run(&args, &server, &plugins).await
    } else if args.tracing_cost {
        tracing_cost::run(&args, &server, &plugins).await
    } else {
        measure(&args, &server, &plugins).await
    };
    mongod.stop();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

async fn measure(args: &BenchArgs, server: &Server, plugins: &std::path::Path) -> Result<()> {
    let client = &server.client;
    let (floor_before, floor_work) = raw_floor(server, args.events).await?;
    println!("raw floor    {:>8.0} documents/s  (find 100, delete them with one delete, over {} documents)", floor_before, args.events);

    let runtime = Arc::new(PluginRuntime::new(None)?);
    let registry = Arc::new(PluginRegistry::new(runtime, plugins, |_| PluginPolicy::default()));
    registry.scan().await?;

    let Drained { rate: drain, work: drain_work, others_rate, plugin_runs } = drain(args, &Workload::of(args), server, &registry).await?;
    // The disk's speed drifts within a run; a floor measured on both sides of the drain, and
    // the faster one used, keeps a slow moment from passing the goal.
    let (floor_after, _) = raw_floor(server, args.events).await?;
    let floor = floor_before.max(floor_after);
    println!("raw floor    {floor_after:>8.0} documents/s  (again, after the drain; the ratio uses the faster: {floor:.0})");
    let ratio = drain / floor;
    let on_hosts = if args.hosts > 1 { format!(" on {} hosts", args.hosts) } else { String::new() };
    let drained_on = match args.join_after {
        joins if joins > 0 && args.hosts > 1 => format!("{on_hosts}, all but one joining {joins} ms into it"),
        _ => on_hosts.clone(),
    };
    let hot = if args.hot_every > 0 { format!(", every {}th on one hot key", args.hot_every) } else { String::new() };
    let events = match args.keys {
        0 => format!("{} unkeyed events{hot}{drained_on}", args.events),
        keys => format!("{} events over {keys} keys{hot}{drained_on}", args.events),
    };
    // The goals (#24): half the floor unkeyed, a third keyed.
    let goal = if args.keys == 0 { 0.50 } else { 0.35 };
    let through = if args.store_only { "each completed at once, no plugin run" } else { "through the no-op plugin" };
    println!(
        "drain        {drain:>8.0} deliveries/s  ({events} {through}) = {:.0} % of the floor (goal >= {:.0} %): {}",
        ratio * 100.0,
        goal * 100.0,
        verdict(ratio >= goal)
    );
    println!("             {plugin_runs} plugin runs");
    if let Some(others) = others_rate {
        println!("             the events off the hot key: {others:.0} deliveries/s until the last of them ran");
    }
    println!("mongod work  per delivery: {}", drain_work.per(args.events));
    println!("             per floor document: {}", floor_work.per(args.events));

    // Over the drain's keys, so that `--keys 1000` measures the matrix's keyed latency row.
    let latency = latency(args, args.keys, client, &registry).await?;
    let (p50, p99) = latency.from_sent;
    let commits = p50 / latency.commit.0;
    let spread = if args.keys == 0 { String::new() } else { format!(" over {} keys", args.keys) };
    println!(
        "latency      p50 {p50:.1} ms = {commits:.2} publisher commits (goal <= 1.7), p99 {p99:.1} ms (goal <= 5), commit sent to handler start, {} events{spread} at {}/s{on_hosts}: {}",
        args.latency_events,
        args.rate,
        verdict(commits <= 1.7 && p99 <= 5.0)
    );
    if latency.again > 0 {
        println!("             {} handler runs were of events run before (hosts racing: at-least-once)", latency.again);
    }
    let (p50, p99) = latency.from_acknowledged;
    println!("             p50 {p50:.1} ms, p99 {p99:.1} ms from the commit's acknowledgement (the commit happened in between)");
    let (commit_p50, commit_p99) = latency.commit;
    println!(
        "commit       p50 {commit_p50:.1} ms, p99 {commit_p99:.1} ms (the publisher's own durable commit, same run): the unit of the latency goal"
    );
    let (ping_p50, ping_p99) = round_trip(client).await?;
    println!(
        "round trip   p50 {ping_p50:.2} ms, p99 {ping_p99:.2} ms (a ping to the same mongod, same run): the other unit the path is made of"
    );
    Ok(())
}

/// p50 and p99 of a `ping` to the server: what one round trip costs on this machine, apart
/// from any work.
async fn round_trip(client: &mongodb::Client) -> Result<(f64, f64)> {
    let admin = client.database("admin");
    let mut milliseconds = Vec::with_capacity(200);
    for _ in 0..200 {
        let started = Instant::now();
        admin.run_command(doc! { "ping": 1 }).await?;
        milliseconds.push(started.elapsed().as_secs_f64() * 1_000.0);
    }
    Ok(percentiles(milliseconds))
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

/// The floor: what MongoDB alone does for a queue of documents on this machine.
async fn raw_floor(server: &Server, count: usize) -> Result<(f64, ServerWork)> {
    let client = &server.client;
    let collection = client.database("bench_floor").collection::<Document>("queue");
    collection.drop().await?;
    for chunk in (0..count).collect::<Vec<_>>().chunks(1_000) {
        let documents = chunk.iter().map(|n| doc! { "_id": *n as i64, "type": "bench", "payload": { "n": *n as i64 } });
        collection.insert_many(documents).await?;
    }
    let work = ServerWork::now(server).await?;
    let started = Instant::now();
    let mut removed = 0;
    loop {
        let batch: Vec<Document> = collection.find(doc! {}).sort(doc! { "_id": 1 }).limit(100).await?.try_collect().await?;
        if batch.is_empty() {
            break;
        }
        let ids: Vec<bson::Bson> = batch.iter().filter_map(|d| d.get("_id").cloned()).collect();
        removed += collection.delete_many(doc! { "_id": { "$in": ids } }).await?.deleted_count;
    }
    if removed as usize != count {
        bail!("the floor removed {removed} of {count} documents");
    }
    let rate = count as f64 / started.elapsed().as_secs_f64();
    Ok((rate, ServerWork::now(server).await?.since(work)))
}

fn store(client: &mongodb::Client, database: &str) -> Result<Arc<MongoStore>> {
    let location = MongoLocation::with_default_prefix(database)?;
    Ok(Arc::new(MongoStore::new(client.clone(), location, StoreOptions::default())))
}

/// `count` instances of `store`, each a host of its own (the first is `store` itself).
fn hosts(store: &Arc<MongoStore>, count: u16) -> Vec<Arc<MongoStore>> {
    std::iter::once(store.clone())
        .chain((1..count).map(|n| Arc::new(store.instance(&format!("bench-host-{n}")))))
        .collect()
}

/// The limits across hosts of a `--limited` drain: 64 at once, a rate far above the drain's.
const LIMITED: Throttle = Throttle {
    concurrency: None,
    rate: None,
    global_concurrency: Some(64),
    global_rate: Some(GlobalRate { max: 1_000_000, per_ms: 1_000, burst: 1_000_000 }),
};

fn dispatcher_options(args: &BenchArgs) -> DispatcherOptions {
    // No busy polling: new events arrive by change stream, the poll is a slow safety net.
    DispatcherOptions {
        concurrency: args.concurrency,
        claim_ahead: args.claim_ahead.unwrap_or(DispatcherOptions::default_claim_ahead(args.concurrency)),
        poll_interval: Duration::from_secs(1),
        ..DispatcherOptions::default()
    }
}

/// Deliveries per second draining a published backlog of `workload`, and what `mongod` did
/// for them.
async fn drain(args: &BenchArgs, workload: &Workload, server: &Server, registry: &Arc<PluginRegistry>) -> Result<Drained> {
    let client = &server.client;
    client.database(&workload.database).drop().await?;
    let store = store(client, &workload.database)?;
    store.setup().await?;
    let events: Vec<NewEvent> = (0..workload.events)
        .map(|n| {
            let event = NewEvent::new(format!("bench-{n}"), "bench", doc! { "n": n as i64 });
            match workload.key_of(n) {
                Some(key) => event.with_key(key),
                None => event,
            }
        })
        .collect();
    let others = events.iter().filter(|event| event.key.as_deref() != Some(HOT_KEY)).count() as u64;
    // Several publishers at once, as an application's would be: the backlog is written before
    // the clock starts, and one publisher alone spends most of the run on its round trips.
    // Transactions of 100 events stay far inside the store's 5 s transaction budget even when
    // the disk is slow (500 once ran past it). Publishers of one key conflict on its counter
    // and run again.
    futures::stream::iter(events.chunks(100))
        .map(|chunk| {
            let store = store.clone();
            async move {
                run_in_transaction(&*store, async |tx| {
                    for event in chunk {
                        store.publish(tx, event).await?;
                    }
                    Ok(())
                })
                .await
            }
        })
        .buffer_unordered(4)
        .try_collect::<Vec<_>>()
        .await?;
    purge::write_completed(&store, workload.purged_beside).await?;
    let off_hot_key: Arc<AtomicU64> = Arc::default();
    let plugin_runs: Arc<AtomicU64> = Arc::default();
    let dispatchers: Vec<_> = hosts(&store, workload.hosts)
        .into_iter()
        .map(|store| {
            let runner = PluginRunner::new(registry.clone(), store.clone(), Arc::new(|_: &str, _: &str| RetryPolicy::default()));
            let runner = match &workload.traced_to {
                Some(endpoint) => runner.traced_by(tracing_cost::telemetry(endpoint, &store.options().owner)?),
                None => runner,
            };
            let runner = if workload.limited { runner.controlled_by(Arc::new(|_: &str, _: &str| Controls { throttle: LIMITED, ..Controls::default() })) } else { runner };
            let runner = DrainRunner {
                plugin: runner,
                store_only: workload.store_only,
                plugin_runs: plugin_runs.clone(),
                off_hot_key: off_hot_key.clone(),
            };
            Ok(Dispatcher::new(store, Arc::new(runner), dispatcher_options(args)))
        })
        .collect::<Result<_>>()?;
    let counters: Vec<Arc<DispatcherCounters>> = dispatchers.iter().map(Dispatcher::counters).collect();
    let total = |counter: fn(&DispatcherCounters) -> &AtomicU64| {
        counters.iter().map(|c| DispatcherCounters::get(counter(c))).sum::<u64>()
    };
    let target = workload.events as u64;
    let stall = Duration::from_secs(args.stall_after);
    let work = ServerWork::now(server).await?;
    let purging = purge::beside(&store, workload.purged_beside, args.purge_pace);
    let started = Instant::now();
    // Ends when every delivery completed, or when none did for a while: a drain that stalls
    // is reported as a failure instead of waiting forever.
    let (finish, finished) = tokio::sync::watch::channel(false);
    let mut others_done = None;
    let monitor = async {
        let mut progress = (0, Instant::now());
        loop {
            let completed = total(|c| &c.completed);
            if others_done.is_none() && off_hot_key.load(Ordering::Relaxed) >= others {
                others_done = Some(started.elapsed());
            }
            if completed >= target || progress.1.elapsed() > stall {
                break;
            }
            if completed > progress.0 {
                progress = (completed, Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = finish.send(true);
    };
    let runs = futures::future::try_join_all(dispatchers.iter().enumerate().map(|(n, dispatcher)| {
        let mut finished = finished.clone();
        let joins = Duration::from_millis(if n == 0 { 0 } else { args.join_after });
        async move {
            tokio::time::sleep(joins).await;
            dispatcher.run(async move {
                let _ = finished.wait_for(|done| *done).await;
            })
            .await
        }
    }));
    let ((), ran) = tokio::join!(monitor, runs);
    ran?;
    let elapsed = started.elapsed();
    if let Some(purging) = purging {
        purge::report(purging, elapsed).await?;
    }
    let completed = total(|c| &c.completed);
    if completed < target {
        bail!(
            "the drain stalled: {completed} of {target} deliveries completed, none in the last {} s",
            stall.as_secs()
        );
    }
    let work = ServerWork::now(server).await?.since(work);
    if total(|c| &c.dead) > 0 {
        bail!("deliveries died during the drain");
    }
    if completed > target {
        println!("drain        {} deliveries ran twice (hosts racing: at-least-once)", completed - target);
    }
    let others_rate = (workload.hot_every > 0).then(|| others as f64 / others_done.unwrap_or(elapsed).as_secs_f64());
    let plugin_runs = plugin_runs.load(Ordering::Relaxed);
    Ok(Drained { rate: workload.events as f64 / elapsed.as_secs_f64(), work, others_rate, plugin_runs })
}

/// The drain's runner: runs the plugin and counts its runs, or (`store_only`, the bench's
/// `--store-only`) completes each delivery at once without it, so that the store's and the
/// dispatcher's work is all that is left; and counts the deliveries off the hot key that ran
/// to their end.
struct DrainRunner<R: Runner> {
    plugin: R,
    store_only: bool,
    plugin_runs: Arc<AtomicU64>,
    off_hot_key: Arc<AtomicU64>,
}

impl<R: Runner> Runner for DrainRunner<R> {
    fn handlers(&self) -> Vec<HandlerSpec> {
        self.plugin.handlers()
    }

    fn run(&self, delivery: ClaimedDelivery) -> Pin<Box<dyn Future<Output = RunResult> + Send>> {
        let off_hot_key = delivery.event.key.as_deref() != Some(HOT_KEY);
        let run = (!self.store_only).then(|| {
            self.plugin_runs.fetch_add(1, Ordering::Relaxed);
            self.plugin.run(delivery)
        });
        let completed = self.off_hot_key.clone();
        Box::pin(async move {
            let result = match run {
                Some(run) => run.await,
                None => RunResult::Attempt(AttemptResult::Completed),
            };
            if off_hot_key {
                completed.fetch_add(1, Ordering::Relaxed);
            }
            result
        })
    }
}

/// p50 and p99 of `milliseconds` (not empty).
fn percentiles(mut milliseconds: Vec<f64>) -> (f64, f64) {
    milliseconds.sort_by(f64::total_cmp);
    let percentile = |p: f64| milliseconds[((milliseconds.len() as f64 * p).ceil() as usize).saturating_sub(1)];
    (percentile(0.50), percentile(0.99))
}
