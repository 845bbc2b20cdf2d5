//! Trying a plugin without deploying it, on the memory store (`relayhost test-plugin`): the
//! events of a file are published, fanned out and delivered once each to the plugin's
//! handlers through the runner a host uses (its limits and grants, transactional handlers in
//! the memory store's transactions), one delivery at a time in publishing order, follow-ups
//! after the events they follow. HTTP requests are recorded and answered from the file's
//! fixtures. Each delivery's report says how it ended, what its transaction wrote, the
//! follow-ups it published, its HTTP requests, its log lines, fuel, peak memory and time.
//!
//! A replay (`relayhost replay`) runs a candidate plugin on one stored event instead, in a
//! transaction that is always aborted, HTTP recorded and not sent, and reports it the same way
//! beside the delivery's last error: an operator tries a fix on the event that died before
//! deploying it.
//!
//! It owns the events file's format and the order of a try; a test never touches MongoDB, a
//! replay never writes to it, and neither decides an outcome (the dispatcher's `decide` does,
//! as on a host).

use crate::store::{Administration, Outbox};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bson::{Bson, DateTime, Document};

use crate::config::Config;
use crate::dispatch::{RunResult, Runner, Settle, decide};
use crate::event::NewEvent;
use crate::plugin::capability::http::recording::{Fixture, Recorded, Recording};
use crate::plugin::{Change, PluginRegistry, PluginRuntime, RuntimeOptions};
use crate::plugin_runner::{RunRecord, RunRecords};
use crate::store::memory::MemoryStore;
use crate::store::{DeliveryFilter, DeliveryStatus, Store, StoreOptions, Subscription, Subscriptions, run_in_transaction};

/// An outcome stated in advance: what a delivery must end as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Expected {
    Completed,
    Retry,
    Dead,
}

impl std::str::FromStr for Expected {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "completed" => Ok(Self::Completed),
            "retry" => Ok(Self::Retry),
            "dead" => Ok(Self::Dead),
            other => Err(format!("{other:?} is not an outcome (completed, retry or dead)")),
        }
    }
}

