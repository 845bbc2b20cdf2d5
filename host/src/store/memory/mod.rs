//! The in-memory store: the same semantics as the MongoDB store, in process.
//!
//! For plugin authors' tests and fast unit tests. It keeps the same documents (events as BSON
//! documents written the way any driver writes them), the same lanes, leases, claim
//! generations, parking and fencing, and shares the claim algorithm with the MongoDB store.
//! Transactions are serializable: a transaction holds the whole state until it commits or
//! aborts, so never claim from inside one. Nothing here survives the process.
//!
//! One file past 600 lines because it implements the whole `Store` over
//! one in-process state, each method a few lines against it, so that its semantics can be
//! read side by side with the MongoDB store's; its two fan-outs (`fan_out.rs`), its claim
//! primitives (`lanes.rs`) and its deliveries without a record (`unstored.rs`) are beside it,
//! as in the MongoDB store.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::claim::{Claimer, HandlerKey, InFlight, LaneSearch, LaneState, Settled, Unpark, Unstored};
use super::fan_out::{FanOutPlan, NewDelivery, WithoutDocuments, id_text};
use super::retention::event_expired;
use super::{
    Capacity, ClaimedDelivery, DeliveryFilter, DeliveryId, DeliveryPage, DeliveryStatus, DeliveryView, EarlyHandOuts, FanOutReport,
    HandlerStatistics, Lease, PurgeOptions, PurgeReport, Published, Settlement, Store, StoreError, StoreOptions,
    StoreTransaction, Subscriptions,
};
use crate::event::{NewEvent, field};
use crate::lane::{LANE_COUNT, LaneId};

mod fan_out;
mod lanes;
mod unstored;

use lanes::Backend;

use unstored::{Charge, Entry};

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
}

impl State {
    /// What [`ClaimBackend::unpark`] does, on this data.
    fn unpark(&mut self, handlers: &[String], scope: &Unpark) -> HashMap<HandlerKey, DeliveryId> {
        let mut heads = HashMap::new();
        // Followers created behind a delivery that is no longer pending lead their keys.
        if let Unpark::Keys { behind, .. } = scope {
            // As in MongoDB, a delivery this instance completed is taken as gone unread.
            let gone = |settled: &Settled| {
                settled.completed || self.deliveries.get(&settled.delivery).is_none_or(|d| d.status != DeliveryStatus::Pending)
            };
            let named: Vec<DeliveryId> = self
                .deliveries
                .iter()
                .filter(|(_, d)| d.lane == LaneKind::Parked && handlers.contains(&d.handler))
                .filter(|(_, d)| d.behind.is_some_and(|before| behind.iter().any(|s| s.delivery == before && gone(s))))
                .map(|(id, _)| *id)
                .collect();
            for id in named {
                let d = self.deliveries.get_mut(&id).expect("found above");
                d.lane = LaneKind::Ready;
                d.behind = None;
                heads.insert((d.handler.clone(), d.key.clone().expect("keyed")), id);
            }
        }
        let keys: Option<HashSet<(&str, &str)>> = match scope {
            Unpark::Everything => None,
            Unpark::Keys { keys, .. } => Some(
                keys.iter()
                    .filter(|key| !heads.contains_key(*key))
                    .map(|(handler, key)| (handler.as_str(), key.as_str()))
                    .collect(),
            ),
        };
        let in_scope = |handler: &str, key: &str| keys.as_ref().is_none_or(|keys| keys.contains(&(handler, key)));
        let mut lowest: HashMap<HandlerKey, (i64, DeliveryId, LaneKind)> = HashMap::new();
        for (id, d) in &self.deliveries {
            if d.status != DeliveryStatus::Pending || !handlers.contains(&d.handler) {
                continue;
            }
            let (Some(key), Some(sequence)) = (&d.key, d.sequence) else { continue };
            if !in_scope(&d.handler, key) {
                continue;
            }
            let slot = lowest.entry((d.handler.clone(), key.clone())).or_insert((sequence, *id, d.lane));
            if sequence < slot.0 {
                *slot = (sequence, *id, d.lane);
            }
        }
        for (key, (_, id, lane)) in lowest {
            if lane == LaneKind::Parked {
                let d = self.deliveries.get_mut(&id).expect("exists");
                d.lane = LaneKind::Ready;
                d.behind = None;
            }
            heads.insert(key, id);
        }
        heads
    }

