//! Operator reads and retention in MongoDB: statistics, listing (with what the live leases
//! list), an event's history, who holds what (hosts and lanes), and the purge (its preview,
//! its steps resting as `purge_pace` says, and the counters of keys none of whose events
//! remain). Every input from an operator reaches a query only as a literal string or ObjectId.

use std::collections::{BTreeMap, HashSet};

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::ClientSession;

use super::MongoStore;
use super::documents::{self, delivery, history, lane, lane_state};
use crate::event::field;
use crate::store::claim::{ClaimBackend, InFlight};
use crate::store::retention::earliest_cutoff;
use crate::store::{
    DeliveryFilter, DeliveryPage, DeliveryView, HandlerStatistics, PurgeOptions, PurgeReport, StoreError,
};

/// The filter of events that may go once nothing references them (see
/// [`crate::store::retention::event_expired`], which states the same rule for one document).
fn expired_events(options: &PurgeOptions) -> Option<Document> {
    let mut alternatives = Vec::new();
    if let Some(cutoff) = options.completed_before {
        alternatives.push(doc! { field::COMPLETED_AT: { "$lt": cutoff } });
    }
    if let Some(cutoff) = earliest_cutoff(options) {
        alternatives.push(doc! { field::COMPLETED_AT: { "$exists": false }, field::CREATED_AT: { "$lt": cutoff } });
        alternatives.push(doc! { field::COMPLETED_AT: { "$exists": false }, field::CREATED_AT: { "$not": { "$type": "date" } } });
    }
    // An event still listing a handler in `handedOut` has a delivery running without a
    // document, which nothing else would show.
    let handed_out = format!("{}.0", field::HANDED_OUT);
    (!alternatives.is_empty())
        .then(|| doc! { field::FANNED_OUT_AT: { "$type": "date" }, handed_out: { "$exists": false }, "$or": alternatives })
}

/// Deletes, in `session`, those of `candidates` that are expired and referenced by no
/// delivery and no history record, and the counters of their keys once no event of a key
/// remains; returns how many events and counters. A fan-out writing one of them conflicts
/// with this.
async fn delete_unreferenced(
    store: &MongoStore,
    session: &mut ClientSession,
    candidates: Vec<Bson>,
    expired: &Document,
) -> Result<(u64, u64), StoreError> {
    if candidates.is_empty() {
        return Ok((0, 0));
    }
    let mut referenced: HashSet<String> = HashSet::new();
    for collection in [&store.collections.deliveries, &store.collections.history] {
        let ids = collection
            .distinct(delivery::EVENT_ID, doc! { delivery::EVENT_ID: { "$in": &candidates } })
            .session(&mut *session)
            .await?;
        referenced.extend(ids.iter().map(crate::store::fan_out::id_text));
    }
    let doomed: Vec<Bson> =
        candidates.into_iter().filter(|id| !referenced.contains(&crate::store::fan_out::id_text(id))).collect();
    if doomed.is_empty() {
        return Ok((0, 0));
    }
    let mut filter = expired.clone();
    filter.insert("_id", doc! { "$in": doomed });
    let keys: Vec<Bson> = store
        .collections
        .events
        .distinct(field::KEY, doc! { "$and": [filter.clone(), { field::KEY: { "$exists": true } }] })
        .session(&mut *session)
        .await?;
    let deleted = store.collections.events.delete_many(filter).session(&mut *session).await?.deleted_count;
    let counters = delete_unused_key_counters(store, session, keys).await?;
    Ok((deleted, counters))
}

/// Deletes the counters of `keys` of which no event remains. A publisher taking a key's next
/// sequence meanwhile writes the same counter and conflicts with this, so a counter is only
/// ever deleted when no event of its key exists or is being published: the key starts again
/// at 1 with nothing of it left to order against.
async fn delete_unused_key_counters(store: &MongoStore, session: &mut ClientSession, keys: Vec<Bson>) -> Result<u64, StoreError> {
    if keys.is_empty() {
        return Ok(0);
    }
    let remaining: HashSet<String> = store
        .collections
        .events
        .distinct(field::KEY, doc! { field::KEY: { "$in": &keys } })
        .session(&mut *session)
        .await?
        .iter()
        .filter_map(|key| key.as_str().map(str::to_string))
        .collect();
    let unused: Vec<Bson> = keys.into_iter().filter(|key| key.as_str().is_some_and(|key| !remaining.contains(key))).collect();
    if unused.is_empty() {
        return Ok(0);
    }
    Ok(store.collections.key_sequences.delete_many(doc! { "_id": { "$in": unused } }).session(&mut *session).await?.deleted_count)
}

