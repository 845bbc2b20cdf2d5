//! The handler registry in MongoDB (see [`crate::store::registry`]): one document per handler
//! in `<prefix>handlers`, `{ _id: handler, eventTypes, transactional, plugin, version,
//! firstSeen, lastSeen, retiredAt? }`, and what each host serves as `serves` on its
//! announcement in `<prefix>hosts`. It never deletes a handler's record: an operator retires it.

use std::collections::BTreeMap;
use std::future::IntoFuture;

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;

use super::MongoStore;
use super::documents::delivery;
use crate::store::StoreError;
use crate::store::registry::{self, Declaration, Disposal, RegisteredHandler, RetireReport, Served};

const ID: &str = "_id";
const EVENT_TYPES: &str = "eventTypes";
const TRANSACTIONAL: &str = "transactional";
/// How its deliveries of one key run several at once, if they do: `{ pointer }`, `null`
/// for the event's key (see [`crate::store::PerKey`]); absent for one at a time in order.
const PER_KEY: &str = "perKey";
const POINTER: &str = "pointer";
/// Where it takes priorities per event from, if it does: `event` or a JSON pointer.
const PRIORITY_FROM: &str = "priorityFrom";
const PLUGIN: &str = "plugin";
const VERSION: &str = "version";
const FIRST_SEEN: &str = "firstSeen";
const LAST_SEEN: &str = "lastSeen";
const RETIRED_AT: &str = "retiredAt";
/// On a host's announcement: the handlers it serves (`[{ handler, eventTypes, transactional }]`).
const SERVES: &str = "serves";
const HANDLER: &str = "handler";
const EXPIRES_AT: &str = "expiresAt";

pub(super) async fn register(store: &MongoStore, declarations: &[Declaration], now: DateTime) -> Result<Vec<RegisteredHandler>, StoreError> {
    let serves: Vec<Document> = declarations
        .iter()
        .map(|d| {
            doc! {
                HANDLER: &d.subscription.handler,
                EVENT_TYPES: d.subscription.event_types.iter().cloned().collect::<Vec<_>>(),
                TRANSACTIONAL: d.subscription.in_transaction,
            }
        })
        .collect();
    let handlers = &store.collections.handlers;
    let writes = declarations.iter().map(|d| {
        handlers
            .update_one(
                doc! { ID: &d.subscription.handler },
                {
                    let mut set = doc! {
                        EVENT_TYPES: d.subscription.event_types.iter().cloned().collect::<Vec<_>>(),
                        TRANSACTIONAL: d.subscription.in_transaction,
                        PLUGIN: &d.plugin,
                        VERSION: &d.version,
                        LAST_SEEN: now,
                    };
                    let mut unset = doc! { RETIRED_AT: "" };
                    match &d.subscription.priority_from {
                        Some(from) => {
                            set.insert(PRIORITY_FROM, from.text());
                        }
                        None => {
                            unset.insert(PRIORITY_FROM, "");
                        }
                    }
                    match &d.subscription.per_key {
                        Some(per_key) => {
                            set.insert(PER_KEY, doc! { POINTER: per_key.pointer() });
                        }
                        None => {
                            unset.insert(PER_KEY, "");
                        }
                    }
                    doc! { "$set": set, "$unset": unset, "$setOnInsert": { FIRST_SEEN: now } }
                },
            )
            .upsert(true)
            .into_future()
    });
    // A handler retired before it was seen again starts anew: its first sighting is now.
    let renewed = handlers.update_many(
        doc! { ID: { "$in": declarations.iter().map(|d| d.subscription.handler.clone()).collect::<Vec<_>>() }, RETIRED_AT: { "$exists": true } },
        doc! { "$set": { FIRST_SEEN: now } },
    );
    renewed.await?;
    futures::future::try_join_all(writes).await?;
    store.collections.hosts.update_one(doc! { ID: store.claimer.host_id() }, doc! { "$set": { SERVES: serves } }).upsert(true).await?;
    handlers_now(store, now).await
}

