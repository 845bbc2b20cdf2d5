//! Handlers as sandboxed WebAssembly components.
//!
//! This module owns the plugin contract's host side (`wit/relayhost.wit`): loading and
//! validating component files, the wasmtime engine and its per-delivery limits, the sandbox
//! and its grants, and the host capabilities (log, environment, directory, HTTP,
//! transaction; one unit each in [`capability`]) behind narrow interfaces the dispatcher
//! wires up. It must never know lanes, leases or outbox documents.

mod bindings;
mod bounds;
pub mod capability;
mod policy;
mod registry;
mod runtime;

pub use capability::transaction::{CapabilityFuture, TransactionCapability};
pub use policy::{Grants, Limits, PluginPolicy};
pub use registry::{Change, DEBOUNCE, PluginRegistry, WatchGuard};
pub use bounds::{MAX_EVENT_TYPES_PER_HANDLER, MAX_HANDLERS_LIMIT, MAX_HANDLERS_PER_PLUGIN, MAX_PLUGIN_FILE_BYTES, read_plugin_file};
pub use runtime::{
    DeliveryInfo, LoadedPlugin, LogLevel, MAX_MEMORY_BYTES, Outcome, PluginRuntime, Ran, RuntimeOptions, limit_allocator_arenas,
};

/// A handler a plugin offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub handler: String,
    pub event_types: Vec<String>,
    pub transactional: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("plugin {file} refused: {reason}")]
    Refused { file: String, reason: String },
    #[error("the WebAssembly engine could not start: {0}")]
    Engine(String),
}