/// Deletes one batch of `(deliveries or history)` documents and then the events they alone
/// referenced (with their keys' unused counters), in one transaction: how many of each, and
/// how many documents the batch found.
async fn purge_batch(
    store: &MongoStore,
    from_history: bool,
    filter: Document,
    expired: Option<&Document>,
) -> Result<(u64, (u64, u64), usize), StoreError> {
    let collection = if from_history { &store.collections.history } else { &store.collections.deliveries };
    let batch_size = store.options.purge_batch_size.max(1);
    transaction!(store, |tx| {
        let session = tx.session();
        let batch: Vec<Document> = collection
            .find(filter.clone())
            .projection(doc! { "_id": 1, delivery::EVENT_ID: 1 })
            .limit(batch_size as i64)
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        if batch.is_empty() {
            return Ok((0, (0, 0), 0));
        }
        let ids: Vec<Bson> = batch.iter().filter_map(|d| d.get("_id").cloned()).collect();
        let deleted = collection.delete_many(doc! { "_id": { "$in": ids } }).session(&mut *session).await?.deleted_count;
        let events = match expired {
            Some(expired) => {
                let event_ids: Vec<Bson> = batch.iter().filter_map(|d| d.get(delivery::EVENT_ID).cloned()).collect();
                delete_unreferenced(store, session, event_ids, expired).await?
            }
            None => (0, 0),
        };
        Ok((deleted, events, batch.len()))
    })
}

/// Rests after a purge step that took `took`, as the store's `purge_pace` says.
async fn rest(store: &MongoStore, took: std::time::Duration) {
    let pace = store.options.purge_pace.clamp(0.01, 1.0);
    if pace < 1.0 {
        tokio::time::sleep(took.mul_f64((1.0 - pace) / pace)).await;
    }
}

pub(super) async fn purge(store: &MongoStore, options: &PurgeOptions, _now: DateTime) -> Result<PurgeReport, StoreError> {
    let mut report = PurgeReport::default();
    let expired = expired_events(options);
    let batch_size = store.options.purge_batch_size.max(1);
    if let Some(cutoff) = options.dead_before {
        loop {
            let filter = doc! { delivery::STATUS: delivery::DEAD, delivery::UPDATED_AT: { "$lt": cutoff } };
            let step = std::time::Instant::now();
            let (deleted, (events, counters), seen) = purge_batch(store, false, filter, expired.as_ref()).await?;
            rest(store, step.elapsed()).await;
            report.dead_deliveries += deleted;
            report.events += events;
            report.key_counters += counters;
            if seen < batch_size {
                break;
            }
        }
    }
    if let Some(cutoff) = options.completed_before {
        loop {
            let filter = doc! { history::COMPLETED_AT: { "$lt": cutoff } };
            let step = std::time::Instant::now();
            let (deleted, (events, counters), seen) = purge_batch(store, true, filter, expired.as_ref()).await?;
            rest(store, step.elapsed()).await;
            report.history_records += deleted;
            report.events += events;
            report.key_counters += counters;
            if seen < batch_size {
                break;
            }
        }
    }
    // Then every other expired event nothing references, walking `(createdAt, _id)` once.
    if let Some(expired) = expired {
        let mut after: Option<(Bson, Bson)> = None;
        loop {
            let mut filter = expired.clone();
            if let Some((created, id)) = &after {
                filter = doc! { "$and": [filter, { "$or": [
                    { field::CREATED_AT: { "$gt": created.clone() } },
                    { field::CREATED_AT: created.clone(), "_id": { "$gt": id.clone() } },
                ] }] };
            }
            let step = std::time::Instant::now();
            let batch: Vec<Document> = store
                .collections
                .events
                .find(filter)
                .sort(doc! { field::CREATED_AT: 1, "_id": 1 })
                // In index order, never a sort of what another index offered; by name, since
                // `unfanned` has the same keys (and none of the events this looks for).
                .hint(mongodb::options::Hint::Name(super::setup::CREATED.into()))
                .projection(doc! { "_id": 1, field::CREATED_AT: 1 })
                .limit(batch_size as i64)
                .await?
                .try_collect()
                .await?;
            let Some(last) = batch.last() else { break };
            after = Some((last.get(field::CREATED_AT).cloned().unwrap_or(Bson::Null), last.get("_id").cloned().unwrap_or(Bson::Null)));
            let ids: Vec<Bson> = batch.iter().filter_map(|d| d.get("_id").cloned()).collect();
            let (events, counters) = transaction!(store, |tx| {
                delete_unreferenced(store, tx.session(), ids.clone(), &expired).await
            })?;
            report.events += events;
            report.key_counters += counters;
            rest(store, step.elapsed()).await;
            if batch.len() < batch_size {
                break;
            }
        }
    }
    Ok(report)
}

