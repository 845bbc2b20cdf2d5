//! Fan-out planning: which committed events become which deliveries.
//!
//! Both stores read a batch of events nobody fanned out yet, in [`unfanned_order`], then,
//! for every ordering key in it, the lowest unfanned events of that key in sequence order. The
//! batch is the unkeyed events plus those per-key prefixes, so a delivery of sequence `n` is
//! never created before the deliveries of every lower sequence of its key exist, whatever the
//! publishers' clocks said (a lower sequence always committed first, so it is visible).
//! This module is pure: it decides, the stores write.
//!
//! It is one file of about 540 lines (its unit tests are in `planning_tests.rs`) because every
//! decision here is over the same batch, in the order a fan-out takes them: what to read
//! (`prefixes_to_read`, `keys_to_ask`), which deliveries (`plan`), which of a key's events to
//! leave for later (`heads_of_idle_keys`), and what may be handed out (`fresh`). Split apart,
//! each part would import the others' types.

use std::collections::{BTreeMap, HashMap, HashSet};

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document};

use crate::store::claim::{Candidate, EventOf, Fresh, HandOutOf, HandlerKey};
use crate::store::{Capacity, ClaimedDelivery, DeliveryId, MALFORMED_EVENT_HANDLER, Subscriptions};
use crate::death::Death;
pub(crate) use crate::event::{id_text, string_key};
use crate::event::{EventRecord, NewEvent, field};
use crate::lane::{LaneId, lane_for_event};

/// A delivery to insert.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NewDelivery {
    pub id: DeliveryId,
    pub event_id: Bson,
    pub event_type: String,
    pub handler: String,
    /// Its event's key, by which it runs one at a time in order; `None` for a handler that runs
    /// several of one key at once (see [`NewDelivery::group`]).
    pub key: Option<String>,
    pub sequence: Option<i64>,
    /// The key of a handler that runs up to a limit of one key at once, unordered
    /// ([`crate::store::PerKey`]), computed here once; its lane is that key's.
    pub group: Option<String>,
    /// Its priority among its handler's deliveries, for a handler that takes priorities per
    /// event ([`crate::store::PriorityFrom`]), computed here once.
    pub priority: Option<i32>,
    pub lane: LaneId,
    /// Set for a malformed event: the delivery is dead at once with this reason.
    pub dead_reason: Option<String>,
    /// Created parked behind this delivery: the next lower sequence of its handler and key,
    /// created in the same fan-out. It waits from the start instead of being read and parked
    /// by a claim, and the claim after that predecessor is settled takes it as its key's head
    /// without looking the key up (see `Unpark::Keys`).
    pub behind: Option<DeliveryId>,
    /// Its event names its handler among [`field::SUSPECTS`]: never handed out by its fan-out,
    /// it gets a document, suspect, so that its start is recorded before it runs.
    pub suspect: bool,
}

/// An event to mark fanned out, with the handlers its list gains.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FannedEvent {
    pub id: Bson,
    pub new_handlers: Vec<String>,
    /// Its whole list afterwards: the handlers it listed (the readable ones) and the new.
    pub handlers: Vec<String>,
}

#[derive(Debug, Default)]
pub(crate) struct FanOutPlan {
    pub deliveries: Vec<NewDelivery>,
    pub events: Vec<FannedEvent>,
    pub malformed: usize,
    /// The announcements of the deliveries it creates dead (of malformed events), to publish
    /// in the transaction that writes them.
    pub dead_letters: Vec<NewEvent>,
    /// Each malformed event's id and what is wrong with it.
    pub malformed_events: Vec<(String, String)>,
    /// The documents of the events too large to deliver
    /// ([`crate::event::MAX_EVENT_DOCUMENT_BYTES`]), whole: a store where one could not grow by
    /// its mark moves it aside first.
    pub oversized: Vec<Document>,
    /// Deliveries that keep their document when handed out (see [`WithoutDocuments::of`]): a
    /// handler's that completes in its own transaction, of an event other handlers get too.
    pub keep_documents: HashSet<DeliveryId>,
    /// Handlers whose deliveries are never handed out ([`Subscriptions::claims_only`]).
    pub claims_only: HashSet<String>,
}

