//! The `[telemetry]` section: where the host sends OpenTelemetry traces and metrics over
//! OTLP/HTTP, if anywhere (see [`crate::telemetry`]). It only describes; off by default.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP base address (`http://collector:4318`): spans go to
    /// `/v1/traces` under it, metrics to `/v1/metrics`. None (the default) exports nothing.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of what the host exports.
    pub service_name: String,
    /// Export a span per delivery attempt.
    pub traces: bool,
    /// Export the delivery metrics (those `/metrics` shows per handler) too.
    pub metrics: bool,
    /// The share of traces started here that are recorded (0 to 1); an event whose publisher
    /// sampled its trace, or did not, is followed as its `traceparent` says.
    pub sample_ratio: f64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self { otlp_endpoint: None, service_name: "relayhost".into(), traces: true, metrics: true, sample_ratio: 1.0 }
    }
}

impl TelemetryConfig {
    /// What is wrong with it, if anything.
    pub fn problem(&self) -> Option<String> {
        if let Some(endpoint) = &self.otlp_endpoint {
            match endpoint.parse::<http::Uri>() {
                Ok(uri) if matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some() => {}
                Ok(_) => return Some(format!("otlp_endpoint {endpoint:?} is not an http:// or https:// address with a host")),
                Err(error) => return Some(format!("otlp_endpoint {endpoint:?} is not an address: {error}")),
            }
            if uri_has_query(endpoint) {
                return Some(format!("otlp_endpoint {endpoint:?} has a query; give the collector's base address"));
            }
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Some(format!("sample_ratio {} is not between 0 and 1", self.sample_ratio));
        }
        if self.service_name.trim().is_empty() {
            return Some("service_name is empty".into());
        }
        None
    }

    /// Where spans go, when traces are exported.
    pub fn traces_endpoint(&self) -> Option<String> {
        self.otlp_endpoint.as_deref().filter(|_| self.traces).map(|base| signal_endpoint(base, "traces"))
    }

    /// Where metrics go, when they are exported.
    pub fn metrics_endpoint(&self) -> Option<String> {
        self.otlp_endpoint.as_deref().filter(|_| self.metrics).map(|base| signal_endpoint(base, "metrics"))
    }
}

fn uri_has_query(endpoint: &str) -> bool {
    endpoint.contains('?')
}

/// `base` with `/v1/<signal>` appended, as OTLP/HTTP's `OTEL_EXPORTER_OTLP_ENDPOINT` is.
fn signal_endpoint(base: &str, signal: &str) -> String {
    format!("{}/v1/{signal}", base.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_the_base_with_each_signals_path() {
        let config = TelemetryConfig { otlp_endpoint: Some("http://127.0.0.1:4318/".into()), ..TelemetryConfig::default() };
        assert_eq!(config.problem(), None);
        assert_eq!(config.traces_endpoint().as_deref(), Some("http://127.0.0.1:4318/v1/traces"));
        assert_eq!(config.metrics_endpoint().as_deref(), Some("http://127.0.0.1:4318/v1/metrics"));
        let no_metrics = TelemetryConfig { metrics: false, ..config };
        assert_eq!(no_metrics.metrics_endpoint(), None);
        assert_eq!(TelemetryConfig::default().traces_endpoint(), None, "off by default");
    }

    #[test]
    fn bad_settings_are_named() {
        for (endpoint, expected) in [
            ("collector:4318", "is not an http:// or https:// address"),
            ("ftp://collector", "is not an http:// or https:// address"),
            ("http://collector:4318?x=1", "has a query"),
            ("http://exa mple", "is not an address"),
        ] {
            let config = TelemetryConfig { otlp_endpoint: Some(endpoint.into()), ..TelemetryConfig::default() };
            let problem = config.problem().unwrap_or_default();
            assert!(problem.contains(expected), "{endpoint}: {problem}");
        }
        let config = TelemetryConfig { sample_ratio: 1.5, ..TelemetryConfig::default() };
        assert!(config.problem().unwrap().contains("sample_ratio 1.5"));
    }
}
