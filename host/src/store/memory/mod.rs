//! The in-memory store: the same semantics as the MongoDB store, in process.
//!
//! For plugin authors' tests and fast unit tests. It keeps the same documents (events as BSON
//! documents written the way any driver writes them), the same lanes, leases, claim
//! generations, parking and fencing, and shares the claim algorithm with the MongoDB store.
//! Transactions are serializable: a transaction holds the whole state until it commits or
//! aborts, so never claim from inside one. Nothing here survives the process.
//!
//! This file holds the state and the store's three parts over it, each method a few lines
//! against it, so that its semantics can be read side by side with the MongoDB store's; beside
//! it, as in the MongoDB store: the state changes several methods share (`state.rs`), its two
//! fan-outs (`fan_out.rs`), its claim primitives (`lanes.rs`), its outcomes' primitives
//! (`outcome.rs`), its deliveries without a record (`unstored.rs`), operators' reads, purge
//! and backfill (`operations.rs`), limiter documents (`limiters.rs`), handlers' collections.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::claim::{Claimer, HandlerKey, InFlight, LaneSearch, LaneState, Settled, Unpark};
use super::limiter;
use super::outcome::Change;
use super::fan_out::{FanOutPlan, NewDelivery, WithoutDocuments, id_text};
use super::{
    Administration, Capacity, ClaimedDelivery, DeliveryFilter, DeliveryId, DeliveryPage, DeliveryStatus, DeliveryView, EarlyHandOuts, FanOutReport,
    HandlerStatistics, Lease, PurgeOptions, PurgeReport, Published, Settlement, StoreError, StoreOptions,
    Hosts, Outbox, StoreTransaction, Subscriptions,
};
use crate::event::{NewEvent, field};
use crate::lane::{LANE_COUNT, LaneId};

mod fan_out;
mod handler_documents;
mod lanes;
mod limiters;
mod operations;
mod outcome;
mod query;
mod registry;
mod state;
mod unstored;

use lanes::Backend;
use operations::to_view;

use unstored::Entry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaneKind {
    Ready,
    Parked,
    Dead,
}

impl LaneKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Parked => "parked",
            Self::Dead => "dead",
        }
    }
}

#[derive(Debug, Clone)]
struct Delivery {
    event_id: Bson,
    event_type: String,
    handler: String,
    key: Option<String>,
    sequence: Option<i64>,
    /// See `NewDelivery::group`.
    group: Option<String>,
    /// See `NewDelivery::priority`.
    priority: Option<i32>,
    lane_id: LaneId,
    lane: LaneKind,
    status: DeliveryStatus,
    attempts: u32,
    claims: i64,
    due_at: DateTime,
    created_at: DateTime,
    updated_at: Option<DateTime>,
    requeued_at: Option<DateTime>,
    last_error: Option<String>,
    /// See `Candidate::suspect`.
    suspect: bool,
    /// See `NewDelivery::behind`; cleared when it is unparked.
    behind: Option<DeliveryId>,
}

#[derive(Debug, Clone)]
struct HistoryRecord {
    event_id: Bson,
    handler: String,
    completed_at: DateTime,
}

#[derive(Debug, Clone)]
struct State {
    /// Raw event documents by `id_text` of their `_id`.
    events: BTreeMap<String, Document>,
    key_sequences: HashMap<String, i64>,
    deliveries: BTreeMap<DeliveryId, Delivery>,
    lanes: Vec<LaneState>,
    history: BTreeMap<DeliveryId, HistoryRecord>,
    /// The hosts that announced themselves, each until its announcement lapses.
    hosts: BTreeMap<String, DateTime>,
    /// The handler registry's records (see `registry.rs`), `served_by` left empty.
    handlers: BTreeMap<String, super::RegisteredHandler>,
    /// What each host serves, beside its announcement.
    serves: BTreeMap<String, Vec<super::registry::Served>>,
    /// Jobs one host at a time does: the holder of each turn, until when.
    turns: BTreeMap<String, (String, DateTime)>,
    /// Limits across hosts, by handler (see `crate::store::limiter`).
    limiters: BTreeMap<String, super::limiter::LimiterState>,
    /// Handlers' collections by name, each in insertion order (see `handler_documents`).
    collections: BTreeMap<String, Vec<Document>>,
}

