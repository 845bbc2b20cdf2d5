//! `RELAYHOST_*` environment overrides of the configuration's scalars: each variable applied
//! to its field, parsed and named in any error, every unknown one refused by name, but for the
//! variables Kubernetes gives containers beside a Service named `relayhost`. The sections' own
//! scalars are set on the [`Config`]; the processing settings (`[defaults]`, `[plugin.<name>]`,
//! `[plugin.<name>.handler.<id>]`) on the file's table before it is read, since those sections
//! may not be in the file at all. It only applies; the checks of the values are
//! `Config::validate`'s.

use super::*;

/// The scalars of `[defaults]` and `[plugin.<name>]` a variable may override.
const PLUGIN_SCALARS: &[&str] = &[
    "fuel",
    "memory",
    "wall_time",
    "output",
    "reason",
    "not_before_horizon",
    "handlers",
    "follow_ups",
    "descendants",
    "follow_up_payload",
    "chain_depth",
    "returned",
    "reruns",
    "concurrency_per_host",
    "concurrency",
    "priority",
    "priority_from",
];

/// The scalars of `[plugin.<name>.handler.<id>]` a variable may override.
const HANDLER_SCALARS: &[&str] = &["concurrency_per_host", "concurrency", "priority", "priority_from"];

/// Whether `key` (lower case, without the prefix) names a processing setting's override.
fn is_processing(key: &str) -> bool {
    key.starts_with("defaults_") || key.starts_with("plugin_")
}

/// Whether any of `environment` overrides a processing setting.
pub(super) fn overrides_processing(environment: &[(String, String)]) -> bool {
    environment.iter().any(|(name, _)| name.strip_prefix(ENV_PREFIX).is_some_and(|key| is_processing(&key.to_ascii_lowercase())))
}

/// Applies `RELAYHOST_DEFAULTS_<FIELD>`, `RELAYHOST_PLUGIN_<NAME>_<FIELD>` and
/// `RELAYHOST_PLUGIN_<NAME>_HANDLER_<ID>_<FIELD>` to `table` (the file's). `<NAME>` and `<ID>`
/// match a section of the file whatever their case and with `_` for `-`; without one, they
/// name it in lower case. Each value is read as TOML (`4`, `"30s"`, or a bare `30s`) and
/// checked as the field's; an unknown field is refused by the variable's name.
pub(super) fn apply_processing_environment(table: &mut toml::Table, environment: &[(String, String)]) -> Result<(), ConfigError> {
    for (name, value) in environment {
        let Some(key) = name.strip_prefix(ENV_PREFIX).map(str::to_ascii_lowercase) else { continue };
        if !is_processing(&key) {
            continue;
        }
        let unknown = || {
            invalid(
                name,
                "is not a configuration override relayhost knows (RELAYHOST_DEFAULTS_<FIELD>, RELAYHOST_PLUGIN_<NAME>_<FIELD>, \
                 RELAYHOST_PLUGIN_<NAME>_HANDLER_<ID>_<FIELD>)",
            )
        };
        let path: Vec<String> = match key.strip_prefix("defaults_") {
            Some(field) if PLUGIN_SCALARS.contains(&field) => vec!["defaults".into(), field.into()],
            Some(_) => return Err(unknown()),
            None => {
                let rest = &key["plugin_".len()..];
                match rest.split_once("_handler_") {
                    Some((plugin, handler_field)) => {
                        let (handler, field) = split_field(handler_field, HANDLER_SCALARS).ok_or_else(unknown)?;
                        let plugin = section_name(table.get("plugin"), plugin);
                        let handlers = table.get("plugin").and_then(|p| p.get(&plugin)).and_then(|p| p.get("handler"));
                        let handler = section_name(handlers, handler);
                        vec!["plugin".into(), plugin, "handler".into(), handler, field.into()]
                    }
                    None => {
                        let (plugin, field) = split_field(rest, PLUGIN_SCALARS).ok_or_else(unknown)?;
                        vec!["plugin".into(), section_name(table.get("plugin"), plugin), field.into()]
                    }
                }
            }
        };
        let value = scalar(path.last().expect("a field"), value).map_err(|message| invalid(name, message))?;
        set(table, &path, value).map_err(|message| invalid(name, message))?;
    }
    Ok(())
}

impl Config {
    /// `RELAYHOST_<SECTION>_<FIELD>` overrides a scalar field of `[mongodb]`, `[host]`,
    /// `[plugins]`, `[retention]`, `[admin]` or `[telemetry]` (the processing settings' were
    /// applied before, see [`apply_processing_environment`]); any other `RELAYHOST_*` variable
    /// is refused by name.
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
                // Applied to the file's table before it was read.
                key if is_processing(key) => {}
                key if is_kubernetes_service_link(key) => {}
                _ => return Err(invalid(&name, "is not a configuration override relayhost knows")),
            }
        }
        Ok(())
    }
}

/// `text` split into what comes before `_<field>` and the field: the longest of `fields` that
/// ends it.
fn split_field<'a>(text: &'a str, fields: &[&'static str]) -> Option<(&'a str, &'static str)> {
    fields
        .iter()
        .filter_map(|field| {
            let head = text.strip_suffix(field)?.strip_suffix('_')?;
            (!head.is_empty()).then_some((head, *field))
        })
        .max_by_key(|(_, field)| field.len())
}

