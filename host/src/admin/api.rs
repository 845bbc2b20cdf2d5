//! The admin HTTP API (`axum`) on `admin.listen` (loopback by default), JSON under
//! `/api/v1/`: statistics, deliveries by filter (listed a bounded page at a time, requeued,
//! buried, one or all that match), an event's history, the handler registry, plugins (version,
//! limits, grants, why a file was refused), lanes and live hosts, and the purge.
//!
//! Every request carries `Authorization: Bearer <admin.token>` (or a signed-in browser's cookie,
//! see `dashboard`; the check is `access`), compared in constant time (as SHA-256 digests, so not even its length
//! shows); any other gets 401. The token is never logged, and no request's text reaches a
//! query but as a literal. The dashboard's pages share the listener and the check.

use crate::store::{Administration, Hosts};
use std::collections::BTreeMap;
use std::net::SocketAddr;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bson::DateTime;
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;

pub use super::access::AdminApi;
use super::access::{Served, authenticated, failure};
use super::bulk::{self, BulkReport};
use super::dashboard;
use super::filters::Filters;
use crate::dispatch::{DispatcherCounters, bury_by_operator};
use crate::store::{DeliveryFilter, DeliveryView, Listed, StoreError};

impl AdminApi {
    /// The routes, every one behind the token.
    pub fn router(self, token: &str) -> Router {
        let served = Served::new(self, Sha256::digest(token.as_bytes()).into());
        let signed_in = Router::new()
            .route("/", get(dashboard::overview))
            .route("/dashboard/deliveries/{id}/requeue", post(dashboard::requeue))
            .route("/dashboard/deliveries/{id}/bury", post(dashboard::bury))
            .route("/api/v1/stats", get(stats))
            .route("/api/v1/deliveries", get(list_deliveries))
            .route("/api/v1/deliveries/requeue", post(requeue_matching))
            .route("/api/v1/deliveries/bury", post(bury_matching))
            .route("/api/v1/deliveries/{id}/requeue", post(requeue_one))
            .route("/api/v1/deliveries/{id}/bury", post(bury_one))
            .route("/api/v1/events/{id}", get(event))
            .route("/api/v1/handlers", get(handlers))
            .route("/api/v1/plugins", get(plugins))
            .route("/api/v1/lanes", get(lanes))
            .route("/api/v1/hosts", get(hosts))
            .route("/api/v1/purge", post(purge))
            .fallback(|| async { failure(StatusCode::NOT_FOUND, "no such endpoint: see /api/v1/stats, /api/v1/deliveries, ...") })
            .layer(middleware::from_fn_with_state(served.clone(), authenticated));
        Router::new()
            .route("/login", get(dashboard::login_form).post(dashboard::login))
            .merge(signed_in)
            .with_state(served)
    }

    /// Listens on `address` until the returned task is aborted; logs the address it got.
    pub async fn serve(self, address: SocketAddr, token: &str) -> std::io::Result<JoinHandle<()>> {
        let listener = tokio::net::TcpListener::bind(address).await?;
        tracing::info!(address = %listener.local_addr()?, "admin API listening (bearer token required)");
        let router = self.router(token);
        Ok(tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, router).await {
                tracing::error!(%error, "the admin API stopped");
            }
        }))
    }
}

/// A store error as an answer: what the operator asked is refused with the reason, or the
/// store failed.
fn store_failure(error: StoreError) -> Response {
    let status = match &error {
        StoreError::DeliveryNotFound(_) => StatusCode::NOT_FOUND,
        StoreError::NotDead(_) | StoreError::NotBuriable { .. } | StoreError::Raced(_) => StatusCode::CONFLICT,
        StoreError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    failure(status, &error.to_string())
}

fn shown(at: DateTime) -> String {
    at.try_to_rfc3339_string().unwrap_or_default()
}

/// A listing's filters and page, as query parameters.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Listing {
    #[serde(flatten)]
    filters: Filters,
    after: Option<String>,
    limit: Option<usize>,
}

fn filter_of(filters: &Filters) -> Result<DeliveryFilter, Response> {
    filters.filter(None).map_err(|message| failure(StatusCode::BAD_REQUEST, &message))
}

/// A delivery as the admin API and `relayhost deliveries --json` show it.
pub fn delivery_json(d: &DeliveryView) -> Value {
    json!({
        "id": d.id, "state": Listed::of(d).as_str(), "eventId": d.event_id, "eventType": d.event_type,
        "handler": d.handler, "key": d.key, "sequence": d.sequence, "limitKey": d.limit_key, "priority": d.priority,
        "lane": d.lane_id, "attempts": d.attempts,
        "dueAt": shown(d.due_at), "createdAt": shown(d.created_at), "updatedAt": d.updated_at.map(shown),
        "lastError": d.last_error,
    })
}

