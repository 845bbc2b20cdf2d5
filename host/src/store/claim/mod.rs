//! The claim: leasing lanes and picking their due deliveries under the per-key rules.
//!
//! This module owns the algorithm both stores share, written once against the small set of
//! primitives in [`ClaimBackend`], so that the MongoDB store and the memory store cannot drift
//! apart. It owns the per-instance record of held lanes and issued leases. It must never
//! decide anything about backoff or attempt limits. The only delivery documents it writes are
//! followers of busy keys it parks and brings back, and lost attempts it charges.
//!
//! Its parts are child modules, which see the `Claimer`'s private record of held lanes and
//! issued leases without it being public to the rest of the store:
//! - [`backend`]: the primitives a store provides ([`ClaimBackend`]) and the records they pass;
//! - [`picking`]: one claim, phase by phase (finish takeovers, read what runs, scan held
//!   lanes, take free lanes, record, bury, park, issue);
//! - [`hand_out`]: a fan-out's deliveries handed out as it commits them;
//! - [`issued`]: the leases this instance issued (the one function that issues them) and how
//!   they settle;
//! - [`keys`]: what this instance knows of keys beyond their documents (which run here, which
//!   wait for a claim, whose known heads to forget);
//! - [`plan`]: what one claim decided so far, and the scan of lanes into it;
//! - this file: the `Claimer` itself, its record, takeovers and reconciliation.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document};

use super::answered;
use super::assignment::Assignment;
use super::{Capacity, ClaimedDelivery, DeliveryId, EarlyHandOuts, FanOutCommit, FanOutReport, KeyLimits, Lease, Priorities, Rooms, StoreError};

mod backend;
mod hand_out;
mod issued;
mod keys;
mod picking;
mod plan;
// Fault injection and crash states, against both stores (test code only).
#[cfg(test)]
mod faults;
#[cfg(test)]
mod takeover_states;
#[cfg(test)]
mod test_stores;

pub(crate) use backend::*;
pub(crate) use issued::Unstored;
use issued::Issued;
#[cfg(test)]
pub(crate) use keys::HoldUp;
pub(crate) use keys::KeysBeforeRead;
use plan::{Plan, older_work_of_unread_lanes, scan};
use crate::event::EventRecord;
use crate::lane::{LaneId, MAX_LANES_PER_QUERY};

/// How often (in claim time) a claim unparks by looking at every key with parked deliveries.
/// In between, a claim looks only at the keys whose deliveries this instance settled since
/// the previous claim: it settles nearly every delivery of the lanes it holds, and all of a
/// key's deliveries share a lane. The sweep catches the rest (a predecessor settled by a host
/// that then died, or buried by an operator) without paying per claim for every parked key.
const UNPARK_SWEEP_INTERVAL_MS: i64 = 5_000;

/// How often a claim whose held lanes filled it looks for older work in free lanes, and in the
/// held lanes its scan did not reach.
const FAIRNESS_CHECK_INTERVAL_MS: i64 = 1_000;
/// How many free lanes with older work such a look takes at most.
const FAIRNESS_LANES: usize = 16;

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

