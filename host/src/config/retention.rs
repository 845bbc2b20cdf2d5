//! The `[retention]` section: how long what the outbox no longer needs is kept, and how often
//! one of the hosts purges it (see `service::retention`). It only describes; the purge is the
//! store's, the schedule the service's.

use std::time::Duration;

use bson::DateTime;
use serde::Deserialize;

use super::Span;
use crate::store::PurgeOptions;

/// How long something is kept: `"off"` keeps it, a duration (`"7d"`) keeps it that long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    Forever,
    For(Duration),
}

impl Keep {
    /// Parses `off` or a duration.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().eq_ignore_ascii_case("off") {
            return Ok(Self::Forever);
        }
        humantime::parse_duration(text)
            .map(Self::For)
            .map_err(|e| format!("{text:?} is neither \"off\" nor a duration like \"7d\" or \"12h\": {e}"))
    }

    /// The cutoff at `now`: what is older goes.
    pub fn cutoff(self, now: DateTime) -> Option<DateTime> {
        match self {
            Self::Forever => None,
            Self::For(age) => Some(DateTime::from_millis(now.timestamp_millis().saturating_sub(age.as_millis() as i64))),
        }
    }
}

impl<'de> Deserialize<'de> for Keep {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Self::parse(&String::deserialize(deserializer)?).map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Completed events (and their completion history) after their last completion. An event
    /// is the deduplication record of its id until then: a publish of the same id within this
    /// window writes nothing.
    pub completed: Keep,
    /// Dead deliveries after their last change (their events with them, once nothing else
    /// refers to them).
    pub dead_letters: Keep,
    /// How often one of the hosts purges (the others skip that turn).
    pub every: Span,
    /// The share of its time a purge works, resting between its steps (0.01 to 1; 1 is flat
    /// out), so that deliveries and publishers keep the server's rest.
    pub pace: f64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            completed: Keep::For(Duration::from_secs(7 * 24 * 3600)),
            dead_letters: Keep::For(Duration::from_secs(30 * 24 * 3600)),
            every: Span(Duration::from_secs(600)),
            pace: 0.25,
        }
    }
}

impl RetentionConfig {
    /// What a purge at `now` deletes.
    pub fn purge_options(&self, now: DateTime) -> PurgeOptions {
        PurgeOptions { dead_before: self.dead_letters.cutoff(now), completed_before: self.completed.cutoff(now) }
    }

    /// Whether it purges anything at all.
    pub fn purges(&self) -> bool {
        self.completed != Keep::Forever || self.dead_letters != Keep::Forever
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_keeps_and_a_duration_sets_the_cutoff() {
        assert_eq!(Keep::parse("off").unwrap(), Keep::Forever);
        assert_eq!(Keep::parse("OFF").unwrap().cutoff(DateTime::from_millis(10_000)), None);
        assert_eq!(Keep::parse("2s").unwrap().cutoff(DateTime::from_millis(10_000)), Some(DateTime::from_millis(8_000)));
        assert!(Keep::parse("forever").unwrap_err().contains("neither \"off\" nor a duration"));
        let config: RetentionConfig = toml::from_str("completed = \"1h\"\ndead_letters = \"off\"").unwrap();
        let options = config.purge_options(DateTime::from_millis(7_200_000));
        assert_eq!((options.completed_before, options.dead_before), (Some(DateTime::from_millis(3_600_000)), None));
        assert!(config.purges() && !RetentionConfig { completed: Keep::Forever, ..config.clone() }.purges());
        assert_eq!(config.pace, 0.25);
    }
}
