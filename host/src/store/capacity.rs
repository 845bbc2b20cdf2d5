//! How much a claim or a fan-out's hand-out may take, and what first: a count of places,
//! those that start at once, a room per throttled handler, how many of one key a handler runs
//! at once, and the handlers' priorities. Only
//! what callers pass in; the claim keeps to it (`claim/plan.rs`), so does a hand-out
//! (`fan_out::fresh`), and nothing here decides a limit or a priority.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// How many deliveries a claim or a hand-out may take (`total`), and how many of them start
/// at once (`run_now`, the free run slots): the others are claimed ahead, to wait for a
/// slot, and are listed as not started, so that a host that dies is charged only for what it
/// ran (see [`ClaimedDelivery::started`]). A plain count takes that many, all started.
/// Both keep to `rooms`: at most so many of a named handler's deliveries. Both take
/// the deliveries of handlers of a higher priority first, and give them the places that start
/// at once first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    pub total: usize,
    pub run_now: usize,
    pub rooms: Rooms,
    pub priorities: Priorities,
    /// The most of one key running at once, of handlers that run several of a key unordered
    /// (see [`crate::store::PerKey`]): a claim keeps to it in the key's lane.
    pub per_key: KeyLimits,
}

impl Capacity {
    /// `total` places of which the first `run_now` (at most `total`) start at once.
    pub fn new(total: usize, run_now: usize) -> Self {
        Self {
            total,
            run_now: run_now.min(total),
            rooms: Rooms::default(),
            priorities: Priorities::default(),
            per_key: KeyLimits::default(),
        }
    }

    /// The same, keeping to `per_key`: at most so many of one key of a handler at once.
    pub fn keyed_within(self, per_key: KeyLimits) -> Self {
        Self { per_key, ..self }
    }

    /// The same, a claim of it keeping to `rooms`.
    pub fn within(self, rooms: Rooms) -> Self {
        Self { rooms, ..self }
    }

    /// The same, taking handlers of a higher priority first.
    pub fn ordered_by(self, priorities: Priorities) -> Self {
        Self { priorities, ..self }
    }

    /// What is left after `taken` places went, the places that start at once first.
    pub fn less(self, taken: usize) -> Self {
        Self { total: self.total.saturating_sub(taken), run_now: self.run_now.saturating_sub(taken), ..self }
    }
}

impl From<usize> for Capacity {
    fn from(total: usize) -> Self {
        Self::new(total, total)
    }
}

/// The most deliveries a claim takes of some handlers (the others it takes as its capacity
/// allows): its host's throttles, as its dispatcher counts them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rooms(Option<Arc<BTreeMap<String, Room>>>);

/// What one claim may take of one handler's deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub most: usize,
}

impl Rooms {
    pub fn new(rooms: impl IntoIterator<Item = (String, Room)>) -> Self {
        let rooms: BTreeMap<String, Room> = rooms.into_iter().collect();
        Self((!rooms.is_empty()).then(|| Arc::new(rooms)))
    }

    /// The room of `handler`; `None` when its deliveries are limited by nothing but the
    /// claim's capacity.
    pub fn of(&self, handler: &str) -> Option<Room> {
        self.0.as_ref()?.get(handler).copied()
    }

    /// Whether it names no handler.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Room)> {
        self.0.iter().flat_map(|rooms| rooms.iter())
    }
}

/// The most deliveries of one key a handler runs at once, for handlers that run several of a
/// key unordered; a handler not named runs its keys one at a time, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyLimits(Option<Arc<BTreeMap<String, usize>>>);

impl KeyLimits {
    pub fn new(limits: impl IntoIterator<Item = (String, usize)>) -> Self {
        let limits: BTreeMap<String, usize> = limits.into_iter().collect();
        Self((!limits.is_empty()).then(|| Arc::new(limits)))
    }

    /// The limit of `handler`, if it has one.
    pub fn of(&self, handler: &str) -> Option<usize> {
        self.0.as_ref()?.get(handler).copied()
    }

    /// Whether it names no handler.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }
}

