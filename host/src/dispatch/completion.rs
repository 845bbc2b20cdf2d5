//! Completion batching: successful runs wait here and are completed together by one
//! background `complete_many` at a time, so the claim loop never waits for a completion.
//!
//! It owns the waiting leases and the running `complete_many`; it must never decide how an
//! attempt settles (that is [`super::decide`]) and never drops a lease whose completion failed:
//! such a batch waits again and is tried after a pause.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bson::DateTime;
use tokio::task::{JoinError, JoinHandle};
use tokio::time::Instant;

use crate::lane::LaneId;
use crate::store::{Lease, Settlement, Store, StoreError};

/// What one background `complete_many` did.
pub(super) struct Written {
    pub completed: usize,
    /// The lanes of the keyed deliveries among them whose keys may have deliveries waiting
    /// for a claim ([`crate::store::SchedulerHints::followers_may_wait`]): those, in the same lanes, may be
    /// claimable there now.
    pub keyed_lanes: BTreeSet<LaneId>,
    /// Some of their keys have events a fan-out left unfanned while they ran here
    /// ([`crate::store::SchedulerHints::unfanned_may_wait`]): fan out again.
    pub fan_out: bool,
}

/// Leases with their delivery's handler and key, if it has one.
type Batch = Vec<(Lease, Option<(String, String)>)>;

pub(super) struct Completions<S: Store> {
    store: Arc<S>,
    /// How long a failed batch waits before it is tried again (unless resumed sooner).
    pause: Duration,
    waiting: Batch,
    running: Option<(JoinHandle<Result<usize, StoreError>>, Batch)>,
    paused_until: Option<Instant>,
}

impl<S: Store> Completions<S> {
    pub fn new(store: Arc<S>, pause: Duration) -> Self {
        Self { store, pause, waiting: Vec::new(), running: None, paused_until: None }
    }

    pub fn push(&mut self, lease: Lease, key: Option<(String, String)>) {
        self.waiting.push((lease, key));
    }

    /// Successful runs whose completion is not written yet.
    pub fn pending(&self) -> usize {
        self.waiting.len() + self.running.as_ref().map_or(0, |(_, batch)| batch.len())
    }

    /// Lets a paused batch be tried again at the next [`Completions::start`].
    pub fn resume(&mut self) {
        self.paused_until = None;
    }

    /// Starts a `complete_many` of everything waiting, unless one runs or a failure paused them.
    pub fn start(&mut self) {
        let paused = self.paused_until.is_some_and(|until| Instant::now() < until);
        if self.running.is_some() || self.waiting.is_empty() || paused {
            return;
        }
        let batch = std::mem::take(&mut self.waiting);
        let leases: Vec<Lease> = batch.iter().map(|(lease, _)| *lease).collect();
        let store = self.store.clone();
        let task = tokio::spawn(async move { complete(&*store, &leases).await });
        self.running = Some((task, batch));
    }

    /// How the running `complete_many` ended; never resolves while none runs.
    pub async fn ended(&mut self) -> Result<Written, StoreError> {
        let Some((task, _)) = &mut self.running else {
            return std::future::pending().await;
        };
        let result = step_result(task.await, "a completion");
        let (_, batch) = self.running.take().expect("a completion was running");
        match result {
            Ok(completed) => {
                let awaited = |key: &Option<(String, String)>| key.as_ref().is_some_and(|(h, k)| self.store.hints().followers_may_wait(h, k));
                let keyed_lanes = batch.iter().filter(|(_, key)| awaited(key)).map(|(lease, _)| lease.lane).collect();
                // Every key is asked (each note is taken once asked).
                let deferred = batch.iter().filter(|(_, key)| key.as_ref().is_some_and(|(_, k)| self.store.hints().unfanned_may_wait(k)));
                let fan_out = deferred.count() > 0;
                Ok(Written { completed, keyed_lanes, fan_out })
            }
            Err(error) => {
                self.waiting.extend(batch);
                self.paused_until = Some(Instant::now() + self.pause);
                Err(error)
            }
        }
    }

    /// At a stop: waits for the running `complete_many`, then completes what still waits, once.
    /// Returns how many were completed.
    pub async fn flush(&mut self) -> Result<usize, StoreError> {
        let mut completed = 0;
        if self.running.is_some() {
            match self.ended().await {
                Ok(written) => completed += written.completed,
                Err(error) => tracing::warn!(%error, "a completion during the stop failed; trying once more"),
            }
        }
        let leases: Vec<Lease> = self.waiting.drain(..).map(|(lease, _)| lease).collect();
        if !leases.is_empty() {
            completed += complete(&*self.store, &leases).await?;
        }
        Ok(completed)
    }
}

/// The result of a background step's task; a task that panicked or was cancelled is an error
/// naming the step.
pub(super) fn step_result<T>(joined: Result<Result<T, StoreError>, JoinError>, step: &str) -> Result<T, StoreError> {
    joined.unwrap_or_else(|join| Err(StoreError::Corrupt(format!("{step} task failed: {join}"))))
}

async fn complete<S: Store>(store: &S, leases: &[Lease]) -> Result<usize, StoreError> {
    let started = Instant::now();
    let settled = store.complete_many(leases, DateTime::now()).await?;
    tracing::trace!(elapsed_us = started.elapsed().as_micros() as u64, count = leases.len(), "completed");
    Ok(settled.iter().filter(|s| matches!(s, Settlement::Completed)).count())
}
