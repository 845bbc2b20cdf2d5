//! The scheduled purge: every `retention.every`, the host whose turn it is (one at a time,
//! see [`Hosts::take_turn`]) deletes what `[retention]` no longer keeps, in the store's
//! bounded batches, and logs what went. It owns the schedule only: what may go, and how, is
//! the store's purge; it never runs two purges at once on one host.

use std::sync::Arc;
use std::time::Duration;

use bson::DateTime;
use tokio::task::JoinHandle;

use crate::config::RetentionConfig;
use crate::store::Store;

/// The name of the purge's turn.
const TURN: &str = "retention";

/// Runs the purge every `retention.every` on whichever host takes the turn; nothing when the
/// configuration keeps everything.
pub fn spawn<S: Store>(store: Arc<S>, retention: RetentionConfig) -> Option<JoinHandle<()>> {
    if !retention.purges() {
        return None;
    }
    let every = retention.every.0;
    Some(tokio::spawn(async move {
        // The first turn a little after the start (hosts started together do not all ask at once).
        let mut next = tokio::time::Instant::now() + every.min(Duration::from_secs(5)) + jitter(every / 10);
        loop {
            tokio::time::sleep_until(next).await;
            next = tokio::time::Instant::now() + every;
            let now = DateTime::now();
            match store.take_turn(TURN, every, now).await {
                Ok(true) => purge(&*store, &retention, now).await,
                Ok(false) => tracing::debug!("another host purges this turn"),
                Err(error) => tracing::warn!(%error, "taking the purge's turn failed; trying at the next"),
            }
        }
    }))
}

async fn purge<S: Store>(store: &S, retention: &RetentionConfig, now: DateTime) {
    let started = std::time::Instant::now();
    match store.purge(&retention.purge_options(now), now).await {
        Ok(report) => tracing::info!(
            events = report.events,
            dead_deliveries = report.dead_deliveries,
            history_records = report.history_records,
            key_counters = report.key_counters,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "retention: purged"
        ),
        Err(error) => tracing::warn!(%error, "retention: the purge failed; what it deleted stays deleted, the rest goes next turn"),
    }
}

/// Up to `most`, from the clock's sub-second digits (no random source needed for this).
fn jitter(most: Duration) -> Duration {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    most.mul_f64(f64::from(nanos % 1_000) / 1_000.0)
}
