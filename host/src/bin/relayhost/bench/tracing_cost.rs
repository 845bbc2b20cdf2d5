//! `relayhost bench --tracing-cost`: what tracing every attempt costs a drain. A local OTLP/HTTP
//! receiver (on 127.0.0.1, counting what it gets and keeping nothing) stands in for a
//! collector; three drains of the same backlog run, without, with and again without telemetry
//! (a span per attempt and the delivery metrics, exported as `relayhost run` exports them), and
//! the drain with it is compared with the mean of the two without, measured in the same run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use relayhost::config::TelemetryConfig;
use relayhost::plugin::{PluginPolicy, PluginRegistry, PluginRuntime};
use relayhost::telemetry::Telemetry;

use super::{BenchArgs, Server, Workload, drain};

/// Telemetry exporting spans and metrics to `endpoint`, for host `host`.
pub(super) fn telemetry(endpoint: &str, host: &str) -> Result<Telemetry> {
    let config = TelemetryConfig { otlp_endpoint: Some(endpoint.to_string()), ..TelemetryConfig::default() };
    Ok(Telemetry::start(&config, host)?)
}

/// Requests and bytes a receiver got.
#[derive(Default)]
struct Received {
    requests: AtomicU64,
    bytes: AtomicU64,
}

/// An OTLP/HTTP receiver on 127.0.0.1 that answers every export and counts it.
async fn receiver() -> Result<(String, Arc<Received>)> {
    let received: Arc<Received> = Arc::default();
    let counted = received.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        let counted = counted.clone();
        async move {
            counted.requests.fetch_add(1, Ordering::Relaxed);
            counted.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((format!("http://{address}"), received))
}

pub(super) async fn run(args: &BenchArgs, server: &Server, plugins: &std::path::Path) -> Result<()> {
    let runtime = Arc::new(PluginRuntime::new(None)?);
    let registry = Arc::new(PluginRegistry::new(runtime, plugins, |_| PluginPolicy::default()));
    registry.scan().await?;
    let (endpoint, received) = receiver().await?;
    let mut rates = Vec::new();
    for (round, traced) in [false, true, false].into_iter().enumerate() {
        let workload =
            Workload { traced_to: traced.then(|| endpoint.clone()), database: format!("bench_tracing_{round}"), ..Workload::of(args) };
        let drained = drain(args, &workload, server, &registry).await?;
        let how = if traced { "with every attempt traced" } else { "untraced" };
        println!("drain {how}: {:.0} deliveries/s", drained.rate);
        rates.push(drained.rate);
    }
    let (requests, bytes) = (received.requests.load(Ordering::Relaxed), received.bytes.load(Ordering::Relaxed));
    println!("  the receiver got {requests} exports, {bytes} bytes of protobuf");
    let without = (rates[0] + rates[2]) / 2.0;
    println!("with tracing: {:.2}x the drain without it (goal >= 0.95)", rates[1] / without);
    Ok(())
}
