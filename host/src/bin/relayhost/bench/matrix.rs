//! `relayhost bench --matrix`: the floor and every workload the delivery path must serve, on
//! one fresh `mongod` in one run, printed as one table: each drain as a share of the floor and
//! as a multiple of its 1-host figure, `mongod`'s CPU and counters per delivery, and the goals.
//!
//! A workload's several-host drains are interleaved with its one-host drains (1, 2, 1, 4, 1
//! hosts), and each is divided by the mean of the one-host drains just before and after it:
//! on a machine whose speed drifts within a run, a one-host figure measured minutes earlier
//! would move the ratio more than the hosts do. The one-host row is the mean of all of them.
//!
//! The unkeyed workload drains once more with its handler limited across hosts (`--limited`:
//! 64 at once, a rate far above the drain's), between one-host drains, and is compared with
//! them (its goal: within 10 %).
//!
//! After its one-host and several-host drains, the unkeyed and the keyed workload each drain
//! once more on one host with every delivery completed at once, no plugin run
//! (`--store-only`): a second table sets what the store and the dispatcher alone reach beside
//! the same workload with the plugin, so that the sandbox's share of each row shows.
//!
//! It owns the choice of workloads and goals and the tables; the measuring is the bench's
//! (`drain`, `latency`, `raw_floor`), the same as a single run's.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use relayhost::plugin::{PluginPolicy, PluginRegistry, PluginRuntime};

use super::{BenchArgs, Drained, Server, ServerWork, Workload, drain, latency, raw_floor, verdict};

/// Keys of the keyed drains: 20 events per key at the default 20,000 events.
const KEYS: usize = 1_000;
/// Every tenth event on one hot key: 2,000 of 20,000.
const HOT_EVERY: usize = 10;

/// The unkeyed drain's handler limited across hosts (64 at once, a rate far above the drain's).
const LIMITED_ROW: &str = "unkeyed, limited across hosts";

/// One row of the table: the mean of one or more drains of a workload on `hosts` hosts.
struct Row {
    name: String,
    hosts: u16,
    /// Deliveries per second, the mean of the drains.
    rate: f64,
    /// `mongod`'s work over all of the drains, and the deliveries they made.
    work: ServerWork,
    deliveries: usize,
    others_rate: Option<f64>,
    /// A several-host row's one-host figures: the mean of the one-host drains around it.
    one_host: Option<Box<Row>>,
}

