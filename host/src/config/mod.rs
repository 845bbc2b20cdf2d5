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
mod tests {
    use super::*;
    use crate::dispatch::{RateLimit, Throttle};
    use crate::store::limiter::GlobalRate;

    const EXAMPLE: &str = r#"
        [mongodb]
        uri = "mongodb://db-1:27017,db-2:27017/?replicaSet=rs0"
        database = "shop"

        [host]
        concurrency = 64
        lease = "45s"

        [defaults]
        wall_time = "10s"
        retry = { max_attempts = 8, initial_backoff = "500ms", max_backoff = "2m" }

        [plugin.webhook]
        memory = "32MiB"
        grants = { environment = ["WEBHOOK_URL"], http_hosts = ["hooks.example.com"] }

        [plugin.audit_log]
        fuel = 500000000
        grants = { collections = ["audit_log"] }
    "#;

    pub(super) fn load(text: &str, environment: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::read(text, "relayhost.toml", None, environment.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn a_full_configuration_resolves_per_plugin() {
        let config = load(EXAMPLE, &[]).unwrap();
        assert_eq!(config.host.lease.0, Duration::from_secs(45));
        let webhook = config.policy_for("webhook");
        assert_eq!(webhook.limits.memory_bytes, 32 << 20);
        assert_eq!(webhook.limits.wall_time, Duration::from_secs(10), "from [defaults]");
        assert_eq!(webhook.grants.http.hosts, ["hooks.example.com"]);
        assert_eq!(config.policy_for("audit_log").limits.fuel, 500_000_000);
        assert_eq!(config.policy_for("audit_log").grants.transaction.collections, ["audit_log"]);
        let billing = load("[plugin.billing]\nfollow_ups = 3\nchain_depth = 2\nreturned = \"1MiB\"\nreruns = 1\n\
             grants = { publish_types = [\"invoice.*\"], publish_id_prefix = \"inv-\", private_networks = true }", &[])
        .unwrap()
        .policy_for("billing");
        let limits = &billing.limits.transaction;
        assert_eq!((limits.follow_ups, limits.chain_depth, limits.returned_bytes, limits.reruns), (3, 2, 1 << 20, 1));
        assert_eq!(billing.grants.transaction.publish_types, ["invoice.*"]);
        assert_eq!(billing.grants.transaction.id_prefix("billing"), "inv-");
        assert!(billing.grants.http.private_networks);
        // An unconfigured plugin gets the default limits and no grants at all.
        let stranger = config.policy_for("stranger");
        assert_eq!(stranger.grants, Grants::default());
        assert_eq!(stranger.limits.wall_time, Duration::from_secs(10));
        assert_eq!(config.retry_for("stranger", "h").max_attempts, 8);
        assert_eq!(Config::default().retry_for("x", "h"), RetryConfig::default());
        // Throttles: each field the plugin's own, or from [defaults]; none unless set.
        assert_eq!(config.throttle_for("webhook", "h"), Throttle::default());
        let throttled = load(
            "[defaults]\nconcurrency_per_host = 4\n[plugin.mailer]\nrate_per_host = { max = 10, per = \"1m\" }\n\
             [plugin.hook]\nconcurrency_per_host = 1\n[plugin.api]\nconcurrency = 64\nrate = { max = 100, per = \"1s\", burst = 20 }\n\
             [plugin.paced]\nrate = { max = 5, per = \"1m\" }",
            &[],
        )
        .unwrap();
        let ten_a_minute = Some(RateLimit { max: 10, per: Duration::from_secs(60) });
        assert_eq!(throttled.throttle_for("mailer", "h"), Throttle { concurrency: Some(4), rate: ten_a_minute, ..Default::default() });
        assert_eq!(throttled.throttle_for("hook", "h"), Throttle { concurrency: Some(1), ..Default::default() });
        assert_eq!(throttled.throttle_for("stranger", "h"), Throttle { concurrency: Some(4), ..Default::default() });
        let api = throttled.throttle_for("api", "h");
        assert_eq!((api.global_concurrency, api.global_rate), (Some(64), Some(GlobalRate { max: 100, per_ms: 1_000, burst: 20 })));
        // The burst is the rate's max unless given.
        assert_eq!(throttled.throttle_for("paced", "h").global_rate, Some(GlobalRate { max: 5, per_ms: 60_000, burst: 5 }));
        let prioritized = load("[defaults]\npriority = -1\n[plugin.urgent]\npriority = 10", &[]).unwrap();
        assert_eq!((prioritized.priority_for("urgent", "h"), prioritized.priority_for("other", "h")), (10, -1));
        assert_eq!(config.priority_for("webhook", "h"), 0);
    }

    #[test]
    fn a_retry_policy_names_its_backoff_and_jitter() {
        let config = load("[plugin.webhook]\nretry = { max_attempts = 3, backoff = \"linear\", jitter = \"none\" }\n", &[]).unwrap();
        let policy = config.retry_for("webhook", "h").policy();
        assert_eq!((policy.max_attempts, policy.backoff, policy.jitter), (3, crate::dispatch::Backoff::Linear, crate::dispatch::Jitter::None));
        let defaults = config.retry_for("other", "h").policy();
        assert_eq!((defaults.backoff, defaults.jitter), (crate::dispatch::Backoff::Exponential, crate::dispatch::Jitter::Full));
        let error = load("[plugin.webhook]\nretry = { backoff = \"quadratic\" }\n", &[]).unwrap_err().to_string();
        assert!(error.contains("quadratic") && error.contains("exponential"), "{error}");
    }

    #[test]
    fn the_environment_overrides_by_name_and_refuses_strangers() {
        let overrides = [("RELAYHOST_MONGODB_URI", "embedded"), ("RELAYHOST_HOST_CONCURRENCY", "8"), ("RELAYHOST_HOST_CLAIM_AHEAD", "0")];
        let config = load(EXAMPLE, &overrides).unwrap();
        assert_eq!(config.mongodb.uri, "embedded");
        assert_eq!(config.host.concurrency, 8);
        assert_eq!(config.host.claim_ahead_or_default(), 0);
        // Unset, it follows the run slots.
        let config = load(EXAMPLE, &[("RELAYHOST_HOST_CONCURRENCY", "8")]).unwrap();
        assert_eq!((config.host.claim_ahead, config.host.claim_ahead_or_default()), (None, 32));
        let error = load(EXAMPLE, &[("RELAYHOST_HOST_CONCURENCY", "8")]).unwrap_err().to_string();
        assert!(error.contains("RELAYHOST_HOST_CONCURENCY"), "{error}");
        // Beside a Kubernetes Service named `relayhost`, its variables are passed over; ours are
        // still checked.
        let kubernetes = [
            ("RELAYHOST_SERVICE_HOST", "10.0.0.7"),
            ("RELAYHOST_SERVICE_PORT", "8080"),
            ("RELAYHOST_SERVICE_PORT_HEALTH", "8080"),
            ("RELAYHOST_PORT", "tcp://10.0.0.7:8080"),
            ("RELAYHOST_PORT_8080_TCP", "tcp://10.0.0.7:8080"),
            ("RELAYHOST_PORT_8080_TCP_PROTO", "tcp"),
            ("RELAYHOST_PORT_8080_TCP_PORT", "8080"),
            ("RELAYHOST_PORT_8080_TCP_ADDR", "10.0.0.7"),
            ("RELAYHOST_HOST_CONCURRENCY", "8"),
        ];
        assert_eq!(load(EXAMPLE, &kubernetes).unwrap().host.concurrency, 8);
        for stranger in ["RELAYHOST_PORTS", "RELAYHOST_PORT_HTTP", "RELAYHOST_PORT_8080_TCP_HOST", "RELAYHOST_SERVICE_HOSTS", "RELAYHOST_SERVICE_PORT_"] {
            let error = load(EXAMPLE, &[(stranger, "1")]).unwrap_err().to_string();
            assert!(error.contains(stranger) && error.contains("is not a configuration override"), "{error}");
        }
        let error = load(EXAMPLE, &[("RELAYHOST_HOST_LEASE", "soon")]).unwrap_err().to_string();
        assert!(error.contains("RELAYHOST_HOST_LEASE") && error.contains("\"soon\""), "{error}");
        let container = load(EXAMPLE, &[("RELAYHOST_MONGODB_EMBEDDED_BIND_IP", "0.0.0.0"), ("RELAYHOST_MONGODB_EMBEDDED_PORT", "27017")]).unwrap();
        assert_eq!((container.mongodb.embedded_bind_ip.to_string(), container.mongodb.embedded_port), ("0.0.0.0".into(), 27017));
        let error = load(EXAMPLE, &[("RELAYHOST_MONGODB_EMBEDDED_BIND_IP", "everywhere")]).unwrap_err().to_string();
        assert!(error.contains("RELAYHOST_MONGODB_EMBEDDED_BIND_IP") && error.contains("\"everywhere\""), "{error}");
    }

    #[test]
    fn bad_configurations_name_the_field() {
        let cases = [
            ("[host]\nconcurency = 3", "concurency"),
            ("[mongodb]\nuri = \"postgres://x\"", "mongodb.uri"),
            ("[mongodb]\ndatabase = \"a.b\"", "mongodb.database"),
            ("[mongodb]\nembedded_bind_ip = \"::\"", "mongodb.embedded_bind_ip"),
            ("[host]\nlease = \"10 parsecs\"", "lease"),
            ("[host]\nlog_format = \"xml\"", "host.log_format"),
            ("[host]\nclaim_ahead = 20000", "host.claim_ahead"),
            ("[host]\nclaim_ahead = -1", "claim_ahead"),
            ("[plugin.x]\nmemory = \"2GiB\"", "plugin.x.memory"),
            ("[plugin.x]\nmemory = \"lots\"", "memory"),
            ("[plugin.x]\nretry = { max_attempts = 0 }", "plugin.x.retry.max_attempts"),
            ("[plugin.x]\nreason = \"1MiB\"", "plugin.x.reason"),
            ("[defaults]\nnot_before_horizon = \"0s\"", "defaults.not_before_horizon"),
            ("[plugin.x]\ngrants = { collections = [\"system.users\"] }", "plugin.x.grants.collections"),
            ("[plugin.x]\ngrants = { directory = \"relative\" }", "plugin.x.grants.directory"),
            ("[plugin.x]\ngrants = { everything = true }", "everything"),
            ("[defaults]\ngrants = { collections = [\"a\"] }", "defaults.grants"),
            ("[plugin.\"../evil\"]\nfuel = 1", "plugin.../evil"),
            ("[plugin.x]\nfollow_ups = 5000", "plugin.x.follow_ups"),
            ("[plugin.x]\ndescendants = 1000001", "plugin.x.descendants"),
            ("[retention]\npace = 0", "retention.pace"),
            ("[retention]\ncompleted = \"forever\"", "completed"),
            ("[admin]\ntoken = \"short\"", "admin.token"),
            ("[plugin.x]\nhandlers = 0", "plugin.x.handlers"),
            ("[defaults]\nfollow_up_payload = \"16MiB\"", "defaults.follow_up_payload"),
            ("[plugin.x]\nchain_depth = 65", "plugin.x.chain_depth"),
            ("[plugin.x]\nreturned = \"10B\"", "plugin.x.returned"),
            ("[plugin.x]\nreruns = 1000", "plugin.x.reruns"),
            ("[plugin.x]\ngrants = { publish_types = [\"relayhost.delivery.dead\"] }", "relayhost.* event types are the host's"),
            ("[plugin.x]\ngrants = { publish_types = [\"a*b\"] }", "plugin.x.grants.publish_types"),
            ("[plugin.x]\nconcurrency_per_host = 0", "plugin.x.concurrency_per_host"),
            ("[plugin.x]\npriority = 5000", "plugin.x.priority"),
            ("[plugin.x]\npriority = \"high\"", "priority"),
            ("[defaults]\nconcurrency_per_host = 20000", "defaults.concurrency_per_host"),
            ("[plugin.x]\nrate_per_host = { max = 0, per = \"1s\" }", "plugin.x.rate_per_host.max"),
            ("[plugin.x]\nrate_per_host = { max = 5, per = \"0s\" }", "plugin.x.rate_per_host.per"),
            ("[plugin.x]\nrate_per_host = { max = 5, per = \"2days\" }", "plugin.x.rate_per_host.per"),
            ("[plugin.x]\nrate_per_host = { max = 5 }", "per"),
            ("[plugin.x]\nrate_per_host = { max = 5, per = \"1s\", burst = 2 }", "burst"),
            ("[plugin.x]\nconcurrency = 0", "plugin.x.concurrency"),
            ("[plugin.x]\nrate = { max = 0, per = \"1s\" }", "plugin.x.rate.max"),
            ("[plugin.x]\nrate = { max = 5, per = \"1s\", burst = 0 }", "plugin.x.rate.burst"),
            ("[plugin.x]\nrate = { max = 5, per = \"3days\" }", "plugin.x.rate.per"),
            ("[plugin.x]\nper_key = { limit = 0 }", "plugin.x.per_key.limit"),
            ("[plugin.x]\npriority_from = \"payload\"", "plugin.x.priority_from"),
            ("[defaults]\npriority_from = 5", "priority_from"),
            ("[plugin.x.handler.h]\nper_key = { limit = 2, key = \"customer\" }", "plugin.x.handler.h.per_key.key"),
            ("[plugin.x]\nper_key = { limit = 2, by = \"/customer\" }", "by"),
        ];
        for (text, field) in cases {
            let error = load(text, &[]).unwrap_err().to_string();
            assert!(error.contains(field), "{text:?} gave {error:?}, which does not name {field:?}");
        }
    }

    #[test]
    fn sizes_and_durations_read_like_an_operator_writes_them() {
        assert_eq!(parse_size("64MiB"), Some(64 << 20));
        assert_eq!(parse_size("512 KiB"), Some(512 << 10));
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("1TB"), None);
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    }
}
