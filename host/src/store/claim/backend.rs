//! What the claim needs of a store: the primitives of [`ClaimBackend`], each one round trip
//! or one atomic write in MongoDB, and the records they pass (lanes, their in-flight lists,
//! candidates, picks). It must never hold claiming state: the `Claimer` does.

use super::*;

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
    /// See [`Candidate::before_commit`].
    pub before_commit: Option<EventOf>,
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

/// An event's `_id` as stored (publishers choose its type), compared by type and value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EventOf(pub Bson);

impl Eq for EventOf {}

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

/// One read of candidates: in which order, from where, and what it leaves out: deliveries the
/// claim knows run (the oldest rows of a held lane are often its running ones), and the keys
/// whose handler's limit of one key at once is reached (see [`crate::store::PerKey`]): their
/// rows would only be passed over.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CandidateRead<'a> {
    pub order: ReadOrder,
    /// The last row of the page before, in `order`.
    pub after: Option<After>,
    pub running: &'a HashSet<DeliveryId>,
    pub full_keys: &'a [HandlerKey],
}

/// The order a claim reads candidates in: the oldest due first, or, for handlers that take
/// priorities per event (see [`crate::store::PriorityFrom`]), the highest delivery priority
/// first and then the oldest due (only deliveries that have a priority).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadOrder {
    Due,
    Priority,
}

/// Where a read of candidates goes on from: after this row, in its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct After {
    pub priority: Option<i32>,
    pub due_at: DateTime,
    pub id: DeliveryId,
}

impl<'a> CandidateRead<'a> {
    /// The first page in due order, leaving out only `running`.
    pub fn plain(running: &'a HashSet<DeliveryId>) -> Self {
        Self { order: ReadOrder::Due, after: None, running, full_keys: &[] }
    }
}

impl After {
    pub fn of(row: &Candidate) -> Self {
        Self { priority: row.priority, due_at: row.due_at, id: row.id }
    }
}

/// A due, ready delivery found in a leased lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub id: DeliveryId,
    pub event_id: String,
    pub handler: String,
    pub key: Option<String>,
    /// The key it is counted by when its handler runs several of one key at once (see
    /// [`crate::store::PerKey`]): a claim takes no more of it than the handler's limit, less
    /// what of the key runs in its lane.
    pub group: Option<String>,
    /// Its priority among its handler's deliveries (see [`crate::store::PriorityFrom`]).
    pub priority: Option<i32>,
    pub lane: LaneId,
    pub due_at: DateTime,
    pub claims: i64,
    pub attempts: u32,
    /// Set for a delivery its fan-out handed out without writing a document for it (the
    /// MongoDB store's short way): the id of its event, whose `handedOut` list names the
    /// handler until the delivery is completed or given a document. Every other outcome, a
    /// takeover, or a check of it gives it its document first, in its key's lane or, unkeyed,
    /// its event's; until then an unkeyed one may be listed in any lane its holder holds (see
    /// [`gather_unstored`]), a keyed one (its key's head) in its key's lane.
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
    /// Set for a keyed delivery its fan-out hands out: its event's id. Its document comes
    /// with the fan-out's commit, which its run may start before; a takeover that finds the
    /// run listed as started and the event unfanned names the event suspect for its handler
    /// (as for a delivery without a document), so that its next run is recorded as started
    /// before it starts.
    pub before_commit: Option<EventOf>,
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
            before_commit: self.before_commit.clone(),
        }
    }

    /// Its handler and key, if it is keyed: what per-key order is kept for.
    pub fn handler_key(&self) -> Option<HandlerKey> {
        self.key.clone().map(|key| (self.handler.clone(), key))
    }
}

/// A new delivery a fan-out may hand out as it commits it (see [`Claimer::hand_out`]): one
/// that nothing can be ahead of (unkeyed, or its key's head while nothing of its key is
/// pending), with its event.
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
pub(crate) struct HandedOut {
    /// The deliveries handed out once it committed.
    pub claimed: Vec<ClaimedDelivery>,
    /// Those sent early instead (see [`ClaimedDelivery::before_commit`]).
    pub sent_early: Vec<DeliveryId>,
}

/// When a lane write counts as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaneWrite {
    /// Once durable (in MongoDB: a majority has it). A claim's, and a hand-out's that lists a
    /// key's head: the list is what keeps a takeover from running a key twice at once.
    Durable,
    /// Once applied. A hand-out's of unkeyed deliveries only, in a lane this instance
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

/// Which keys a claim's unparking looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unpark {
    /// Every key of the claim's handlers with parked deliveries.
    Everything,
    /// Only these keys; a parked follower created behind one of `behind` (settled since)
    /// that is no longer pending is taken as its key's head without a lookup.
    Keys { keys: Vec<HandlerKey>, behind: Vec<Settled> },
}

/// A delivery this instance settled, as an unparking looks for the followers created behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settled {
    pub delivery: DeliveryId,
    /// Completed by this instance (its completion matched its lease): it is gone and no
    /// longer pending, which the unparking then need not read. Otherwise (retried, buried,
    /// settled in a transaction whose outcome it does not know) it reads.
    pub completed: bool,
}

/// Which free lanes' ready work a search counts ([`ClaimBackend::free_lanes_with_due_work`]):
/// work due by `before` in this host's lanes, and in other live hosts' lanes (theirs to take,
/// see `crate::store::assignment`) only what was due by `others_before` too, what waited past
/// stale. One search thus finds both, so that a claim of an idle host reads the lanes once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DueWork<'a> {
    /// Lanes not searched at all (those the claim holds or tried already).
    pub exclude: &'a BTreeSet<LaneId>,
    /// Work due by then counts; a lease that ran out by then leaves its lane free.
    pub before: DateTime,
    pub others: &'a BTreeSet<LaneId>,
    pub others_before: DateTime,
    /// The order of the claim's read: lanes with the first work in it come first.
    pub order: ReadOrder,
    /// In [`ReadOrder::Priority`]: only work of a priority above this counts.
    pub above: Option<i32>,
}

impl DueWork<'_> {
    /// Until when work in `lane` counts as due.
    pub fn due_before(&self, lane: LaneId) -> DateTime {
        if self.others.contains(&lane) { self.before.min(self.others_before) } else { self.before }
    }
}

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
    /// Up to `count` lanes that are free (no owner or an expired lease), not excluded, and
    /// have ready deliveries of `handlers` due as `due` says (or list in flight deliveries of
    /// theirs without a document, which their last holder left: those first), the one with
    /// the oldest due delivery first, each with how many due deliveries were seen there (a
    /// lower bound; enough rows are read to see about `wanted` of them).
    fn free_lanes_with_due_work(
        &self,
        handlers: &[String],
        due: DueWork<'_>,
        count: usize,
        wanted: usize,
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
    /// at. Lanes that are not free, or list something, are skipped. A hand-out's write,
    /// acknowledged as `write` says (once applied, unless it lists a key's head).
    fn take_listing(
        &self,
        lanes: &[(LaneId, Vec<InFlight>)],
        holder: &Holder,
        now: DateTime,
        until: DateTime,
        write: LaneWrite,
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
    /// Due, ready deliveries of `handlers` in `lanes`, as `read` says.
    fn candidates(
        &self,
        lanes: &[LaneId],
        handlers: &[String],
        now: DateTime,
        read: CandidateRead<'_>,
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
