//! The host's configuration: one TOML file plus `RELAYHOST_*` environment overrides,
//! validated before anything starts.
//!
//! This module owns the file format and its validation; every error names the field. It must
//! never start anything: the binary reads a [`Config`] and builds the host from it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::dispatch::DispatcherOptions;

mod environment;
mod live;
mod plugin;
mod processing;
mod retention;
mod telemetry;

pub use live::{LiveConfig, Reloaded};
pub use plugin::{GrantsConfig, PluginConfig, Processing, RateConfig, RetryConfig};
pub use retention::{Keep, RetentionConfig};
pub use telemetry::TelemetryConfig;
use plugin::validate_plugin;
use crate::plugin::capability::{http, log, transaction};
use crate::plugin::{Grants, Limits, PluginPolicy};

/// Prefix of environment overrides: `RELAYHOST_MONGODB_URI`, `RELAYHOST_HOST_CONCURRENCY`, ...
pub const ENV_PREFIX: &str = "RELAYHOST_";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("`{field}`: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

/// A duration written as `250ms`, `30s`, `5m`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span(pub Duration);

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_duration(&text)
            .map(Span)
            .map_err(|e| serde::de::Error::custom(format!("{text:?} is not a duration like \"30s\" or \"250ms\": {e}")))
    }
}

/// A size written as `64MiB`, `512KiB`, `1GiB` or a number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub usize);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Bytes(n) => Ok(Size(n as usize)),
            Raw::Text(text) => parse_size(&text).map(Size).ok_or_else(|| {
                serde::de::Error::custom(format!("{text:?} is not a size like \"64MiB\" or \"512KiB\""))
            }),
        }
    }
}

fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: usize = number.parse().ok()?;
    let factor = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    number.checked_mul(factor)
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MongoConfig {
    /// `embedded` (a local single-node replica set the host starts and owns) or a URI.
    pub uri: String,
    pub database: String,
    pub collection_prefix: String,
    /// Where the embedded server keeps its data across restarts (default: a `data`
    /// directory in relayhost's cache).
    pub embedded_data_dir: Option<PathBuf>,
    /// Port of the embedded server; 0 picks a free one.
    pub embedded_port: u16,
    /// Address the embedded server listens on: loopback by default; `0.0.0.0` in a container
    /// whose publishers reach it through a published port.
    pub embedded_bind_ip: std::net::IpAddr,
}

impl Default for MongoConfig {
    fn default() -> Self {
        Self {
            uri: "embedded".into(),
            database: "relayhost".into(),
            collection_prefix: crate::publish::DEFAULT_PREFIX.into(),
            embedded_data_dir: None,
            embedded_port: 0,
            embedded_bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    /// Deliveries this host runs at once.
    pub concurrency: usize,
    /// Deliveries a claim may take beyond the free run slots, to wait for one (bigger, fewer
    /// claims under a backlog). 0 claims only what can start at once; absent, 4 per run slot.
    /// A host that dies charges an attempt to all it claimed, started or not.
    pub claim_ahead: Option<usize>,
    pub lease: Span,
    /// Claims happen at least this often; new events come sooner through the change stream.
    pub poll_interval: Span,
    /// How long a graceful stop waits for deliveries in flight.
    pub shutdown_timeout: Span,
    /// `plain` or `json`.
    pub log_format: String,
    pub completion_history: bool,
    /// Where compiled plugins are cached across restarts.
    pub artifact_cache: Option<PathBuf>,
    /// Address of the health, readiness and metrics endpoints (`/healthz`, `/readyz`,
    /// `/metrics`); none when absent.
    pub health_listen: Option<std::net::SocketAddr>,
}

impl HostConfig {
    /// `claim_ahead` as set, or its default for `concurrency`.
    pub fn claim_ahead_or_default(&self) -> usize {
        self.claim_ahead.unwrap_or(DispatcherOptions::default_claim_ahead(self.concurrency))
    }
}

impl Default for HostConfig {
    fn default() -> Self {
        let dispatch = DispatcherOptions::default();
        Self {
            concurrency: dispatch.concurrency,
            claim_ahead: None,
            lease: Span(dispatch.lease_duration),
            poll_interval: Span(Duration::from_secs(1)),
            shutdown_timeout: Span(dispatch.shutdown_timeout),
            log_format: "plain".into(),
            completion_history: false,
            artifact_cache: None,
            health_listen: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PluginsConfig {
    pub directory: PathBuf,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        Self { directory: PathBuf::from("plugins") }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub mongodb: MongoConfig,
    pub host: HostConfig,
    pub plugins: PluginsConfig,
    /// Limits and retry policy of plugins without their own (grants are never defaulted).
    pub defaults: PluginConfig,
    /// Per plugin, by file name without `.wasm`.
    pub plugin: BTreeMap<String, PluginConfig>,
    pub retention: RetentionConfig,
    pub admin: AdminConfig,
    pub telemetry: TelemetryConfig,
    /// A JSON Schema file per event type (`"order.placed" = "schemas/order-placed.json"`,
    /// relative to the configuration file's folder): payloads must match it.
    pub schemas: BTreeMap<String, PathBuf>,
}

/// A secret from the configuration: never printed, not even by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Secret)
    }
}

/// The admin API and dashboard (`[admin]`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Where they listen: loopback by default.
    pub listen: std::net::SocketAddr,
    /// The bearer token every request must carry (`RELAYHOST_ADMIN_TOKEN` sets it too); without
    /// one, the admin API is off.
    pub token: Option<Secret>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self { listen: std::net::SocketAddr::from(([127, 0, 0, 1], 8081)), token: None }
    }
}

impl Config {
    /// Reads `path` (if given), applies the environment, validates.
    pub fn load(path: Option<&Path>, environment: impl IntoIterator<Item = (String, String)>) -> Result<Self, ConfigError> {
        let (text, origin) = match path {
            Some(path) => (
                std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?,
                path.display().to_string(),
            ),
            None => (String::new(), "the default configuration".to_string()),
        };
        Self::read(&text, &origin, path.and_then(Path::parent), environment)
    }

