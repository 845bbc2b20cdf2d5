//! Schema setup: server checks, collections, indexes and the 256 lane documents.
//! Idempotent and safe when several hosts run it at once.

use std::time::Duration;

use bson::{Bson, Document, doc};
use mongodb::options::IndexOptions;
use mongodb::{Client, Collection, IndexModel};

use super::documents::{delivery, history, lane};
use super::{Collections, MongoLocation};
use crate::event::field;
use crate::lane::LANE_COUNT;
use crate::store::StoreError;

const NAMESPACE_EXISTS: i32 = 48;
const DUPLICATE_KEY: i32 = 11000;
const INDEX_NOT_FOUND: i32 = 27;

/// Delivery indexes earlier versions created that the store no longer uses or keeps partial
/// now (every delivery used to pay for them twice: at fan-out and at completion).
const SUPERSEDED_DELIVERY_INDEXES: &[&str] = &["due", "status_updated", "by_status", "by_handler", "by_event_type"];

/// The events' indexes the fan-out reads by (by name: a hint, so that the planner never walks
/// `created`, which has the same keys, through every event ever fanned out).
pub(super) const UNFANNED: &str = "unfanned_by_depth";
/// The index of each key's pending deliveries in sequence order (see `delivery_indexes`).
pub(super) const ORDERING: &str = "ordering";
/// Claims of handlers that take priorities per event: their deliveries by lane, the highest
/// priority first, then as `claim` (see [`crate::store::claim::ReadOrder`]).
pub(super) const CLAIM_BY_PRIORITY: &str = "claim_by_priority";
pub(super) const PARKED_BEHIND: &str = "parked_behind";
pub(super) const KEY_UNFANNED: &str = "key_unfanned";
/// Every event in creation order: the purge's walk (by name, for the same reason).
pub(super) const CREATED: &str = "created";
/// Keyed events by key: what the purge asks before it deletes a key's counter.
pub(super) const BY_KEY: &str = "by_key";

/// Event indexes earlier versions created. `completed` made every completion move an index key
/// of its event, and in MongoDB that update then costs about four times as much as without
/// it; the purge reads `completedAt` while it walks `created` instead. `fan_out` and
/// `key_fan_out` held every event with `fannedOutAt` as a key, so the fan-out's stamp moved
/// a key in each; `unfanned` and `key_unfanned` hold unfanned events only, and the stamp just
/// takes the event out of them.
const SUPERSEDED_EVENT_INDEXES: &[&str] = &["completed", "fan_out", "key_fan_out", "unfanned"];

pub(super) async fn run(client: &Client, collections: &Collections, location: &MongoLocation) -> Result<(), StoreError> {
    check_server(client).await?;
    let database = client.database(&location.database);
    // Explicitly: collections created implicitly inside concurrent transactions conflict.
    for collection in [
        &collections.events,
        &collections.key_sequences,
        &collections.deliveries,
        &collections.lanes,
        &collections.history,
        &collections.oversized_events,
        &collections.hosts,
        &collections.handlers,
        &collections.turns,
        &collections.limiters,
    ] {
        create_collection(&database, collection.name()).await?;
    }
    drop_superseded_indexes(&collections.deliveries, SUPERSEDED_DELIVERY_INDEXES).await?;
    drop_superseded_indexes(&collections.events, SUPERSEDED_EVENT_INDEXES).await?;
    create_indexes(&collections.deliveries, delivery_indexes()).await?;
    create_indexes(&collections.events, event_indexes()).await?;
    create_indexes(&collections.history, history_indexes()).await?;
    create_indexes(&collections.hosts, vec![super::hosts::lapsed_index()]).await?;
    seed_lanes(&collections.lanes).await
}

