//! The fan-out's primitives in MongoDB (orchestrated once, in [`crate::store::fan_out`]), and
//! the way it takes what the change stream heard. A fan-out's transaction reads a batch of
//! unfanned events, marks them fanned out and inserts their deliveries. Two hosts fanning out
//! the same event both mark it, so one of them conflicts and, on retry, no longer sees it as
//! unfanned. The mark comes first so that, once it succeeded, the fan-out is the only one of
//! its events; what it hands out early is sent from there.
//!
//! The commit is acknowledged once applied, without waiting for the journal or a majority:
//! nothing a claim takes from a fan-out runs before the claim's lane list names it, a
//! majority write, and a fan-out lost in a crash or a failover leaves its events unfanned, to
//! be fanned out again. A handed-out delivery may then start before its fan-out is durable;
//! should a failover lose the fan-out, its events are fanned out and run again, which
//! at-least-once allows. A transactional handler's completion cannot commit without it: it
//! deletes the delivery the fan-out inserted, later in the same oplog.
//!
//! A fan-out that may hand out first takes the unkeyed events its host's change stream
//! reported ([`Heard`]) instead of reading them, and checks in its transaction that each is
//! still unfanned. The way from a commit to its handler is then the transaction's mark beside
//! one lane write, with nothing read first; the inserts and the commit follow while the
//! handler runs.

use std::collections::{BTreeMap, HashMap, HashSet};

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;

use mongodb::ClientSession;

use super::generations::WriteIn;
use super::{Commit, MongoStore, MongoTx, generations, heads, lanes};
use super::documents::new_delivery_document;
use super::unfanned::read_batch;
use crate::event::field;
use crate::store::claim::{ClaimBackend, Claimer, HandlerKey};
use crate::store::fan_out::{self, Batch, FanOutBackend, FanOutPlan, FannedEvent, PlainMarks, Read, WithoutDocuments, id_text};
use crate::store::{Capacity, DeliveryId, EarlyHandOuts, FanOutReport, StoreError, Subscriptions, answered};

pub(super) async fn run(
    store: &MongoStore,
    subscriptions: &Subscriptions,
    limit: usize,
    hand_out: Capacity,
    early: Option<&EarlyHandOuts>,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    if limit == 0 {
        return Ok(FanOutReport::default());
    }
    let mut report = FanOutReport::default();
    let mut hand_out = hand_out;
    // Heard events are committed already: a fan-out that does not hand out reads them below
    // (or, if its batch comes back full, counts a miss), so they are dropped then.
    let heard = store.heard.take();
    if hand_out.total > 0 {
        if heard.len() > limit {
            store.heard.missed_some();
        }
        // Other hosts' events are theirs (see `crate::store::assignment`).
        let (assignment, stale_before) = (store.claimer.assignment(), store.claimer.stale_before(now));
        // A keyed event needs its key's lower unfanned events with it: the heard ones are all
        // of them only in this host's own lanes, and while the stream missed nothing (see
        // `Heard::complete_under`); otherwise reading finds them.
        let complete = store.heard.complete_under(&assignment);
        let heard_some = !heard.is_empty();
        let (batch, left): (Vec<Document>, Vec<Document>) =
            heard.into_iter().take(limit).filter(|event| assignment.fans_out(event, stale_before)).partition(|event| {
                fan_out::string_key(event).is_none() || (complete && assignment.holds(event))
            });
        if heard_some && batch.is_empty() && left.is_empty() && complete {
            // All the stream reported is other hosts', and it missed nothing since a read to
            // the end under this split: nothing of this host's is left to read. (A fan-out
            // with nothing heard, the poll's, still reads: it finds other hosts' stale events.)
            return Ok(report);
        }
        if !batch.is_empty() {
            match fan_out::handing_out(store, subscriptions, Batch::Heard(fan_out::in_key_order(batch)), hand_out.clone(), early, now).await {
                Ok(heard) if left.is_empty() && !store.heard.behind() => return Ok(heard),
                Ok(heard) => report = heard,
                Err(error) => {
                    store.heard.missed_some();
                    // Another fan-out's deliveries may land in the lanes this one took or
                    // listed in: only this instance can claim them there, so it will.
                    report.lanes.extend(store.claimer.lanes_to_read());
                    tracing::debug!(%error, "fanning out heard events failed; reading them instead");
                }
            }
        }
        hand_out = hand_out.less(report.claimed.len() + report.sent_early);
    }
    // The split first: a read under a split that changed since counts for none (see `Heard`).
    let under = store.claimer.assignment();
    let since = store.heard.misses();
    match fan_out::fan_out(store, subscriptions, limit, hand_out, early, now).await {
        Ok(read) => {
            store.heard.read(since, under, read.read_to_the_end);
            Ok(report.and(read))
        }
        Err(error) => {
            store.heard.missed_some();
            // What was handed out is claimed: it must reach the dispatcher, which runs it.
            if report.claimed.is_empty() && report.sent_early == 0 {
                return Err(error);
            }
            tracing::warn!(%error, "reading unfanned events failed; the next fan-out reads them");
            Ok(report)
        }
    }
}

