//! The configuration's unit tests: loading, validation (every error names its field), overrides.

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