/// An in-process outbox. Clones of the data are made with [`MemoryStore::instance`].
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
    claimer: Arc<Claimer>,
    /// Whether a fan-out tries its plain mark first (see `crate::store::fan_out`).
    plain_marks: super::fan_out::PlainMarks,
    options: StoreOptions,
}

impl MemoryStore {
    pub fn new(options: StoreOptions) -> Self {
        let claimer = Arc::new(Claimer::new(&options.owner, options.lease_duration));
        Self { state: Arc::new(Mutex::new(State::new())), claimer, plain_marks: Default::default(), options }
    }

    /// Another worker on the same data, with its own lanes and leases (like a second host).
    pub fn instance(&self, owner: &str) -> Self {
        let options = StoreOptions { owner: owner.to_string(), ..self.options.clone() };
        let claimer = Arc::new(Claimer::new(owner, options.lease_duration));
        Self { state: self.state.clone(), claimer, plain_marks: Default::default(), options }
    }

    /// Inserts an event document exactly as given, the way another driver would.
    pub async fn insert_event_document(&self, document: Document) -> Result<(), StoreError> {
        let id = id_text(document.get(field::ID).unwrap_or(&Bson::Null));
        let mut state = self.state.lock().await;
        if state.events.contains_key(&id) {
            return Err(StoreError::InvalidArgument(format!("an event with _id {id:?} exists already")));
        }
        state.events.insert(id, document);
        Ok(())
    }

    /// The claim primitives and the claimer, for fault-injection tests of the claim.
    #[cfg(test)]
    pub(crate) fn claim_parts(&self) -> (impl super::claim::ClaimBackend + '_, &Claimer) {
        (Backend(&self.state), &self.claimer)
    }

    /// The stored document of an event, if it exists.
    pub async fn event_document(&self, id: &str) -> Option<Document> {
        self.state.lock().await.events.get(id).cloned()
    }
}

/// A serializable transaction over the whole in-memory state.
pub struct MemoryTx {
    state: OwnedMutexGuard<State>,
    backup: Option<State>,
    started: Instant,
    budget: std::time::Duration,
    claimer: Arc<Claimer>,
    /// Leases this transaction settles: settled for the claimer once it commits.
    settles: Vec<Lease>,
    /// A handler's call it refused: it cannot commit (see `handler_documents`).
    doomed: Option<String>,
}

impl MemoryTx {
    /// Publishes a follow-up event in this transaction.
    pub fn publish(&mut self, event: &NewEvent, max_payload_bytes: usize) -> Result<Published, StoreError> {
        self.state.publish(event, max_payload_bytes)
    }
}

impl StoreTransaction for MemoryTx {
    async fn commit(mut self) -> Result<(), StoreError> {
        if let Some(refused) = self.doomed.take() {
            self.abort_in_place();
            return Err(StoreError::TransactionAborted(refused));
        }
        if self.started.elapsed() > self.budget {
            let budget = self.budget;
            self.abort_in_place();
            return Err(StoreError::TransactionTimeout(budget));
        }
        self.backup = None;
        self.claimer.settled(&self.settles);
        Ok(())
    }

    async fn abort(mut self) -> Result<(), StoreError> {
        self.abort_in_place();
        Ok(())
    }
}

impl MemoryTx {
    fn abort_in_place(&mut self) {
        if let Some(backup) = self.backup.take() {
            *self.state = backup;
        }
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        // A transaction dropped without commit aborts, as a MongoDB session does.
        self.abort_in_place();
    }
}

impl Outbox for MemoryStore {
    type Tx = MemoryTx;