/// The primitives the one fan-out (`crate::store::fan_out`) is orchestrated over.
impl FanOutBackend for MongoStore {
    type Tx = MongoTx;

    fn claimer(&self) -> &Claimer {
        &self.claimer
    }

    fn lanes(&self) -> impl ClaimBackend + '_ {
        lanes::Backend { store: self }
    }

    fn completion_history(&self) -> bool {
        self.options.completion_history
    }

    fn plain_marks(&self) -> &PlainMarks {
        &self.plain_marks
    }

    /// Acknowledged once applied (see the module's doc).
    async fn begin(&self) -> Result<MongoTx, StoreError> {
        self.begin_with(Commit::Applied).await
    }

    async fn read(&self, tx: Option<&mut MongoTx>, limit: usize, hands_out: bool, now: DateTime) -> Result<Read, StoreError> {
        read_batch(self, tx.map(|tx| tx.session()), limit, hands_out, now).await
    }

    async fn idle_keys(&self, tx: &mut MongoTx, heads: Vec<HandlerKey>) -> Result<HashSet<HandlerKey>, StoreError> {
        heads::idle_keys(self, tx.session(), heads).await
    }

    async fn mark(&self, tx: &mut MongoTx, plan: &FanOutPlan, without: &WithoutDocuments, now: DateTime) -> Result<u64, StoreError> {
        mark(self, tx.session(), plan, without, now).await
    }

    async fn write_rest(
        &self,
        tx: &mut MongoTx,
        plan: &FanOutPlan,
        without: &WithoutDocuments,
        handed: &HashSet<DeliveryId>,
        now: DateTime,
    ) -> Result<(), StoreError> {
        let without_document: HashSet<DeliveryId> = handed.iter().filter(|id| without.deliveries.contains_key(id)).copied().collect();
        insert(self, tx.session(), plan, &without_document, now).await?;
        without.not_handed_out(self, tx.session(), &without_document).await
    }

    /// Outside a transaction: `mongod` checks every index of a collection against its
    /// durable catalog for each document a transaction writes that changes an index (the mark
    /// takes the event out of `unfanned`), and runs a transaction's statements one after the
    /// other; outside one, the mark costs less and runs on two threads.
    async fn mark_plainly(&self, events: &[FannedEvent], without: &WithoutDocuments, now: DateTime) -> Result<HashSet<String>, StoreError> {
        mark_plainly(self, events, &without.handlers, without.fan_out, now).await
    }

    /// The time a hand-out's leases run from, once its batch is read: the fan-out's `now`, or the
    /// clock if that moved on. A read held up (by a failover, say) would otherwise list what it
    /// hands out under a lease that lapsed, or nearly, as it was written, and another host would
    /// take the lane over from a live holder (which loses nothing, see `unstored::materialize`,
    /// but charges runs that did not fail).
    fn after_read(&self, now: DateTime) -> DateTime {
        now.max(DateTime::now())
    }

    /// Its events are not all fanned out: the change stream's are no longer all there is.
    fn left_some_unfanned(&self) {
        self.heard.missed_some();
    }
}

/// Marks `events` fanned out by `fan_out` with plain updates, two commands at once (one per
/// half); returns the events (as [`id_text`] prints them) it marked. An event another
/// fan-out marked first is left as it is. The statements also match an event `fan_out`
/// marked already, so after an error they are sent again, changing nothing twice.
async fn mark_plainly(
    store: &MongoStore,
    events: &[FannedEvent],
    handed_out: &HashMap<String, Vec<String>>,
    fan_out: ObjectId,
    now: DateTime,
) -> Result<HashSet<String>, StoreError> {
    let collection = store.collections.events.name();
    let halves: Vec<Vec<Document>> =
        events.chunks(events.len().div_ceil(2).max(1)).map(|half| mark_statements(half, handed_out, Some(Stamp::Plain(fan_out)), now)).collect();
    let mut attempts = 0;
    let marked: u64 = loop {
        let sent = halves.iter().map(|statements| {
            generations::update_each(store, collection, statements.clone(), WriteIn::Alone(Commit::Applied))
        });
        // Every half is awaited, failed or not (see `answered`): a half landing after this
        // fan-out gave up would mark events its hand-back left out of their lane's list.
        match answered::every(sent).await {
            Ok(counts) => break counts.into_iter().sum(),
            Err(error) if attempts < PLAIN_MARK_ATTEMPTS => {
                attempts += 1;
                tracing::warn!(%error, attempts, "a plain mark failed; sending it again");
                tokio::time::sleep(std::time::Duration::from_millis(50 << attempts)).await;
            }
            Err(error) => return Err(error),
        }
    };
    let ids: Vec<Bson> = events.iter().map(|event| event.id.clone()).collect();
    if marked == ids.len() as u64 {
        return Ok(events.iter().map(|event| id_text(&event.id)).collect());
    }
    // Another fan-out marked some first: which is said by the mark itself.
    let ours: Vec<Document> = store
        .collections
        .events
        .find(doc! { field::ID: { "$in": ids }, field::FAN_OUT: fan_out })
        .projection(doc! { field::ID: 1 })
        .batch_size(super::documents::one_batch(events.len()))
        .await?
        .try_collect()
        .await?;
    Ok(ours.iter().map(|event| id_text(event.get(field::ID).unwrap_or(&Bson::Null))).collect())
}

