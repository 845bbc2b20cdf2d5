//! OpenTelemetry end to end, on the test replica set with a host process: a local OTLP/HTTP
//! receiver (axum on 127.0.0.1) decodes what the host exports with the protocol's own protobuf
//! types, and the test follows one trace from a publisher's `traceparent` through a handler's
//! attempt, its follow-up event, and the follow-up's failing attempt.

mod common;

use relayhost::store::Administration;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use bson::doc;
use common::deployment::Deployment;
use common::{Fixture, publish_all};
use relayhost::event::NewEvent;
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// What the receiver got: every span, and every metric's data points by metric name.
#[derive(Default)]
struct Received {
    spans: Vec<Span>,
    service_names: Vec<String>,
    metrics: BTreeMap<String, Vec<Data>>,
}

/// An OTLP/HTTP receiver on 127.0.0.1 that decodes each request as protobuf.
async fn receiver() -> (std::net::SocketAddr, Arc<Mutex<Received>>) {
    let received: Arc<Mutex<Received>> = Arc::default();
    let (traces, metrics) = (received.clone(), received.clone());
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| async move {
                let request = ExportTraceServiceRequest::decode(body).expect("a protobuf trace export");
                let mut received = traces.lock().unwrap();
                for resource in request.resource_spans {
                    for attribute in resource.resource.iter().flat_map(|r| r.attributes.iter()) {
                        if attribute.key == "service.name" {
                            received.service_names.push(text(attribute.value.as_ref().and_then(|v| v.value.as_ref())));
                        }
                    }
                    received.spans.extend(resource.scope_spans.into_iter().flat_map(|scope| scope.spans));
                }
            }),
        )
        .route(
            "/v1/metrics",
            axum::routing::post(move |body: Bytes| async move {
                let request = ExportMetricsServiceRequest::decode(body).expect("a protobuf metrics export");
                let mut received = metrics.lock().unwrap();
                for metric in request.resource_metrics.into_iter().flat_map(|r| r.scope_metrics).flat_map(|s| s.metrics) {
                    received.metrics.entry(metric.name).or_default().extend(metric.data);
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (address, received)
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(text)) => text.clone(),
        Some(Value::IntValue(n)) => n.to_string(),
        other => format!("{other:?}"),
    }
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).map(|a| text(a.value.as_ref().and_then(|v| v.value.as_ref())))
}

fn spans_of(received: &Mutex<Received>, event_id: &str) -> Vec<Span> {
    received.lock().unwrap().spans.iter().filter(|s| attribute(s, "messaging.message.id").as_deref() == Some(event_id)).cloned().collect()
}

