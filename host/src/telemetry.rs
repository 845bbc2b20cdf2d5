//! OpenTelemetry: a span per delivery attempt and the delivery metrics, exported over
//! OTLP/HTTP (protobuf) when `[telemetry] otlp_endpoint` is set, and the W3C trace context a
//! delivery's follow-up events carry on.
//!
//! It owns the exporters (their batching threads), the attempt span (named `process <event
//! type>`, kind consumer, with the messaging semantic conventions' attributes and relayhost's
//! own: handler, attempt, outcome, lane, host) and reading and writing `traceparent` and
//! `tracestate` headers. An event whose publisher set a `traceparent` gets its attempts' spans
//! as children of that span; follow-ups carry the attempt's span on. With telemetry off, an
//! attempt is nothing but the event's own trace headers, carried on as they are. It never
//! decides anything about a delivery, and a failing collector never slows one: spans wait in
//! a bounded queue and are dropped past it.

use std::collections::BTreeMap;
use std::sync::Arc;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

use crate::config::TelemetryConfig;
use crate::store::ClaimedDelivery;

/// The W3C trace context headers: what a delivery carries on to its follow-ups.
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

#[derive(Debug, thiserror::Error)]
#[error("cannot export telemetry to {endpoint}: {message}")]
pub struct TelemetryError {
    endpoint: String,
    message: String,
}

/// The host's telemetry: off, or the exporters. Clones share them.
#[derive(Clone, Default)]
pub struct Telemetry {
    exporting: Option<Arc<Exporting>>,
}

struct Exporting {
    tracer: Option<SdkTracer>,
    traces: Option<SdkTracerProvider>,
    metrics: Option<SdkMeterProvider>,
    host: String,
    propagator: TraceContextPropagator,
}

impl Telemetry {
    /// Exports nothing; attempts carry their event's trace headers on.
    pub fn off() -> Self {
        Self::default()
    }

    /// Starts the exporters `config` asks for, for host `host` (the `relayhost.host` of its
    /// spans). Off when it names no endpoint.
    pub fn start(config: &TelemetryConfig, host: &str) -> Result<Self, TelemetryError> {
        let resource = Resource::builder().with_service_name(config.service_name.clone()).build();
        let failed = |endpoint: &str, error: &dyn std::fmt::Display| TelemetryError { endpoint: endpoint.into(), message: error.to_string() };
        let traces = match config.traces_endpoint() {
            Some(endpoint) => {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(endpoint.clone())
                    .build()
                    .map_err(|error| failed(&endpoint, &error))?;
                let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sample_ratio)));
                Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_sampler(sampler).with_resource(resource.clone()).build())
            }
            None => None,
        };
        let metrics = match config.metrics_endpoint() {
            Some(endpoint) => {
                let exporter = opentelemetry_otlp::MetricExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(endpoint.clone())
                    .build()
                    .map_err(|error| failed(&endpoint, &error))?;
                Some(SdkMeterProvider::builder().with_periodic_exporter(exporter).with_resource(resource).build())
            }
            None => None,
        };
        if traces.is_none() && metrics.is_none() {
            return Ok(Self::off());
        }
        let tracer = traces.as_ref().map(|provider| provider.tracer("relayhost"));
        let exporting = Exporting { tracer, traces, metrics, host: host.to_string(), propagator: TraceContextPropagator::new() };
        Ok(Self { exporting: Some(Arc::new(exporting)) })
    }

    /// The meter the delivery metrics are exported by, when they are.
    pub fn meter(&self) -> Option<opentelemetry::metrics::Meter> {
        use opentelemetry::metrics::MeterProvider as _;
        self.exporting.as_ref()?.metrics.as_ref().map(|provider| provider.meter("relayhost"))
    }

    /// Starts the span of one attempt of `delivery` (none with traces off).
    pub fn attempt(&self, delivery: &ClaimedDelivery) -> Attempt {
        let headers = &delivery.event.headers;
        let Some((exporting, tracer)) = self.exporting.as_ref().and_then(|e| Some((e, e.tracer.as_ref()?))) else {
            let carried = TRACE_HEADERS.iter().filter_map(|name| Some((name.to_string(), header(headers, name)?.to_string()))).collect();
            return Attempt { span: None, carried };
        };
        let parent = exporting.propagator.extract(&Headers(headers));
        let event = &delivery.event;
        let mut attributes = vec![
            KeyValue::new("messaging.system", "relayhost"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.operation.name", "process"),
            KeyValue::new("messaging.destination.name", event.event_type.clone()),
            KeyValue::new("messaging.destination.partition.id", delivery.lease.lane.to_string()),
            KeyValue::new("messaging.consumer.group.name", delivery.handler.clone()),
            KeyValue::new("messaging.message.id", event.id.clone()),
            KeyValue::new("relayhost.handler", delivery.handler.clone()),
            KeyValue::new("relayhost.attempt", i64::from(delivery.attempts) + 1),
            KeyValue::new("relayhost.lane", i64::from(delivery.lease.lane)),
            KeyValue::new("relayhost.host", exporting.host.clone()),
        ];
        if let Some(correlation) = &event.correlation_id {
            attributes.push(KeyValue::new("messaging.message.conversation_id", correlation.clone()));
        }
        if let Some(key) = &event.key {
            attributes.push(KeyValue::new("relayhost.key", key.clone()));
        }
        let span = tracer
            .span_builder(format!("process {}", event.event_type))
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        let mut carried = Carried::default();
        let context = Context::new().with_remote_span_context(span.span_context().clone());
        exporting.propagator.inject_context(&context, &mut carried);
        Attempt { span: Some(span), carried: carried.0 }
    }

    /// Sends what is buffered and stops the exporters (at the host's stop).
    pub fn shutdown(&self) {
        let Some(exporting) = &self.exporting else { return };
        if let Some(traces) = &exporting.traces
            && let Err(error) = traces.shutdown()
        {
            tracing::warn!(%error, "the trace exporter did not stop cleanly");
        }
        if let Some(metrics) = &exporting.metrics
            && let Err(error) = metrics.shutdown()
        {
            tracing::warn!(%error, "the metric exporter did not stop cleanly");
        }
    }
}

/// One attempt's span (if traced) and the trace context its follow-ups carry on.
pub struct Attempt {
    span: Option<opentelemetry_sdk::trace::Span>,
    carried: Vec<(String, String)>,
}

impl Attempt {
    /// The `traceparent` and `tracestate` headers the attempt's follow-ups carry on.
    pub fn trace_context(&self) -> Vec<(String, String)> {
        self.carried.clone()
    }

    /// Ends the span with how the attempt ended (`completed`, `retry`, `failed`, ...), an
    /// error status with `error` when it failed.
    pub fn end(self, outcome: &'static str, error: Option<&str>) {
        let Some(mut span) = self.span else { return };
        span.set_attribute(KeyValue::new("relayhost.outcome", outcome));
        if let Some(error) = error {
            span.set_status(Status::error(error.chars().take(512).collect::<String>()));
        }
        span.end();
    }
}

fn header<'a>(headers: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    headers.get(name).or_else(|| headers.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, v)| v)).map(String::as_str)
}

/// An event's headers, as the propagator reads them (names in any case).
struct Headers<'a>(&'a BTreeMap<String, String>);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        header(self.0, key)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

#[derive(Default)]
struct Carried(Vec<(String, String)>);

impl Injector for Carried {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_string(), value));
    }
}
