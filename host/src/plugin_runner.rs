//! Runs deliveries in their plugins: the `Runner` the host gives the dispatcher.
//!
//! This module joins the three layers and owns only the joining: which loaded version serves
//! a claimed delivery, the delivery's context, and for transactional handlers the collections
//! they are granted (created before their first run) and the store's
//! transaction around the run, on either store (the handler runs again after a transient transaction error,
//! up to its plugin's `reruns` with a growing pause, then the attempt is charged; a transient
//! error of the handler's own making, after a call of its own failed, is charged at once; its
//! writes, follow-up events and the completion commit together). It must never decide retries (the dispatcher does) nor
//! touch lanes (the store does).

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use bson::DateTime;

use crate::dispatch::{AttemptResult, Controls, HandlerSpec, RetryPolicy, RunResult, Runner};
use crate::event::{EventRecord, NewEvent};
use crate::handler_transaction::{FollowUps, HandlerTransaction, Journal, SharedTrouble, Trouble, Write, publish_follow_ups};
use crate::metrics::DeliveryMetrics;
use crate::plugin::{DeliveryInfo, LoadedPlugin, Outcome, PluginRegistry, Ran};
use crate::store::{ClaimedDelivery, Declaration, Retrying, Store, StoreError};
use crate::telemetry::Telemetry;

/// The retry policy of a handler, by its plugin's name and its id.
pub type RetryPolicies = dyn Fn(&str, &str) -> RetryPolicy + Send + Sync;

/// How a handler's deliveries are processed (throttle, priority, per key), by its plugin's
/// name and its id.
pub type HandlerControls = dyn Fn(&str, &str) -> Controls + Send + Sync;

pub struct PluginRunner<S> {
    registry: Arc<PluginRegistry>,
    store: Arc<S>,
    retry_for: Arc<RetryPolicies>,
    controls_for: Arc<HandlerControls>,
    /// The collections granted to transactional plugins that are known to exist.
    created: Arc<Mutex<HashSet<String>>>,
    metrics: DeliveryMetrics,
    telemetry: Telemetry,
    records: Option<RunRecords>,
}

/// What one run did, kept while a plugin is tried (see [`PluginRunner::recorded_in`]).
#[derive(Debug, Clone, Default)]
pub struct RunRecord {
    pub elapsed: Duration,
    pub fuel_consumed: Option<u64>,
    pub peak_memory_bytes: usize,
    /// Its log lines (`LEVEL text`).
    pub log: Vec<String>,
    /// What its transaction's calls wrote, in order (published with its commit, if any).
    pub writes: Vec<Write>,
    /// The follow-up events it published (with its commit, if any).
    pub follow_ups: Vec<NewEvent>,
}

impl RunRecord {
    fn of(ran: &Ran, writes: Vec<Write>, follow_ups: Vec<NewEvent>) -> Self {
        let (elapsed, fuel_consumed, peak_memory_bytes, log) = (ran.elapsed, ran.fuel_consumed, ran.peak_memory_bytes, ran.log.clone());
        Self { elapsed, fuel_consumed, peak_memory_bytes, log, writes, follow_ups }
    }
}

/// The records of a runner's runs, oldest first; a transactional handler's reruns each have
/// one.
pub type RunRecords = Arc<std::sync::Mutex<Vec<RunRecord>>>;

impl<S: Store> PluginRunner<S> {
    pub fn new(registry: Arc<PluginRegistry>, store: Arc<S>, retry_for: Arc<RetryPolicies>) -> Self {
        let controls_for = Arc::new(|_: &str, _: &str| Controls::default());
        let (created, metrics, telemetry) = (Arc::default(), DeliveryMetrics::default(), Telemetry::off());
        Self { registry, store, retry_for, controls_for, created, metrics, telemetry, records: None }
    }

    /// The same, keeping a [`RunRecord`] of every run in `records` (a plugin tried, not
    /// deployed: with a runtime that records its HTTP requests and log lines).
    pub fn recorded_in(self, records: RunRecords) -> Self {
        Self { records: Some(records), ..self }
    }

