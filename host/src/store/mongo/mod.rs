//! The MongoDB store: the outbox in the operator's replica set or sharded cluster.
//!
//! Collections (`<prefix>` defaults to `relayhost_`): `events` (written by publishers),
//! `key_sequences` (one counter per ordering key), `deliveries` (one per unfinished event and
//! handler; deleted on completion), `lanes` (256 lease documents) and `completed_deliveries`
//! (with completion history). Claims and renewals write with majority write concern and read
//! from the primary whatever the client's defaults are, so a lease survives a failover and
//! the ordering check never reads a stale secondary.

/// Runs `$body`, which uses `$tx: &mut MongoTx` and evaluates to `Result<_, StoreError>`,
/// in a transaction with the retry rules of [`crate::store::Retrying`].
macro_rules! transaction {
    ($store:expr, |$tx:ident| $body:expr) => {
        transaction!($store, $crate::store::mongo::Commit::Majority, |$tx| $body)
    };
    ($store:expr, $commit:expr, |$tx:ident| $body:expr) => {{
        let mut retrying = $crate::store::Retrying::new();
        loop {
            let mut tx = $store.begin_with($commit).await?;
            let outcome: Result<_, $crate::store::StoreError> = async {
                let $tx = &mut tx;
                $body
            }
            .await;
            if let Some(result) = retrying.settle(tx, outcome).await {
                break result;
            }
        }
    }};
}

mod documents;
mod fan_out;
mod free_lanes;
mod generations;
mod handler_documents;
mod heads;
mod heard;
mod hosts;
mod lane_statements;
mod lanes;
mod limiters;
mod operations;
mod outcome;
mod registry;
mod setup;
mod suspects;
mod unfanned;
mod unstored;
mod wakeup;

pub use wakeup::EventWakeups;

use crate::store::{Administration, Hosts, Outbox};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bson::{Bson, DateTime, Document};
use mongodb::options::{
    CollectionOptions, ReadConcern, ReadPreference, SelectionCriteria, TransactionOptions, WriteConcern,
};
use mongodb::{Client, ClientSession, Collection, Database};

use super::claim::{Claimer, LaneSearch};
use super::outcome::Change;
use super::limiter::{self, ShareGrant, ShareRequest};
use super::registry::{Declaration, Disposal, RegisteredHandler, RetireReport};
use crate::lane::LaneId;
use super::{
    Capacity, ClaimedDelivery, DeliveryFilter, DeliveryPage, EarlyHandOuts, FanOutReport, HandlerStatistics, Lease, PurgeOptions,
    PurgeReport, Published, Settlement, StoreError, StoreOptions, StoreTransaction, Subscriptions,
};
use crate::event::NewEvent;
use crate::publish::{DEFAULT_PREFIX, Publisher};

/// Server error code of a command that ran past its `maxTimeMS` (here: `maxCommitTimeMS`).
const MAX_TIME_MS_EXPIRED: i32 = 50;

/// Where the store's collections live.
#[derive(Debug, Clone)]
pub struct MongoLocation {
    pub database: String,
    pub collection_prefix: String,
}

impl MongoLocation {
    /// Validates names so they cannot smuggle anything into a namespace.
    pub fn new(database: impl Into<String>, collection_prefix: impl Into<String>) -> Result<Self, StoreError> {
        let database = database.into();
        let collection_prefix = collection_prefix.into();
        let valid_database = (1..=63).contains(&database.len())
            && database.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid_database {
            return Err(StoreError::InvalidArgument(format!(
                "database {database:?} must be 1-63 characters of letters, digits, `_` and `-`"
            )));
        }
        let valid_prefix = collection_prefix.len() <= 64
            && collection_prefix.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
            && !collection_prefix.starts_with("system.");
        if !valid_prefix {
            return Err(StoreError::InvalidArgument(format!(
                "collection prefix {collection_prefix:?} must be at most 64 characters of letters, digits, `_`, `-` and `.`"
            )));
        }
        Ok(Self { database, collection_prefix })
    }

    pub fn with_default_prefix(database: impl Into<String>) -> Result<Self, StoreError> {
        Self::new(database, DEFAULT_PREFIX)
    }
}