impl FanOutPlan {
    /// Whether `fresh` (read with no key idle, so unkeyed only) is every delivery of the plan,
    /// each to be handed out without a document: what a fan-out without a transaction needs,
    /// since it writes nothing but the events' marks. (Its listing refuses any other batch
    /// too, see `Claimer::hand_out_listed_first`; asked here first, a store skips that path
    /// for its next batches instead of reading each twice.)
    pub fn handed_out_whole_without_documents(&self, fresh: &[Fresh]) -> bool {
        fresh.len() == self.deliveries.len() && self.keep_documents.is_empty()
    }

    /// What carrying out this plan did, `claimed` being the deliveries it handed out once
    /// committed and `sent_early` those it handed out before.
    pub fn report(&self, claimed: Vec<ClaimedDelivery>, sent_early: &[DeliveryId]) -> crate::store::FanOutReport {
        let handed_out: HashSet<DeliveryId> =
            claimed.iter().map(|c| c.lease.delivery).chain(sent_early.iter().copied()).collect();
        let left = |d: &&NewDelivery| d.dead_reason.is_none() && !handed_out.contains(&d.id);
        crate::store::FanOutReport {
            events: self.events.len(),
            deliveries: self.deliveries.len(),
            malformed: self.malformed,
            malformed_events: self.malformed_events.clone(),
            lanes: self.deliveries.iter().filter(left).map(|d| d.lane).collect(),
            left_to_claims: self.deliveries.iter().filter(left).filter_map(|d| Some((d.handler.clone(), d.key.clone()?))).collect(),
            handed_out_keys: self
                .deliveries
                .iter()
                .filter(|d| handed_out.contains(&d.id))
                .filter_map(|d| Some((d.handler.clone(), d.key.clone()?)))
                .collect(),
            claimed,
            sent_early: sent_early.len(),
            more: false,
            read_to_the_end: false,
            deferred_keys: Vec::new(),
        }
    }
}

/// How many groups of keys a batch's prefix read names at most (see [`prefixes_to_read`]).
const PREFIX_GROUPS_MAX: usize = 8;

/// The order a fan-out reads unfanned events in: applications' events before handlers'
/// follow-ups, shallower follow-ups before deeper ones (`chainDepth`, missing on an
/// application's event), then oldest first (`createdAt`, `_id`). A plugin whose follow-ups
/// burst thus never holds back the events applications publish meanwhile, and a chain is
/// drained a level at a time. Per-key order does not depend on it: a key's lower events come
/// with it whatever their depth (see [`prefixes_to_read`]). MongoDB sorts the same way by its
/// `unfanned_by_depth` index (missing and null first, then numbers, then any other type).
pub(crate) fn unfanned_order(doc: &Document) -> (u8, i64, Option<DateTime>, String) {
    let (class, depth) = match doc.get(field::CHAIN_DEPTH) {
        None | Some(Bson::Null) => (0, 0),
        Some(Bson::Int32(n)) => (1, i64::from(*n)),
        Some(Bson::Int64(n)) => (1, *n),
        Some(_) => (2, 0),
    };
    (class, depth, doc.get_datetime(field::CREATED_AT).ok().copied(), id_text(doc.get(field::ID).unwrap_or(&Bson::Null)))
}