/// What [`purge`] would delete, counted: the dead deliveries and history records past their
/// cutoffs, and the events past theirs (of which those still referenced stay).
pub(super) async fn purge_preview(store: &MongoStore, options: &PurgeOptions, _now: DateTime) -> Result<PurgeReport, StoreError> {
    let mut report = PurgeReport::default();
    if let Some(cutoff) = options.dead_before {
        let filter = doc! { delivery::STATUS: delivery::DEAD, delivery::UPDATED_AT: { "$lt": cutoff } };
        report.dead_deliveries = store.collections.deliveries.count_documents(filter).await?;
    }
    if let Some(cutoff) = options.completed_before {
        report.history_records = store.collections.history.count_documents(doc! { history::COMPLETED_AT: { "$lt": cutoff } }).await?;
    }
    if let Some(expired) = expired_events(options) {
        report.events = store.collections.events.count_documents(expired).await?;
    }
    Ok(report)
}

pub(super) async fn statistics(store: &MongoStore, now: DateTime) -> Result<Vec<HandlerStatistics>, StoreError> {
    let rows: Vec<Document> = store
        .collections
        .deliveries
        .aggregate(vec![doc! { "$group": {
            "_id": { "h": "$handler", "s": "$status", "l": "$lane" },
            "n": { "$sum": 1 },
            "due": { "$min": "$dueAt" },
        } }])
        .await?
        .try_collect()
        .await?;
    let mut by_handler: BTreeMap<String, HandlerStatistics> = BTreeMap::new();
    for row in &rows {
        let group = row.get_document("_id").map_err(|_| StoreError::Corrupt(format!("statistics row {row}")))?;
        let handler = group.get_str("h").unwrap_or_default().to_string();
        let count = match row.get("n") {
            Some(Bson::Int32(n)) => *n as u64,
            Some(Bson::Int64(n)) => *n as u64,
            _ => 0,
        };
        let stats = by_handler
            .entry(handler.clone())
            .or_insert_with(|| HandlerStatistics { handler, ..Default::default() });
        if group.get_str("s") == Ok(delivery::DEAD) {
            stats.dead += count;
            continue;
        }
        stats.pending += count;
        if group.get_str("l") == Ok(delivery::PARKED) {
            stats.parked += count;
        }
        if let Ok(due) = row.get_datetime("due") {
            stats.oldest_due_at = Some(stats.oldest_due_at.map_or(*due, |at| at.min(*due)));
        }
    }
    // Running: listed by a live lease and still at the listed claim generation.
    let lanes: Vec<Document> = store
        .collections
        .lanes
        .find(doc! { lane::OWNER: { "$ne": Bson::Null }, lane::LEASE_EXPIRES_AT: { "$gte": now } })
        .await?
        .try_collect()
        .await?;
    let mut entries: Vec<InFlight> = Vec::new();
    for document in &lanes {
        entries.extend(lane_state(document)?.in_flight);
    }
    if !entries.is_empty() {
        let current = super::lanes::Backend { store }.current(&entries).await?;
        for entry in entries.iter().filter(|e| current.contains(&e.delivery)) {
            let handler = entry.handler.clone();
            let stats = by_handler.entry(handler.clone()).or_insert_with(|| HandlerStatistics { handler, ..Default::default() });
            stats.running += 1;
            // One without a document was not counted as pending above.
            if entry.unstored.is_none() {
                stats.pending = stats.pending.saturating_sub(1);
            }
        }
    }
    if store.options.completion_history {
        let rows: Vec<Document> = store
            .collections
            .history
            .aggregate(vec![doc! { "$group": { "_id": "$handler", "n": { "$sum": 1 } } }])
            .await?
            .try_collect()
            .await?;
        for row in &rows {
            let handler = row.get_str("_id").unwrap_or_default().to_string();
            let count = row.get_i32("n").map(|n| n as u64).unwrap_or(0);
            by_handler
                .entry(handler.clone())
                .or_insert_with(|| HandlerStatistics { handler, ..Default::default() })
                .completed = Some(count);
        }
        for stats in by_handler.values_mut() {
            stats.completed.get_or_insert(0);
        }
    }
    Ok(by_handler.into_values().collect())
}