/// Creates collection `name` in `database` unless it exists.
pub(super) async fn create_collection(database: &mongodb::Database, name: &str) -> Result<(), StoreError> {
    match database.create_collection(name).await {
        Ok(()) => Ok(()),
        Err(error) if StoreError::from(error.clone()).server_code() == Some(NAMESPACE_EXISTS) => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Refuses a standalone server and servers older than 6.0, saying what to run instead.
pub(super) async fn check_server(client: &Client) -> Result<(), StoreError> {
    let admin = client.database("admin");
    let hello = admin.run_command(doc! { "hello": 1 }).await?;
    let is_replica_set = hello.get_str("setName").is_ok();
    let is_router = hello.get_str("msg") == Ok("isdbgrid");
    if !is_replica_set && !is_router {
        return Err(StoreError::NeedsReplicaSet("this standalone mongod".to_string()));
    }
    let build_info = admin.run_command(doc! { "buildInfo": 1 }).await?;
    require_version(build_info.get_str("version").unwrap_or("unknown"))
}

fn require_version(version: &str) -> Result<(), StoreError> {
    let major: u32 = version.split('.').next().and_then(|m| m.parse().ok()).unwrap_or(0);
    if major < 6 {
        return Err(StoreError::ServerTooOld { found: version.to_string() });
    }
    Ok(())
}

fn index(keys: Document, name: &str, partial: Option<Document>, unique: bool) -> IndexModel {
    let options = IndexOptions::builder().name(name.to_string()).partial_filter_expression(partial).unique(unique.then_some(true)).build();
    IndexModel::builder().keys(keys).options(options).build()
}

fn dead() -> Document {
    doc! { delivery::STATUS: delivery::DEAD }
}

fn delivery_indexes() -> Vec<IndexModel> {
    vec![
        // Backstop of idempotent fan-out; the code never relies on catching it.
        index(doc! { delivery::EVENT_ID: 1, delivery::HANDLER: 1 }, "event_handler", None, true),
        // Claims and free-lane discovery. Ends with `handler` so a query over many lanes stays a
        // merge of one index scan per lane.
        index(
            doc! { delivery::LANE_ID: 1, delivery::DUE_AT: 1, delivery::ID: 1, delivery::HANDLER: 1 },
            "claim",
            Some(doc! { delivery::LANE: delivery::READY }),
            false,
        ),
        // The same for the deliveries that have a priority of their own, in its order.
        index(
            doc! { delivery::LANE_ID: 1, delivery::PRIORITY: -1, delivery::DUE_AT: 1, delivery::ID: 1, delivery::HANDLER: 1 },
            CLAIM_BY_PRIORITY,
            Some(doc! { delivery::LANE: delivery::READY, delivery::PRIORITY: { "$exists": true } }),
            false,
        ),
        // The head of each key: its lowest unfinished sequence.
        index(
            doc! { delivery::HANDLER: 1, delivery::KEY: 1, delivery::SEQUENCE: 1 },
            ORDERING,
            Some(doc! { delivery::STATUS: delivery::PENDING, delivery::KEY: { "$exists": true } }),
            false,
        ),
        // Keys with parked followers. `lane` leads so that the distinct scan over it is an
        // index skip per key (DISTINCT_SCAN), not a walk over every parked delivery.
        index(
            doc! { delivery::LANE: 1, delivery::HANDLER: 1, delivery::KEY: 1, delivery::SEQUENCE: 1 },
            "parked",
            Some(doc! { delivery::LANE: delivery::PARKED }),
            false,
        ),
        // Followers created parked behind a delivery, found by it once it is settled.
        index(
            doc! { delivery::BEHIND: 1 },
            PARKED_BEHIND,
            Some(doc! { delivery::LANE: delivery::PARKED, delivery::BEHIND: { "$exists": true } }),
            false,
        ),
        // Dead letters only: the operator's listings and the purge of old dead letters. The
        // hot path (insert at fan-out, delete at completion) never touches them.
        index(doc! { delivery::STATUS: 1, delivery::ID: 1 }, "dead_by_id", Some(dead()), false),
        index(doc! { delivery::STATUS: 1, delivery::UPDATED_AT: 1 }, "dead_updated", Some(dead()), false),
        index(doc! { delivery::HANDLER: 1, delivery::ID: 1 }, "dead_by_handler", Some(dead()), false),
        index(doc! { delivery::EVENT_TYPE: 1, delivery::ID: 1 }, "dead_by_event_type", Some(dead()), false),
        index(
            doc! { delivery::REQUEUED_AT: 1 },
            "requeued",
            Some(doc! { delivery::REQUEUED_AT: { "$exists": true } }),
            false,
        ),
    ]
}

fn event_indexes() -> Vec<IndexModel> {
    vec![
        // Events nobody fanned out yet, and only those (`fannedOutAt: null` also matches a
        // missing field, which `$exists: false` would say but a partial index cannot): the
        // fan-out's stamp removes an event from it instead of moving its key, and the index
        // stays as small as the backlog.
        index(doc! { field::CHAIN_DEPTH: 1, field::CREATED_AT: 1, field::ID: 1 }, UNFANNED, Some(doc! { field::FANNED_OUT_AT: Bson::Null }), false),
        // The lowest unfanned events of a key.
        index(
            doc! { field::KEY: 1, field::SEQUENCE: 1 },
            KEY_UNFANNED,
            Some(doc! { field::FANNED_OUT_AT: Bson::Null, field::KEY: { "$exists": true } }),
            false,
        ),
        // The purge's walk. `completedAt` is deliberately in no index: see
        // `SUPERSEDED_EVENT_INDEXES`.
        index(doc! { field::CREATED_AT: 1, field::ID: 1 }, CREATED, None, false),
        // Whether any event of a key remains, once the purge deleted some (never touched by
        // the fan-out's marks, which leave `key` as it is).
        index(doc! { field::KEY: 1 }, BY_KEY, Some(doc! { field::KEY: { "$exists": true } }), false),
    ]
}

fn history_indexes() -> Vec<IndexModel> {
    vec![
        index(doc! { history::COMPLETED_AT: 1, "_id": 1 }, "completed", None, false),
        index(doc! { delivery::EVENT_ID: 1 }, "event", None, false),
        index(doc! { delivery::HANDLER: 1 }, "handler", None, false),
    ]
}

/// Concurrent builds of the same index by several hosts can fail transiently; a few retries
/// settle them (the specs are identical, so the survivor is the right index).
async fn create_indexes(collection: &Collection<Document>, models: Vec<IndexModel>) -> Result<(), StoreError> {
    let mut attempt = 0;
    loop {
        match collection.create_indexes(models.clone()).await {
            Ok(_) => return Ok(()),
            Err(error) if attempt < 5 => {
                attempt += 1;
                tracing::debug!(%error, collection = collection.name(), "index creation raced; retrying");
                tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Drops the indexes of `collection` that `superseded` names; one already gone (another host
/// dropped it, or it never existed) is fine.
async fn drop_superseded_indexes(collection: &Collection<Document>, superseded: &[&str]) -> Result<(), StoreError> {
    let existing = collection.list_index_names().await?;
    for name in superseded.iter().filter(|name| existing.iter().any(|e| e == *name)) {
        match collection.drop_index(*name).await {
            Ok(()) => tracing::info!(index = name, collection = collection.name(), "dropped a superseded index"),
            Err(error) if StoreError::from(error.clone()).server_code() == Some(INDEX_NOT_FOUND) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

async fn seed_lanes(lanes: &Collection<Document>) -> Result<(), StoreError> {
    let documents: Vec<Document> = (0..LANE_COUNT)
        .map(|id| {
            doc! {
                lane::ID: i32::from(id),
                lane::OWNER: bson::Bson::Null,
                lane::INSTANCE: bson::Bson::Null,
                lane::LEASE_EXPIRES_AT: bson::DateTime::from_millis(0),
                lane::EPOCH: 0_i64,
                lane::IN_FLIGHT: [],
            }
        })
        .collect();
    match lanes.insert_many(documents).ordered(false).await {
        Ok(_) => Ok(()),
        Err(error) => match error.kind.as_ref() {
            // Lanes another host (or an earlier run) created already.
            mongodb::error::ErrorKind::InsertMany(failure)
                if failure.write_concern_error.is_none()
                    && failure.write_errors.as_ref().is_some_and(|errors| errors.iter().all(|e| e.code == DUPLICATE_KEY)) =>
            {
                Ok(())
            }
            _ => Err(error.into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_older_than_6_are_refused_by_name() {
        for old in ["5.0.21", "4.4.0", "unknown"] {
            let error = require_version(old).unwrap_err().to_string();
            assert!(error.contains(old) && error.contains("6.0 or newer"), "{error}");
        }
        for fine in ["6.0.5", "7.0.2", "8.0.0-rc1"] {
            assert!(require_version(fine).is_ok());
        }
    }
}