/// Keys whose lowest unfanned events must be read to complete the batch, grouped by how far
/// that read goes: up to the highest sequence the key has among the oldest events (`first`),
/// or, `None`, to the key's end (up to the read's cap). A key's unfanned events above its
/// bound wait for a batch whose oldest events reach them, so a backlog of many keys is fanned
/// out in publishing order, a few events of each key at a time, instead of whole keys at a
/// time: a key's later events then usually find it idle and are handed out too, where a whole
/// key's would all be created behind its head, each to wait for a claim. Events with no
/// sequence are read all the same (the key's index orders them first); a key with a sequence
/// that is not an integer, which the index orders after every number, is read to its end.
/// Keys of the same bound share a group; past [`PREFIX_GROUPS_MAX`] bounds, neighbouring
/// ones are merged under the highest of them (reading more of a key than needed is harmless).
///
/// Only a fan-out that may hand out (`hands_out`) bounds the keys: one that hands nothing out
/// leaves everything to claims, and a key's events read together are created parked one
/// behind the other, where met one batch at a time each would be read and parked by a claim
/// (four hosts' keyed drain, which hands out nothing, wrote 6.0 documents per delivery bounded
/// against 5.5 not, measured).
///
/// `asked` are keys read apart, each up to its own bound (see [`Claimer::keys_left_out`]), or,
/// when it is one key and nothing else is read (`first` is empty), to its end: a batch of
/// nothing but one key is kept whole (see [`heads_of_idle_keys`]), and the read among the
/// oldest, which must step over every event of a key read apart, is not made again for each
/// of its events. Several keys are read up to their bounds all the same: read to their ends
/// they would fill a batch with followers parked for claims (four hosts' keyed drain did).
///
/// [`Claimer::keys_left_out`]: crate::store::claim::Claimer::keys_left_out
pub(crate) fn prefixes_to_read(first: &[Document], hands_out: bool, asked: &[(String, i64)]) -> Vec<(Vec<String>, Option<i64>)> {
    let mut bounds: BTreeMap<&str, Option<i64>> = BTreeMap::new();
    let to_the_end = first.is_empty() && asked.len() == 1;
    for (key, bound) in asked {
        bounds.insert(key, (!to_the_end).then_some(*bound));
    }
    for doc in first {
        let Some(key) = string_key(doc) else { continue };
        let bound = bounds.entry(key).or_insert(if hands_out { Some(i64::MIN) } else { None });
        *bound = match (*bound, doc.get(field::SEQUENCE)) {
            (bound, None | Some(Bson::Null)) => bound,
            (Some(bound), Some(Bson::Int32(n))) => Some(bound.max(i64::from(*n))),
            (Some(bound), Some(Bson::Int64(n))) => Some(bound.max(*n)),
            _ => None,
        };
    }
    // By bound, the unbounded last.
    let mut by_bound: BTreeMap<(bool, i64), Vec<String>> = BTreeMap::new();
    for (key, bound) in bounds {
        by_bound.entry((bound.is_none(), bound.unwrap_or(i64::MAX))).or_default().push(key.to_string());
    }
    let groups: Vec<((bool, i64), Vec<String>)> = by_bound.into_iter().collect();
    let per_group = groups.len().div_ceil(PREFIX_GROUPS_MAX).max(1);
    groups
        .chunks(per_group)
        .map(|merged| {
            let ((unbounded, bound), _) = merged[merged.len() - 1];
            let keys = merged.iter().flat_map(|(_, keys)| keys.iter().cloned()).collect();
            (keys, (!unbounded).then_some(bound))
        })
        .collect()
}

/// The keys a batch of `limit` events reads apart (see [`Claimer::keys_left_out`]): those of
/// `left_out` that do not run here (`runs_here`), at most half the batch (the rest are read among the
/// oldest, as any key), each with the sequence it is read up to.
///
/// [`Claimer::keys_left_out`]: crate::store::claim::Claimer::keys_left_out
pub(crate) fn keys_to_ask(left_out: HashMap<String, i64>, runs_here: impl Fn(&str) -> bool, limit: usize) -> Vec<(String, i64)> {
    let mut asked: Vec<(String, i64)> = left_out.into_iter().filter(|(key, _)| !runs_here(key)).collect();
    asked.sort();
    asked.truncate(limit / 2);
    asked
}

/// Takes out of `prefixes` (a batch's prefix read) the keys read apart (`asked`) none of whose
/// events is this host's to fan out (`ours`): such a key may be another host's since it was
/// noted (a new split of the lanes). A key kept is kept whole: its lower events come along,
/// whoever's they are, as for any key.
pub(crate) fn drop_asked_keys_not_ours<D: std::borrow::Borrow<Document>>(prefixes: &mut Vec<D>, asked: &[String], ours: impl Fn(&Document) -> bool) {
    if asked.is_empty() {
        return;
    }
    let kept: HashSet<String> =
        prefixes.iter().map(|doc| doc.borrow()).filter(|doc| ours(doc)).filter_map(|doc| string_key(doc).map(str::to_string)).collect();
    prefixes.retain(|doc| string_key(doc.borrow()).is_none_or(|key| kept.contains(key) || !asked.iter().any(|asked| asked == key)));
}