/// A charge that waited [`CHARGE_WAIT`] once is tried again at most this often, and waited for
/// at most [`CHARGE_RETRY_WAIT`]: the claims in between go on without it, so a lock held for
/// the server's transaction lifetime never holds up every claim of its host.
const CHARGE_RETRY_INTERVAL_MS: i64 = 1_000;
const CHARGE_RETRY_WAIT: Duration = Duration::from_millis(200);

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
    /// The look for older work in held lanes a claim's scan did not reach (see
    /// [`plan::older_work_of_unread_lanes`]).
    unread_lanes_check: Periodic,
    /// The retry of a takeover's charge that waited too long (see [`CHARGE_RETRY_INTERVAL_MS`]).
    charge_retry: Periodic,
    /// The warning that lanes still wait for a takeover's charge, at most this often.
    charge_warning: Periodic,
    /// Keys whose deliveries this instance settled since the last claim's unparking, and
    /// those deliveries (followers created parked behind one of them are found by it).
    moved_keys: Mutex<(HashSet<HandlerKey>, Vec<Settled>)>,
    /// The unparking of every key with parked deliveries.
    unpark_sweep: Periodic,
    /// Heads of keys this instance's claims looked up (see [`Plan::recall_heads`]).
    known_heads: Mutex<HashMap<HandlerKey, DeliveryId>>,
    /// Keys with deliveries that may wait for a claim once one of theirs settles (see
    /// [`Claimer::followers_may_wait`]).
    awaited_keys: Mutex<HashSet<HandlerKey>>,
    /// Ordering keys whose events a fan-out left unfanned because a delivery of theirs ran
    /// here (see [`Claimer::unfanned_may_wait`]).
    deferred_keys: Mutex<HashSet<String>>,
    /// Keys whose later events a fan-out left unfanned, with the sequence its next batch reads
    /// up to (see [`Claimer::keys_left_out`]).
    left_out: Mutex<HashMap<String, i64>>,
    /// Keys whose known head (in [`Claimer::known_heads`], or found by an unparking) may be
    /// wrong: a delivery of theirs handed out without a document may have got one since (its
    /// lease settled other than by a completion, or a takeover charged it), a lower sequence
    /// of the key than the head known. Claims forget their heads (see
    /// [`Claimer::drop_forgotten_heads`]).
    forgotten_heads: Mutex<HashSet<HandlerKey>>,
    /// What lanes this instance took over listed in flight, where charging it failed, with
    /// each lane and the epoch of the take: a reconciliation keeps it listed, and the next
    /// claim charges it before anything else (see [`Claimer::take`]).
    uncharged: Mutex<Vec<(LaneId, i64, InFlight)>>,
    /// How many takeover charges this instance made: each may give a key's head that ran
    /// without a document its document, which a fan-out's read of idle keys from before it
    /// does not see (see [`KeysBeforeRead`]).
    takeovers_charged: AtomicU64,
    /// Where a test holds this instance's fan-outs up (see [`HoldUp`]).
    #[cfg(test)]
    hold_ups: Mutex<Vec<(HoldUp, std::sync::Arc<tokio::sync::Notify>, std::sync::Arc<tokio::sync::Notify>)>>,
    /// The lanes whose events this instance fans out, as its last announcement found the
    /// live hosts (every lane until it announced itself).
    assignment: Mutex<Assignment>,
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

impl Claimer {
    pub fn new(owner: &str, lease_duration: Duration) -> Self {
        Self {
            holder: Holder { owner: owner.to_string(), instance: ObjectId::new().to_hex() },
            lease_duration,
            held: tokio::sync::Mutex::new(BTreeMap::new()),
            issued: Mutex::new(HashMap::new()),
            fairness_check: Periodic::new(FAIRNESS_CHECK_INTERVAL_MS),
            unread_lanes_check: Periodic::new(FAIRNESS_CHECK_INTERVAL_MS),
            charge_retry: Periodic::new(CHARGE_RETRY_INTERVAL_MS),
            charge_warning: Periodic::new(CHARGE_WARNING_INTERVAL_MS),
            moved_keys: Mutex::new((HashSet::new(), Vec::new())),
            unpark_sweep: Periodic::new(UNPARK_SWEEP_INTERVAL_MS),
            known_heads: Mutex::new(HashMap::new()),
            awaited_keys: Mutex::new(HashSet::new()),
            deferred_keys: Mutex::new(HashSet::new()),
            left_out: Mutex::new(HashMap::new()),
            forgotten_heads: Mutex::new(HashSet::new()),
            uncharged: Mutex::new(Vec::new()),
            takeovers_charged: AtomicU64::new(0),
            #[cfg(test)]
            hold_ups: Mutex::new(Vec::new()),
            assignment: Mutex::new(Assignment::everything()),
        }
    }

    /// This instance's id among the live hosts (see [`Assignment`]).
    pub fn host_id(&self) -> String {
        format!("{}/{}", self.holder.owner, self.holder.instance)
    }

    /// Until when an announcement at `now` counts this instance as live: a third of its
    /// lease, so that the others take the share of a host that died well before its held
    /// lanes' leases run out.
    pub fn announced_until(&self, now: DateTime) -> DateTime {
        DateTime::from_millis(now.timestamp_millis().saturating_add(self.lease_duration.as_millis() as i64 / 3))
    }

    /// Whether this instance holds lanes of another live host's share (see
    /// [`Outbox::holds_lanes_of_another_host`]); false while a claim holds the lanes' lock
    /// (that claim hands back those that ran empty).
    ///
    /// [`Outbox::holds_lanes_of_another_host`]: crate::store::Outbox::holds_lanes_of_another_host
    pub fn holds_lanes_of_another_host(&self) -> bool {
        let assignment = self.assignment();
        self.held.try_lock().is_ok_and(|held| held.keys().any(|lane| !assignment.is_mine(*lane)))
    }

