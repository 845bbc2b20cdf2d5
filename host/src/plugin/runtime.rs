//! The plugin runtime: one wasmtime engine for the process, components compiled once (and
//! cached on disk by content hash and engine), one sandboxed instance per delivery from a
//! pre-instantiated template, with fuel, memory, wall-clock and output limits.
//!
//! It knows components, grants and limits; it must never know lanes, leases or documents
//! of the outbox: the dispatcher hands it an event and gets an outcome back.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ResourceLimiter, Store, Trap};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpView};

use super::bounds::{cut, read_plugin_file, validate_subscriptions};
use super::capability::{FollowUpEvent, TransactionCapability};
use super::http::GrantedHosts;
use super::output::{Output, Source};
use super::{PluginError, PluginPolicy, Subscription};
use crate::event::EventRecord;

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "plugin",
        imports: { default: async },
        exports: { default: async },
    });
}

use bindings::relayhost::plugin::{log, transaction, types};

pub use bindings::relayhost::plugin::log::Level as LogLevel;

/// Milliseconds between epoch ticks: the resolution of the wall-clock limit.
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Fuel a busy plugin may burn between two yields to the async runtime.
const FUEL_YIELD_INTERVAL: u64 = 100_000;
/// Concurrent instances the pooling allocator has slots for.
const INSTANCE_SLOTS: u32 = 256;
/// Linear memory a reused instance slot keeps resident between deliveries.
const KEEP_RESIDENT_BYTES: usize = 8 * 1024 * 1024;
/// Largest memory any plugin may be granted.
pub const MAX_MEMORY_BYTES: usize = 1 << 30;

/// What the host keeps per delivery inside the wasmtime store.
pub(crate) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    http: WasiHttpCtx,
    http_hosts: GrantedHosts,
    limiter: MemoryLimiter,
    output: Output,
    plugin: Arc<str>,
    policy: Arc<PluginPolicy>,
    /// Present only for transactional handlers.
    transaction: Option<Box<dyn TransactionCapability>>,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl WasiHttpView for HostState {
    fn http(&mut self) -> wasmtime_wasi_http::WasiHttpCtxView<'_> {
        wasmtime_wasi_http::WasiHttpCtxView { ctx: &mut self.http, table: &mut self.table, hooks: &mut self.http_hosts }
    }
}

/// Enforces the plugin's memory limit and remembers whether it had to refuse growth, so a
/// trap that follows can be named for what it is.
#[derive(Default)]
struct MemoryLimiter {
    max_bytes: usize,
    refused: bool,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let allowed = desired <= self.max_bytes;
        self.refused |= !allowed;
        Ok(allowed)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

impl types::Host for HostState {}

impl log::Host for HostState {
    async fn log(&mut self, level: LogLevel, message: String) {
        self.output.push(Source::Log(level), &message);
    }
}

impl HostState {
    fn capability(&mut self, collection: Option<&str>) -> Result<&mut dyn TransactionCapability, String> {
        let Some(capability) = self.transaction.as_deref_mut() else {
            return Err("the transaction capability is only available to transactional handlers".to_string());
        };
        if let Some(collection) = collection {
            if !self.policy.grants.allows_collection(collection) {
                return Err(format!("collection `{collection}` is not granted to plugin `{}`", self.plugin));
            }
        }
        Ok(capability)
    }
}

impl transaction::Host for HostState {
    async fn insert(&mut self, collection: String, document: String) -> Result<String, String> {
        self.capability(Some(&collection))?.insert(&collection, &document).await
    }

    async fn update(&mut self, collection: String, filter: String, update: String) -> Result<u64, String> {
        self.capability(Some(&collection))?.update(&collection, &filter, &update).await
    }

    async fn delete(&mut self, collection: String, filter: String) -> Result<u64, String> {
        self.capability(Some(&collection))?.delete(&collection, &filter).await
    }

    async fn find(&mut self, collection: String, filter: String, limit: u32) -> Result<Vec<String>, String> {
        self.capability(Some(&collection))?.find(&collection, &filter, limit).await
    }

