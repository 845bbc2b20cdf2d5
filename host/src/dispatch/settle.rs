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

/// Retries of one handler: attempts in all, and a backoff doubling from `initial` to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { max_attempts: 5, initial_backoff: Duration::from_secs(1), max_backoff: Duration::from_secs(60) }
    }
}

impl RetryPolicy {
    /// The pause after failed attempt number `attempt` (1-based): initial, doubling, capped.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(32);
        self.initial_backoff.saturating_mul(1u32 << doublings.min(31)).min(self.max_backoff)
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

/// Decides how attempt number `attempt` (1-based) settles at `now`.
pub fn decide(result: AttemptResult, attempt: u32, policy: &RetryPolicy, now: DateTime) -> Settle {
    let (reason, not_before) = match result {
        AttemptResult::Completed => return Settle::Complete,
        AttemptResult::Unprocessable(reason) => return Settle::Bury { reason: format!("unprocessable: {reason}") },
        AttemptResult::Retry { reason, not_before } => (reason, not_before),
        AttemptResult::Failed(reason) => (reason, None),
    };
    if attempt >= policy.max_attempts {
        return Settle::Bury { reason: format!("{reason} (attempt {attempt} of {})", policy.max_attempts) };
    }
    let backoff = now.timestamp_millis().saturating_add(policy.backoff(attempt).as_millis() as i64);
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
    }

    #[test]
    fn outcomes_settle_as_documented() {
        let policy = RetryPolicy::default();
        let now = DateTime::from_millis(NOW);
        assert_eq!(decide(AttemptResult::Completed, 1, &policy, now), Settle::Complete);
        assert_eq!(
            decide(AttemptResult::Unprocessable("no such customer".into()), 1, &policy, now),
            Settle::Bury { reason: "unprocessable: no such customer".into() }
        );
        assert_eq!(
            decide(AttemptResult::Failed("fuel exhausted".into()), 2, &policy, now),
            Settle::Reschedule { due_at: DateTime::from_millis(NOW + 2_000), reason: "fuel exhausted".into() }
        );
        // The plugin's not-before wins over the backoff, but never lies in the past.
        let later = AttemptResult::Retry { reason: "429".into(), not_before: Some(NOW + 30_000) };
        assert_eq!(decide(later, 1, &policy, now), Settle::Reschedule { due_at: DateTime::from_millis(NOW + 30_000), reason: "429".into() });
        let past = AttemptResult::Retry { reason: "503".into(), not_before: Some(NOW - 5) };
        assert_eq!(decide(past, 1, &policy, now), Settle::Reschedule { due_at: now, reason: "503".into() });
        assert_eq!(
            decide(AttemptResult::Failed("trap: unreachable".into()), 5, &policy, now),
            Settle::Bury { reason: "trap: unreachable (attempt 5 of 5)".into() }
        );
    }

    proptest! {
        #[test]
        fn backoff_never_exceeds_its_cap_and_never_shrinks(initial in 1u64..10_000, cap in 1u64..1_000_000, attempt in 1u32..200) {
            let policy = RetryPolicy { max_attempts: 10, initial_backoff: Duration::from_millis(initial), max_backoff: Duration::from_millis(cap) };
            prop_assert!(policy.backoff(attempt) <= policy.max_backoff);
            prop_assert!(policy.backoff(attempt + 1) >= policy.backoff(attempt));
        }
    }
}
