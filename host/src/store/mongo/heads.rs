//! Finding the heads of keys in MongoDB (a key's head: its lowest pending delivery, the only
//! one of it a claim may run): by lookup, the keys' pending deliveries read from the `ordering`
//! index and grouped by key in one command per handler, and by name, the followers created
//! parked behind a delivery that is gone; and which keys have nothing pending at all (a
//! fan-out may hand out their heads). It reads and unparks; it must never decide what runs
//! (the shared claim does).

use std::collections::{BTreeMap, HashMap, HashSet};

use bson::{Document, doc};
use futures::TryStreamExt;
use futures::future::try_join_all;
use mongodb::ClientSession;
use mongodb::options::Hint;

use super::documents::{self, delivery};
use super::lanes::Backend;
use super::{Commit, MongoStore, setup};
use crate::store::claim::{HandlerKey, Settled};
use crate::store::{DeliveryId, StoreError, answered};

/// Keys whose heads one command looks up.
const HEADS_PER_COMMAND: usize = 1_000;

/// Settled deliveries up to this many (a key's chain settles one at a time) have their
/// followers unparked by one `findAndModify` each, all at once: one round trip instead of a
/// read and then an update.
const UNPARKED_ONE_BY_ONE_MAX: usize = 4;

impl Backend<'_> {
    /// Every key of `handlers` with parked deliveries. One skip scan over the `parked` index
    /// names the handlers that have any (usually none), so a host serving many handlers pays
    /// one command, not one per handler; then one skip scan per such handler names its keys.
    pub(super) async fn parked_keys(&self, handlers: &[String]) -> Result<Vec<HandlerKey>, StoreError> {
        let deliveries = &self.store.collections.deliveries;
        let parked_handlers = deliveries
            .distinct(delivery::HANDLER, doc! { delivery::LANE: delivery::PARKED, delivery::HANDLER: { "$in": handlers } })
            .await?;
        let parked_handlers: Vec<String> = parked_handlers.iter().filter_map(|h| h.as_str().map(str::to_string)).collect();
        let per_handler: Vec<Vec<HandlerKey>> = try_join_all(parked_handlers.iter().map(|handler| async move {
            let keys = deliveries
                .distinct(delivery::KEY, doc! { delivery::LANE: delivery::PARKED, delivery::HANDLER: handler })
                .await?;
            Ok::<_, StoreError>(keys.into_iter().filter_map(|k| k.as_str().map(|k| (handler.clone(), k.to_string()))).collect())
        }))
        .await?;
        Ok(per_handler.into_iter().flatten().collect())
    }

    /// Unparks the followers created behind one of `settled` that is no longer pending, and
    /// returns them as their keys' heads: at most two reads by index and one update, whatever
    /// the number of keys (or, for a few, one `findAndModify` each, at once), where looking
    /// each key's head up costs `mongod` a sub-pipeline per key. Whether a delivery is still
    /// pending is read only for those this instance did not complete itself (a completed one
    /// is gone). The unpark is acknowledged once applied: the claim that runs the follower
    /// records it by a majority write after it, and the sweep repairs one a failover lost.
    pub(super) async fn followers_of_settled(
        &self,
        handlers: &[String],
        settled: &[Settled],
    ) -> Result<HashMap<HandlerKey, DeliveryId>, StoreError> {
        let deliveries = &self.store.collections.deliveries;
        let unsure: Vec<DeliveryId> = settled.iter().filter(|s| !s.completed).map(|s| s.delivery).collect();
        let still_pending: HashSet<DeliveryId> = if unsure.is_empty() {
            HashSet::new()
        } else {
            deliveries
                .find(doc! { delivery::ID: { "$in": &unsure }, delivery::STATUS: delivery::PENDING })
                .projection(doc! { delivery::ID: 1 })
                .hint(super::by_id())
                .batch_size(super::documents::one_batch(unsure.len()))
                .await?
                .try_collect::<Vec<Document>>()
                .await?
                .iter()
                .filter_map(|d| d.get_object_id(delivery::ID).ok())
                .collect()
        };
        let gone: Vec<DeliveryId> = settled.iter().map(|s| s.delivery).filter(|id| !still_pending.contains(id)).collect();
        if gone.is_empty() {
            return Ok(HashMap::new());
        }
        let unpark = documents::unparked();
        let projection = doc! { delivery::ID: 1, delivery::HANDLER: 1, delivery::KEY: 1 };
        if gone.len() <= UNPARKED_ONE_BY_ONE_MAX {
            let unparked = answered::every(gone.iter().map(|id| {
                deliveries
                    .find_one_and_update(
                        doc! { delivery::BEHIND: id, delivery::LANE: delivery::PARKED, delivery::HANDLER: { "$in": handlers } },
                        unpark.clone(),
                    )
                    .projection(projection.clone())
                    .hint(Hint::Name(setup::PARKED_BEHIND.into()))
                    .write_concern(Commit::Applied.write_concern())
                    .into_future()
            }))
            .await?;
            return Ok(keys_of(unparked.iter().flatten()));
        }
        let followers: Vec<Document> = deliveries
            .find(doc! {
                delivery::BEHIND: { "$in": gone },
                delivery::LANE: delivery::PARKED,
                delivery::HANDLER: { "$in": handlers },
            })
            .projection(projection)
            .hint(Hint::Name(setup::PARKED_BEHIND.into()))
            // One follower behind each, as a rule (a delivery is of one handler and key), so one
            // batch: past the server's first batch of 101, a `getMore` costs the claim a round trip.
            .batch_size(super::documents::one_batch(settled.len()))
            .await?
            .try_collect()
            .await?;
        let heads = keys_of(followers.iter());
        if !heads.is_empty() {
            let ids: Vec<DeliveryId> = heads.values().copied().collect();
            deliveries
                .update_many(doc! { delivery::ID: { "$in": ids }, delivery::LANE: delivery::PARKED }, unpark)
                .hint(super::by_id())
                .write_concern(Commit::Applied.write_concern())
                .await?;
        }
        Ok(heads)
    }

    /// The head of each of `keys` that has one, with its claim lane: one command per handler
    /// (per thousand keys), whatever the number of keys.
    pub(super) async fn heads(&self, keys: &[HandlerKey]) -> Result<Vec<(HandlerKey, DeliveryId, String)>, StoreError> {
        let mut by_handler: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (handler, key) in keys {
            by_handler.entry(handler).or_default().push(key);
        }
        let lookups = by_handler.iter().flat_map(|(handler, keys)| {
            keys.chunks(HEADS_PER_COMMAND).map(move |chunk| async move {
                let found = heads_of(self.store, handler, chunk, None).await?;
                Ok::<_, StoreError>(found.into_iter().map(|(key, id, lane)| ((handler.to_string(), key), id, lane)))
            })
        });
        Ok(try_join_all(lookups).await?.into_iter().flatten().collect())
    }
}