    async fn publish(&mut self, event: transaction::NewEvent) -> Result<(), String> {
        let follow_up = FollowUpEvent {
            id: event.id,
            event_type: event.event_type,
            key: event.key,
            payload: event.payload,
            headers: event.headers,
        };
        self.capability(None)?.publish(follow_up).await
    }
}

/// How one delivery ended, as far as the plugin is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// The plugin asked for a retry.
    Retry { reason: String, not_before: Option<i64> },
    /// The plugin says retrying cannot help.
    Unprocessable(String),
    /// The attempt failed without the plugin deciding: a trap, fuel or memory exhausted, the
    /// wall-clock limit. Counts as a failed attempt.
    Failed(String),
}

/// One delivery's run: its outcome and what became of the plugin's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ran {
    pub outcome: Outcome,
    /// Bytes of log lines and stdout/stderr routed to the host's logs.
    pub output_kept: usize,
    /// Bytes dropped over the plugin's output budget.
    pub output_dropped: usize,
}

/// What the dispatcher tells a plugin about one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryInfo {
    pub handler: String,
    pub attempt: u32,
    pub max_attempts: u32,
    /// Milliseconds since the Unix epoch.
    pub deadline: i64,
}

/// A compiled, validated plugin: one version of one file.
pub struct LoadedPlugin {
    /// The file name without `.wasm`.
    pub name: Arc<str>,
    /// Hex SHA-256 of the file's bytes: the version's identity in logs.
    pub content_hash: String,
    pub subscriptions: Vec<Subscription>,
    pub policy: Arc<PluginPolicy>,
    pre: bindings::PluginPre<HostState>,
}

impl std::fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlugin")
            .field("name", &self.name)
            .field("content_hash", &self.content_hash)
            .field("subscriptions", &self.subscriptions)
            .finish_non_exhaustive()
    }
}

impl LoadedPlugin {
    pub fn short_hash(&self) -> &str {
        &self.content_hash[..12]
    }

    pub fn subscription(&self, handler: &str) -> Option<&Subscription> {
        self.subscriptions.iter().find(|s| s.handler == handler)
    }
}

/// The process's plugin engine.
pub struct PluginRuntime {
    engine: Engine,
    linker: Linker<HostState>,
    cache_dir: Option<PathBuf>,
    stop_ticker: Arc<AtomicBool>,
    meter_fuel: bool,
}

/// How to build the engine.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Where compiled artifacts are kept across restarts.
    pub cache_dir: Option<PathBuf>,
    /// Count fuel (the deterministic CPU budget of `Limits::fuel`). Without it only the
    /// wall-clock limit stops a busy plugin; the benchmarks use this to price metering.
    pub meter_fuel: bool,
}

impl Drop for PluginRuntime {
    fn drop(&mut self) {
        self.stop_ticker.store(true, Ordering::Relaxed);
    }
}

impl PluginRuntime {
    /// One engine with the pooling allocator, fuel, epoch interruption and async support.
    /// `cache_dir` keeps compiled artifacts across restarts.
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Self, PluginError> {
        Self::with_options(RuntimeOptions { cache_dir, meter_fuel: true })
    }

