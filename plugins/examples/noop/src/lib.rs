//! Accepts every event and does nothing: the baseline of the runtime's overhead.

use relayhost_guest::prelude::*;

struct Noop;

impl Plugin for Noop {
    fn subscriptions() -> Vec<Subscription> {
        vec![Subscription::new("noop", ["order.placed", "bench"])]
    }

    fn handle(_event: Event, _context: DeliveryContext) -> Result<(), Failure> {
        Ok(())
    }
}

relayhost_guest::export_plugin!(Noop);
