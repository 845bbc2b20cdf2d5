//! The claim loop: fan out, claim up to free capacity, run each delivery, settle it.
//!
//! Completions that finish close together are settled with one `complete_many`; failures are
//! rescheduled with the handler's backoff or buried with a dead letter; leases of running
//! deliveries are renewed; a delivery whose attempts are used up (its workers kept dying) is
//! buried without running again. A retry's due time sets a timer that wakes the loop. A stop
//! ends claiming, lets running deliveries finish up to a timeout, cancels the rest and hands
//! them and the lanes back without charging an attempt.
//!
//! Store errors inside the loop (a network blip, an election) are logged and the loop goes
//! on at the next poll: a delivery whose outcome could not be written is retried after its
//! lease expires, so nothing is lost.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bson::DateTime;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::AbortHandle;
use tokio::time::Instant;

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
    /// Claims happen at least this often, and whenever a delivery finishes, a wakeup comes
    /// or a retry falls due.
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
}

impl DispatcherCounters {
    fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// The claim loop of one store instance.
pub struct Dispatcher<S: Store, R: Runner> {
    store: Arc<S>,
    runner: Arc<R>,
    options: DispatcherOptions,
    wakeup: Arc<Notify>,
    counters: Arc<DispatcherCounters>,
}

struct Running {
    lease: Lease,
    renew: bool,
    task: AbortHandle,
}

/// Loop state the settle and stop steps share.
struct Flight {
    running: HashMap<DeliveryId, Running>,
    /// Due times of retries this dispatcher scheduled, earliest first.
    retry_timers: BinaryHeap<Reverse<Instant>>,
    /// What the next step should look for. A claim costs several round trips, so the loop
    /// claims only when something may have become claimable.
    fan_out: bool,
    claim: bool,
    /// The last claim filled all the free capacity: more may be waiting.
    backlog: bool,
}

impl<S: Store, R: Runner> Dispatcher<S, R> {
    pub fn new(store: Arc<S>, runner: Arc<R>, options: DispatcherOptions) -> Self {
        Self { store, runner, options, wakeup: Arc::new(Notify::new()), counters: Arc::default() }
    }

    pub fn counters(&self) -> Arc<DispatcherCounters> {
        self.counters.clone()
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
        let mut flight =
            Flight { running: HashMap::new(), retry_timers: BinaryHeap::new(), fan_out: true, claim: true, backlog: false };
        let mut renewal = tokio::time::interval(self.options.lease_duration / 3);
        renewal.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_retry = flight.retry_timers.peek().map(|Reverse(at)| *at);
            // New events appear only with a wakeup or by the poll; a finished delivery brings
            // none, and makes a claim worth it only when it may have unblocked something.
            let step = tokio::select! {
                () = &mut stop => break,
                () = self.wakeup.notified() => { flight.fan_out = true; flight.claim = true; Ok(()) }
                () = tokio::time::sleep(self.options.poll_interval) => { flight.fan_out = true; flight.claim = true; Ok(()) }
                () = sleep_until_some(next_retry) => {
                    let now = Instant::now();
                    while flight.retry_timers.peek().is_some_and(|Reverse(at)| *at <= now) {
                        flight.retry_timers.pop();
                    }
                    flight.claim = true;
                    Ok(())
                }
                Some(done) = finished.recv() => {
                    let mut batch = vec![done];
                    while let Ok(more) = finished.try_recv() {
                        batch.push(more);
                    }
                    self.settle(batch, &mut flight).await
                }
                _ = renewal.tick() => self.renew(&flight.running).await,
            };
            let step = match step {
                Ok(()) => self.dispatch(&permits, &finished_tx, &mut flight).await,
                Err(error) => Err(error),
            };
            if let Err(error) = step {
                DispatcherCounters::add(&self.counters.store_errors, 1);
                tracing::warn!(%error, "store error; trying again at the next poll");
                flight.fan_out = true;
                flight.claim = true;
            }
        }
        self.stop(&mut flight, &mut finished).await
    }