    pub fn with_options(options: RuntimeOptions) -> Result<Self, PluginError> {
        let RuntimeOptions { cache_dir, meter_fuel } = options;
        let mut config = Config::new();
        config.wasm_component_model(true).consume_fuel(meter_fuel).epoch_interruption(true);
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(INSTANCE_SLOTS)
            .total_core_instances(INSTANCE_SLOTS * 4)
            .total_memories(INSTANCE_SLOTS * 2)
            .total_tables(INSTANCE_SLOTS * 4)
            .total_stacks(INSTANCE_SLOTS)
            .max_memory_size(MAX_MEMORY_BYTES)
            // A reused slot keeps the pages its last instance touched, and only those are
            // reset (found with the PAGEMAP_SCAN ioctl where the kernel has it): no page
            // faults, madvise calls or TLB shootdowns per delivery.
            .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
            .table_keep_resident(64 * 1024)
            .async_stack_keep_resident(64 * 1024)
            .pagemap_scan(wasmtime::Enabled::Auto);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(|e| PluginError::Engine(e.to_string()))?;

        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| PluginError::Engine(e.to_string()))?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker).map_err(|e| PluginError::Engine(e.to_string()))?;
        bindings::Plugin::add_to_linker::<_, HasSelf<_>>(&mut linker, |state| state)
            .map_err(|e| PluginError::Engine(e.to_string()))?;

        let stop_ticker = Arc::new(AtomicBool::new(false));
        let ticker_engine = engine.clone();
        let stop = stop_ticker.clone();
        std::thread::Builder::new()
            .name("relayhost-epoch".to_string())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    ticker_engine.increment_epoch();
                }
            })
            .map_err(|e| PluginError::Engine(e.to_string()))?;
        Ok(Self { engine, linker, cache_dir, stop_ticker, meter_fuel })
    }

    /// Compiles (or loads from the artifact cache) and validates one plugin file: a component
    /// of this world, with well-formed, unique handler ids. The error names the file.
    pub async fn load(&self, path: &Path, policy: PluginPolicy) -> Result<LoadedPlugin, PluginError> {
        let bytes = read_plugin_file(path).map_err(|reason| PluginError::Refused { file: path.display().to_string(), reason })?;
        self.load_bytes(path, bytes, policy).await
    }

    /// [`PluginRuntime::load`] of a file's bytes read already (by [`read_plugin_file`]).
    pub async fn load_bytes(&self, path: &Path, bytes: Vec<u8>, policy: PluginPolicy) -> Result<LoadedPlugin, PluginError> {
        let file = path.display().to_string();
        let refuse = |reason: String| PluginError::Refused { file: file.clone(), reason };
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| refuse("the file name is not valid UTF-8".to_string()))?
            .to_string();
        let content_hash = hex::encode(Sha256::digest(&bytes));
        // Compiling is seconds of CPU for a large component: keep it off the async threads.
        let (engine, cache_dir, hash) = (self.engine.clone(), self.cache_dir.clone(), content_hash.clone());
        let component = tokio::task::spawn_blocking(move || compile(&engine, cache_dir.as_deref(), &bytes, &hash))
            .await
            .map_err(|e| refuse(format!("compiling it failed: {e}")))?
            .map_err(refuse)?;
        let instance_pre = self.linker.instantiate_pre(&component).map_err(|e| {
            refuse(format!("it needs an import relayhost does not provide: {}", root_cause(&e)))
        })?;
        let pre = bindings::PluginPre::new(instance_pre)
            .map_err(|e| refuse(format!("it does not implement relayhost:plugin/handler@0.1.0: {}", root_cause(&e))))?;
        let mut plugin = LoadedPlugin {
            name: name.into(),
            content_hash,
            subscriptions: Vec::new(),
            policy: Arc::new(policy),
            pre,
        };
        plugin.subscriptions = self.read_subscriptions(&plugin).await.map_err(refuse)?;
        Ok(plugin)
    }

    async fn read_subscriptions(&self, plugin: &LoadedPlugin) -> Result<Vec<Subscription>, String> {
        let (mut store, output) = self.store(plugin, None);
        let call = async {
            let instance = plugin.pre.instantiate_async(&mut store).await?;
            instance.relayhost_plugin_handler().call_subscriptions(&mut store).await
        };
        let result = tokio::time::timeout(plugin.policy.limits.wall_time, call).await;
        route_output(&plugin.name, plugin.short_hash(), &output);
        let subscriptions = match result {
            Ok(Ok(subscriptions)) => subscriptions,
            Ok(Err(error)) => return Err(format!("its `subscriptions` failed: {}", describe_trap(&error, &store))),
            Err(_) => return Err("its `subscriptions` ran past the wall-clock limit".to_string()),
        };
        let subscriptions = subscriptions.into_iter().map(|s| Subscription {
            handler: s.handler,
            event_types: s.event_types,
            transactional: s.transactional,
        });
        validate_subscriptions(subscriptions.collect())
    }

    fn store(&self, plugin: &LoadedPlugin, transaction: Option<Box<dyn TransactionCapability>>) -> (Store<HostState>, Output) {
        let policy = plugin.policy.clone();
        let output = Output::new(policy.limits.output_bytes);
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(output.stream(Source::Stdout))
            .stderr(output.stream(Source::Stderr))
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .socket_addr_check(|_, _| Box::pin(async { false }));
        for name in &policy.grants.environment {
            if let Ok(value) = std::env::var(name) {
                wasi.env(name, value);
            }
        }
        if let Some(directory) = &policy.grants.read_only_directory {
            if let Err(error) = wasi.preopened_dir(directory, "/data", wasmtime_wasi::FsPerms::ReadOnly) {
                tracing::warn!(plugin = %plugin.name, %error, directory = %directory.display(), "cannot open the granted directory");
            }
        }
        let state = HostState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            http: WasiHttpCtx::new(),
            http_hosts: GrantedHosts::new(plugin.name.clone(), policy.clone()),
            limiter: MemoryLimiter { max_bytes: policy.limits.memory_bytes.min(MAX_MEMORY_BYTES), refused: false },
            output: output.clone(),
            plugin: plugin.name.clone(),
            policy: policy.clone(),
            transaction,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| &mut state.limiter);
        if self.meter_fuel {
            store.set_fuel(policy.limits.fuel).expect("fuel is enabled");
            store.fuel_async_yield_interval(Some(FUEL_YIELD_INTERVAL)).expect("async and fuel are enabled");
        }
        let ticks = (policy.limits.wall_time.as_millis() / EPOCH_TICK.as_millis()).max(1) as u64;
        store.set_epoch_deadline(ticks);
        store.epoch_deadline_trap();
        (store, output)
    }

    /// Runs one delivery in a fresh instance. A transactional handler gets `transaction`;
    /// it is handed back with the outcome so the caller can commit or abort.
    pub async fn invoke(
        &self,
        plugin: &LoadedPlugin,
        event: &EventRecord,
        delivery: &DeliveryInfo,
        transaction: Option<Box<dyn TransactionCapability>>,
    ) -> Ran {
        let started = Instant::now();
        if !Engine::same(&self.engine, plugin.pre.engine()) {
            return Ran { outcome: Outcome::Failed("the plugin was loaded by another runtime".into()), output_kept: 0, output_dropped: 0 };
        }
        let (mut store, output) = self.store(plugin, transaction);
        let wit_event = to_wit_event(event);
        let context = types::DeliveryContext {
            handler: delivery.handler.clone(),
            attempt: delivery.attempt,
            max_attempts: delivery.max_attempts,
            deadline: delivery.deadline,
        };
        let call = async {
            let instance = plugin.pre.instantiate_async(&mut store).await?;
            instance.relayhost_plugin_handler().call_handle(&mut store, &wit_event, &context).await
        };
        // The epoch deadline stops WebAssembly code; this timeout also stops time spent
        // blocked in host calls (a sleep, a slow HTTP peer).
        let result = tokio::time::timeout(plugin.policy.limits.wall_time, call).await;
        let outcome = match result {
            Ok(Ok(Ok(()))) => Outcome::Completed,
            Ok(Ok(Err(types::Failure::Retry(retry)))) => {
                let limits = &plugin.policy.limits;
                let horizon = bson::DateTime::now().timestamp_millis().saturating_add(limits.not_before_horizon.as_millis() as i64);
                Outcome::Retry { reason: cut(retry.reason, limits.reason_bytes), not_before: retry.not_before.map(|at| at.min(horizon)) }
            }
            Ok(Ok(Err(types::Failure::Unprocessable(reason)))) => Outcome::Unprocessable(cut(reason, plugin.policy.limits.reason_bytes)),
            Ok(Err(error)) => {
                // A guest that panics prints why to stderr just before its trap; a limit
                // needs no more words than its own.
                let reason = describe_trap(&error, &store);
                match output.last_line(Source::Stderr) {
                    Some(line) if reason.starts_with("trap: ") => {
                        Outcome::Failed(format!("{reason}; its last words: {}", line.chars().take(300).collect::<String>()))
                    }
                    _ => Outcome::Failed(reason),
                }
            }
            Err(_) => Outcome::Failed(format!("wall-clock limit of {:?} exceeded", plugin.policy.limits.wall_time)),
        };
        let (output_kept, output_dropped) = route_output(&plugin.name, plugin.short_hash(), &output);
        // A quick plugin may finish without ever yielding; let a caller running deliveries
        // back to back still share the thread with other tasks.
        tokio::task::consume_budget().await;
        tracing::debug!(plugin = %plugin.name, version = plugin.short_hash(), handler = %delivery.handler, event = %event.id,
            elapsed_us = started.elapsed().as_micros() as u64, ?outcome, "delivery ran");
        Ran { outcome, output_kept, output_dropped }
    }

    /// Runs one delivery of a transactional handler and hands its transaction capability
    /// back, for the caller to commit (on [`Outcome::Completed`]) or abort.
    pub async fn invoke_transactional(
        &self,
        plugin: &LoadedPlugin,
        event: &EventRecord,
        delivery: &DeliveryInfo,
        transaction: Box<dyn TransactionCapability>,
    ) -> (Ran, Option<Box<dyn TransactionCapability>>) {
        let holder = CapabilityReturn::default();
        let ran = self.invoke(plugin, event, delivery, Some(Box::new(holder.wrap(transaction)))).await;
        (ran, holder.take())
    }
}

