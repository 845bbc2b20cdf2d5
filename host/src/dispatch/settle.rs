//! How one attempt settles: the handler's result, the attempts so far and the retry policy
//! decide between completing, retrying later and burying.

use std::time::Duration;

use bson::DateTime;

/// A handler's result as the dispatcher sees it (whatever ran the handler).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptResult {
    Completed,
    /// Try again; not before `not_before` (ms since the Unix epoch) when given.
    Retry { reason: String, not_before: Option<i64> },
    /// Retrying cannot help.
    Unprocessable(String),
    /// The attempt failed without the handler deciding (a trap, a limit, a crash).
    Failed(String),
}

/// How the bound of the pause after failed attempt `n` grows: the same each time (`fixed`),
/// by the first pause each time (`linear`), or doubling (`exponential`, the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backoff {
    Fixed,
    Linear,
    #[default]
    Exponential,
}

/// Whether the pause is drawn at random between nothing and its bound (`full`, the default:
/// deliveries that failed together, in an outage, are not retried together) or is the bound
/// (`none`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    None,
    #[default]
    Full,
}

/// Retries of one handler: attempts in all, and the pause after each failed one, from
/// `initial_backoff` growing as `backoff` says up to `max_backoff`, drawn as `jitter` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub backoff: Backoff,
    pub jitter: Jitter,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            backoff: Backoff::Exponential,
            jitter: Jitter::Full,
        }
    }
}

impl RetryPolicy {
    /// The bound of the pause after failed attempt number `attempt` (1-based), capped.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let attempt = attempt.max(1);
        let bound = match self.backoff {
            Backoff::Fixed => self.initial_backoff,
            Backoff::Linear => self.initial_backoff.saturating_mul(attempt),
            Backoff::Exponential => self.initial_backoff.saturating_mul(1u32 << (attempt - 1).min(31)),
        };
        bound.min(self.max_backoff)
    }

    /// The pause after failed attempt `attempt`, given `draw`, uniform in [0, 1).
    pub fn pause(&self, attempt: u32, draw: f64) -> Duration {
        match self.jitter {
            Jitter::None => self.backoff(attempt),
            Jitter::Full => self.backoff(attempt).mul_f64(draw.clamp(0.0, 1.0)),
        }
    }
}

/// What to do with the delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    Complete,
    Reschedule { due_at: DateTime, reason: String },
    /// Dead, with the reason recorded as its last error.
    Bury { reason: String },
}