    async fn setup(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn begin(&self) -> Result<MemoryTx, StoreError> {
        let state = self.state.clone().lock_owned().await;
        let backup = Some(state.clone());
        Ok(MemoryTx {
            state,
            backup,
            started: Instant::now(),
            budget: self.options.transaction_budget,
            claimer: self.claimer.clone(),
            settles: Vec::new(),
            doomed: None,
        })
    }

    async fn publish(&self, tx: &mut MemoryTx, event: &NewEvent) -> Result<Published, StoreError> {
        tx.publish(event, self.options.max_payload_bytes)
    }

    async fn fan_out(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: impl Into<Capacity> + Send,
        now: DateTime,
    ) -> Result<FanOutReport, StoreError> {
        let report = super::fan_out::fan_out(self, subscriptions, limit, hand_out.into(), None, now).await?;
        self.claimer.note_fan_out(&report);
        Ok(report)
    }

    async fn fan_out_early(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: impl Into<Capacity> + Send,
        early: &EarlyHandOuts,
        now: DateTime,
    ) -> Result<FanOutReport, StoreError> {
        let report = super::fan_out::fan_out(self, subscriptions, limit, hand_out.into(), Some(early), now).await?;
        self.claimer.note_fan_out(&report);
        Ok(report)
    }

    async fn claim(&self, handlers: &[String], limit: impl Into<Capacity> + Send, now: DateTime) -> Result<Vec<ClaimedDelivery>, StoreError> {
        self.claimer.claim(&Backend(&self.state), handlers, LaneSearch::FreeWithDueWork, limit.into(), now).await
    }

    async fn claim_in(
        &self,
        handlers: &[String],
        lanes: &[LaneId],
        limit: impl Into<Capacity> + Send,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        self.claimer.claim(&Backend(&self.state), handlers, LaneSearch::Only(lanes), limit.into(), now).await
    }

    async fn record_starts(&self, leases: &[Lease]) -> Result<Vec<bool>, StoreError> {
        self.claimer.record_starts(&Backend(&self.state), leases).await
    }

    fn hints(&self) -> crate::store::SchedulerHints<'_> {
        crate::store::SchedulerHints::of(&self.claimer)
    }

    async fn complete_many(&self, leases: &[Lease], now: DateTime) -> Result<Vec<Settlement>, StoreError> {
        super::outcome::complete(self, leases, now).await
    }

    async fn complete_in(&self, tx: &mut MemoryTx, lease: &Lease, now: DateTime) -> Result<(), StoreError> {
        super::outcome::complete_in(self, tx, lease, now).await
    }

    async fn reschedule(&self, lease: &Lease, due_at: DateTime, error: &str, now: DateTime) -> Result<Settlement, StoreError> {
        super::outcome::settle_one(self, lease, Change::Reschedule { due_at, error }, now).await
    }

    async fn release(&self, leases: &[Lease], now: DateTime) -> Result<usize, StoreError> {
        super::outcome::settle(self, leases, Change::HandBack, now).await
    }

