//! Deliveries a fan-out handed out without writing a document for them (see
//! [`Candidate::unstored`]): the first attempt of an unkeyed event, or of a key's head, the
//! common case of a drain, then costs the event's mark and its completion's stamp and no
//! delivery document at all. While it runs, its records are its event's `handedOut` list,
//! which names its handler, and an entry in the in-flight list of a lane its holder holds
//! (its key's, or, unkeyed, any such lane), which names its event.
//!
//! This module owns the two ways out of that list. A completion takes the handler out of it
//! (and stamps the event) in one conditional update. Anything else, a failure, a hand-back, a
//! takeover or a check, first *materializes* it: one transaction takes the handler out of the
//! list and inserts the delivery's document at claim generation 0, as a fan-out would have,
//! so that the ordinary fenced outcomes apply from there. Both conditions are on the event
//! document, so of a completion and a materialization only the first changes anything. It
//! must never write a document for a handler the list no longer names (that delivery was
//! completed, or has its document already). A takeover's entry whose event was never fanned
//! out names the event suspect for its handler in the same transaction, which a fan-out of
//! it still on its way conflicts with (see [`materialize`]).
//!
//! [`Candidate::unstored`]: crate::store::claim::Candidate::unstored

use std::collections::{BTreeMap, HashMap, HashSet};

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::ClientSession;

use super::documents::{delivery, new_delivery_document};
use super::generations::{self, WriteIn};
use super::{Commit, MongoStore};
use crate::event::field;
use crate::store::fan_out::{NewDelivery, id_text};
use crate::store::{DeliveryId, LOST_WHILE_RUNNING, StoreError};

pub(super) use crate::store::unstored::Entry;

/// In MongoDB: the filter of its event.
impl Entry {
    /// The filter of its event while the delivery has no document and is not completed.
    fn event_filter(&self) -> Document {
        let mut filter = doc! { field::ID: self.event.clone(), field::HANDED_OUT: &self.handler };
        if let Some(fan_out) = self.fan_out {
            filter.insert(field::FAN_OUT, fan_out);
        }
        filter
    }
}

/// How a materialization counts the run of the deliveries it gives a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Charge {
    /// Not at all: the outcome that follows counts it (a failure, a hand-back, a check).
    Nothing,
    /// A takeover's: each is at the next claim generation, and those listed as started are
    /// charged the attempt their dead host did not finish. In the transaction that writes
    /// the document, so a crash between the two can neither lose nor repeat the charge.
    Takeover,
}

