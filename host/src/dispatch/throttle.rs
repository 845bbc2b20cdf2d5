//! A handler's processing limits, as the operator sets them: how many of its deliveries a
//! host holds at once (running or claimed ahead of a run slot), and how many of them it
//! starts in any window of a given length, on each host; and the same across every host (the
//! global `concurrency` and `rate`, held through the store's limiter documents, see
//! [`crate::store::limiter`]; each run passes its handler's gate, see [`super::global_limits`]).
//!
//! Claims and hand-outs take at most the room a throttled handler's limits leave (they are
//! told each handler's room, [`Rooms`]), so its backlog never takes the places of other
//! handlers' work: on each host, what its limits let it hold; across hosts, what its gate
//! could let start soon. The loop claims for it again when one of its runs ends and when its
//! rate window lets another start.
//!
//! This module owns the counting: the limits, the starts each throttled handler made in its
//! window, and the rooms they leave. It never claims, and never knows how a handler runs.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::HandlerSpec;
use super::options::CLAIM_AHEAD_PER_RUN_SLOT;
use crate::store::limiter::GlobalRate;
use crate::store::{Room, Rooms};

/// What the operator limits one handler to, on each host and across all. The default limits
/// nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Throttle {
    /// At most this many of its deliveries held at once on each host, running or waiting for
    /// a run slot.
    pub concurrency: Option<usize>,
    /// At most so many starts in any window, on each host.
    pub rate: Option<RateLimit>,
    /// At most this many held at once across all hosts.
    pub global_concurrency: Option<usize>,
    /// At most so many starts a window across all hosts, with a burst.
    pub global_rate: Option<GlobalRate>,
}

/// At most `max` starts in any window of `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub max: usize,
    pub per: Duration,
}

impl Throttle {
    /// Whether it limits anything.
    pub fn limits(&self) -> bool {
        self.concurrency.is_some() || self.rate.is_some() || self.global()
    }

    /// Whether it limits anything on each host.
    pub fn per_host(&self) -> bool {
        self.concurrency.is_some() || self.rate.is_some()
    }

    /// Whether it limits anything across hosts (its claims ask the store's limiter first).
    pub fn global(&self) -> bool {
        self.global_concurrency.is_some() || self.global_rate.is_some()
    }

    /// Whether each start is counted as it is claimed, so it must start at once (the limits
    /// across hosts count starts at their gate instead, see [`super::global_limits`]).
    fn counts_starts(&self) -> bool {
        self.rate.is_some()
    }

    /// The most of its deliveries a host holds for its limits across hosts, running or
    /// waiting at their gate: what the global concurrency runs, with each run slot's claims
    /// ahead, and about a second of starts at the global rate. A limited backlog keeps its
    /// gate fed without taking the places of other handlers' work.
    fn global_hold(&self) -> Option<usize> {
        let by_concurrency = self.global_concurrency.map(|limit| limit.saturating_mul(1 + CLAIM_AHEAD_PER_RUN_SLOT));
        let by_rate = self.global_rate.map(|rate| {
            let per_second = rate.max as u128 * 1_000 / rate.per_ms.max(1) as u128;
            per_second.clamp(1, usize::MAX as u128) as usize
        });
        match (by_concurrency, by_rate) {
            (Some(concurrency), Some(rate)) => Some(concurrency.min(rate)),
            (concurrency, rate) => concurrency.or(rate),
        }
    }
}

/// The starts each rate-limited handler made on this host within its window.
#[derive(Debug, Default)]
pub(super) struct StartWindows {
    by_handler: HashMap<String, VecDeque<Instant>>,
}

impl StartWindows {
    /// How many more deliveries of `handler` may be taken at `now`, with `held` of them held:
    /// `None` when `throttle` limits nothing.
    pub(super) fn room(&mut self, handler: &str, throttle: &Throttle, held: usize, now: Instant) -> Option<usize> {
        if !throttle.limits() {
            return None;
        }
        let by_concurrency = throttle.concurrency.map_or(usize::MAX, |limit| limit.saturating_sub(held));
        let by_rate = match throttle.rate {
            Some(rate) => rate.max.saturating_sub(self.started_within(handler, rate, now)),
            None => usize::MAX,
        };
        let by_global = throttle.global_hold().map_or(usize::MAX, |hold| hold.saturating_sub(held));
        Some(by_concurrency.min(by_rate).min(by_global))
    }

    /// What a claim may take of each throttled handler of `specs`, `held(handler)` of its
    /// deliveries held: what its throttle leaves, and of a rate-limited one no more than the
    /// free run slots (`run_now`) the others left (each is counted as it is claimed, so it
    /// must start at once). Also whether one of those found fewer free run slots than its
    /// window left it (the next run that ends should ask for a claim).
    pub(super) fn rooms(&mut self, specs: &[HandlerSpec], run_now: usize, held: impl Fn(&str) -> usize) -> (Rooms, bool) {
        let now = Instant::now();
        let mut run_slots = run_now;
        let mut wait_for_slots = false;
        let mut rooms = Vec::new();
        for spec in specs.iter().filter(|spec| spec.controls.throttle.limits()) {
            let mut most = self.room(&spec.handler, &spec.controls.throttle, held(&spec.handler), now).unwrap_or(0);
            let start_now = spec.controls.throttle.counts_starts();
            if start_now {
                wait_for_slots |= most > run_slots;
                most = most.min(run_slots);
                run_slots -= most;
            }
            rooms.push((spec.handler.clone(), Room { most, start_now }));
        }
        (Rooms::new(rooms), wait_for_slots)
    }

