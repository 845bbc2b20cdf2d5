//! The claim loop: fan out, claim up to free capacity, run each delivery, settle it.
//!
//! Completions that finish close together are settled with one `complete_many`; failures are
//! rescheduled with the handler's backoff or buried with a dead letter; leases of running
//! deliveries are renewed; a delivery whose attempts are used up (its workers kept dying) is
//! buried without running again. A stop ends claiming, lets running deliveries finish up to a
//! timeout and hands the lanes back.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bson::DateTime;
use tokio::sync::{Notify, Semaphore, mpsc};

use super::{AttemptResult, RetryPolicy, Settle, bury_with_dead_letter, decide};
use crate::store::{ClaimedDelivery, DeliveryId, Lease, Store, StoreError, Subscription, Subscriptions};

/// A handler the runner offers, with its retry policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerSpec {
    pub handler: String,
    pub event_types: Vec<String>,
    pub retry: RetryPolicy,
    /// Completes inside its own transaction: its lease is not renewed (a renewal would
    /// conflict with that completion), so the lease must outlast it.
    pub transactional: bool,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunResult {
    Attempt(AttemptResult),
    /// The runner completed the delivery in the handler's own transaction.
    CompletedInTransaction,
    /// Nothing ran (no plugin serves the handler any more): hand it back, uncharged.
    NotRun,
    /// The lease was lost while it ran; another worker owns the delivery now.
    LeaseLost,
}

/// Runs deliveries. The host implements it with plugins; the dispatcher never knows how.
pub trait Runner: Send + Sync + 'static {
    fn handlers(&self) -> Vec<HandlerSpec>;
    fn run(&self, delivery: ClaimedDelivery) -> Pin<Box<dyn Future<Output = RunResult> + Send>>;
}

#[derive(Debug, Clone)]
pub struct DispatcherOptions {
    /// Deliveries running at once in this process.
    pub concurrency: usize,
    /// Claims happen at least this often, and whenever a delivery finishes or a wakeup comes.
    pub poll_interval: Duration,
    pub fan_out_batch: usize,
    pub lease_duration: Duration,
    /// How long a stop waits for running deliveries.
    pub shutdown_timeout: Duration,
}

impl Default for DispatcherOptions {
    fn default() -> Self {
        Self {
            concurrency: 32,
            poll_interval: Duration::from_millis(500),
            fan_out_batch: 200,
            lease_duration: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(10),
        }
    }
}

/// The claim loop of one store instance.
pub struct Dispatcher<S: Store, R: Runner> {
    store: Arc<S>,
    runner: Arc<R>,
    options: DispatcherOptions,
    wakeup: Arc<Notify>,
}

struct Running {
    lease: Lease,
    renew: bool,
}

impl<S: Store, R: Runner> Dispatcher<S, R> {
    pub fn new(store: Arc<S>, runner: Arc<R>, options: DispatcherOptions) -> Self {
        Self { store, runner, options, wakeup: Arc::new(Notify::new()) }
    }

    /// Wakes the loop now (new events committed, a retry came due).
    pub fn waker(&self) -> Arc<Notify> {
        self.wakeup.clone()
    }

