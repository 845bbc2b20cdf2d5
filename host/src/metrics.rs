//! What each delivery costs, by handler, for `/metrics`: histograms of run time, fuel
//! consumed, peak linear memory and lag from the event's creation to its run's start, and a
//! count of runs by how they ended (`prometheus-client` families). The plugin runner records
//! one sample of each per run; the health endpoint encodes them with the rest at each scrape,
//! and, when telemetry exports metrics, the same samples go to OpenTelemetry instruments of
//! the same names (dotted: `relayhost.delivery.run`). It never decides anything.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics as otel;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// A handler, as a label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandlerLabel {
    pub handler: String,
}

/// A handler and how one of its runs ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub handler: String,
    /// `completed`, `retry`, `unprocessable` or `failed` (a trap or a limit).
    pub outcome: &'static str,
}

type ByHandler = Family<HandlerLabel, Histogram, fn() -> Histogram>;

/// The per-delivery histograms; clones share them.
#[derive(Debug, Clone)]
pub struct DeliveryMetrics {
    run_seconds: ByHandler,
    fuel: ByHandler,
    memory_bytes: ByHandler,
    lag_seconds: ByHandler,
    runs: Family<OutcomeLabels, Counter>,
    exported: Option<Arc<Exported>>,
}

/// The OpenTelemetry instruments the same samples go to.
#[derive(Debug)]
struct Exported {
    run_seconds: otel::Histogram<f64>,
    fuel: otel::Histogram<u64>,
    memory_bytes: otel::Histogram<u64>,
    lag_seconds: otel::Histogram<f64>,
    runs: otel::Counter<u64>,
}

impl Default for DeliveryMetrics {
    fn default() -> Self {
        // 1 ms to about 65 s; fuel from 10 thousand to about 10 billion; memory from 64 KiB to 2 GiB.
        Self {
            run_seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 17))),
            fuel: Family::new_with_constructor(|| Histogram::new(exponential_buckets(10_000.0, 4.0, 11))),
            memory_bytes: Family::new_with_constructor(|| Histogram::new(exponential_buckets(65_536.0, 2.0, 16))),
            lag_seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 17))),
            runs: Family::default(),
            exported: None,
        }
    }
}

impl DeliveryMetrics {
    /// The same, each sample also recorded by `meter`'s instruments (when given).
    pub fn exported_by(self, meter: Option<otel::Meter>) -> Self {
        let exported = meter.map(|meter| {
            Arc::new(Exported {
                run_seconds: meter.f64_histogram("relayhost.delivery.run").with_unit("s").with_description("How long each delivery's plugin run took").build(),
                fuel: meter.u64_histogram("relayhost.delivery.fuel").with_description("Fuel each delivery's run consumed").build(),
                memory_bytes: meter.u64_histogram("relayhost.delivery.peak_memory").with_unit("By").with_description("The largest linear memory of each delivery's instance").build(),
                lag_seconds: meter.f64_histogram("relayhost.delivery.lag").with_unit("s").with_description("From the event's creation to its delivery's run").build(),
                runs: meter.u64_counter("relayhost.delivery.runs").with_description("Plugin runs, by how each ended").build(),
            })
        });
        Self { exported, ..self }
    }

    /// One run of `handler` that ended as `outcome`: how long it took, the fuel it burned, its peak memory, and how
    /// long after its event's creation it started (`None` when the publisher's clock is ahead).
    pub fn ran(&self, handler: &str, outcome: &'static str, took: Duration, fuel: Option<u64>, peak_memory_bytes: usize, lag: Option<Duration>) {
        self.runs.get_or_create(&OutcomeLabels { handler: handler.to_string(), outcome }).inc();
        let label = HandlerLabel { handler: handler.to_string() };
        self.run_seconds.get_or_create(&label).observe(took.as_secs_f64());
        if let Some(fuel) = fuel {
            self.fuel.get_or_create(&label).observe(fuel as f64);
        }
        self.memory_bytes.get_or_create(&label).observe(peak_memory_bytes as f64);
        if let Some(lag) = lag {
            self.lag_seconds.get_or_create(&label).observe(lag.as_secs_f64());
        }
        if let Some(exported) = &self.exported {
            let handler = [KeyValue::new("handler", handler.to_string())];
            exported.runs.add(1, &[handler[0].clone(), KeyValue::new("outcome", outcome)]);
            exported.run_seconds.record(took.as_secs_f64(), &handler);
            if let Some(fuel) = fuel {
                exported.fuel.record(fuel, &handler);
            }
            exported.memory_bytes.record(peak_memory_bytes as u64, &handler);
            if let Some(lag) = lag {
                exported.lag_seconds.record(lag.as_secs_f64(), &handler);
            }
        }
    }

    /// Registers the families (sharing their samples) in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register_with_unit("relayhost_delivery_run", "How long each delivery's plugin run took", Unit::Seconds, self.run_seconds.clone());
        registry.register("relayhost_delivery_fuel", "Fuel each delivery's run consumed (about one per WebAssembly instruction)", self.fuel.clone());
        registry.register_with_unit("relayhost_delivery_peak_memory", "The largest linear memory of each delivery's instance", Unit::Bytes, self.memory_bytes.clone());
        registry.register("relayhost_delivery_runs", "Plugin runs, by how each ended", self.runs.clone());
        registry.register_with_unit(
            "relayhost_delivery_lag",
            "From the event's creation (the publisher's clock) to its delivery's run",
            Unit::Seconds,
            self.lag_seconds.clone(),
        );
    }
}