/// The lowest pending delivery of a key, `(id, claim lane)`, read in `session` if given.
pub(super) async fn key_head(
    store: &MongoStore,
    handler: &str,
    key: &str,
    session: Option<&mut ClientSession>,
) -> Result<Option<(DeliveryId, String)>, StoreError> {
    Ok(heads_of(store, handler, &[key], session).await?.pop().map(|(_, id, lane)| (id, lane)))
}

/// The heads of `keys` of one handler, `(key, id, claim lane)`, read in `session` if given:
/// the pending deliveries of those keys in `ordering` order, grouped by key, the first of
/// each kept, in one round trip. `mongod` 6.0 plans no skip scan for it on this partial index:
/// it reads every pending delivery of the keys (a few each in a drain, whose keys' later
/// events wait unfanned). A `$lookup` of each key's lowest from literal documents read one
/// index entry per key but cost about 100 µs a key in sub-pipelines, 35-44 ms a call in a
/// four-host keyed drain, 15 % of `mongod`'s time there (measured, `docs/performance.md`);
/// this form costs a key with thousands of deliveries pending that many index entries, and
/// only a key whose head its claimer does not know is looked up.
pub(super) async fn heads_of(
    store: &MongoStore,
    handler: &str,
    keys: &[&str],
    session: Option<&mut ClientSession>,
) -> Result<Vec<(String, DeliveryId, String)>, StoreError> {
    let pipeline = vec![
        doc! { "$match": {
            delivery::HANDLER: handler,
            delivery::KEY: { "$in": keys },
            delivery::STATUS: delivery::PENDING,
        } },
        doc! { "$sort": { delivery::HANDLER: 1, delivery::KEY: 1, delivery::SEQUENCE: 1 } },
        doc! { "$group": {
            "_id": format!("${}", delivery::KEY),
            "id": { "$first": format!("${}", delivery::ID) },
            "lane": { "$first": format!("${}", delivery::LANE) },
        } },
    ];
    let deliveries = &store.collections.deliveries;
    // At most a row per key, in one batch (past 101, a `getMore` would cost a round trip).
    let aggregate =
        deliveries.aggregate(pipeline).hint(Hint::Name(setup::ORDERING.into())).batch_size(super::documents::one_batch(keys.len()));
    let found: Vec<Document> = match session {
        // A transaction reads from its primary already.
        Some(session) => aggregate.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
        None => aggregate
            .selection_criteria(mongodb::options::SelectionCriteria::ReadPreference(
                mongodb::options::ReadPreference::Primary,
            ))
            .await?
            .try_collect()
            .await?,
    };
    // A head whose id is not an ObjectId was not written by a host: its key counts as having
    // none.
    Ok(found
        .iter()
        .filter_map(|row| {
            let id = row.get_object_id("id").ok()?;
            let lane = row.get_str("lane").unwrap_or_default().to_string();
            Some((row.get_str("_id").ok()?.to_string(), id, lane))
        })
        .collect())
}

/// Those of `heads` of which nothing is pending, read in `session` (a fan-out's transaction,
/// so that its snapshot decides): one `distinct` of the pending keys per handler over the
/// `ordering` index, which names each key once however many deliveries it has pending.
pub(super) async fn idle_keys(
    store: &MongoStore,
    session: &mut ClientSession,
    heads: Vec<HandlerKey>,
) -> Result<HashSet<HandlerKey>, StoreError> {
    let mut by_handler: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (handler, key) in &heads {
        by_handler.entry(handler.clone()).or_default().push(key.clone());
    }
    let mut idle: HashSet<HandlerKey> = heads.into_iter().collect();
    for (handler, keys) in by_handler {
        let filter = doc! {
            delivery::HANDLER: &handler,
            delivery::KEY: { "$in": keys },
            delivery::STATUS: delivery::PENDING,
        };
        let pending = store.collections.deliveries.distinct(delivery::KEY, filter).session(&mut *session).await?;
        for key in pending.iter().filter_map(|key| key.as_str()) {
            idle.remove(&(handler.clone(), key.to_string()));
        }
    }
    Ok(idle)
}

/// The deliveries of `followers` by their handler and key.
fn keys_of<'a>(followers: impl Iterator<Item = &'a Document>) -> HashMap<HandlerKey, DeliveryId> {
    followers
        .filter_map(|follower| {
            let (Ok(id), Ok(handler), Ok(key)) =
                (follower.get_object_id(delivery::ID), follower.get_str(delivery::HANDLER), follower.get_str(delivery::KEY))
            else {
                return None;
            };
            Some(((handler.to_string(), key.to_string()), id))
        })
        .collect()
}