#[derive(Clone)]
pub(crate) struct Collections {
    pub events: Collection<Document>,
    pub key_sequences: Collection<Document>,
    pub deliveries: Collection<Document>,
    pub lanes: Collection<Document>,
    pub history: Collection<Document>,
    /// Event documents too large to deliver, kept whole (see `fan_out::quarantine`).
    pub oversized_events: Collection<Document>,
    /// The live hosts' announcements (see `hosts`).
    pub hosts: Collection<Document>,
    /// The handler registry (see `registry`).
    pub handlers: Collection<Document>,
    /// Whose turn a job that one host at a time does is (see `Hosts::take_turn`).
    pub turns: Collection<Document>,
    /// Limits across hosts, one document per limited handler (see `limiters`).
    pub limiters: Collection<Document>,
}

impl Collections {
    fn new(database: &Database, prefix: &str) -> Self {
        // Majority writes and primary reads regardless of the client's defaults.
        let options = CollectionOptions::builder()
            .write_concern(WriteConcern::majority())
            .selection_criteria(SelectionCriteria::ReadPreference(ReadPreference::Primary))
            .build();
        let collection = |name: &str| database.collection_with_options(&format!("{prefix}{name}"), options.clone());
        Self {
            events: collection("events"),
            key_sequences: collection("key_sequences"),
            deliveries: collection("deliveries"),
            lanes: collection("lanes"),
            history: collection("completed_deliveries"),
            oversized_events: collection("oversized_events"),
            hosts: collection("hosts"),
            handlers: collection("handlers"),
            turns: collection("turns"),
            limiters: collection("limiters"),
        }
    }
}

/// The outbox in MongoDB. One instance is one claimer: it holds lanes of its own, even
/// beside other instances with the same owner name.
pub struct MongoStore {
    client: Client,
    collections: Collections,
    publisher: Publisher,
    claimer: Arc<Claimer>,
    /// Inserted events the change stream reported, for the next fan-out (see `fan_out`).
    heard: Arc<heard::Heard>,
    /// Whether a fan-out tries its plain mark first (see `fan_out`).
    plain_marks: Arc<crate::store::fan_out::PlainMarks>,
    /// Sessions of hosts that stopped announcing themselves this instance ended (see `hosts`).
    dead_hosts_sessions_ended: Arc<AtomicU64>,
    options: StoreOptions,
    location: MongoLocation,
}

impl MongoStore {
    async fn begin_with(&self, commit: Commit) -> Result<MongoTx, StoreError> {
        let mut session = self.client.start_session().await?;
        let options = TransactionOptions::builder()
            .read_concern(ReadConcern::snapshot())
            .write_concern(commit.write_concern())
            .selection_criteria(SelectionCriteria::ReadPreference(ReadPreference::Primary))
            .max_commit_time(self.options.transaction_budget)
            .build();
        session.start_transaction().with_options(options).await?;
        Ok(MongoTx {
            session,
            database: self.database(),
            started: Instant::now(),
            budget: self.options.transaction_budget,
            claimer: self.claimer.clone(),
            settles: Vec::new(),
        })
    }

    pub fn new(client: Client, location: MongoLocation, options: StoreOptions) -> Self {
        let database = client.database(&location.database);
        let collections = Collections::new(&database, &location.collection_prefix);
        let publisher =
            Publisher::new(&database, &location.collection_prefix).with_max_payload_bytes(options.max_payload_bytes);
        let claimer = Arc::new(Claimer::new(&options.owner, options.lease_duration));
        Self {
            client,
            collections,
            publisher,
            claimer,
            heard: Arc::default(),
            plain_marks: Arc::default(),
            dead_hosts_sessions_ended: Arc::default(),
            options,
            location,
        }
    }

    /// This instance's id among the live hosts (and as its lanes' holder).
    pub fn host_id(&self) -> String {
        self.claimer.host_id()
    }

    /// Another claimer on the same collections (a second worker in this process).
    pub fn instance(&self, owner: &str) -> Self {
        self.instance_with(owner, self.options.clone())
    }