    /// Runs `handler` on `event` as attempt `attempt`, outside any lease or delivery: a
    /// transactional handler's transaction is always aborted, so nothing it does stays. For
    /// trying a candidate plugin on a stored event (`relayhost replay`). `None` when no loaded
    /// plugin offers `handler`.
    pub async fn try_on(&self, handler: &str, event: &EventRecord, attempt: u32) -> Option<(AttemptResult, RunRecord)> {
        let plugin = self.registry.plugin_for(handler)?;
        let max_attempts = (self.retry_for)(&plugin.name, handler).max_attempts;
        let deadline = DateTime::now().timestamp_millis() + plugin.policy.limits.wall_time.as_millis() as i64;
        let info = DeliveryInfo { handler: handler.to_string(), attempt, max_attempts, deadline, trace_context: Vec::new() };
        if !plugin.subscription(handler).is_some_and(|s| s.transactional) {
            let ran = self.registry.runtime().invoke(&plugin, event, &info).await;
            let record = RunRecord::of(&ran, Vec::new(), Vec::new());
            return Some((attempt_of(ran.outcome), record));
        }
        let tx = match self.store.begin().await {
            Ok(tx) => Arc::new(tokio::sync::Mutex::new(tx)),
            Err(error) => return Some((AttemptResult::Failed(format!("cannot start its transaction: {error}")), RunRecord::default())),
        };
        let (follow_ups, journal, trouble) = (FollowUps::default(), Journal::default(), SharedTrouble::default());
        let capability = HandlerTransaction::new(tx.clone(), follow_ups.clone(), trouble.clone()).journaled(journal.clone());
        let (ran, returned) = self.registry.runtime().invoke_transactional(&plugin, event, &info, Box::new(capability)).await;
        drop(returned);
        if let Ok(tx) = Arc::try_unwrap(tx) {
            let _ = crate::store::StoreTransaction::abort(tx.into_inner()).await;
        }
        let writes = std::mem::take(&mut *journal.lock().expect("the journal"));
        let published = std::mem::take(&mut *follow_ups.lock().expect("follow-ups"));
        let record = RunRecord::of(&ran, writes, published);
        let result = match std::mem::take(&mut *trouble.lock().expect("transient error slot")) {
            Trouble { transient: Some(error), .. } if ran.outcome == Outcome::Completed => {
                AttemptResult::Failed(format!("its transaction could not have committed: {error}"))
            }
            _ => attempt_of(ran.outcome),
        };
        Some((result, record))
    }

    /// The same, each attempt traced and its costs exported by `telemetry` (see
    /// [`crate::telemetry`]).
    pub fn traced_by(self, telemetry: Telemetry) -> Self {
        let metrics = self.metrics.exported_by(telemetry.meter());
        Self { telemetry, metrics, ..self }
    }

    /// What its runs cost, by handler (for `/metrics`).
    pub fn metrics(&self) -> DeliveryMetrics {
        self.metrics.clone()
    }

    /// The same, each plugin's handlers processed as `controls_for` says (throttled by
    /// nothing, of priority 0 and one at a time per key by default).
    pub fn controlled_by(self, controls_for: Arc<HandlerControls>) -> Self {
        Self { controls_for, ..self }
    }

    /// Creates the collections the loaded transactional plugins are granted, if missing: at
    /// start, before any delivery runs (see `create_collections_granted_to`).
    pub async fn create_granted_collections(&self) {
        for subscription in self.registry.subscriptions().iter().filter(|s| s.transactional) {
            if let Some(plugin) = self.registry.plugin_for(&subscription.handler) {
                create_collections_granted_to(&*self.store, &plugin, &self.created).await;
            }
        }
    }
}

/// Creates the collections `plugin` is granted before its first transactional run (once per
/// process and collection), so that its first deliveries, running at once on a fresh
/// database, do not each create them in their transactions: those conflict, and the plugin
/// would run again (its logs and calls repeated) for nothing. The host does it at start; a
/// plugin loaded later gets them at its first run. Best effort: on a failure the
/// transactions create them, as before.
async fn create_collections_granted_to<S: Store>(store: &S, plugin: &LoadedPlugin, created: &Mutex<HashSet<String>>) {
    let granted = &plugin.policy.grants.transaction.collections;
    if let Err(error) = create_once(created, granted, async |missing: &[String]| store.create_collections(missing).await).await {
        tracing::warn!(%error, plugin = %plugin.name, "could not create the collections the plugin is granted");
    }
}

