//! The claim: leasing lanes and picking their due deliveries under the per-key rules.
//!
//! This module owns the algorithm both stores share, written once against the small set of
//! primitives in [`ClaimBackend`], so that the MongoDB store and the memory store cannot drift
//! apart. It owns the per-instance record of held lanes and issued leases. It must never
//! decide anything about backoff or attempt limits. The only delivery documents it writes are
//! followers of busy keys it parks and brings back, and lost attempts it charges.
//!
//! One file past 600 lines because the claim, the hand-outs, the takeover's charge and the
//! reconciliation all read and write the `Claimer`'s private record of held lanes and issued
//! leases under one lock; splitting them would make that record public to its parts. The
//! one delivery path (#24) is to reduce the claim to a few named phases and drop this note.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document};

use super::{Capacity, ClaimedDelivery, DeliveryId, EarlyHandOut, EarlyHandOuts, FanOutCommit, Lease, StoreError};
use crate::event::EventRecord;
use crate::lane::{LaneId, MAX_LANES_PER_QUERY};

/// How far back a claim looks for requeues that may have overtaken its picks.
const REQUEUE_RACE_WINDOW_MS: i64 = 60_000;

/// How long an unsettled lease counts as running on this instance's word alone. Older ones
/// are checked against their delivery at every claim, which drops the entries of deliveries
/// that changed under the lease without this instance seeing it (a settling write whose reply
/// was lost) and that it would otherwise keep as running. Under a backlog nearly every lease
/// settles well within this, so the claims skip a read of a few hundred deliveries each.
const UNSETTLED_TRUSTED_FOR_MS: i64 = 2_000;

/// How long a claim waits for a takeover's charge before it leaves that lane for a later
/// claim and goes on with the others. The charge waits for whatever still writes the lost
/// deliveries: a host killed while committing a transactional handler's work leaves its
/// transaction open, with its locks, until the server aborts it (after
/// `transactionLifetimeLimitSeconds`, 60 s by default).
const CHARGE_WAIT: Duration = Duration::from_secs(2);

/// Who holds a lane: a worker name and the store instance inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub owner: String,
    pub instance: String,
}

/// A delivery a lane's owner claimed and has not seen settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InFlight {
    pub delivery: DeliveryId,
    /// The delivery's claim generation when it was claimed.
    pub claims: i64,
    pub handler: String,
    pub key: Option<String>,
    /// See [`Candidate::unstored`].
    pub unstored: Option<HandOutOf>,
    /// Whether its holder had started running it when it listed it, or recorded since that
    /// it has (see [`Claimer::record_starts`]): a takeover charges an attempt for these
    /// only. A delivery claimed ahead of a free run slot is listed unstarted.
    pub started: bool,
}

/// What names a delivery handed out without a document: its event's `_id` as stored
/// (publishers choose its type) and the fan-out that handed it out, which its event's mark
/// stamps (`fanOut`). Two fan-outs racing for an event both list a delivery for it; only the
/// one whose mark won made a delivery that exists, and the stamp says which (`None`: an entry
/// written before entries named their fan-out, matched by its event alone).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HandOutOf {
    pub event: Bson,
    pub fan_out: Option<ObjectId>,
}

// Ids are compared as documents compare them in the store: by type and value.
impl Eq for HandOutOf {}

/// A lane document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LaneState {
    pub id: LaneId,
    pub owner: Option<String>,
    pub instance: Option<String>,
    pub lease_expires_at: DateTime,
    pub epoch: i64,
    pub in_flight: Vec<InFlight>,
}

impl LaneState {
    pub fn held_by(&self, holder: &Holder) -> bool {
        self.owner.as_deref() == Some(&holder.owner) && self.instance.as_deref() == Some(&holder.instance)
    }
}

/// A due, ready delivery found in a leased lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub id: DeliveryId,
    pub event_id: String,
    pub handler: String,
    pub key: Option<String>,
    pub lane: LaneId,
    pub due_at: DateTime,
    pub claims: i64,
    pub attempts: u32,
    /// Set for a delivery its fan-out handed out without writing a document for it (the
    /// MongoDB store's short way): the id of its event, whose `handedOut` list names the
    /// handler until the delivery is completed or given a document. Every other outcome, a
    /// takeover, or a check of it gives it its document first, in its event's lane; until
    /// then it may be listed in any lane its holder holds (see [`gather_unstored`]).
    pub unstored: Option<HandOutOf>,
    /// Once picked: whether it starts at once, or is claimed ahead of a free run slot (see
    /// [`InFlight::started`]).
    pub started: bool,
    /// A host died while it was listed unstarted (claimed ahead): it may have been running
    /// nonetheless, since a start from the queue of claimed-ahead work is not recorded. From
    /// then on, claimed ahead, it records its start before it runs (see
    /// [`ClaimedDelivery::suspect`]), so that a delivery that kills its host is charged at
    /// every death but its first.
    pub suspect: bool,
}

impl Candidate {
    /// Its entry in its lane's in-flight list once claimed.
    pub fn in_flight(&self) -> InFlight {
        InFlight {
            delivery: self.id,
            claims: self.claims,
            handler: self.handler.clone(),
            key: self.key.clone(),
            unstored: self.unstored.clone(),
            started: self.started,
        }
    }

    /// Its handler and key, if it is keyed: what per-key order is kept for.
    pub fn handler_key(&self) -> Option<HandlerKey> {
        self.key.clone().map(|key| (self.handler.clone(), key))
    }
}

/// A new delivery a fan-out may hand out as it commits it (see [`Claimer::hand_out`]): one
/// that nothing can be ahead of (unkeyed), with its event.
#[derive(Debug, Clone)]
pub(crate) struct Fresh {
    pub candidate: Candidate,
    pub event: EventRecord,
}

/// The new state of a lane after a claim.
#[derive(Debug, Clone)]
pub(crate) struct LaneRecord {
    pub lane: LaneId,
    pub epoch: i64,
    pub in_flight: Vec<InFlight>,
    pub lease_until: DateTime,
    /// The record also takes the lane: it applies only while the lane is still at
    /// `epoch - 1`, free at this time (no owner, or an expired lease) and runs nothing, and it
    /// makes the holder its owner at `epoch`.
    pub takes_free_at: Option<DateTime>,
}

/// What [`Claimer::hand_out`] did.
pub(crate) struct HandedOut<T> {
    /// What the fan-out's commit returned.
    pub committed: T,
    /// The deliveries handed out once it committed.
    pub claimed: Vec<ClaimedDelivery>,
    /// Those sent early instead (see [`EarlyHandOut`]).
    pub sent_early: Vec<DeliveryId>,
}

/// When a lane write counts as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaneWrite {
    /// Once durable (in MongoDB: a majority has it). A claim's: it may list keyed deliveries,
    /// and the list is what keeps a takeover from running a key twice at once.
    Durable,
    /// Once applied. A hand-out's: it lists unkeyed deliveries only, in a lane this instance
    /// holds (or takes, only if it lists nothing). Should a failover lose the write, those
    /// deliveries run again uncharged, which at-least-once allows; anything this instance
    /// does later that needs the lane is a durable write after it, which makes it durable
    /// too (in MongoDB, by the order of the oplog).
    Applied,
}

pub(crate) type HandlerKey = (String, String);

/// Where a claim looks for lanes beyond the ones its instance holds.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LaneSearch<'a> {
    /// Free lanes with due work, the oldest due first, in growing rounds.
    FreeWithDueWork,
    /// Only these lanes (where new deliveries were just fanned out), taken if free.
    Only(&'a [LaneId]),
}

/// How often (in claim time) a claim unparks by looking at every key with parked deliveries.
/// In between, a claim looks only at the keys whose deliveries this instance settled since
/// the previous claim: it settles nearly every delivery of the lanes it holds, and all of a
/// key's deliveries share a lane. The sweep catches the rest (a predecessor settled by a host
/// that then died, or buried by an operator) without paying per claim for every parked key.
const UNPARK_SWEEP_INTERVAL_MS: i64 = 5_000;

/// Which keys a claim's unparking looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unpark {
    /// Every key of the claim's handlers with parked deliveries.
    Everything,
    /// Only these keys.
    Keys(Vec<HandlerKey>),
}

/// How often a claim whose held lanes filled it looks for older work in free lanes.
const FAIRNESS_CHECK_INTERVAL_MS: i64 = 1_000;
/// How many free lanes with older work such a look takes at most.
const FAIRNESS_LANES: usize = 16;

/// The fewest due rows [`ClaimBackend::free_lanes_with_due_work`] reads per query before it
/// stops: an answer that saw fewer rows in all saw every due row of the free lanes.
pub(crate) const MIN_ROWS_PER_LANE_QUERY: usize = 64;

