//! Fan-out in MongoDB: one transaction reads a batch of unfanned events (completed per key,
//! see [`crate::store::fan_out`]), marks them fanned out and inserts their deliveries. Two
//! hosts fanning out the same event both mark it, so one of them conflicts and, on retry,
//! no longer sees it as unfanned. The mark comes first so that, once it succeeded, the
//! fan-out is the only one of its events; what it hands out early is sent from there.
//!
//! The commit is acknowledged once applied, without waiting for the journal or a majority:
//! nothing a claim takes from a fan-out runs before the claim's lane list names it, a
//! majority write, and a fan-out lost in a crash or a failover leaves its events unfanned, to
//! be fanned out again (see [`handing_out`] for the deliveries a fan-out hands out itself).
//!
//! A fan-out that may hand out first takes the unkeyed events its host's change stream
//! reported ([`Heard`]) instead of reading them, and checks in its transaction that each is
//! still unfanned. The way from a commit to its handler is then the transaction's mark beside
//! one lane write, with nothing read first; the inserts and the commit follow while the
//! handler runs.
//!
//! A backlog batch that can be handed out whole writes no delivery document, so it needs no
//! transaction at all ([`plain`]): its lanes are listed first, then its events are marked by
//! plain updates that each apply only while the event is unfanned.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;

use mongodb::ClientSession;