/// Hands a capability back out of a store that has been dropped.
#[derive(Default, Clone)]
struct CapabilityReturn(Arc<std::sync::Mutex<Option<Box<dyn TransactionCapability>>>>);

struct Returning {
    inner: Option<Box<dyn TransactionCapability>>,
    slot: CapabilityReturn,
}

impl CapabilityReturn {
    fn wrap(&self, capability: Box<dyn TransactionCapability>) -> Returning {
        Returning { inner: Some(capability), slot: self.clone() }
    }

    fn take(&self) -> Option<Box<dyn TransactionCapability>> {
        self.0.lock().expect("capability slot").take()
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        *self.slot.0.lock().expect("capability slot") = self.inner.take();
    }
}

impl TransactionCapability for Returning {
    fn insert<'a>(&'a mut self, collection: &'a str, document: &'a str) -> super::capability::CapabilityFuture<'a, String> {
        self.inner.as_mut().expect("present until dropped").insert(collection, document)
    }
    fn update<'a>(&'a mut self, collection: &'a str, filter: &'a str, update: &'a str) -> super::capability::CapabilityFuture<'a, u64> {
        self.inner.as_mut().expect("present until dropped").update(collection, filter, update)
    }
    fn delete<'a>(&'a mut self, collection: &'a str, filter: &'a str) -> super::capability::CapabilityFuture<'a, u64> {
        self.inner.as_mut().expect("present until dropped").delete(collection, filter)
    }
    fn find<'a>(&'a mut self, collection: &'a str, filter: &'a str, limit: u32) -> super::capability::CapabilityFuture<'a, Vec<String>> {
        self.inner.as_mut().expect("present until dropped").find(collection, filter, limit)
    }
    fn publish(&mut self, event: FollowUpEvent) -> super::capability::CapabilityFuture<'_, ()> {
        self.inner.as_mut().expect("present until dropped").publish(event)
    }
}