    /// Another claimer on the same collections, with its own `options`.
    pub fn instance_with(&self, owner: &str, options: StoreOptions) -> Self {
        let options = StoreOptions { owner: owner.to_string(), ..options };
        Self::new(self.client.clone(), self.location.clone(), options)
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn location(&self) -> &MongoLocation {
        &self.location
    }

    /// The database of the store's collections (and of handlers' business collections).
    pub fn database(&self) -> mongodb::Database {
        self.client.database(&self.location.database)
    }

    /// Lanes this instance took over that wait for the charge of what their previous holder
    /// left in flight (a `/metrics` gauge: it should be 0 but for moments).
    pub fn lanes_waiting_for_charge(&self) -> usize {
        self.claimer.lanes_waiting_for_charge()
    }

    /// Sessions of hosts that stopped announcing themselves this instance ended (a `/metrics`
    /// counter: each dead host's open transactions, see `hosts`).
    pub fn dead_hosts_sessions_ended(&self) -> u64 {
        self.dead_hosts_sessions_ended.load(Ordering::Relaxed)
    }

    /// The publisher writing into this store's events collection.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// The events collection, for tools that write or inspect raw documents.
    pub fn events_collection(&self) -> &Collection<Document> {
        &self.collections.events
    }

    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    /// The claim primitives and the claimer, for fault-injection tests of the claim.
    #[cfg(test)]
    pub(crate) fn claim_parts(&self) -> (impl super::claim::ClaimBackend + '_, &Claimer) {
        (lanes::Backend { store: self }, &self.claimer)
    }

    /// See `fan_out::mark_late`.
    #[cfg(test)]
    pub(crate) async fn mark_late(&self, event: &str, handler: &str, fan_out: bson::oid::ObjectId, in_transaction: bool) -> bool {
        fan_out::mark_late(self, event, handler, fan_out, in_transaction).await
    }
}

/// The `_id` index, for lookups by id that also filter on a field another index leads with:
/// left to itself the planner can pick that index and walk every entry of it.
fn by_id() -> mongodb::options::Hint {
    mongodb::options::Hint::Keys(bson::doc! { "_id": 1 })
}

/// How long a transaction's commit waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Commit {
    /// Until a majority has it (on a single node: until it is journaled). Every write that
    /// fences or ends work, and every claim's.
    Majority,
    /// Until the primary applied it. Only for work that is safe to lose, or to lose and do
    /// again (a fan-out, and its hand-out's lane lists of unkeyed deliveries, see
    /// [`crate::store::claim::LaneWrite`]), whose effects nothing keyed or final acts on
    /// before a later majority write of this store, which by oplog order makes it durable
    /// too.
    Applied,
}

impl Commit {
    fn write_concern(self) -> WriteConcern {
        match self {
            Commit::Majority => WriteConcern::majority(),
            Commit::Applied => WriteConcern::nodes(1),
        }
    }

    /// The same, for a raw command.
    fn write_concern_document(self) -> bson::Document {
        match self {
            Commit::Majority => bson::doc! { "w": "majority" },
            Commit::Applied => bson::doc! { "w": 1 },
        }
    }
}

impl From<crate::store::claim::LaneWrite> for Commit {
    fn from(write: crate::store::claim::LaneWrite) -> Self {
        match write {
            crate::store::claim::LaneWrite::Durable => Commit::Majority,
            crate::store::claim::LaneWrite::Applied => Commit::Applied,
        }
    }
}

/// A MongoDB transaction: a session with a started transaction and a time budget.
pub struct MongoTx {
    session: ClientSession,
    /// Where a handler's collections are (see `handler_documents`).
    database: mongodb::Database,
    started: Instant,
    budget: Duration,
    claimer: Arc<Claimer>,
    /// Leases this transaction settles (a handler's completion, a burial): settled for the
    /// claimer once it commits.
    settles: Vec<Lease>,
}

impl MongoTx {
    /// The session, for the caller's own writes in this transaction.
    pub fn session(&mut self) -> &mut ClientSession {
        &mut self.session
    }

    fn settles_on_commit(&mut self, lease: Lease) {
        self.settles.push(lease);
    }
}