/// The primitives a claim is made of. Each is one small, bounded database step.
pub(crate) trait ClaimBackend: Sync {
    /// Moves the lowest parked delivery of every key in `scope` (of `handlers`) that has no
    /// unfinished predecessor back to the ready lane; returns the head (lowest pending
    /// delivery) it found for each key it looked at.
    fn unpark(
        &self,
        handlers: &[String],
        scope: &Unpark,
    ) -> impl Future<Output = Result<HashMap<HandlerKey, DeliveryId>, StoreError>> + Send;
    fn lanes(&self, ids: &[LaneId]) -> impl Future<Output = Result<Vec<LaneState>, StoreError>> + Send;
    /// Up to `count` lanes that are free (no owner or an expired lease), not in `exclude`,
    /// and have due ready deliveries of `handlers` (or list in flight deliveries of theirs
    /// without a document, which their last holder left: those first), the one with the
    /// oldest due delivery first,
    /// each with how many due deliveries were seen there (a lower bound; enough rows are read
    /// to see about `wanted` of them).
    fn free_lanes_with_due_work(
        &self,
        handlers: &[String],
        exclude: &BTreeSet<LaneId>,
        count: usize,
        wanted: usize,
        now: DateTime,
    ) -> impl Future<Output = Result<Vec<(LaneId, usize)>, StoreError>> + Send;
    /// Takes those of `lanes` that are still free, incrementing their epochs, and returns
    /// them as taken (with the in-flight list the previous owner left); lanes another claimer
    /// took first are skipped, never waited for.
    fn take_lanes(
        &self,
        lanes: &[LaneId],
        holder: &Holder,
        now: DateTime,
        until: DateTime,
    ) -> impl Future<Output = Result<Vec<LaneState>, StoreError>> + Send;
    /// Takes those of `lanes` that are free and run nothing, each in one write that also lists
    /// its given entries in flight; returns the lanes taken, each with the epoch it is now held
    /// at. Lanes that are not free, or list something, are skipped. A hand-out's write: it
    /// counts once applied ([`LaneWrite::Applied`]).
    fn take_listing(
        &self,
        lanes: &[(LaneId, Vec<InFlight>)],
        holder: &Holder,
        now: DateTime,
        until: DateTime,
    ) -> impl Future<Output = Result<Vec<(LaneId, i64)>, StoreError>> + Send;
    /// Moves every entry still at its listed claim generation on to the next, and charges an
    /// attempt to those listed as started ([`InFlight::started`]). Conditional on the
    /// generation, so repeating it charges nothing twice; `entries` hold no delivery twice.
    /// An entry of a delivery without a document ([`Candidate::unstored`]) counts only while
    /// its event names it as handed out by that entry's fan-out: an entry of a fan-out that
    /// lost the race for its event names a delivery that never existed.
    fn charge_lost(&self, entries: &[InFlight], now: DateTime) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Lists the given deliveries of each lane (held by `holder` at the epoch given) as
    /// started; one flag per lane, `false` when the lane is not held so or does not list them
    /// all. Acknowledged once applied ([`LaneWrite::Applied`]): only the failover of a primary
    /// that had not replicated it loses it, and that costs a charge, never a run or an order.
    fn record_starts(
        &self,
        holder: &Holder,
        lanes: &[(LaneId, i64, Vec<DeliveryId>)],
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;
    /// The entries whose delivery is still pending at the listed claim generation.
    fn current(&self, entries: &[InFlight]) -> impl Future<Output = Result<HashSet<DeliveryId>, StoreError>> + Send;
    /// Due, ready deliveries of `handlers` in `lanes`, in `(dueAt, _id)` order after `after`,
    /// leaving out `running` (the oldest rows of a held lane are often its running ones).
    fn candidates(
        &self,
        lanes: &[LaneId],
        handlers: &[String],
        now: DateTime,
        after: Option<(DateTime, DeliveryId)>,
        running: &HashSet<DeliveryId>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Candidate>, StoreError>> + Send;
    /// The lowest-sequence pending delivery of each (handler, key).
    fn key_heads(
        &self,
        keys: &[HandlerKey],
    ) -> impl Future<Output = Result<HashMap<HandlerKey, DeliveryId>, StoreError>> + Send;
    fn park(&self, ids: &[DeliveryId]) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Writes each lane's new in-flight list and lease, conditional on the epoch and holder;
    /// one flag per record, once `write` says the write counts.
    fn record(
        &self,
        holder: &Holder,
        records: &[LaneRecord],
        write: LaneWrite,
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;
    /// Gives lanes up at once (no owner, empty in-flight list), conditional on the epoch.
    fn hand_back(&self, holder: &Holder, lanes: &[(LaneId, i64)], now: DateTime)
    -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Raw event documents by id.
    fn events(&self, ids: &[String]) -> impl Future<Output = Result<HashMap<String, Document>, StoreError>> + Send;
    /// Whether an operator requeued anything at or after `since`.
    fn requeued_since(&self, since: DateTime) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// Ends claims that were recorded but will not be handed out, without an attempt charged.
    fn give_back(&self, picks: &[(DeliveryId, i64)]) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Buries deliveries that can never run (their event is gone or unreadable).
    fn bury_unrunnable(
        &self,
        doomed: &[(DeliveryId, i64, String)],
        now: DateTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// After a failed claim: keeps in the holder's lanes only the entries in `issued` and
    /// moves the claim generation of every other entry on (each write fenced on its own: the
    /// generation it moves from, the epoch of the lane it rewrites).
    fn reconcile(&self, holder: &Holder, issued: &HashSet<Lease>) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// One store instance's claiming state: the lanes it holds and the leases it issued.
pub(crate) struct Claimer {
    pub holder: Holder,
    pub lease_duration: Duration,
    /// The lanes this instance holds. The async lock also serializes the claims of this
    /// instance, so overlapping claims never read or write the same in-flight list.
    held: tokio::sync::Mutex<BTreeMap<LaneId, Held>>,
    issued: Mutex<HashMap<DeliveryId, Issued>>,
    /// The look for older work in free lanes (see the claim).
    fairness_check: Periodic,
    /// The warning that lanes still wait for a takeover's charge, at most this often.
    charge_warning: Periodic,
    /// Keys whose deliveries this instance settled since the last claim's unparking.
    moved_keys: Mutex<HashSet<HandlerKey>>,
    /// The unparking of every key with parked deliveries.
    unpark_sweep: Periodic,
    /// Heads of keys this instance's claims looked up (see [`Plan::recall_heads`]).
    known_heads: Mutex<HashMap<HandlerKey, DeliveryId>>,
    /// What lanes this instance took over listed in flight, where charging it failed, with
    /// each lane and the epoch of the take: a reconciliation keeps it listed, and the next
    /// claim charges it before anything else (see [`Claimer::take`]).
    uncharged: Mutex<Vec<(LaneId, i64, InFlight)>>,
}

/// How many known heads a claimer keeps at most; beyond that it forgets them all and looks
/// them up again as it meets their keys.
const KNOWN_HEADS_MAX: usize = 100_000;

/// How often at most a claim warns that lanes wait for a takeover's charge.
const CHARGE_WARNING_INTERVAL_MS: i64 = 10_000;

/// A lane this instance holds.
#[derive(Debug, Clone)]
struct Held {
    /// The epoch under which it holds the lane.
    epoch: i64,
    /// What this instance listed in flight there and may still be running, as of its last
    /// claim, and the lease its last record wrote; `None` while a claim works on it, and when
    /// unknown (a write whose reply was lost, a reconciliation): the next claim reads the lane.
    ///
    /// Nobody else writes a lane while its lease runs without moving its epoch, so a claim
    /// trusts this instead of reading every held lane again; a lane another claimer took
    /// meanwhile refuses the record (conditional on the epoch), and nothing of it is handed
    /// out.
    known: Option<Listed>,
}

#[derive(Debug, Clone)]
struct Listed {
    in_flight: Vec<InFlight>,
    lease_until: DateTime,
}

/// A step a claim takes at most once per interval of claim time (its `now`).
struct Periodic {
    interval_ms: i64,
    last: AtomicI64,
}

impl Periodic {
    fn new(interval_ms: i64) -> Self {
        Self { interval_ms, last: AtomicI64::new(i64::MIN) }
    }

    /// Whether the step is due at `now`; if it is, it counts as taken.
    fn due(&self, now: DateTime) -> bool {
        let now = now.timestamp_millis();
        now.saturating_sub(self.last.load(Ordering::Relaxed)) >= self.interval_ms && {
            self.last.store(now, Ordering::Relaxed);
            true
        }
    }

    /// Makes the step due again at once (it was due, but did not happen).
    fn again(&self) {
        self.last.store(i64::MIN, Ordering::Relaxed);
    }
}

/// A lease this instance handed out and has not seen settled.
#[derive(Debug, Clone)]
struct Issued {
    lease: Lease,
    /// The `now` of the claim that issued it.
    at: DateTime,
    key: Option<HandlerKey>,
    unstored: Option<Unstored>,
}

/// An issued lease's delivery that has no document (see [`Candidate::unstored`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Unstored {
    pub event: HandOutOf,
    pub handler: String,
}

impl Claimer {
    pub fn new(owner: &str, lease_duration: Duration) -> Self {
        Self {
            holder: Holder { owner: owner.to_string(), instance: ObjectId::new().to_hex() },
            lease_duration,
            held: tokio::sync::Mutex::new(BTreeMap::new()),
            issued: Mutex::new(HashMap::new()),
            fairness_check: Periodic::new(FAIRNESS_CHECK_INTERVAL_MS),
            charge_warning: Periodic::new(CHARGE_WARNING_INTERVAL_MS),
            moved_keys: Mutex::new(HashSet::new()),
            unpark_sweep: Periodic::new(UNPARK_SWEEP_INTERVAL_MS),
            known_heads: Mutex::new(HashMap::new()),
            uncharged: Mutex::new(Vec::new()),
        }
    }

    pub fn lease_until(&self, now: DateTime) -> DateTime {
        DateTime::from_millis(now.timestamp_millis().saturating_add(self.lease_duration.as_millis() as i64))
    }

    /// Whether this instance issued exactly this lease and has not seen it settled. A lease
    /// it cannot have issued is refused without a database call.
    pub fn issued(&self, lease: &Lease) -> bool {
        self.issued.lock().expect("issued leases").get(&lease.delivery).map(|issued| &issued.lease) == Some(lease)
    }

    /// The event of an issued lease whose delivery has no document (see
    /// [`Candidate::unstored`]).
    pub fn unstored(&self, lease: &Lease) -> Option<Unstored> {
        let issued = self.issued.lock().expect("issued leases");
        issued.get(&lease.delivery).filter(|issued| issued.lease == *lease).and_then(|issued| issued.unstored.clone())
    }

    /// How many lanes this instance took over and cannot use yet, since what their previous
    /// holder left in flight could not be charged (see [`Claimer::take`]).
    pub fn lanes_waiting_for_charge(&self) -> usize {
        let uncharged = self.uncharged.lock().expect("uncharged");
        uncharged.iter().map(|(lane, _, _)| *lane).collect::<BTreeSet<_>>().len()
    }

    /// Counts `leases` as settled: they run no more, and their keys may have moved on.
    pub fn settled<'a>(&self, leases: impl IntoIterator<Item = &'a Lease>) {
        let mut issued = self.issued.lock().expect("issued leases");
        let mut moved = Vec::new();
        for lease in leases {
            if issued.get(&lease.delivery).map(|issued| &issued.lease) == Some(lease) {
                moved.extend(issued.remove(&lease.delivery).and_then(|issued| issued.key));
            }
        }
        drop(issued);
        if !moved.is_empty() {
            self.moved_keys.lock().expect("moved keys").extend(moved);
        }
    }

    /// Records that the deliveries of `leases`, claimed ahead, start now (see
    /// [`ClaimedDelivery::started`]); one flag per lease, `false` for one whose lane this
    /// instance no longer holds at its epoch, or that it did not issue: that one must not run.
    ///
    /// Serialized with claims and hand-outs, which rewrite whole lists from what this
    /// instance knows of them: the known lists are updated with the write, so that no later
    /// record lists a started delivery as unstarted again. Only suspects record their starts
    /// ([`Candidate::suspect`]), so this is rare.
    pub async fn record_starts<B: ClaimBackend>(&self, backend: &B, leases: &[Lease]) -> Result<Vec<bool>, StoreError> {
        let mut held = self.held.lock().await;
        let mut by_lane: BTreeMap<(LaneId, i64), Vec<DeliveryId>> = BTreeMap::new();
        for lease in leases.iter().filter(|lease| self.issued(lease)) {
            if held.get(&lease.lane).is_some_and(|lane| lane.epoch == lease.epoch) {
                by_lane.entry((lease.lane, lease.epoch)).or_default().push(lease.delivery);
            }
        }
        let lanes: Vec<(LaneId, i64, Vec<DeliveryId>)> =
            by_lane.into_iter().map(|((lane, epoch), deliveries)| (lane, epoch, deliveries)).collect();
        let recorded = if lanes.is_empty() { Vec::new() } else { backend.record_starts(&self.holder, &lanes).await? };
        let mut started: HashSet<(LaneId, i64)> = HashSet::new();
        for ((lane, epoch, deliveries), ok) in lanes.iter().zip(recorded) {
            if !ok {
                continue;
            }
            started.insert((*lane, *epoch));
            if let Some(Held { known: Some(listed), .. }) = held.get_mut(lane) {
                for entry in listed.in_flight.iter_mut().filter(|entry| deliveries.contains(&entry.delivery)) {
                    entry.started = true;
                }
            }
        }
        Ok(leases.iter().map(|lease| self.issued(lease) && started.contains(&(lease.lane, lease.epoch))).collect())
    }

    /// What a claim at `now` unparks: every key at most every [`UNPARK_SWEEP_INTERVAL_MS`],
    /// otherwise the keys that moved since the last claim; `None` when there are none.
    fn unpark_scope(&self, now: DateTime) -> Option<Unpark> {
        let keys = std::mem::take(&mut *self.moved_keys.lock().expect("moved keys"));
        if self.unpark_sweep.due(now) {
            return Some(Unpark::Everything);
        }
        (!keys.is_empty()).then(|| Unpark::Keys(keys.into_iter().collect()))
    }

    /// Keeps what `scope` was to unpark for the next claim, after it failed.
    fn unpark_later(&self, scope: Option<Unpark>) {
        match scope {
            Some(Unpark::Everything) => self.unpark_sweep.again(),
            Some(Unpark::Keys(keys)) => self.moved_keys.lock().expect("moved keys").extend(keys),
            None => {}
        }
    }

    /// Counts `lease` as issued at `at` and unsettled again, as if the reply of the write that
    /// settled it had been lost.
    #[cfg(test)]
    pub fn lose_settlement_reply(&self, lease: Lease, key: Option<HandlerKey>, at: DateTime) {
        self.issued.lock().expect("issued leases").insert(lease.delivery, Issued { lease, at, key, unstored: None });
    }

    /// Forgets every held lane and returns them (graceful stop), each with whether its list
    /// names work still to settle: a lease this instance issued there and did not see
    /// settled, or a takeover's entry it has still to charge.
    pub async fn take_held(&self) -> Vec<(LaneId, i64, bool)> {
        let mut held = self.held.lock().await;
        let issued = self.issued.lock().expect("issued leases");
        let uncharged = self.uncharged.lock().expect("uncharged");
        std::mem::take(&mut *held)
            .into_iter()
            .map(|(lane, Held { epoch, .. })| {
                let running = issued.values().any(|i| i.lease.lane == lane && i.lease.epoch == epoch);
                (lane, epoch, running || uncharged.iter().any(|(l, e, _)| *l == lane && *e == epoch))
            })
            .collect()
    }

    pub async fn claim<B: ClaimBackend>(
        &self,
        backend: &B,
        handlers: &[String],
        search: LaneSearch<'_>,
        limit: impl Into<Capacity>,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        let limit = limit.into();
        let mut held = self.held.lock().await;
        if limit.total == 0 || handlers.is_empty() {
            return Ok(Vec::new());
        }
        match self.claim_serialized(backend, &mut held, handlers, search, limit, now).await {
            Ok(claimed) => Ok(claimed),
            Err(error) => {
                // The claim may have reached the database without its reply reaching us, and
                // the reconciliation rewrites the lanes: the next claim reads them all.
                for lane in held.values_mut() {
                    lane.known = None;
                }
                if let Err(reconcile_error) = self.reconcile(backend).await {
                    tracing::warn!(%reconcile_error, claim_error = %error, "reconciling lanes after a failed claim failed");
                }
                Err(error)
            }
        }
    }

    async fn claim_serialized<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        handlers: &[String],
        search: LaneSearch<'_>,
        capacity: Capacity,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        let limit = capacity.total;
        let until = self.lease_until(now);

        // A takeover whose charge failed is finished first. Charging again changes nothing
        // already charged (the charge applies at the listed generation only), and charging
        // after the lane changed hands again is the charge its new owner would make.
        // While it still cannot be made, its lanes sit this claim out.
        let uncharged: Vec<(LaneId, i64, InFlight)> = self.uncharged.lock().expect("uncharged").clone();
        let mut waiting = BTreeSet::new();
        if !uncharged.is_empty() {
            let entries: Vec<InFlight> = uncharged.iter().map(|(_, _, entry)| entry.clone()).collect();
            match charge(backend, &entries, now).await {
                Ok(()) => self.uncharged.lock().expect("uncharged").clear(),
                Err(error) => {
                    waiting.extend(uncharged.iter().map(|(lane, _, _)| *lane));
                    if self.charge_warning.due(now) {
                        tracing::warn!(
                            %error,
                            lanes = ?waiting,
                            "lanes taken over still wait for their previous holder's deliveries to be charged; trying again at every claim",
                        );
                    }
                }
            }
        }

        // The lanes this instance still holds, and what of theirs still runs (as its last
        // claim left them, or read where that is unknown), with the lanes the search names
        // (unparking goes meanwhile: it touches only parked deliveries). A named lane that is
        // free and runs nothing is taken by the record write itself, conditional on its epoch
        // not having moved: its due work can be read before, since nobody can claim from it
        // without moving the epoch.
        let named: Vec<LaneId> = match search {
            LaneSearch::Only(lanes) => lanes.iter().copied().filter(|lane| !held.contains_key(lane)).collect(),
            LaneSearch::FreeWithDueWork => Vec::new(),
        };
        // Taken for the claim: a successful one leaves every lane it still holds known again.
        let known: BTreeMap<LaneId, HeldLane> = held
            .iter_mut()
            .filter_map(|(id, lane)| {
                let Listed { in_flight, lease_until } = lane.known.take()?;
                Some((*id, HeldLane { epoch: lane.epoch, running: in_flight, takes_free_at: None, lease_until }))
            })
            .collect();
        let unknown = held.keys().filter(|id| !known.contains_key(id)).copied();
        let read_ids: Vec<LaneId> = unknown.chain(named.iter().copied()).collect();
        let holder = &self.holder;
        let running_in_held = async {
            let mut mine = known;
            let mut left_over = Vec::new();
            let states = if read_ids.is_empty() { Vec::new() } else { backend.lanes(&read_ids).await? };
            for state in states {
                if waiting.contains(&state.id) {
                    continue;
                }
                if held.get(&state.id).map(|lane| lane.epoch) == Some(state.epoch) && state.held_by(holder) {
                    let lane = HeldLane {
                        epoch: state.epoch,
                        running: state.in_flight,
                        takes_free_at: None,
                        lease_until: state.lease_expires_at,
                    };
                    mine.insert(state.id, lane);
                } else if named.contains(&state.id) && (state.owner.is_none() || state.lease_expires_at < now) {
                    if state.in_flight.is_empty() {
                        let lane =
                            HeldLane { epoch: state.epoch + 1, running: Vec::new(), takes_free_at: Some(now), lease_until: now };
                        mine.insert(state.id, lane);
                    } else {
                        // A takeover: what its owner left in flight is charged before anything
                        // of it is read.
                        left_over.push(state.id);
                    }
                }
            }
            // An entry whose lease this instance settled (or never issued) runs no more: only
            // the unsettled ones count, and only the older ones need the database's word.
            let trusted_since = DateTime::from_millis(now.timestamp_millis().saturating_sub(UNSETTLED_TRUSTED_FOR_MS));
            let unsettled: HashMap<(DeliveryId, i64), bool> = self
                .issued
                .lock()
                .expect("issued leases")
                .values()
                .map(|i| ((i.lease.delivery, i.lease.claims), i.at >= trusted_since))
                .collect();
            let mut current = HashSet::new();
            let mut to_check = Vec::new();
            for entry in mine.values().flat_map(|lane| lane.running.iter()) {
                match unsettled.get(&(entry.delivery, entry.claims)) {
                    Some(true) => {
                        current.insert(entry.delivery);
                    }
                    Some(false) => to_check.push(entry.clone()),
                    None => {}
                }
            }
            if !to_check.is_empty() {
                current.extend(backend.current(&to_check).await?);
            }
            Ok::<_, StoreError>((mine, current, left_over))
        };
        let scope = self.unpark_scope(now);
        let unpark = async {
            match &scope {
                Some(scope) => backend.unpark(handlers, scope).await,
                None => Ok(HashMap::new()),
            }
        };
        // The heads unparking found spare the scan a lookup of each of those keys (they are
        // the keys that just moved, whose next deliveries this claim is most likely to see).
        let ((mut mine, current, left_over), mut heads) = match futures::try_join!(running_in_held, unpark) {
            Ok(read) => read,
            Err(error) => {
                self.unpark_later(scope);
                return Err(error);
            }
        };
        held.retain(|id, _| waiting.contains(id) || mine.get(id).is_some_and(|lane| lane.takes_free_at.is_none()));
        for lane in mine.values_mut() {
            lane.running.retain(|entry| current.contains(&entry.delivery));
        }
        // Leases that ended without this instance seeing it: their keys may have moved on, so
        // what waits parked behind them is unparked before the scan.
        let ended: Vec<HandlerKey> = {
            let mut issued = self.issued.lock().expect("issued leases");
            let ended = issued.iter().filter(|(id, _)| !current.contains(id)).filter_map(|(_, i)| i.key.clone()).collect();
            issued.retain(|id, _| current.contains(id));
            ended
        };
        if !ended.is_empty() {
            let scope = Unpark::Keys(ended);
            match backend.unpark(handlers, &scope).await {
                Ok(found) => heads.extend(found),
                Err(error) => {
                    self.unpark_later(Some(scope));
                    return Err(error);
                }
            }
        }
        let taken = self.take(backend, held, &left_over, now, until).await?;
        adopt(held, &mut mine, taken);

        let mut plan = Plan::new(limit, mine.values().flat_map(|lane| lane.running.iter()));
        plan.heads.extend(heads.into_iter().map(|(key, head)| (key, Some(head))));
        // Taken for the claim (claims of an instance never overlap) and put back, with what it
        // learned, when it succeeds; a failed claim only costs the next one some lookups.
        plan.known_heads = std::mem::take(&mut *self.known_heads.lock().expect("known heads"));
        let lanes: Vec<LaneId> = mine.keys().copied().collect();
        scan(backend, &mut plan, &lanes, handlers, now).await?;

        let mut tried: BTreeSet<LaneId> = mine.keys().chain(&waiting).copied().collect();
        // Held lanes can fill a claim on their own with work younger than what waits in lanes
        // nobody holds: a lane kept busy by a steady stream would then keep the others waiting
        // for as long as the stream lasts. At most once a second (it costs a query), free lanes
        // with work due before the claim's youngest pick are taken and scanned for that work,
        // which takes the place of the youngest picks.
        if plan.full() && matches!(search, LaneSearch::FreeWithDueWork) && self.fairness_check.due(now) {
            if let Some(youngest) = plan.youngest_due() {
                let before = DateTime::from_millis(youngest.timestamp_millis() - 1);
                let half = (plan.limit / 2).max(1);
                let older = backend.free_lanes_with_due_work(handlers, &tried, FAIRNESS_LANES, half, before).await?;
                if !older.is_empty() {
                    let lanes: Vec<LaneId> = older.iter().map(|(lane, _)| *lane).collect();
                    tried.extend(lanes.iter().copied());
                    let taken = self.take(backend, held, &lanes, now, until).await?;
                    let new_lanes = adopt(held, &mut mine, taken);
                    plan.make_room(older.iter().map(|(_, due)| due).sum::<usize>().min(half));
                    scan(backend, &mut plan, &new_lanes, handlers, before).await?;
                }
            }
        }
        // More lanes, in growing rounds (4, 8, 16, ... or as many as the due work seen in them
        // says the batch still needs, if more), while the batch is not full.
        let mut round = 4;
        while !plan.full() && matches!(search, LaneSearch::FreeWithDueWork) {
            let missing = plan.limit - plan.picks.len();
            let found = backend.free_lanes_with_due_work(handlers, &tried, MAX_LANES_PER_QUERY, missing, now).await?;
            if found.is_empty() {
                break;
            }
            let mut seen = 0;
            let free: Vec<LaneId> = found
                .iter()
                .enumerate()
                .take_while(|(taken, (_, due))| {
                    let more = *taken < round || seen < missing;
                    seen += due;
                    more
                })
                .map(|(_, (lane, _))| *lane)
                .collect();
            tried.extend(free.iter().copied());
            let taken = self.take(backend, held, &free, now, until).await?;
            let new_lanes = adopt(held, &mut mine, taken);
            scan(backend, &mut plan, &new_lanes, handlers, now).await?;
            // The answer named every free lane with due work (fewer lanes than asked for, and
            // fewer rows than any of its reads could return) and all of them were tried: a
            // further round would only find that out again, at the cost of another query.
            let rows_seen: usize = found.iter().map(|(_, due)| due).sum();
            if found.len() < MAX_LANES_PER_QUERY && rows_seen < MIN_ROWS_PER_LANE_QUERY && free.len() == found.len() {
                break;
            }
            round = (round * 2).min(MAX_LANES_PER_QUERY);
        }

        // Record (one conditional write per lane with new picks), hand back the lanes that run
        // nothing and read the picks' events, all at once: a failure in any of them fails the
        // claim, and the reconciliation undoes what was recorded.
        let mut records = Vec::new();
        let mut idle = Vec::new();
        // The first picks take the free run slots; the others are listed as claimed ahead.
        for (at, pick) in plan.picks.iter_mut().enumerate() {
            pick.started = at < capacity.run_now;
        }
        // A lane that runs something and picked nothing new keeps its list and lease as
        // written (entries settled since are harmless there: a takeover charges only those
        // still at their listed generation), unless its lease is running out.
        let lease_ms = i64::try_from(self.lease_duration.as_millis()).unwrap_or(i64::MAX);
        let refresh_before = DateTime::from_millis(now.timestamp_millis().saturating_add(lease_ms / 2));
        for (lane_id, lane) in &mine {
            let mut in_flight = lane.running.clone();
            let before = in_flight.len();
            in_flight.extend(plan.picks.iter().filter(|pick| pick.lane == *lane_id).map(Candidate::in_flight));
            let picked = in_flight.len() > before;
            match (in_flight.is_empty(), lane.takes_free_at) {
                // Never taken, so nothing to hand back.
                (true, Some(_)) => {}
                (true, None) => idle.push((*lane_id, lane.epoch)),
                (false, None) if !picked && lane.lease_until > refresh_before => {
                    if let Some(held) = held.get_mut(lane_id) {
                        held.known = Some(Listed { in_flight, lease_until: lane.lease_until });
                    }
                }
                (false, takes_free_at) => records.push(LaneRecord {
                    lane: *lane_id,
                    epoch: lane.epoch,
                    in_flight,
                    lease_until: until,
                    takes_free_at,
                }),
            }
        }
        // Counted as held before the write: should its reply be lost, the next claim finds out
        // from the lane itself whether the take happened.
        for record in records.iter().filter(|record| record.takes_free_at.is_some()) {
            held.insert(record.lane, Held { epoch: record.epoch, known: None });
        }
        let mut event_ids: Vec<String> = plan.picks.iter().map(|pick| pick.event_id.clone()).collect();
        event_ids.sort();
        event_ids.dedup();
        let record = async {
            if records.is_empty() { Ok(Vec::new()) } else { backend.record(&self.holder, &records, LaneWrite::Durable).await }
        };
        let hand_back = async { if idle.is_empty() { Ok(()) } else { backend.hand_back(&self.holder, &idle, now).await } };
        let events = async { if event_ids.is_empty() { Ok(HashMap::new()) } else { backend.events(&event_ids).await } };
        let (recorded, (), events) = futures::try_join!(record, hand_back, events)?;
        // A pick whose event is gone or unreadable can never run: it is buried (which also
        // moves its claim generation on, so its lane entry no longer counts as running).
        let mut unrunnable = Vec::new();
        let mut buried_keys = Vec::new();
        let mut runnable = Vec::new();
        for pick in std::mem::take(&mut plan.picks) {
            let reason = match events.get(&pick.event_id).map(EventRecord::from_document) {
                Some(Ok(event)) => {
                    runnable.push((pick, event));
                    continue;
                }
                Some(Err(error)) => format!("event document is malformed: {error}"),
                None => "event document is missing".to_string(),
            };
            buried_keys.extend(pick.handler_key());
            unrunnable.push((pick.id, pick.claims, reason));
        }
        if !unrunnable.is_empty() {
            backend.bury_unrunnable(&unrunnable, now).await?;
        }
        // Their keys move on like those of any other burial.
        self.moved_keys.lock().expect("moved keys").extend(buried_keys);
        let mut lost_lanes = HashSet::new();
        for (record, ok) in records.iter().zip(&recorded) {
            if !ok {
                lost_lanes.insert(record.lane);
                held.remove(&record.lane);
            } else if let Some(lane) = held.get_mut(&record.lane) {
                lane.known = Some(Listed { in_flight: record.in_flight.clone(), lease_until: record.lease_until });
            }
        }
        // Lanes named but not taken, and lanes another claimer took meanwhile, are none of
        // this claim's business any more: what it saw blocked there was judged by what this
        // instance ran there, which may be stale.
        let untaken: HashSet<LaneId> = mine
            .iter()
            .filter(|(id, lane)| lane.takes_free_at.is_some() && !held.contains_key(id))
            .map(|(id, _)| *id)
            .chain(lost_lanes.iter().copied())
            .collect();
        plan.forget_lanes(&untaken);
        for (lane, _) in &idle {
            held.remove(lane);
        }

        // Park everything seen blocked behind an unfinished predecessor: left ready, it would
        // be read again by every claim for as long as its key is busy, and a lane handed back
        // would be taken again for nothing. Each delivery is parked once and unparked once,
        // when it becomes its key's head. Best effort: a failure here costs the next claims
        // some reading but never strands a key.
        let to_park = plan.to_park();
        let park = async {
            if !to_park.is_empty() {
                if let Err(error) = backend.park(&to_park).await {
                    tracing::warn!(%error, count = to_park.len(), "parking blocked deliveries failed");
                }
            }
        };

        // A requeue racing this claim can have put an earlier delivery of a picked key back in
        // front of it: such picks are given back, uncharged. Requeues are operator actions, so
        // a window of a minute covers clock skew between hosts at the cost of rare re-checks.
        // The check and the parking go at once: a claim that parks pays no round trip more.
        runnable.retain(|(pick, _)| !lost_lanes.contains(&pick.lane));
        let keyed: Vec<HandlerKey> =
            runnable.iter().filter_map(|(pick, _)| pick.handler_key()).collect();
        let window = DateTime::from_millis(now.timestamp_millis() - REQUEUE_RACE_WINDOW_MS);
        let requeued = async { if keyed.is_empty() { Ok(false) } else { backend.requeued_since(window).await } };
        let ((), requeued) = futures::join!(park, requeued);
        if requeued? {
            let heads = backend.key_heads(&keyed).await?;
            let (keep, overtaken): (Vec<_>, Vec<_>) = runnable.into_iter().partition(|(pick, _)| match &pick.key {
                Some(key) => heads.get(&(pick.handler.clone(), key.clone())) == Some(&pick.id),
                None => true,
            });
            if !overtaken.is_empty() {
                let back: Vec<(DeliveryId, i64)> = overtaken.iter().map(|(pick, _)| (pick.id, pick.claims)).collect();
                backend.give_back(&back).await?;
            }
            runnable = keep;
            for key in keyed {
                let head = heads.get(&key).copied();
                plan.heads.insert(key, head);
            }
        }

        *self.known_heads.lock().expect("known heads") = plan.into_known_heads();

        let mut claimed = Vec::with_capacity(runnable.len());
        let mut issued = self.issued.lock().expect("issued leases");
        for (pick, event) in runnable {
            let epoch = mine[&pick.lane].epoch;
            claimed.push(issue(&mut issued, pick, epoch, event, now));
        }
        Ok(claimed)
    }

    /// The lanes this instance holds without knowing what they list: a failed hand-out or
    /// claim leaves them so. Another fan-out may be filling them (the one whose mark beat a
    /// failed hand-out's), and only this instance can claim there while it holds them; so a
    /// fan-out names them for a claim. Empty while a claim is under way (it reads them).
    pub fn lanes_to_read(&self) -> Vec<LaneId> {
        match self.held.try_lock() {
            Ok(held) => held.iter().filter(|(_, lane)| lane.known.is_none()).map(|(id, _)| *id).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Where a hand-out lists `fresh` deliveries (moving those without a document into held
    /// lanes, see [`gather_unstored`]): the records of the held lanes it writes, with the
    /// entries of their lists this instance settled left out, and the free lanes it takes.
    fn list_fresh(&self, held: &BTreeMap<LaneId, Held>, fresh: &mut [Fresh], until: DateTime) -> FreshLists {
        // A listed entry whose lease this instance settled runs no more, and is left out of
        // the list rewritten; so lanes that only hand-outs fill keep short lists.
        let issued = self.issued.lock().expect("issued leases");
        let unsettled = |entry: &&InFlight| issued.get(&entry.delivery).is_some_and(|i| i.lease.claims == entry.claims);
        let events_lanes = fresh.iter().map(|fresh| fresh.candidate.lane).collect();
        let gathered = gather_unstored(held, |listed| listed.in_flight.iter().filter(unsettled).count(), fresh);
        let mut by_lane: BTreeMap<LaneId, Vec<InFlight>> = BTreeMap::new();
        for Fresh { candidate, .. } in fresh.iter() {
            by_lane.entry(candidate.lane).or_default().push(candidate.in_flight());
        }
        let mut records = Vec::new();
        let mut to_take = Vec::new();
        for (lane, entries) in &by_lane {
            match held.get(lane) {
                Some(Held { epoch, known: Some(listed) }) => records.push(LaneRecord {
                    lane: *lane,
                    epoch: *epoch,
                    in_flight: listed.in_flight.iter().filter(unsettled).chain(entries).cloned().collect(),
                    lease_until: until,
                    takes_free_at: None,
                }),
                Some(Held { known: None, .. }) => {}
                None => to_take.push((*lane, entries.clone())),
            }
        }
        FreshLists { by_lane, records, to_take, events_lanes, gathered }
    }

    /// Hands out `fresh` deliveries of a fan-out while `write` writes them: lists them in
    /// their lanes' in-flight lists (lanes this instance holds, as it knows them, and free
    /// lanes that run nothing, which the list's write takes) beside the fan-out's first
    /// stage, each acknowledged once applied ([`LaneWrite::Applied`]). `write` is that stage,
    /// the one that makes the fan-out the only one of its events (in MongoDB, the mark), and
    /// resolves to the rest: whatever else it writes, and its commit, given the deliveries
    /// whose leases are issued (a store may leave those without a document, see
    /// [`Candidate::unstored`]; it writes every other one). The leases are issued
    /// once the commit is done, or, given `early`, as soon as the first stage and the lists
    /// are, and sent there with a word of the commit to come (see [`EarlyHandOut`]). The way
    /// from a commit to its handler is then no durable write long, not a fan-out's and then
    /// a claim's.
    ///
    /// Returns what the commit returned and the deliveries handed out (not those sent early).
    /// Fresh deliveries it does not hand out (their lane is another instance's, or its list is
    /// unknown here, or a claim of this instance is under way and owns the lists) are left to
    /// a claim. A list written for a commit that then failed names deliveries that may not
    /// exist: harmless, since only issued leases count as running here, and the lanes are read
    /// again by the next claim.
    pub async fn hand_out<B: ClaimBackend, C, F, T>(
        &self,
        backend: &B,
        fresh: Vec<Fresh>,
        write: impl Future<Output = Result<C, StoreError>>,
        early: Option<&EarlyHandOuts>,
        now: DateTime,
    ) -> Result<HandedOut<T>, StoreError>
    where
        C: FnOnce(&HashSet<DeliveryId>) -> F,
        F: Future<Output = Result<T, StoreError>>,
    {
        let none = HashSet::new();
        let mut held = match self.held.try_lock() {
            Ok(held) if !fresh.is_empty() => held,
            _ => return Ok(HandedOut { committed: write.await?(&none).await?, claimed: Vec::new(), sent_early: Vec::new() }),
        };
        let until = self.lease_until(now);
        let mut fresh = fresh;
        let FreshLists { by_lane, records, to_take, events_lanes, .. } = self.list_fresh(&held, &mut fresh, until);
        let recording = async {
            let record = async {
                if records.is_empty() { Ok(Vec::new()) } else { backend.record(&self.holder, &records, LaneWrite::Applied).await }
            };
            let take = async {
                if to_take.is_empty() { Ok(Vec::new()) } else { backend.take_listing(&to_take, &self.holder, now, until).await }
            };
            futures::try_join!(record, take)
        };
        let (written, recorded) = futures::join!(write, recording);
        let (commit, (flags, taken)) = match (written, recorded) {
            (Ok(commit), Ok(recorded)) => (commit, recorded),
            (written, recorded) => {
                // A first stage that succeeded goes on to its commit all the same: its
                // deliveries are left to a claim.
                let committed = match written {
                    Ok(commit) => commit(&none).await,
                    Err(error) => Err(error),
                };
                let taken = recorded.map(|(_, taken)| taken);
                let tried = Tried { records: &records, to_take: &to_take, events_lanes: &events_lanes };
                return self.after_failed_hand_out(backend, &mut held, tried, committed, taken).await;
            }
        };
        // What the leases will be issued for: the fresh deliveries of the lanes listed.
        let handed: HashSet<DeliveryId> = records
            .iter()
            .zip(&flags)
            .filter(|(_, ok)| **ok)
            .map(|(record, _)| record.lane)
            .chain(taken.iter().map(|(lane, _)| *lane))
            .flat_map(|lane| by_lane[&lane].iter().map(|entry| entry.delivery))
            .collect();
        // Issues the leases of what was listed, and knows those lanes' lists again.
        let issue_listed = |held: &mut BTreeMap<LaneId, Held>, records: Vec<LaneRecord>| {
            let mut listed: Vec<(LaneId, i64, Vec<InFlight>)> = Vec::new();
            for (record, ok) in records.into_iter().zip(flags) {
                if ok {
                    listed.push((record.lane, record.epoch, record.in_flight));
                } else {
                    held.remove(&record.lane);
                }
            }
            listed.extend(taken.iter().map(|(lane, epoch)| (*lane, *epoch, by_lane[lane].clone())));
            self.issue_listed(held, listed, &by_lane, fresh, |_| true, now)
        };
        let Some(early) = early else {
            // Issued once committed: each lease names a delivery that exists.
            return match commit(&handed).await {
                Ok(committed) => Ok(HandedOut { committed, claimed: issue_listed(&mut held, records), sent_early: Vec::new() }),
                Err(error) => {
                    let taken = Ok(taken.clone());
                    let tried = Tried { records: &records, to_take: &to_take, events_lanes: &events_lanes };
                    self.after_failed_hand_out(backend, &mut held, tried, Err(error), taken).await
                }
            };
        };
        let claimed = issue_listed(&mut held, records);
        // The lists are written: claims need not wait for the commit.
        drop(held);
        let (tell, commit_word) = FanOutCommit::channel();
        let sending: Vec<DeliveryId> = claimed.iter().map(|c| c.lease.delivery).collect();
        let (kept, sent_early) = if claimed.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            // A dispatcher that stopped listening gets them with the report instead.
            match early.send(EarlyHandOut { claimed, commit: commit_word }) {
                Ok(()) => (Vec::new(), sending),
                Err(unsent) => (unsent.0.claimed, Vec::new()),
            }
        };
        // Should the commit fail, what was sent is handed back as not run by whoever runs
        // it (the lists naming it are harmless: only issued leases count as running).
        let committed = commit(&handed).await;
        let _ = tell.send(Some(committed.is_ok()));
        Ok(HandedOut { committed: committed?, claimed: kept, sent_early })
    }

    /// Hands out `fresh` deliveries, all of them or none, listing them *before* `mark` writes
    /// their fan-out. For a store whose fan-out is then no transaction (in MongoDB, the plain
    /// mark of a backlog batch, see `store/mongo/fan_out.rs`): a crash between the two leaves
    /// lists naming deliveries of unmarked events, which nothing runs or charges, and never a
    /// marked event that nothing lists.
    ///
    /// Returns `Ok(None)`, having marked nothing, when not every one of `fresh` fits in a lane
    /// this instance holds and knows the list of ([`gather_unstored`]), when a claim of this
    /// instance is under way (it owns the lists), or when a list could not be written (the
    /// next claim reads those lanes). Otherwise `mark` runs, and resolves to the deliveries
    /// whose events it marked (another fan-out may have marked some first); their leases are
    /// issued and sent to `early`, with word that their fan-out is done. Should `mark` fail, it may have marked any of them: all are sent as not run,
    /// and the dispatcher hands them back, which gives each whose event was marked its
    /// document (see [`Candidate::unstored`]).
    pub async fn hand_out_listed_first<B: ClaimBackend, F>(
        &self,
        backend: &B,
        fresh: Vec<Fresh>,
        mark: impl FnOnce() -> F,
        early: &EarlyHandOuts,
        now: DateTime,
    ) -> Result<Option<Vec<DeliveryId>>, StoreError>
    where
        F: Future<Output = Result<HashSet<DeliveryId>, StoreError>>,
    {
        let Ok(mut held) = self.held.try_lock() else { return Ok(None) };
        let until = self.lease_until(now);
        let mut fresh = fresh;
        let FreshLists { by_lane, records, to_take, gathered, .. } = self.list_fresh(&held, &mut fresh, until);
        if fresh.is_empty() || gathered < fresh.len() || !to_take.is_empty() {
            return Ok(None);
        }
        match backend.record(&self.holder, &records, LaneWrite::Applied).await {
            Ok(flags) if flags.iter().all(|ok| *ok) => {}
            outcome => {
                if let Err(error) = outcome {
                    tracing::debug!(%error, "listing a hand-out before its mark failed; fanning out with a transaction");
                }
                for record in &records {
                    held.insert(record.lane, Held { epoch: record.epoch, known: None });
                }
                return Ok(None);
            }
        }
        let marked = mark().await;
        // After a failed mark every one is issued, to be handed back as not run. Entries of
        // events another fan-out marked stay listed, unissued: they run nowhere, and the next
        // write of their list leaves them out.
        let issued_for = |delivery: &DeliveryId| marked.as_ref().map_or(true, |ours| ours.contains(delivery));
        let listed = records.into_iter().map(|record| (record.lane, record.epoch, record.in_flight)).collect();
        let claimed = self.issue_listed(&mut held, listed, &by_lane, fresh, issued_for, now);
        let done = marked.is_ok();
        drop(held);
        let sent: Vec<DeliveryId> = claimed.iter().map(|c| c.lease.delivery).collect();
        let (tell, commit) = FanOutCommit::channel();
        let _ = tell.send(Some(done));
        if !claimed.is_empty() && early.send(EarlyHandOut { claimed, commit }).is_err() {
            // The dispatcher stopped: its stop hands back what this instance holds.
            tracing::debug!(deliveries = sent.len(), "a hand-out found the dispatcher gone");
        }
        marked.map(|_| Some(sent))
    }

    /// Issues the leases of those of `fresh` that `issued_for` admits, in the lanes of `listed`
    /// (each with the epoch and the whole list written), and counts those lanes as held with
    /// these lists.
    fn issue_listed(
        &self,
        held: &mut BTreeMap<LaneId, Held>,
        listed: Vec<(LaneId, i64, Vec<InFlight>)>,
        by_lane: &BTreeMap<LaneId, Vec<InFlight>>,
        fresh: Vec<Fresh>,
        issued_for: impl Fn(&DeliveryId) -> bool,
        now: DateTime,
    ) -> Vec<ClaimedDelivery> {
        let until = self.lease_until(now);
        let mut events: HashMap<DeliveryId, (Candidate, EventRecord)> =
            fresh.into_iter().map(|Fresh { candidate, event }| (candidate.id, (candidate, event))).collect();
        let mut claimed = Vec::new();
        let mut issued = self.issued.lock().expect("issued leases");
        for (lane, epoch, in_flight) in listed {
            for entry in by_lane.get(&lane).into_iter().flatten().filter(|entry| issued_for(&entry.delivery)) {
                if let Some((candidate, event)) = events.remove(&entry.delivery) {
                    claimed.push(issue(&mut issued, candidate, epoch, event, now));
                }
            }
            held.insert(lane, Held { epoch, known: Some(Listed { in_flight, lease_until: until }) });
        }
        claimed
    }

    /// After a hand-out whose fan-out or lane writes failed: learns what it cannot know
    /// (the next claim reads every lane involved; a lane taken without this instance learning
    /// it is asked for) and reconciles. Lists written for a commit that failed name deliveries
    /// that were never inserted, harmless since only issued leases count as running; lists
    /// written without this instance learning it for a commit that happened name real
    /// deliveries, which the reconciliation moves on as for a claim.
    ///
    /// The held lanes among [`Tried::events_lanes`] are read again too, although the hand-out
    /// may have listed nothing there (see [`gather_unstored`]): the fan-out whose mark beat
    /// this one put its deliveries there, where only this instance can claim them (see
    /// [`Claimer::lanes_to_read`]).
    async fn after_failed_hand_out<B: ClaimBackend, T>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        Tried { records, to_take, events_lanes }: Tried<'_>,
        committed: Result<T, StoreError>,
        taken: Result<Vec<(LaneId, i64)>, StoreError>,
    ) -> Result<HandedOut<T>, StoreError> {
        for record in records {
            held.insert(record.lane, Held { epoch: record.epoch, known: None });
        }
        for lane in events_lanes {
            if let Some(lane) = held.get_mut(lane) {
                lane.known = None;
            }
        }
        // A lane taken without this instance learning it would otherwise stay its own,
        // unused, until its lease ran out.
        let learned = match &taken {
            Ok(taken) => Ok(taken.clone()),
            Err(_) => {
                let ids: Vec<LaneId> = to_take.iter().map(|(lane, _)| *lane).collect();
                backend.lanes(&ids).await.map(|states| {
                    states.iter().filter(|state| state.held_by(&self.holder)).map(|state| (state.id, state.epoch)).collect()
                })
            }
        };
        match learned {
            Ok(learned) => {
                for (lane, epoch) in learned {
                    held.insert(lane, Held { epoch, known: None });
                }
            }
            Err(error) => tracing::warn!(%error, "reading the lanes a failed hand-out may have taken failed"),
        }
        let committed = committed?;
        if let Err(error) = self.reconcile(backend).await {
            tracing::warn!(%error, "reconciling lanes after a failed hand-out failed");
        }
        taken.map(|_| HandedOut { committed, claimed: Vec::new(), sent_early: Vec::new() })
    }

    /// After a failed claim or hand-out: keeps in this instance's lanes only the leases it
    /// issued (and the entries of takeovers it has still to charge), and moves every other
    /// listed delivery's claim generation on.
    async fn reconcile<B: ClaimBackend>(&self, backend: &B) -> Result<(), StoreError> {
        let mut keep: HashSet<Lease> = self.issued.lock().expect("issued leases").values().map(|i| i.lease).collect();
        // Dropped unsettled, an uncharged entry of a delivery without a document would leave
        // nothing that names it but its event.
        keep.extend(self.uncharged.lock().expect("uncharged").iter().map(|(lane, epoch, entry)| Lease {
            delivery: entry.delivery,
            lane: *lane,
            epoch: *epoch,
            claims: entry.claims,
        }));
        backend.reconcile(&self.holder, &keep).await
    }

    /// Takes those of `lanes` that are free and charges what their previous owners left in
    /// flight; returns the lanes taken.
    ///
    /// Should the take fail, it may have happened without its reply reaching this instance:
    /// such a lane would stay its own, unused, until its lease ran out. So it asks which of
    /// `lanes` it holds, charges what they list as after any take, and counts them in `held`
    /// (as lanes to read), before it fails. A charge that fails, or does not finish within
    /// [`CHARGE_WAIT`], leaves the lanes that listed something held but out of this claim,
    /// their entries kept as `uncharged` for later claims to charge first (dropped from the
    /// lists, a delivery without a document would be lost); the claim goes on with the rest.
    async fn take<B: ClaimBackend>(
        &self,
        backend: &B,
        held: &mut BTreeMap<LaneId, Held>,
        lanes: &[LaneId],
        now: DateTime,
        until: DateTime,
    ) -> Result<Vec<LaneState>, StoreError> {
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let (taken, failure) = match backend.take_lanes(lanes, &self.holder, now, until).await {
            Ok(taken) => (taken, None),
            Err(error) => match backend.lanes(lanes).await {
                Ok(states) => (states.into_iter().filter(|state| state.held_by(&self.holder)).collect(), Some(error)),
                Err(read_error) => {
                    tracing::warn!(%read_error, "reading the lanes a failed take may have taken failed");
                    return Err(error);
                }
            },
        };
        // Charge what the previous owner left in flight before reading what to claim,
        // so that a takeover and a completion never both succeed.
        let lost: Vec<InFlight> = taken.iter().flat_map(|lane| lane.in_flight.iter().cloned()).collect();
        let charged = if lost.is_empty() { Ok(()) } else { charge(backend, &lost, now).await };
        if charged.is_err() {
            let mut uncharged = self.uncharged.lock().expect("uncharged");
            uncharged.extend(taken.iter().flat_map(|lane| lane.in_flight.iter().map(|entry| (lane.id, lane.epoch, entry.clone()))));
        }
        match (failure, charged) {
            (None, Ok(())) => Ok(taken),
            // The lanes that listed nothing serve this claim; the others wait, held, for the
            // charge a later claim makes first.
            (None, Err(error)) => {
                tracing::warn!(%error, lanes = ?taken.iter().map(|lane| lane.id).collect::<Vec<_>>(), "charging a takeover failed");
                let (usable, waiting): (Vec<LaneState>, Vec<LaneState>) =
                    taken.into_iter().partition(|lane| lane.in_flight.is_empty());
                for lane in &waiting {
                    held.insert(lane.id, Held { epoch: lane.epoch, known: None });
                }
                Ok(usable)
            }
            (Some(error), _) => {
                for lane in &taken {
                    held.insert(lane.id, Held { epoch: lane.epoch, known: None });
                }
                Err(error)
            }
        }
    }
}

/// Where a hand-out lists its fresh deliveries (see [`Claimer::list_fresh`]).
struct FreshLists {
    /// The fresh deliveries' entries, by the lane that is to list them.
    by_lane: BTreeMap<LaneId, Vec<InFlight>>,
    /// The new lists of held lanes.
    records: Vec<LaneRecord>,
    /// Free lanes to take with these entries.
    to_take: Vec<(LaneId, Vec<InFlight>)>,
    /// Where the fresh deliveries' events place them, whichever lanes list them.
    events_lanes: BTreeSet<LaneId>,
    /// How many fresh deliveries without a document went to held lanes.
    gathered: usize,
}

/// What a failed hand-out tried to write, for [`Claimer::after_failed_hand_out`].
struct Tried<'a> {
    records: &'a [LaneRecord],
    to_take: &'a [(LaneId, Vec<InFlight>)],
    /// Where the fresh deliveries' events place them, whichever lanes list them.
    events_lanes: &'a BTreeSet<LaneId>,
}

/// The most entries a hand-out lets a list grow to in a held lane it gathers deliveries
/// without a document in (see [`gather_unstored`]). A record rewrites its lane's whole list,
/// so a list's length is paid at every write of it.
const GATHERED_PER_LANE: usize = 64;

/// Moves the `fresh` deliveries without a document ([`Candidate::unstored`]) into lanes this
/// instance holds and knows the lists of, filling the one listing the fewest unsettled
/// entries (`unsettled`) first, up to [`GATHERED_PER_LANE`] each; those that do not fit keep
/// their event's lane. Returns how many it moved.
///
/// Such a delivery is bound to no lane: it is unkeyed, so no order binds it, and no document
/// says where it is; its lane entry only records that it runs, for a takeover or a check
/// (which give it its document, in its event's lane, see [`Candidate::unstored`]). Listed by
/// the lanes its events hash to, a hand-out wrote about one lane document for every
/// delivery, a quarter of `mongod`'s work in a drain; gathered, it writes one per
/// [`GATHERED_PER_LANE`] deliveries, and lanes another instance holds stop it less.
fn gather_unstored(held: &BTreeMap<LaneId, Held>, unsettled: impl Fn(&Listed) -> usize, fresh: &mut [Fresh]) -> usize {
    let mut room: Vec<(usize, LaneId)> = held
        .iter()
        .filter_map(|(id, lane)| Some((unsettled(lane.known.as_ref()?), *id)))
        .filter(|(listed, _)| *listed < GATHERED_PER_LANE)
        .collect();
    room.sort_unstable();
    let mut lanes = room.into_iter();
    let mut filling = lanes.next();
    let mut gathered = 0;
    for Fresh { candidate, .. } in fresh.iter_mut().filter(|fresh| fresh.candidate.unstored.is_some()) {
        let Some((listed, lane)) = filling.as_mut() else { break };
        candidate.lane = *lane;
        gathered += 1;
        *listed += 1;
        if *listed >= GATHERED_PER_LANE {
            filling = lanes.next();
        }
    }
    gathered
}

/// Charges `entries` (see [`ClaimBackend::charge_lost`]), waiting at most [`CHARGE_WAIT`]. A
/// charge cut short is made again in full later: each of its writes applies once.
///
/// A delivery listed twice (in two lanes, or twice in one: racing fan-outs and failures can
/// leave that behind) is charged once, as started if any of its entries says so.
async fn charge<B: ClaimBackend>(backend: &B, entries: &[InFlight], now: DateTime) -> Result<(), StoreError> {
    let mut unique: Vec<InFlight> = Vec::with_capacity(entries.len());
    let mut at: HashMap<(DeliveryId, i64), usize> = HashMap::new();
    for entry in entries {
        match at.get(&(entry.delivery, entry.claims)) {
            Some(seen) => unique[*seen].started |= entry.started,
            None => {
                at.insert((entry.delivery, entry.claims), unique.len());
                unique.push(entry.clone());
            }
        }
    }
    tokio::time::timeout(CHARGE_WAIT, backend.charge_lost(&unique, now))
        .await
        .unwrap_or(Err(StoreError::ChargeWaiting(CHARGE_WAIT)))
}

/// The lease of `pick` in its lane at `epoch`, counted as issued at `now`, handed out with
/// its event.
fn issue(issued: &mut HashMap<DeliveryId, Issued>, pick: Candidate, epoch: i64, event: EventRecord, now: DateTime) -> ClaimedDelivery {
    let lease = Lease { delivery: pick.id, lane: pick.lane, epoch, claims: pick.claims };
    let key = pick.handler_key();
    let unstored = pick.unstored.map(|event| Unstored { event, handler: pick.handler.clone() });
    issued.insert(pick.id, Issued { lease, at: now, key, unstored });
    ClaimedDelivery { lease, handler: pick.handler, attempts: pick.attempts, event, started: pick.started, suspect: pick.suspect }
}

/// Counts lanes just taken as held, with nothing of theirs running; returns their ids.
fn adopt(held: &mut BTreeMap<LaneId, Held>, mine: &mut BTreeMap<LaneId, HeldLane>, taken: Vec<LaneState>) -> Vec<LaneId> {
    let ids: Vec<LaneId> = taken.iter().map(|lane| lane.id).collect();
    for lane in taken {
        held.insert(lane.id, Held { epoch: lane.epoch, known: None });
        let lease_until = lane.lease_expires_at;
        mine.insert(lane.id, HeldLane { epoch: lane.epoch, running: Vec::new(), takes_free_at: None, lease_until });
    }
    ids
}

struct HeldLane {
    epoch: i64,
    running: Vec<InFlight>,
    /// Not held yet: the record takes it (see [`LaneRecord::takes_free_at`]).
    takes_free_at: Option<DateTime>,
    /// When its lease ends as last written.
    lease_until: DateTime,
}

/// What one claim decided so far.
struct Plan {
    limit: usize,
    running_ids: HashSet<DeliveryId>,
    /// Keys with a running delivery, or one already picked by this claim.
    busy_keys: HashSet<HandlerKey>,
    heads: HashMap<HandlerKey, Option<DeliveryId>>,
    /// Heads earlier claims looked up, not confirmed by this one yet.
    known_heads: HashMap<HandlerKey, DeliveryId>,
    picks: Vec<Candidate>,
    /// Seen waiting behind an unfinished predecessor of their key.
    blocked: Vec<(LaneId, DeliveryId)>,
}

impl Plan {
    fn new<'a>(limit: usize, running: impl Iterator<Item = &'a InFlight>) -> Self {
        let mut running_ids = HashSet::new();
        let mut busy_keys = HashSet::new();
        for entry in running {
            running_ids.insert(entry.delivery);
            if let Some(key) = &entry.key {
                busy_keys.insert((entry.handler.clone(), key.clone()));
            }
        }
        Self {
            limit,
            running_ids,
            busy_keys,
            heads: HashMap::new(),
            known_heads: HashMap::new(),
            picks: Vec::new(),
            blocked: Vec::new(),
        }
    }

    fn full(&self) -> bool {
        self.picks.len() >= self.limit
    }

    fn youngest_due(&self) -> Option<DateTime> {
        self.picks.iter().map(|pick| pick.due_at).max()
    }

    /// Drops the `n` youngest picks, freeing their keys; the rest stay in due order.
    fn make_room(&mut self, n: usize) {
        self.picks.sort_by_key(|pick| (pick.due_at, pick.id));
        let keep = self.picks.len().saturating_sub(n);
        for pick in self.picks.drain(keep..) {
            if let Some(key) = pick.key {
                self.busy_keys.remove(&(pick.handler, key));
            }
        }
    }

    /// Confirms the known heads that `rows` contain. A delivery that was its key's lowest
    /// pending one when an earlier claim looked it up still is while it is pending: a fan-out
    /// never creates a lower sequence after a higher one, and an operator's requeue, the one
    /// way back for a lower one, is what the claim's requeue check is for. A key whose known
    /// head is not among the rows (it ran elsewhere, or is further on) is looked up again.
    fn recall_heads(&mut self, rows: &[Candidate]) {
        if self.known_heads.is_empty() {
            return;
        }
        for row in rows {
            if let Some(key) = row.handler_key() {
                if self.known_heads.get(&key) == Some(&row.id) {
                    self.heads.entry(key).or_insert(Some(row.id));
                }
            }
        }
    }

    /// The known heads after this claim: what it looked up or confirmed replaces what was
    /// known of those keys.
    fn into_known_heads(mut self) -> HashMap<HandlerKey, DeliveryId> {
        if self.known_heads.len() + self.heads.len() > KNOWN_HEADS_MAX {
            self.known_heads.clear();
        }
        for (key, head) in self.heads {
            match head {
                Some(head) => self.known_heads.insert(key, head),
                None => self.known_heads.remove(&key),
            };
        }
        self.known_heads
    }

    /// Keyed candidates whose head is not known yet and whose key is not busy.
    fn unknown_keys(&self, rows: &[Candidate]) -> Vec<HandlerKey> {
        let mut keys: Vec<HandlerKey> = rows
            .iter()
            .filter(|row| !self.running_ids.contains(&row.id))
            .filter_map(Candidate::handler_key)
            .filter(|key| !self.busy_keys.contains(key) && !self.heads.contains_key(key))
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }

    fn consider(&mut self, row: Candidate) {
        if self.full() || self.running_ids.contains(&row.id) {
            return;
        }
        let Some(key) = &row.key else {
            self.picks.push(row);
            return;
        };
        let handler_key = (row.handler.clone(), key.clone());
        let is_head = self.heads.get(&handler_key).copied().flatten() == Some(row.id);
        if is_head && !self.busy_keys.contains(&handler_key) {
            self.busy_keys.insert(handler_key);
            self.picks.push(row);
        } else {
            self.blocked.push((row.lane, row.id));
        }
    }

    /// Drops what was seen in lanes this claim did not get, so nothing there is parked.
    fn forget_lanes(&mut self, lanes: &HashSet<LaneId>) {
        if lanes.is_empty() {
            return;
        }
        self.blocked.retain(|(lane, _)| !lanes.contains(lane));
    }

    fn to_park(&self) -> Vec<DeliveryId> {
        self.blocked.iter().map(|(_, id)| *id).collect()
    }
}

/// Reads the due deliveries of `lanes` page by page and lets the plan pick from them; it
/// continues past blocked keys until the batch is full or the lanes are exhausted.
async fn scan<B: ClaimBackend>(
    backend: &B,
    plan: &mut Plan,
    lanes: &[LaneId],
    handlers: &[String],
    now: DateTime,
) -> Result<(), StoreError> {
    for chunk in lanes.chunks(MAX_LANES_PER_QUERY) {
        let mut after = None;
        while !plan.full() {
            let page = ((plan.limit - plan.picks.len()) * 2).clamp(64, 1_000);
            let rows = backend.candidates(chunk, handlers, now, after, &plan.running_ids, page).await?;
            plan.recall_heads(&rows);
            let unknown = plan.unknown_keys(&rows);
            if !unknown.is_empty() {
                let heads = backend.key_heads(&unknown).await?;
                for key in unknown {
                    let head = heads.get(&key).copied();
                    plan.heads.insert(key, head);
                }
            }
            let exhausted = rows.len() < page;
            after = rows.last().map(|row| (row.due_at, row.id));
            for row in rows {
                plan.consider(row);
            }
            if exhausted {
                break;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> HandlerKey {
        ("h".to_string(), name.to_string())
    }

    #[test]
    fn known_heads_are_forgotten_past_their_cap_but_what_a_claim_learned_is_kept() {
        // Under the cap: what the claim looked up replaces what was known of those keys.
        let mut plan = Plan::new(1, std::iter::empty());
        let (old, new) = (ObjectId::new(), ObjectId::new());
        plan.known_heads = HashMap::from([(key("a"), old), (key("b"), old)]);
        plan.heads = HashMap::from([(key("a"), Some(new)), (key("b"), None)]);
        assert_eq!(plan.into_known_heads(), HashMap::from([(key("a"), new)]));

        // Past it: everything known before is forgotten, and only this claim's heads stay.
        let mut plan = Plan::new(1, std::iter::empty());
        plan.known_heads = (0..KNOWN_HEADS_MAX).map(|n| (key(&format!("k{n}")), old)).collect();
        plan.heads = HashMap::from([(key("fresh"), Some(new))]);
        assert_eq!(plan.into_known_heads(), HashMap::from([(key("fresh"), new)]));
    }
}