/// An events file: the events in order, each with the outcome it must have (if stated), and
/// the HTTP fixtures.
#[derive(Debug, Clone, Default)]
pub struct EventsFile {
    pub events: Vec<(NewEvent, Option<Expected>)>,
    pub fixtures: Vec<Fixture>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EventLine {
    id: String,
    #[serde(rename = "type")]
    event_type: String,
    #[serde(default)]
    payload: Option<serde_json::Value>,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    expect: Option<Expected>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FixtureLine {
    http: Fixture,
}

impl EventsFile {
    /// Parses one JSON object a line: an event (`id`, `type`, `payload`, and optionally `key`,
    /// `headers` and `expect`), or an HTTP fixture (`{"http": {"method", "url", "status",
    /// "body"}}`). Blank lines and lines starting with `#` or `//` are skipped.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut file = Self::default();
        for (number, line) in text.lines().enumerate().map(|(n, line)| (n + 1, line.trim())) {
            if line.is_empty() || line.starts_with('#') || line.starts_with("//") {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("line {number}: not JSON: {e}"))?;
            if value.get("http").is_some() {
                let fixture: FixtureLine = serde_json::from_value(value).map_err(|e| format!("line {number}: an HTTP fixture: {e}"))?;
                file.fixtures.push(fixture.http);
                continue;
            }
            let line: EventLine = serde_json::from_value(value).map_err(|e| format!("line {number}: an event: {e}"))?;
            let payload = match line.payload.map(Bson::try_from).transpose().map_err(|e| format!("line {number}: payload: {e}"))? {
                None => Document::new(),
                Some(Bson::Document(payload)) => payload,
                Some(other) => return Err(format!("line {number}: payload must be an object, found {}", crate::event::bson_type_name(&other))),
            };
            let mut event = NewEvent::new(line.id, line.event_type, payload);
            event.key = line.key;
            event.headers = line.headers;
            file.events.push((event, line.expect));
        }
        if file.events.is_empty() {
            return Err("the file holds no event".into());
        }
        Ok(file)
    }
}

/// How a delivery ended, as its report says.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
pub enum Reported {
    Completed,
    /// Rescheduled: a host would run it again at `at` (ms since the epoch).
    Retry { at: i64, reason: String },
    Dead { reason: String },
    /// It never ran: why.
    #[serde(rename = "not run")]
    NotRun { why: String },
}

impl Reported {
    pub fn as_expected(&self) -> Option<Expected> {
        match self {
            Self::Completed => Some(Expected::Completed),
            Self::Retry { .. } => Some(Expected::Retry),
            Self::Dead { .. } => Some(Expected::Dead),
            Self::NotRun { .. } => None,
        }
    }
}

/// One delivery of the try.
#[derive(Debug, Clone)]
pub struct DeliveryReport {
    pub event_id: String,
    pub event_type: String,
    pub handler: String,
    pub attempt: u32,
    pub outcome: Reported,
    /// What the run did (nothing for a delivery that never ran).
    pub run: RunRecord,
    pub http: Vec<Recorded>,
    /// The outcome the events file stated for its event.
    pub expected: Option<Expected>,
}

impl DeliveryReport {
    /// Whether it ended as stated (as `completed` when nothing was stated).
    pub fn as_it_should(&self) -> bool {
        self.outcome.as_expected() == Some(self.expected.unwrap_or(Expected::Completed))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrialError {
    #[error("{0}")]
    Plugin(String),
    #[error("the store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Runs the plugin in `wasm` on `file`'s events, as `config` configures the plugin (named after
/// the file), HTTP answered from the fixtures (and sent, when nothing answers, only with
/// `send_http`).
pub async fn run(wasm: &Path, file: &EventsFile, config: &Config, send_http: bool) -> Result<Vec<DeliveryReport>, TrialError> {
    let recording = Recording::new(file.fixtures.clone(), send_http);
    let (registry, name) = candidate(wasm, config, &recording).await?;
    let store = Arc::new(MemoryStore::new(StoreOptions::default()));
    store.setup().await?;
    let records = RunRecords::default();
    let policies = retry_policies(config, &name);
    let runner = crate::plugin_runner::PluginRunner::new(registry.clone(), store.clone(), policies.clone())
        .recorded_in(records.clone());
    let offered = registry.subscriptions();
    let handlers: Vec<String> = offered.iter().map(|s| s.handler.clone()).collect();
    let schemas = config.event_schemas().map_err(|e| TrialError::Plugin(e.to_string()))?;
    let subscriptions = Subscriptions::new(
        offered.into_iter().map(|s| Subscription::new(s.handler, s.event_types).completing_in_transaction(s.transactional)),
    )?
    .with_schemas(schemas);
    let mut reports = Vec::new();
    let mut order: BTreeMap<String, (usize, Option<Expected>)> = BTreeMap::new();
    for (position, (event, expected)) in file.events.iter().enumerate() {
        order.insert(event.id.clone(), (position, *expected));
        if let Err(error) = run_in_transaction(&*store, async |tx| store.publish(tx, event).await.map(|_| ())).await {
            reports.push(DeliveryReport {
                event_id: event.id.clone(),
                event_type: event.event_type.clone(),
                handler: String::new(),
                attempt: 0,
                outcome: Reported::NotRun { why: format!("refused at publish: {error}") },
                run: RunRecord::default(),
                http: Vec::new(),
                expected: *expected,
            });
        }
    }
    let mut ran: HashSet<String> = HashSet::new();
    loop {
        let now = DateTime::now();
        while store.fan_out(&subscriptions, 1_000, 0, now).await?.events > 0 {}
        let mut claimed = store.claim(&handlers, 1_000, now).await?;
        claimed.retain(|c| !ran.contains(&c.lease.delivery.to_string()));
        if claimed.is_empty() {
            break;
        }
        // Publishing order; follow-ups (not in the file) after, in the order they came.
        claimed.sort_by_key(|c| order.get(&c.event.id).map_or(usize::MAX, |(position, _)| *position));
        for delivery in claimed {
            ran.insert(delivery.lease.delivery.to_string());
            let attempt = delivery.attempts + 1;
            let (lease, event_id, event_type, handler) =
                (delivery.lease, delivery.event.id.clone(), delivery.event.event_type.clone(), delivery.handler.clone());
            let result = runner.run(delivery).await;
            let run = records.lock().expect("run records").pop().unwrap_or_default();
            records.lock().expect("run records").clear();
            let now = DateTime::now();
            let outcome = match result {
                RunResult::CompletedInTransaction => Reported::Completed,
                RunResult::NotRun => Reported::NotRun { why: "no loaded plugin offers its handler".into() },
                RunResult::LeaseLost => Reported::NotRun { why: "its lease was lost".into() },
                RunResult::Attempt(result) => match decide(result, attempt, &policies(&name, &handler), now, fastrand::f64()) {
                    Settle::Complete => {
                        store.complete_many(&[lease], now).await?;
                        Reported::Completed
                    }
                    Settle::Reschedule { due_at, reason } => {
                        store.reschedule(&lease, due_at, &reason, now).await?;
                        Reported::Retry { at: due_at.timestamp_millis(), reason }
                    }
                    Settle::Bury { reason } => {
                        store.bury(&lease, &reason, true, now).await?;
                        Reported::Dead { reason }
                    }
                },
            };
            let expected = order.get(&event_id).and_then(|(_, expected)| *expected);
            reports.push(DeliveryReport { event_id, event_type, handler, attempt, outcome, run, http: recording.take(), expected });
        }
    }
    // What never ran: dead at fan-out (malformed), or waiting behind its key's head.
    let every = store.list_deliveries(&DeliveryFilter { limit: 1_000, ..DeliveryFilter::default() }).await?;
    for delivery in every.deliveries.into_iter().filter(|d| !ran.contains(&d.id)) {
        let outcome = match delivery.status {
            DeliveryStatus::Dead => Reported::Dead { reason: delivery.last_error.unwrap_or_default() },
            _ => Reported::NotRun { why: "it waits behind an earlier delivery of its key that did not complete".into() },
        };
        let expected = order.get(&delivery.event_id).and_then(|(_, expected)| *expected);
        reports.push(DeliveryReport {
            event_id: delivery.event_id,
            event_type: delivery.event_type,
            handler: delivery.handler,
            attempt: delivery.attempts,
            outcome,
            run: RunRecord::default(),
            http: Vec::new(),
            expected,
        });
    }
    Ok(reports)
}

/// The plugin in `wasm`, loaded as `config` configures the plugin of its file's name, its HTTP
/// going through `recording`; and that name.
async fn candidate(wasm: &Path, config: &Config, recording: &Recording) -> Result<(Arc<PluginRegistry>, String), TrialError> {
    let name = wasm.file_stem().and_then(|s| s.to_str()).filter(|s| !s.is_empty()).unwrap_or("plugin").to_string();
    let directory = scratch_directory()?;
    std::fs::copy(wasm, directory.join(format!("{name}.wasm")))?;
    let runtime = PluginRuntime::with_options(RuntimeOptions { cache_dir: None, meter_fuel: true, recording: Some(recording.clone()) })
        .map_err(|e| TrialError::Plugin(e.to_string()))?;
    let policies = config.clone();
    let registry = Arc::new(PluginRegistry::new(Arc::new(runtime), &directory, move |plugin| policies.policy_for(plugin)));
    let changes = registry.scan().await.map_err(|e| TrialError::Plugin(e.to_string()));
    let _ = std::fs::remove_dir_all(&directory);
    if let Some(Change::Refused { reason, .. }) = changes?.iter().find(|c| matches!(c, Change::Refused { .. })) {
        return Err(TrialError::Plugin(format!("{} is refused: {reason}", wasm.display())));
    }
    Ok((registry, name))
}

/// The retry policies `config` gives the handlers of the plugin `name` (the candidate's file
/// may be named otherwise).
fn retry_policies(config: &Config, name: &str) -> Arc<crate::plugin_runner::RetryPolicies> {
    let (config, name) = (config.clone(), name.to_string());
    Arc::new(move |_: &str, handler: &str| config.retry_for(&name, handler).policy())
}

/// A replay of one handler on a stored event, beside its delivery's state.
#[derive(Debug, Clone)]
pub struct Replayed {
    pub report: DeliveryReport,
    /// The stored delivery's status and last error, if the event has one for the handler.
    pub delivery: Option<(DeliveryStatus, Option<String>)>,
}

/// Runs the candidate plugin in `wasm` on the stored event `event_id`, for each of its handlers
/// subscribed to the event's type (or `handler` alone): transactional handlers in a
/// transaction of `store` that is always aborted, HTTP recorded and never sent. Nothing is
/// written to `store`.
pub async fn replay<S: Store>(
    store: Arc<S>,
    wasm: &Path,
    config: &Config,
    event_id: &str,
    handler: Option<&str>,
) -> Result<Vec<Replayed>, TrialError> {
    let history = store.event_history(event_id).await?;
    let document = history.event.ok_or_else(|| TrialError::Plugin(format!("there is no event {event_id:?}")))?;
    let event = crate::event::EventRecord::from_document(&document)
        .map_err(|e| TrialError::Plugin(format!("event {event_id:?} is malformed: {e}")))?;
    let recording = Recording::new(Vec::new(), false);
    let (registry, name) = candidate(wasm, config, &recording).await?;
    let handlers: Vec<String> = registry
        .subscriptions()
        .into_iter()
        .filter(|s| s.event_types.iter().any(|t| *t == event.event_type) && handler.is_none_or(|h| h == s.handler))
        .map(|s| s.handler)
        .collect();
    if handlers.is_empty() {
        let which = handler.map_or_else(|| "no handler".to_string(), |h| format!("no handler {h:?}"));
        return Err(TrialError::Plugin(format!("{} offers {which} of event type {:?}", wasm.display(), event.event_type)));
    }
    let policies = retry_policies(config, &name);
    let runner = crate::plugin_runner::PluginRunner::new(registry, store.clone(), policies.clone());
    let mut replayed = Vec::new();
    for handler in handlers {
        let filter = DeliveryFilter { event_id: Some(event_id.to_string()), handler: Some(handler.clone()), limit: 10, ..DeliveryFilter::default() };
        let stored = store.list_deliveries(&filter).await?.deliveries.into_iter().next();
        let attempt = stored.as_ref().map_or(1, |d| d.attempts + 1);
        let (result, run) = runner.try_on(&handler, &event, attempt).await.expect("the candidate offers the handler");
        let outcome = match decide(result, attempt, &policies(&name, &handler), DateTime::now(), fastrand::f64()) {
            Settle::Complete => Reported::Completed,
            Settle::Reschedule { due_at, reason } => Reported::Retry { at: due_at.timestamp_millis(), reason },
            Settle::Bury { reason } => Reported::Dead { reason },
        };
        let report = DeliveryReport {
            event_id: event.id.clone(),
            event_type: event.event_type.clone(),
            handler,
            attempt,
            outcome,
            run,
            http: recording.take(),
            expected: None,
        };
        replayed.push(Replayed { report, delivery: stored.map(|d| (d.status, d.last_error)) });
    }
    Ok(replayed)
}

/// A fresh directory the plugin is loaded from (the registry loads directories).
fn scratch_directory() -> Result<PathBuf, std::io::Error> {
    let directory = std::env::temp_dir().join(format!("relayhost-trial-{}-{}", std::process::id(), bson::oid::ObjectId::new()));
    std::fs::create_dir_all(&directory)?;
    Ok(directory)
}
