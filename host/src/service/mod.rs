//! The running host: what `relayhost run` starts, in order, and stops, in reverse.
//!
//! This module owns the assembly only: MongoDB (a URI or the embedded server), the store and
//! its setup, the plugin registry and its directory watch, the dispatcher with change-stream
//! wakeups, the configuration's reloads (`reload`), the scheduled purge (`retention`), the
//! health endpoints and the admin API. It must never contain delivery logic: claims, outcomes
//! and retries belong to `dispatch` and `store`, running a plugin to `plugin`.

mod embedded;
mod health;
mod reload;
mod retention;

use crate::store::Outbox;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use embedded::{ConnectError, MongoConnection, embedded_data_dir};
pub use health::HealthState;

use crate::admin::api::AdminApi;
use crate::config::{Config, LiveConfig, Secret};
use crate::dispatch::{Dispatcher, DispatcherCounters, DispatcherOptions};
use crate::event_schema::SchemaSource;
use crate::mongod::cache_dir;
use crate::plugin::{Change, PluginError, PluginPolicy, PluginRegistry, PluginRuntime};
use crate::plugin_runner::PluginRunner;
use crate::store::mongo::{EventWakeups, MongoLocation, MongoStore};
use crate::store::{StoreError, StoreOptions};
use crate::telemetry::{Telemetry, TelemetryError};

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("health endpoint on {address}: {source}")]
    Health { address: std::net::SocketAddr, source: std::io::Error },
    #[error("admin API on {address} (admin.listen): {source}")]
    Admin { address: std::net::SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Telemetry(#[from] TelemetryError),
    #[error("{0}")]
    Schemas(String),
    #[error("listening for configuration reloads (SIGHUP, the file's changes): {0}")]
    Reload(std::io::Error),
}

/// Time a transaction of the store may take: a transactional handler runs inside one, so it
/// must outlast the longest wall time a plugin is allowed, with room for the completion.
pub fn transaction_budget(config: &Config) -> Duration {
    (config.longest_wall_time() + Duration::from_secs(5)).max(StoreOptions::default().transaction_budget)
}

/// Connects as the configuration says; an embedded server aborts transactions a little after
/// the store would have given them up.
pub async fn connect(config: &Config) -> Result<MongoConnection, ConnectError> {
    MongoConnection::open(&config.mongodb, transaction_budget(config) + Duration::from_secs(5)).await
}

/// The store a configuration describes, on an open connection.
pub fn store_for(config: &Config, connection: &MongoConnection) -> Result<MongoStore, StoreError> {
    let location = MongoLocation::new(&config.mongodb.database, &config.mongodb.collection_prefix)?;
    let options = StoreOptions {
        lease_duration: config.host.lease.0,
        completion_history: config.host.completion_history,
        purge_pace: config.retention.pace,
        transaction_budget: transaction_budget(config),
        client_app_name: Some(connection.app_name.clone()),
        ..StoreOptions::default()
    };
    Ok(MongoStore::new(connection.client.clone(), location, options))
}

/// The plugin runtime and registry a configuration describes (nothing loaded yet).
pub fn registry_for(config: &Config) -> Result<Arc<PluginRegistry>, PluginError> {
    let policies = config.clone();
    registry_with(config, move |name| policies.policy_for(name))
}

/// The same, each plugin's limits and grants as `policy_for` says when it is loaded.
fn registry_with(
    config: &Config,
    policy_for: impl Fn(&str) -> PluginPolicy + Send + Sync + 'static,
) -> Result<Arc<PluginRegistry>, PluginError> {
    let artifacts = config.host.artifact_cache.clone().unwrap_or_else(|| cache_dir().join("artifacts"));
    let runtime = Arc::new(PluginRuntime::new(Some(artifacts))?);
    Ok(Arc::new(PluginRegistry::new(runtime, &config.plugins.directory, policy_for)))
}

/// Runs the host until `stop` resolves, then stops gracefully: claiming ends, deliveries in
/// flight get `host.shutdown_timeout` to finish, the rest are handed back uncharged, the
/// lanes are relinquished, and an embedded server this process started is shut down.
///
/// `config` was loaded from `path` (if any): SIGHUP, or a change of that file, reloads it, and
/// its processing settings and schemas apply without a restart (see [`LiveConfig`]).
pub async fn run(config: Config, path: Option<&Path>, stop: impl Future<Output = ()>) -> Result<(), ServiceError> {
    let live = LiveConfig::new(config, path);
    let connection = connect(&live.get()).await?;
    let result = serve(&live, &connection, stop).await;
    connection.close().await;
    result
}

async fn serve(
    live: &Arc<LiveConfig>,
    connection: &MongoConnection,
    stop: impl Future<Output = ()>,
) -> Result<(), ServiceError> {
    // What only a start applies; the processing settings are read from `live` at each use.
    let in_force = live.get();
    let config: &Config = &in_force;
    let store = Arc::new(store_for(config, connection)?);
    store.setup().await?;
    let policies = live.clone();
    let registry = registry_with(config, move |name| policies.get().policy_for(name))?;
    let changes = registry.scan().await?;
    let refused = changes.iter().filter(|c| matches!(c, Change::Refused { .. })).count();
    let handlers = registry.subscriptions();
    tracing::info!(
        plugins = registry.versions().len(),
        refused,
        handlers = handlers.len(),
        directory = %registry.directory().display(),
        "plugins loaded; watching the directory for changes"
    );
    let _watch = registry.watch()?;

    let telemetry = Telemetry::start(&config.telemetry, &store.options().owner)?;
    if let Some(endpoint) = &config.telemetry.otlp_endpoint {
        tracing::info!(%endpoint, traces = config.telemetry.traces, metrics = config.telemetry.metrics, "exporting telemetry over OTLP/HTTP");
    }
    let (retries, controls) = (live.clone(), live.clone());
    let retry_for = Arc::new(move |plugin: &str, handler: &str| retries.get().retry_for(plugin, handler).policy());
    let runner = PluginRunner::new(registry.clone(), store.clone(), retry_for)
        .controlled_by(Arc::new(move |plugin: &str, handler: &str| controls.get().controls_for(plugin, handler)))
        .traced_by(telemetry.clone());
    let deliveries = runner.metrics();
    let runner = Arc::new(runner);
    runner.create_granted_collections().await;
    let options = DispatcherOptions {
        concurrency: config.host.concurrency,
        claim_ahead: config.host.claim_ahead_or_default(),
        poll_interval: config.host.poll_interval.0,
        lease_duration: config.host.lease.0,
        shutdown_timeout: config.host.shutdown_timeout.0,
        schemas: SchemaSource::new(config.event_schemas().map_err(|e| ServiceError::Schemas(e.to_string()))?),
        ..DispatcherOptions::default()
    };
    let schemas = options.schemas.clone();
    let dispatcher = Dispatcher::new(store.clone(), runner, options);
    let reloading = reload::Reloading { live: live.clone(), registry: registry.clone(), schemas, dispatcher: dispatcher.waker() };
    let _reloading = reloading.spawn().map_err(ServiceError::Reload)?;
    let counters = dispatcher.counters();
    let wakeups = EventWakeups::default().spawn(&store, dispatcher.waker());
    let health = match config.host.health_listen {
        Some(address) => Some(
            HealthState::new(store.clone(), registry.clone(), counters.clone(), dispatcher.known_handlers(), deliveries.clone())
                .serve(address)
                .await
                .map_err(|source| ServiceError::Health { address, source })?,
        ),
        None => None,
    };
    let admin = match &config.admin.token {
        Some(Secret(token)) => {
            let api = AdminApi {
                store: store.clone(),
                plugins: registry.clone(),
                known: dispatcher.known_handlers(),
                counters: counters.clone(),
                retention: config.retention.clone(),
            };
            let address = config.admin.listen;
            Some(api.serve(address, token).await.map_err(|source| ServiceError::Admin { address, source })?)
        }
        None => {
            tracing::info!("admin API off: set admin.token (or RELAYHOST_ADMIN_TOKEN) to serve it on admin.listen");
            None
        }
    };
    let purging = retention::spawn(store.clone(), config.retention.clone());
    tracing::info!(owner = %store.options().owner, database = %config.mongodb.database, "relayhost is running");
    let result = dispatcher.run(stop).await;
    wakeups.abort();
    for task in [purging, admin].into_iter().flatten() {
        task.abort();
    }
    if let Some(health) = health {
        health.abort();
    }
    telemetry.shutdown();
    let count = |c: &std::sync::atomic::AtomicU64| DispatcherCounters::get(c);
    tracing::info!(
        completed = count(&counters.completed),
        retried = count(&counters.retried),
        dead = count(&counters.dead),
        released = count(&counters.released),
        "relayhost stopped"
    );
    Ok(result?)
}
