//! `relayhost bench --matrix`: the floor and every workload the delivery path must serve, on
//! one fresh `mongod` in one run, printed as one table: each drain as a share of the floor and
//! as a multiple of its 1-host figure, `mongod`'s CPU and counters per delivery, and the goals.
//!
//! It owns the choice of workloads and goals and the table; the measuring is the bench's
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

struct Row {
    name: String,
    hosts: u16,
    drained: Drained,
}

pub(super) async fn run(args: &BenchArgs, server: &Server, plugins: &Path) -> Result<()> {
    let runtime = Arc::new(PluginRuntime::new(None)?);
    let registry = Arc::new(PluginRegistry::new(runtime, plugins, |_| PluginPolicy::default()));
    registry.scan().await?;
    let (floor_before, _) = raw_floor(server, args.events).await?;
    println!("raw floor {floor_before:.0} documents/s; draining {} events per workload...", args.events);

    let mut rows = Vec::new();
    for (name, keys, hot_every) in [("unkeyed", 0, 0), ("1,000 keys", KEYS, 0), ("hot key + 1,000 keys", KEYS, HOT_EVERY)] {
        let hosts: &[u16] = if hot_every > 0 { &[1] } else { &[1, 2, 4] };
        for &count in hosts {
            let workload = Workload { events: args.events, keys, hot_every, hosts: count, database: format!("bench_matrix_{}", rows.len()) };
            let drained = drain(args, &workload, server, &registry).await?;
            println!("  {name} on {count} host(s): {:.0} deliveries/s", drained.rate);
            rows.push(Row { name: name.to_string(), hosts: count, drained });
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
        let one_host = rows.iter().find(|r| r.name == row.name && r.hosts == 1).expect("every workload runs on 1 host");
        let share = row.drained.rate / floor;
        let speedup = row.drained.rate / one_host.drained.rate;
        let cpu = micros_per(&row.drained.work, args.events);
        let cpu_ratio = cpu / micros_per(&one_host.drained.work, args.events).max(f64::MIN_POSITIVE);
        let (goal, met) = match (row.name.as_str(), row.hosts) {
            ("unkeyed", 1) => ("≥ 50 % of the floor".to_string(), share >= 0.50),
            ("1,000 keys", 1) => ("≥ 35 % of the floor".to_string(), share >= 0.35),
            ("hot key + 1,000 keys", _) => {
                let keyed = rows.iter().find(|r| r.name == "1,000 keys" && r.hosts == 1).expect("measured");
                let others = row.drained.others_rate.unwrap_or(0.0) / keyed.drained.rate;
                (format!("other keys at the keyed rate: {:.2}×", others), others >= 0.9)
            }
            _ => ("≥ 0.9× 1 host, CPU ≤ 1.25×".to_string(), speedup >= 0.9 && cpu_ratio <= 1.25),
        };
        let work = &row.drained.work;
        let per = |n: i64| n as f64 / args.events.max(1) as f64;
        println!(
            "| {} | {} | {:.0} | {:.0} % | {:.2} | {:.0} | {:.2} | {:.1} | {:.3} | {goal} | {} |",
            row.name,
            row.hosts,
            row.drained.rate,
            share * 100.0,
            speedup,
            cpu,
            cpu_ratio,
            per(work.written),
            per(work.commands),
            verdict(met)
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

/// `mongod`'s CPU time per delivery, in microseconds.
fn micros_per(work: &ServerWork, deliveries: usize) -> f64 {
    work.mongod_cpu.as_secs_f64() * 1e6 / deliveries.max(1) as f64
}