pub(super) async fn handlers_now(store: &MongoStore, now: DateTime) -> Result<Vec<RegisteredHandler>, StoreError> {
    let stored: Vec<Document> = store.collections.handlers.find(doc! {}).await?.try_collect().await?;
    let mut records = BTreeMap::new();
    for document in stored {
        let record = record_of(&document).ok_or_else(|| StoreError::Corrupt(format!("handler record: {document}")))?;
        records.insert(record.handler.clone(), record);
    }
    let hosts: Vec<Document> = store
        .collections
        .hosts
        .find(doc! { EXPIRES_AT: { "$gt": now } })
        .projection(doc! { ID: 1, SERVES: 1 })
        .await?
        .try_collect()
        .await?;
    let live = hosts.iter().filter_map(|host| {
        let id = host.get_str(ID).ok()?.to_string();
        let served = host.get_array(SERVES).map(|served| served.iter().filter_map(served_of).collect()).unwrap_or_default();
        Some((id, served))
    });
    Ok(registry::joined(records, live))
}

fn record_of(document: &Document) -> Option<RegisteredHandler> {
    Some(RegisteredHandler {
        handler: document.get_str(ID).ok()?.to_string(),
        event_types: strings(document.get_array(EVENT_TYPES).ok()?),
        in_transaction: document.get_bool(TRANSACTIONAL).unwrap_or(false),
        priority_from: document.get_str(PRIORITY_FROM).ok().and_then(crate::store::PriorityFrom::parse),
        per_key: document.get_document(PER_KEY).ok().map(|per_key| crate::store::PerKey::from_pointer(per_key.get_str(POINTER).ok())),
        plugin: document.get_str(PLUGIN).unwrap_or("").to_string(),
        version: document.get_str(VERSION).unwrap_or("").to_string(),
        first_seen: document.get_datetime(FIRST_SEEN).copied().ok()?,
        last_seen: document.get_datetime(LAST_SEEN).copied().ok()?,
        served_by: Vec::new(),
        retired_at: document.get_datetime(RETIRED_AT).copied().ok(),
    })
}

fn served_of(entry: &Bson) -> Option<Served> {
    let entry = entry.as_document()?;
    Some(Served {
        handler: entry.get_str(HANDLER).ok()?.to_string(),
        event_types: strings(entry.get_array(EVENT_TYPES).ok()?),
        in_transaction: entry.get_bool(TRANSACTIONAL).unwrap_or(false),
    })
}

fn strings(values: &[Bson]) -> std::collections::BTreeSet<String> {
    values.iter().filter_map(|v| v.as_str().map(str::to_string)).collect()
}

/// Retires `handler` (refused while a live host serves it), then buries or drops its pending
/// deliveries but those a live lease lists.
pub(super) async fn retire(store: &MongoStore, handler: &str, disposal: Disposal, now: DateTime) -> Result<RetireReport, StoreError> {
    registry::check_retirable(&handlers_now(store, now).await?, handler)?;
    let not_yet = doc! { ID: { "$eq": handler }, RETIRED_AT: { "$exists": false } };
    store.collections.handlers.update_one(not_yet, doc! { "$set": { RETIRED_AT: now } }).await?;
    // What a live lease lists may still run on a host that stopped serving it: left alone.
    let listed: Vec<Bson> = super::operations::listed_by_live_leases(store, now).await?.into_iter().map(Bson::ObjectId).collect();
    let waiting = doc! { delivery::HANDLER: { "$eq": handler }, delivery::STATUS: delivery::PENDING };
    let still_claimed = if listed.is_empty() {
        0
    } else {
        let mut claimed = waiting.clone();
        claimed.insert(delivery::ID, doc! { "$in": &listed });
        store.collections.deliveries.count_documents(claimed).await?
    };
    let mut disposable = waiting;
    disposable.insert(delivery::ID, doc! { "$nin": listed });
    let disposed = match disposal {
        Disposal::Drop => store.collections.deliveries.delete_many(disposable).await?.deleted_count,
        Disposal::Bury => {
            store.collections.deliveries.update_many(disposable, super::outcome::burial(registry::RETIRED, false, now)).await?.modified_count
        }
    };
    Ok(RetireReport { disposed, still_claimed })
}