impl StoreTransaction for MongoTx {
    async fn commit(mut self) -> Result<(), StoreError> {
        if self.started.elapsed() > self.budget {
            let _ = self.session.abort_transaction().await;
            return Err(StoreError::TransactionTimeout(self.budget));
        }
        let deadline = Instant::now() + super::TRANSACTION_RETRY_LIMIT;
        loop {
            match self.session.commit_transaction().await.map_err(StoreError::from) {
                Ok(()) => {
                    self.claimer.settled(&self.settles);
                    return Ok(());
                }
                Err(error) if error.server_code() == Some(MAX_TIME_MS_EXPIRED) => {
                    return Err(StoreError::TransactionTimeout(self.budget));
                }
                Err(error) if error.is_unknown_commit_result() && Instant::now() < deadline => continue,
                Err(error) => return Err(error),
            }
        }
    }

    async fn abort(mut self) -> Result<(), StoreError> {
        Ok(self.session.abort_transaction().await?)
    }
}

impl Outbox for MongoStore {
    type Tx = MongoTx;

    async fn setup(&self) -> Result<(), StoreError> {
        setup::run(&self.client, &self.collections, &self.location).await
    }

    async fn begin(&self) -> Result<MongoTx, StoreError> {
        self.begin_with(Commit::Majority).await
    }

    async fn publish(&self, tx: &mut MongoTx, event: &NewEvent) -> Result<Published, StoreError> {
        self.publisher.publish(&mut tx.session, event).await
    }

    async fn fan_out(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: impl Into<Capacity> + Send,
        now: DateTime,
    ) -> Result<FanOutReport, StoreError> {
        let report = fan_out::run(self, subscriptions, limit, hand_out.into(), None, now).await?;
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
        let report = fan_out::run(self, subscriptions, limit, hand_out.into(), Some(early), now).await?;
        self.claimer.note_fan_out(&report);
        Ok(report)
    }

    async fn claim(&self, handlers: &[String], limit: impl Into<Capacity> + Send, now: DateTime) -> Result<Vec<ClaimedDelivery>, StoreError> {
        self.claimer.claim(&lanes::Backend { store: self }, handlers, LaneSearch::FreeWithDueWork, limit.into(), now).await
    }

    async fn claim_in(
        &self,
        handlers: &[String],
        lanes: &[LaneId],
        limit: impl Into<Capacity> + Send,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        self.claimer.claim(&lanes::Backend { store: self }, handlers, LaneSearch::Only(lanes), limit.into(), now).await
    }

    async fn record_starts(&self, leases: &[Lease]) -> Result<Vec<bool>, StoreError> {
        self.claimer.record_starts(&lanes::Backend { store: self }, leases).await
    }

