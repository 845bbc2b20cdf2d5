//! The live hosts in MongoDB: one document per host instance in `<prefix>hosts`,
//! `{ _id: "<owner>/<instance>", owner, expiresAt, appName }`, written by its announcement and
//! deleted at its graceful stop; a lapsed one is ignored, and removed by a TTL index an hour
//! later. It also owns ending a dead host's open transactions ([`end_lapsed`]); which lanes the
//! live hosts get is [`crate::store::assignment`]'s. It never ends the transactions of a host
//! whose announcement is live, nor of a client it cannot name (no `appName`).

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::Database;
use mongodb::IndexModel;
use mongodb::options::IndexOptions;

use super::MongoStore;
use crate::store::StoreError;

const ID: &str = "_id";
const OWNER: &str = "owner";
const EXPIRES_AT: &str = "expiresAt";
/// The `appName` of the host's MongoDB client, which the server reports its sessions under.
const APP_NAME: &str = "appName";
/// When a live host ended the lapsed host's open transactions (see [`end_lapsed`]).
const ENDED_AT: &str = "endedAt";

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
/// Ends the open transactions of hosts that stopped announcing themselves ([`end_lapsed`]).
pub(super) async fn announce(store: &MongoStore, now: DateTime) -> Result<usize, StoreError> {
    let claimer = &store.claimer;
    let me = claimer.host_id();
    let hosts = &store.collections.hosts;
    let mut announcement = doc! { OWNER: &claimer.holder.owner, EXPIRES_AT: claimer.announced_until(now) };
    if let Some(app_name) = &store.options.client_app_name {
        announcement.insert(APP_NAME, app_name);
    }
    hosts.update_one(doc! { ID: &me }, doc! { "$set": announcement, "$unset": { ENDED_AT: "" } }).upsert(true).await?;
    // The live ones, and the lapsed ones whose transactions nobody ended yet.
    let unended = doc! { ENDED_AT: { "$exists": false }, APP_NAME: { "$type": "string" } };
    let announced: Vec<Document> = hosts
        .find(doc! { "$or": [{ EXPIRES_AT: { "$gt": now } }, unended] })
        .projection(doc! { ID: 1, EXPIRES_AT: 1, APP_NAME: 1 })
        .await?
        .try_collect()
        .await?;
    let mut live = Vec::new();
    let mut lapsed = Vec::new();
    for host in announced {
        let (Some(Bson::String(id)), Some(Bson::DateTime(expires_at))) = (host.get(ID), host.get(EXPIRES_AT)) else { continue };
        if *expires_at > now {
            live.push(id.clone());
        } else if let Some(Bson::String(app_name)) = host.get(APP_NAME) {
            lapsed.push(Lapsed { id: id.clone(), expires_at: *expires_at, app_name: app_name.clone() });
        }
    }
    if claimer.assign(&live) {
        store.heard.missed_some();
    }
    end_lapsed(store, lapsed, now).await;
    Ok(live.len().max(1))
}

/// Reads the live hosts and takes this instance's share of the lanes among them (see
/// [`announce`]); writes nothing.
pub(super) async fn look(store: &MongoStore, now: DateTime) -> Result<usize, StoreError> {
    let announced: Vec<Document> =
        store.collections.hosts.find(doc! { EXPIRES_AT: { "$gt": now } }).projection(doc! { ID: 1 }).await?.try_collect().await?;
    let live: Vec<String> = announced.iter().filter_map(|host| host.get_str(ID).ok().map(str::to_string)).collect();
    if store.claimer.assign(&live) {
        store.heard.missed_some();
    }
    Ok(live.len().max(1))
}

/// A host whose announcement lapsed, and the name its client gave MongoDB.
struct Lapsed {
    id: String,
    expires_at: DateTime,
    app_name: String,
}

