//! Which lanes are whose: the 256 lanes split among the live hosts, so that hosts do not race
//! for the same events.
//!
//! Every host announces itself in the store ([`crate::store::Hosts::announce`]) and reads
//! who else is live; each lane then belongs to the host whose rendezvous hash of (host, lane)
//! is highest. Every host computes the same split from the same list, a host that joins or
//! leaves moves only its own share (about `256 / hosts` lanes), and no coordinator is
//! needed. A host fans out only the events of its own lanes, so what it fans out lands in
//! lanes it then runs, and a second host takes the other events instead of the same oldest
//! ones.
//!
//! The split is a preference, never a lock: leases keep lanes exclusive, as before. An event
//! of another host's lane that is older than [`Assignment::stale_after`] is fanned out by
//! whoever reads it, so a host that announces itself but does not fan out delays its
//! share, never strands it. A store instance that never announced itself (an operator's
//! command, a test of one instance) holds every lane.
//!
//! This module is pure: it decides, the stores record the announcements.

use bson::{Bson, DateTime, Document};

use crate::event::{field, id_text, string_key};
use crate::lane::{LANE_COUNT, LaneId, lane_for_event};

/// The lanes one host fans out: its share among the live hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Assignment {
    mine: Vec<bool>,
    hosts: usize,
}

impl Default for Assignment {
    fn default() -> Self {
        Self::everything()
    }
}

impl Assignment {
    /// Every lane: a host alone, or one that has not announced itself.
    pub fn everything() -> Self {
        Self { mine: vec![true; usize::from(LANE_COUNT)], hosts: 1 }
    }

    /// The share of `me` among `hosts` (live host ids; `me` counts whether listed or not).
    pub fn among(me: &str, hosts: &[String]) -> Self {
        let mut all: Vec<&str> = hosts.iter().map(String::as_str).collect();
        if !all.contains(&me) {
            all.push(me);
        }
        all.sort_unstable();
        all.dedup();
        let mine = (0..LANE_COUNT)
            .map(|lane| {
                let lane = lane as LaneId;
                let winner = all.iter().max_by_key(|host| (weight(host, lane), **host)).expect("me at least");
                *winner == me
            })
            .collect();
        Self { mine, hosts: all.len() }
    }

    pub fn is_mine(&self, lane: LaneId) -> bool {
        self.mine[usize::from(lane)]
    }

    /// How many live hosts share the lanes.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// How many lanes are this host's.
    pub fn lanes(&self) -> usize {
        self.mine.iter().filter(|mine| **mine).count()
    }

    /// Whether this assignment holds a lane `before` did not.
    pub fn gains_on(&self, before: &Assignment) -> bool {
        self.mine.iter().zip(&before.mine).any(|(now, then)| *now && !*then)
    }

    /// How long an event of another host's lane waits before anyone fans it out: twice the
    /// lease, the time in which a host that stopped renewing is seen gone anyway.
    pub fn stale_after(lease_ms: i64) -> i64 {
        lease_ms.saturating_mul(2)
    }

    /// Whether the event `doc` is in one of this host's lanes.
    pub fn holds(&self, doc: &Document) -> bool {
        let id = id_text(doc.get(field::ID).unwrap_or(&Bson::Null));
        self.is_mine(lane_for_event(&id, string_key(doc)))
    }

    /// Whether this host fans out the event `doc`: it is in one of its lanes, or older than
    /// `stale_before` (by its `createdAt`), or unreadable enough that its lane is unknown.
    pub fn fans_out(&self, doc: &Document, stale_before: DateTime) -> bool {
        if self.hosts == 1 || self.holds(doc) {
            return true;
        }
        match doc.get(field::CREATED_AT) {
            Some(Bson::DateTime(created)) => *created < stale_before,
            // A malformed event is dead-lettered by whoever reads it.
            _ => true,
        }
    }
}

