//! The plugin runtime's costs, each against a baseline measured in the same run:
//! - per-delivery overhead of a no-op Rust plugin (instantiate, call, drop) against calling
//!   a native Rust closure with the same event (goal: ≤ 25 µs p50 overhead);
//! - fuel metering on a CPU-bound plugin, against the same engine without metering
//!   (goal: ≤ 20 %);
//! - resident memory of an idle host with 10 plugins loaded, against the same process before
//!   loading them (goal: ≤ 150 MB in all).
//!
//! `cargo bench -p relayhost --bench plugin` (builds the plugins first).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use bson::{DateTime, doc};
use relayhost::event::EventRecord;
use relayhost::plugin::{DeliveryInfo, Limits, Outcome, PluginPolicy, PluginRuntime, RuntimeOptions};

fn plugins_dir() -> PathBuf {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/build-plugins.sh");
    let output = Command::new(script).output().expect("run scripts/build-plugins.sh");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    PathBuf::from(String::from_utf8(output.stdout).unwrap().trim())
}

fn event(event_type: &str, payload: bson::Document) -> EventRecord {
    EventRecord {
        id: "bench-1".into(),
        event_type: event_type.into(),
        payload,
        key: None,
        sequence: None,
        headers: BTreeMap::new(),
        correlation_id: None,
        causation_id: None,
        priority: None,
        chain_depth: 0,
        chain_budget: None,
        created_at: DateTime::now(),
    }
}