    /// Counts `count` starts of `handler` at `now`, if its throttle limits its rate.
    pub(super) fn started(&mut self, handler: &str, throttle: &Throttle, count: usize, now: Instant) {
        if throttle.rate.is_some() && count > 0 {
            self.by_handler.entry(handler.to_string()).or_default().extend(std::iter::repeat_n(now, count));
        }
    }

    /// When the window of `handler` lets its next start in, if it is full at `now`.
    pub(super) fn opening(&mut self, handler: &str, throttle: &Throttle, now: Instant) -> Option<Instant> {
        let rate = throttle.rate?;
        if self.started_within(handler, rate, now) < rate.max {
            return None;
        }
        let starts = self.by_handler.get(handler)?;
        // The start that leaves the window first makes room for one more.
        starts.get(starts.len() - rate.max).map(|start| *start + rate.per)
    }

    /// The starts of `handler` within the window ending at `now`; older ones are forgotten.
    fn started_within(&mut self, handler: &str, rate: RateLimit, now: Instant) -> usize {
        let Some(starts) = self.by_handler.get_mut(handler) else { return 0 };
        while starts.front().is_some_and(|start| *start + rate.per <= now) {
            starts.pop_front();
        }
        starts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::Controls;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn the_room_is_the_least_that_either_limit_leaves() {
        let mut windows = StartWindows::default();
        let now = Instant::now();
        assert_eq!(windows.room("h", &Throttle::default(), 100, now), None, "unthrottled");
        let both = Throttle { concurrency: Some(3), rate: Some(RateLimit { max: 5, per: SECOND }), ..Default::default() };
        assert_eq!(windows.room("h", &both, 0, now), Some(3));
        assert_eq!(windows.room("h", &both, 2, now), Some(1));
        assert_eq!(windows.room("h", &both, 7, now), Some(0), "held beyond a lowered limit");
        windows.started("h", &both, 4, now);
        assert_eq!(windows.room("h", &both, 0, now), Some(1), "one start left in the window");
        assert_eq!(windows.room("other", &both, 0, now), Some(3), "each handler counts its own");
    }

    #[test]
    fn rate_limited_handlers_share_the_free_run_slots_and_the_others_may_claim_ahead() {
        let spec = |handler: &str, throttle: Throttle| HandlerSpec {
            handler: handler.into(),
            event_types: vec!["t".into()],
            retry: Default::default(),
            controls: Controls { throttle, ..Controls::default() },
            transactional: false,
        };
        let paced = Throttle { rate: Some(RateLimit { max: 4, per: SECOND }), ..Default::default() };
        let specs = [
            spec("free", Throttle::default()),
            spec("a", paced),
            spec("b", paced),
            spec("held", Throttle { concurrency: Some(10), ..Default::default() }),
        ];
        let mut windows = StartWindows::default();
        let (rooms, wait_for_slots) = windows.rooms(&specs, 6, |handler| if handler == "held" { 3 } else { 0 });
        assert_eq!(rooms.of("free"), None);
        assert_eq!(rooms.of("a"), Some(Room { most: 4, start_now: true }));
        assert_eq!(rooms.of("b"), Some(Room { most: 2, start_now: true }), "what `a` left of six slots");
        assert_eq!(rooms.of("held"), Some(Room { most: 7, start_now: false }), "claimed ahead too");
        assert!(wait_for_slots, "`b` could have started four");
        let (_, wait_for_slots) = windows.rooms(&specs, 8, |_| 0);
        assert!(!wait_for_slots);
    }

    #[test]
    fn a_full_window_opens_when_its_oldest_start_leaves_it() {
        let mut windows = StartWindows::default();
        let rate = Throttle { rate: Some(RateLimit { max: 2, per: SECOND }), ..Default::default() };
        let t0 = Instant::now();
        windows.started("h", &rate, 1, t0);
        assert_eq!(windows.opening("h", &rate, t0), None, "room left");
        windows.started("h", &rate, 1, t0 + Duration::from_millis(300));
        windows.started("h", &rate, 1, t0 + Duration::from_millis(600));
        assert_eq!(windows.room("h", &rate, 0, t0 + Duration::from_millis(600)), Some(0));
        // Three starts, two allowed: the window has room again once the first two left it.
        let opens = windows.opening("h", &rate, t0 + Duration::from_millis(600)).unwrap();
        assert_eq!(opens, t0 + Duration::from_millis(1_300));
        assert_eq!(windows.room("h", &rate, 0, opens - Duration::from_millis(1)), Some(0));
        assert_eq!(windows.room("h", &rate, 0, opens), Some(1));
        assert_eq!(windows.room("h", &rate, 0, t0 + 3 * SECOND), Some(2));
        // Concurrency alone counts no starts.
        let held = Throttle { concurrency: Some(1), ..Default::default() };
        windows.started("c", &held, 5, t0);
        assert_eq!(windows.opening("c", &held, t0), None);
        assert_eq!(windows.room("c", &held, 0, t0), Some(1));
    }
}
