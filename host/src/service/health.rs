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

use crate::store::{Administration, Hosts};
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

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::dispatch::{DispatcherCounters, KnownHandlers};
use crate::metrics::{DeliveryMetrics, HandlerLabel};
use crate::plugin::PluginRegistry;
use crate::store::mongo::MongoStore;
use crate::store::{HandlerStatistics, RegisteredHandler, StoreError};

/// How long `/metrics` reuses the per-handler delivery counts.
pub const STATISTICS_MAX_AGE: Duration = Duration::from_secs(5);

/// What the endpoints look at.
#[derive(Clone)]
pub struct HealthState {
    store: Arc<MongoStore>,
    registry: Arc<PluginRegistry>,
    counters: Arc<DispatcherCounters>,
    known: Arc<KnownHandlers>,
    /// Per-handler counts, the unfanned events and the lanes this host holds.
    statistics: Arc<Recent<(Vec<HandlerStatistics>, u64, usize)>>,
    deliveries: DeliveryMetrics,
}

impl HealthState {
    pub fn new(
        store: Arc<MongoStore>,
        registry: Arc<PluginRegistry>,
        counters: Arc<DispatcherCounters>,
        known: Arc<KnownHandlers>,
        deliveries: DeliveryMetrics,
    ) -> Self {
        Self { store, registry, counters, known, statistics: Arc::new(Recent::new(STATISTICS_MAX_AGE)), deliveries }
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
        let recent = self
            .statistics
            .get_or_refresh(|| async {
                let now = DateTime::now();
                let (unfanned, statistics, membership) =
                    tokio::try_join!(self.store.unfanned_events(), self.store.statistics(now), self.store.membership(now))?;
                let held = self.store.host_id();
                let lanes_held = membership.lanes.iter().filter(|lane| lane.holder.as_deref() == Some(held.as_str())).count();
                Ok((statistics, unfanned, lanes_held))
            })
            .await
            .map_err(|e| e.to_string())?;
        let (statistics, unfanned, lanes_held) = (&recent.0, recent.1, recent.2);
        let mut registry = Registry::default();
        let count = |counter: &std::sync::atomic::AtomicU64| ConstCounter::new(DispatcherCounters::get(counter));
        let counters = &self.counters;
        registry.register("relayhost_completed", "Deliveries completed by this host", count(&counters.completed));
        registry.register("relayhost_retried", "Failed attempts rescheduled by this host", count(&counters.retried));
        registry.register("relayhost_dead", "Deliveries this host made dead", count(&counters.dead));
        registry.register("relayhost_released", "Deliveries handed back uncharged", count(&counters.released));
        registry.register("relayhost_store_errors", "Store errors the claim loop went on from", count(&counters.store_errors));
        registry.register(
            "relayhost_out_of_order",
            "Keyed deliveries that started after a higher sequence of their key and handler (a publisher broke the protocol, or a dead delivery was requeued)",
            count(&counters.out_of_order),
        );
        registry.register(
            "relayhost_dead_hosts_sessions_ended",
            "Sessions of hosts that stopped announcing themselves this host ended (their open transactions held locks)",
            ConstCounter::new(self.store.dead_hosts_sessions_ended()),
        );
        let gauge = |value: u64| {
            let gauge = Gauge::<i64>::default();
            gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
            gauge
        };
        registry.register(
            "relayhost_lanes_waiting_for_charge",
            "Lanes taken over whose previous holder's deliveries could not be charged yet",
            gauge(self.store.lanes_waiting_for_charge() as u64),
        );
        registry.register("relayhost_lanes_held", "Lanes this host holds under a live lease", gauge(lanes_held as u64));
        registry.register("relayhost_events_unfanned", "Committed events not fanned out yet", gauge(unfanned));
        registry.register("relayhost_plugins_loaded", "Plugin files this host serves", gauge(self.registry.versions().len() as u64));
        registry.register("relayhost_plugins_refused", "Plugin files this host refused (see the admin API for why)", gauge(self.registry.refusals().len() as u64));
        type ByHandler = Family<HandlerLabel, Gauge>;
        let by_handler = |rows: &mut dyn Iterator<Item = (&str, u64)>| {
            let family = ByHandler::default();
            for (handler, value) in rows {
                family.get_or_create(&HandlerLabel { handler: handler.to_string() }).set(i64::try_from(value).unwrap_or(i64::MAX));
            }
            family
        };
        registry.register("relayhost_deliveries_pending", "Deliveries waiting", by_handler(&mut statistics.iter().map(|s| (s.handler.as_str(), s.pending))));
        registry.register("relayhost_deliveries_running", "Deliveries under a live lease", by_handler(&mut statistics.iter().map(|s| (s.handler.as_str(), s.running))));
        registry.register("relayhost_deliveries_dead", "Dead deliveries (dead letters)", by_handler(&mut statistics.iter().map(|s| (s.handler.as_str(), s.dead))));
        if let Some(known) = self.known.known() {
            let now = DateTime::now().timestamp_millis();
            let active: Vec<_> = known.iter().filter(|r| r.active()).collect();
            registry.register(
                "relayhost_handler_hosts_serving",
                "Live hosts serving each registered (not retired) handler",
                by_handler(&mut active.iter().map(|r| (r.handler.as_str(), r.served_by.len() as u64))),
            );
            let unserved = |r: &&&RegisteredHandler| if r.served_by.is_empty() { ((now - r.last_seen.timestamp_millis()).max(0) / 1000) as u64 } else { 0 };
            registry.register_with_unit(
                "relayhost_handler_unserved",
                "How long no live host has served each registered handler (0 while one does); its deliveries wait",
                Unit::Seconds,
                by_handler(&mut active.iter().map(|r| (r.handler.as_str(), unserved(&r)))),
            );
        }
        self.deliveries.register(&mut registry);
        let mut out = String::new();
        encode(&mut out, &registry).map_err(|e| e.to_string())?;
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
    let content_type = if status == StatusCode::OK && body.ends_with("# EOF\n") {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let mut response = (status, body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
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