/// `doc`'s sequence, if it is an integer.
pub(crate) fn integer_sequence(doc: &Document) -> Option<i64> {
    match doc.get(field::SEQUENCE) {
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        Some(Bson::Int64(n)) => Some(*n),
        _ => None,
    }
}

/// Whether a prefix read under `bound` (see [`prefixes_to_read`]) takes `doc`, one of its
/// keys' unfanned events: it is not an integer sequence above the bound.
pub(crate) fn within_prefix_bound(doc: &Document, bound: Option<i64>) -> bool {
    let Some(bound) = bound else { return true };
    integer_sequence(doc).is_none_or(|n| n <= bound)
}

/// The batch to fan out: the unkeyed events of `first` and every per-key prefix read. Keyed
/// events of `first` whose key the (capped) prefix read did not reach wait for a later batch.
pub(crate) fn assemble(first: Vec<Document>, prefixes: Vec<Document>) -> Vec<Document> {
    let mut seen: HashSet<String> = HashSet::new();
    let mut batch = Vec::with_capacity(first.len() + prefixes.len());
    for doc in first.into_iter().filter(|doc| string_key(doc).is_none()).chain(prefixes) {
        let id = id_text(doc.get(field::ID).unwrap_or(&Bson::Null));
        if seen.insert(id) {
            batch.push(doc);
        }
    }
    batch
}

/// A batch taken from what the change stream heard: its unkeyed events as heard, then each
/// key's events in sequence order, as [`assemble`] orders a batch read (a key's events commit
/// in sequence order when their publishers follow the protocol; this holds it when not).
pub(crate) fn in_key_order(heard: Vec<Document>) -> Vec<Document> {
    let (mut batch, mut keyed): (Vec<Document>, Vec<Document>) = heard.into_iter().partition(|doc| string_key(doc).is_none());
    // As the key's index orders them: a missing sequence first, then numbers, then the rest.
    let sequence = |doc: &Document| match doc.get(field::SEQUENCE) {
        None | Some(Bson::Null) => (0, 0.0),
        Some(Bson::Int32(n)) => (1, f64::from(*n)),
        Some(Bson::Int64(n)) => (1, *n as f64),
        Some(Bson::Double(n)) => (1, *n),
        Some(_) => (2, 0.0),
    };
    keyed.sort_by(|a, b| {
        let ((a_rank, a_n), (b_rank, b_n)) = (sequence(a), sequence(b));
        string_key(a).cmp(&string_key(b)).then(a_rank.cmp(&b_rank)).then(a_n.total_cmp(&b_n))
    });
    batch.extend(keyed);
    batch
}

