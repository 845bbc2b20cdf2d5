//! The dead-letter hook: when a delivery dies, the event `relayhost.delivery.dead` is
//! published in the same transaction that marks it dead, so a plugin can subscribe to it and
//! the two never happen apart.

use bson::DateTime;

pub use crate::death::DEAD_LETTER_EVENT_TYPE;
use crate::death::Death;
use crate::event::NewEvent;
use crate::store::{ClaimedDelivery, DeliveryView, Retrying, Settlement, Store, StoreError};

/// The dead-letter event of `delivery`, dead after `attempts` attempts with `reason`. Its id is
/// unique per burial, so a requeued delivery that dies again announces it again.
pub fn dead_letter_event(delivery: &ClaimedDelivery, attempts: u32, reason: &str) -> NewEvent {
    let death = Death {
        id: format!("dead:{}:{}", delivery.lease.delivery.to_hex(), delivery.lease.claims),
        delivery_id: delivery.lease.delivery.to_hex(),
        event_id: &delivery.event.id,
        event_type: &delivery.event.event_type,
        handler: &delivery.handler,
        key: delivery.event.key.as_deref(),
        attempts,
        reason,
    };
    let mut event = death.event();
    event.correlation_id = delivery.event.correlation_id.clone();
    event
}

/// Operator action: buries a pending delivery that is not running and announces its death in
/// the same transaction (unless it is itself a dead-letter delivery, as with any burial).
pub async fn bury_by_operator<S: Store>(store: &S, delivery_id: &str, reason: &str) -> Result<DeliveryView, StoreError> {
    let mut retrying = Retrying::new();
    loop {
        let now = DateTime::now();
        let mut tx = store.begin().await?;
        let attempt = async {
            let buried = store.bury_pending_in(&mut tx, delivery_id, reason, now).await?;
            let death = Death {
                    // Unique per burial: the same delivery may be requeued and buried again.
                id: format!("dead:{}:operator:{}", buried.id, now.timestamp_millis()),
                delivery_id: buried.id.clone(),
                event_id: &buried.event_id,
                event_type: &buried.event_type,
                handler: &buried.handler,
                key: buried.key.as_deref(),
                attempts: buried.attempts,
                reason,
            };
            if death.announced() {
                store.publish(&mut tx, &death.event()).await?;
            }
            Ok(buried)
        }
        .await;
        if let Some(result) = retrying.settle(tx, attempt).await {
            return result;
        }
    }
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
