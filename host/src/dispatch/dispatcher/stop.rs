//! The loop's last step, **stop**: no more claims; a running fan-out finishes its batch (cut
//! short at the deadline); what has not started is handed back at once; running deliveries
//! get `shutdown_timeout` and are settled as they finish, the rest cancelled and handed back
//! uncharged; this host's shares of the limits across hosts go back, then its lanes. It
//! must never charge an attempt: the host chose to stop, no handler failed.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bson::DateTime;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;

use super::super::completion::step_result;
use super::super::flight::Flight;
use super::super::options::DispatcherCounters;
use super::super::runner::{RunResult, Runner};
use super::{Dispatcher, settle_batch};
use crate::store::{ClaimedDelivery, Lease, Store, StoreError};

impl<S: Store, R: Runner> Dispatcher<S, R> {
    pub(super) async fn stop(
        &self,
        permits: &Arc<Semaphore>,
        finished_tx: &mpsc::UnboundedSender<(ClaimedDelivery, RunResult)>,
        flight: &mut Flight<S>,
        finished: &mut mpsc::UnboundedReceiver<(ClaimedDelivery, RunResult)>,
    ) -> Result<(), StoreError> {
        // Deliveries still waiting at a gate, for their window or for a run slot come back as
        // not run, and are released.
        flight.global_shares.close();
        flight.start_windows.close();
        permits.close();
        let deadline = Instant::now() + self.options.shutdown_timeout;
        // The fan-out ends after its batch, and what that handed out is released unstarted.
        // Past the deadline it is cut short: whoever fans out next redoes an interrupted
        // batch, whose transaction never commits.
        flight.stop_fanning.store(true, Ordering::Relaxed);
        if let Some(mut fanning) = flight.fanning.take() {
            match tokio::time::timeout_at(deadline, &mut fanning).await {
                Ok(done) => match step_result(done, "the fan-out") {
                    Ok(done) => flight.handed_out.extend(done.claimed),
                    Err(error) => tracing::warn!(%error, "the last fan-out failed during the stop"),
                },
                Err(_) => fanning.abort(),
            }
        }
        while let Ok(claimed) = flight.early.try_recv() {
            flight.handed_out.extend(claimed);
        }
        let specs = self.runner.handlers();
        let handed_out = std::mem::take(&mut flight.handed_out);
        self.start(handed_out, &specs, permits, finished_tx, flight).await?;
        // Runs in flight that did not finish yet (the unsettled ones did).
        while flight.running.len() > flight.unsettled.len() {
            match tokio::time::timeout_at(deadline, finished.recv()).await {
                Ok(Some(done)) => {
                    let batch = settle_batch(flight, done, finished);
                    if let Err(error) = self.settle(batch, flight).await {
                        tracing::warn!(%error, "settling deliveries during the stop failed; their leases will expire");
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        let again = std::mem::take(&mut flight.unsettled);
        if let Err(error) = self.settle(again, flight).await {
            tracing::warn!(%error, count = flight.unsettled.len(), "outcomes that could not be written are left to their leases, which will expire");
            for (delivery, _) in flight.unsettled.drain(..) {
                flight.running.remove(&delivery.lease.delivery);
            }
        }
        let completed = flight.completions.flush().await?;
        DispatcherCounters::add(&self.counters.completed, completed);
        if !flight.running.is_empty() {
            // The host chose to stop these runs, the handlers did not fail: cancel them and
            // hand them back uncharged (a cancelled transactional run never commits).
            for running in flight.running.values() {
                running.task.abort();
            }
            let leases: Vec<Lease> = flight.running.values().map(|r| r.lease).collect();
            tracing::warn!(count = leases.len(), "stop timeout reached: cancelling the deliveries still running and releasing them");
            let released = self.store.release(&leases, DateTime::now()).await?;
            DispatcherCounters::add(&self.counters.released, released);
        }
        if !flight.global_shares.is_empty() {
            flight.global_shares.hand_back(&*self.store, &self.runner.handlers()).await;
        }
        self.store.relinquish().await
    }
}
