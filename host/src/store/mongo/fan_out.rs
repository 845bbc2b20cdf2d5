//! Fan-out in MongoDB: one transaction reads a batch of unfanned events (completed per key,
//! see [`crate::store::fan_out`]), inserts their deliveries and marks them fanned out. Two
//! hosts fanning out the same event both write it, so one of them conflicts and, on retry,
//! no longer sees it as unfanned.
//!
//! The commit is acknowledged once applied, without waiting for the journal or a majority:
//! nothing is handed out from a fan-out before the claim's lane record, a majority write made
//! later on the same primary, and a majority-committed oplog entry makes every earlier one
//! durable too. Should a crash or a failover lose a fan-out first, its events are unfanned
//! again and the next fan-out makes their deliveries anew. That takes one journal flush (about
//! 2 ms here) off the path from commit to handler.

use std::collections::BTreeMap;

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;

use super::{Commit, MongoStore, generations};
use super::documents::new_delivery_document;
use crate::event::field;
use crate::store::fan_out;
use crate::store::{FanOutReport, StoreError, Subscriptions};

pub(super) async fn run(
    store: &MongoStore,
    subscriptions: &Subscriptions,
    limit: usize,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    if limit == 0 {
        return Ok(FanOutReport::default());
    }
    let events = &store.collections.events;
    let deliveries = &store.collections.deliveries;
    transaction!(store, Commit::Applied, |tx| {
        let session = tx.session();
        let first: Vec<Document> = events
            .find(doc! { field::FANNED_OUT_AT: Bson::Null })
            .sort(doc! { field::FANNED_OUT_AT: 1, field::CREATED_AT: 1, field::ID: 1 })
            .limit(limit as i64)
            .batch_size(super::outcome::one_batch(limit))
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        if first.is_empty() {
            return Ok(FanOutReport::default());
        }
        let keys = fan_out::keys_of(&first);
        let prefixes: Vec<Document> = if keys.is_empty() {
            Vec::new()
        } else {
            events
                .find(doc! { field::KEY: { "$in": &keys }, field::FANNED_OUT_AT: Bson::Null })
                .sort(doc! { field::KEY: 1, field::FANNED_OUT_AT: 1, field::SEQUENCE: 1 })
                .limit(limit.saturating_mul(4) as i64)
                .batch_size(super::outcome::one_batch(limit.saturating_mul(4)))
                .session(&mut *session)
                .await?
                .stream(&mut *session)
                .try_collect()
                .await?
        };
        let batch = fan_out::assemble(first, prefixes);
        let plan = fan_out::plan(&batch, subscriptions);
        if !plan.deliveries.is_empty() {
            let documents: Vec<Document> = plan.deliveries.iter().map(|d| new_delivery_document(d, now)).collect();
            deliveries.insert_many(documents).session(&mut *session).await?;
        }
        // One statement per distinct resulting list (in practice: per event type), all in one
        // command, so a batch of many types costs one round trip too. The lists were read in
        // this transaction, so a concurrent change of one conflicts with this write; a
        // malformed `handlers` field is replaced by the readable part of it.
        let mut by_handlers: BTreeMap<Vec<String>, Vec<Bson>> = BTreeMap::new();
        for event in &plan.events {
            by_handlers.entry(event.handlers.clone()).or_default().push(event.id.clone());
        }
        let statements = by_handlers
            .into_iter()
            .map(|(handlers, ids)| {
                doc! {
                    "q": { field::ID: { "$in": ids }, field::FANNED_OUT_AT: Bson::Null },
                    "u": { "$set": { field::FANNED_OUT_AT: now, field::HANDLERS: handlers } },
                    "multi": true,
                    "hint": { field::ID: 1 },
                }
            })
            .collect();
        generations::update_each(store, events.name(), statements, Some(&mut *session)).await?;
        Ok(plan.report())
    })
}