    /// The lanes whose events this instance fans out.
    pub fn assignment(&self) -> Assignment {
        self.assignment.lock().expect("assignment").clone()
    }

    /// Takes the live hosts an announcement found as the new split of the lanes; returns
    /// whether this instance gained lanes (whose unfanned events it left to others so far).
    pub fn assign(&self, hosts: &[String]) -> bool {
        let new = Assignment::among(&self.host_id(), hosts);
        let mut assignment = self.assignment.lock().expect("assignment");
        let gained = new.gains_on(&assignment);
        if new.hosts() != assignment.hosts() {
            tracing::info!(hosts = new.hosts(), lanes = new.lanes(), "live hosts changed; this host now fans out its share of the lanes");
        }
        *assignment = new;
        gained
    }

    /// Events created before this are fanned out by whoever reads them, whoever's lane
    /// they are in (see [`Assignment::stale_after`]).
    pub fn stale_before(&self, now: DateTime) -> DateTime {
        let stale_after = Assignment::stale_after(self.lease_duration.as_millis() as i64);
        DateTime::from_millis(now.timestamp_millis().saturating_sub(stale_after))
    }

    pub fn lease_until(&self, now: DateTime) -> DateTime {
        DateTime::from_millis(now.timestamp_millis().saturating_add(self.lease_duration.as_millis() as i64))
    }

    /// How many lanes this instance took over and cannot use yet, since what their previous
    /// holder left in flight could not be charged (see [`Claimer::take`]).
    pub fn lanes_waiting_for_charge(&self) -> usize {
        let uncharged = self.uncharged.lock().expect("uncharged");
        uncharged.iter().map(|(lane, _, _)| *lane).collect::<BTreeSet<_>>().len()
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
        let (keys, behind) = std::mem::take(&mut *self.moved_keys.lock().expect("moved keys"));
        if self.unpark_sweep.due(now) {
            return Some(Unpark::Everything);
        }
        (!keys.is_empty()).then(|| Unpark::Keys { keys: keys.into_iter().collect(), behind })
    }

    /// Keeps what `scope` was to unpark for the next claim, after it failed.
    fn unpark_later(&self, scope: Option<Unpark>) {
        match scope {
            Some(Unpark::Everything) => self.unpark_sweep.again(),
            Some(Unpark::Keys { keys, behind }) => {
                let (moved, settled) = &mut *self.moved_keys.lock().expect("moved keys");
                moved.extend(keys);
                settled.extend(behind);
            }
            None => {}
        }
    }

    /// Counts `lease` as issued at `at` and unsettled again, as if the reply of the write that
    /// settled it had been lost.
    #[cfg(test)]
    pub fn lose_settlement_reply(&self, lease: Lease, key: Option<HandlerKey>, at: DateTime) {
        self.issued.lock().expect("issued leases").insert(lease.delivery, Issued { lease, at, key, group: None, unstored: None });
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
        self.forget_heads(lost.iter().filter_map(|entry| Some((entry.handler.clone(), entry.key.clone()?))));
        let charged = if lost.is_empty() { Ok(()) } else { self.charge(backend, &lost, now, CHARGE_WAIT).await };
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

    /// Charges `entries` (see [`ClaimBackend::charge_lost`]), waiting at most `wait`, and
    /// counts the charge, made or not ([`Claimer::takeovers_charged`]; a charge cut short may
    /// still land). A charge cut short is made again in full later: each of its writes applies
    /// once. Called by claims, which hold the lanes' lock, so a hand-out (which takes it) sees
    /// every charge made before.
    ///
    /// A delivery listed twice (in two lanes, or twice in one: racing fan-outs and failures can
    /// leave that behind) is charged once, as started if any of its entries says so.
    async fn charge<B: ClaimBackend>(&self, backend: &B, entries: &[InFlight], now: DateTime, wait: Duration) -> Result<(), StoreError> {
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
        let charged = tokio::time::timeout(wait, backend.charge_lost(&unique, now)).await.unwrap_or(Err(StoreError::ChargeWaiting(wait)));
        self.takeovers_charged.fetch_add(1, Ordering::SeqCst);
        charged
    }
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