/// The mark of the fan-out `fan_out`, which listed `event`'s delivery to `handler` in a lane
/// and handed it out, landing only now: plain, or in a transaction (as a heard batch's, which
/// reads nothing first); whether it marked the event.
#[cfg(test)]
pub(super) async fn mark_late(store: &MongoStore, event: &str, handler: &str, fan_out: ObjectId, in_transaction: bool) -> bool {
    let handlers = vec![handler.to_string()];
    let fanned = FannedEvent { id: Bson::String(event.to_string()), new_handlers: handlers.clone(), handlers: handlers.clone() };
    let handed_out = HashMap::from([(event.to_string(), handlers)]);
    let now = DateTime::now();
    if !in_transaction {
        return mark_plainly(store, &[fanned], &handed_out, fan_out, now).await.unwrap().contains(event);
    }
    let mut tx = store.begin_with(Commit::Applied).await.unwrap();
    let statements = mark_statements(&[fanned], &handed_out, Some(Stamp::InTransaction(fan_out)), now);
    let marked = generations::update_each(store, store.collections.events.name(), statements, WriteIn::Transaction(tx.session()));
    let marked = marked.await.unwrap();
    crate::store::StoreTransaction::commit(tx).await.unwrap();
    marked == 1
}

/// How often a plain mark is sent again after an error before the fan-out gives up (and
/// hands what it listed back as not run).
const PLAIN_MARK_ATTEMPTS: u32 = 4;

/// In MongoDB, the commit stage of a hand-out takes back what it did not hand out.
impl WithoutDocuments {
    /// Takes the handlers of those that were not handed out after all (their lane was not
    /// listed) out of their events' lists: [`insert`] wrote their documents.
    async fn not_handed_out(
        &self,
        store: &MongoStore,
        session: &mut ClientSession,
        without_document: &HashSet<DeliveryId>,
    ) -> Result<(), StoreError> {
        let mut by_handler: BTreeMap<&str, Vec<Bson>> = BTreeMap::new();
        for (delivery, (event, handler, _)) in &self.deliveries {
            if !without_document.contains(delivery) {
                by_handler.entry(handler).or_default().push(event.clone());
            }
        }
        let statements: Vec<Document> = by_handler
            .into_iter()
            .map(|(handler, ids)| {
                doc! {
                    "q": { field::ID: { "$in": ids } },
                    "u": { "$pull": { field::HANDED_OUT: handler } },
                    "multi": true,
                    "hint": { field::ID: 1 },
                }
            })
            .collect();
        generations::update_each(store, store.collections.events.name(), statements, WriteIn::Transaction(session)).await?;
        Ok(())
    }
}

/// Marks the plan's events fanned out, with the handlers they had deliveries for and those
/// of `unstored` whose deliveries are handed out without a document (stamped with its
/// fan-out, which their lane entries name); returns how many it marked (those still
/// unfanned). Once this statement succeeded, no other fan-out of those events can: it would
/// write the same documents, and conflict.
async fn mark(
    store: &MongoStore,
    session: &mut ClientSession,
    plan: &FanOutPlan,
    unstored: &WithoutDocuments,
    now: DateTime,
) -> Result<u64, StoreError> {
    if plan.events.is_empty() {
        return Ok(0);
    }
    quarantine(store, session, plan).await?;
    // The lists were read in this transaction, so a concurrent change of one conflicts with
    // this write.
    let stamp = (!unstored.handlers.is_empty()).then_some(Stamp::InTransaction(unstored.fan_out));
    let statements = mark_statements(&plan.events, &unstored.handlers, stamp, now);
    generations::update_each(store, store.collections.events.name(), statements, WriteIn::Transaction(session)).await
}