pub(super) async fn list_deliveries(store: &MongoStore, filter: &DeliveryFilter) -> Result<DeliveryPage, StoreError> {
    let limit = filter.page_limit();
    let mut query = Document::new();
    if let Some(status) = filter.status {
        query.insert(delivery::STATUS, status.as_str());
    }
    // Literal strings only: `Bson::String` can never be read as a query operator.
    for (field, value) in [
        (delivery::HANDLER, &filter.handler),
        (delivery::EVENT_TYPE, &filter.event_type),
        (delivery::EVENT_ID, &filter.event_id),
        (delivery::KEY, &filter.key),
    ] {
        if let Some(value) = value {
            query.insert(field, Bson::String(value.clone()));
        }
    }
    if let Some(parked) = filter.parked {
        query.insert(delivery::LANE, if parked { doc! { "$eq": delivery::PARKED } } else { doc! { "$ne": delivery::PARKED } });
    }
    if let Some(before) = filter.created_before {
        query.insert(delivery::CREATED_AT, doc! { "$lt": before });
    }
    let running = listed_by_live_leases(store, DateTime::now()).await?;
    let mut by_id = Document::new();
    if let Some(after) = filter.after_id()? {
        by_id.insert("$gt", after);
    }
    match filter.running {
        Some(true) => by_id.insert("$in", running.iter().map(|id| Bson::ObjectId(*id)).collect::<Vec<_>>()),
        Some(false) => by_id.insert("$nin", running.iter().map(|id| Bson::ObjectId(*id)).collect::<Vec<_>>()),
        None => None,
    };
    if !by_id.is_empty() {
        query.insert(delivery::ID, by_id);
    }
    let rows: Vec<Document> = store
        .collections
        .deliveries
        .find(query)
        .sort(doc! { delivery::ID: 1 })
        .limit(limit as i64 + 1)
        .await?
        .try_collect()
        .await?;
    let deliveries = rows
        .iter()
        .map(|row| documents::view(row).map(|view| DeliveryView { running: row.get_object_id(delivery::ID).is_ok_and(|id| running.contains(&id)), ..view }))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(DeliveryPage::from_overfetch(deliveries, limit))
}

