//! Reads and writes of deliveries conditional on their claim generation, and batches of
//! update statements sent as one command.
//!
//! A filter `{ $or: [{ _id, claims }, ...] }` looks natural but makes the query planner
//! enumerate a plan per clause: 128 clauses took 350 ms on a collection with the store's
//! indexes. So reads here fetch by `_id: { $in }` and compare the generation in the host,
//! updates send one point statement per delivery in a single `update` command, and deletes
//! one `_id: { $in }` statement per generation in a single `delete` command. This module must
//! never decide what a generation means; it only matches it.

use std::collections::{BTreeMap, HashMap};

use bson::oid::ObjectId;
use bson::{Bson, Document, doc};
use futures::TryStreamExt;
use mongodb::ClientSession;

use super::{Commit, MongoStore};
use super::documents::{self, delivery};
use crate::store::StoreError;

/// The pending deliveries among `pairs` that are still at the listed claim generation.
/// `projection`, when given, must keep `claims`.
pub(super) async fn find_current(
    store: &MongoStore,
    pairs: &[(ObjectId, i64)],
    projection: Option<Document>,
    session: Option<&mut ClientSession>,
) -> Result<Vec<Document>, StoreError> {
    if pairs.is_empty() {
        return Ok(Vec::new());
    }
    let wanted: HashMap<ObjectId, i64> = pairs.iter().copied().collect();
    let ids: Vec<ObjectId> = wanted.keys().copied().collect();
    let options = mongodb::options::FindOptions::builder()
        .projection(projection)
        .hint(super::by_id())
        .batch_size(super::documents::one_batch(pairs.len()))
        .build();
    let find = store
        .collections
        .deliveries
        .find(doc! { delivery::ID: { "$in": ids }, delivery::STATUS: delivery::PENDING })
        .with_options(options);
    let found: Vec<Document> = match session {
        Some(session) => find.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
        None => find.await?.try_collect().await?,
    };
    Ok(found
        .into_iter()
        .filter(|document| {
            let id = document.get_object_id(delivery::ID).ok();
            id.and_then(|id| wanted.get(&id)).is_some_and(|claims| documents::claims(document) == *claims)
        })
        .collect())
}

/// Applies `update` to every pending delivery among `pairs` still at its listed generation,
/// outside any transaction and acknowledged by a majority; returns how many matched.
pub(super) async fn update_current(store: &MongoStore, pairs: &[(ObjectId, i64)], update: &Document) -> Result<u64, StoreError> {
    let statements = pairs
        .iter()
        .map(|(id, claims)| {
            doc! {
                "q": { delivery::ID: *id, delivery::CLAIMS: *claims, delivery::STATUS: delivery::PENDING },
                "u": update.clone(),
                "hint": { "_id": 1 },
            }
        })
        .collect();
    update_each(store, store.collections.deliveries.name(), statements, WriteIn::Alone(Commit::Majority)).await
}

/// Deletes every pending delivery among `pairs` still at its listed generation, in one
/// command acknowledged once applied (a completion: the next delivery of its key runs only
/// after a majority write that follows it); returns how many were deleted.
///
/// One statement per distinct generation, `_id: { $in }` within it: most deliveries of a batch
/// share their generation, and each statement of a write command is planned and executed on
/// its own (one per delivery made the deletes half again as expensive).
pub(super) async fn delete_current(store: &MongoStore, pairs: &[(ObjectId, i64)]) -> Result<u64, StoreError> {
    if pairs.is_empty() {
        return Ok(0);
    }
    let mut by_generation: BTreeMap<i64, Vec<ObjectId>> = BTreeMap::new();
    for (id, claims) in pairs {
        by_generation.entry(*claims).or_default().push(*id);
    }
    let statements: Vec<Document> = by_generation
        .into_iter()
        .map(|(claims, ids)| {
            doc! {
                "q": { delivery::ID: { "$in": ids }, delivery::CLAIMS: claims, delivery::STATUS: delivery::PENDING },
                "limit": 0,
                "hint": { "_id": 1 },
            }
        })
        .collect();
    let collection = store.collections.deliveries.name();
    let command = doc! {
        "delete": collection,
        "deletes": statements,
        "ordered": false,
        "writeConcern": Commit::Applied.write_concern_document(),
    };
    let reply = store.client.database(&store.location.database).run_command(command).await?;
    matched(collection, "delete", &reply)
}

/// Where a raw write command goes.
pub(super) enum WriteIn<'a> {
    /// Into the session's transaction, acknowledged with its commit.
    Transaction(&'a mut ClientSession),
    /// On its own, acknowledged as this says: a raw command does not inherit the collection's
    /// write concern.
    Alone(Commit),
}

/// Sends `{ q, u }` statements as one unordered `update` command; returns how many matched.
pub(super) async fn update_each(
    store: &MongoStore,
    collection: &str,
    statements: Vec<Document>,
    write_in: WriteIn<'_>,
) -> Result<u64, StoreError> {
    if statements.is_empty() {
        return Ok(0);
    }
    let mut command = doc! { "update": collection, "updates": statements, "ordered": false };
    let database = store.client.database(&store.location.database);
    let reply = match write_in {
        WriteIn::Transaction(session) => database.run_command(command).session(session).await?,
        WriteIn::Alone(commit) => {
            command.insert("writeConcern", commit.write_concern_document());
            database.run_command(command).await?
        }
    };
    matched(collection, "update", &reply)
}

/// How many documents a raw write command's `reply` says it matched; its write errors and a
/// missing majority acknowledgement are errors naming `what` of `collection`.
fn matched(collection: &str, what: &str, reply: &Document) -> Result<u64, StoreError> {
    if let Ok(errors) = reply.get_array("writeErrors") {
        return Err(StoreError::Corrupt(format!("{what} of {collection} failed: {errors:?}")));
    }
    if let Ok(error) = reply.get_document("writeConcernError") {
        return Err(StoreError::Corrupt(format!("{what} of {collection} not acknowledged by a majority: {error}")));
    }
    Ok(match reply.get("n") {
        Some(Bson::Int32(n)) => *n as u64,
        Some(Bson::Int64(n)) => *n as u64,
        _ => 0,
    })
}