    async fn bury(&self, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<Settlement, StoreError> {
        super::outcome::settle_one(self, lease, Change::Bury { reason, charge_attempt }, now).await
    }

    async fn bury_in(&self, tx: &mut MemoryTx, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<(), StoreError> {
        super::outcome::settle_in(self, tx, lease, Change::Bury { reason, charge_attempt }, now).await
    }

    async fn extend_lease(&self, leases: &[Lease], now: DateTime) -> Result<Vec<bool>, StoreError> {
        let mut state = self.state.lock().await;
        let until = self.claimer.lease_until(now);
        let mut results = Vec::with_capacity(leases.len());
        for lease in leases {
            // A delivery without a record runs while its lease is issued: its lane is checked.
            let unstored = self.claimer.unstored(lease).is_some();
            let ok = self.claimer.issued(lease) && if unstored { state.lane_current(lease) } else { state.current(lease) };
            if ok {
                let lane = &mut state.lanes[usize::from(lease.lane)];
                lane.lease_expires_at = lane.lease_expires_at.max(until);
            }
            results.push(ok);
        }
        Ok(results)
    }
}

impl Hosts for MemoryStore {

    async fn relinquish(&self) -> Result<(), StoreError> {
        let held = self.claimer.take_held().await;
        let mut state = self.state.lock().await;
        state.hosts.remove(&self.claimer.host_id());
        for (lane, epoch, unsettled) in held {
            let lane = &mut state.lanes[usize::from(lane)];
            if lane.epoch == epoch && lane.held_by(&self.claimer.holder) {
                lane.owner = None;
                lane.instance = None;
                if !unsettled {
                    lane.in_flight.clear();
                }
            }
        }
        Ok(())
    }

    async fn announce(&self, now: DateTime) -> Result<usize, StoreError> {
        let mut state = self.state.lock().await;
        state.hosts.insert(self.claimer.host_id(), self.claimer.announced_until(now));
        state.hosts.retain(|_, until| *until > now);
        let live: Vec<String> = state.hosts.keys().cloned().collect();
        self.claimer.assign(&live);
        Ok(live.len())
    }

    async fn look(&self, now: DateTime) -> Result<usize, StoreError> {
        let state = self.state.lock().await;
        let live: Vec<String> = state.hosts.iter().filter(|(_, until)| **until > now).map(|(host, _)| host.clone()).collect();
        self.claimer.assign(&live);
        Ok(live.len().max(1))
    }

    async fn register(&self, declarations: &[super::Declaration], now: DateTime) -> Result<Vec<super::RegisteredHandler>, StoreError> {
        self.register_served(declarations, now).await
    }

    async fn registered_handlers(&self, now: DateTime) -> Result<Vec<super::RegisteredHandler>, StoreError> {
        Ok(self.registered(now).await)
    }

    async fn membership(&self, now: DateTime) -> Result<super::Membership, StoreError> {
        let state = self.state.lock().await;
        let hosts = state.hosts.iter().filter(|(_, until)| **until > now).map(|(host, until)| (host.clone(), *until)).collect();
        let lanes = state
            .lanes
            .iter()
            .map(|lane| {
                let live = lane.lease_expires_at > now;
                super::LaneView {
                    lane: lane.id,
                    holder: lane.owner.clone().zip(lane.instance.clone()).filter(|_| live).map(|(owner, instance)| format!("{owner}/{instance}")),
                    lease_expires_at: lane.lease_expires_at,
                    epoch: lane.epoch,
                    in_flight: if live { lane.in_flight.len() } else { 0 },
                }
            })
            .collect();
        Ok(super::Membership { hosts, lanes })
    }

    async fn take_turn(&self, job: &str, turn: std::time::Duration, now: DateTime) -> Result<bool, StoreError> {
        let me = self.claimer.host_id();
        let mut state = self.state.lock().await;
        let until = DateTime::from_millis(now.timestamp_millis() + turn.as_millis() as i64);
        match state.turns.get(job) {
            Some((holder, lapses)) if *holder != me && *lapses > now => Ok(false),
            _ => {
                state.turns.insert(job.to_string(), (me, until));
                Ok(true)
            }
        }
    }

    async fn lease_share(&self, handler: &str, request: &limiter::ShareRequest, now: DateTime) -> Result<limiter::ShareGrant, StoreError> {
        let lease_ms = self.claimer.lease_duration.as_millis() as i64;
        limiter::lease_share(&limiters::Limiters { store: self }, &self.claimer.host_id(), handler, request, now, lease_ms).await
    }
}

impl Administration for MemoryStore {

    async fn retire(&self, handler: &str, disposal: super::Disposal, now: DateTime) -> Result<super::RetireReport, StoreError> {
        self.retire_handler(handler, disposal, now).await
    }

    async fn reopen_for(&self, handler: &str, types: &[String], since: Option<DateTime>, limit: usize) -> Result<Vec<Bson>, StoreError> {
        Ok(self.state.lock().await.reopen_for(handler, types, since, limit))
    }

    async fn backfill_waiting(&self, handler: &str, types: &[String], since: Option<DateTime>) -> Result<usize, StoreError> {
        Ok(self.state.lock().await.backfill_waiting(handler, types, since))
    }

    async fn unfanned_among(&self, events: &[Bson]) -> Result<usize, StoreError> {
        Ok(self.state.lock().await.unfanned_among(events))
    }

    async fn requeue(&self, delivery_id: &str, now: DateTime) -> Result<(), StoreError> {
        let not_found = || StoreError::DeliveryNotFound(delivery_id.to_string());
        let id = ObjectId::parse_str(delivery_id).map_err(|_| not_found())?;
        let mut state = self.state.lock().await;
        let delivery = state.deliveries.get_mut(&id).ok_or_else(not_found)?;
        if delivery.status != DeliveryStatus::Dead {
            return Err(StoreError::NotDead(delivery_id.to_string()));
        }
        delivery.status = DeliveryStatus::Pending;
        delivery.lane = LaneKind::Ready;
        delivery.attempts = 0;
        delivery.claims += 1;
        delivery.due_at = now;
        delivery.updated_at = Some(now);
        delivery.requeued_at = Some(now);
        // Back before its key's followers: none of them leads its key any more by having
        // been created behind a delivery that is gone (see `NewDelivery::behind`).
        if let Some(key) = delivery.key.clone() {
            let handler = delivery.handler.clone();
            for d in state.deliveries.values_mut().filter(|d| d.handler == handler && d.key.as_ref() == Some(&key)) {
                d.behind = None;
            }
        }
        Ok(())
    }

    async fn bury_pending_in(&self, tx: &mut MemoryTx, delivery_id: &str, reason: &str, now: DateTime) -> Result<DeliveryView, StoreError> {
        let not_found = || StoreError::DeliveryNotFound(delivery_id.to_string());
        let refused = |why: String| StoreError::NotBuriable { id: delivery_id.to_string(), why };
        let id = ObjectId::parse_str(delivery_id).map_err(|_| not_found())?;
        let state = &mut tx.state;
        let delivery = state.deliveries.get(&id).ok_or_else(not_found)?;
        let before = to_view(&id, delivery);
        if delivery.status == DeliveryStatus::Dead {
            return Err(refused("it is dead already".into()));
        }
        let lane = &mut state.lanes[usize::from(before.lane_id)];
        if let Some(owner) = lane.owner.as_deref().filter(|_| lane.lease_expires_at > now) {
            return Err(refused(format!(
                "its lane {} is leased by {owner} until {}; try again once that host lets it go, or stop that host",
                lane.id,
                lane.lease_expires_at.try_to_rfc3339_string().unwrap_or_default()
            )));
        }
        lane.epoch += 1;
        let delivery = state.deliveries.get_mut(&id).expect("found above");
        delivery.status = DeliveryStatus::Dead;
        delivery.lane = LaneKind::Dead;
        delivery.claims += 1;
        delivery.last_error = Some(reason.to_string());
        delivery.updated_at = Some(now);
        if let Some(key) = &before.key {
            // Its key's next delivery may wait parked behind it: it leads the key now.
            let behind = vec![Settled { delivery: id, completed: false }];
            let scope = Unpark::Keys { keys: vec![(before.handler.clone(), key.clone())], behind };
            state.unpark(std::slice::from_ref(&before.handler), &scope);
        }
        Ok(before)
    }

    async fn purge(&self, options: &PurgeOptions, _now: DateTime) -> Result<PurgeReport, StoreError> {
        Ok(self.state.lock().await.purge(options))
    }

    async fn event_history(&self, event_id: &str) -> Result<super::EventHistory, StoreError> {
        let state = self.state.lock().await;
        let mut completions: Vec<(String, DateTime)> = state
            .history
            .values()
            .filter(|record| super::fan_out::id_text(&record.event_id) == event_id)
            .map(|record| (record.handler.clone(), record.completed_at))
            .collect();
        completions.sort_by_key(|(_, at)| *at);
        Ok(super::EventHistory { event: state.events.get(event_id).cloned(), completions })
    }

    async fn purge_preview(&self, options: &PurgeOptions, _now: DateTime) -> Result<PurgeReport, StoreError> {
        Ok(self.state.lock().await.purge_preview(options))
    }

    async fn unfanned_events(&self) -> Result<u64, StoreError> {
        let state = self.state.lock().await;
        Ok(state.events.values().filter(|doc| !doc.contains_key(field::FANNED_OUT_AT)).count() as u64)
    }

    async fn statistics(&self, now: DateTime) -> Result<Vec<HandlerStatistics>, StoreError> {
        Ok(self.state.lock().await.statistics(now, self.options.completion_history))
    }

    async fn list_deliveries(&self, filter: &DeliveryFilter) -> Result<DeliveryPage, StoreError> {
        let after = filter.after_id()?;
        Ok(self.state.lock().await.list_deliveries(filter, after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_dropped_transaction_aborts() {
        let store = MemoryStore::new(StoreOptions::default());
        {
            let mut tx = store.begin().await.unwrap();
            store.publish(&mut tx, &NewEvent::new("e-1", "t", bson::doc! {})).await.unwrap();
        }
        assert!(store.event_document("e-1").await.is_none());
    }
}
