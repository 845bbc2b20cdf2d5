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

use mongodb::ClientSession;

use super::{Commit, MongoStore, generations, lanes};
use super::documents::new_delivery_document;
use crate::event::field;
use crate::store::fan_out::{self, FanOutPlan};
use crate::store::{FanOutReport, StoreError, StoreTransaction, Subscriptions};

pub(super) async fn run(
    store: &MongoStore,
    subscriptions: &Subscriptions,
    limit: usize,
    hand_out: usize,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    if limit == 0 {
        return Ok(FanOutReport::default());
    }
    if hand_out > 0 {
        match handing_out(store, subscriptions, limit, hand_out, now).await {
            // Another fan-out wrote the same events first: the retrying path sorts it out.
            Err(error) if error.is_transient() => {}
            done => return done,
        }
    }
    transaction!(store, Commit::Applied, |tx| {
        let batch = read_batch(store, tx.session(), limit).await?;
        let plan = fan_out::plan(&batch, subscriptions);
        write(store, tx.session(), &plan, now).await?;
        Ok(plan.report(Vec::new()))
    })
}

/// One fan-out transaction that hands out what it creates (see [`Claimer::hand_out`]): the
/// lane lists are written (a majority write) while the deliveries are. Tried once: an error
/// aborts it, and a conflict leaves the batch to the retrying path.
///
/// Its commit too is acknowledged once applied. A handed-out delivery may then start before
/// its fan-out is durable; should a failover lose the fan-out, its events are fanned out and
/// run again, which at-least-once allows. A transactional handler's completion cannot commit
/// without it: it deletes the delivery the fan-out inserted, later in the same oplog.
///
/// [`Claimer::hand_out`]: crate::store::claim::Claimer::hand_out
async fn handing_out(
    store: &MongoStore,
    subscriptions: &Subscriptions,
    limit: usize,
    hand_out: usize,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    let mut tx = store.begin_with(Commit::Applied).await?;
    let batch = match read_batch(store, tx.session(), limit).await {
        Ok(batch) => batch,
        Err(error) => {
            let _ = tx.abort().await;
            return Err(error);
        }
    };
    let plan = fan_out::plan(&batch, subscriptions);
    let fresh = fan_out::fresh(&plan, &batch, hand_out, now);
    let written = &plan;
    let commit = async move {
        match write(store, tx.session(), written, now).await {
            Ok(()) => tx.commit().await,
            Err(error) => {
                let _ = tx.abort().await;
                Err(error)
            }
        }
    };
    let ((), claimed) = store.claimer.hand_out(&lanes::Backend { store }, fresh, commit, now).await?;
    Ok(plan.report(claimed))
}

/// A batch of unfanned events: the oldest, completed by the lowest unfanned events of every
/// key among them (see [`crate::store::fan_out`]).
async fn read_batch(store: &MongoStore, session: &mut ClientSession, limit: usize) -> Result<Vec<Document>, StoreError> {
    let events = &store.collections.events;
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
        return Ok(first);
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
    Ok(fan_out::assemble(first, prefixes))
}

/// Inserts the plan's deliveries and marks its events fanned out.
async fn write(store: &MongoStore, session: &mut ClientSession, plan: &FanOutPlan, now: DateTime) -> Result<(), StoreError> {
    if !plan.deliveries.is_empty() {
        let documents: Vec<Document> = plan.deliveries.iter().map(|d| new_delivery_document(d, now)).collect();
        store.collections.deliveries.insert_many(documents).session(&mut *session).await?;
    }
    if plan.events.is_empty() {
        return Ok(());
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
    generations::update_each(store, store.collections.events.name(), statements, Some(session)).await?;
    Ok(())
}
