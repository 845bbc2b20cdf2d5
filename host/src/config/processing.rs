//! The effective processing settings of one handler: its own section
//! (`[plugin.<name>.handler.<id>]`), else its plugin's, else `[defaults]`', field by field
//! (one retry policy as a whole). It owns that resolution and nothing else: the sections and
//! their validation are `plugin.rs`'.

use super::Config;
use super::plugin::{Processing, RetryConfig};
use crate::dispatch::{RateLimit, Throttle};
use crate::store::limiter::GlobalRate;

impl Config {
    /// A processing setting of `handler` (of `plugin`): its own (`[plugin.<name>.handler.<id>]`),
    /// else its plugin's, else `[defaults]`'.
    fn processing<T>(&self, plugin: &str, handler: &str, get: impl Fn(&Processing) -> Option<T>) -> Option<T> {
        let own = self.plugin.get(plugin);
        own.and_then(|p| p.handler.get(handler))
            .and_then(&get)
            .or_else(|| own.and_then(|p| get(&p.processing())))
            .or_else(|| get(&self.defaults.processing()))
    }

    /// The effective throttle of `handler` of `plugin`: each field its own, its plugin's, or
    /// from `[defaults]`.
    pub fn throttle_for(&self, plugin: &str, handler: &str) -> Throttle {
        let rate = self.processing(plugin, handler, |p| p.rate_per_host);
        let global_rate = self.processing(plugin, handler, |p| p.rate);
        Throttle {
            concurrency: self.processing(plugin, handler, |p| p.concurrency_per_host),
            rate: rate.map(|rate| RateLimit { max: rate.max, per: rate.per.0 }),
            global_concurrency: self.processing(plugin, handler, |p| p.concurrency),
            global_rate: global_rate.map(|rate| GlobalRate {
                max: rate.max,
                per_ms: rate.per.0.as_millis() as i64,
                burst: rate.burst.unwrap_or(rate.max),
            }),
        }
    }

    /// How `handler` of `plugin` has its deliveries processed: its throttle, priority and
    /// `per_key`, each as resolved below (read once per handler where it is asked often).
    pub fn controls_for(&self, plugin: &str, handler: &str) -> crate::dispatch::Controls {
        crate::dispatch::Controls {
            throttle: self.throttle_for(plugin, handler),
            priority: self.priority_for(plugin, handler),
            priority_from: self.processing(plugin, handler, |p| p.priority_from.as_deref().and_then(crate::store::PriorityFrom::parse)),
            per_key: self.per_key_for(plugin, handler),
        }
    }

    /// How many deliveries of one key `handler` of `plugin` runs at once, and by which key
    /// (`None`: one at a time, in order): its own, its plugin's, or `[defaults]`' `per_key`.
    pub fn per_key_for(&self, plugin: &str, handler: &str) -> Option<crate::dispatch::KeyLimit> {
        self.processing(plugin, handler, |p| p.per_key.as_ref().map(super::plugin::PerKeyConfig::key_limit))
    }

    /// The effective priority of `handler` of `plugin`: its own, its plugin's, from
    /// `[defaults]`, or 0.
    pub fn priority_for(&self, plugin: &str, handler: &str) -> i32 {
        self.processing(plugin, handler, |p| p.priority).unwrap_or(0)
    }

    /// The effective retry policy of `handler` of `plugin` (the whole policy of the first
    /// that sets one: its own, its plugin's, `[defaults]`').
    pub fn retry_for(&self, plugin: &str, handler: &str) -> RetryConfig {
        self.processing(plugin, handler, |p| p.retry.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::load;

    #[test]
    fn a_handler_of_its_own_overrides_its_plugins_settings_field_by_field() {
        let config = load(
            "[defaults]\npriority = -1\n[plugin.mail]\nconcurrency_per_host = 4\nretry = { max_attempts = 3 }\n\
             [plugin.mail.handler.receipts]\nconcurrency = 2\npriority = 5\nretry = { max_attempts = 9 }\n\
             [plugin.mail.handler.digest]\nrate = { max = 1, per = \"1m\" }",
            &[],
        )
        .unwrap();
        let receipts = config.throttle_for("mail", "receipts");
        assert_eq!((receipts.concurrency, receipts.global_concurrency), (Some(4), Some(2)), "its own, and its plugin's");
        assert_eq!((config.priority_for("mail", "receipts"), config.retry_for("mail", "receipts").max_attempts), (5, 9));
        let digest = config.throttle_for("mail", "digest");
        assert_eq!((digest.concurrency, digest.global_concurrency, digest.global_rate.map(|r| r.max)), (Some(4), None, Some(1)));
        // A handler not named has its plugin's settings, then the defaults'.
        assert_eq!((config.priority_for("mail", "other"), config.retry_for("mail", "other").max_attempts), (-1, 3));
        // A handler's settings are checked as a plugin's, and named by where they are.
        let error = load("[plugin.mail.handler.receipts]\nconcurrency = 0", &[]).unwrap_err().to_string();
        assert!(error.contains("plugin.mail.handler.receipts.concurrency"), "{error}");
        let error = load("[plugin.mail.handler.receipts]\nfuel = 5", &[]).unwrap_err().to_string();
        assert!(error.contains("fuel"), "{error}");
        let error = load("[defaults.handler.receipts]\npriority = 1", &[]).unwrap_err().to_string();
        assert!(error.contains("defaults.handler"), "{error}");
    }

    #[test]
    fn per_key_is_read_as_a_limit_and_where_the_key_comes_from() {
        use crate::dispatch::KeyLimit;
        use crate::store::PerKey;
        let config = load(
            "[plugin.mail]\nper_key = { limit = 3 }\n[plugin.mail.handler.receipts]\nper_key = { limit = 2, key = \"/customer/id\" }",
            &[],
        )
        .unwrap();
        let receipts = KeyLimit { limit: 2, key: PerKey::Payload("/customer/id".to_string()) };
        assert_eq!(config.controls_for("mail", "receipts").per_key, Some(receipts));
        assert_eq!(config.per_key_for("mail", "digest"), Some(KeyLimit { limit: 3, key: PerKey::EventKey }));
        assert_eq!(config.per_key_for("other", "h"), None, "one at a time, in order, unless set");
    }

    #[test]
    fn priority_from_is_the_events_or_a_payload_field_inherited_like_the_rest() {
        use crate::store::PriorityFrom;
        let config = load("[defaults]\npriority_from = \"event\"\n[plugin.mail.handler.receipts]\npriority_from = \"/urgency\"", &[]).unwrap();
        assert_eq!(config.controls_for("mail", "receipts").priority_from, Some(PriorityFrom::Payload("/urgency".to_string())));
        assert_eq!(config.controls_for("mail", "digest").priority_from, Some(PriorityFrom::Event));
        assert_eq!(load("", &[]).unwrap().controls_for("mail", "digest").priority_from, None);
    }
}
