//! A CPU-bound handler: folds the payload through FNV-1a `rounds` times (from the payload,
//! default 100,000). The benchmarks use it to measure what fuel metering costs.

use relayhost_guest::prelude::*;

struct Checksum;

impl Plugin for Checksum {
    fn subscriptions() -> Vec<Subscription> {
        vec![Subscription::new("checksum", ["bench"])]
    }

    fn handle(event: Event, _context: DeliveryContext) -> Result<(), Failure> {
        let payload: serde_json::Value = event.payload()?;
        let rounds = payload["rounds"].as_u64().unwrap_or(100_000);
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for round in 0..rounds {
            for byte in event.payload.as_bytes().iter().chain(&round.to_le_bytes()) {
                hash ^= u64::from(*byte);
                hash = hash.wrapping_mul(0x0100_0000_01b3);
            }
        }
        log::debug(&format!("checksum {hash:016x}"));
        Ok(())
    }
}

relayhost_guest::export_plugin!(Checksum);
