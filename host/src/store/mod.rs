//! The outbox store: events, their per-handler deliveries, lanes and leases.
//!
//! This module owns the [`Store`] trait, in three parts: the [`Outbox`] (publish, fan-out,
//! claims, outcomes, transactions, and the claim's scheduler hints), the [`Hosts`] (their
//! announcements and turns, the handler registry, who holds which lane) and the
//! [`Administration`] (statistics, listing, requeue, bury, purge, retire); and the types that
//! cross them. Two implementations
//! keep the same semantics: [`mongo::MongoStore`] (the product) and [`memory::MemoryStore`]
//! (in process, for plugin authors' tests and fast unit tests); one contract suite
//! (`host/tests/store_contract.rs`) runs against both. The store must never know about
//! WebAssembly, plugins or the dispatcher's policies (backoff, attempt limits): callers pass
//! decisions in, the store applies them atomically and fenced.

mod answered;
pub(crate) mod backfill;
mod assignment;
mod capacity;
mod claim;
mod error;
mod fan_out;
pub mod handler_documents;
mod lease;
pub mod limiter;
mod listing;
mod outcome;
pub mod registry;
pub mod memory;
pub mod mongo;
mod retention;
mod subscriptions;
mod transaction;
mod unstored;

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use bson::DateTime;
use bson::oid::ObjectId;

pub use capacity::{Capacity, KeyLimits, Priorities, Room, Rooms};
pub use error::StoreError;
pub use handler_documents::HandlerDocuments;
pub use lease::Lease;
pub use subscriptions::{PerKey, PriorityFrom, Subscription, Subscriptions};
pub use registry::{Declaration, Disposal, RegisteredHandler, RetireReport};
pub use listing::{DeliveryFilter, DeliveryPage, DeliveryView, EventHistory, HandlerStatistics, LaneView, Listed, Membership, PurgeReport};
pub use transaction::{Retrying, TRANSACTION_RETRY_LIMIT, run_in_transaction};

use crate::event::{EventRecord, NewEvent};
use crate::lane::LaneId;

/// How often at most a host announces itself (see [`Hosts::announce`]); a host that joins
/// is seen by the others within that.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(1);

/// A delivery's id: the `_id` of its document.
pub type DeliveryId = ObjectId;

/// Handler name under which an event is dead-lettered when its `type` cannot be read, so
/// no subscription can be chosen for it.
pub const MALFORMED_EVENT_HANDLER: &str = "relayhost.malformed";

/// Longest handler id, in characters.
pub const MAX_HANDLER_CHARS: usize = 128;

/// The `lastError` of a delivery charged an attempt because the host running it died.
pub(crate) const LOST_WHILE_RUNNING: &str = "lease lost: the worker running it stopped renewing its lane";

/// Settings shared by both stores.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Identifies the worker in lane documents (`owner`). Several store instances may share
    /// it; lanes are still held per instance.
    pub owner: String,
    /// How long a lane stays leased without a claim or renewal.
    pub lease_duration: Duration,
    /// Keep a record of every completed delivery (`<prefix>completed_deliveries`).
    pub completion_history: bool,
    /// Documents deleted per purge step.
    pub purge_batch_size: usize,
    /// The share of its time a purge works (0.01 to 1): after each step it rests
    /// `(1 - pace) / pace` times as long as the step took, leaving the rest of the server to
    /// the deliveries and the publishers. 1 purges flat out.
    pub purge_pace: f64,
    /// Largest accepted event payload (BSON bytes).
    pub max_payload_bytes: usize,
    /// Time a transaction may take from start to commit before it is aborted.
    pub transaction_budget: Duration,
    /// The `appName` this store's MongoDB client gives the server, unique to its process
    /// (`relayhost run` sets one). Announced with the host, it lets the other hosts end this
    /// process's open transactions should it die (see `mongo/hosts.rs`); `None`: they wait
    /// for the server's transaction lifetime instead.
    pub client_app_name: Option<String>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            owner: default_owner(),
            lease_duration: Duration::from_secs(30),
            completion_history: false,
            purge_batch_size: 500,
            purge_pace: 1.0,
            max_payload_bytes: crate::event::DEFAULT_MAX_PAYLOAD_BYTES,
            transaction_budget: Duration::from_secs(5),
            client_app_name: None,
        }
    }
}

fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".to_string());
    format!("{host}:{}", std::process::id())
}

/// A delivery handed to a worker by [`Outbox::claim`].
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedDelivery {
    pub lease: Lease,
    pub handler: String,
    /// Attempts already charged before this one (failed runs and lost leases).
    pub attempts: u32,
    pub event: EventRecord,
    /// Listed in its lane as started: should the host die, a takeover charges its attempt.
    /// One claimed ahead of a free run slot is listed as not started, and is not charged: it
    /// may only have waited for a slot.
    pub started: bool,
    /// A host died while it was claimed ahead and may have been running it (see
    /// `Candidate::suspect`): claimed ahead, it records its start ([`Outbox::record_starts`])
    /// before it runs, so that its next death is charged.
    pub suspect: bool,
    /// Handed out before its fan-out committed: the word of that commit, which its run waits
    /// for before its outcome is written (as not run if the commit failed: it may not exist),
    /// and a transactional handler's run before it starts (its completion deletes the
    /// delivery in its own transaction). `None` for every other lease: it may run and settle
    /// at once. The dispatcher checks it in one place (its `start`).
    pub before_commit: Option<FanOutCommit>,
}

/// The result of settling one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    Completed,
    /// The lease was no longer current: another worker took the lane over, or the delivery
    /// was settled already. Nothing was changed.
    LeaseLost,
}

/// What one fan-out step did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FanOutReport {
    /// Events marked fanned out (malformed ones included).
    pub events: usize,
    /// Deliveries created, dead letters of malformed events included.
    pub deliveries: usize,
    /// Malformed event documents dead-lettered.
    pub malformed: usize,
    /// Each malformed event (its id and what is wrong with it): its deliveries are dead, and
    /// their deaths announced.
    pub malformed_events: Vec<(String, String)>,
    /// The lanes of the new deliveries that are left to a claim (for [`Outbox::claim_in`]):
    /// all of them but those handed out.
    pub lanes: BTreeSet<LaneId>,
    /// New deliveries handed out to this store instance as the fan-out committed them: claimed,
    /// under leases like those of [`Outbox::claim`].
    pub claimed: Vec<ClaimedDelivery>,
    /// New deliveries handed out before the commit instead (see [`Outbox::fan_out_early`]).
    pub sent_early: usize,
    /// Unfanned events of this host's lanes may remain beyond the batch although it was not
    /// full (it read past other hosts' events): fan out again at once.
    pub more: bool,
    /// The batch read every unfanned event there was (of any host's lanes).
    pub read_to_the_end: bool,
    /// The keys (with their handlers) of the keyed deliveries it left to claims: their store
    /// notes them (see [`SchedulerHints::followers_may_wait`]).
    pub(crate) left_to_claims: Vec<(String, String)>,
    /// The keys (with their handlers) whose heads it handed out: nothing of theirs was pending
    /// in the store, so none of their deliveries waits for a claim but those it left to
    /// claims itself (see [`SchedulerHints::followers_may_wait`]).
    pub(crate) handed_out_keys: Vec<(String, String)>,
    /// The ordering keys whose unfanned events a batch that may hand out left unfanned, since a
    /// delivery of theirs ran on this instance (named only by a read that reached the end of
    /// the rest): their store notes them (see [`SchedulerHints::unfanned_may_wait`]).
    pub(crate) deferred_keys: Vec<String>,
}

impl FanOutReport {
    /// This report and `other`'s, for a fan-out made of both.
    pub fn and(mut self, other: FanOutReport) -> FanOutReport {
        self.events += other.events;
        self.deliveries += other.deliveries;
        self.malformed += other.malformed;
        self.malformed_events.extend(other.malformed_events);
        self.lanes.extend(other.lanes);
        self.claimed.extend(other.claimed);
        self.sent_early += other.sent_early;
        self.more |= other.more;
        self.read_to_the_end |= other.read_to_the_end;
        self.left_to_claims.extend(other.left_to_claims);
        self.handed_out_keys.extend(other.handed_out_keys);
        self.deferred_keys.extend(other.deferred_keys);
        self
    }
}

/// The word of an early hand-out's commit; its clones share it.
#[derive(Debug, Clone)]
pub struct FanOutCommit(tokio::sync::watch::Receiver<Option<bool>>);

