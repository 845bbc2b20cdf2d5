//! The `[defaults]` and `[plugin.<name>]` sections: a plugin's limits, grants, retry policy,
//! throttle and priority as the operator writes them, and their validation (every error names
//! the field). It must never resolve a plugin's effective policy: [`super::Config::policy_for`]
//! and its siblings do, with the defaults.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Size, Span, invalid};
use crate::dispatch::{Backoff, Jitter, RetryPolicy};
use crate::plugin::MAX_MEMORY_BYTES;
use crate::plugin::capability::transaction;

/// How failed attempts are retried.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    pub max_attempts: u32,
    pub initial_backoff: Span,
    pub max_backoff: Span,
    /// `fixed`, `linear` or `exponential` (the default).
    pub backoff: Backoff,
    /// `full` (the default: each pause drawn between nothing and its bound) or `none`.
    pub jitter: Jitter,
}

impl Default for RetryConfig {
    fn default() -> Self {
        let policy = RetryPolicy::default();
        Self {
            max_attempts: policy.max_attempts,
            initial_backoff: Span(policy.initial_backoff),
            max_backoff: Span(policy.max_backoff),
            backoff: policy.backoff,
            jitter: policy.jitter,
        }
    }
}

impl RetryConfig {
    /// The dispatcher's policy this describes.
    pub fn policy(&self) -> RetryPolicy {
        let Self { max_attempts, initial_backoff, max_backoff, backoff, jitter } = *self;
        RetryPolicy { max_attempts, initial_backoff: initial_backoff.0, max_backoff: max_backoff.0, backoff, jitter }
    }
}

/// At most `max` starts in any window of `per`, on each host.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RateConfig {
    pub max: usize,
    pub per: Span,
}

/// At most `max` starts in any window of `per` across all hosts, up to `burst` of them at
/// once (`max` unless given).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GlobalRateConfig {
    pub max: usize,
    pub per: Span,
    pub burst: Option<usize>,
}

/// Up to `limit` deliveries of one key at once, unordered, instead of one at a time in order;
/// the key is the event's, or the value at `key` (a JSON pointer) in its payload.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PerKeyConfig {
    pub limit: usize,
    pub key: Option<String>,
}

impl PerKeyConfig {
    /// What the dispatcher and the fan-out are told.
    pub fn key_limit(&self) -> crate::dispatch::KeyLimit {
        crate::dispatch::KeyLimit { limit: self.limit, key: crate::store::PerKey::from_pointer(self.key.as_deref()) }
    }
}

/// What the operator grants one plugin.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GrantsConfig {
    pub directory: Option<PathBuf>,
    pub environment: Vec<String>,
    pub http_hosts: Vec<String>,
    /// Whether the HTTP hosts may resolve to private, loopback or link-local addresses.
    pub private_networks: bool,
    pub collections: Vec<String>,
    /// Event types its follow-ups may have (`order.*` for a prefix).
    pub publish_types: Vec<String>,
    /// What its follow-ups' ids start with; `<plugin name>:` when absent.
    pub publish_id_prefix: Option<String>,
}

/// How one handler's deliveries are processed: what `[plugin.<name>.handler.<id>]` sets for
/// one handler of a plugin (absent fields come from its plugin, then `[defaults]`), and the
/// same fields of a plugin's own section.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Processing {
    pub retry: Option<RetryConfig>,
    pub concurrency_per_host: Option<usize>,
    pub rate_per_host: Option<RateConfig>,
    pub concurrency: Option<usize>,
    pub rate: Option<GlobalRateConfig>,
    pub priority: Option<i32>,
    pub priority_from: Option<String>,
    pub per_key: Option<PerKeyConfig>,
}