/// Decides the deliveries of `batch` for `subscriptions`. Handlers an event already lists
/// are skipped, so a handler that completed an event never gets it again.
pub(crate) fn plan(batch: &[Document], subscriptions: &Subscriptions) -> FanOutPlan {
    let mut plan = FanOutPlan::default();
    plan.claims_only = subscriptions.handlers().into_iter().filter(|h| subscriptions.claims_only(h)).collect();
    // The last live keyed delivery created so far of each (handler, key): the batch holds
    // each key's events in sequence order, so the next one of a pair is its follower.
    let mut keys_created: HashMap<(String, String), DeliveryId> = HashMap::new();
    for doc in batch {
        let raw_id = doc.get(field::ID).cloned().unwrap_or(Bson::Null);
        let listed_in_order: Vec<&str> = match doc.get(field::HANDLERS) {
            Some(Bson::Array(handlers)) => handlers.iter().filter_map(Bson::as_str).collect(),
            _ => Vec::new(),
        };
        let listed: HashSet<&str> = listed_in_order.iter().copied().collect();
        let suspects: HashSet<&str> = match doc.get(field::SUSPECTS) {
            Some(Bson::Array(handlers)) => handlers.iter().filter_map(Bson::as_str).collect(),
            _ => HashSet::new(),
        };
        let size = crate::event::check_document_size(doc);
        if size.is_err() {
            plan.oversized.push(doc.clone());
        }
        let parsed = size.and_then(|()| EventRecord::from_document(doc));
        let (targets, record, dead_reason) = match parsed {
            Ok(record) => {
                let mut targets: Vec<String> = subscriptions.handlers_for(&record.event_type).cloned().collect();
                let violation = subscriptions.schema_violation(&record);
                if violation.is_some() {
                    plan.malformed += 1;
                    if targets.is_empty() {
                        targets.push(MALFORMED_EVENT_HANDLER.to_string());
                    }
                }
                (targets, Some(record), violation)
            }
            Err(error) => {
                plan.malformed += 1;
                let event_type = doc.get_str(field::TYPE).ok();
                let mut targets: Vec<String> =
                    event_type.map(|t| subscriptions.handlers_for(t).cloned().collect()).unwrap_or_default();
                if targets.is_empty() {
                    targets.push(MALFORMED_EVENT_HANDLER.to_string());
                }
                (targets, None, Some(format!("malformed event document: {error}")))
            }
        };
        let new_handlers: Vec<String> = targets.into_iter().filter(|h| !listed.contains(h.as_str())).collect();
        let event_id = id_text(&raw_id);
        let key = record.as_ref().map_or_else(|| string_key(doc).map(str::to_string), |r| r.key.clone());
        let event_type =
            record.as_ref().map_or_else(|| doc.get_str(field::TYPE).unwrap_or("").to_string(), |r| r.event_type.clone());
        if let Some(reason) = &dead_reason {
            plan.malformed_events.push((event_id.clone(), reason.clone()));
        }
        for handler in &new_handlers {
            let priority = subscriptions.priority_from(handler).map(|from| record.as_ref().map_or(0, |r| from.priority_of(r)));
            // A handler limited per key runs its key's deliveries unordered, in that key's lane.
            let (ordering_key, sequence, group) = match subscriptions.per_key(handler) {
                None => (key.clone(), record.as_ref().and_then(|r| r.sequence), None),
                Some(per_key) => (None, None, record.as_ref().and_then(|record| per_key.key_of(record))),
            };
            let delivery = NewDelivery {
                id: ObjectId::new(),
                event_id: raw_id.clone(),
                event_type: event_type.clone(),
                handler: handler.clone(),
                lane: lane_for_event(&event_id, group.as_deref().or(ordering_key.as_deref())),
                key: ordering_key,
                sequence,
                group,
                priority,
                dead_reason: dead_reason.clone(),
                behind: None,
                suspect: suspects.contains(handler.as_str()),
            };
            let delivery = match (&delivery.key, &delivery.dead_reason) {
                (Some(key), None) => {
                    NewDelivery { behind: keys_created.insert((handler.clone(), key.clone()), delivery.id), ..delivery }
                }
                _ => delivery,
            };
            if let Some(reason) = &delivery.dead_reason {
                let death = Death {
                    id: format!("dead:{}:0", delivery.id.to_hex()),
                    delivery_id: delivery.id.to_hex(),
                    event_id: &event_id,
                    event_type: &event_type,
                    handler,
                    key: key.as_deref(),
                    attempts: 0,
                    reason,
                };
                if death.announced() {
                    plan.dead_letters.push(death.event());
                }
            }
            plan.deliveries.push(delivery);
        }
        let mut handlers: Vec<String> = Vec::with_capacity(listed.len() + new_handlers.len());
        for handler in listed_in_order.iter().copied().chain(new_handlers.iter().map(String::as_str)) {
            if !handlers.iter().any(|h| h == handler) {
                handlers.push(handler.to_string());
            }
        }
        if handlers.len() > 1 {
            let created = &plan.deliveries[plan.deliveries.len() - new_handlers.len()..];
            let in_transaction = created.iter().filter(|d| subscriptions.completes_in_transaction(&d.handler));
            plan.keep_documents.extend(in_transaction.map(|d| d.id));
        }
        plan.events.push(FannedEvent { id: raw_id, new_handlers, handlers });
    }
    plan
}

/// The keys (with their handlers) whose first delivery in `plan` is ready: each may be
/// handed out with its fan-out if nothing of its key is pending in the store already (see
/// [`fresh`]), which the store checks in the fan-out's own snapshot. A claims-only handler's
/// keys are never among them.
pub(crate) fn keyed_heads(plan: &FanOutPlan) -> Vec<HandlerKey> {
    let mut heads: Vec<HandlerKey> = plan
        .deliveries
        .iter()
        .filter(|d| d.dead_reason.is_none() && d.behind.is_none() && !plan.claims_only.contains(&d.handler))
        .filter_map(|d| Some((d.handler.clone(), d.key.clone()?)))
        .collect();
    heads.sort();
    heads.dedup();
    heads
}

