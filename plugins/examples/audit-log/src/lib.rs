//! Writes one audit document per event, in the delivery's transaction: the document and the
//! delivery's completion commit together, so each event is recorded exactly once.

use relayhost_guest::prelude::*;
use serde_json::{Value, json};

struct AuditLog;

impl Plugin for AuditLog {
    fn subscriptions() -> Vec<Subscription> {
        vec![Subscription::new("audit-log", ["order.placed", "order.paid"]).transactional()]
    }

    fn handle(event: Event, _context: DeliveryContext) -> Result<(), Failure> {
        let payload: Value = event.payload()?;
        let record = json!({
            "_id": event.id, "type": event.event_type, "key": event.key,
            "sequence": event.sequence, "payload": payload,
        });
        transaction::insert("audit_log", &record.to_string())?;
        Ok(())
    }
}

relayhost_guest::export_plugin!(AuditLog);