/// Keeps the whole document of every oversized event of `plan` in `<prefix>oversized_events`
/// (same `_id`) and takes the payload out of the event, before its mark: an event within
/// bytes of 16 MiB cannot grow by its mark, and a mark that fails fails the whole fan-out,
/// every time. Nothing is lost: the event's `payloadMovedTo` names where it is.
async fn quarantine(store: &MongoStore, session: &mut ClientSession, plan: &FanOutPlan) -> Result<(), StoreError> {
    for document in &plan.oversized {
        let id = document.get(field::ID).cloned().unwrap_or(Bson::Null);
        tracing::warn!(event = %id_text(&id), collection = store.collections.oversized_events.name(),
            "an event too large to deliver is dead-lettered; its document is kept whole aside");
        store
            .collections
            .oversized_events
            .replace_one(doc! { field::ID: id.clone() }, document.clone())
            .upsert(true)
            .session(&mut *session)
            .await?;
        let moved = doc! {
            "$unset": { field::PAYLOAD: "" },
            "$set": { field::PAYLOAD_MOVED_TO: store.collections.oversized_events.name() },
        };
        store.collections.events.update_one(doc! { field::ID: id }, moved).session(&mut *session).await?;
    }
    Ok(())
}

/// How a mark names its fan-out in the events' `fanOut`.
#[derive(Debug, Clone, Copy)]
enum Stamp {
    /// Inside the fan-out's transaction, where only unfanned events are marked.
    InTransaction(ObjectId),
    /// A plain mark, which also matches what this very fan-out marked (see [`mark_plainly`]).
    Plain(ObjectId),
}

/// The statements that mark `events` fanned out (stamped with their fan-out, if given). One
/// statement per distinct pair of resulting lists (in practice: per event type and whether
/// it is handed out), all in one command, so a batch of many types costs one round trip
/// too. A malformed `handlers` field is replaced by the readable part of it.
fn mark_statements(
    events: &[FannedEvent],
    handed_out: &HashMap<String, Vec<String>>,
    stamp: Option<Stamp>,
    now: DateTime,
) -> Vec<Document> {
    let none = Vec::new();
    let mut by_handlers: BTreeMap<(Vec<String>, &Vec<String>), Vec<Bson>> = BTreeMap::new();
    for event in events {
        let handed_out = handed_out.get(&id_text(&event.id)).unwrap_or(&none);
        by_handlers.entry((event.handlers.clone(), handed_out)).or_default().push(event.id.clone());
    }
    by_handlers
        .into_iter()
        .map(|((handlers, handed_out), ids)| {
            let mut set = doc! { field::FANNED_OUT_AT: now, field::HANDLERS: handlers };
            if !handed_out.is_empty() {
                set.insert(field::HANDED_OUT, handed_out);
            }
            let mut filter = doc! { field::ID: { "$in": ids } };
            // Never handed out to a handler a takeover named suspect: that takeover dropped
            // this fan-out's lane entry of it (see `unstored::materialize`).
            let mut unfanned = doc! { field::FANNED_OUT_AT: Bson::Null };
            if !handed_out.is_empty() {
                unfanned.insert(field::SUSPECTS, doc! { "$nin": handed_out });
            }
            match stamp {
                Some(Stamp::Plain(fan_out)) => {
                    set.insert(field::FAN_OUT, fan_out);
                    filter.insert("$or", vec![unfanned, doc! { field::FAN_OUT: fan_out }]);
                }
                Some(Stamp::InTransaction(fan_out)) => {
                    set.insert(field::FAN_OUT, fan_out);
                    filter.extend(unfanned);
                }
                None => {
                    filter.insert(field::FANNED_OUT_AT, Bson::Null);
                }
            }
            doc! { "q": filter, "u": { "$set": set }, "multi": true, "hint": { field::ID: 1 } }
        })
        .collect()
}

/// Inserts the plan's deliveries but those handed out `without_document`.
async fn insert(
    store: &MongoStore,
    session: &mut ClientSession,
    plan: &FanOutPlan,
    without_document: &HashSet<DeliveryId>,
    now: DateTime,
) -> Result<(), StoreError> {
    let documents: Vec<Document> = plan
        .deliveries
        .iter()
        .filter(|d| !without_document.contains(&d.id))
        .map(|d| new_delivery_document(d, now))
        .collect();
    if !documents.is_empty() {
        store.collections.deliveries.insert_many(documents).session(&mut *session).await?;
    }
    // The deaths of what it creates dead are announced with them.
    for dead_letter in &plan.dead_letters {
        store.publisher.publish(session, dead_letter).await?;
    }
    Ok(())
}
