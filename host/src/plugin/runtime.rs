//! The plugin runtime: one wasmtime engine for the process, components compiled once (and
//! cached on disk by content hash and engine), one sandboxed instance per delivery from a
//! pre-instantiated template, with fuel, memory, wall-clock and output limits.
//!
//! It knows components, grants and limits; it must never know lanes, leases or documents
//! of the outbox: the dispatcher hands it an event and gets an outcome back.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ResourceLimiter, Store, Trap};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpView};

use super::bindings;
use super::bindings::relayhost::plugin::types;
use super::bounds::{cut, read_plugin_file, validate_subscriptions};
use super::capability::http::GrantedHosts;
use super::capability::http::recording::Recording;
use super::capability::log::{Output, Source};
use super::capability::transaction::{TransactionCapability, TransactionState};
use super::capability::{directory, environment, http, log};
use super::{PluginError, PluginPolicy, Subscription};
use crate::event::EventRecord;

pub use super::bindings::relayhost::plugin::log::Level as LogLevel;

/// Milliseconds between epoch ticks: the resolution of the wall-clock limit.
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Fuel a busy plugin may burn between two yields to the async runtime.
const FUEL_YIELD_INTERVAL: u64 = 100_000;
/// Concurrent instances the pooling allocator has slots for.
const INSTANCE_SLOTS: u32 = 256;
/// Longest a plugin's `subscriptions` may take (or its wall time, if shorter): it runs at
/// every load, and a slow one would hold up the scan that loads the others.
const SUBSCRIPTIONS_WALL_TIME: Duration = Duration::from_secs(2);
/// Linear memory a reused instance slot keeps resident between deliveries.
const KEEP_RESIDENT_BYTES: usize = 8 * 1024 * 1024;
/// Largest memory any plugin may be granted.
pub const MAX_MEMORY_BYTES: usize = 1 << 30;

/// What the host keeps per delivery inside the wasmtime store: WASI (with the environment
/// and directory capabilities in it) and each capability's per-instance state.
pub(crate) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    http: WasiHttpCtx,
    http_hosts: GrantedHosts,
    limiter: MemoryLimiter,
    output: Output,
    transaction: TransactionState,
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
    /// The largest linear memory it allowed: the delivery's peak.
    peak: usize,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let allowed = desired <= self.max_bytes;
        self.refused |= !allowed;
        if allowed {
            self.peak = self.peak.max(desired);
        }
        Ok(allowed)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

impl types::Host for HostState {}

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

/// One delivery's run: its outcome, what became of the plugin's output, and what it cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ran {
    pub outcome: Outcome,
    /// Bytes of log lines and stdout/stderr routed to the host's logs.
    pub output_kept: usize,
    /// Bytes dropped over the plugin's output budget.
    pub output_dropped: usize,
    /// From its instance's creation to its outcome.
    pub elapsed: Duration,
    /// Fuel it burned (`None` when the runtime meters none).
    pub fuel_consumed: Option<u64>,
    /// The largest its linear memory grew to.
    pub peak_memory_bytes: usize,
    /// The log lines it routed (`LEVEL text`), kept only while it is tried (a runtime that
    /// records, see [`RuntimeOptions::recording`]).
    pub log: Vec<String>,
}

/// What the dispatcher tells a plugin about one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryInfo {
    pub handler: String,
    pub attempt: u32,
    pub max_attempts: u32,
    /// Milliseconds since the Unix epoch.
    pub deadline: i64,
    /// The W3C trace context headers (`traceparent`, `tracestate`) its follow-up events carry
    /// on, unless the plugin sets its own.
    pub trace_context: Vec<(String, String)>,
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
    recording: Option<Recording>,
}