/// Decides how attempt number `attempt` (1-based) settles at `now`; `draw` (uniform in
/// [0, 1)) places a jittered pause. A plugin's not-before wins over the pause.
pub fn decide(result: AttemptResult, attempt: u32, policy: &RetryPolicy, now: DateTime, draw: f64) -> Settle {
    let (reason, not_before) = match result {
        AttemptResult::Completed => return Settle::Complete,
        AttemptResult::Unprocessable(reason) => return Settle::Bury { reason: format!("unprocessable: {reason}") },
        AttemptResult::Retry { reason, not_before } => (reason, not_before),
        AttemptResult::Failed(reason) => (reason, None),
    };
    if attempt >= policy.max_attempts {
        return Settle::Bury { reason: format!("{reason} (attempt {attempt} of {})", policy.max_attempts) };
    }
    let backoff = now.timestamp_millis().saturating_add(policy.pause(attempt, draw).as_millis() as i64);
    let due = not_before.map_or(backoff, |at| at.max(now.timestamp_millis()));
    Settle::Reschedule { due_at: DateTime::from_millis(due), reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: i64 = 1_900_000_000_000;

    #[test]
    fn the_default_backoff_doubles_from_one_second_to_a_minute() {
        let policy = RetryPolicy::default();
        let pauses: Vec<u64> = (1..=9).map(|a| policy.backoff(a).as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        let linear = RetryPolicy { backoff: Backoff::Linear, max_backoff: Duration::from_secs(4), ..policy };
        assert_eq!((1..=6).map(|a| linear.backoff(a).as_secs()).collect::<Vec<_>>(), [1, 2, 3, 4, 4, 4]);
        let fixed = RetryPolicy { backoff: Backoff::Fixed, ..policy };
        assert_eq!((1..=4).map(|a| fixed.backoff(a).as_secs()).collect::<Vec<_>>(), [1, 1, 1, 1]);
    }

    #[test]
    fn full_jitter_spreads_a_pause_between_nothing_and_its_bound() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.pause(3, 0.0), Duration::ZERO);
        assert_eq!(policy.pause(3, 0.5), Duration::from_secs(2));
        assert_eq!(policy.pause(3, 1.0), Duration::from_secs(4));
        let none = RetryPolicy { jitter: Jitter::None, ..policy };
        assert_eq!(none.pause(3, 0.0), Duration::from_secs(4));
        // A thousand deliveries failing together are spread over the whole bound.
        let now = DateTime::from_millis(NOW);
        let mut dues: Vec<i64> = (0..1_000)
            .map(|_| match decide(AttemptResult::Failed("outage".into()), 3, &policy, now, fastrand::f64()) {
                Settle::Reschedule { due_at, .. } => due_at.timestamp_millis() - NOW,
                other => panic!("{other:?}"),
            })
            .collect();
        dues.sort();
        assert!(dues[0] >= 0 && dues[999] <= 4_000, "{} .. {}", dues[0], dues[999]);
        assert!(dues[100] < 800 && dues[900] > 3_200, "spread: p10 {} p90 {}", dues[100], dues[900]);
        // A plugin's not-before is kept as it is.
        let later = AttemptResult::Retry { reason: "429".into(), not_before: Some(NOW + 30_000) };
        assert_eq!(decide(later, 1, &policy, now, 0.0), Settle::Reschedule { due_at: DateTime::from_millis(NOW + 30_000), reason: "429".into() });
    }

    #[test]
    fn outcomes_settle_as_documented() {
        let policy = RetryPolicy { jitter: Jitter::None, ..RetryPolicy::default() };
        let now = DateTime::from_millis(NOW);
        assert_eq!(decide(AttemptResult::Completed, 1, &policy, now, 0.5), Settle::Complete);
        assert_eq!(
            decide(AttemptResult::Unprocessable("no such customer".into()), 1, &policy, now, 0.5),
            Settle::Bury { reason: "unprocessable: no such customer".into() }
        );
        assert_eq!(
            decide(AttemptResult::Failed("fuel exhausted".into()), 2, &policy, now, 0.5),
            Settle::Reschedule { due_at: DateTime::from_millis(NOW + 2_000), reason: "fuel exhausted".into() }
        );
        // The plugin's not-before wins over the backoff, but never lies in the past.
        let later = AttemptResult::Retry { reason: "429".into(), not_before: Some(NOW + 30_000) };
        assert_eq!(decide(later, 1, &policy, now, 0.5), Settle::Reschedule { due_at: DateTime::from_millis(NOW + 30_000), reason: "429".into() });
        let past = AttemptResult::Retry { reason: "503".into(), not_before: Some(NOW - 5) };
        assert_eq!(decide(past, 1, &policy, now, 0.5), Settle::Reschedule { due_at: now, reason: "503".into() });
        assert_eq!(
            decide(AttemptResult::Failed("trap: unreachable".into()), 5, &policy, now, 0.5),
            Settle::Bury { reason: "trap: unreachable (attempt 5 of 5)".into() }
        );
    }

    proptest! {
        #[test]
        fn backoff_never_exceeds_its_cap_and_never_shrinks(initial in 1u64..10_000, cap in 1u64..1_000_000, attempt in 1u32..200, draw in 0.0f64..1.0) {
            let policy = RetryPolicy { max_attempts: 10, initial_backoff: Duration::from_millis(initial), max_backoff: Duration::from_millis(cap), ..RetryPolicy::default() };
            for backoff in [Backoff::Fixed, Backoff::Linear, Backoff::Exponential] {
                let policy = RetryPolicy { backoff, ..policy };
                prop_assert!(policy.backoff(attempt) <= policy.max_backoff);
                prop_assert!(policy.backoff(attempt + 1) >= policy.backoff(attempt));
                prop_assert!(policy.pause(attempt, draw) <= policy.backoff(attempt));
            }
        }
    }
}
