//! Writes one audit document per event, in the delivery's transaction: the document and the
//! delivery's completion commit together, so each event is recorded exactly once. A keyed
//! event is also appended to its key's entry in `audit_order`, in handling order, which
//! shows that a key's events were handled one at a time, in sequence.

use relayhost_guest::prelude::*;
use serde_json::{Value, json};

struct AuditLog;

impl Plugin for AuditLog {
    fn subscriptions() -> Vec<Subscription> {
        vec![Subscription::new("audit-log", ["order.placed", "order.paid"]).transactional()]
    }

    fn handle(event: Event, context: DeliveryContext) -> Result<(), Failure> {
        let payload: Value = event.payload()?;
        let record = json!({
            "_id": event.id, "type": event.event_type, "key": event.key,
            "sequence": event.sequence, "payload": payload, "attempt": context.attempt,
        });
        transaction::insert("audit_log", &record.to_string())?;
        if let Some(key) = &event.key {
            let filter = json!({ "_id": key }).to_string();
            let push = json!({ "$push": { "events": event.id } }).to_string();
            if transaction::update("audit_order", &filter, &push)? == 0 {
                transaction::insert("audit_order", &json!({ "_id": key, "events": [event.id] }).to_string())?;
            }
        }
        Ok(())
    }
}

relayhost_guest::export_plugin!(AuditLog);