use super::generations::WriteIn;
use super::{Commit, MongoStore, generations, heads, lanes};
use super::documents::new_delivery_document;
use super::unfanned::{Reach, Read, read_batch};
use crate::event::field;
use crate::store::fan_out::{self, FanOutPlan, FannedEvent, WithoutDocuments, id_text};
use crate::store::{Capacity, DeliveryId, EarlyHandOuts, FanOutReport, StoreError, StoreTransaction, Subscriptions, answered};

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
            match handing_out(store, subscriptions, Batch::Heard(fan_out::in_key_order(batch)), hand_out.clone(), early, now).await {
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
    match read(store, subscriptions, limit, hand_out, early, now).await {
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

/// A fan-out of what is read from the collection: handing out up to `hand_out` if it may,
/// retrying as a plain fan-out should that conflict with another.
async fn read(
    store: &MongoStore,
    subscriptions: &Subscriptions,
    limit: usize,
    hand_out: Capacity,
    early: Option<&EarlyHandOuts>,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    let mut lanes_to_read = Vec::new();
    if hand_out.total > 0 {
        let plainly = early.filter(|_| !store.options.completion_history && store.plain_marks.worth_trying());
        if let Some(early) = plainly {
            match plain(store, subscriptions, limit, hand_out.clone(), early, now).await {
                Ok(Some(report)) => return Ok(report),
                Ok(None) => {}
                // Nothing of it was written, or what was is handed back: read again.
                Err(error) if error.is_transient() => {}
                Err(error) => return Err(error),
            }
        }
        match handing_out(store, subscriptions, Batch::Read(limit), hand_out.clone(), early, now).await {
            // Another fan-out wrote the same events first: the retrying path sorts it out,
            // and a claim looks at the lanes this one took or listed in (see `run`).
            Err(error) if error.is_transient() => lanes_to_read = store.claimer.lanes_to_read(),
            done => return done,
        }
    }
    // After a hand-out that failed, the batch read is bounded as that hand-out's was.
    let mut report = transaction!(store, Commit::Applied, |tx| {
        let Read { batch, reach, .. } = read_batch(store, Some(tx.session()), limit, hand_out.total > 0, now).await?;
        let plan = fan_out::plan(&batch, subscriptions);
        write(store, tx.session(), &plan, now).await?;
        Ok(reach.on(plan.report(Vec::new(), &[])))
    })?;
    report.lanes.extend(lanes_to_read);
    Ok(report)
}

/// The time a hand-out's leases run from, once its batch is read: the fan-out's `now`, or the
/// clock if that moved on. A read held up (by a failover, say) would otherwise list what it
/// hands out under a lease that lapsed, or nearly, as it was written, and another host would
/// take the lane over from a live holder (which loses nothing, see `unstored::materialize`,
/// but charges runs that did not fail).
fn after_read(now: DateTime) -> DateTime {
    now.max(DateTime::now())
}

/// Whether a fan-out tries its batch the plain way first ([`plain`]). A batch that cannot be
/// handed out whole is read twice, so after one whose events do not allow it (keyed events,
/// several handlers, too few run slots, malformed events) the next [`PLAIN_SKIPS`] go
/// straight to the transaction.
#[derive(Debug, Default)]
pub(super) struct PlainMarks {
    skips: AtomicU64,
}

/// Batches a fan-out reads in a transaction after one whose events could not be handed out
/// whole.
const PLAIN_SKIPS: u64 = 16;

impl PlainMarks {
    fn worth_trying(&self) -> bool {
        self.skips.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |skips| skips.checked_sub(1)).is_err()
    }

    fn skip(&self, batches: u64) {
        self.skips.store(batches, Ordering::SeqCst);
    }
}

/// A backlog batch handed out whole without a transaction: read, listed in lanes this
/// instance holds, then marked fanned out by plain updates ([`mark_plainly`]), its leases
/// sent to `early` once the mark is done. `None`, having written nothing that counts, when
/// the batch cannot be handed out whole (see [`Claimer::hand_out_listed_first`]).
///
/// Every delivery of such a batch is unkeyed, handed out and without a document, so the
/// mark is all a fan-out writes besides the lists, and it needs no transaction: each event
/// is marked by one statement that matches it only while unfanned, so of two racing
/// fan-outs exactly one marks it, and the lists, written first, name every delivery a
/// marked event's `handedOut` lists. `mongod` checks every index of a collection against
/// its durable catalog for each document a transaction writes that changes an index (the
/// mark takes the event out of `unfanned`), and runs a transaction's statements one after
/// the other; outside one, the mark costs less and runs on two threads.
///
/// [`Claimer::hand_out_listed_first`]: crate::store::claim::Claimer::hand_out_listed_first
async fn plain(
    store: &MongoStore,
    subscriptions: &Subscriptions,
    limit: usize,
    hand_out: Capacity,
    early: &EarlyHandOuts,
    now: DateTime,
) -> Result<Option<FanOutReport>, StoreError> {
    let Read { batch, reach, .. } = read_batch(store, None, limit, true, now).await?;
    let now = after_read(now);
    let plan = fan_out::plan(&batch, subscriptions);
    // Every delivery of such a batch is unkeyed.
    let mut fresh = fan_out::fresh(&plan, &batch, hand_out, &HashSet::new(), now);
    if plan.events.is_empty() {
        return Ok(Some(reach.on(plan.report(Vec::new(), &[]))));
    }
    if !plan.handed_out_whole_without_documents(&fresh) {
        store.plain_marks.skip(PLAIN_SKIPS);
        return Ok(None);
    }
    let unstored = WithoutDocuments::of(&plan, &mut fresh);
    let (plan, handed_out, fan_out) = (&plan, &unstored.handlers, unstored.fan_out);
    let mark = || async move {
        let ours = mark_plainly(store, &plan.events, handed_out, fan_out, now).await?;
        Ok(plan.deliveries.iter().filter(|d| ours.contains(&id_text(&d.event_id))).map(|d| d.id).collect())
    };
    // `None`: the lanes held have no room for it (the transaction's hand-out takes some), or
    // a claim owns them now.
    let sent = store.claimer.hand_out_listed_first(&lanes::Backend { store }, fresh, mark, early, now).await?;
    Ok(sent.map(|sent| reach.on(plan.report(Vec::new(), &sent))))
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
    tx.commit().await.unwrap();
    marked == 1
}

/// How often a plain mark is sent again after an error before the fan-out gives up (and
/// hands what it listed back as not run).
const PLAIN_MARK_ATTEMPTS: u32 = 4;

/// Where a fan-out's batch comes from.
enum Batch {
    /// Unkeyed events the change stream reported.
    Heard(Vec<Document>),
    /// Read from the collection, up to this many (and the lower events of their keys).
    Read(usize),
}

/// One fan-out transaction that hands out what it creates (see [`Claimer::hand_out`]): the
/// lane lists are written while the events are marked. Tried once: an error aborts it, and a
/// conflict leaves the batch to the retrying path.
///
/// Its commit, like the lane writes ([`LaneWrite::Applied`]), is acknowledged once applied. A
/// handed-out delivery may then start before its fan-out is durable; should a failover lose
/// the fan-out, its events are fanned out and run again, which at-least-once allows. A
/// transactional handler's completion cannot commit without it: it deletes the delivery the
/// fan-out inserted, later in the same oplog.
///
/// [`LaneWrite::Applied`]: crate::store::claim::LaneWrite::Applied
///
/// [`Claimer::hand_out`]: crate::store::claim::Claimer::hand_out
async fn handing_out(
    store: &MongoStore,
    subscriptions: &Subscriptions,
    batch: Batch,
    hand_out: Capacity,
    early: Option<&EarlyHandOuts>,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    // Before the transaction's first read, which takes its snapshot (see `KeysBeforeRead`).
    let keys = store.claimer.before_idle_read().await;
    let mut tx = store.begin_with(Commit::Applied).await?;
    let (batch, limit, reach, asked) = match batch {
        Batch::Heard(events) => (events, None, Reach::default(), Vec::new()),
        Batch::Read(limit) => match read_batch(store, Some(tx.session()), limit, hand_out.total > 0, now).await {
            Ok(Read { batch, reach, asked }) => (batch, Some(limit), reach, asked),
            Err(error) => {
                let _ = tx.abort().await;
                return Err(error);
            }
        },
    };
    let now = after_read(now);
    let plan = fan_out::plan(&batch, subscriptions);
    let heads = if hand_out.total == 0 { Vec::new() } else { fan_out::keyed_heads(&plan) };
    let idle = match heads.is_empty() {
        true => HashSet::new(),
        false => match heads::idle_keys(store, tx.session(), heads).await {
            Ok(idle) => idle,
            Err(error) => {
                let _ = tx.abort().await;
                return Err(error);
            }
        },
    };
    let mut idle = idle;
    idle.retain(|key| !keys.running.contains(key));
    // Of an idle key, only its head: the rest waits unfanned for the head to settle here.
    let (batch, left_out) = if idle.is_empty() { (batch, Vec::new()) } else { fan_out::heads_of_idle_keys(batch, &plan, &idle) };
    let plan = if left_out.is_empty() { plan } else { fan_out::plan(&batch, subscriptions) };
    if !left_out.is_empty() {
        // Its events are not all fanned out: the change stream's are no longer all there is.
        store.heard.missed_some();
    }
    let noted = store.claimer.note_left_out(&asked, &batch, &left_out);
    let mut fresh = fan_out::fresh(&plan, &batch, hand_out, &idle, now);
    // What is handed out gets no document (see `super::unstored`), unless every completion is to be
    // recorded: the history copies the delivery's document.
    let unstored = if store.options.completion_history { WithoutDocuments::default() } else { WithoutDocuments::of(&plan, &mut fresh) };
    let (written, unstored) = (&plan, &unstored);
    // The first stage is the mark, which makes this fan-out the only one of its events; the
    // inserts go with the commit, so that a hand-out sent early need not wait for them.
    let write = async move {
        let marked = mark(store, tx.session(), written, unstored, now).await;
        match marked {
            // Every heard event must still have been unfanned: one that was not is another
            // fan-out's (whose deliveries may even be completed and gone by now).
            Ok(marked) if marked == written.events.len() as u64 || limit.is_some() => Ok(move |handed: &HashSet<DeliveryId>| {
                let without_document: HashSet<DeliveryId> =
                    handed.iter().filter(|id| unstored.deliveries.contains_key(id)).copied().collect();
                async move {
                    let inserted = async {
                        insert(store, tx.session(), written, &without_document, now).await?;
                        unstored.not_handed_out(store, tx.session(), &without_document).await
                    };
                    if let Err(error) = inserted.await {
                        let _ = tx.abort().await;
                        return Err(error);
                    }
                    tx.commit().await
                }
            }),
            outcome => {
                let _ = tx.abort().await;
                Err(outcome.err().unwrap_or_else(|| StoreError::Raced("a heard event was fanned out already".into())))
            }
        }
    };
    let handed = store.claimer.hand_out(&lanes::Backend { store }, fresh, &keys, write, early, now).await?;
    let mut report = reach.on(plan.report(handed.claimed, &handed.sent_early));
    if !left_out.is_empty() {
        report.read_to_the_end = false;
    }
    report.deferred_keys.extend(noted);
    Ok(report)
}

/// Marks the plan's events fanned out and inserts their deliveries; returns how many it
/// marked (those still unfanned).
async fn write(store: &MongoStore, session: &mut ClientSession, plan: &FanOutPlan, now: DateTime) -> Result<u64, StoreError> {
    let marked = mark(store, session, plan, &WithoutDocuments::default(), now).await?;
    insert(store, session, plan, &HashSet::new(), now).await?;
    Ok(marked)
}

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
