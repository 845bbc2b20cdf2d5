//! How a dispatcher is set up (run slots, claims ahead, intervals, leases) and what it counts
//! as it goes. It decides nothing: the loop (`dispatcher`) reads these.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct DispatcherOptions {
    /// Deliveries running at once in this process.
    pub concurrency: usize,
    /// Deliveries a claim may take beyond the free run slots, to wait for one. Bigger claims
    /// cost fewer round trips per delivery; the waiting ones keep their lane leased (so a
    /// process that dies charges them an attempt, like the running ones). Finished runs whose
    /// completion is not written yet may add as many again before claims wait for them.
    pub claim_ahead: usize,
    /// Claims happen at least this often, and whenever a delivery finishes, a wakeup comes
    /// or a retry falls due.
    pub poll_interval: Duration,
    pub fan_out_batch: usize,
    pub lease_duration: Duration,
    /// How long a stop waits for running deliveries.
    pub shutdown_timeout: Duration,
    /// The event types' schemas fan-outs check payloads against (the set in force at each
    /// fan-out).
    pub schemas: crate::event_schema::SchemaSource,
}

/// The default `claim_ahead` per run slot. Claims of a few times the run slots cost about as
/// much as small ones and keep the slots fed under a backlog (measured with `relayhost bench`);
/// more would let one host hoard work that other hosts could run.
pub const CLAIM_AHEAD_PER_RUN_SLOT: usize = 4;

impl DispatcherOptions {
    /// The default `claim_ahead` for `concurrency` run slots.
    pub fn default_claim_ahead(concurrency: usize) -> usize {
        concurrency.saturating_mul(CLAIM_AHEAD_PER_RUN_SLOT)
    }
}

impl Default for DispatcherOptions {
    fn default() -> Self {
        // Handlers mostly wait on the network (webhooks, mail, other services), so run slots
        // are cheap; and under a backlog, fan-outs hand out up to the capacity they make, in
        // bigger batches that write fewer lane lists per delivery. 64 drained 6,975-7,147
        // deliveries/s against 5,969-6,117 for 32 in interleaved `relayhost bench` runs. The
        // price is memory: up to this many instances at once, each within its plugin's limit.
        let concurrency = 64;
        Self {
            concurrency,
            claim_ahead: Self::default_claim_ahead(concurrency),
            poll_interval: Duration::from_millis(500),
            fan_out_batch: 200,
            lease_duration: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(10),
            schemas: Default::default(),
        }
    }
}

/// What a dispatcher has done since it started.
#[derive(Debug, Default)]
pub struct DispatcherCounters {
    pub completed: AtomicU64,
    pub retried: AtomicU64,
    pub dead: AtomicU64,
    /// Handed back uncharged: nothing served the handler, or a stop cut the run short.
    pub released: AtomicU64,
    /// Store errors the loop logged and went on from.
    pub store_errors: AtomicU64,
    /// Keyed deliveries that started after a higher sequence of their key (see
    /// `SequenceWatch`).
    pub out_of_order: AtomicU64,
}

impl DispatcherCounters {
    pub(super) fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