/// What a batch that hands out fans out of its keys: of a key whose first event in `batch`
/// (its lowest unfanned one) is all live heads in `idle` (nothing of the key pending in the
/// store nor running here), only that event. Its later events stay unfanned until the head
/// settles, instead of being created parked behind it, each to wait for a claim: that
/// settling asks for a fan-out (see [`crate::store::SchedulerHints::unfanned_may_wait`]), which finds the key
/// idle again. Returns the batch and the keys whose later events it left out, each with the
/// lowest sequence it left out (`None` if that is not an integer).
///
/// A batch of nothing but such heads is kept whole: a backlog of a few keys alone runs faster
/// behind each head, each next one taken by the claim its predecessor's completion asks for,
/// than one fan-out per event (one hot key's 2,000 events alone: half the rate, measured).
pub(crate) fn heads_of_idle_keys(
    batch: Vec<Document>,
    plan: &FanOutPlan,
    idle: &HashSet<HandlerKey>,
) -> (Vec<Document>, Vec<(String, Option<i64>)>) {
    let mut by_event: HashMap<String, Vec<&NewDelivery>> = HashMap::new();
    for delivery in &plan.deliveries {
        by_event.entry(id_text(&delivery.event_id)).or_default().push(delivery);
    }
    let runs_alone = |delivery: &&NewDelivery| {
        delivery.dead_reason.is_none()
            && !delivery.suspect
            && delivery.behind.is_none()
            && delivery.key.as_ref().is_some_and(|key| idle.contains(&(delivery.handler.clone(), key.clone())))
    };
    // Each key's first event decides; the batch holds a key's events in sequence order.
    let mut firsts: HashMap<&str, bool> = HashMap::new();
    let mut left_out: BTreeMap<String, Option<i64>> = BTreeMap::new();
    let mut leave: Vec<bool> = Vec::with_capacity(batch.len());
    for doc in &batch {
        let left = match string_key(doc) {
            None => false,
            Some(key) => match firsts.get(key) {
                Some(true) => {
                    left_out.entry(key.to_string()).or_insert_with(|| integer_sequence(doc));
                    true
                }
                Some(false) => false,
                None => {
                    let heads = by_event.get(&id_text(doc.get(field::ID).unwrap_or(&Bson::Null))).map(Vec::as_slice).unwrap_or_default();
                    firsts.insert(key, !heads.is_empty() && heads.iter().all(runs_alone));
                    false
                }
            },
        };
        leave.push(left);
    }
    let kept = batch.len() - leave.iter().filter(|left| **left).count();
    if kept == left_out.len() {
        return (batch, Vec::new());
    }
    let kept = batch.into_iter().zip(leave).filter(|(_, left)| !left).map(|(doc, _)| doc).collect();
    (kept, left_out.into_iter().collect())
}