/// `00-<trace id>-<span id>-<flags>`, split.
fn traceparent_parts(traceparent: &str) -> (String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent}");
    (parts[1].to_string(), parts[2].to_string())
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PUBLISHER_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_is_a_span_in_the_publishers_trace_and_follow_ups_carry_it_on() {
    let (address, received) = receiver().await;
    let extra = format!(
        "poll_interval = \"200ms\"\n\n[telemetry]\notlp_endpoint = \"http://{address}\"\nservice_name = \"relayhost-under-test\"\n\n\
         [plugin.hostile]\nretry = {{ max_attempts = 1 }}\ngrants = {{ publish_types = [\"poison\", \"hostile.note\"] }}"
    );
    let deployment = Deployment::new(&["hostile"], &extra).await;
    // Export often, so that the test waits little.
    let fast = [("OTEL_BSP_SCHEDULE_DELAY", "100"), ("OTEL_METRIC_EXPORT_INTERVAL", "300")];
    let host = deployment.start_with("host", &fast);
    assert!(host.log().contains("exporting telemetry over OTLP/HTTP"), "the host says where telemetry goes");
    let store = deployment.fixture.store();
    // A publisher's traced event whose handler publishes a follow-up that traps, and an
    // untraced one whose handler publishes a note nobody handles.
    let traced = NewEvent::new("traced", "publish", doc! { "type": "poison", "id": "hostile:poisoned-" })
        .with_header("traceparent", &format!("00-{TRACE}-{PUBLISHER_SPAN}-01"));
    let untraced = NewEvent::new("untraced", "publish", doc! { "type": "hostile.note", "id": "hostile:note-" });
    publish_all(store, vec![traced, untraced]).await;
    deployment.wait_until("the follow-up died", Duration::from_secs(60), async |d| {
        d.fixture.store().statistics(bson::DateTime::now()).await.unwrap().iter().any(|s| s.handler == "poison" && s.dead == 1)
    })
    .await;
    deployment.wait_until("the spans are exported", Duration::from_secs(30), async |_| {
        [spans_of(&received, "traced"), spans_of(&received, "hostile:poisoned-0"), spans_of(&received, "untraced")].iter().all(|s| !s.is_empty())
    })
    .await;

    // The handler's attempt: a consumer span, child of the publisher's span, in its trace.
    let [publish_attempt] = spans_of(&received, "traced").try_into().unwrap();
    assert_eq!(hex(&publish_attempt.trace_id), TRACE);
    assert_eq!(hex(&publish_attempt.parent_span_id), PUBLISHER_SPAN);
    assert_eq!(publish_attempt.name, "process publish");
    assert_eq!(publish_attempt.kind, 5, "SPAN_KIND_CONSUMER");
    let expected = [
        ("messaging.system", "relayhost"),
        ("messaging.operation.type", "process"),
        ("messaging.destination.name", "publish"),
        ("messaging.message.id", "traced"),
        ("relayhost.handler", "publish"),
        ("relayhost.attempt", "1"),
        ("relayhost.outcome", "completed"),
    ];
    for (key, value) in expected {
        assert_eq!(attribute(&publish_attempt, key).as_deref(), Some(value), "{key}");
    }
    let lane = attribute(&publish_attempt, "relayhost.lane").unwrap().parse::<u32>().unwrap();
    assert!(lane < 256);
    let host_id = attribute(&publish_attempt, "relayhost.host").unwrap();
    assert!(!host_id.is_empty());

    // The follow-up carries the attempt's context on: its own attempt is the attempt's child.
    let follow_up = store.events_collection().find_one(doc! { "_id": "hostile:poisoned-0" }).await.unwrap().unwrap();
    let carried = follow_up.get_document("headers").unwrap().get_str("traceparent").unwrap().to_string();
    assert_eq!(traceparent_parts(&carried), (TRACE.to_string(), hex(&publish_attempt.span_id)));
    let [poisoned] = spans_of(&received, "hostile:poisoned-0").try_into().unwrap();
    assert_eq!((hex(&poisoned.trace_id), hex(&poisoned.parent_span_id)), (TRACE.to_string(), hex(&publish_attempt.span_id)));
    assert_eq!(attribute(&poisoned, "relayhost.outcome").as_deref(), Some("failed"));
    let status = poisoned.status.clone().unwrap();
    assert_eq!(status.code, 2, "STATUS_CODE_ERROR");
    assert!(status.message.contains("poisoned by event hostile:poisoned-0"), "{}", status.message);

    // An untraced event starts its own trace, which its follow-up carries.
    let [root] = spans_of(&received, "untraced").try_into().unwrap();
    assert!(root.parent_span_id.is_empty(), "no parent");
    assert_ne!(hex(&root.trace_id), TRACE);
    let note = store.events_collection().find_one(doc! { "_id": "hostile:note-0" }).await.unwrap().unwrap();
    let carried = note.get_document("headers").unwrap().get_str("traceparent").unwrap().to_string();
    assert_eq!(traceparent_parts(&carried), (hex(&root.trace_id), hex(&root.span_id)));
    assert!(received.lock().unwrap().service_names.iter().all(|name| name == "relayhost-under-test"));

    // The delivery metrics go the same way: a run histogram per handler, three runs in all.
    deployment.wait_until("the metrics are exported", Duration::from_secs(30), async |_| {
        received.lock().unwrap().metrics.contains_key("relayhost.delivery.run")
    })
    .await;
    let runs = |received: &Received| -> u64 {
        let Some(Data::Histogram(histogram)) = received.metrics.get("relayhost.delivery.run").and_then(|d| d.last()) else { return 0 };
        histogram.data_points.iter().map(|point| point.count).sum()
    };
    deployment.wait_until("the three runs are counted", Duration::from_secs(30), async |_| runs(&received.lock().unwrap()) == 3).await;
    host.stop();

    // With telemetry off, a follow-up carries its event's own trace context on unchanged.
    let spans_before = received.lock().unwrap().spans.len();
    let host = deployment.start_with("untraced-host", &[("RELAYHOST_TELEMETRY_OTLP_ENDPOINT", "")]);
    let traceparent = format!("00-{TRACE}-{PUBLISHER_SPAN}-01");
    let traced = NewEvent::new("traced-off", "publish", doc! { "type": "hostile.note", "id": "hostile:off-" })
        .with_header("traceparent", &traceparent)
        .with_header("tracestate", "vendor=1");
    publish_all(store, vec![traced]).await;
    deployment.wait_until("the follow-up is published", Duration::from_secs(30), async |d| {
        d.collection("relayhost_events").count_documents(doc! { "_id": "hostile:off-0" }).await.unwrap() == 1
    })
    .await;
    let note = store.events_collection().find_one(doc! { "_id": "hostile:off-0" }).await.unwrap().unwrap();
    let headers = note.get_document("headers").unwrap();
    assert_eq!((headers.get_str("traceparent").unwrap(), headers.get_str("tracestate").unwrap()), (traceparent.as_str(), "vendor=1"));
    host.stop();
    assert_eq!(received.lock().unwrap().spans.len(), spans_before, "nothing is exported with telemetry off");
}

/// A handler's HTTP requests carry its attempt's trace context (W3C `traceparent`, and the
/// publisher's `tracestate`), so the service it calls continues the delivery's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_http_requests_carry_its_attempts_trace_context() {
    let (address, received) = receiver().await;
    let webhook = common::receiver::Receiver::answering(0);
    let extra = format!(
        "poll_interval = \"200ms\"\n\n[telemetry]\notlp_endpoint = \"http://{address}\"\n\n[plugin.webhook]\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{}\"], private_networks = true }}",
        webhook.address
    );
    let deployment = Deployment::new(&["webhook"], &extra).await;
    let url = format!("http://{}/hooks", webhook.address);
    let host = deployment.start_with("host", &[("OTEL_BSP_SCHEDULE_DELAY", "100"), ("WEBHOOK_URL", url.as_str())]);
    let traced = NewEvent::new("called", "order.placed", doc! { "n": 1 })
        .with_header("traceparent", &format!("00-{TRACE}-{PUBLISHER_SPAN}-01"))
        .with_header("tracestate", "vendor=1");
    publish_all(deployment.fixture.store(), vec![traced]).await;
    deployment
        .wait_until("the call and its span", Duration::from_secs(60), async |_| {
            !webhook.headers().is_empty() && !spans_of(&received, "called").is_empty()
        })
        .await;
    host.stop();
    let [attempt] = spans_of(&received, "called").try_into().unwrap();
    let [call] = webhook.headers().try_into().unwrap();
    assert_eq!(traceparent_parts(&call["traceparent"]), (TRACE.to_string(), hex(&attempt.span_id)), "the attempt's span is the call's parent");
    assert_eq!(call["tracestate"], "vendor=1");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