/// Gives each of `entries` whose event still names it (see [`Entry::named_by`]) its
/// document, ready and due now, at claim generation 0 (or charged, see [`Charge`]), and takes
/// the handler out of the list, in one transaction. Repeating it changes nothing.
///
/// Whatever racing fan-outs, failures and crashes left in lanes' lists, it never writes a
/// second document for an event and handler: entries naming the same one are made once, and
/// one that has a document already (the unique `(eventId, handler)` index would refuse the
/// batch, for good) only leaves the list.
///
/// A takeover's entry whose event is still unfanned was handed out by a fan-out that has not
/// committed: dead with its host, or still on its way, from a holder whose lease lapsed while
/// it was held up (a failover, say). Dropped from its lane unmaterialized, it would be lost
/// should that fan-out commit after all. So the takeover names the event suspect for the
/// entry's handler ([`fence`]) in its transaction: a fan-out transaction that marked the event
/// makes this one conflict, and it is tried again until that one ended (a dead host's is
/// ended by the live hosts, see `hosts`), then finds the event marked, or not; a fan-out
/// that marks it later conflicts with this write, or, if it starts after it, finds the
/// handler named (a mark never hands out to a suspect handler, see `fan_out::mark_statements`).
pub(super) async fn materialize(store: &MongoStore, entries: &[Entry], charge: Charge, now: DateTime) -> Result<(), StoreError> {
    if entries.is_empty() {
        return Ok(());
    }
    transaction!(store, |tx| {
        let session = tx.session();
        let ids: Vec<Bson> = entries.iter().map(|entry| entry.event.clone()).collect();
        let (events, deliveries) = (&store.collections.events, &store.collections.deliveries);
        let projection =
            doc! { field::ID: 1, field::TYPE: 1, field::SEQUENCE: 1, field::HANDED_OUT: 1, field::FAN_OUT: 1, field::FANNED_OUT_AT: 1 };
        let events = read_in(session, events, doc! { field::ID: { "$in": &ids } }, projection, entries.len()).await?;
        let events: HashMap<String, &Document> =
            events.iter().map(|event| (id_text(event.get(field::ID).unwrap_or(&Bson::Null)), event)).collect();
        let filter = doc! { delivery::EVENT_ID: { "$in": &ids } };
        let projection = doc! { delivery::EVENT_ID: 1, delivery::HANDLER: 1 };
        let existing = read_in(session, deliveries, filter, projection, entries.len()).await?;
        let mut made: HashSet<(String, String)> = existing
            .iter()
            .map(|d| {
                let event = id_text(d.get(delivery::EVENT_ID).unwrap_or(&Bson::Null));
                (event, d.get_str(delivery::HANDLER).unwrap_or_default().to_string())
            })
            .collect();
        let mut statements = Vec::new();
        let mut documents = Vec::new();
        let mut unlisted = Vec::new();
        for entry in entries {
            let found = events.get(&id_text(&entry.event));
            let Some(event) = found.filter(|event| entry.named_by(event)) else {
                if charge == Charge::Takeover && found.is_some_and(|event| unfanned(event)) {
                    // Its fan-out has not committed, and may still: this write is what stops it.
                    statements.push(fence(entry));
                }
                unlisted.push(entry.clone());
                continue;
            };
            let pull = doc! { "q": entry.event_filter(), "u": { "$pull": { field::HANDED_OUT: &entry.handler } } };
            if !made.insert((id_text(&entry.event), entry.handler.clone())) {
                // Another entry of the same delivery, or one that has its document already.
                tracing::warn!(
                    delivery = %entry.delivery,
                    event = %id_text(&entry.event),
                    handler = %entry.handler,
                    "a delivery handed out without a document is listed twice, or has a document already; it is given one document",
                );
                statements.push(pull);
                continue;
            }
            statements.push(pull);
            let new = NewDelivery {
                id: entry.delivery,
                event_id: entry.event.clone(),
                event_type: event.get_str(field::TYPE).unwrap_or_default().to_string(),
                handler: entry.handler.clone(),
                key: entry.key.clone(),
                sequence: Entry::sequence_of(event),
                group: None,
                priority: None,
                lane: entry.lane(),
                dead_reason: None,
                behind: None,
                suspect: false,
            };
            let mut document = new_delivery_document(&new, now);
            if charge == Charge::Takeover {
                document.insert(delivery::CLAIMS, 1_i64);
                if entry.started {
                    document.insert(delivery::ATTEMPTS, 1_i32);
                    document.insert(delivery::LAST_ERROR, LOST_WHILE_RUNNING);
                } else {
                    document.insert(delivery::SUSPECT, true);
                }
            }
            documents.push(document);
        }
        // The snapshot may not hold the fan-out that listed them yet (its commit is acknowledged
        // once applied): one the latest data still lists is not settled, and must not be lost.
        if !unfinished(store, &unlisted).await?.is_empty() {
            return Err(StoreError::SnapshotBehind("a delivery without a document to materialize".into()));
        }
        if !statements.is_empty() {
            generations::update_each(store, store.collections.events.name(), statements, WriteIn::Transaction(&mut *session))
                .await?;
        }
        if !documents.is_empty() {
            store.collections.deliveries.insert_many(documents).session(&mut *session).await?;
        }
        Ok(())
    })
}

/// Whether `event` (its document) is not fanned out.
fn unfanned(event: &Document) -> bool {
    matches!(event.get(field::FANNED_OUT_AT), None | Some(Bson::Null))
}

/// The statement that names the entry's handler among its event's suspects while the event
/// is unfanned (see [`materialize`]).
fn fence(entry: &Entry) -> Document {
    doc! {
        "q": { field::ID: entry.event.clone(), field::FANNED_OUT_AT: Bson::Null },
        "u": { "$addToSet": { field::SUSPECTS: &entry.handler } },
    }
}

/// The documents `filter` matches in `collection`, read in `session`'s transaction (about
/// `expected` of them, in one batch).
async fn read_in(
    session: &mut ClientSession,
    collection: &mongodb::Collection<Document>,
    filter: Document,
    projection: Document,
    expected: usize,
) -> Result<Vec<Document>, StoreError> {
    let found = collection
        .find(filter)
        .projection(projection)
        .batch_size(super::documents::one_batch(expected))
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?;
    Ok(found)
}