pub(super) async fn membership(store: &MongoStore, now: DateTime) -> Result<crate::store::Membership, StoreError> {
    let hosts: Vec<Document> = store
        .collections
        .hosts
        .find(doc! { "expiresAt": { "$gt": now } })
        .projection(doc! { "_id": 1, "expiresAt": 1 })
        .await?
        .try_collect()
        .await?;
    let hosts = hosts.iter().filter_map(|h| Some((h.get_str("_id").ok()?.to_string(), *h.get_datetime("expiresAt").ok()?))).collect();
    let lanes: Vec<Document> = store.collections.lanes.find(doc! {}).sort(doc! { lane::ID: 1 }).await?.try_collect().await?;
    let lanes = lanes
        .iter()
        .map(|document| {
            let state = lane_state(document)?;
            let live = state.lease_expires_at > now;
            Ok(crate::store::LaneView {
                lane: state.id,
                holder: state.owner.clone().zip(state.instance.clone()).filter(|_| live).map(|(owner, instance)| format!("{owner}/{instance}")),
                lease_expires_at: state.lease_expires_at,
                epoch: state.epoch,
                in_flight: if live { state.in_flight.len() } else { 0 },
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(crate::store::Membership { hosts, lanes })
}

pub(super) async fn event_history(store: &MongoStore, event_id: &str) -> Result<crate::store::EventHistory, StoreError> {
    let id = Bson::String(event_id.to_string());
    let event = store.collections.events.find_one(doc! { "_id": { "$eq": &id } }).await?;
    let records: Vec<Document> = store
        .collections
        .history
        .find(doc! { delivery::EVENT_ID: { "$eq": &id } })
        .sort(doc! { history::COMPLETED_AT: 1 })
        .await?
        .try_collect()
        .await?;
    let completions = records
        .iter()
        .filter_map(|r| Some((r.get_str(delivery::HANDLER).ok()?.to_string(), *r.get_datetime(history::COMPLETED_AT).ok()?)))
        .collect();
    Ok(crate::store::EventHistory { event, completions })
}

/// The deliveries the lanes' live leases list (running, or claimed ahead of a run slot).
pub(super) async fn listed_by_live_leases(store: &MongoStore, now: DateTime) -> Result<HashSet<bson::oid::ObjectId>, StoreError> {
    let lanes: Vec<Document> = store
        .collections
        .lanes
        .find(doc! { lane::LEASE_EXPIRES_AT: { "$gt": now } })
        .projection(doc! { lane::IN_FLIGHT: 1 })
        .await?
        .try_collect()
        .await?;
    Ok(lanes
        .iter()
        .filter_map(|l| l.get_array(lane::IN_FLIGHT).ok())
        .flatten()
        .filter_map(|entry| entry.as_document()?.get_object_id(documents::entry::DELIVERY).ok())
        .collect())
}

/// The events a backfill of `handler` may reopen, or, `waiting`, those that wait for a run
/// (see [`crate::store::backfill::backfill_of`], the rule this filter says).
fn reopenable(handler: &str, types: &[String], since: Option<DateTime>, waiting: bool) -> Document {
    let mut filter = doc! {
        field::TYPE: { "$in": types },
        field::FANNED_OUT_AT: { "$type": "date" },
        field::HANDLERS: { "$ne": handler },
        format!("{}.0", field::HANDED_OUT): { "$exists": waiting },
    };
    if let Some(since) = since {
        filter.insert(field::CREATED_AT, doc! { "$gte": since });
    }
    filter
}

pub(super) async fn reopen_for(
    store: &MongoStore,
    handler: &str,
    types: &[String],
    since: Option<DateTime>,
    limit: usize,
) -> Result<Vec<Bson>, StoreError> {
    let filter = reopenable(handler, types, since, false);
    let found: Vec<Document> = store
        .collections
        .events
        .find(filter.clone())
        .sort(doc! { field::CREATED_AT: 1, field::ID: 1 })
        .limit(i64::try_from(limit).unwrap_or(i64::MAX))
        .projection(doc! { field::ID: 1 })
        .await?
        .try_collect()
        .await?;
    let ids: Vec<Bson> = found.iter().filter_map(|event| event.get(field::ID).cloned()).collect();
    if ids.is_empty() {
        return Ok(ids);
    }
    // The rule again in the update: an event fanned out anew meanwhile is left as it is.
    let mut update = filter;
    update.insert(field::ID, doc! { "$in": ids.clone() });
    store.collections.events.update_many(update, doc! { "$unset": { field::FANNED_OUT_AT: "", field::FAN_OUT: "" } }).await?;
    Ok(ids)
}

pub(super) async fn backfill_waiting(store: &MongoStore, handler: &str, types: &[String], since: Option<DateTime>) -> Result<usize, StoreError> {
    Ok(store.collections.events.count_documents(reopenable(handler, types, since, true)).await? as usize)
}

pub(super) async fn unfanned_among(store: &MongoStore, events: &[Bson]) -> Result<usize, StoreError> {
    let filter = doc! { field::ID: { "$in": events }, field::FANNED_OUT_AT: Bson::Null };
    Ok(store.collections.events.count_documents(filter).await? as usize)
}
