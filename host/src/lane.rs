//! Lanes: the 256 partitions of the outbox that hosts lease instead of single deliveries.
//!
//! This module owns the mapping from an ordering key (or, for unkeyed events, the event id)
//! to its lane. It must never change: every delivery document stores the lane it was given,
//! and per-key order relies on all deliveries of a key sharing one lane.

/// Number of lanes. A claim queries at most [`MAX_LANES_PER_QUERY`] of them at once.
pub const LANE_COUNT: u16 = 256;

/// MongoDB merges at most 200 index scans per query; 128 keeps a claim query well inside that.
pub const MAX_LANES_PER_QUERY: usize = 128;

/// A lane number in `0..LANE_COUNT`.
pub type LaneId = u8;

/// 32-bit FNV-1a of the UTF-8 bytes, modulo [`LANE_COUNT`].
pub fn lane_of(ordering_key: &str) -> LaneId {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in ordering_key.as_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    (hash % u32::from(LANE_COUNT)) as LaneId
}

/// The lane of an event: its key's lane when keyed, its id's lane otherwise.
pub fn lane_for_event(event_id: &str, key: Option<&str>) -> LaneId {
    lane_of(key.unwrap_or(event_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_reference_fnv1a_values() {
        // Reference values of 32-bit FNV-1a: "" -> 0x811c9dc5, "a" -> 0xe40c292c,
        // "foobar" -> 0xbf9cf968.
        assert_eq!(lane_of(""), (0x811c_9dc5_u32 % 256) as u8);
        assert_eq!(lane_of("a"), (0xe40c_292c_u32 % 256) as u8);
        assert_eq!(lane_of("foobar"), (0xbf9c_f968_u32 % 256) as u8);
    }

    #[test]
    fn keyed_events_share_their_key_lane() {
        assert_eq!(lane_for_event("e-1", Some("order-7")), lane_of("order-7"));
        assert_eq!(lane_for_event("e-1", None), lane_of("e-1"));
    }
}
