//! What the operator allows a plugin: its limits and its grants. A plugin never sets these.

use std::path::PathBuf;
use std::time::Duration;

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
    /// Log lines plus stdout/stderr kept per delivery, in bytes; the rest is dropped.
    pub output_bytes: usize,
    /// Longest failure reason kept from the plugin, in bytes; a longer one is cut, saying so.
    /// The host stores it (`lastError`) and repeats it (the dead letter), so it must stay far
    /// below what a document may hold.
    pub reason_bytes: usize,
    /// Furthest ahead a plugin's `not-before` may put its retry; a later one is brought back
    /// to this.
    pub not_before_horizon: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            fuel: 2_000_000_000,
            memory_bytes: 64 * 1024 * 1024,
            wall_time: Duration::from_secs(30),
            output_bytes: 64 * 1024,
            reason_bytes: 4 * 1024,
            not_before_horizon: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// What a plugin may reach beyond its own memory. Empty by default: no files, no environment,
/// no sockets, no HTTP, no collections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// A host directory the plugin may read, mounted read-only at `/data`.
    pub read_only_directory: Option<PathBuf>,
    /// Environment variables passed through by name (their values come from the host).
    pub environment: Vec<String>,
    /// `host` or `host:port` authorities the plugin may send HTTP requests to.
    pub http_hosts: Vec<String>,
    /// Collections the transaction capability may read and write.
    pub collections: Vec<String>,
}

impl Grants {
    /// Whether a request to `host` on `port` is granted; `port` is the one the request names,
    /// or its scheme's default (`default_port`). A grant without a port allows the scheme's
    /// default port only.
    pub(crate) fn allows_http(&self, host: &str, port: Option<u16>, default_port: u16) -> bool {
        let port = port.unwrap_or(default_port);
        self.http_hosts.iter().any(|granted| match granted.rsplit_once(':') {
            Some((granted_host, granted_port)) if granted_port.parse::<u16>().is_ok() => {
                granted_host.eq_ignore_ascii_case(host) && granted_port.parse::<u16>() == Ok(port)
            }
            _ => granted.eq_ignore_ascii_case(host) && port == default_port,
        })
    }

    pub(crate) fn allows_collection(&self, collection: &str) -> bool {
        self.collections.iter().any(|granted| granted == collection)
    }
}

/// Limits and grants of one plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginPolicy {
    pub limits: Limits,
    pub grants: Grants,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_grants_match_host_and_port_and_a_grant_without_port_means_the_default_one() {
        let grants = Grants { http_hosts: vec!["api.example.com".into(), "127.0.0.1:8080".into()], ..Default::default() };
        assert!(grants.allows_http("api.example.com", Some(443), 443));
        assert!(grants.allows_http("API.example.com", None, 443));
        assert!(grants.allows_http("api.example.com", None, 80));
        assert!(!grants.allows_http("api.example.com", Some(8443), 443), "no port granted: not every port");
        assert!(!grants.allows_http("api.example.com", Some(22), 80));
        assert!(grants.allows_http("127.0.0.1", Some(8080), 80));
        assert!(!grants.allows_http("127.0.0.1", Some(8081), 80));
        assert!(!grants.allows_http("127.0.0.1", None, 80));
        assert!(!grants.allows_http("evil.example.com", Some(443), 443));
        assert!(!grants.allows_http("api.example.com.evil", None, 443));
    }
}