async fn stats(State(served): State<Served>) -> Response {
    let api = &served.api;
    let now = DateTime::now();
    let (statistics, unfanned) = match tokio::try_join!(api.store.statistics(now), api.store.unfanned_events()) {
        Ok(both) => both,
        Err(error) => return store_failure(error),
    };
    let registry = api.known.known().map(|known| (*known).clone()).unwrap_or_default();
    let rows: Vec<Value> = statistics
        .iter()
        .map(|s| {
            let record = registry.iter().find(|r| r.handler == s.handler);
            json!({
                "handler": s.handler, "pending": s.pending, "running": s.running, "parked": s.parked, "dead": s.dead,
                "completed": s.completed, "oldestDueAt": s.oldest_due_at.map(shown),
                "servedBy": record.map(|r| r.served_by.clone()),
                "unservedSince": record.filter(|r| r.served_by.is_empty() && r.active()).map(|r| shown(r.last_seen)),
            })
        })
        .collect();
    let counters = &api.counters;
    let this_host = json!({
        "completed": DispatcherCounters::get(&counters.completed), "retried": DispatcherCounters::get(&counters.retried),
        "dead": DispatcherCounters::get(&counters.dead), "released": DispatcherCounters::get(&counters.released),
    });
    Json(json!({ "handlers": rows, "unfannedEvents": unfanned, "thisHost": this_host })).into_response()
}

async fn list_deliveries(State(served): State<Served>, Query(listing): Query<Listing>) -> Response {
    let filter = match filter_of(&listing.filters) {
        Ok(filter) => DeliveryFilter { after: listing.after, limit: listing.limit.unwrap_or(100).min(1_000), ..filter },
        Err(response) => return response,
    };
    match served.api.store.list_deliveries(&filter).await {
        Ok(page) => Json(json!({ "deliveries": page.deliveries.iter().map(delivery_json).collect::<Vec<_>>(), "next": page.next })).into_response(),
        Err(error) => store_failure(error),
    }
}

/// A bulk action: its filters, and `confirm` to act (without it, only the count).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Bulk {
    #[serde(flatten)]
    filters: Filters,
    confirm: bool,
    reason: Option<String>,
}

fn bulk_json(report: &BulkReport, acted: bool) -> Response {
    let refused: Vec<Value> = report.refused.iter().map(|(id, why)| json!({ "id": id, "reason": why })).collect();
    Json(json!({ "matched": report.matched, "done": report.done, "acted": acted, "refused": refused })).into_response()
}

async fn requeue_matching(State(served): State<Served>, Json(request): Json<Bulk>) -> Response {
    let filter = match filter_of(&request.filters) {
        Ok(filter) => filter,
        Err(response) => return response,
    };
    match bulk::requeue(&*served.api.store, filter, request.confirm).await {
        Ok(report) => bulk_json(&report, request.confirm),
        Err(error) => store_failure(error),
    }
}

async fn bury_matching(State(served): State<Served>, Json(request): Json<Bulk>) -> Response {
    let filter = match filter_of(&request.filters) {
        Ok(filter) => filter,
        Err(response) => return response,
    };
    let reason = request.reason.as_deref().unwrap_or("buried by an operator");
    match bulk::bury(&*served.api.store, filter, reason, request.confirm).await {
        Ok(report) => bulk_json(&report, request.confirm),
        Err(error) => store_failure(error),
    }
}