fn p50(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// A line of /proc/self/status in MB.
fn status_mb(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status.lines().find_map(|l| l.strip_prefix(field)).unwrap().trim().trim_end_matches(" kB").trim().parse().unwrap();
    kb / 1024.0
}

fn rss_mb() -> f64 {
    status_mb("VmRSS:")
}

/// What the resident memory is: the heap and other private pages, mapped files (compiled
/// artifacts when they are mapped), shared memory (wasmtime's copy-on-write images of the
/// plugins' initial linear memories).
fn rss_parts() -> String {
    format!("anonymous {:.0}, files {:.0}, shared {:.0}", status_mb("RssAnon:"), status_mb("RssFile:"), status_mb("RssShmem:"))
}

fn main() {
    // As the host does, before any thread starts.
    relayhost::plugin::limit_allocator_arenas();
    let dir = plugins_dir();
    let cache = std::env::temp_dir().join(format!("relayhost-bench-artifacts-{}", std::process::id()));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let rss_before = rss_mb();
        let metered = PluginRuntime::with_options(RuntimeOptions { cache_dir: Some(cache.clone()), meter_fuel: true, recording: None }).unwrap();
        let unmetered = PluginRuntime::with_options(RuntimeOptions { cache_dir: Some(cache.clone()), meter_fuel: false, recording: None }).unwrap();
        let policy = PluginPolicy { limits: Limits { fuel: u64::MAX / 2, ..Limits::default() }, ..Default::default() };

        // 1. Per-delivery overhead.
        let noop = metered.load(&dir.join("noop.wasm"), policy.clone()).await.unwrap();
        let order = event("order.placed", doc! { "orderId": "o-1", "total": 12 });
        let info = DeliveryInfo { handler: "noop".into(), attempt: 1, max_attempts: 5, deadline: 0, trace_context: Vec::new() };
        let mut plugin_samples = Vec::new();
        for round in 0..2_200 {
            let started = Instant::now();
            let ran = metered.invoke(&noop, &order, &info).await;
            let elapsed = started.elapsed();
            assert_eq!(ran.outcome, Outcome::Completed);
            if round >= 200 {
                plugin_samples.push(elapsed);
            }
        }
        let native = |event: &EventRecord| -> Result<(), String> {
            // What the plugin receives: the event with its payload as JSON text.
            black_box(bson::Bson::Document(event.payload.clone()).into_relaxed_extjson().to_string());
            Ok(())
        };
        let mut native_samples = Vec::new();
        for _ in 0..2_000 {
            let started = Instant::now();
            black_box(native(black_box(&order))).unwrap();
            native_samples.push(started.elapsed());
        }
        let (plugin_p50, native_p50) = (p50(plugin_samples), p50(native_samples));
        println!("per delivery, p50 of 2,000:");
        println!("  no-op plugin (instantiate, call, drop) {:>9.1} µs", plugin_p50.as_secs_f64() * 1e6);
        println!("  native closure                         {:>9.1} µs", native_p50.as_secs_f64() * 1e6);
        println!(
            "  overhead                               {:>9.1} µs (goal <= 25)",
            (plugin_p50.saturating_sub(native_p50)).as_secs_f64() * 1e6
        );

        // 2. Fuel metering on a CPU-bound plugin.
        let burn = event("bench", doc! { "rounds": 200_000_i64 });
        let info = DeliveryInfo { handler: "checksum".into(), ..info.clone() };
        let with_fuel = metered.load(&dir.join("checksum.wasm"), policy.clone()).await.unwrap();
        let without_fuel = unmetered.load(&dir.join("checksum.wasm"), policy.clone()).await.unwrap();
        let mut metered_samples = Vec::new();
        let mut unmetered_samples = Vec::new();
        for round in 0..24 {
            // Interleaved, so that both see the same machine.
            let started = Instant::now();
            assert_eq!(metered.invoke(&with_fuel, &burn, &info).await.outcome, Outcome::Completed);
            let metered_time = started.elapsed();
            let started = Instant::now();
            assert_eq!(unmetered.invoke(&without_fuel, &burn, &info).await.outcome, Outcome::Completed);
            let unmetered_time = started.elapsed();
            if round >= 4 {
                metered_samples.push(metered_time);
                unmetered_samples.push(unmetered_time);
            }
        }
        let (with, without) = (p50(metered_samples), p50(unmetered_samples));
        println!("CPU-bound plugin (200,000 rounds of FNV-1a over its payload), p50 of 20:");
        println!("  with fuel metering    {:>8.2} ms", with.as_secs_f64() * 1e3);
        println!("  without               {:>8.2} ms", without.as_secs_f64() * 1e3);
        println!(
            "  fuel costs            {:>8.1} % (goal <= 20)",
            (with.as_secs_f64() / without.as_secs_f64() - 1.0) * 100.0
        );

        // 3. Idle memory with 10 plugins loaded: ten Rust plugins, then two of them replaced
        // by the Python and the JavaScript plugin (whose components carry an interpreter).
        drop((noop, with_fuel, without_fuel));
        let rust = ["noop", "audit_log", "webhook", "checksum", "hostile"];
        let mut loaded = Vec::new();
        for n in 0..10 {
            let path = dir.join(format!("{}.wasm", rust[n % rust.len()]));
            loaded.push(metered.load(&path, policy.clone()).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let rss_rust = rss_mb();
        let parts_rust = rss_parts();
        loaded.truncate(8);
        for file in ["py_order_check", "js_order_check"] {
            loaded.push(metered.load(&dir.join(format!("{file}.wasm")), policy.clone()).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let rss_mixed = rss_mb();
        let parts_mixed = rss_parts();
        // As after a restart: the same plugins loaded from their compiled artifacts.
        drop(loaded);
        let restarted = PluginRuntime::with_options(RuntimeOptions { cache_dir: Some(cache.clone()), meter_fuel: true, recording: None }).unwrap();
        let mut loaded = Vec::new();
        for n in 0..8 {
            loaded.push(restarted.load(&dir.join(format!("{}.wasm", rust[n % rust.len()])), policy.clone()).await.unwrap());
        }
        for file in ["py_order_check", "js_order_check"] {
            loaded.push(restarted.load(&dir.join(format!("{file}.wasm")), policy.clone()).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let rss_restarted = rss_mb();
        let parts_restarted = rss_parts();
        println!("resident memory:");
        println!("  process before loading                     {rss_before:>7.1} MB");
        println!("  idle with 10 Rust plugins loaded           {rss_rust:>7.1} MB (goal <= 150; {parts_rust})");
        println!("  idle with 8 Rust + Python + JS plugins     {rss_mixed:>7.1} MB (goal <= 200; {parts_mixed})");
        println!("  the same, loaded again from their artifacts {rss_restarted:>6.1} MB (goal <= 200; {parts_restarted})");
        drop(loaded);
    });
    let _ = std::fs::remove_dir_all(cache);
}