/// Compiles a component, or loads it from the artifact cache of this engine.
fn compile(engine: &Engine, cache_dir: Option<&Path>, bytes: &[u8], content_hash: &str) -> Result<Component, String> {
    let cached = cache_dir.map(|dir| dir.join(engine_fingerprint(engine)).join(format!("{content_hash}.cwasm")));
    if let Some(path) = &cached {
        // Read, not mapped: a file changed in place under a mapping would crash the host.
        if let Ok(artifact) = std::fs::read(path) {
            // SAFETY: the artifact was written by `Component::serialize` of an engine with
            // the same compatibility hash, into a directory only this host writes; wasmtime
            // checks its header and refuses foreign or truncated artifacts.
            match unsafe { Component::deserialize(engine, &artifact) } {
                Ok(component) => return Ok(component),
                Err(error) => tracing::warn!(%error, path = %path.display(), "ignoring an unusable compiled artifact"),
            }
        }
    }
    let component = Component::new(engine, bytes).map_err(|e| format!("it is not a valid WebAssembly component: {}", root_cause(&e)))?;
    if let Some(path) = cached {
        if let Err(error) = write_artifact(&path, &component) {
            tracing::warn!(%error, path = %path.display(), "cannot cache the compiled plugin");
        }
    }
    Ok(component)
}