    fn hints(&self) -> crate::store::SchedulerHints<'_> {
        crate::store::SchedulerHints::of(&self.claimer)
    }

    async fn complete_many(&self, leases: &[Lease], now: DateTime) -> Result<Vec<Settlement>, StoreError> {
        crate::store::outcome::complete(self, leases, now).await
    }

    async fn complete_in(&self, tx: &mut MongoTx, lease: &Lease, now: DateTime) -> Result<(), StoreError> {
        crate::store::outcome::complete_in(self, tx, lease, now).await
    }

    /// Creates those of `names` (business collections of the store's database) that do not
    /// exist yet. MongoDB creates a missing collection inside a transaction, but two
    /// transactions that both create one conflict, and one of them has to run again. Those
    /// that exist are left alone: creating a collection is a catalog change, which the
    /// transactions running meanwhile may have to abort for.
    async fn create_collections(&self, names: &[String]) -> Result<(), StoreError> {
        let database = self.database();
        let existing = database.list_collection_names().filter(bson::doc! { "name": { "$in": names } }).await?;
        for name in names.iter().filter(|name| !existing.contains(name)) {
            setup::create_collection(&database, name).await?;
        }
        Ok(())
    }

    async fn reschedule(&self, lease: &Lease, due_at: DateTime, error: &str, now: DateTime) -> Result<Settlement, StoreError> {
        crate::store::outcome::settle_one(self, lease, Change::Reschedule { due_at, error }, now).await
    }

    async fn release(&self, leases: &[Lease], now: DateTime) -> Result<usize, StoreError> {
        crate::store::outcome::settle(self, leases, Change::HandBack, now).await
    }

    async fn bury(&self, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<Settlement, StoreError> {
        crate::store::outcome::settle_one(self, lease, Change::Bury { reason, charge_attempt }, now).await
    }

    async fn bury_in(&self, tx: &mut MongoTx, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<(), StoreError> {
        crate::store::outcome::settle_in(self, tx, lease, Change::Bury { reason, charge_attempt }, now).await
    }

    async fn extend_lease(&self, leases: &[Lease], now: DateTime) -> Result<Vec<bool>, StoreError> {
        outcome::extend_lease(self, leases, now).await
    }
}

impl Hosts for MongoStore {

    async fn relinquish(&self) -> Result<(), StoreError> {
        outcome::relinquish(self).await?;
        hosts::withdraw(self).await
    }

    async fn announce(&self, now: DateTime) -> Result<usize, StoreError> {
        hosts::announce(self, now).await
    }

    async fn look(&self, now: DateTime) -> Result<usize, StoreError> {
        hosts::look(self, now).await
    }

    async fn register(&self, declarations: &[Declaration], now: DateTime) -> Result<Vec<RegisteredHandler>, StoreError> {
        registry::register(self, declarations, now).await
    }

    async fn registered_handlers(&self, now: DateTime) -> Result<Vec<RegisteredHandler>, StoreError> {
        registry::handlers_now(self, now).await
    }

    async fn membership(&self, now: DateTime) -> Result<crate::store::Membership, StoreError> {
        operations::membership(self, now).await
    }

    async fn take_turn(&self, job: &str, turn: std::time::Duration, now: DateTime) -> Result<bool, StoreError> {
        hosts::take_turn(self, job, turn, now).await
    }

    async fn lease_share(&self, handler: &str, request: &ShareRequest, now: DateTime) -> Result<ShareGrant, StoreError> {
        let lease_ms = self.claimer.lease_duration.as_millis() as i64;
        limiter::lease_share(&limiters::Limiters { store: self }, &self.claimer.host_id(), handler, request, now, lease_ms).await
    }
}

impl Administration for MongoStore {

    async fn retire(&self, handler: &str, disposal: Disposal, now: DateTime) -> Result<RetireReport, StoreError> {
        registry::retire(self, handler, disposal, now).await
    }

    async fn requeue(&self, delivery_id: &str, now: DateTime) -> Result<(), StoreError> {
        outcome::requeue(self, delivery_id, now).await
    }

    async fn reopen_for(&self, handler: &str, types: &[String], since: Option<DateTime>, limit: usize) -> Result<Vec<Bson>, StoreError> {
        operations::reopen_for(self, handler, types, since, limit).await
    }

    async fn backfill_waiting(&self, handler: &str, types: &[String], since: Option<DateTime>) -> Result<usize, StoreError> {
        operations::backfill_waiting(self, handler, types, since).await
    }

    async fn unfanned_among(&self, events: &[Bson]) -> Result<usize, StoreError> {
        operations::unfanned_among(self, events).await
    }

    async fn bury_pending_in(&self, tx: &mut MongoTx, delivery_id: &str, reason: &str, now: DateTime) -> Result<crate::store::DeliveryView, StoreError> {
        outcome::bury_pending_in(self, tx, delivery_id, reason, now).await
    }

    async fn purge(&self, options: &PurgeOptions, now: DateTime) -> Result<PurgeReport, StoreError> {
        operations::purge(self, options, now).await
    }

    async fn event_history(&self, event_id: &str) -> Result<crate::store::EventHistory, StoreError> {
        operations::event_history(self, event_id).await
    }

    async fn purge_preview(&self, options: &PurgeOptions, now: DateTime) -> Result<PurgeReport, StoreError> {
        operations::purge_preview(self, options, now).await
    }

    async fn statistics(&self, now: DateTime) -> Result<Vec<HandlerStatistics>, StoreError> {
        operations::statistics(self, now).await
    }

    async fn unfanned_events(&self) -> Result<u64, StoreError> {
        // The partial index holds exactly these: counting them walks the backlog's keys only.
        Ok(self
            .collections
            .events
            .count_documents(bson::doc! { crate::event::field::FANNED_OUT_AT: bson::Bson::Null })
            .hint(mongodb::options::Hint::Name(setup::UNFANNED.into()))
            .await?)
    }

    async fn list_deliveries(&self, filter: &DeliveryFilter) -> Result<DeliveryPage, StoreError> {
        operations::list_deliveries(self, filter).await
    }
}