/// Completes `entries`: takes each handler out of its event's list and stamps the event (in
/// `session`'s transaction if given, which completes one). One statement per handler in one
/// command: each statement of a write command is planned and run on its own, so one per
/// event would cost more than the writes. Returns the deliveries it completed; one whose
/// handler had left the list was materialized by a takeover first, and is not.
pub(super) async fn complete(
    store: &MongoStore,
    entries: &[Entry],
    session: Option<&mut ClientSession>,
    now: DateTime,
) -> Result<HashSet<ObjectId>, StoreError> {
    let mut completed: HashSet<ObjectId> = entries.iter().map(|entry| entry.delivery).collect();
    if let Some(session) = session {
        // A miss here may be a snapshot behind the fan-out: the caller checks (`complete_in`).
        if completion(store, entries, WriteIn::Transaction(session), now).await? < entries.len() as u64 {
            completed.clear();
        }
        return Ok(completed);
    }
    // In a transaction of its own all the same: `mongod` then writes the batch's oplog as one
    // entry at the commit instead of one per event, which made a completion about two fifths
    // cheaper (measured).
    let mut changed = transaction!(store, |tx| completion(store, entries, WriteIn::Transaction(tx.session()), now).await)?;
    if changed < entries.len() as u64 {
        // The transaction's snapshot may have been behind a fan-out that listed some (its
        // commit is acknowledged once applied): those the latest data still lists are
        // completed by a plain update.
        let behind = unfinished(store, entries).await?;
        let behind: Vec<Entry> = entries.iter().filter(|entry| behind.contains(&entry.delivery)).cloned().collect();
        changed += completion(store, &behind, WriteIn::Alone(Commit::Majority), now).await?;
    }
    if changed < entries.len() as u64 {
        // A takeover materialized some between the lane check and this: those have their
        // document now (one whose document is gone again was completed by its new holder
        // after running again: completed either way).
        forget_stored(store, &mut completed).await?;
    }
    Ok(completed)
}

/// The statements of [`complete`]; returns how many events they changed.
async fn completion(store: &MongoStore, entries: &[Entry], write_in: WriteIn<'_>, now: DateTime) -> Result<u64, StoreError> {
    let mut by_handler: BTreeMap<&str, Vec<Bson>> = BTreeMap::new();
    for entry in entries {
        by_handler.entry(&entry.handler).or_default().push(entry.event.clone());
    }
    let statements: Vec<Document> = by_handler
        .into_iter()
        .map(|(handler, ids)| {
            doc! {
                "q": { field::ID: { "$in": ids }, field::HANDED_OUT: handler },
                "u": { "$pull": { field::HANDED_OUT: handler }, "$max": { field::COMPLETED_AT: now } },
                "multi": true,
                "hint": { field::ID: 1 },
            }
        })
        .collect();
    generations::update_each(store, store.collections.events.name(), statements, write_in).await
}

/// Those of `entries` that are still unfinished: their event still lists their handler.
pub(super) async fn unfinished(store: &MongoStore, entries: &[Entry]) -> Result<HashSet<DeliveryId>, StoreError> {
    if entries.is_empty() {
        return Ok(HashSet::new());
    }
    let ids: Vec<Bson> = entries.iter().map(|entry| entry.event.clone()).collect();
    let events: Vec<Document> = store
        .collections
        .events
        .find(doc! { field::ID: { "$in": ids }, field::HANDED_OUT: { "$exists": true } })
        .projection(doc! { field::ID: 1, field::HANDED_OUT: 1, field::FAN_OUT: 1 })
        .batch_size(super::documents::one_batch(entries.len()))
        .await?
        .try_collect()
        .await?;
    let events: HashMap<String, &Document> =
        events.iter().map(|event| (id_text(event.get(field::ID).unwrap_or(&Bson::Null)), event)).collect();
    Ok(entries
        .iter()
        .filter(|entry| events.get(&id_text(&entry.event)).is_some_and(|event| entry.named_by(event)))
        .map(|entry| entry.delivery)
        .collect())
}

/// Takes out of `completed` the deliveries that have a document: a completion that changed
/// fewer documents than it meant to lost those to a takeover.
pub(super) async fn forget_stored(store: &MongoStore, completed: &mut HashSet<ObjectId>) -> Result<(), StoreError> {
    let ids: Vec<ObjectId> = completed.iter().copied().collect();
    let left: Vec<Document> = store
        .collections
        .deliveries
        .find(doc! { delivery::ID: { "$in": ids } })
        .projection(doc! { delivery::ID: 1 })
        .hint(super::by_id())
        .await?
        .try_collect()
        .await?;
    for document in &left {
        if let Ok(id) = document.get_object_id(delivery::ID) {
            completed.remove(&id);
        }
    }
    Ok(())
}