/// Names the artifacts an engine can load: its compatibility hash.
fn engine_fingerprint(engine: &Engine) -> String {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

fn write_artifact(path: &Path, component: &Component) -> std::io::Result<()> {
    let bytes = component.serialize().map_err(std::io::Error::other)?;
    let dir = path.parent().expect("artifact path has a parent");
    std::fs::create_dir_all(dir)?;
    let partial = path.with_extension(format!("partial.{}", std::process::id()));
    std::fs::write(&partial, bytes)?;
    std::fs::rename(partial, path)
}

fn root_cause(error: &wasmtime::Error) -> String {
    format!("{error:#}")
}

/// Names a failed call for humans: limits first, then the trap, then anything else.
fn describe_trap(error: &wasmtime::Error, store: &Store<HostState>) -> String {
    match error.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => "fuel exhausted".to_string(),
        Some(Trap::Interrupt) => "wall-clock limit exceeded".to_string(),
        Some(Trap::StackOverflow) => "trap: stack overflow".to_string(),
        _ if store.data().limiter.refused => {
            format!("memory limit of {} bytes reached", store.data().limiter.max_bytes)
        }
        Some(trap) => format!("trap: {trap}"),
        None => format!("failed: {}", root_cause(error)),
    }
}

/// Sends the delivery's output to `tracing`; returns the bytes kept and dropped.
fn route_output(plugin: &str, version: &str, output: &Output) -> (usize, usize) {
    let (kept, dropped) = output.take();
    let kept_bytes = kept.iter().map(|(_, text)| text.len()).sum();
    for (source, text) in kept {
        for line in text.lines().filter(|l| !l.is_empty()) {
            match source {
                Source::Log(LogLevel::Error) | Source::Stderr => tracing::error!(plugin, version, "{line}"),
                Source::Log(LogLevel::Warn) => tracing::warn!(plugin, version, "{line}"),
                Source::Log(LogLevel::Info) | Source::Stdout => tracing::info!(plugin, version, "{line}"),
                Source::Log(LogLevel::Debug) => tracing::debug!(plugin, version, "{line}"),
                Source::Log(LogLevel::Trace) => tracing::trace!(plugin, version, "{line}"),
            }
        }
    }
    if dropped > 0 {
        tracing::warn!(plugin, version, dropped_bytes = dropped, "plugin output over its budget was dropped");
    }
    (kept_bytes, dropped)
}

fn to_wit_event(event: &EventRecord) -> types::Event {
    types::Event {
        id: event.id.clone(),
        event_type: event.event_type.clone(),
        key: event.key.clone(),
        sequence: event.sequence,
        payload: bson::Bson::Document(event.payload.clone()).into_relaxed_extjson().to_string(),
        headers: event.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        correlation_id: event.correlation_id.clone(),
        causation_id: event.causation_id.clone(),
        created_at: event.created_at.timestamp_millis(),
    }
}
