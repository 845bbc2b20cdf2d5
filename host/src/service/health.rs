//! Health, readiness and metrics over HTTP, for container orchestrators and scrapers.
//!
//! `/healthz` answers while the process serves; `/readyz` when MongoDB answers a ping and at
//! least one plugin handler is loaded; `/metrics` prints the dispatcher's counters, each
//! handler's delivery counts, and how many live hosts serve each registered handler (and
//! since when none does) in the Prometheus text format. Read-only: nothing here changes a
//! delivery, and no request input reaches a query.
//!
//! The per-handler counts come from an aggregation over every delivery, so `/metrics` reuses
//! them for [`STATISTICS_MAX_AGE`]: however often and however many scrapers ask, the
//! deliveries collection is aggregated at most once in that time.

use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bson::{DateTime, doc};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::dispatch::{DispatcherCounters, KnownHandlers};
use crate::plugin::PluginRegistry;
use crate::store::mongo::MongoStore;
use crate::store::{HandlerStatistics, Store, StoreError};

/// How long `/metrics` reuses the per-handler delivery counts.
pub const STATISTICS_MAX_AGE: Duration = Duration::from_secs(5);

/// What the endpoints look at.
#[derive(Clone)]
pub struct HealthState {
    store: Arc<MongoStore>,
    registry: Arc<PluginRegistry>,
    counters: Arc<DispatcherCounters>,
    known: Arc<KnownHandlers>,
    /// Per-handler counts and the unfanned events.
    statistics: Arc<Recent<(Vec<HandlerStatistics>, u64)>>,
}

impl HealthState {
    pub fn new(
        store: Arc<MongoStore>,
        registry: Arc<PluginRegistry>,
        counters: Arc<DispatcherCounters>,
        known: Arc<KnownHandlers>,
    ) -> Self {
        Self { store, registry, counters, known, statistics: Arc::new(Recent::new(STATISTICS_MAX_AGE)) }
    }

    /// Listens on `address` until the returned task is aborted.
    pub async fn serve(self, address: SocketAddr) -> std::io::Result<JoinHandle<()>> {
        let listener = tokio::net::TcpListener::bind(address).await?;
        tracing::info!(address = %listener.local_addr()?, "health endpoints listening");
        let router = Router::new()
            .route("/healthz", get(|| async { text(StatusCode::OK, "ok\n".into()) }))
            .route("/readyz", get(ready))
            .route("/metrics", get(metrics))
            .fallback(|| async { text(StatusCode::NOT_FOUND, "not found: try /healthz, /readyz or /metrics\n".into()) })
            .with_state(self);
        Ok(tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, router).await {
                tracing::error!(%error, "the health endpoints stopped");
            }
        }))
    }

    async fn readiness(&self) -> Result<(), String> {
        self.store
            .client()
            .database("admin")
            .run_command(doc! { "ping": 1 })
            .await
            .map_err(|e| format!("MongoDB does not answer: {e}"))?;
        if self.registry.subscriptions().is_empty() {
            return Err(format!("no plugin handler is loaded from {}", self.registry.directory().display()));
        }
        Ok(())
    }

    async fn metrics(&self) -> Result<String, String> {
        let mut out = String::new();
        let counters = [
            ("completed", &self.counters.completed, "Deliveries completed by this host"),
            ("retried", &self.counters.retried, "Failed attempts rescheduled by this host"),
            ("dead", &self.counters.dead, "Deliveries this host made dead"),
            ("released", &self.counters.released, "Deliveries handed back uncharged"),
            ("store_errors", &self.counters.store_errors, "Store errors the claim loop went on from"),
            (
                "out_of_order",
                &self.counters.out_of_order,
                "Keyed deliveries that started after a higher sequence of their key and handler (a publisher broke the protocol, or a dead delivery was requeued)",
            ),
        ];
        for (name, counter, help) in counters {
            let _ = writeln!(out, "# HELP relayhost_{name}_total {help}\n# TYPE relayhost_{name}_total counter");
            let _ = writeln!(out, "relayhost_{name}_total {}", DispatcherCounters::get(counter));
        }
        let waiting = self.store.lanes_waiting_for_charge();
        let _ = writeln!(
            out,
            "# HELP relayhost_lanes_waiting_for_charge Lanes taken over whose previous holder's deliveries could not be charged yet\n# TYPE relayhost_lanes_waiting_for_charge gauge"
        );
        let _ = writeln!(out, "relayhost_lanes_waiting_for_charge {waiting}");
        let _ = writeln!(
            out,
            "# HELP relayhost_dead_hosts_sessions_ended_total Sessions of hosts that stopped announcing themselves this host ended (their open transactions held locks)\n# TYPE relayhost_dead_hosts_sessions_ended_total counter"
        );
        let _ = writeln!(out, "relayhost_dead_hosts_sessions_ended_total {}", self.store.dead_hosts_sessions_ended());
        let statistics = self
            .statistics
            .get_or_refresh(|| async {
                let unfanned = self.store.unfanned_events().await?;
                Ok((self.store.statistics(DateTime::now()).await?, unfanned))
            })
            .await
            .map_err(|e| e.to_string())?;
        let (statistics, unfanned) = (&statistics.0, statistics.1);
        let _ = writeln!(out, "# HELP relayhost_events_unfanned Committed events not fanned out yet\n# TYPE relayhost_events_unfanned gauge");
        let _ = writeln!(out, "relayhost_events_unfanned {unfanned}");
        for (name, help) in [("pending", "Deliveries waiting"), ("running", "Deliveries under a live lease"), ("dead", "Dead deliveries")] {
            let _ = writeln!(out, "# HELP relayhost_deliveries_{name} {help}\n# TYPE relayhost_deliveries_{name} gauge");
            for s in statistics {
                let value = match name {
                    "pending" => s.pending,
                    "running" => s.running,
                    _ => s.dead,
                };
                let _ = writeln!(out, "relayhost_deliveries_{name}{{handler=\"{}\"}} {value}", label(&s.handler));
            }
        }
        if let Some(known) = self.known.known() {
            let now = DateTime::now().timestamp_millis();
            let _ = writeln!(
                out,
                "# HELP relayhost_handler_hosts_serving Live hosts serving each registered (not retired) handler\n# TYPE relayhost_handler_hosts_serving gauge"
            );
            for record in known.iter().filter(|r| r.active()) {
                let _ = writeln!(out, "relayhost_handler_hosts_serving{{handler=\"{}\"}} {}", label(&record.handler), record.served_by.len());
            }
            let _ = writeln!(
                out,
                "# HELP relayhost_handler_unserved_seconds How long no live host has served each registered handler (0 while one does); its deliveries wait\n# TYPE relayhost_handler_unserved_seconds gauge"
            );
            for record in known.iter().filter(|r| r.active()) {
                let seconds = if record.served_by.is_empty() { (now - record.last_seen.timestamp_millis()).max(0) / 1000 } else { 0 };
                let _ = writeln!(out, "relayhost_handler_unserved_seconds{{handler=\"{}\"}} {seconds}", label(&record.handler));
            }
        }
        Ok(out)
    }
}

