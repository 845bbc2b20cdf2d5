//! A delivery a fan-out handed out without a document (see
//! [`Candidate::unstored`](crate::store::claim::Candidate::unstored)), as its lease or its lane
//! entry names it, and whether its event still names it: what the two stores' `unstored`
//! modules share. It reads documents; it must never write (each store writes in its terms).

use bson::oid::ObjectId;
use bson::{Bson, Document};

use super::claim::{HandOutOf, InFlight, Unstored};
use super::{DeliveryId, Lease};
use crate::event::{field, id_text};
use crate::lane::{LaneId, lane_for_event};

/// A delivery without a document, as its lane lists it or its lease says.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub delivery: DeliveryId,
    pub event: Bson,
    /// The fan-out that handed it out (`None`: an entry of an earlier version, which named
    /// none).
    pub fan_out: Option<ObjectId>,
    pub handler: String,
    /// Its event's ordering key, if it has one: its document goes to the key's lane.
    pub key: Option<String>,
    /// Listed as started: a takeover's materialization charges it.
    pub started: bool,
}

impl Entry {
    pub fn of_lease(lease: &Lease, unstored: Unstored) -> Self {
        let HandOutOf { event, fan_out } = unstored.event;
        Self { delivery: lease.delivery, event, fan_out, handler: unstored.handler, key: unstored.key, started: false }
    }

    /// The unstored ones among lanes' in-flight entries.
    pub fn listed(entries: &[InFlight]) -> Vec<Self> {
        entries
            .iter()
            .filter_map(|entry| {
                let HandOutOf { event, fan_out } = entry.unstored.clone()?;
                Some(Self {
                    delivery: entry.delivery,
                    event,
                    fan_out,
                    handler: entry.handler.clone(),
                    key: entry.key.clone(),
                    started: entry.started,
                })
            })
            .collect()
    }

    /// The lane its document goes to: its key's, or, unkeyed, the one its event's id places it
    /// in, whichever lane listed it while it ran.
    pub fn lane(&self) -> LaneId {
        lane_for_event(&id_text(&self.event), self.key.as_deref())
    }

    /// Its document's `sequence`: its event's, an integer (anything else there makes the event
    /// malformed, and it would not have been handed out).
    pub fn sequence_of(event: &Document) -> Option<i64> {
        match event.get(field::SEQUENCE) {
            Some(Bson::Int32(n)) => Some(i64::from(*n)),
            Some(Bson::Int64(n)) => Some(*n),
            _ => None,
        }
    }

    /// Whether `event` (its document) still names this delivery as handed out without a
    /// document: it lists the handler, and its mark is this entry's fan-out's. An entry of a
    /// fan-out whose mark lost names a delivery that never existed.
    pub fn named_by(&self, event: &Document) -> bool {
        let listed = match event.get(field::HANDED_OUT) {
            Some(Bson::Array(handlers)) => handlers.iter().any(|handler| handler.as_str() == Some(&self.handler)),
            _ => false,
        };
        listed && self.fan_out.is_none_or(|fan_out| event.get_object_id(field::FAN_OUT).ok() == Some(fan_out))
    }
}