impl Row {
    fn of(name: &str, hosts: u16, drains: &[&Drained], events: usize) -> Self {
        let count = drains.len().max(1) as f64;
        let mean = |value: fn(&Drained) -> Option<f64>| {
            let values: Vec<f64> = drains.iter().filter_map(|drained| value(drained)).collect();
            (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
        };
        Self {
            name: name.to_string(),
            hosts,
            rate: drains.iter().map(|drained| drained.rate).sum::<f64>() / count,
            work: drains.iter().fold(ServerWork::default(), |sum, drained| sum.plus(drained.work)),
            deliveries: events * drains.len(),
            others_rate: mean(|drained| drained.others_rate),
            one_host: None,
        }
    }

    /// `mongod`'s CPU time per delivery, in microseconds.
    fn cpu_per_delivery(&self) -> f64 {
        self.work.mongod_cpu.as_secs_f64() * 1e6 / self.deliveries.max(1) as f64
    }

    /// The host's (this process's) CPU time per delivery, in microseconds.
    fn host_cpu_per_delivery(&self) -> f64 {
        self.work.host_cpu.as_secs_f64() * 1e6 / self.deliveries.max(1) as f64
    }

    /// This row's rate and `mongod` CPU per delivery as multiples of its one-host figures.
    fn against_one_host(&self) -> (f64, f64) {
        match &self.one_host {
            Some(one) => (self.rate / one.rate, self.cpu_per_delivery() / one.cpu_per_delivery().max(f64::MIN_POSITIVE)),
            None => (1.0, 1.0),
        }
    }
}

pub(super) async fn run(args: &BenchArgs, server: &Server, plugins: &Path) -> Result<()> {
    let runtime = Arc::new(PluginRuntime::new(None)?);
    let registry = Arc::new(PluginRegistry::new(runtime, plugins, |_| PluginPolicy::default()));
    registry.scan().await?;
    let (floor_before, _) = raw_floor(server, args.events).await?;
    println!("raw floor {floor_before:.0} documents/s; draining {} events per workload...", args.events);

    let mut rows = Vec::new();
    // Each workload's drain without plugin runs, with its one-host rate and host CPU per
    // delivery with them.
    let mut store_only: Vec<(Row, f64, f64)> = Vec::new();
    let workloads = [("unkeyed", 0, 0), ("1,000 keys", KEYS, 0), ("hot key + 1,000 keys", KEYS, HOT_EVERY)];
    for (workload_number, (name, keys, hot_every)) in workloads.into_iter().enumerate() {
        let several: &[u16] = if hot_every > 0 { &[] } else { &[2, 4] };
        let mut drains = 0;
        let mut run = async |hosts: u16, store_only: bool, limited: bool| -> Result<Drained> {
            let database = format!("bench_matrix_{workload_number}_{drains}");
            let workload = Workload { events: args.events, keys, hot_every, hosts, store_only, database, purged_beside: 0, traced_to: None, limited };
            drains += 1;
            let drained = drain(args, &workload, server, &registry).await?;
            let alone = match (store_only, limited) {
                (true, _) => ", store only,",
                (_, true) => ", limited across hosts,",
                _ => "",
            };
            println!("  {name}{alone} on {hosts} host(s): {:.0} deliveries/s", drained.rate);
            Ok(drained)
        };
        let mut one_host = vec![run(1, false, false).await?];
        let mut more = Vec::new();
        for &hosts in several {
            let drained = run(hosts, false, false).await?;
            one_host.push(run(1, false, false).await?);
            let around = &one_host[one_host.len() - 2..];
            let mut row = Row::of(name, hosts, &[&drained], args.events);
            row.one_host = Some(Box::new(Row::of(name, 1, &around.iter().collect::<Vec<_>>(), args.events)));
            more.push(row);
        }
        // The unkeyed drain once more with its handler limited across hosts, far above what it
        // reaches (`--limited`), against the one-host drains around it.
        if keys == 0 {
            let drained = run(1, false, true).await?;
            one_host.push(run(1, false, false).await?);
            let around = &one_host[one_host.len() - 2..];
            let mut row = Row::of(LIMITED_ROW, 1, &[&drained], args.events);
            row.one_host = Some(Box::new(Row::of(name, 1, &around.iter().collect::<Vec<_>>(), args.events)));
            more.push(row);
        }
        let one_host = Row::of(name, 1, &one_host.iter().collect::<Vec<_>>(), args.events);
        let with_plugin = (one_host.rate, one_host.host_cpu_per_delivery());
        rows.push(one_host);
        rows.extend(more);
        if hot_every == 0 {
            let alone = run(1, true, false).await?;
            store_only.push((Row::of(name, 1, &[&alone], args.events), with_plugin.0, with_plugin.1));
        }
    }
    let (floor_after, _) = raw_floor(server, args.events).await?;
    let floor = floor_before.max(floor_after);

    println!();
    println!("raw floor: {floor_before:.0} before and {floor_after:.0} after the drains; the ratios use the faster, {floor:.0} documents/s");
    println!();
    println!("| workload | hosts | deliveries/s | of the floor | × 1 host | mongod µs / delivery | × 1 host | written / delivery | commands / delivery | goal | |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for row in &rows {
        let share = row.rate / floor;
        let (speedup, cpu_ratio) = row.against_one_host();
        let (goal, met) = match (row.name.as_str(), row.hosts) {
            ("unkeyed", 1) => ("≥ 50 % of the floor".to_string(), share >= 0.50),
            ("1,000 keys", 1) => ("≥ 35 % of the floor".to_string(), share >= 0.35),
            ("hot key + 1,000 keys", _) => {
                let keyed = rows.iter().find(|r| r.name == "1,000 keys" && r.hosts == 1).expect("measured");
                let others = row.others_rate.unwrap_or(0.0) / keyed.rate;
                (format!("other keys at the keyed rate: {:.2}×", others), others >= 0.9)
            }
            (LIMITED_ROW, _) => ("≥ 0.9× unlimited".to_string(), speedup >= 0.9),
            _ => ("≥ 0.9× 1 host, CPU ≤ 1.25×".to_string(), speedup >= 0.9 && cpu_ratio <= 1.25),
        };
        let per = |n: i64| n as f64 / row.deliveries.max(1) as f64;
        println!(
            "| {} | {} | {:.0} | {:.0} % | {:.2} | {:.0} | {:.2} | {:.1} | {:.3} | {goal} | {} |",
            row.name,
            row.hosts,
            row.rate,
            share * 100.0,
            speedup,
            row.cpu_per_delivery(),
            cpu_ratio,
            per(row.work.written),
            per(row.work.commands),
            verdict(met)
        );
    }
    println!();
    println!("| the store alone, 1 host: each delivery completed at once, no plugin run | deliveries/s | of the floor | × with the plugin | mongod µs / delivery | host µs / delivery | host µs with the plugin |");
    println!("|---|---|---|---|---|---|---|");
    for (alone, rate_with_plugin, host_cpu_with_plugin) in &store_only {
        println!(
            "| {} | {:.0} | {:.0} % | {:.2} | {:.0} | {:.0} | {:.0} |",
            alone.name,
            alone.rate,
            alone.rate / floor * 100.0,
            alone.rate / rate_with_plugin,
            alone.cpu_per_delivery(),
            alone.host_cpu_per_delivery(),
            host_cpu_with_plugin
        );
    }
    println!();
    println!("| latency, {} events at {}/s | hosts | p50 ms | p99 ms | p50 in publisher commits | goal | |", args.latency_events, args.rate);
    println!("|---|---|---|---|---|---|---|");
    for (name, keys) in [("unkeyed", 0), ("keyed", KEYS)] {
        for hosts in [1, 2] {
            let args = BenchArgs { hosts, ..args.clone() };
            let measured = latency(&args, keys, &server.client, &registry).await?;
            let (p50, p99) = measured.from_sent;
            let commits = p50 / measured.commit.0;
            println!(
                "| {name} | {hosts} | {p50:.1} | {p99:.1} | {commits:.2} | p50 ≤ 1.7 commits, p99 ≤ 5 ms | {} |",
                verdict(commits <= 1.7 && p99 <= 5.0)
            );
        }
    }
    Ok(())
}
