//! Records every dead delivery the host announces (`relayhost.delivery.dead`) in the
//! `dead_letter_alerts` collection, in the delivery's transaction: one document per burial,
//! with the handler, the event, the attempts and the last error, for a dashboard or a pager.

use relayhost_guest::prelude::*;
use serde_json::{Value, json};

struct DeadLetterAlert;

impl Plugin for DeadLetterAlert {
    fn subscriptions() -> Vec<Subscription> {
        vec![Subscription::new("dead-letter-alert", ["relayhost.delivery.dead"]).transactional()]
    }

    fn handle(event: Event, _context: DeliveryContext) -> Result<(), Failure> {
        let dead: Value = event.payload()?;
        let alert = json!({
            "_id": event.id, "handler": dead["handler"], "eventId": dead["eventId"],
            "eventType": dead["eventType"], "key": dead["key"], "attempts": dead["attempts"],
            "lastError": dead["lastError"],
        });
        transaction::insert("dead_letter_alerts", &alert.to_string())?;
        log::warn(&format!("delivery of {} to {} is dead: {}", dead["eventId"], dead["handler"], dead["lastError"]));
        Ok(())
    }
}

relayhost_guest::export_plugin!(DeadLetterAlert);