/// Calls `create` with those of `wanted` that `created` does not hold yet, and adds them once
/// it succeeded. `created` is held while they are created: a run that comes meanwhile waits
/// for them. A collection created while a handler's transaction was open made that
/// transaction's commit a write conflict, and the handler ran again (`transactional_handler`
/// `a_transactional_handler_beside_another_handler_of_unkeyed_events_runs_once_each`, its
/// first run: 3 of 60 and 2 of 150 looped runs failed so; none of 150, twice, since; the
/// test below shows the wait).
async fn create_once(
    created: &Mutex<HashSet<String>>,
    wanted: &[String],
    create: impl AsyncFnOnce(&[String]) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut created = created.lock().await;
    let missing: Vec<String> = wanted.iter().filter(|name| !created.contains(*name)).cloned().collect();
    if missing.is_empty() {
        return Ok(());
    }
    create(&missing).await?;
    created.extend(missing);
    Ok(())
}

fn attempt_of(outcome: Outcome) -> AttemptResult {
    match outcome {
        Outcome::Completed => AttemptResult::Completed,
        Outcome::Retry { reason, not_before } => AttemptResult::Retry { reason, not_before },
        Outcome::Unprocessable(reason) => AttemptResult::Unprocessable(reason),
        Outcome::Failed(reason) => AttemptResult::Failed(reason),
    }
}

impl<S: Store> PluginRunner<S> {
    /// Each handler the loaded plugins export, with the plugin that serves it.
    fn served_handlers(&self) -> Vec<(Arc<LoadedPlugin>, HandlerSpec)> {
        let mut specs = Vec::new();
        for subscription in self.registry.subscriptions() {
            let Some(plugin) = self.registry.plugin_for(&subscription.handler) else { continue };
            let spec = HandlerSpec {
                retry: (self.retry_for)(&plugin.name, &subscription.handler),
                controls: (self.controls_for)(&plugin.name, &subscription.handler),
                handler: subscription.handler,
                event_types: subscription.event_types,
                transactional: subscription.transactional,
            };
            specs.push((plugin, spec));
        }
        specs
    }
}

impl<S: Store> Runner for PluginRunner<S> {
    fn handlers(&self) -> Vec<HandlerSpec> {
        self.served_handlers().into_iter().map(|(_, spec)| spec).collect()
    }

    fn declarations(&self) -> Vec<Declaration> {
        self.served_handlers()
            .into_iter()
            .map(|(plugin, spec)| Declaration {
                subscription: spec.subscription(),
                plugin: plugin.name.to_string(),
                version: plugin.content_hash.clone(),
            })
            .collect()
    }

    fn run(&self, delivery: ClaimedDelivery) -> Pin<Box<dyn Future<Output = RunResult> + Send>> {
        let (registry, store, retry_for, created) = (self.registry.clone(), self.store.clone(), self.retry_for.clone(), self.created.clone());
        let (metrics, telemetry, records) = (self.metrics.clone(), self.telemetry.clone(), self.records.clone());
        Box::pin(async move {
            // The version serving the handler now; the delivery keeps it to the end.
            let Some(plugin) = registry.plugin_for(&delivery.handler) else { return RunResult::NotRun };
            let attempt = telemetry.attempt(&delivery);
            let info = DeliveryInfo {
                handler: delivery.handler.clone(),
                attempt: delivery.attempts + 1,
                max_attempts: retry_for(&plugin.name, &delivery.handler).max_attempts,
                deadline: DateTime::now().timestamp_millis() + plugin.policy.limits.wall_time.as_millis() as i64,
                trace_context: attempt.trace_context(),
            };
            let result = if plugin.subscription(&delivery.handler).is_some_and(|s| s.transactional) {
                create_collections_granted_to(&*store, &plugin, &created).await;
                run_transactional(&registry, &*store, &plugin, &delivery, &info, &metrics, records.as_ref()).await
            } else {
                let started = DateTime::now();
                let ran = registry.runtime().invoke(&plugin, &delivery.event, &info).await;
                measure(&metrics, &delivery, &ran, started);
                if let Some(records) = &records {
                    records.lock().expect("run records").push(RunRecord::of(&ran, Vec::new(), Vec::new()));
                }
                RunResult::Attempt(attempt_of(ran.outcome))
            };
            let (outcome, error) = how_it_ended(&result);
            attempt.end(outcome, error);
            result
        })
    }
}