/// A value computed at most once per `max_age`; callers arriving while it is computed wait for
/// that computation instead of starting their own. A failed computation is not kept.
struct Recent<T> {
    max_age: Duration,
    value: Mutex<Option<(Instant, T)>>,
}

impl<T: Clone> Recent<T> {
    fn new(max_age: Duration) -> Self {
        Self { max_age, value: Mutex::new(None) }
    }

    async fn get_or_refresh<F, Fut>(&self, compute: F) -> Result<T, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let mut value = self.value.lock().await;
        if let Some((at, kept)) = value.as_ref()
            && at.elapsed() < self.max_age
        {
            return Ok(kept.clone());
        }
        let fresh = compute().await?;
        *value = Some((Instant::now(), fresh.clone()));
        Ok(fresh)
    }
}

/// A label value: handler ids are printable but may hold quotes or backslashes.
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"")
}

async fn ready(State(state): State<HealthState>) -> Response {
    match state.readiness().await {
        Ok(()) => text(StatusCode::OK, "ready\n".into()),
        Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
    }
}

async fn metrics(State(state): State<HealthState>) -> Response {
    match state.metrics().await {
        Ok(body) => text(StatusCode::OK, body),
        Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
    }
}

fn text(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    async fn count(recent: &Recent<usize>, computed: &AtomicUsize) -> Result<usize, StoreError> {
        recent
            .get_or_refresh(|| async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(computed.fetch_add(1, Ordering::SeqCst) + 1)
            })
            .await
    }

    #[tokio::test]
    async fn concurrent_and_recent_askers_share_one_computation() {
        let recent = Recent::new(Duration::from_secs(3600));
        let computed = AtomicUsize::new(0);
        let (a, b, c) = tokio::join!(count(&recent, &computed), count(&recent, &computed), count(&recent, &computed));
        assert_eq!((a.unwrap(), b.unwrap(), c.unwrap()), (1, 1, 1));
        assert_eq!(count(&recent, &computed).await.unwrap(), 1);
        assert_eq!(computed.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_older_value_is_computed_again() {
        let recent = Recent::new(Duration::from_millis(1));
        let computed = AtomicUsize::new(0);
        assert_eq!(count(&recent, &computed).await.unwrap(), 1);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(count(&recent, &computed).await.unwrap(), 2);
    }

    #[tokio::test]
    async fn a_failed_computation_is_not_kept() {
        let recent: Recent<usize> = Recent::new(Duration::from_secs(3600));
        let failed = recent.get_or_refresh(|| async { Err(StoreError::Corrupt("statistics row".into())) }).await;
        assert!(failed.is_err());
        assert_eq!(recent.get_or_refresh(|| async { Ok(7) }).await.unwrap(), 7);
    }
}