async fn requeue_one(State(served): State<Served>, Path(id): Path<String>) -> Response {
    match served.api.store.requeue(&id, DateTime::now()).await {
        Ok(()) => Json(json!({ "requeued": id })).into_response(),
        Err(error) => store_failure(error),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Burial {
    reason: Option<String>,
}

async fn bury_one(State(served): State<Served>, Path(id): Path<String>, body: Option<Json<Burial>>) -> Response {
    let reason = body.and_then(|Json(burial)| burial.reason).unwrap_or_else(|| "buried by an operator".to_string());
    match bury_by_operator(&*served.api.store, &id, &reason).await {
        Ok(buried) => Json(json!({ "buried": delivery_json(&buried) })).into_response(),
        Err(error) => store_failure(error),
    }
}

async fn event(State(served): State<Served>, Path(id): Path<String>) -> Response {
    let store = &served.api.store;
    let history = match store.event_history(&id).await {
        Ok(history) => history,
        Err(error) => return store_failure(error),
    };
    let Some(event) = history.event else { return failure(StatusCode::NOT_FOUND, "no such event (never published, or purged)") };
    let deliveries = match bulk::matching(&**store, DeliveryFilter { event_id: Some(id), ..DeliveryFilter::default() }, 1_000).await {
        Ok(deliveries) => deliveries,
        Err(error) => return store_failure(error),
    };
    let completions: Vec<Value> = history.completions.iter().map(|(handler, at)| json!({ "handler": handler, "completedAt": shown(*at) })).collect();
    Json(json!({
        "event": bson::Bson::Document(event).into_relaxed_extjson(),
        "deliveries": deliveries.iter().map(delivery_json).collect::<Vec<_>>(),
        "completions": completions,
    }))
    .into_response()
}

async fn handlers(State(served): State<Served>) -> Response {
    match served.api.store.registered_handlers(DateTime::now()).await {
        Ok(registry) => Json(json!({ "handlers": registry.iter().map(|r| json!({
            "handler": r.handler, "eventTypes": r.event_types, "transactional": r.in_transaction, "plugin": r.plugin,
            "version": r.version, "servedBy": r.served_by, "firstSeen": shown(r.first_seen), "lastSeen": shown(r.last_seen),
            "retiredAt": r.retired_at.map(shown),
        })).collect::<Vec<_>>() }))
        .into_response(),
        Err(error) => store_failure(error),
    }
}

async fn plugins(State(served): State<Served>) -> Response {
    let loaded: Vec<Value> = served
        .api
        .plugins
        .plugins()
        .iter()
        .map(|plugin| {
            let (limits, grants) = (&plugin.policy.limits, &plugin.policy.grants);
            json!({
                "plugin": &*plugin.name, "version": plugin.content_hash,
                "handlers": plugin.subscriptions.iter().map(|s| json!({ "handler": s.handler, "eventTypes": s.event_types, "transactional": s.transactional })).collect::<Vec<_>>(),
                "limits": {
                    "fuel": limits.fuel, "memoryBytes": limits.memory_bytes, "wallTimeMs": limits.wall_time.as_millis() as u64,
                    "reasonBytes": limits.reason_bytes, "outputBytes": limits.log.output_bytes,
                    "followUps": limits.transaction.follow_ups, "descendants": limits.transaction.descendants,
                    "chainDepth": limits.transaction.chain_depth,
                },
                "grants": {
                    "collections": grants.transaction.collections, "publishTypes": grants.transaction.publish_types,
                    "httpHosts": grants.http.hosts, "privateNetworks": grants.http.private_networks,
                    "environment": grants.environment,
                    "directory": grants.read_only_directory.as_ref().map(|p| p.display().to_string()),
                },
            })
        })
        .collect();
    let refused: BTreeMap<String, String> = served.api.plugins.refusals();
    Json(json!({ "plugins": loaded, "refused": refused })).into_response()
}

async fn lanes(State(served): State<Served>) -> Response {
    match served.api.store.membership(DateTime::now()).await {
        Ok(membership) => Json(json!({ "lanes": membership.lanes.iter().map(|l| json!({
            "lane": l.lane, "holder": l.holder, "leaseExpiresAt": shown(l.lease_expires_at), "epoch": l.epoch, "inFlight": l.in_flight,
        })).collect::<Vec<_>>() }))
        .into_response(),
        Err(error) => store_failure(error),
    }
}

async fn hosts(State(served): State<Served>) -> Response {
    let api = &served.api;
    let now = DateTime::now();
    let (membership, registry) = match tokio::try_join!(api.store.membership(now), api.store.registered_handlers(now)) {
        Ok(both) => both,
        Err(error) => return store_failure(error),
    };
    let rows: Vec<Value> = membership
        .hosts
        .iter()
        .map(|(host, until)| {
            let lanes = membership.lanes.iter().filter(|l| l.holder.as_deref() == Some(host.as_str())).count();
            let serves: Vec<&String> = registry.iter().filter(|r| r.served_by.contains(host)).map(|r| &r.handler).collect();
            json!({ "host": host, "announcedUntil": shown(*until), "lanesHeld": lanes, "serves": serves })
        })
        .collect();
    Json(json!({ "hosts": rows })).into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct PurgeRequest {
    dry_run: bool,
}

async fn purge(State(served): State<Served>, body: Option<Json<PurgeRequest>>) -> Response {
    let dry_run = body.is_none_or(|Json(request)| request.dry_run);
    let api = &served.api;
    let now = DateTime::now();
    let options = api.retention.purge_options(now);
    let report = if dry_run { api.store.purge_preview(&options, now).await } else { api.store.purge(&options, now).await };
    match report {
        Ok(report) => Json(json!({
            "dryRun": dry_run, "deadDeliveries": report.dead_deliveries, "historyRecords": report.history_records,
            "events": report.events, "keyCounters": report.key_counters,
        }))
        .into_response(),
        Err(error) => store_failure(error),
    }
}