/// The rendezvous weight of `lane` for `host`: FNV-1a over the host id and the lane, mixed
/// so that near-identical host names still spread.
fn weight(host: &str, lane: LaneId) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in host.as_bytes().iter().chain(&[0xff, lane]) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64's finalizer.
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|name| name.to_string()).collect()
    }

    #[test]
    fn every_lane_has_exactly_one_host_and_the_shares_are_even() {
        for count in [2, 3, 4, 8] {
            let names: Vec<String> = (0..count).map(|n| format!("host-{n}/instance-{n}")).collect();
            let shares: Vec<Assignment> = names.iter().map(|me| Assignment::among(me, &names)).collect();
            for lane in 0..=255u8 {
                assert_eq!(shares.iter().filter(|share| share.is_mine(lane)).count(), 1, "lane {lane} of {count} hosts");
            }
            let even = 256 / count;
            for share in &shares {
                assert_eq!(share.hosts(), count);
                // Rendezvous hashing is even in expectation; these names stay within a third.
                assert!(share.lanes().abs_diff(even) <= even / 3 + 4, "{} lanes of {count} hosts", share.lanes());
            }
        }
    }

    #[test]
    fn a_host_joining_moves_only_lanes_to_itself() {
        let before = hosts(&["a/1", "b/1", "c/1"]);
        let after = hosts(&["a/1", "b/1", "c/1", "d/1"]);
        for me in ["a/1", "b/1", "c/1"] {
            let (then, now) = (Assignment::among(me, &before), Assignment::among(me, &after));
            assert!(!now.gains_on(&then), "{me} gains nothing when d joins");
            for lane in 0..=255u8 {
                if then.is_mine(lane) && !now.is_mine(lane) {
                    assert!(Assignment::among("d/1", &after).is_mine(lane), "lane {lane} went to d");
                }
            }
        }
        // And when d leaves again, the others gain exactly what d had.
        let d = Assignment::among("d/1", &after);
        let gained: usize = ["a/1", "b/1", "c/1"]
            .iter()
            .map(|me| {
                let (with_d, without) = (Assignment::among(me, &after), Assignment::among(me, &before));
                (0..=255u8).filter(|lane| without.is_mine(*lane) && !with_d.is_mine(*lane)).count()
            })
            .sum();
        assert_eq!(gained, d.lanes());
    }

    #[test]
    fn a_host_alone_or_unannounced_fans_out_everything() {
        let alone = Assignment::among("a/1", &[]);
        assert_eq!((alone.hosts(), alone.lanes()), (1, 256));
        assert_eq!(Assignment::everything(), alone);
    }

    #[test]
    fn another_host_s_event_is_left_to_it_until_stale() {
        let names = hosts(&["a/1", "b/1"]);
        let a = Assignment::among("a/1", &names);
        let theirs = (0..).map(|n| format!("e-{n}")).find(|id| !a.is_mine(lane_for_event(id, None))).unwrap();
        let ours = (0..).map(|n| format!("e-{n}")).find(|id| a.is_mine(lane_for_event(id, None))).unwrap();
        let created = DateTime::from_millis(10_000);
        let event = |id: &str| doc! { "_id": id, "type": "t", "createdAt": created };
        assert!(a.fans_out(&event(&ours), DateTime::from_millis(0)));
        assert!(!a.fans_out(&event(&theirs), DateTime::from_millis(10_000)));
        assert!(a.fans_out(&event(&theirs), DateTime::from_millis(10_001)), "stale: whoever reads it");
        // A keyed event goes by its key's lane, whatever its id.
        let their_key = (0..).map(|n| format!("k-{n}")).find(|key| !a.is_mine(crate::lane::lane_of(key))).unwrap();
        assert!(!a.fans_out(&doc! { "_id": ours.as_str(), "key": their_key, "createdAt": created }, DateTime::from_millis(0)));
        // An event without a readable createdAt is malformed: whoever reads it dead-letters it.
        assert!(a.fans_out(&doc! { "_id": theirs.as_str(), "createdAt": "yesterday" }, DateTime::from_millis(0)));
    }
}
