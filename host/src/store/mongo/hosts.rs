//! The live hosts in MongoDB: one document per host instance in `<prefix>hosts`,
//! `{ _id: "<owner>/<instance>", owner, expiresAt }`, written by its announcement and deleted
//! at its graceful stop; a lapsed one is ignored, and removed by a TTL index an hour later.
//! It owns nothing else: which lanes the live hosts get is [`crate::store::assignment`]'s.

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::options::IndexOptions;

use super::MongoStore;
use crate::store::StoreError;

const ID: &str = "_id";
const OWNER: &str = "owner";
const EXPIRES_AT: &str = "expiresAt";

/// Removes announcements an hour after they lapsed (only to keep the collection small:
/// a lapsed one is ignored as soon as it lapses).
pub(super) fn lapsed_index() -> IndexModel {
    let options = IndexOptions::builder()
        .name("lapsed".to_string())
        .expire_after(std::time::Duration::from_secs(3_600))
        .build();
    IndexModel::builder().keys(doc! { EXPIRES_AT: 1 }).options(options).build()
}

/// Announces this instance (until a third of a lease from `now`), then reads the live hosts and takes
/// this instance's share of the lanes. A share that grew includes lanes whose events it left
/// to their host while it heard them: the next fan-out reads instead of trusting the stream.
pub(super) async fn announce(store: &MongoStore, now: DateTime) -> Result<usize, StoreError> {
    let claimer = &store.claimer;
    let me = claimer.host_id();
    let hosts = &store.collections.hosts;
    hosts
        .update_one(
            doc! { ID: &me },
            doc! { "$set": { OWNER: &claimer.holder.owner, EXPIRES_AT: claimer.announced_until(now) } },
        )
        .upsert(true)
        .await?;
    let live: Vec<Document> =
        hosts.find(doc! { EXPIRES_AT: { "$gt": now } }).projection(doc! { ID: 1 }).await?.try_collect().await?;
    let live: Vec<String> = live
        .iter()
        .filter_map(|host| match host.get(ID) {
            Some(Bson::String(id)) => Some(id.clone()),
            _ => None,
        })
        .collect();
    if claimer.assign(&live) {
        store.heard.missed_some();
    }
    Ok(live.len().max(1))
}

/// Deletes this instance's announcement (a graceful stop).
pub(super) async fn withdraw(store: &MongoStore) -> Result<(), StoreError> {
    store.collections.hosts.delete_one(doc! { ID: store.claimer.host_id() }).await?;
    Ok(())
}
