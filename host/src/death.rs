//! The dead-letter event: what `relayhost.delivery.dead` says about a delivery that died,
//! whoever buried it (the dispatcher, an operator, or a fan-out that found its event
//! malformed). Every death is announced by one such event, published in the transaction that
//! marks the delivery dead.
//!
//! This module owns the event's type, id and payload. It must never write anything: the
//! burying transaction publishes what it builds.

use bson::doc;

use crate::event::NewEvent;

/// The type of the event published when a delivery dies.
pub const DEAD_LETTER_EVENT_TYPE: &str = "relayhost.delivery.dead";

/// What a dead-letter event says, however the delivery died.
pub(crate) struct Death<'a> {
    /// The dead-letter event's id: unique per burial, so a requeued delivery that dies again
    /// announces it again, and a burial retried announces it once.
    pub id: String,
    pub delivery_id: String,
    pub event_id: &'a str,
    pub event_type: &'a str,
    pub handler: &'a str,
    pub key: Option<&'a str>,
    pub attempts: u32,
    pub reason: &'a str,
}

impl Death<'_> {
    /// Whether it is announced at all: the deaths of dead-letter deliveries are not, so a
    /// failing hook handler cannot loop.
    pub fn announced(&self) -> bool {
        self.event_type != DEAD_LETTER_EVENT_TYPE
    }

    pub fn event(&self) -> NewEvent {
        let mut payload = doc! {
            "deliveryId": &self.delivery_id,
            "eventId": self.event_id,
            "eventType": self.event_type,
            "handler": self.handler,
            "attempts": i64::from(self.attempts),
            "lastError": self.reason,
        };
        if let Some(key) = self.key {
            payload.insert("key", key);
        }
        let mut event = NewEvent::new(&self.id, DEAD_LETTER_EVENT_TYPE, payload);
        event.causation_id = Some(self.event_id.to_string());
        event
    }
}
