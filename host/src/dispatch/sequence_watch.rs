//! A watch on per-key order as the publishers promised it: the sequences of a key reach its
//! handlers in increasing order, since each is taken from the key's counter in the committing
//! transaction. A publisher that takes sequences some other way (or outside its transaction)
//! can commit sequence 2 after 3 has been delivered; the host then delivers 2 late, which is
//! all it can do, and says so here: a warning naming the key and a counter in `/metrics`.
//!
//! This module owns the memory of the highest sequence started per handler and key, bounded.
//! It must never hold a delivery back or change its order: it only reports.

use std::collections::HashMap;

use crate::store::ClaimedDelivery;

/// Keys remembered at most; past that the memory starts over (a break across the reset goes
/// unreported, which costs a report, never a delivery).
const KEYS_MAX: usize = 100_000;

#[derive(Debug, Default)]
pub(super) struct SequenceWatch {
    highest: HashMap<(String, String), i64>,
}

impl SequenceWatch {
    /// Notes that `delivery` starts; returns whether it comes after a higher sequence of its
    /// key and handler (and warns).
    pub fn starts(&mut self, delivery: &ClaimedDelivery) -> bool {
        let (Some(key), Some(sequence)) = (&delivery.event.key, delivery.event.sequence) else { return false };
        if self.highest.len() >= KEYS_MAX {
            self.highest.clear();
        }
        let highest = self.highest.entry((delivery.handler.clone(), key.clone())).or_insert(sequence);
        if sequence >= *highest {
            *highest = sequence;
            return false;
        }
        tracing::warn!(
            key = %key,
            handler = %delivery.handler,
            sequence,
            after = *highest,
            event = %delivery.event.id,
            "a keyed event reaches its handler after a higher sequence of its key: its publisher did not take the \
             sequence from the key's counter in the transaction that committed it (or an operator requeued a dead delivery)",
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventRecord;
    use crate::store::Lease;
    use bson::oid::ObjectId;

    fn delivery(handler: &str, key: Option<&str>, sequence: i64) -> ClaimedDelivery {
        let mut event = crate::event::NewEvent::new(format!("e-{sequence}"), "t", bson::doc! {});
        if let Some(key) = key {
            event = event.with_key(key);
        }
        let document = event.to_document(key.map(|_| sequence), bson::DateTime::now());
        ClaimedDelivery {
            lease: Lease { delivery: ObjectId::new(), lane: 0, epoch: 1, claims: 0 },
            handler: handler.to_string(),
            attempts: 0,
            event: EventRecord::from_document(&document).unwrap(),
            started: true,
            suspect: false,
            before_commit: None,
        }
    }

    #[test]
    fn a_lower_sequence_after_a_higher_one_of_its_key_and_handler_is_reported_once() {
        let mut watch = SequenceWatch::default();
        let started: Vec<bool> = [("h", Some("k"), 1), ("h", Some("k"), 3), ("h", Some("k"), 3), ("h", Some("k"), 2)]
            .into_iter()
            .map(|(handler, key, sequence)| watch.starts(&delivery(handler, key, sequence)))
            .collect();
        // A retry of 3 is no break; 2 after 3 is.
        assert_eq!(started, [false, false, false, true]);
        // Other handlers, other keys and unkeyed events have orders of their own.
        assert!(!watch.starts(&delivery("other", Some("k"), 1)));
        assert!(!watch.starts(&delivery("h", Some("k2"), 1)));
        assert!(!watch.starts(&delivery("h", None, 0)));
        // 4 follows 3, and the break did not lower what 4 is compared with.
        assert!(!watch.starts(&delivery("h", Some("k"), 4)));
        assert!(watch.starts(&delivery("h", Some("k"), 3)));
    }
}