/// Limits and retry policy of one plugin; absent fields come from `[defaults]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PluginConfig {
    pub fuel: Option<u64>,
    pub memory: Option<Size>,
    pub wall_time: Option<Span>,
    pub output: Option<Size>,
    /// Longest failure reason kept from the plugin.
    pub reason: Option<Size>,
    /// Furthest ahead a plugin may put its retry.
    pub not_before_horizon: Option<Span>,
    /// The most handlers the plugin may subscribe.
    pub handlers: Option<usize>,
    /// Follow-up events one delivery may publish.
    pub follow_ups: Option<u32>,
    /// Most events descending from one application event through its follow-ups.
    pub descendants: Option<u32>,
    /// Largest payload of a follow-up event.
    pub follow_up_payload: Option<Size>,
    /// Deepest chain of follow-ups.
    pub chain_depth: Option<u32>,
    /// Most bytes one `find` may hand back.
    pub returned: Option<Size>,
    /// Re-runs of a transactional handler in one attempt after transient errors.
    pub reruns: Option<u32>,
    pub retry: Option<RetryConfig>,
    /// The most deliveries of each of its handlers one host holds at once (running or
    /// claimed ahead of a run slot).
    pub concurrency_per_host: Option<usize>,
    /// The most deliveries of each of its handlers one host starts in a window.
    pub rate_per_host: Option<RateConfig>,
    /// The most deliveries of each of its handlers held at once across all hosts.
    pub concurrency: Option<usize>,
    /// The most deliveries of each of its handlers started in a window across all hosts.
    pub rate: Option<GlobalRateConfig>,
    /// Of due deliveries, those of its handlers go before those of lower priorities.
    pub priority: Option<i32>,
    /// Where each delivery's priority among its handler's comes from: `event` (its event's
    /// `priority`) or a JSON pointer into the payload; absent, its handler's priority alone.
    pub priority_from: Option<String>,
    /// Several deliveries of one key at once, unordered (one at a time in order when absent).
    pub per_key: Option<PerKeyConfig>,
    pub grants: GrantsConfig,
    /// Processing settings of single handlers, by handler id (a plugin may export several).
    pub handler: std::collections::BTreeMap<String, Processing>,
}

impl PluginConfig {
    /// Its processing settings (those a handler may set for itself).
    pub fn processing(&self) -> Processing {
        Processing {
            retry: self.retry.clone(),
            concurrency_per_host: self.concurrency_per_host,
            rate_per_host: self.rate_per_host,
            concurrency: self.concurrency,
            rate: self.rate,
            priority: self.priority,
            priority_from: self.priority_from.clone(),
            per_key: self.per_key.clone(),
        }
    }
}

/// The longest failure reason an operator may let a plugin store: its dead letter repeats it,
/// and both must stay far below a document's 16 MiB.
const MAX_REASON_BYTES: usize = 64 * 1024;

/// How far ahead a plugin may be allowed to put its retry, at most.
const MAX_NOT_BEFORE_HORIZON: Duration = Duration::from_secs(365 * 24 * 3600);