/// Two words are equal when they are the word of one commit.
impl PartialEq for FanOutCommit {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_channel(&other.0)
    }
}

impl FanOutCommit {
    /// The word the returned sender gives: `Some(true)` once the fan-out committed,
    /// `Some(false)` if it did not. A sender dropped without a word means the fan-out was
    /// abandoned: not committed.
    pub fn channel() -> (tokio::sync::watch::Sender<Option<bool>>, Self) {
        let (tell, word) = tokio::sync::watch::channel(None);
        (tell, Self(word))
    }

    /// Whether the fan-out committed; waits until that is known. If it did not, its
    /// deliveries may not exist: whatever ran of them is to be handed back as not run.
    pub async fn committed(mut self) -> bool {
        matches!(self.0.wait_for(Option::is_some).await.as_deref(), Ok(Some(true)))
    }
}

/// Where a fan-out sends the deliveries it hands out as soon as it had marked their events
/// and listed them in their lanes, before it inserted them and committed (see
/// [`Outbox::fan_out_early`]); each carries the word of that commit
/// ([`ClaimedDelivery::before_commit`]).
pub type EarlyHandOuts = tokio::sync::mpsc::UnboundedSender<Vec<ClaimedDelivery>>;

/// Retention cutoffs for [`Administration::purge`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeOptions {
    /// Delete dead deliveries whose last change is older.
    pub dead_before: Option<DateTime>,
    /// Delete completion history older than this, and let events whose latest completion is
    /// older go (they are kept as deduplication records until then).
    pub completed_before: Option<DateTime>,
}

/// State of a stored delivery (a completed one is deleted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryStatus {
    Pending,
    Dead,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Dead => "dead",
        }
    }
}

/// Result of publishing one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// Written, with its key's sequence when keyed.
    New { sequence: Option<i64> },
    /// An event with this id exists already; nothing was written.
    Duplicate,
}

/// What this instance's fan-outs and claims noted of the work they left waiting, which tells
/// the dispatcher when a settled delivery asks for a claim or a fan-out. Kept by the shared
/// claim; every store hands out its own ([`Outbox::hints`]).
pub struct SchedulerHints<'a>(&'a claim::Claimer);

impl<'a> SchedulerHints<'a> {
    pub(crate) fn of(claimer: &'a claim::Claimer) -> Self {
        Self(claimer)
    }

    /// Whether deliveries of `handler` and `key` may wait for a claim once one of theirs is
    /// settled: this instance's fan-outs left some of them to claims, or its claims parked
    /// some, since a fan-out last handed the key's head out (nothing of it pending then). A
    /// completion of a key with none asks for no claim in its lane (its next event is
    /// not fanned out yet, or is handed out by the fan-out that marks it); what another host
    /// left there is found by the poll, and whatever stays parked by the unpark sweep.
    pub fn followers_may_wait(&self, handler: &str, key: &str) -> bool {
        self.0.followers_may_wait(&(handler.to_string(), key.to_string()))
    }

    /// Whether unfanned events of `key` wait for a fan-out once a delivery of theirs that ran
    /// on this instance is settled: a fan-out that may hand out leaves the events of keys that
    /// run here unfanned, instead of creating their deliveries parked for a claim. Asked once
    /// per settled keyed delivery; `true` once per note. A settle between a fan-out's read and
    /// its note is found by the next poll.
    pub fn unfanned_may_wait(&self, key: &str) -> bool {
        self.0.unfanned_may_wait(key)
    }

    /// Whether this instance holds lanes a new split gave another live host: they take no new
    /// work here, and the next claim hands back those that ran empty (see
    /// [`crate::store::assignment`]). False while a claim runs: that claim hands back those
    /// that ran empty, and the completion of a run in one of the rest asks again.
    pub fn holds_lanes_of_another_host(&self) -> bool {
        self.0.holds_lanes_of_another_host()
    }
}