    /// Runs until `stop` resolves, then stops gracefully.
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<(), StoreError> {
        tokio::pin!(stop);
        let permits = Arc::new(Semaphore::new(self.options.concurrency));
        let (finished_tx, mut finished) = mpsc::unbounded_channel::<(ClaimedDelivery, RunResult)>();
        let mut running: HashMap<DeliveryId, Running> = HashMap::new();
        let mut renewal = tokio::time::interval(self.options.lease_duration / 3);
        renewal.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // New events appear only with a wakeup or by the poll; a finished delivery frees
        // capacity but brings none, so it leads straight to a claim without a fan-out.
        let mut look_for_events = true;
        loop {
            tokio::select! {
                () = &mut stop => break,
                () = self.wakeup.notified() => look_for_events = true,
                () = tokio::time::sleep(self.options.poll_interval) => look_for_events = true,
                Some(done) = finished.recv() => {
                    let mut batch = vec![done];
                    while let Ok(more) = finished.try_recv() {
                        batch.push(more);
                    }
                    // A burial publishes a dead-letter event: fan it out at once.
                    look_for_events |= self.settle(batch, &mut running).await?;
                }
                _ = renewal.tick() => self.renew(&running).await?,
            }
            let specs = self.runner.handlers();
            if specs.is_empty() {
                continue;
            }
            if std::mem::take(&mut look_for_events) {
                let subscriptions = Subscriptions::new(
                    specs.iter().map(|s| Subscription::new(s.handler.clone(), s.event_types.iter().cloned())),
                )?;
                while self.store.fan_out(&subscriptions, self.options.fan_out_batch, DateTime::now()).await?.events > 0 {}
            }
            let free = permits.available_permits();
            if free == 0 {
                continue;
            }
            let handlers: Vec<String> = specs.iter().map(|s| s.handler.clone()).collect();
            for delivery in self.store.claim(&handlers, free, DateTime::now()).await? {
                let Some(spec) = specs.iter().find(|s| s.handler == delivery.handler) else { continue };
                if delivery.attempts >= spec.retry.max_attempts {
                    // Its workers kept dying while running it: dead without running again.
                    let reason = format!("{} attempts used up by workers that stopped while running it", delivery.attempts);
                    bury_with_dead_letter(&*self.store, &delivery, &reason, false, DateTime::now()).await?;
                    look_for_events = true;
                    continue;
                }
                let permit = permits.clone().acquire_owned().await.expect("the semaphore is never closed");
                running.insert(delivery.lease.delivery, Running { lease: delivery.lease, renew: !spec.transactional });
                let (runner, finished_tx) = (self.runner.clone(), finished_tx.clone());
                tokio::spawn(async move {
                    let result = runner.run(delivery.clone()).await;
                    drop(permit);
                    let _ = finished_tx.send((delivery, result));
                });
            }
        }
        self.stop(&mut running, &mut finished).await
    }

    /// Settles finished runs; returns whether a dead letter was published.
    async fn settle(
        &self,
        batch: Vec<(ClaimedDelivery, RunResult)>,
        running: &mut HashMap<DeliveryId, Running>,
    ) -> Result<bool, StoreError> {
        let mut published = false;
        let specs = self.runner.handlers();
        let now = DateTime::now();
        let mut completions = Vec::new();
        for (delivery, result) in batch {
            running.remove(&delivery.lease.delivery);
            let attempt = match result {
                RunResult::CompletedInTransaction | RunResult::LeaseLost => continue,
                RunResult::NotRun => {
                    self.store.release(&[delivery.lease], now).await?;
                    continue;
                }
                RunResult::Attempt(attempt) => attempt,
            };
            let policy = specs.iter().find(|s| s.handler == delivery.handler).map(|s| s.retry).unwrap_or_default();
            match decide(attempt, delivery.attempts + 1, &policy, now) {
                Settle::Complete => completions.push(delivery.lease),
                Settle::Reschedule { due_at, reason } => {
                    self.store.reschedule(&delivery.lease, due_at, &reason, now).await?;
                }
                Settle::Bury { reason } => {
                    bury_with_dead_letter(&*self.store, &delivery, &reason, true, now).await?;
                    published = true;
                }
            }
        }
        if !completions.is_empty() {
            self.store.complete_many(&completions, now).await?;
        }
        Ok(published)
    }

    async fn renew(&self, running: &HashMap<DeliveryId, Running>) -> Result<(), StoreError> {
        let leases: Vec<Lease> = running.values().filter(|r| r.renew).map(|r| r.lease).collect();
        if !leases.is_empty() {
            self.store.extend_lease(&leases, DateTime::now()).await?;
        }
        Ok(())
    }

    async fn stop(
        &self,
        running: &mut HashMap<DeliveryId, Running>,
        finished: &mut mpsc::UnboundedReceiver<(ClaimedDelivery, RunResult)>,
    ) -> Result<(), StoreError> {
        let deadline = tokio::time::Instant::now() + self.options.shutdown_timeout;
        while !running.is_empty() {
            match tokio::time::timeout_at(deadline, finished.recv()).await {
                Ok(Some(done)) => {
                    self.settle(vec![done], running).await?;
                }
                Ok(None) | Err(_) => break,
            }
        }
        if !running.is_empty() {
            tracing::warn!(count = running.len(), "stopping with deliveries still running; their leases will expire");
        }
        self.store.relinquish().await
    }
}
