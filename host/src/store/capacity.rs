//! How much a claim or a fan-out's hand-out may take: a count of places, those that start at
//! once, and a room per throttled handler. Only what callers pass in; the claim keeps to it
//! (`claim/plan.rs`), and nothing here decides a limit.

use std::collections::BTreeMap;
use std::sync::Arc;

/// How many deliveries a claim or a hand-out may take (`total`), and how many of them start
/// at once (`run_now`, the free run slots): the others are claimed ahead, to wait for a
/// slot, and are listed as not started, so that a host that dies is charged only for what it
/// ran (see [`ClaimedDelivery::started`]). A plain count takes that many, all started.
/// A claim also keeps to `rooms`: at most so many of a named handler's deliveries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    pub total: usize,
    pub run_now: usize,
    pub rooms: Rooms,
}

impl Capacity {
    /// `total` places of which the first `run_now` (at most `total`) start at once.
    pub fn new(total: usize, run_now: usize) -> Self {
        Self { total, run_now: run_now.min(total), rooms: Rooms::default() }
    }

    /// The same, a claim of it keeping to `rooms`.
    pub fn within(self, rooms: Rooms) -> Self {
        Self { rooms, ..self }
    }

    /// What is left after `taken` places went, the places that start at once first.
    pub fn less(self, taken: usize) -> Self {
        Self::new(self.total.saturating_sub(taken), self.run_now.saturating_sub(taken)).within(self.rooms)
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
    /// They must start at once: they take the claim's first run slots (the room is at most
    /// those), never a place claimed ahead.
    pub start_now: bool,
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

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Room)> {
        self.0.iter().flat_map(|rooms| rooms.iter())
    }
}