/// A transaction of a store: writes made through it commit or abort together.
pub trait StoreTransaction: Send {
    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn abort(self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The outbox: publishing, fan-out, claims, outcomes and transactions, with the claim's
/// scheduler hints. Every method that changes a delivery takes the lease it was claimed with
/// and changes nothing when that lease is no longer current.
pub trait Outbox: Send + Sync + 'static {
    type Tx: StoreTransaction + HandlerDocuments;

    /// Creates collections, indexes and lane documents; idempotent, safe to run from several
    /// hosts at once.
    fn setup(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Starts a transaction (snapshot reads, majority commit, bounded by the time budget).
    ///
    /// Everything written in it must fit `StoreOptions::transaction_budget` (5 s by default),
    /// counted from here to the commit: a publisher writing hundreds of keyed events (each a
    /// round trip for its key's sequence) in one transaction on a loaded server can outlast it
    /// and have the commit refused (`StoreError::TransactionTimeout`). Publish large batches
    /// in several transactions, or raise the budget.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Writes `event` in `tx`; a keyed event takes its key's next sequence.
    fn publish(&self, tx: &mut Self::Tx, event: &NewEvent)
    -> impl Future<Output = Result<Published, StoreError>> + Send;

    /// Turns up to `limit` committed events into one delivery per subscribed handler, and
    /// hands out up to `hand_out` of the new ones that nothing can be ahead of (unkeyed, or the
    /// head of a key with nothing pending) to
    /// this instance as it commits them, where their lanes are free or its own (see
    /// [`FanOutReport::claimed`]): the short way from a commit to its handler.
    fn fan_out(&self, subscriptions: &Subscriptions, limit: usize, hand_out: impl Into<Capacity> + Send, now: DateTime)
    -> impl Future<Output = Result<FanOutReport, StoreError>> + Send;

    /// Like [`Outbox::fan_out`], but it may send what it hands out to `early` as soon as it
    /// holds their events (no other fan-out can create them) and has listed them in their
    /// lanes, before the deliveries are written and committed (the inserts' and the commit's
    /// round trips sooner); those are not in the report's `claimed`. Their runs must wait for
    /// [`FanOutCommit::committed`] before their outcome is written, and a transactional
    /// handler's run before it starts (its completion deletes the delivery in its own
    /// transaction). The default hands out after the commit, as `fan_out`.
    fn fan_out_early(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: impl Into<Capacity> + Send,
        early: &EarlyHandOuts,
        now: DateTime,
    ) -> impl Future<Output = Result<FanOutReport, StoreError>> + Send {
        let _ = early;
        self.fan_out(subscriptions, limit, hand_out, now)
    }

    /// Claims up to `limit` due deliveries of `handlers` through lane leases (those beyond
    /// its `run_now` claimed ahead, see [`Capacity`]).
    fn claim(&self, handlers: &[String], limit: impl Into<Capacity> + Send, now: DateTime)
    -> impl Future<Output = Result<Vec<ClaimedDelivery>, StoreError>> + Send;

    /// Claims like [`Outbox::claim`], but takes new lanes only among `lanes` (those a fan-out
    /// just filled, see [`FanOutReport::lanes`]) instead of searching every free lane: the
    /// short path from a commit to its handler. Lanes held already are claimed from as usual.
    fn claim_in(&self, handlers: &[String], lanes: &[LaneId], limit: impl Into<Capacity> + Send, now: DateTime)
    -> impl Future<Output = Result<Vec<ClaimedDelivery>, StoreError>> + Send;

    /// Records that deliveries claimed ahead (not [`ClaimedDelivery::started`]) start now, in
    /// their lanes' lists, so that a takeover charges them should this host die while they
    /// run; one flag per lease: `false` when its lane is no longer this instance's at the
    /// lease's epoch (it must not run: the lease is lost). Acknowledged once applied: a
    /// failover may lose it, which costs that start its charge should the host die.
    fn record_starts(&self, leases: &[Lease]) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;

    /// The claim's hints to the scheduler: when a settled delivery asks for a claim or a
    /// fan-out.
    fn hints(&self) -> SchedulerHints<'_>;

    /// Completes a batch in a fixed number of commands; one result per lease, in order.
    fn complete_many(&self, leases: &[Lease], now: DateTime)
    -> impl Future<Output = Result<Vec<Settlement>, StoreError>> + Send;

    /// Completes inside the caller's transaction, so the caller's writes and the completion
    /// commit together. Fails with [`StoreError::LeaseLost`] (abort the transaction then).
    fn complete_in(&self, tx: &mut Self::Tx, lease: &Lease, now: DateTime)
    -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Creates those of `names` (handlers' collections, see [`HandlerDocuments`]) that do not
    /// exist yet, before handlers' transactions write to them (a store that needs nothing
    /// of the kind does nothing).
    fn create_collections(&self, names: &[String]) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = names;
        async { Ok(()) }
    }

    /// Ends an attempt as failed: charges it and makes the delivery due again at `due_at`.
    fn reschedule(&self, lease: &Lease, due_at: DateTime, error: &str, now: DateTime)
    -> impl Future<Output = Result<Settlement, StoreError>> + Send;

    /// Hands claimed deliveries back without charging an attempt (graceful stop).
    fn release(&self, leases: &[Lease], now: DateTime) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Makes the delivery dead with `reason`; `charge_attempt` counts the attempt that failed.
    fn bury(&self, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime)
    -> impl Future<Output = Result<Settlement, StoreError>> + Send;

    /// [`Outbox::bury`] inside the caller's transaction (for a dead-letter event published in
    /// the same transaction). Fails with [`StoreError::LeaseLost`].
    fn bury_in(&self, tx: &mut Self::Tx, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime)
    -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the lanes of still-current leases to `now + lease_duration`; one flag per lease.
    fn extend_lease(&self, leases: &[Lease], now: DateTime)
    -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;
}

/// The hosts' membership: their announcements and turns, the handler registry they declare
/// to, lanes handed back, and who holds what.
pub trait Hosts: Send + Sync + 'static {

    /// Hands every lane this instance holds back at once, and withdraws its announcement
    /// (graceful stop): the other hosts take its share of the lanes at their next look.
    fn relinquish(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Announces this instance as a live host for a third of its lease from `now` (so one
    /// that dies leaves its share to the others that soon), reads which hosts
    /// are live and takes its share of the lanes among them: from then on its fan-outs leave
    /// the events of the other hosts' lanes to them (until stale), so that hosts do not race
    /// for the same events. Returns how many hosts are live. An instance that never announces
    /// itself fans out every event (see the `assignment` module). A host's dispatcher
    /// announces every [`ANNOUNCE_EVERY`] (or tenth of its lease, if shorter).
    fn announce(&self, now: DateTime) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Reads which hosts are live and takes this instance's share of the lanes among them, as
    /// [`Hosts::announce`] does, without announcing anything (it writes nothing). A host's
    /// dispatcher looks every tenth of the announcement interval, so that it learns of a host
    /// that joined long before its own next announcement.
    fn look(&self, now: DateTime) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Records that this instance serves `declarations` and nothing else (on its
    /// announcement), registers each of their handlers (anew if it was retired), and returns
    /// the registry (see [`registry`]). A host's dispatcher calls it when what it serves
    /// changed, and now and then to say it still does.
    fn register(&self, declarations: &[Declaration], now: DateTime)
    -> impl Future<Output = Result<Vec<RegisteredHandler>, StoreError>> + Send;

    /// The registry: every handler ever declared, with the live hosts serving each.
    fn registered_handlers(&self, now: DateTime) -> impl Future<Output = Result<Vec<RegisteredHandler>, StoreError>> + Send;

    /// Takes `job`'s turn for `turn` from `now`, unless another instance holds it: a job that
    /// one host at a time does (the scheduled purge). A turn is not handed back; the next
    /// is taken once it lapses, by whichever host asks first.
    fn take_turn(&self, job: &str, turn: Duration, now: DateTime) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The live hosts and every lane's holder (while its lease is live), for operators.
    fn membership(&self, now: DateTime) -> impl Future<Output = Result<Membership, StoreError>> + Send;

    /// This instance's ask of `handler`'s limits across all hosts at `now`: its share of the
    /// global concurrency, lasting a lease, and the rate's tokens (see [`limiter`]).
    fn lease_share(
        &self,
        handler: &str,
        request: &limiter::ShareRequest,
        now: DateTime,
    ) -> impl Future<Output = Result<limiter::ShareGrant, StoreError>> + Send;
}

/// Administration: what operators read and do (statistics, listing, requeue, bury, purge,
/// retire).
pub trait Administration: Outbox {

    /// Operator action: retires `handler` (refused while a live host serves it, or if it was
    /// never registered): fan-outs create no more of its deliveries once their hosts read the
    /// registry again (within [`ANNOUNCE_EVERY`]), and its pending ones are buried or dropped,
    /// but those a live lease still lists (counted, to retire again). Retiring a retired
    /// handler again keeps its retirement's time and disposes of what a fan-out created since.
    fn retire(&self, handler: &str, disposal: Disposal, now: DateTime)
    -> impl Future<Output = Result<RetireReport, StoreError>> + Send;

    /// Operator action (backfill): reopens for fan-out up to `limit` of the events of `types`
    /// created at `since` or later that were fanned out without a delivery for `handler`
    /// (and have none handed out without a document now), oldest first; returns their ids.
    /// The next fan-outs give each a delivery for every subscribed handler it never had; an
    /// event is never reopened for a handler it lists, so a backfill run again reopens
    /// nothing twice (see [`backfill`]).
    fn reopen_for(
        &self,
        handler: &str,
        types: &[String],
        since: Option<DateTime>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<bson::Bson>, StoreError>> + Send;

    /// How many events a backfill of `handler` would reopen but for a delivery of theirs that
    /// runs without a document just now (they wait for that run to end; see [`backfill`]).
    fn backfill_waiting(&self, handler: &str, types: &[String], since: Option<DateTime>)
    -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// How many of `events` (ids as [`Administration::reopen_for`] returned them) wait for a
    /// fan-out.
    fn unfanned_among(&self, events: &[bson::Bson]) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Operator action: makes a dead delivery pending and due now, with its attempts reset.
    fn requeue(&self, delivery_id: &str, now: DateTime) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Operator action inside the caller's transaction (so the death can be announced in it):
    /// makes a pending delivery dead with `reason`, its attempts unchanged, and returns it as
    /// it was. Refused with [`StoreError::NotBuriable`] when it is dead already or its lane is
    /// leased (it may be running: wait for the lease to end or stop that host); the lane's
    /// epoch moves on, so a claim racing the burial fails instead of handing it out.
    fn bury_pending_in(&self, tx: &mut Self::Tx, delivery_id: &str, reason: &str, now: DateTime)
    -> impl Future<Output = Result<DeliveryView, StoreError>> + Send;

    /// Deletes dead deliveries, history and events nothing references, in batches (each its
    /// own transaction, so publishers and deliveries never wait for a whole purge), and the
    /// counters of keys none of whose events remain (a key's counter is never reset while an
    /// event of the key exists or is being published).
    fn purge(&self, options: &PurgeOptions, now: DateTime)
    -> impl Future<Output = Result<PurgeReport, StoreError>> + Send;

    /// What [`Administration::purge`] would delete, counted, deleting nothing: the dead deliveries and
    /// history records past their cutoffs, and the events past theirs (some of which stay, while
    /// something refers to them); no key counters.
    fn purge_preview(&self, options: &PurgeOptions, now: DateTime)
    -> impl Future<Output = Result<PurgeReport, StoreError>> + Send;

    /// Per-handler counts.
    fn statistics(&self, now: DateTime) -> impl Future<Output = Result<Vec<HandlerStatistics>, StoreError>> + Send;

    /// Committed events no fan-out has made deliveries of yet. A host fans a backlog out only
    /// as fast as it can hand it out (see the dispatcher), so this is where a backlog waits.
    fn unfanned_events(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The event `event_id` as stored, and its completions (with completion history); the id
    /// is matched as a literal string.
    fn event_history(&self, event_id: &str) -> impl Future<Output = Result<EventHistory, StoreError>> + Send;

    /// Deliveries matching `filter`, in id order.
    fn list_deliveries(&self, filter: &DeliveryFilter)
    -> impl Future<Output = Result<DeliveryPage, StoreError>> + Send;
}

/// A store: the outbox, its membership and its administration, in three parts.
pub trait Store: Outbox + Hosts + Administration {}

impl<T: Outbox + Hosts + Administration> Store for T {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscriptions_refuse_bad_and_duplicate_handlers() {
        assert!(Subscriptions::new([Subscription::new("", ["a"])]).is_err());
        assert!(Subscriptions::new([Subscription::new(MALFORMED_EVENT_HANDLER, ["a"])]).is_err());
        assert!(Subscriptions::new([Subscription::new("h", ["a"]), Subscription::new("h", ["b"])]).is_err());
        let subscriptions =
            Subscriptions::new([Subscription::new("b", ["x"]), Subscription::new("a", ["x", "y"])]).unwrap();
        assert_eq!(subscriptions.handlers_for("x").collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(subscriptions.handlers_for("z").count(), 0);
    }
}
