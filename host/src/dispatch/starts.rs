//! The starts of suspect deliveries claimed ahead, recorded before they run, several at once.
//!
//! A claim (or a fan-out's hand-out) takes more deliveries than there are free run slots;
//! those beyond are listed in their lanes as not started, so that a host that dies is charged
//! an attempt only for what it was running. Their starts are not recorded (a lane write per
//! handful of deliveries cost a drain about a third of its rate, measured), so a death finds
//! them unstarted whether they waited or ran: they are not charged, and become suspect. A
//! suspect claimed ahead has its start recorded in its lane when it gets its run slot, before
//! the handler runs: a delivery that kills its host every time is charged at every death but
//! the first, and goes dead after at most `max_attempts + 1` of them. Every start waiting at the
//! moment a write goes out goes with it.
//!
//! This module owns that batching. It must never let a delivery run whose start was not
//! recorded, and never charge or settle anything itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::store::{Lease, Store};

/// What became of a start: recorded, or refused because the lease is no longer current
/// (`None`: the write failed, and the start is asked for again).
type Reply = oneshot::Sender<Option<bool>>;

/// The first wait after a failed write; doubled up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Sends starts to the one background task that writes them.
#[derive(Clone)]
pub(super) struct StartRecorder {
    requests: mpsc::UnboundedSender<(Lease, Reply)>,
}

impl StartRecorder {
    /// Starts the background writer, which ends when the last recorder is dropped.
    pub fn spawn<S: Store>(store: Arc<S>) -> Self {
        let (requests, mut waiting) = mpsc::unbounded_channel::<(Lease, Reply)>();
        tokio::spawn(async move {
            while let Some(first) = waiting.recv().await {
                let mut batch = vec![first];
                while let Ok(more) = waiting.try_recv() {
                    batch.push(more);
                }
                let leases: Vec<Lease> = batch.iter().map(|(lease, _)| *lease).collect();
                match store.record_starts(&leases).await {
                    Ok(flags) => {
                        for ((_, reply), recorded) in batch.into_iter().zip(flags) {
                            let _ = reply.send(Some(recorded));
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, starts = leases.len(), "recording the starts of deliveries claimed ahead failed; they wait");
                        for (_, reply) in batch {
                            let _ = reply.send(None);
                        }
                    }
                }
            }
        });
        Self { requests }
    }

    /// Records that `lease`'s delivery starts now; `false` when the lease is lost (it must not
    /// run). While the store cannot be written, it waits and asks again.
    pub async fn record(&self, lease: Lease) -> bool {
        let mut wait = RETRY_FIRST;
        loop {
            let (reply, recorded) = oneshot::channel();
            if self.requests.send((lease, reply)).is_err() {
                return false;
            }
            match recorded.await {
                Ok(Some(recorded)) => return recorded,
                Ok(None) => {}
                // The writer is gone: the dispatcher stopped.
                Err(_) => return false,
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(RETRY_MAX);
        }
    }
}
