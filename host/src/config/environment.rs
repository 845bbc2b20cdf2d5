//! `RELAYHOST_*` environment overrides of the configuration's scalars: each variable applied
//! to its field, parsed and named in any error, every unknown one refused by name, but for the
//! variables Kubernetes gives containers beside a Service named `relayhost`. It only applies;
//! the checks of the values are `Config::validate`'s.

use super::*;

impl Config {
    /// `RELAYHOST_<SECTION>_<FIELD>` overrides a scalar field of `[mongodb]`, `[host]`,
    /// `[plugins]`, `[retention]`, `[admin]` or `[telemetry]`; any other `RELAYHOST_*` variable is refused by
    /// name.
    pub fn apply_environment(&mut self, environment: impl IntoIterator<Item = (String, String)>) -> Result<(), ConfigError> {
        for (name, value) in environment {
            let Some(key) = name.strip_prefix(ENV_PREFIX) else { continue };
            let key = key.to_ascii_lowercase();
            let parse_error = |message: String| invalid(&name, message);
            match key.as_str() {
                "mongodb_uri" => self.mongodb.uri = value,
                "mongodb_database" => self.mongodb.database = value,
                "mongodb_collection_prefix" => self.mongodb.collection_prefix = value,
                "mongodb_embedded_data_dir" => self.mongodb.embedded_data_dir = Some(value.into()),
                "mongodb_embedded_port" => {
                    self.mongodb.embedded_port = value.parse().map_err(|e| parse_error(format!("{value:?} is not a port: {e}")))?
                }
                "mongodb_embedded_bind_ip" => {
                    self.mongodb.embedded_bind_ip =
                        value.parse().map_err(|e| parse_error(format!("{value:?} is not an IP address like 0.0.0.0: {e}")))?
                }
                "host_concurrency" => {
                    self.host.concurrency = value.parse().map_err(|e| parse_error(format!("{value:?} is not a count: {e}")))?
                }
                "host_claim_ahead" => {
                    self.host.claim_ahead = Some(value.parse().map_err(|e| parse_error(format!("{value:?} is not a count: {e}")))?)
                }
                "host_lease" => self.host.lease = Span(parse_duration(&value).map_err(parse_error)?),
                "host_poll_interval" => self.host.poll_interval = Span(parse_duration(&value).map_err(parse_error)?),
                "host_health_listen" => {
                    self.host.health_listen =
                        Some(value.parse().map_err(|e| parse_error(format!("{value:?} is not an address like 0.0.0.0:8080: {e}")))?)
                }
                "host_shutdown_timeout" => self.host.shutdown_timeout = Span(parse_duration(&value).map_err(parse_error)?),
                "host_log_format" => self.host.log_format = value,
                "host_completion_history" => {
                    self.host.completion_history =
                        value.parse().map_err(|_| parse_error(format!("{value:?} is not true or false")))?
                }
                "host_artifact_cache" => self.host.artifact_cache = Some(value.into()),
                "plugins_directory" => self.plugins.directory = value.into(),
                "retention_completed" => self.retention.completed = Keep::parse(&value).map_err(parse_error)?,
                "retention_dead_letters" => self.retention.dead_letters = Keep::parse(&value).map_err(parse_error)?,
                "admin_token" => self.admin.token = Some(Secret(value)),
                "admin_listen" => {
                    self.admin.listen =
                        value.parse().map_err(|e| parse_error(format!("{value:?} is not an address like 127.0.0.1:8081: {e}")))?
                }
                "retention_every" => self.retention.every = Span(parse_duration(&value).map_err(parse_error)?),
                "telemetry_otlp_endpoint" => self.telemetry.otlp_endpoint = Some(value).filter(|v| !v.is_empty()),
                "telemetry_service_name" => self.telemetry.service_name = value,
                "telemetry_sample_ratio" => {
                    self.telemetry.sample_ratio = value.parse().map_err(|e| parse_error(format!("{value:?} is not a number: {e}")))?
                }
                // Read by other parts of relayhost, not configuration.
                "config" | "mongod" | "cache" | "pythonpath" => {}
                key if is_kubernetes_service_link(key) => {}
                _ => return Err(invalid(&name, "is not a configuration override relayhost knows")),
            }
        }
        Ok(())
    }
}

/// Whether `key` (a `RELAYHOST_*` variable's name without the prefix, lower case) is one of
/// those Kubernetes gives every container beside a Service named `relayhost`:
/// `RELAYHOST_SERVICE_HOST`, `RELAYHOST_SERVICE_PORT[_<name>]`, `RELAYHOST_PORT` and
/// `RELAYHOST_PORT_<port>_<protocol>[_PROTO|_PORT|_ADDR]`. No override of ours has their
/// shapes (`[service]` and `[port]` are no sections), so they are passed over and every other
/// name is still checked.
fn is_kubernetes_service_link(key: &str) -> bool {
    if key == "service_host" || key == "service_port" || key == "port" {
        return true;
    }
    if let Some(name) = key.strip_prefix("service_port_") {
        return !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    }
    let Some(rest) = key.strip_prefix("port_") else { return false };
    let mut parts = rest.split('_');
    let port = parts.next().is_some_and(|port| !port.is_empty() && port.chars().all(|c| c.is_ascii_digit()));
    let protocol = parts.next().is_some_and(|protocol| matches!(protocol, "tcp" | "udp" | "sctp"));
    let field = match parts.next() {
        None => true,
        Some(field) => matches!(field, "proto" | "port" | "addr") && parts.next().is_none(),
    };
    port && protocol && field
}