/// How a run ended, as its span says: the outcome's name, and the reason when it failed.
fn how_it_ended(result: &RunResult) -> (&'static str, Option<&str>) {
    match result {
        RunResult::Attempt(AttemptResult::Completed) | RunResult::CompletedInTransaction => ("completed", None),
        RunResult::Attempt(AttemptResult::Retry { reason, .. }) => ("retry", Some(reason)),
        RunResult::Attempt(AttemptResult::Unprocessable(reason)) => ("unprocessable", Some(reason)),
        RunResult::Attempt(AttemptResult::Failed(reason)) => ("failed", Some(reason)),
        RunResult::NotRun => ("not_run", None),
        RunResult::LeaseLost => ("lease_lost", Some("the lease was lost while it ran")),
    }
}

/// Records what one run of `delivery`, started at `started`, cost.
fn measure(metrics: &DeliveryMetrics, delivery: &ClaimedDelivery, ran: &Ran, started: DateTime) {
    let lag = u64::try_from(started.timestamp_millis() - delivery.event.created_at.timestamp_millis()).ok().map(Duration::from_millis);
    let outcome = match ran.outcome {
        Outcome::Completed => "completed",
        Outcome::Retry { .. } => "retry",
        Outcome::Unprocessable(_) => "unprocessable",
        Outcome::Failed(_) => "failed",
    };
    metrics.ran(&delivery.handler, outcome, ran.elapsed, ran.fuel_consumed, ran.peak_memory_bytes, lag);
}

async fn run_transactional<S: Store>(
    registry: &PluginRegistry,
    store: &S,
    plugin: &LoadedPlugin,
    delivery: &ClaimedDelivery,
    info: &DeliveryInfo,
    metrics: &DeliveryMetrics,
    records: Option<&RunRecords>,
) -> RunResult {
    let mut retrying = Retrying::new();
    let mut reruns = Reruns { done: 0, limit: plugin.policy.limits.transaction.reruns };
    loop {
        let tx = match store.begin().await {
            Ok(tx) => Arc::new(tokio::sync::Mutex::new(tx)),
            Err(error) => return RunResult::Attempt(AttemptResult::Failed(format!("cannot start its transaction: {error}"))),
        };
        let (transient, follow_ups, journal) = (SharedTrouble::default(), FollowUps::default(), Journal::default());
        let mut capability = HandlerTransaction::new(tx.clone(), follow_ups.clone(), transient.clone());
        if records.is_some() {
            capability = capability.journaled(journal.clone());
        }
        let started = DateTime::now();
        let (ran, returned) = registry.runtime().invoke_transactional(plugin, &delivery.event, info, Box::new(capability)).await;
        measure(metrics, delivery, &ran, started);
        if let Some(records) = records {
            let writes = std::mem::take(&mut *journal.lock().expect("the journal"));
            let published = follow_ups.lock().expect("follow-ups").clone();
            records.lock().expect("run records").push(RunRecord::of(&ran, writes, published));
        }
        drop(returned);
        let Ok(tx) = Arc::try_unwrap(tx) else {
            return RunResult::Attempt(AttemptResult::Failed("the handler kept its transaction".into()));
        };
        let mut tx = tx.into_inner();
        let Trouble { transient: met, failed_call } = std::mem::take(&mut *transient.lock().expect("transient error slot"));
        // A call of its own failed and ended the transaction: running it again would repeat it.
        let self_inflicted = |reason: &str| {
            let call = failed_call.as_deref().unwrap_or_default();
            RunResult::Attempt(AttemptResult::Failed(format!(
                "a call of the handler failed ({call}), which ends its transaction, and the handler went on: {reason}"
            )))
        };
        if let Some(error) = met {
            let reason = error.to_string();
            if failed_call.is_some() {
                let _ = crate::store::StoreTransaction::abort(tx).await;
                return self_inflicted(&reason);
            }
            match retrying.settle(tx, Err::<(), _>(error)).await {
                None => match reruns.next(reason).await {
                    None => continue,
                    Some(charged) => return charged,
                },
                Some(result) => {
                    let reason = result.err().map_or_else(|| "its transaction failed".to_string(), |e| e.to_string());
                    return RunResult::Attempt(AttemptResult::Failed(reason));
                }
            }
        }
        if ran.outcome != Outcome::Completed {
            let _ = crate::store::StoreTransaction::abort(tx).await;
            return RunResult::Attempt(attempt_of(ran.outcome));
        }
        let completion = match publish_follow_ups(store, &mut tx, &follow_ups).await {
            Ok(()) => store.complete_in(&mut tx, &delivery.lease, DateTime::now()).await,
            Err(error) => Err(error),
        };
        match retrying.settle(tx, completion).await {
            // A transient error (a write conflict, a step-down): run the handler again.
            None if failed_call.is_some() => return self_inflicted("its commit met a transient error"),
            None => match reruns.next("its commit met a transient error".to_string()).await {
                None => continue,
                Some(charged) => return charged,
            },
            Some(Ok(())) => return RunResult::CompletedInTransaction,
            Some(Err(StoreError::LeaseLost(_))) => return RunResult::LeaseLost,
            Some(Err(error)) => return RunResult::Attempt(AttemptResult::Failed(error.to_string())),
        }
    }
}