/// The priority of each handler (0 unless named), and the handlers that take priorities per
/// event (see [`crate::store::PriorityFrom`]): of due deliveries, those of a higher handler
/// priority are taken first, and of one such handler, those of a higher delivery priority.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Priorities(Option<Arc<Ranks>>);

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Ranks {
    by_handler: BTreeMap<String, i32>,
    per_event: BTreeSet<String>,
}

impl Priorities {
    /// The priorities of every handler (`priorities`); none when they are all equal: one tier
    /// changes no order, and a fan-out need not give up pacing its backlog for it.
    pub fn new(priorities: impl IntoIterator<Item = (String, i32)>) -> Self {
        let all: Vec<(String, i32)> = priorities.into_iter().collect();
        if all.iter().all(|(_, priority)| Some(priority) == all.first().map(|(_, first)| first)) {
            return Self::default();
        }
        let by_handler: BTreeMap<String, i32> = all.into_iter().filter(|(_, priority)| *priority != 0).collect();
        Self(Some(Arc::new(Ranks { by_handler, per_event: BTreeSet::new() })))
    }

    /// The same, `handlers` taking priorities per event: each is a tier of its own (with the
    /// others of its priority that do), just above the handlers of its priority that do not,
    /// and its deliveries are read in their priorities' order.
    pub fn per_event(self, handlers: impl IntoIterator<Item = String>) -> Self {
        let per_event: BTreeSet<String> = handlers.into_iter().collect();
        if per_event.is_empty() {
            return self;
        }
        let by_handler = self.0.map(|ranks| ranks.by_handler.clone()).unwrap_or_default();
        Self(Some(Arc::new(Ranks { by_handler, per_event })))
    }

    /// Whether no handler goes before another, and none takes priorities per event.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn of(&self, handler: &str) -> i32 {
        self.0.as_ref().and_then(|ranks| ranks.by_handler.get(handler).copied()).unwrap_or(0)
    }

    /// Whether `handler` takes priorities per event.
    pub fn per_event_of(&self, handler: &str) -> bool {
        self.0.as_ref().is_some_and(|ranks| ranks.per_event.contains(handler))
    }

    /// `handlers` in groups of one priority each, the highest first (one group when none has a
    /// priority of its own); of one priority, those that take priorities per event first.
    pub fn tiers(&self, handlers: &[String]) -> Vec<Vec<String>> {
        if self.0.is_none() {
            return vec![handlers.to_vec()];
        }
        let mut by_priority: BTreeMap<(std::cmp::Reverse<i32>, bool), Vec<String>> = BTreeMap::new();
        for handler in handlers {
            by_priority.entry((std::cmp::Reverse(self.of(handler)), !self.per_event_of(handler))).or_default().push(handler.clone());
        }
        by_priority.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_go_from_the_highest_priority_down() {
        let handlers: Vec<String> = ["a", "b", "c", "d"].iter().map(|h| h.to_string()).collect();
        assert_eq!(Priorities::default().tiers(&handlers), [handlers.clone()]);
        let priorities = Priorities::new([("c".to_string(), 5), ("a".to_string(), -1), ("d".to_string(), 5), ("b".to_string(), 0)]);
        let named = |tier: &[&str]| tier.iter().map(|h| h.to_string()).collect::<Vec<_>>();
        assert_eq!(priorities.tiers(&handlers), [named(&["c", "d"]), named(&["b"]), named(&["a"])]);
        assert_eq!(Priorities::new([("x".to_string(), 0)]), Priorities::default(), "0 is everyone's");
        let equal = Priorities::new([("x".to_string(), 3), ("y".to_string(), 3)]);
        assert!(equal.is_empty(), "one tier is no priority at all");
        assert_eq!(equal.tiers(&handlers), [handlers.clone()]);
        // Taking priorities per event: a tier of its own above its priority's others.
        let by_event = equal.per_event(["b".to_string()]);
        assert!(!by_event.is_empty() && by_event.per_event_of("b"));
        assert_eq!(by_event.tiers(&handlers), [named(&["b"]), named(&["a", "c", "d"])]);
    }
}
