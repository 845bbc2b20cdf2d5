//! A relayhost handler in Rust: checks each placed order and logs it, as the Python,
//! JavaScript and C order checks do. `relayhost new --lang rust` starts a project from it.

use relayhost_guest::prelude::*;
use serde_json::Value;

struct OrderCheck;

impl Plugin for OrderCheck {
    fn subscriptions() -> Vec<Subscription> {
        vec![Subscription::new("rs-order-check", ["order.placed"])]
    }

    fn handle(event: Event, context: DeliveryContext) -> Result<(), Failure> {
        let order: Value = event.payload()?;
        let Some(order_id) = order["orderId"].as_str() else {
            return Err(Failure::unprocessable("order without orderId"));
        };
        if order["total"].as_f64().unwrap_or(0.0) < 0.0 {
            return Err(Failure::retry("negative total, asking again later"));
        }
        log::info(&format!("order {order_id} checked on attempt {}", context.attempt));
        Ok(())
    }
}

relayhost_guest::export_plugin!(OrderCheck);
