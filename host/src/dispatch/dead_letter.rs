//! The dead-letter hook: when a delivery dies, the event `relayhost.delivery.dead` is
//! published in the same transaction that marks it dead, so a plugin can subscribe to it and
//! the two never happen apart.

use bson::{DateTime, doc};

use crate::event::NewEvent;
use crate::store::{ClaimedDelivery, Retrying, Settlement, Store, StoreError};

/// The type of the event published when a delivery dies.
pub const DEAD_LETTER_EVENT_TYPE: &str = "relayhost.delivery.dead";

/// The dead-letter event of `delivery`, dead after `attempts` attempts with `reason`. Its id is
/// unique per burial, so a requeued delivery that dies again announces it again.
pub fn dead_letter_event(delivery: &ClaimedDelivery, attempts: u32, reason: &str) -> NewEvent {
    let mut payload = doc! {
        "deliveryId": delivery.lease.delivery.to_hex(),
        "eventId": &delivery.event.id,
        "eventType": &delivery.event.event_type,
        "handler": &delivery.handler,
        "attempts": i64::from(attempts),
        "lastError": reason,
    };
    if let Some(key) = &delivery.event.key {
        payload.insert("key", key);
    }
    let mut event = NewEvent::new(
        format!("dead:{}:{}", delivery.lease.delivery.to_hex(), delivery.lease.claims),
        DEAD_LETTER_EVENT_TYPE,
        payload,
    );
    event.causation_id = Some(delivery.event.id.clone());
    event.correlation_id = delivery.event.correlation_id.clone();
    event
}

/// Buries `delivery` and publishes its dead-letter event in one transaction. The dead letters
/// of dead-letter events are not announced again, so a failing hook handler cannot loop.
pub async fn bury_with_dead_letter<S: Store>(
    store: &S,
    delivery: &ClaimedDelivery,
    reason: &str,
    charge_attempt: bool,
    now: DateTime,
) -> Result<Settlement, StoreError> {
    if delivery.event.event_type == DEAD_LETTER_EVENT_TYPE {
        return store.bury(&delivery.lease, reason, charge_attempt, now).await;
    }
    let attempts = delivery.attempts + u32::from(charge_attempt);
    let event = dead_letter_event(delivery, attempts, reason);
    // A loop rather than `run_in_transaction`: its async closure would make this future
    // lose `Send`, and the dispatcher runs it in spawned tasks.
    let mut retrying = Retrying::new();
    let buried = loop {
        let mut tx = store.begin().await?;
        let attempt = async {
            store.publish(&mut tx, &event).await?;
            store.bury_in(&mut tx, &delivery.lease, reason, charge_attempt, now).await
        }
        .await;
        if let Some(result) = retrying.settle(tx, attempt).await {
            break result;
        }
    };
    match buried {
        Ok(()) => Ok(Settlement::Completed),
        Err(StoreError::LeaseLost(_)) => Ok(Settlement::LeaseLost),
        Err(error) => Err(error),
    }
}