/// The section among `sections` (a table of sections) that `wanted` names, in any case and with
/// `_` for `-`; `wanted` itself if none does.
fn section_name(sections: Option<&toml::Value>, wanted: &str) -> String {
    let normal = |name: &str| name.to_ascii_lowercase().replace('-', "_");
    sections
        .and_then(toml::Value::as_table)
        .and_then(|sections| sections.keys().find(|name| normal(name) == wanted).cloned())
        .unwrap_or_else(|| wanted.to_string())
}

/// `text` as the TOML value of `field` (a string if it is no TOML scalar), checked as the
/// field reads it.
fn scalar(field: &str, text: &str) -> Result<toml::Value, String> {
    let parsed = toml::from_str::<toml::Table>(&format!("v = {text}")).ok().and_then(|mut table| table.remove("v"));
    let value = parsed.filter(|value| !value.is_table() && !value.is_array()).unwrap_or_else(|| toml::Value::String(text.to_string()));
    let mut one = toml::Table::new();
    one.insert(field.to_string(), value.clone());
    toml::Value::Table(one).try_into::<PluginConfig>().map_err(|e| format!("{text:?}: {}", e.message()))?;
    Ok(value)
}

/// Sets `path` (sections, then the field) in `table`, making the sections that are missing.
fn set(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (field, sections) = path.split_last().expect("a field");
    let mut at = table;
    for section in sections {
        at = at
            .entry(section.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| format!("`{section}` is not a section in the file"))?;
    }
    at.insert(field.clone(), value);
    Ok(())
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


#[cfg(test)]
mod tests {
    use super::super::tests::load;
    use super::*;

    const FILE: &str = "[defaults]\nwall_time = \"10s\"\n\n[plugin.audit-log]\nconcurrency_per_host = 2\n\n\
                        [plugin.audit-log.handler.audit-log]\npriority = 1\n";

    #[test]
    fn processing_settings_are_overridden_per_plugin_and_handler_with_or_without_their_section() {
        let overrides = [
            ("RELAYHOST_DEFAULTS_WALL_TIME", "30s"),
            ("RELAYHOST_PLUGIN_AUDIT_LOG_CONCURRENCY_PER_HOST", "8"),
            ("RELAYHOST_PLUGIN_AUDIT_LOG_HANDLER_AUDIT_LOG_PRIORITY", "5"),
            ("RELAYHOST_PLUGIN_MAILER_CONCURRENCY", "3"),
            ("RELAYHOST_PLUGIN_MAILER_MEMORY", "\"64MiB\""),
            ("RELAYHOST_PLUGIN_MAILER_PRIORITY_FROM", "event"),
            ("RELAYHOST_PLUGIN_AUDIT_LOG_HANDLER_AUDIT_LOG_PRIORITY_FROM", "/urgency"),
            ("RELAYHOST_HOST_CONCURRENCY", "16"),
        ];
        let config = load(FILE, &overrides).unwrap();
        assert_eq!(config.defaults.wall_time.unwrap().0, Duration::from_secs(30));
        let audit = &config.plugin["audit-log"];
        assert_eq!(audit.concurrency_per_host, Some(8), "the file's section, named with `_` for `-`");
        assert_eq!(audit.handler["audit-log"].priority, Some(5));
        assert_eq!(config.plugin["mailer"].concurrency, Some(3), "a section the file does not have");
        assert_eq!(config.plugin["mailer"].memory.unwrap().0, 64 << 20);
        assert_eq!(config.host.concurrency, 16, "the sections' own overrides still apply");
        assert_eq!(config.priority_for("audit-log", "audit-log"), 5);
        let from = |plugin: &str, handler: &str| config.controls_for(plugin, handler).priority_from;
        assert_eq!(from("mailer", "m"), Some(crate::store::PriorityFrom::Event), "priority_from, not a plugin `mailer_priority`");
        assert_eq!(from("audit-log", "audit-log"), Some(crate::store::PriorityFrom::Payload("/urgency".to_string())));
    }

    #[test]
    fn a_bad_processing_override_is_refused_by_its_name() {
        for (name, value, said) in [
            ("RELAYHOST_PLUGIN_MAILER_CONCURENCY", "3", "is not a configuration override"),
            ("RELAYHOST_DEFAULTS_GRANTS", "x", "is not a configuration override"),
            ("RELAYHOST_PLUGIN_MAILER_HANDLER_X_FUEL", "3", "is not a configuration override"),
            ("RELAYHOST_PLUGIN_CONCURRENCY", "3", "is not a configuration override"),
            ("RELAYHOST_PLUGIN_MAILER_CONCURRENCY", "many", "\"many\""),
            ("RELAYHOST_DEFAULTS_WALL_TIME", "soon", "\"soon\""),
        ] {
            let error = load(FILE, &[(name, value)]).unwrap_err().to_string();
            assert!(error.contains(name) && error.contains(said), "{name}={value}: {error}");
        }
        // A value that reads well but breaks a range is named by its field, as in the file.
        let error = load(FILE, &[("RELAYHOST_PLUGIN_MAILER_CONCURRENCY_PER_HOST", "0")]).unwrap_err().to_string();
        assert!(error.contains("plugin.mailer.concurrency_per_host"), "{error}");
        let error = load(FILE, &[("RELAYHOST_DEFAULTS_PRIORITY_FROM", "urgency")]).unwrap_err().to_string();
        assert!(error.contains("defaults.priority_from"), "{error}");
    }
}
