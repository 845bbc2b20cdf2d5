//! What the operator allows a plugin: its limits and its grants, composed of each
//! capability's own (see [`super::capability`]). A plugin never sets these.

use std::time::Duration;

use super::capability::{directory, environment, http, log, transaction};

/// Per-delivery limits of one plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Deterministic CPU budget of one delivery, in wasmtime fuel units (about one per
    /// WebAssembly instruction).
    pub fuel: u64,
    /// Largest linear memory of one delivery's instance, in bytes.
    pub memory_bytes: usize,
    /// Wall-clock time of one delivery, host calls included.
    pub wall_time: Duration,
    /// Longest failure reason kept from the plugin, in bytes; a longer one is cut, saying so.
    /// The host stores it (`lastError`) and repeats it (the dead letter), so it must stay far
    /// below what a document may hold.
    pub reason_bytes: usize,
    /// Furthest ahead a plugin's `not-before` may put its retry; a later one is brought back
    /// to this.
    pub not_before_horizon: Duration,
    /// The most handlers the plugin may subscribe.
    pub handlers: usize,
    pub log: log::Limits,
    pub transaction: transaction::Limits,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            fuel: 2_000_000_000,
            memory_bytes: 64 * 1024 * 1024,
            wall_time: Duration::from_secs(30),
            reason_bytes: 4 * 1024,
            not_before_horizon: Duration::from_secs(7 * 24 * 3600),
            handlers: super::MAX_HANDLERS_PER_PLUGIN,
            log: log::Limits::default(),
            transaction: transaction::Limits::default(),
        }
    }
}

/// What a plugin may reach beyond its own memory. Empty by default: no files, no environment,
/// no HTTP, no collections, no follow-up events (and never sockets).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// A host directory the plugin may read, mounted read-only at `/data`.
    pub read_only_directory: directory::Grant,
    /// Environment variables passed through by name (their values come from the host).
    pub environment: environment::Grant,
    pub http: http::Grant,
    pub transaction: transaction::Grant,
}

/// Limits and grants of one plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginPolicy {
    pub limits: Limits,
    pub grants: Grants,
}