/// How to build the engine.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Where compiled artifacts are kept across restarts.
    pub cache_dir: Option<PathBuf>,
    /// Count fuel (the deterministic CPU budget of `Limits::fuel`). Without it only the
    /// wall-clock limit stops a busy plugin; the benchmarks use this to price metering.
    pub meter_fuel: bool,
    /// Record plugins' HTTP requests and answer them from fixtures instead of sending them
    /// (a plugin tried, not deployed; see [`Recording`]).
    pub recording: Option<Recording>,
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
        Self::with_options(RuntimeOptions { cache_dir, meter_fuel: true, recording: None })
    }

    pub fn with_options(options: RuntimeOptions) -> Result<Self, PluginError> {
        let RuntimeOptions { cache_dir, meter_fuel, recording } = options;
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

        let mut linker: Linker<HostState> = Linker::new(&engine);
        let linked = (|| {
            wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
            types::add_to_linker::<_, HasSelf<_>>(&mut linker, |state| state)?;
            log::link(&mut linker, |state| &mut state.output)?;
            http::link(&mut linker)?;
            super::capability::transaction::link(&mut linker, |state| &mut state.transaction)
        })();
        linked.map_err(|e| PluginError::Engine(e.to_string()))?;

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
        Ok(Self { engine, linker, cache_dir, stop_ticker, meter_fuel, recording })
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
        let component = tokio::task::spawn_blocking(move || {
            let compiled = compile(&engine, cache_dir.as_deref(), &bytes, &hash);
            drop(bytes);
            release_freed_heap();
            compiled
        })
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
        let (mut store, output) = self.store(plugin, None, None);
        let call = async {
            let instance = plugin.pre.instantiate_async(&mut store).await?;
            instance.relayhost_plugin_handler().call_subscriptions(&mut store).await
        };
        let wall_time = plugin.policy.limits.wall_time.min(SUBSCRIPTIONS_WALL_TIME);
        let result = tokio::time::timeout(wall_time, call).await;
        log::route(&plugin.name, plugin.short_hash(), &output);
        let subscriptions = match result {
            Ok(Ok(subscriptions)) => subscriptions,
            Ok(Err(error)) => return Err(format!("its `subscriptions` failed: {}", describe_trap(&error, &store))),
            Err(_) => return Err(format!("its `subscriptions` took longer than {wall_time:?}")),
        };
        let subscriptions = subscriptions.into_iter().map(|s| Subscription {
            handler: s.handler,
            event_types: s.event_types,
            transactional: s.transactional,
        });
        validate_subscriptions(subscriptions.collect(), plugin.policy.limits.handlers)
    }

    /// One instance's store: every capability prepared from the plugin's policy, for `event`
    /// (none while listing subscriptions), with the transaction `backend` if transactional.
    fn store(
        &self,
        plugin: &LoadedPlugin,
        event: Option<(&EventRecord, &[(String, String)])>,
        backend: Option<Box<dyn TransactionCapability>>,
    ) -> (Store<HostState>, Output) {
        let policy = plugin.policy.clone();
        let (grants, limits) = (&policy.grants, &policy.limits);
        let mut wasi = WasiCtxBuilder::new();
        // Sockets are no capability at all: outgoing HTTP goes through `wasi:http`.
        wasi.allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .socket_addr_check(|_, _| Box::pin(async { false }));
        let output = log::prepare(&limits.log, &mut wasi);
        environment::prepare(&grants.environment, &mut wasi);
        directory::prepare(&plugin.name, &grants.read_only_directory, &mut wasi);
        let state = HostState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            http: WasiHttpCtx::new(),
            http_hosts: GrantedHosts::prepare(
                plugin.name.clone(),
                &grants.http,
                self.recording.clone(),
                event.map_or(&[], |(_, trace_context)| trace_context),
            ),
            limiter: MemoryLimiter { max_bytes: limits.memory_bytes.min(MAX_MEMORY_BYTES), refused: false, peak: 0 },
            output: output.clone(),
            transaction: TransactionState::prepare(plugin.name.clone(), &grants.transaction, &limits.transaction, event, backend),
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

    /// Runs one delivery of a handler that is not transactional in a fresh instance.
    pub async fn invoke(&self, plugin: &LoadedPlugin, event: &EventRecord, delivery: &DeliveryInfo) -> Ran {
        self.run(plugin, event, delivery, None).await.0
    }

    /// Runs one delivery of a transactional handler and hands its transaction backend back,
    /// for the caller to commit (on [`Outcome::Completed`]) or abort.
    pub async fn invoke_transactional(
        &self,
        plugin: &LoadedPlugin,
        event: &EventRecord,
        delivery: &DeliveryInfo,
        backend: Box<dyn TransactionCapability>,
    ) -> (Ran, Option<Box<dyn TransactionCapability>>) {
        self.run(plugin, event, delivery, Some(backend)).await
    }

    async fn run(
        &self,
        plugin: &LoadedPlugin,
        event: &EventRecord,
        delivery: &DeliveryInfo,
        backend: Option<Box<dyn TransactionCapability>>,
    ) -> (Ran, Option<Box<dyn TransactionCapability>>) {
        let started = Instant::now();
        if !Engine::same(&self.engine, plugin.pre.engine()) {
            let outcome = Outcome::Failed("the plugin was loaded by another runtime".into());
            let ran = Ran {
                outcome,
                output_kept: 0,
                output_dropped: 0,
                elapsed: started.elapsed(),
                fuel_consumed: None,
                peak_memory_bytes: 0,
                log: Vec::new(),
            };
            return (ran, backend);
        }
        let (mut store, output) = self.store(plugin, Some((event, &delivery.trace_context)), backend);
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
        let (output_kept, output_dropped, log) = log::route_keeping(&plugin.name, plugin.short_hash(), &output, self.recording.is_some());
        let backend = store.data_mut().transaction.take_backend();
        // A quick plugin may finish without ever yielding; let a caller running deliveries
        // back to back still share the thread with other tasks.
        tokio::task::consume_budget().await;
        tracing::debug!(plugin = %plugin.name, version = plugin.short_hash(), handler = %delivery.handler, event = %event.id,
            elapsed_us = started.elapsed().as_micros() as u64, ?outcome, "delivery ran");
        let fuel_consumed = self.meter_fuel.then(|| plugin.policy.limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0)));
        let peak_memory_bytes = store.data().limiter.peak;
        (Ran { outcome, output_kept, output_dropped, elapsed: started.elapsed(), fuel_consumed, peak_memory_bytes, log }, backend)
    }
}