pub(super) fn validate_plugin(section: &str, plugin: &PluginConfig) -> Result<(), ConfigError> {
    for (handler, processing) in &plugin.handler {
        if handler.is_empty() || handler.chars().any(char::is_control) {
            return Err(invalid(format!("{section}.handler"), format!("{handler:?} is not a handler id")));
        }
        // A handler's settings are checked as its plugin's same fields are.
        let Processing { retry, concurrency_per_host, rate_per_host, concurrency, rate, priority, priority_from, per_key } =
            processing.clone();
        let alone = PluginConfig {
            retry,
            concurrency_per_host,
            rate_per_host,
            concurrency,
            rate,
            priority,
            priority_from,
            per_key,
            ..PluginConfig::default()
        };
        validate_plugin(&format!("{section}.handler.{handler}"), &alone)?;
    }
    if plugin.fuel == Some(0) {
        return Err(invalid(format!("{section}.fuel"), "must be more than 0"));
    }
    if let Some(memory) = plugin.memory {
        if memory.0 < 1 << 20 || memory.0 > MAX_MEMORY_BYTES {
            return Err(invalid(format!("{section}.memory"), "must be between 1MiB and 1GiB"));
        }
    }
    if plugin.wall_time.is_some_and(|w| w.0.is_zero()) {
        return Err(invalid(format!("{section}.wall_time"), "must be more than 0s"));
    }
    if plugin.reason.is_some_and(|r| !(64..=MAX_REASON_BYTES).contains(&r.0)) {
        return Err(invalid(format!("{section}.reason"), "must be between 64B and 64KiB"));
    }
    if plugin.not_before_horizon.is_some_and(|h| h.0.is_zero() || h.0 > MAX_NOT_BEFORE_HORIZON) {
        return Err(invalid(format!("{section}.not_before_horizon"), "must be more than 0s and at most 365 days"));
    }
    let range = |field: &str, value: Option<u64>, min: u64, max: u64, shown: &str| match value {
        Some(value) if !(min..=max).contains(&value) => Err(invalid(format!("{section}.{field}"), format!("must be {shown}"))),
        _ => Ok(()),
    };
    range("handlers", plugin.handlers.map(|n| n as u64), 1, crate::plugin::MAX_HANDLERS_LIMIT as u64, "between 1 and 1000")?;
    range("follow_ups", plugin.follow_ups.map(u64::from), 0, 1_000, "between 0 and 1000")?;
    range("descendants", plugin.descendants.map(u64::from), 0, 1_000_000, "between 0 and 1000000")?;
    range("follow_up_payload", plugin.follow_up_payload.map(|s| s.0 as u64), 64, 4 << 20, "between 64B and 4MiB")?;
    range("chain_depth", plugin.chain_depth.map(u64::from), 0, 64, "between 0 and 64")?;
    range("returned", plugin.returned.map(|s| s.0 as u64), 1024, MAX_MEMORY_BYTES as u64, "between 1KiB and 1GiB")?;
    range("reruns", plugin.reruns.map(u64::from), 0, 100, "between 0 and 100")?;
    range("concurrency_per_host", plugin.concurrency_per_host.map(|n| n as u64), 1, 10_000, "between 1 and 10000")?;
    if plugin.priority.is_some_and(|priority| !(-1_000..=1_000).contains(&priority)) {
        return Err(invalid(format!("{section}.priority"), "must be between -1000 and 1000"));
    }
    range("concurrency", plugin.concurrency.map(|n| n as u64), 1, 100_000, "between 1 and 100000")?;
    if let Some(from) = &plugin.priority_from {
        if crate::store::PriorityFrom::parse(from).is_none() || from.len() > 256 || from.chars().any(char::is_control) {
            return Err(invalid(
                format!("{section}.priority_from"),
                "must be \"event\" or a JSON pointer into the payload, such as \"/urgency\" (at most 256 bytes)",
            ));
        }
    }
    if let Some(per_key) = &plugin.per_key {
        range("per_key.limit", Some(per_key.limit as u64), 1, 10_000, "between 1 and 10000")?;
        let pointer = per_key.key.as_deref().unwrap_or("/");
        if !pointer.starts_with('/') || pointer.len() > 256 || pointer.chars().any(char::is_control) {
            return Err(invalid(
                format!("{section}.per_key.key"),
                "must be a JSON pointer into the payload, such as \"/customer/id\" (at most 256 bytes)",
            ));
        }
    }
    if let Some(rate) = &plugin.rate {
        range("rate.max", Some(rate.max as u64), 1, 100_000, "between 1 and 100000")?;
        range("rate.burst", rate.burst.map(|n| n as u64), 1, 100_000, "between 1 and 100000")?;
        if rate.per.0 < Duration::from_millis(1) || rate.per.0 > Duration::from_secs(24 * 3600) {
            return Err(invalid(format!("{section}.rate.per"), "must be between 1ms and 24h"));
        }
    }
    if let Some(rate) = &plugin.rate_per_host {
        range("rate_per_host.max", Some(rate.max as u64), 1, 100_000, "between 1 and 100000")?;
        if rate.per.0 < Duration::from_millis(1) || rate.per.0 > Duration::from_secs(24 * 3600) {
            return Err(invalid(format!("{section}.rate_per_host.per"), "must be between 1ms and 24h"));
        }
    }
    if let Some(retry) = &plugin.retry {
        if retry.max_attempts == 0 {
            return Err(invalid(format!("{section}.retry.max_attempts"), "must be at least 1"));
        }
        if retry.initial_backoff.0 > retry.max_backoff.0 {
            return Err(invalid(format!("{section}.retry.initial_backoff"), "must not exceed retry.max_backoff"));
        }
    }
    for host in &plugin.grants.http_hosts {
        if host.is_empty() || host.contains(['/', '*', ' ']) {
            return Err(invalid(format!("{section}.grants.http_hosts"), format!("{host:?} is not a host or host:port")));
        }
    }
    for event_type in &plugin.grants.publish_types {
        let name = event_type.strip_suffix('*').unwrap_or(event_type);
        if event_type.is_empty() || name.contains('*') || event_type.len() > 256 || event_type.chars().any(char::is_control) {
            return Err(invalid(format!("{section}.grants.publish_types"), format!("{event_type:?} is not an event type or a prefix ending in *")));
        }
        if transaction::is_host_event_type(name) {
            return Err(invalid(format!("{section}.grants.publish_types"), format!("{event_type:?}: relayhost.* event types are the host's alone")));
        }
    }
    if let Some(prefix) = &plugin.grants.publish_id_prefix {
        if prefix.chars().count() > 128 || prefix.chars().any(char::is_control) {
            return Err(invalid(format!("{section}.grants.publish_id_prefix"), "must be at most 128 printable characters"));
        }
    }
    for collection in &plugin.grants.collections {
        if collection.is_empty() || collection.starts_with("system.") || collection.contains('$') {
            return Err(invalid(format!("{section}.grants.collections"), format!("{collection:?} is not a collection name")));
        }
    }
    if let Some(directory) = &plugin.grants.directory {
        if !directory.is_absolute() {
            return Err(invalid(format!("{section}.grants.directory"), "must be an absolute path"));
        }
    }
    Ok(())
}