    fn new() -> Self {
        let lanes = (0..LANE_COUNT)
            .map(|id| LaneState {
                id: id as LaneId,
                owner: None,
                instance: None,
                lease_expires_at: DateTime::from_millis(0),
                epoch: 0,
                in_flight: Vec::new(),
            })
            .collect();
        Self {
            events: BTreeMap::new(),
            key_sequences: HashMap::new(),
            deliveries: BTreeMap::new(),
            lanes,
            history: BTreeMap::new(),
            hosts: BTreeMap::new(),
        }
    }

    /// The lease is current: its lane still has that epoch and the delivery that generation.
    /// (Not necessarily in that lane: one handed out without a record may be listed in any lane
    /// its holder holds, and its record, once it has one, is in its event's lane.)
    fn current(&self, lease: &Lease) -> bool {
        self.lanes[usize::from(lease.lane)].epoch == lease.epoch
            && self.deliveries.get(&lease.delivery).is_some_and(|d| d.claims == lease.claims && d.status == DeliveryStatus::Pending)
    }

    /// Whether the lane of `lease` still has its epoch.
    fn lane_current(&self, lease: &Lease) -> bool {
        self.lanes[usize::from(lease.lane)].epoch == lease.epoch
    }

    /// Inserts a fan-out's deliveries but those handed out `without` a record (which its
    /// events list instead), announces those it creates dead and marks its events fanned out.
    fn write_fan_out(&mut self, plan: &FanOutPlan, without: &WithoutDocuments, now: DateTime) {
        for dead_letter in &plan.dead_letters {
            // Built by the store itself, so it is valid; one published already stays.
            let _ = self.publish(dead_letter, usize::MAX);
        }
        self.insert_deliveries(plan, |id| !without.deliveries.contains_key(id), now);
        for fanned in &plan.events {
            if let Some(event) = self.events.get_mut(&id_text(&fanned.id)) {
                event.insert(field::FANNED_OUT_AT, now);
                let mut handlers: Vec<Bson> = match event.get(field::HANDLERS) {
                    Some(Bson::Array(list)) => list.clone(),
                    _ => Vec::new(),
                };
                handlers.extend(fanned.new_handlers.iter().cloned().map(Bson::String));
                event.insert(field::HANDLERS, handlers);
            }
        }
        self.list_handed_out(without);
    }

    /// Inserts the records of the plan's deliveries that `wanted`.
    fn insert_deliveries(&mut self, plan: &FanOutPlan, wanted: impl Fn(&DeliveryId) -> bool, now: DateTime) {
        for NewDelivery { id, event_id, event_type, handler, key, sequence, lane, dead_reason, behind } in
            plan.deliveries.iter().filter(|d| wanted(&d.id))
        {
            let dead = dead_reason.is_some();
            self.deliveries.insert(
                *id,
                Delivery {
                    event_id: event_id.clone(),
                    event_type: event_type.clone(),
                    handler: handler.clone(),
                    key: key.clone(),
                    sequence: *sequence,
                    lane_id: *lane,
                    lane: if dead {
                        LaneKind::Dead
                    } else if behind.is_some() {
                        LaneKind::Parked
                    } else {
                        LaneKind::Ready
                    },
                    status: if dead { DeliveryStatus::Dead } else { DeliveryStatus::Pending },
                    attempts: 0,
                    claims: 0,
                    due_at: now,
                    created_at: now,
                    updated_at: dead.then_some(now),
                    requeued_at: None,
                    last_error: dead_reason.clone(),
                    suspect: false,
                    behind: *behind,
                },
            );
        }
    }

    fn complete(&mut self, lease: &Lease, now: DateTime, history: bool) -> Settlement {
        if !self.current(lease) {
            return Settlement::LeaseLost;
        }
        let delivery = self.deliveries.remove(&lease.delivery).expect("checked above");
        self.stamp_completed(&delivery.event_id, now);
        if history {
            self.history.insert(
                lease.delivery,
                HistoryRecord { event_id: delivery.event_id, handler: delivery.handler, completed_at: now },
            );
        }
        Settlement::Completed
    }

    /// Stamps the event's latest completion.
    fn stamp_completed(&mut self, event_id: &Bson, now: DateTime) {
        if let Some(event) = self.events.get_mut(&id_text(event_id)) {
            let later = match event.get(field::COMPLETED_AT) {
                Some(Bson::DateTime(at)) => *at < now,
                _ => true,
            };
            if later {
                event.insert(field::COMPLETED_AT, now);
            }
        }
    }