/// Compiles a component, or loads it from the artifact cache of this engine.
fn compile(engine: &Engine, cache_dir: Option<&Path>, bytes: &[u8], content_hash: &str) -> Result<Component, String> {
    let cached = cache_dir.map(|dir| dir.join(engine_fingerprint(engine)).join(format!("{content_hash}.cwasm")));
    if let Some(path) = &cached {
        if path.exists() {
            match map_private_copy(engine, path) {
                Ok(component) => return Ok(component),
                Err(error) => tracing::warn!(%error, path = %path.display(), "ignoring an unusable compiled artifact"),
            }
        }
    }
    let component = Component::new(engine, bytes).map_err(|e| format!("it is not a valid WebAssembly component: {}", root_cause(&e)))?;
    if let Some(path) = cached {
        if let Err(error) = write_artifact(&path, &component) {
            tracing::warn!(%error, path = %path.display(), "cannot cache the compiled plugin");
        } else if let Ok(mapped) = map_private_copy(engine, &path) {
            // The compiled copy's memory goes with it.
            return Ok(mapped);
        }
    }
    Ok(component)
}

/// Loads an artifact mapped from a private copy of its file, unlinked once mapped. Mapped, the
/// compiled code is resident only where it runs (an interpreter's is mostly never touched:
/// docs/performance.md), and the kernel may drop its clean pages under pressure; the copy has
/// no name left, so nothing can change or truncate a file under the mapping (which would kill
/// the host with SIGBUS), whatever happens to the cache.
fn map_private_copy(engine: &Engine, artifact: &Path) -> wasmtime::Result<Component> {
    static COPIES: AtomicU64 = AtomicU64::new(0);
    let copy = artifact.with_extension(format!("mapped.{}.{}", std::process::id(), COPIES.fetch_add(1, Ordering::Relaxed)));
    std::fs::copy(artifact, &copy)?;
    // SAFETY: the artifact was written by `Component::serialize` of an engine with the same
    // compatibility hash, into a directory only relayhost writes; wasmtime checks its header
    // and refuses foreign or truncated artifacts. The file mapped is this call's own copy.
    let component = unsafe { Component::deserialize_file(engine, &copy) };
    let _ = std::fs::remove_file(&copy);
    component
}

/// Caps the allocator's arenas at two per core (at least four; glibc's default is eight per
/// core). Each thread that compiles or loads a plugin would otherwise get an arena of its own
/// and keep what the load left there: an idle host with eight Rust plugins, a Python and a
/// JavaScript one held 194-214 MB resident with the default and 163-189 MB (six runs) with
/// four arenas on two cores, the no-op plugin's overhead within its spread (two arenas: 145 MB,
/// but 10 us more per delivery from threads contending for them); `cargo bench --bench plugin`
/// measures it. A process-wide setting: the binary calls it first, before its threads start.
pub fn limit_allocator_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let arenas = (2 * cores).max(4).min(i32::MAX as usize) as i32;
        // SAFETY: mallopt only changes a limit the allocator reads when it creates an arena.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, arenas);
        }
    }
}

/// Gives the heap pages freed since back to the system. Compiling (or deserializing) a large
/// component frees hundreds of megabytes that glibc's allocator would otherwise keep: an idle
/// host with eight Rust plugins, a Python and a JavaScript one stayed at 489 MB resident
/// without this, 229 MB with it (`cargo bench --bench plugin`). At load time only, never per
/// delivery (it walks the allocator's arenas).
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only hands free pages of the allocator's own arenas back to the
    // system; it frees nothing in use.
    unsafe {
        libc::malloc_trim(0);
    }
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
