//! Deliveries a fan-out handed out without writing a document for them (see
//! [`Candidate::unstored`]): the first attempt of an unkeyed event, the common case of a
//! drain, then costs the event's mark and its completion's stamp and no delivery document
//! at all. While it runs, its records are its event's `handedOut` list, which names its
//! handler, and an entry in the in-flight list of a lane its holder holds (any such lane: it
//! is unkeyed), which names its event.
//!
//! This module owns the two ways out of that list. A completion takes the handler out of it
//! (and stamps the event) in one conditional update. Anything else, a failure, a hand-back, a
//! takeover or a check, first *materializes* it: one transaction takes the handler out of the
//! list and inserts the delivery's document at claim generation 0, as a fan-out would have,
//! so that the ordinary fenced outcomes apply from there. Both conditions are on the event
//! document, so of a completion and a materialization only the first changes anything. It
//! must never write a document for a handler the list no longer names (that delivery was
//! completed, or has its document already).
//!
//! [`Candidate::unstored`]: crate::store::claim::Candidate::unstored

use std::collections::{BTreeMap, HashMap, HashSet};

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::ClientSession;

use super::documents::new_delivery_document;
use super::generations::{self, WriteIn};
use super::{Commit, MongoStore};
use crate::event::field;
use crate::lane::{LaneId, lane_for_event};
use crate::store::claim::{EventId, InFlight, Unstored};
use crate::store::fan_out::{NewDelivery, id_text};
use crate::store::{DeliveryId, Lease, StoreError};

/// A delivery without a document, as its lane lists it or its lease says.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub delivery: DeliveryId,
    pub event: Bson,
    pub handler: String,
}

impl Entry {
    pub fn of_lease(lease: &Lease, unstored: Unstored) -> Self {
        Self { delivery: lease.delivery, event: unstored.event.0, handler: unstored.handler }
    }

    /// The unstored ones among lanes' in-flight entries.
    pub fn listed(entries: &[InFlight]) -> Vec<Self> {
        entries
            .iter()
            .filter_map(|entry| {
                let EventId(event) = entry.unstored.clone()?;
                Some(Self { delivery: entry.delivery, event, handler: entry.handler.clone() })
            })
            .collect()
    }

    /// The lane its document goes to. It is unkeyed, so its event's id places it, whichever
    /// lane listed it while it ran (see [`Candidate::unstored`](crate::store::claim::Candidate::unstored)).
    fn lane(&self) -> LaneId {
        lane_for_event(&id_text(&self.event), None)
    }

    /// The filter of its event while the delivery has no document and is not completed.
    fn event_filter(&self) -> Document {
        doc! { field::ID: self.event.clone(), field::HANDED_OUT: &self.handler }
    }
}

/// The handlers an event document's `handedOut` lists.
fn handed_out(event: &Document) -> HashSet<&str> {
    match event.get(field::HANDED_OUT) {
        Some(Bson::Array(handlers)) => handlers.iter().filter_map(Bson::as_str).collect(),
        _ => HashSet::new(),
    }
}

/// Gives each of `entries` whose event still lists its handler its document, at claim
/// generation 0, ready and due now, and takes the handler out of the list, in one
/// transaction. Repeating it changes nothing.
pub(super) async fn materialize(store: &MongoStore, entries: &[Entry], now: DateTime) -> Result<(), StoreError> {
    if entries.is_empty() {
        return Ok(());
    }
    transaction!(store, |tx| {
        let session = tx.session();
        let ids: Vec<Bson> = entries.iter().map(|entry| entry.event.clone()).collect();
        let events: Vec<Document> = store
            .collections
            .events
            .find(doc! { field::ID: { "$in": ids } })
            .projection(doc! { field::ID: 1, field::TYPE: 1, field::HANDED_OUT: 1 })
            .batch_size(super::outcome::one_batch(entries.len()))
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        let events: HashMap<String, &Document> =
            events.iter().map(|event| (id_text(event.get(field::ID).unwrap_or(&Bson::Null)), event)).collect();
        let mut statements = Vec::new();
        let mut documents = Vec::new();
        let mut unlisted = Vec::new();
        for entry in entries {
            let listed = events.get(&id_text(&entry.event)).filter(|event| handed_out(event).contains(entry.handler.as_str()));
            let Some(event) = listed else {
                unlisted.push(entry.clone());
                continue;
            };
            statements.push(doc! { "q": entry.event_filter(), "u": { "$pull": { field::HANDED_OUT: &entry.handler } } });
            let new = NewDelivery {
                id: entry.delivery,
                event_id: entry.event.clone(),
                event_type: event.get_str(field::TYPE).unwrap_or_default().to_string(),
                handler: entry.handler.clone(),
                key: None,
                sequence: None,
                lane: entry.lane(),
                dead_reason: None,
            };
            documents.push(new_delivery_document(&new, now));
        }
        // The snapshot may not hold the fan-out that listed them yet (its commit is acknowledged
        // once applied): one the latest data still lists is not settled, and must not be lost.
        if !unfinished(store, &unlisted).await?.is_empty() {
            return Err(StoreError::SnapshotBehind("a delivery without a document to materialize".into()));
        }
        if documents.is_empty() {
            return Ok(());
        }
        generations::update_each(store, store.collections.events.name(), statements, WriteIn::Transaction(&mut *session))
            .await?;
        store.collections.deliveries.insert_many(documents).session(&mut *session).await?;
        Ok(())
    })
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
        super::outcome::forget_stored(store, &mut completed).await?;
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
        .projection(doc! { field::ID: 1, field::HANDED_OUT: 1 })
        .batch_size(super::outcome::one_batch(entries.len()))
        .await?
        .try_collect()
        .await?;
    let events: HashMap<String, &Document> =
        events.iter().map(|event| (id_text(event.get(field::ID).unwrap_or(&Bson::Null)), event)).collect();
    Ok(entries
        .iter()
        .filter(|entry| events.get(&id_text(&entry.event)).is_some_and(|event| handed_out(event).contains(entry.handler.as_str())))
        .map(|entry| entry.delivery)
        .collect())
}