    /// Completes what `lease` runs, with or without a record (the latter as `unstored` names it).
    fn complete_lease(&mut self, lease: &Lease, unstored: Option<Unstored>, now: DateTime, history: bool) -> Settlement {
        match unstored {
            Some(unstored) if !history => {
                if self.lane_current(lease) && self.complete_unstored(&Entry::of_lease(lease, unstored), now) {
                    Settlement::Completed
                } else {
                    Settlement::LeaseLost
                }
            }
            unstored => {
                self.materialize_lease(lease, unstored, now);
                self.complete(lease, now, history)
            }
        }
    }

    /// Gives the delivery of `lease` its record if it runs without one (as `unstored` names
    /// it), so that an outcome other than a completion applies.
    fn materialize_lease(&mut self, lease: &Lease, unstored: Option<Unstored>, now: DateTime) {
        if let Some(unstored) = unstored {
            self.materialize(&[Entry::of_lease(lease, unstored)], Charge::Nothing, now);
        }
    }

    fn bury(&mut self, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Settlement {
        if !self.current(lease) {
            return Settlement::LeaseLost;
        }
        let delivery = self.deliveries.get_mut(&lease.delivery).expect("checked above");
        delivery.status = DeliveryStatus::Dead;
        delivery.lane = LaneKind::Dead;
        delivery.claims += 1;
        delivery.attempts += u32::from(charge_attempt);
        delivery.last_error = Some(reason.to_string());
        delivery.updated_at = Some(now);
        Settlement::Completed
    }

    fn publish(&mut self, event: &NewEvent, max_payload_bytes: usize) -> Result<Published, StoreError> {
        event.validate(max_payload_bytes)?;
        if self.events.contains_key(&event.id) {
            return Ok(Published::Duplicate);
        }
        let sequence = event.key.as_ref().map(|key| {
            let counter = self.key_sequences.entry(key.clone()).or_insert(0);
            *counter += 1;
            *counter
        });
        self.events.insert(event.id.clone(), event.to_document(sequence, DateTime::now()));
        Ok(Published::New { sequence })
    }

    /// The entries of live lanes that run: at their record's generation, or without a record
    /// while their event names them.
    fn running(&self, now: DateTime) -> Vec<&InFlight> {
        self.lanes
            .iter()
            .filter(|lane| lane.owner.is_some() && lane.lease_expires_at >= now)
            .flat_map(|lane| lane.in_flight.iter())
            .filter(|entry| self.runs(entry))
            .collect()
    }

    /// Whether a lane's entry still runs: its record is at the entry's generation and pending,
    /// or, without a record, its event names it.
    fn runs(&self, entry: &InFlight) -> bool {
        match Entry::listed(std::slice::from_ref(entry)).first() {
            Some(unstored) => self.names(unstored),
            None => self.deliveries.get(&entry.delivery).is_some_and(|d| d.claims == entry.claims && d.status == DeliveryStatus::Pending),
        }
    }
}

/// An in-process outbox. Clones of the data are made with [`MemoryStore::instance`].
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
    claimer: Arc<Claimer>,
    options: StoreOptions,
}

impl MemoryStore {
    pub fn new(options: StoreOptions) -> Self {
        let claimer = Arc::new(Claimer::new(&options.owner, options.lease_duration));
        Self { state: Arc::new(Mutex::new(State::new())), claimer, options }
    }

    /// Another worker on the same data, with its own lanes and leases (like a second host).
    pub fn instance(&self, owner: &str) -> Self {
        let options = StoreOptions { owner: owner.to_string(), ..self.options.clone() };
        Self { state: self.state.clone(), claimer: Arc::new(Claimer::new(owner, options.lease_duration)), options }
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
}

impl MemoryTx {
    /// Publishes a follow-up event in this transaction.
    pub fn publish(&mut self, event: &NewEvent, max_payload_bytes: usize) -> Result<Published, StoreError> {
        self.state.publish(event, max_payload_bytes)
    }
}

impl StoreTransaction for MemoryTx {
    async fn commit(mut self) -> Result<(), StoreError> {
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

fn to_view(id: &DeliveryId, d: &Delivery) -> DeliveryView {
    DeliveryView {
        id: id.to_hex(),
        event_id: id_text(&d.event_id),
        event_type: d.event_type.clone(),
        handler: d.handler.clone(),
        key: d.key.clone(),
        sequence: d.sequence,
        status: d.status,
        lane: d.lane.as_str().to_string(),
        lane_id: d.lane_id,
        attempts: d.attempts,
        due_at: d.due_at,
        created_at: d.created_at,
        updated_at: d.updated_at,
        last_error: d.last_error.clone(),
    }
}

fn stats_for<'m>(map: &'m mut BTreeMap<String, HandlerStatistics>, handler: &str) -> &'m mut HandlerStatistics {
    map.entry(handler.to_string())
        .or_insert_with(|| HandlerStatistics { handler: handler.to_string(), ..Default::default() })
}

impl Store for MemoryStore {
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
        self.fan_out_handing_out(subscriptions, limit, hand_out.into(), now).await
    }