    /// A configuration's `text` (from `origin`; its schema files relative to `folder`), with
    /// `environment` applied, validated.
    pub fn read(
        text: &str,
        origin: &str,
        folder: Option<&Path>,
        environment: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let environment: Vec<(String, String)> = environment.into_iter().collect();
        // Only then read through a table, whose errors cannot quote the file's lines.
        let mut config = if environment::overrides_processing(&environment) {
            let parse_error = |e: toml::de::Error| ConfigError::Parse { path: origin.to_string(), message: e.to_string() };
            let mut table: toml::Table = toml::from_str(text).map_err(parse_error)?;
            environment::apply_processing_environment(&mut table, &environment)?;
            toml::Value::Table(table).try_into().map_err(parse_error)?
        } else {
            Self::parse(text, origin)?
        };
        if let Some(folder) = folder {
            for file in config.schemas.values_mut().filter(|file| file.is_relative()) {
                *file = folder.join(&*file);
            }
        }
        config.apply_environment(environment)?;
        config.validate()?;
        Ok(config)
    }

    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse { path: origin.to_string(), message: e.to_string() })
    }

    /// The event types' schemas, read and compiled.
    pub fn event_schemas(&self) -> Result<crate::event_schema::Schemas, ConfigError> {
        crate::event_schema::Schemas::load(&self.schemas).map_err(|message| invalid("schemas", message))
    }

    /// Checks values serde cannot: ranges, names, combinations.
    pub fn validate(&self) -> Result<(), ConfigError> {
        crate::store::mongo::MongoLocation::new(&self.mongodb.database, &self.mongodb.collection_prefix).map_err(|e| {
            invalid("mongodb.database / mongodb.collection_prefix", e.to_string().trim_start_matches("invalid argument: "))
        })?;
        if self.mongodb.uri != "embedded" && !self.mongodb.uri.starts_with("mongodb://") && !self.mongodb.uri.starts_with("mongodb+srv://") {
            return Err(invalid("mongodb.uri", "must be \"embedded\" or a mongodb:// or mongodb+srv:// URI"));
        }
        if !self.mongodb.embedded_bind_ip.is_ipv4() {
            return Err(invalid("mongodb.embedded_bind_ip", "must be an IPv4 address (the embedded server also listens on 127.0.0.1)"));
        }
        if !(1..=10_000).contains(&self.host.concurrency) {
            return Err(invalid("host.concurrency", "must be between 1 and 10000"));
        }
        if self.host.claim_ahead.is_some_and(|ahead| ahead > 10_000) {
            return Err(invalid("host.claim_ahead", "must be at most 10000"));
        }
        if self.host.lease.0 < Duration::from_secs(1) {
            return Err(invalid("host.lease", "must be at least 1s"));
        }
        if self.host.poll_interval.0 < Duration::from_millis(10) {
            return Err(invalid("host.poll_interval", "must be at least 10ms"));
        }
        if let Some(Secret(token)) = &self.admin.token
            && (token.chars().count() < 16 || token.chars().any(|c| c.is_control() || c.is_whitespace()))
        {
            return Err(invalid("admin.token", "must be at least 16 characters, without spaces or control characters"));
        }
        self.event_schemas()?;
        if let Some(problem) = self.telemetry.problem() {
            return Err(invalid("telemetry", problem));
        }
        if !(0.01..=1.0).contains(&self.retention.pace) {
            return Err(invalid("retention.pace", "must be between 0.01 and 1 (the share of its time a purge works)"));
        }
        if self.retention.every.0 < Duration::from_secs(1) {
            return Err(invalid("retention.every", "must be at least 1s"));
        }
        if !matches!(self.host.log_format.as_str(), "plain" | "json") {
            return Err(invalid("host.log_format", "must be \"plain\" or \"json\""));
        }
        if self.defaults.grants != GrantsConfig::default() {
            return Err(invalid("defaults.grants", "grants are given per plugin, never by default"));
        }
        if !self.defaults.handler.is_empty() {
            return Err(invalid("defaults.handler", "handlers' own settings are given in their plugin's section"));
        }
        validate_plugin("defaults", &self.defaults)?;
        for (name, plugin) in &self.plugin {
            if name.is_empty() || name.starts_with('.') || name.contains(['/', '\\']) {
                return Err(invalid(format!("plugin.{name}"), "is not a plugin file name"));
            }
            validate_plugin(&format!("plugin.{name}"), plugin)?;
        }
        Ok(())
    }

    /// The effective limits and grants of a plugin.
    pub fn policy_for(&self, plugin: &str) -> PluginPolicy {
        let own = self.plugin.get(plugin);
        let defaults = Limits::default();
        let pick = |get: &dyn Fn(&PluginConfig) -> Option<u64>, fallback: u64| {
            own.and_then(get).or_else(|| get(&self.defaults)).unwrap_or(fallback)
        };
        let transaction_defaults = transaction::Limits::default();
        let limits = Limits {
            fuel: pick(&|p| p.fuel, defaults.fuel),
            memory_bytes: pick(&|p| p.memory.map(|s| s.0 as u64), defaults.memory_bytes as u64) as usize,
            wall_time: own
                .and_then(|p| p.wall_time)
                .or(self.defaults.wall_time)
                .map_or(defaults.wall_time, |s| s.0),
            log: log::Limits { output_bytes: pick(&|p| p.output.map(|s| s.0 as u64), defaults.log.output_bytes as u64) as usize },
            reason_bytes: pick(&|p| p.reason.map(|s| s.0 as u64), defaults.reason_bytes as u64) as usize,
            not_before_horizon: own
                .and_then(|p| p.not_before_horizon)
                .or(self.defaults.not_before_horizon)
                .map_or(defaults.not_before_horizon, |s| s.0),
            handlers: pick(&|p| p.handlers.map(|n| n as u64), defaults.handlers as u64) as usize,
            transaction: transaction::Limits {
                follow_ups: pick(&|p| p.follow_ups.map(u64::from), u64::from(transaction_defaults.follow_ups)) as u32,
                descendants: pick(&|p| p.descendants.map(u64::from), u64::from(transaction_defaults.descendants)) as u32,
                follow_up_payload_bytes: pick(
                    &|p| p.follow_up_payload.map(|s| s.0 as u64),
                    transaction_defaults.follow_up_payload_bytes as u64,
                ) as usize,
                chain_depth: pick(&|p| p.chain_depth.map(u64::from), u64::from(transaction_defaults.chain_depth)) as u32,
                returned_bytes: pick(&|p| p.returned.map(|s| s.0 as u64), transaction_defaults.returned_bytes as u64) as usize,
                reruns: pick(&|p| p.reruns.map(u64::from), u64::from(transaction_defaults.reruns)) as u32,
            },
        };
        let grants = own.map(|p| &p.grants).cloned().unwrap_or_default();
        PluginPolicy {
            limits,
            grants: Grants {
                read_only_directory: grants.directory,
                environment: grants.environment,
                http: http::Grant { hosts: grants.http_hosts, private_networks: grants.private_networks },
                transaction: transaction::Grant {
                    collections: grants.collections,
                    publish_types: grants.publish_types,
                    publish_id_prefix: grants.publish_id_prefix,
                },
            },
        }
    }

    /// The longest wall time any plugin may run: a transactional handler's transaction must
    /// be allowed to live that long, plus the completion.
    pub fn longest_wall_time(&self) -> Duration {
        let default = self.defaults.wall_time.map_or(Limits::default().wall_time, |s| s.0);
        self.plugin.values().filter_map(|p| p.wall_time.map(|s| s.0)).fold(default, Duration::max)
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a duration like \"30s\": {e}"))
}

#[cfg(test)]
mod tests;