/// Ends the open transactions of hosts whose announcement lapsed a third of a lease ago
/// (two thirds of a lease after their last one, well before their lanes' leases run out):
/// killed, most likely. MongoDB keeps a dead client's transaction, and the write locks it
/// holds, until its transaction lifetime (a minute by default): the events its fan-out was
/// marking, the documents its transactional handler was writing, would wait that long. Each
/// lapsed host is ended once, by the live host that marks it first (`endedAt`); a host that
/// announces itself again is live again. Should it have been alive after all (cut off from
/// MongoDB that long), its transactions end as a failover would end them, and its outcomes
/// are fenced as after any takeover.
///
/// The sessions are found by `$currentOp` (this user's, idle ones included) under the lapsed
/// host's `appName`, and ended by `killSessions`: no privilege is needed while every host
/// connects as the same user. Failures are logged, not returned: the server's transaction
/// lifetime still ends them.
async fn end_lapsed(store: &MongoStore, lapsed: Vec<Lapsed>, now: DateTime) {
    let grace = store.options.lease_duration.as_millis() as i64 / 3;
    let own = store.options.client_app_name.as_deref();
    for host in lapsed.into_iter().filter(|host| host.expires_at.timestamp_millis() <= now.timestamp_millis() - grace) {
        if own == Some(host.app_name.as_str()) {
            continue;
        }
        let marked = store
            .collections
            .hosts
            .update_one(
                doc! { ID: &host.id, EXPIRES_AT: host.expires_at, ENDED_AT: { "$exists": false } },
                doc! { "$set": { ENDED_AT: now } },
            )
            .await;
        match marked {
            Ok(marked) if marked.modified_count == 1 => {}
            Ok(_) => continue,
            Err(error) => {
                tracing::warn!(%error, host = %host.id, "marking a lapsed host's transactions as ended failed");
                continue;
            }
        }
        match end_sessions(&store.client.database("admin"), &host.app_name).await {
            Ok(0) => {}
            Ok(ended) => {
                store.dead_hosts_sessions_ended.fetch_add(ended as u64, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(host = %host.id, sessions = ended, "a host stopped announcing itself; ended its open sessions");
            }
            Err(error) => tracing::warn!(
                %error,
                host = %host.id,
                "ending the sessions of a host that stopped announcing itself failed; its transactions hold their locks until the server's transaction lifetime"
            ),
        }
    }
}

/// Kills the sessions the server holds for clients named `app_name`; returns how many.
async fn end_sessions(admin: &Database, app_name: &str) -> Result<usize, StoreError> {
    let pipeline = vec![
        doc! { "$currentOp": { "idleSessions": true } },
        doc! { "$match": { APP_NAME: { "$eq": app_name }, "lsid.id": { "$exists": true } } },
        doc! { "$group": { "_id": "$lsid.id" } },
    ];
    let sessions: Vec<Document> = admin.aggregate(pipeline).await?.try_collect().await?;
    let ids: Vec<Document> = sessions.into_iter().filter_map(|session| session.get(ID).map(|id| doc! { "id": id.clone() })).collect();
    let count = ids.len();
    if count > 0 {
        admin.run_command(doc! { "killSessions": ids }).await?;
    }
    Ok(count)
}

/// Takes `job`'s turn for `turn` from `now` if nobody holds it (or this instance does): one
/// host at a time does it. A turn is never handed back: the next is taken when it lapses.
pub(super) async fn take_turn(store: &MongoStore, job: &str, turn: std::time::Duration, now: DateTime) -> Result<bool, StoreError> {
    let me = store.claimer.host_id();
    let until = DateTime::from_millis(now.timestamp_millis() + turn.as_millis() as i64);
    let free = doc! { ID: { "$eq": job }, "$or": [{ "until": { "$lte": now } }, { "holder": &me }] };
    let taken = store.collections.turns.update_one(free, doc! { "$set": { "holder": &me, "until": until } }).upsert(true).await;
    match taken {
        Ok(_) => Ok(true),
        // The turn exists and is another's: the upsert met its `_id`.
        Err(error) if StoreError::from(error.clone()).server_code() == Some(11000) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// Deletes this instance's announcement (a graceful stop).
pub(super) async fn withdraw(store: &MongoStore) -> Result<(), StoreError> {
    store.collections.hosts.delete_one(doc! { ID: store.claimer.host_id() }).await?;
    Ok(())
}