/// Up to `budget` deliveries of `plan` that may be handed out as the fan-out commits them,
/// with the events of `batch` they are for: live unkeyed ones, and the heads of the keys in
/// `idle` (keys of [`keyed_heads`] of which nothing is pending in the store: nothing runs
/// there and nothing precedes them; their followers in the batch are created parked behind
/// them); never a claims-only handler's, and of a handler with a room in `budget.rooms` no
/// more than it (as a claim keeps to it). Those of handlers of a higher priority go first;
/// the first `budget.run_now` of them start at once, the others are claimed ahead.
pub(crate) fn fresh(plan: &FanOutPlan, batch: &[Document], budget: Capacity, idle: &HashSet<HandlerKey>, now: DateTime) -> Vec<Fresh> {
    if budget.total == 0 {
        return Vec::new();
    }
    // Only the events of what is handed out are parsed (again: `plan` parsed them all).
    let events: HashMap<String, &Document> =
        batch.iter().filter_map(|doc| Some((id_text(doc.get(field::ID)?), doc))).collect();
    let fresh = plan
        .deliveries
        .iter()
        .filter(|d| may_run(d, idle) && !plan.claims_only.contains(&d.handler))
        .filter_map(|d| {
            let event_id = id_text(&d.event_id);
            let event = EventRecord::from_document(events.get(&event_id)?).ok()?;
            let candidate = Candidate {
                id: d.id,
                event_id,
                handler: d.handler.clone(),
                key: d.key.clone(),
                group: d.group.clone(),
                priority: d.priority,
                lane: d.lane,
                due_at: now,
                claims: 0,
                attempts: 0,
                unstored: None,
                started: false,
                suspect: false,
                before_commit: d.key.is_some().then(|| EventOf(d.event_id.clone())),
            };
            Some(Fresh { candidate, event })
        });
    let mut fresh: Vec<Fresh> = if budget.priorities.is_empty() && budget.rooms.is_empty() {
        fresh.take(budget.total).collect()
    } else {
        let mut taken: HashMap<String, usize> = HashMap::new();
        let mut all: Vec<Fresh> = fresh
            .filter(|fresh| match budget.rooms.of(&fresh.candidate.handler) {
                None => true,
                Some(room) => {
                    let taken = taken.entry(fresh.candidate.handler.clone()).or_default();
                    *taken += 1;
                    *taken <= room.most
                }
            })
            .collect();
        all.sort_by_key(|fresh| std::cmp::Reverse(budget.priorities.of(&fresh.candidate.handler)));
        all.truncate(budget.total);
        all
    };
    for (at, fresh) in fresh.iter_mut().enumerate() {
        fresh.candidate.started = at < budget.run_now;
    }
    fresh
}

/// Whether `d`, of a fan-out's plan, may run as soon as it is created: live, not suspect, and
/// unkeyed or the head of a key in `idle` (see [`fresh`]).
fn may_run(d: &NewDelivery, idle: &HashSet<HandlerKey>) -> bool {
    let ready = match &d.key {
        None => true,
        Some(key) => d.behind.is_none() && idle.contains(&(d.handler.clone(), key.clone())),
    };
    d.dead_reason.is_none() && !d.suspect && ready
}

/// The fresh deliveries of a hand-out that are to have no document (see [`Candidate::unstored`]).
#[derive(Debug, Default)]
pub(crate) struct WithoutDocuments {
    /// The fan-out's id, stamped on the events it marks and named by the lane entries.
    pub fan_out: ObjectId,
    /// By event (as [`id_text`] prints it): the handlers its `handedOut` list gets.
    pub handlers: HashMap<String, Vec<String>>,
    /// Each one's event, handler and key.
    pub deliveries: HashMap<DeliveryId, (Bson, String, Option<String>)>,
}

impl WithoutDocuments {
    /// Every one of `fresh`, each marked as such. A keyed one is its key's head, handed out
    /// while nothing of its key is pending in the store nor runs on this instance (the only
    /// one that runs its lane's work); its followers in the batch get documents, parked
    /// behind it. One of the plan's [`FanOutPlan::keep_documents`] keeps its document:
    /// without a document, a delivery's completion is its event's `handedOut`, and in a
    /// handler's transaction, which lasts as long as its run, that write would conflict with
    /// any other handler's completion of the same event, and run the handler again.
    pub fn of(plan: &FanOutPlan, fresh: &mut [Fresh]) -> Self {
        let events: HashMap<DeliveryId, &Bson> = plan.deliveries.iter().map(|d| (d.id, &d.event_id)).collect();
        let mut unstored = Self { fan_out: ObjectId::new(), ..Self::default() };
        let without_document = |fresh: &&mut Fresh| !plan.keep_documents.contains(&fresh.candidate.id);
        for Fresh { candidate, .. } in fresh.iter_mut().filter(without_document) {
            let Some(event) = events.get(&candidate.id) else { continue };
            candidate.unstored = Some(HandOutOf { event: (*event).clone(), fan_out: Some(unstored.fan_out) });
            unstored.handlers.entry(id_text(event)).or_default().push(candidate.handler.clone());
            unstored.deliveries.insert(candidate.id, ((*event).clone(), candidate.handler.clone(), candidate.key.clone()));
        }
        unstored
    }
}

#[cfg(test)]
#[path = "planning_tests.rs"]
mod tests;
