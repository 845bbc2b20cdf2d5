//! Deliveries a fan-out handed out without a delivery record, in memory: the same records and
//! the same ways out as in MongoDB (`store/mongo/unstored.rs`, see
//! [`Candidate::unstored`](crate::store::claim::Candidate::unstored)), so that the contract
//! suite runs this path on both stores.
//!
//! While such a delivery runs, its records are its event's `handedOut` list (naming its
//! handler; the event's `fanOut` names the fan-out that marked it) and its lane entry (which
//! names the event). A completion takes the handler out of the list and stamps the event;
//! anything else (a failure, a hand-back, a takeover, the commit stage of a hand-out that did
//! not hand it out) first *materializes* it: takes the handler out of the list and inserts its
//! record at claim generation 0 in its key's or event's lane, so that the ordinary fenced
//! outcomes apply;
//! a takeover's entry of an event never fanned out makes the event suspect for its handler
//! instead, which a late mark of that fan-out respects. It must never make a record for a
//! handler its event no longer lists.

use bson::{Bson, DateTime};

use super::{Delivery, LaneKind, State};
use crate::event::field;
use crate::store::fan_out::{WithoutDocuments, id_text};
use crate::store::{DeliveryStatus, LOST_WHILE_RUNNING};

pub(super) use crate::store::unstored::Entry;

/// How a materialization counts the run of the deliveries it gives a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Charge {
    /// Not at all: the outcome that follows counts it.
    Nothing,
    /// A takeover's: at the next generation, charged if it was listed as started, suspect if not.
    Takeover,
}

impl State {
    /// The first stage of a fan-out that hands out `without`: lists their handlers in their
    /// events' `handedOut` and stamps those events with the fan-out.
    pub(super) fn list_handed_out(&mut self, without: &WithoutDocuments) {
        for (event, handlers) in &without.handlers {
            if let Some(event) = self.events.get_mut(event) {
                event.insert(field::HANDED_OUT, handlers.clone());
                event.insert(field::FAN_OUT, without.fan_out);
            }
        }
    }

    /// Whether the delivery's event still names it as running without a record: it lists the
    /// handler, and its mark is the entry's fan-out's.
    pub(super) fn names(&self, entry: &Entry) -> bool {
        self.events.get(&id_text(&entry.event)).is_some_and(|event| entry.named_by(event))
    }

    /// Takes the handler out of its event's list (`named` checked by the caller).
    fn unlist(&mut self, entry: &Entry) {
        if let Some(Bson::Array(handlers)) = self.events.get_mut(&id_text(&entry.event)).and_then(|e| e.get_mut(field::HANDED_OUT)) {
            handlers.retain(|handler| handler.as_str() != Some(&entry.handler));
        }
    }

    /// Completes the delivery if its event still names it: unlists it and stamps the event.
    pub(super) fn complete_unstored(&mut self, entry: &Entry, now: DateTime) -> bool {
        if !self.names(entry) {
            return false;
        }
        self.unlist(entry);
        self.stamp_completed(&entry.event, now);
        true
    }

    /// Gives each of `entries` its event still names a record, ready and due now in its
    /// event's lane (charged as `charge` says), and unlists it. Repeating it changes nothing,
    /// and it never makes a second record for an event and handler.
    pub(super) fn materialize(&mut self, entries: &[Entry], charge: Charge, now: DateTime) {
        for entry in entries {
            if !self.names(entry) {
                // Its fan-out has not committed, and may still (as in MongoDB): named, its
                // handler is never handed out by that fan-out's mark (see `fan_out`).
                if charge == Charge::Takeover {
                    self.suspect(&entry.event, &entry.handler);
                }
                continue;
            }
            self.unlist(entry);
            let exists = self.deliveries.values().any(|d| d.event_id == entry.event && d.handler == entry.handler);
            if exists {
                tracing::warn!(delivery = %entry.delivery, handler = %entry.handler, "a delivery handed out without a record is listed twice, or has one already");
                continue;
            }
            let event = self.events.get(&id_text(&entry.event));
            let event_type = event.and_then(|e| e.get_str(field::TYPE).ok()).unwrap_or_default();
            let sequence = event.and_then(Entry::sequence_of);
            let takeover = charge == Charge::Takeover;
            let charged = takeover && entry.started;
            self.deliveries.insert(
                entry.delivery,
                Delivery {
                    event_id: entry.event.clone(),
                    event_type: event_type.to_string(),
                    handler: entry.handler.clone(),
                    key: entry.key.clone(),
                    sequence,
                    group: None,
                    priority: None,
                    lane_id: entry.lane(),
                    lane: LaneKind::Ready,
                    status: DeliveryStatus::Pending,
                    attempts: u32::from(charged),
                    claims: i64::from(takeover),
                    due_at: now,
                    created_at: now,
                    updated_at: None,
                    requeued_at: None,
                    last_error: charged.then(|| LOST_WHILE_RUNNING.to_string()),
                    suspect: takeover && !entry.started,
                    behind: None,
                },
            );
        }
    }
}