/// Re-runs of a transactional handler within one attempt: not charged (the handler did not
/// fail, its transaction did), each after a pause growing from 50 ms to 5 s, so that the
/// default 20 outlast another transaction holding a lock for MongoDB's default transaction
/// lifetime (60 s, a killed host's) while a handler that conflicts without end costs one run
/// every 5 s; past the plugin's limit, the attempt is charged with the last error.
struct Reruns {
    done: u32,
    limit: u32,
}

impl Reruns {
    async fn next(&mut self, error: String) -> Option<RunResult> {
        self.done += 1;
        if self.done > self.limit {
            return Some(RunResult::Attempt(AttemptResult::Failed(format!(
                "its transaction met a transient error {} times in this attempt (the plugin's `reruns` limit is {}); the last: {error}",
                self.done, self.limit
            ))));
        }
        let pause = std::time::Duration::from_millis(50u64 << (self.done - 1).min(7)).min(std::time::Duration::from_secs(5));
        tokio::time::sleep(pause).await;
        None
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::FutureExt;
    use tokio::sync::Notify;

    use super::*;

    /// A run that comes while another creates the collections waits until they exist, and
    /// does not create them again (its transaction would be open beside their creation).
    #[tokio::test]
    async fn a_run_that_comes_while_the_collections_are_created_waits_for_them() {
        let created = Mutex::new(HashSet::new());
        let wanted = vec!["audit".to_string(), "orders".to_string()];
        let (creating, done) = (Notify::new(), Notify::new());
        let calls = AtomicUsize::new(0);
        let create = async |missing: &[String]| {
            calls.fetch_add(1, Ordering::SeqCst);
            assert_eq!(missing, ["audit".to_string(), "orders".to_string()]);
            creating.notify_one();
            done.notified().await;
            Ok(())
        };
        let mut first = std::pin::pin!(create_once(&created, &wanted, create));
        // The first run is inside its creation.
        assert!(first.as_mut().now_or_never().is_none());
        creating.notified().now_or_never().expect("the first run is creating the collections");
        let mut second = std::pin::pin!(create_once(&created, &wanted, async |_: &[String]| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }));
        assert!(second.as_mut().now_or_never().is_none(), "a second run went ahead while the collections were being created");
        done.notify_one();
        first.await.expect("created");
        second.await.expect("waited");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the collections were created once");
        assert_eq!(created.lock().await.len(), 2);
    }
}