    /// Fans out when asked to, then claims up to the free capacity and starts the runs.
    async fn dispatch(
        &self,
        permits: &Arc<Semaphore>,
        finished_tx: &mpsc::UnboundedSender<(ClaimedDelivery, RunResult)>,
        flight: &mut Flight,
    ) -> Result<(), StoreError> {
        let specs = self.runner.handlers();
        if specs.is_empty() {
            return Ok(());
        }
        if flight.fan_out {
            let subscriptions = Subscriptions::new(
                specs.iter().map(|s| Subscription::new(s.handler.clone(), s.event_types.iter().cloned())),
            )?;
            // A short batch means nothing was left: no second transaction to find that out.
            let started = Instant::now();
            while self.store.fan_out(&subscriptions, self.options.fan_out_batch, DateTime::now()).await?.events
                >= self.options.fan_out_batch
            {}
            tracing::trace!(elapsed_us = started.elapsed().as_micros() as u64, "fanned out");
            flight.fan_out = false;
        }
        let free = permits.available_permits();
        if free == 0 || !(flight.claim || flight.backlog) {
            return Ok(());
        }
        flight.claim = false;
        let handlers: Vec<String> = specs.iter().map(|s| s.handler.clone()).collect();
        let started = Instant::now();
        let claimed = self.store.claim(&handlers, free, DateTime::now()).await?;
        tracing::trace!(elapsed_us = started.elapsed().as_micros() as u64, count = claimed.len(), "claimed");
        flight.backlog = claimed.len() >= free;
        for delivery in claimed {
            let Some(spec) = specs.iter().find(|s| s.handler == delivery.handler) else { continue };
            if delivery.attempts >= spec.retry.max_attempts {
                // Its workers kept dying while running it: dead without running again.
                let reason = format!("{} attempts used up by workers that stopped while running it", delivery.attempts);
                bury_with_dead_letter(&*self.store, &delivery, &reason, false, DateTime::now()).await?;
                DispatcherCounters::add(&self.counters.dead, 1);
                // Its dead letter is a new event, and its key may move on.
                flight.fan_out = true;
                flight.claim = true;
                continue;
            }
            let permit = permits.clone().acquire_owned().await.expect("the semaphore is never closed");
            let (runner, finished_tx) = (self.runner.clone(), finished_tx.clone());
            let lease = delivery.lease;
            let task = tokio::spawn(async move {
                let result = runner.run(delivery.clone()).await;
                drop(permit);
                let _ = finished_tx.send((delivery, result));
            });
            flight.running.insert(lease.delivery, Running { lease, renew: !spec.transactional, task: task.abort_handle() });
        }
        Ok(())
    }

    /// Settles finished runs, and notes what they may have made worth a fan-out or a claim.
    async fn settle(&self, batch: Vec<(ClaimedDelivery, RunResult)>, flight: &mut Flight) -> Result<(), StoreError> {
        let specs = self.runner.handlers();
        let now = DateTime::now();
        let mut completions = Vec::new();
        for (delivery, result) in batch {
            flight.running.remove(&delivery.lease.delivery);
            // A keyed delivery that ends (however) may let its key's next one go.
            flight.claim |= delivery.event.key.is_some();
            let attempt = match result {
                RunResult::CompletedInTransaction => {
                    DispatcherCounters::add(&self.counters.completed, 1);
                    continue;
                }
                RunResult::LeaseLost => continue,
                RunResult::NotRun => {
                    self.store.release(&[delivery.lease], now).await?;
                    DispatcherCounters::add(&self.counters.released, 1);
                    flight.claim = true;
                    continue;
                }
                RunResult::Attempt(attempt) => attempt,
            };
            let policy = specs.iter().find(|s| s.handler == delivery.handler).map(|s| s.retry).unwrap_or_default();
            match decide(attempt, delivery.attempts + 1, &policy, now) {
                Settle::Complete => completions.push(delivery.lease),
                Settle::Reschedule { due_at, reason } => {
                    self.store.reschedule(&delivery.lease, due_at, &reason, now).await?;
                    DispatcherCounters::add(&self.counters.retried, 1);
                    let wait = Duration::from_millis(due_at.timestamp_millis().saturating_sub(now.timestamp_millis()).max(0) as u64);
                    flight.retry_timers.push(Reverse(Instant::now() + wait));
                }
                Settle::Bury { reason } => {
                    bury_with_dead_letter(&*self.store, &delivery, &reason, true, now).await?;
                    DispatcherCounters::add(&self.counters.dead, 1);
                    // Its dead letter is a new event: fan it out at once.
                    flight.fan_out = true;
                    flight.claim = true;
                }
            }
        }
        if !completions.is_empty() {
            let settled = self.store.complete_many(&completions, now).await?;
            let done = settled.iter().filter(|s| matches!(s, crate::store::Settlement::Completed)).count();
            DispatcherCounters::add(&self.counters.completed, done);
        }
        Ok(())
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
        flight: &mut Flight,
        finished: &mut mpsc::UnboundedReceiver<(ClaimedDelivery, RunResult)>,
    ) -> Result<(), StoreError> {
        let deadline = Instant::now() + self.options.shutdown_timeout;
        while !flight.running.is_empty() {
            match tokio::time::timeout_at(deadline, finished.recv()).await {
                Ok(Some(done)) => {
                    if let Err(error) = self.settle(vec![done], flight).await {
                        tracing::warn!(%error, "settling a delivery during the stop failed; its lease will expire");
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
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
        self.store.relinquish().await
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
