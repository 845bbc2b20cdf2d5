//! Health, readiness and metrics over HTTP, for container orchestrators and scrapers.
//!
//! `/healthz` answers while the process serves; `/readyz` when MongoDB answers a ping and at
//! least one plugin handler is loaded; `/metrics` prints the dispatcher's counters and each
//! handler's delivery counts in the Prometheus text format. Read-only: nothing here changes a
//! delivery, and no request input reaches a query.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

use bson::{DateTime, doc};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::task::JoinHandle;

use crate::dispatch::DispatcherCounters;
use crate::plugin::PluginRegistry;
use crate::store::Store;
use crate::store::mongo::MongoStore;

/// What the endpoints look at.
#[derive(Clone)]
pub struct HealthState {
    store: Arc<MongoStore>,
    registry: Arc<PluginRegistry>,
    counters: Arc<DispatcherCounters>,
}

impl HealthState {
    pub fn new(store: Arc<MongoStore>, registry: Arc<PluginRegistry>, counters: Arc<DispatcherCounters>) -> Self {
        Self { store, registry, counters }
    }

    /// Listens on `address` until the returned task is aborted.
    pub async fn serve(self, address: SocketAddr) -> std::io::Result<JoinHandle<()>> {
        let listener = tokio::net::TcpListener::bind(address).await?;
        tracing::info!(address = %listener.local_addr()?, "health endpoints listening");
        Ok(tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let state = self.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(state.respond(request).await) }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
        }))
    }

    async fn respond(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        match request.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n".into()),
            "/readyz" => match self.readiness().await {
                Ok(()) => text(StatusCode::OK, "ready\n".into()),
                Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
            },
            "/metrics" => match self.metrics().await {
                Ok(body) => text(StatusCode::OK, body),
                Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
            },
            _ => text(StatusCode::NOT_FOUND, "not found: try /healthz, /readyz or /metrics\n".into()),
        }
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
        ];
        for (name, counter, help) in counters {
            let _ = writeln!(out, "# HELP relayhost_{name}_total {help}\n# TYPE relayhost_{name}_total counter");
            let _ = writeln!(out, "relayhost_{name}_total {}", DispatcherCounters::get(counter));
        }
        let statistics = self.store.statistics(DateTime::now()).await.map_err(|e| e.to_string())?;
        for (name, help) in [("pending", "Deliveries waiting"), ("running", "Deliveries under a live lease"), ("dead", "Dead deliveries")] {
            let _ = writeln!(out, "# HELP relayhost_deliveries_{name} {help}\n# TYPE relayhost_deliveries_{name} gauge");
            for s in &statistics {
                let value = match name {
                    "pending" => s.pending,
                    "running" => s.running,
                    _ => s.dead,
                };
                // Handler ids are printable but may hold quotes or backslashes.
                let handler = s.handler.replace('\\', "\\\\").replace('"', "\\\"");
                let _ = writeln!(out, "relayhost_deliveries_{name}{{handler=\"{handler}\"}} {value}");
            }
        }
        Ok(out)
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}