    async fn fan_out_early(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: impl Into<Capacity> + Send,
        early: &EarlyHandOuts,
        now: DateTime,
    ) -> Result<FanOutReport, StoreError> {
        let hand_out = hand_out.into();
        if hand_out.total > 0 && !self.options.completion_history {
            if let Some(report) = self.fan_out_plainly(subscriptions, limit, hand_out, early, now).await? {
                return Ok(report);
            }
        }
        self.fan_out_handing_out(subscriptions, limit, hand_out, now).await
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

    async fn complete_many(&self, leases: &[Lease], now: DateTime) -> Result<Vec<Settlement>, StoreError> {
        let mut state = self.state.lock().await;
        let results: Vec<Settlement> = leases
            .iter()
            .map(|lease| {
                if self.claimer.issued(lease) {
                    state.complete_lease(lease, self.claimer.unstored(lease), now, self.options.completion_history)
                } else {
                    Settlement::LeaseLost
                }
            })
            .collect();
        let (completed, lost): (Vec<_>, Vec<_>) =
            leases.iter().zip(&results).partition(|(_, settlement)| **settlement == Settlement::Completed);
        self.claimer.completed(completed.into_iter().map(|(lease, _)| lease));
        self.claimer.settled(lost.into_iter().map(|(lease, _)| lease));
        Ok(results)
    }

    async fn complete_in(&self, tx: &mut MemoryTx, lease: &Lease, now: DateTime) -> Result<(), StoreError> {
        let unstored = self.claimer.unstored(lease);
        if !self.claimer.issued(lease)
            || tx.state.complete_lease(lease, unstored, now, self.options.completion_history) != Settlement::Completed
        {
            return Err(StoreError::LeaseLost(lease.to_string()));
        }
        tx.settles.push(*lease);
        Ok(())
    }

    async fn reschedule(&self, lease: &Lease, due_at: DateTime, error: &str, now: DateTime) -> Result<Settlement, StoreError> {
        let mut state = self.state.lock().await;
        if !self.claimer.issued(lease) {
            return Ok(Settlement::LeaseLost);
        }
        state.materialize_lease(lease, self.claimer.unstored(lease), now);
        if !state.current(lease) {
            self.claimer.settled([lease]);
            return Ok(Settlement::LeaseLost);
        }
        let delivery = state.deliveries.get_mut(&lease.delivery).expect("current");
        delivery.attempts += 1;
        delivery.claims += 1;
        delivery.due_at = due_at;
        delivery.last_error = Some(error.to_string());
        delivery.updated_at = Some(now);
        self.claimer.settled([lease]);
        Ok(Settlement::Completed)
    }

    async fn release(&self, leases: &[Lease], now: DateTime) -> Result<usize, StoreError> {
        let mut state = self.state.lock().await;
        let mut released = 0;
        for lease in leases.iter().filter(|lease| self.claimer.issued(lease)) {
            state.materialize_lease(lease, self.claimer.unstored(lease), now);
            if state.current(lease) {
                let delivery = state.deliveries.get_mut(&lease.delivery).expect("current");
                delivery.claims += 1;
                delivery.updated_at = Some(now);
                released += 1;
            }
        }
        self.claimer.settled(leases);
        Ok(released)
    }

    async fn bury(&self, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<Settlement, StoreError> {
        let mut state = self.state.lock().await;
        if !self.claimer.issued(lease) {
            return Ok(Settlement::LeaseLost);
        }
        state.materialize_lease(lease, self.claimer.unstored(lease), now);
        let settlement = state.bury(lease, reason, charge_attempt, now);
        self.claimer.settled([lease]);
        Ok(settlement)
    }

    async fn bury_in(&self, tx: &mut MemoryTx, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<(), StoreError> {
        if !self.claimer.issued(lease) {
            return Err(StoreError::LeaseLost(lease.to_string()));
        }
        tx.state.materialize_lease(lease, self.claimer.unstored(lease), now);
        if tx.state.bury(lease, reason, charge_attempt, now) != Settlement::Completed {
            return Err(StoreError::LeaseLost(lease.to_string()));
        }
        tx.settles.push(*lease);
        Ok(())
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
        let mut state = self.state.lock().await;
        let mut report = PurgeReport::default();
        if let Some(cutoff) = options.dead_before {
            let before = state.deliveries.len();
            state.deliveries.retain(|_, d| {
                !(d.status == DeliveryStatus::Dead && d.updated_at.unwrap_or(d.created_at) < cutoff)
            });
            report.dead_deliveries = (before - state.deliveries.len()) as u64;
        }
        if let Some(cutoff) = options.completed_before {
            let before = state.history.len();
            state.history.retain(|_, record| record.completed_at >= cutoff);
            report.history_records = (before - state.history.len()) as u64;
        }
        let referenced: HashSet<String> = state
            .deliveries
            .values()
            .map(|d| id_text(&d.event_id))
            .chain(state.history.values().map(|r| id_text(&r.event_id)))
            .collect();
        let before = state.events.len();
        // An event still listing a handler in `handedOut` has a delivery running without a record.
        let handed_out = |event: &Document| matches!(event.get(field::HANDED_OUT), Some(Bson::Array(list)) if !list.is_empty());
        state.events.retain(|id, event| referenced.contains(id) || handed_out(event) || !event_expired(event, options));
        report.events = (before - state.events.len()) as u64;
        Ok(report)
    }

    async fn unfanned_events(&self) -> Result<u64, StoreError> {
        let state = self.state.lock().await;
        Ok(state.events.values().filter(|doc| !doc.contains_key(field::FANNED_OUT_AT)).count() as u64)
    }

    async fn statistics(&self, now: DateTime) -> Result<Vec<HandlerStatistics>, StoreError> {
        let state = self.state.lock().await;
        let running_entries = state.running(now);
        let running: HashSet<DeliveryId> = running_entries.iter().map(|entry| entry.delivery).collect();
        let mut by_handler: BTreeMap<String, HandlerStatistics> = BTreeMap::new();
        // Those without a record run, and have no record to be counted by below.
        for entry in running_entries.iter().filter(|entry| entry.unstored.is_some()) {
            stats_for(&mut by_handler, &entry.handler).running += 1;
        }
        for (id, d) in &state.deliveries {
            let stats = stats_for(&mut by_handler, &d.handler);
            match d.status {
                DeliveryStatus::Dead => stats.dead += 1,
                DeliveryStatus::Pending => {
                    if running.contains(id) {
                        stats.running += 1;
                    } else {
                        stats.pending += 1;
                    }
                    if d.lane == LaneKind::Parked {
                        stats.parked += 1;
                    }
                    stats.oldest_due_at = Some(stats.oldest_due_at.map_or(d.due_at, |at| at.min(d.due_at)));
                }
            }
        }
        if self.options.completion_history {
            for record in state.history.values() {
                *stats_for(&mut by_handler, &record.handler).completed.get_or_insert(0) += 1;
            }
            for stats in by_handler.values_mut() {
                stats.completed.get_or_insert(0);
            }
        }
        Ok(by_handler.into_values().collect())
    }

    async fn list_deliveries(&self, filter: &DeliveryFilter) -> Result<DeliveryPage, StoreError> {
        let after = filter.after_id()?;
        let limit = filter.page_limit();
        let state = self.state.lock().await;
        let matches = |d: &Delivery| {
            filter.status.is_none_or(|s| d.status == s)
                && filter.handler.as_ref().is_none_or(|h| &d.handler == h)
                && filter.event_type.as_ref().is_none_or(|t| &d.event_type == t)
                && filter.event_id.as_ref().is_none_or(|e| id_text(&d.event_id) == *e)
                && filter.key.as_ref().is_none_or(|k| d.key.as_ref() == Some(k))
        };
        let range = match after {
            Some(after) => state.deliveries.range((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded)),
            None => state.deliveries.range(..),
        };
        let deliveries = range.filter(|(_, d)| matches(d)).take(limit + 1).map(|(id, d)| to_view(id, d)).collect();
        Ok(DeliveryPage::from_overfetch(deliveries, limit))
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
