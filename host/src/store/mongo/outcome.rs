//! Outcomes of claimed deliveries in MongoDB: the primitives the shared outcomes
//! (`crate::store::outcome`) are written over, the lease renewal, a stop's hand-back of its
//! lanes, and the operator's requeue and burial. Every write is conditional on the lease's
//! lane epoch and claim generation.

use std::collections::{BTreeSet, HashMap, HashSet};

use bson::oid::ObjectId;
use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::ClientSession;

use super::documents::{self, delivery, generation_filter, history, lane, lane_state, view};
use super::{generations, unstored};
use super::{MongoStore, MongoTx};
use crate::lane::LaneId;
use crate::store::claim::Claimer;
use crate::store::outcome::{Change, OutcomeBackend};
use crate::store::{DeliveryStatus, DeliveryView, Lease, StoreError};

fn lease_generations<'a>(leases: impl Iterator<Item = &'a Lease>) -> Vec<(ObjectId, i64)> {
    leases.map(|lease| (lease.delivery, lease.claims)).collect()
}

/// Lane epochs as they are now, read in `session` if given.
async fn lane_epochs(
    store: &MongoStore,
    session: Option<&mut ClientSession>,
    lanes: impl IntoIterator<Item = LaneId>,
) -> Result<HashMap<LaneId, i64>, StoreError> {
    let ids: BTreeSet<i32> = lanes.into_iter().map(i32::from).collect();
    let find = store
        .collections
        .lanes
        .find(doc! { lane::ID: { "$in": ids.into_iter().collect::<Vec<_>>() } })
        .projection(doc! { lane::ID: 1, lane::EPOCH: 1 })
        .batch_size(u32::from(crate::lane::LANE_COUNT) + 1);
    let documents: Vec<Document> = match session {
        Some(session) => find.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
        None => find.await?.try_collect().await?,
    };
    Ok(documents
        .iter()
        .filter_map(|d| Some((LaneId::try_from(d.get_i32(lane::ID).ok()?).ok()?, d.get_i64(lane::EPOCH).ok()?)))
        .collect())
}

/// The leases among `leases` whose lane still has their epoch and whose delivery was `found`
/// at their generation.
fn current<'a, T>(leases: &'a [Lease], epochs: &HashMap<LaneId, i64>, found: &HashMap<ObjectId, T>) -> Vec<&'a Lease> {
    leases.iter().filter(|lease| epochs.get(&lease.lane) == Some(&lease.epoch) && found.contains_key(&lease.delivery)).collect()
}

/// Where [`complete_in_session`] stamps the completed deliveries' events.
#[derive(Clone, Copy, PartialEq, Eq)]
enum EventStamp {
    /// In the transaction, with the rest.
    InTransaction,
    /// Outside it, before it commits, as [`complete_each`] stamps them before its deletes. A
    /// handler's transaction runs for as long as its handler: stamped in it, the event (which
    /// every handler of it stamps) would meet any other handler's completion of it committed
    /// meanwhile as a write conflict, and the handler would run again for nothing.
    Outside,
}

/// Completes the current ones among `leases` in `session`'s transaction: reads the lanes and
/// the deliveries, deletes, stamps the events (see [`EventStamp`]), writes history. A fixed
/// number of commands. Returns the deliveries it completed.
async fn complete_in_session(
    store: &MongoStore,
    session: &mut ClientSession,
    leases: &[Lease],
    stamp: EventStamp,
    now: DateTime,
) -> Result<HashSet<ObjectId>, StoreError> {
    let epochs = lane_epochs(store, Some(&mut *session), leases.iter().map(|l| l.lane)).await?;
    // The history copies whole documents; without it the generation and the event id do.
    let projection =
        (!store.options.completion_history).then(|| doc! { delivery::ID: 1, delivery::EVENT_ID: 1, delivery::CLAIMS: 1 });
    let found = generations::find_current(store, &lease_generations(leases.iter()), projection, Some(&mut *session)).await?;
    let found: HashMap<ObjectId, Document> =
        found.into_iter().filter_map(|d| Some((d.get_object_id(delivery::ID).ok()?, d))).collect();
    let current = current(leases, &epochs, &found);
    if !current.is_empty() {
        let ids: Vec<ObjectId> = current.iter().map(|l| l.delivery).collect();
        store
            .collections
            .deliveries
            .delete_many(doc! { delivery::ID: { "$in": &ids } })
            .hint(super::by_id())
            .session(&mut *session)
            .await?;
        let event_ids: Vec<Bson> = current
            .iter()
            .filter_map(|l| found[&l.delivery].get(delivery::EVENT_ID).cloned())
            .collect();
        let stamp_events = store
            .collections
            .events
            .update_many(doc! { "_id": { "$in": event_ids } }, doc! { "$max": { crate::event::field::COMPLETED_AT: now } })
            .hint(super::by_id());
        match stamp {
            EventStamp::InTransaction => stamp_events.session(&mut *session).await?,
            // Applied only: the transaction's majority commit after it makes it durable.
            EventStamp::Outside => stamp_events.write_concern(mongodb::options::WriteConcern::nodes(1)).await?,
        };
        if store.options.completion_history {
            let records: Vec<Document> = current
                .iter()
                .map(|lease| {
                    let mut record = found[&lease.delivery].clone();
                    for field in [delivery::LANE, delivery::STATUS, delivery::CLAIMS, delivery::DUE_AT, delivery::LAST_ERROR] {
                        record.remove(field);
                    }
                    let attempts = record.get_i32(delivery::ATTEMPTS).unwrap_or(0);
                    record.insert(delivery::ATTEMPTS, attempts + 1);
                    record.insert(history::COMPLETED_AT, now);
                    record
                })
                .collect();
            store.collections.history.insert_many(records).session(&mut *session).await?;
        }
    }
    Ok(current.iter().map(|l| l.delivery).collect())
}

/// Completes the current ones among `leases` without a transaction: every delivery is
/// deleted only if it is still at its claim generation, in one command.
///
/// Why not one transaction, like `complete_in`: MongoDB (6.0) checks every index of a
/// collection against its durable catalog for each document a transaction writes, which made
/// a transactional delete of a delivery cost twice a plain one (`perf` on `mongod`: a fifth of
/// its time in a drain went to those checks), and completion is what every delivery pays.
/// Nothing here needs the atomicity: the generation fences each delete on its own (a takeover
/// moves it before anything else), and an event is stamped before its delivery goes, so a
/// crash in between leaves a stamped event whose delivery runs again, never a finished
/// delivery whose event looks never completed. Returns the deliveries it completed.
async fn complete_each(store: &MongoStore, leases: &[Lease], now: DateTime) -> Result<HashSet<ObjectId>, StoreError> {
    let projection = doc! { delivery::ID: 1, delivery::EVENT_ID: 1, delivery::CLAIMS: 1 };
    let generations = lease_generations(leases.iter());
    let (epochs, found) = futures::try_join!(
        lane_epochs(store, None, leases.iter().map(|l| l.lane)),
        generations::find_current(store, &generations, Some(projection), None),
    )?;
    let events: HashMap<ObjectId, Bson> = found
        .into_iter()
        .filter_map(|d| Some((d.get_object_id(delivery::ID).ok()?, d.get(delivery::EVENT_ID)?.clone())))
        .collect();
    let current = current(leases, &epochs, &events);
    let mut completed: HashSet<ObjectId> = current.iter().map(|l| l.delivery).collect();
    if !current.is_empty() {
        let event_ids: Vec<&Bson> = current.iter().map(|l| &events[&l.delivery]).collect();
        // Applied only, as the delete after it: the next delivery of a completed one's key runs
        // only after a claim's majority record (or a hand-out's durable list) that comes after
        // both on the same primary and makes them durable (a failover that loses them runs the
        // delivery again, never after a later one of its key).
        store
            .collections
            .events
            .update_many(doc! { "_id": { "$in": event_ids } }, doc! { "$max": { crate::event::field::COMPLETED_AT: now } })
            .hint(super::by_id())
            .write_concern(mongodb::options::WriteConcern::nodes(1))
            .await?;
        let deleted = generations::delete_current(store, &lease_generations(current.iter().copied())).await?;
        if deleted < current.len() as u64 {
            // A takeover moved some on between the read and the delete: those are still there
            // (one that is gone was deleted here, or completed by its new holder after running
            // again: completed either way).
            unstored::forget_stored(store, &mut completed).await?;
        }
    }
    Ok(completed)
}

/// The primitives the shared outcomes (`crate::store::outcome`) are written over.
impl OutcomeBackend for MongoStore {
    type Tx = MongoTx;

    fn claimer(&self) -> &Claimer {
        &self.claimer
    }

    fn completion_history(&self) -> bool {
        self.options.completion_history
    }

    async fn complete_stored(&self, tx: Option<&mut MongoTx>, leases: &[Lease], now: DateTime) -> Result<HashSet<ObjectId>, StoreError> {
        match tx {
            Some(tx) => complete_in_session(self, tx.session(), leases, EventStamp::Outside, now).await,
            // A history record is written exactly when its delivery goes.
            None if self.options.completion_history => {
                transaction!(self, |tx| complete_in_session(self, tx.session(), leases, EventStamp::InTransaction, now).await)
            }
            None => complete_each(self, leases, now).await,
        }
    }

    /// See [`unstored::complete`].
    async fn complete_unstored(
        &self,
        tx: Option<&mut MongoTx>,
        entries: &[(Lease, unstored::Entry)],
        now: DateTime,
    ) -> Result<HashSet<ObjectId>, StoreError> {
        let mut session = tx.map(|tx| tx.session());
        let epochs = lane_epochs(self, session.as_deref_mut(), entries.iter().map(|(l, _)| l.lane)).await?;
        let current: Vec<unstored::Entry> =
            entries.iter().filter(|(l, _)| epochs.get(&l.lane) == Some(&l.epoch)).map(|(_, e)| e.clone()).collect();
        if current.is_empty() {
            return Ok(HashSet::new());
        }
        unstored::complete(self, &current, session, now).await
    }

    /// In a transaction of its own (see [`unstored::materialize`]), whatever `tx`.
    async fn materialize(&self, _tx: Option<&mut MongoTx>, entries: &[unstored::Entry], now: DateTime) -> Result<(), StoreError> {
        unstored::materialize(self, entries, unstored::Charge::Nothing, now).await
    }

    async fn change_stored(&self, tx: Option<&mut MongoTx>, leases: &[Lease], change: Change<'_>, now: DateTime) -> Result<usize, StoreError> {
        let update = match change {
            Change::Reschedule { due_at, error } => doc! {
                "$inc": { delivery::ATTEMPTS: 1, delivery::CLAIMS: 1_i64 },
                "$set": { delivery::DUE_AT: due_at, delivery::LAST_ERROR: error, delivery::UPDATED_AT: now },
            },
            Change::Bury { reason, charge_attempt } => burial(reason, charge_attempt, now),
            // A graceful stop's batch: one command, fenced by the generations alone.
            Change::HandBack => {
                let update = doc! { "$inc": { delivery::CLAIMS: 1_i64 }, "$set": { delivery::UPDATED_AT: now } };
                return Ok(generations::update_current(self, &lease_generations(leases.iter()), &update).await? as usize);
            }
        };
        let mut session = tx.map(|tx| tx.session());
        let epochs = lane_epochs(self, session.as_deref_mut(), leases.iter().map(|l| l.lane)).await?;
        let mut changed = 0;
        for lease in leases.iter().filter(|l| epochs.get(&l.lane) == Some(&l.epoch)) {
            let mut filter = generation_filter(lease.delivery, lease.claims);
            filter.insert(delivery::STATUS, delivery::PENDING);
            let update = self.collections.deliveries.update_one(filter, update.clone());
            let result = match session.as_deref_mut() {
                Some(session) => update.session(session).await?,
                None => update.await?,
            };
            changed += result.matched_count as usize;
        }
        Ok(changed)
    }

    /// The lease's lane still has its epoch, and its delivery is at its generation (or,
    /// without a document, still listed by its event). A transaction that found otherwise read
    /// a snapshot behind a write acknowledged already (a fan-out's commit or a hand-out's lane
    /// take, acknowledged once applied, or a materialization committed after the transaction
    /// began).
    async fn honoured_outside(&self, lease: &Lease) -> Result<bool, StoreError> {
        if !lane_current(self, lease).await? {
            return Ok(false);
        }
        if let Some(handed_out) = self.claimer.unstored(lease) {
            let entry = unstored::Entry::of_lease(lease, handed_out);
            if !unstored::unfinished(self, std::slice::from_ref(&entry)).await?.is_empty() {
                return Ok(true);
            }
        }
        let projection = doc! { delivery::ID: 1, delivery::CLAIMS: 1 };
        let pairs = lease_generations(std::iter::once(lease));
        Ok(!generations::find_current(self, &pairs, Some(projection), None).await?.is_empty())
    }

    fn settles_on_commit(tx: &mut MongoTx, lease: Lease) {
        tx.settles_on_commit(lease);
    }
}

/// Whether the lease's lane still has its epoch (read outside any transaction).
async fn lane_current(store: &MongoStore, lease: &Lease) -> Result<bool, StoreError> {
    Ok(store
        .collections
        .lanes
        .find_one(doc! { lane::ID: i32::from(lease.lane), lane::EPOCH: lease.epoch })
        .projection(doc! { lane::ID: 1 })
        .await?
        .is_some())
}

pub(super) fn burial(reason: &str, charge_attempt: bool, now: DateTime) -> Document {
    doc! {
        "$inc": { delivery::ATTEMPTS: i32::from(charge_attempt), delivery::CLAIMS: 1_i64 },
        "$set": {
            delivery::STATUS: delivery::DEAD,
            delivery::LANE: delivery::DEAD,
            delivery::LAST_ERROR: reason,
            delivery::UPDATED_AT: now,
        },
    }
}

pub(super) async fn extend_lease(store: &MongoStore, leases: &[Lease], now: DateTime) -> Result<Vec<bool>, StoreError> {
    let issued: Vec<Lease> = leases.iter().filter(|l| store.claimer.issued(l)).copied().collect();
    if issued.is_empty() {
        return Ok(vec![false; leases.len()]);
    }
    let until = store.claimer.lease_until(now);
    let holder = &store.claimer.holder;
    // The generation check and the lane extension in one transaction, so a stale lease never
    // extends the lane of a newer claim.
    let extended: HashSet<ObjectId> = transaction!(store, |tx| {
        let session = tx.session();
        let projection = doc! { delivery::ID: 1, delivery::CLAIMS: 1 };
        let found = generations::find_current(store, &lease_generations(issued.iter()), Some(projection), Some(&mut *session)).await?;
        // A delivery without a document runs while its lease is issued: its lane is checked.
        let found: HashSet<ObjectId> = found
            .iter()
            .filter_map(|d| d.get_object_id(delivery::ID).ok())
            .chain(issued.iter().filter(|l| store.claimer.unstored(l).is_some()).map(|l| l.delivery))
            .collect();
        let lanes: BTreeSet<(LaneId, i64)> =
            issued.iter().filter(|l| found.contains(&l.delivery)).map(|l| (l.lane, l.epoch)).collect();
        let mut renewed = HashSet::new();
        for (lane_id, epoch) in lanes {
            let result = store
                .collections
                .lanes
                .update_one(
                    doc! { lane::ID: i32::from(lane_id), lane::EPOCH: epoch, lane::OWNER: &holder.owner, lane::INSTANCE: &holder.instance },
                    doc! { "$max": { lane::LEASE_EXPIRES_AT: until } },
                )
                .session(&mut *session)
                .await?;
            if result.matched_count == 1 {
                renewed.insert((lane_id, epoch));
            }
        }
        Ok(issued
            .iter()
            .filter(|l| found.contains(&l.delivery) && renewed.contains(&(l.lane, l.epoch)))
            .map(|l| l.delivery)
            .collect())
    })?;
    Ok(leases.iter().map(|l| store.claimer.issued(l) && extended.contains(&l.delivery)).collect())
}

pub(super) async fn relinquish(store: &MongoStore) -> Result<(), StoreError> {
    let holder = &store.claimer.holder;
    for (lane_id, epoch, unsettled) in store.claimer.take_held().await {
        // With nothing of ours unsettled the in-flight list is history and goes; otherwise
        // it stays, and the next taker charges what of it is still current.
        let mut release = doc! { lane::OWNER: Bson::Null, lane::INSTANCE: Bson::Null };
        if !unsettled {
            release.insert(lane::IN_FLIGHT, Vec::<Bson>::new());
        }
        store
            .collections
            .lanes
            .update_one(
                doc! { lane::ID: i32::from(lane_id), lane::EPOCH: epoch, lane::OWNER: &holder.owner, lane::INSTANCE: &holder.instance },
                doc! { "$set": release },
            )
            .await?;
    }
    Ok(())
}

pub(super) async fn requeue(store: &MongoStore, delivery_id: &str, now: DateTime) -> Result<(), StoreError> {
    // Only a well-formed ObjectId reaches a query, so an admin input cannot become an operator.
    let id = ObjectId::parse_str(delivery_id).map_err(|_| StoreError::DeliveryNotFound(delivery_id.to_string()))?;
    let requeued = store
        .collections
        .deliveries
        .find_one_and_update(
            doc! { delivery::ID: id, delivery::STATUS: delivery::DEAD },
            doc! {
                "$set": {
                    delivery::STATUS: delivery::PENDING,
                    delivery::LANE: delivery::READY,
                    delivery::ATTEMPTS: 0,
                    delivery::DUE_AT: now,
                    delivery::UPDATED_AT: now,
                    delivery::REQUEUED_AT: now,
                },
                "$inc": { delivery::CLAIMS: 1_i64 },
            },
        )
        .projection(doc! { delivery::HANDLER: 1, delivery::KEY: 1 })
        .await?;
    if let Some(requeued) = requeued {
        // Back before its key's followers: none of them leads its key any more by having
        // been created behind a delivery that is gone (see `NewDelivery::behind`).
        if let (Ok(handler), Ok(key)) = (requeued.get_str(delivery::HANDLER), requeued.get_str(delivery::KEY)) {
            store
                .collections
                .deliveries
                .update_many(
                    doc! { delivery::LANE: delivery::PARKED, delivery::HANDLER: handler, delivery::KEY: key },
                    doc! { "$unset": { delivery::BEHIND: "" } },
                )
                .await?;
        }
        return Ok(());
    }
    let exists = store.collections.deliveries.find_one(doc! { delivery::ID: id }).projection(doc! { delivery::ID: 1 }).await?;
    Err(if exists.is_some() {
        StoreError::NotDead(delivery_id.to_string())
    } else {
        StoreError::DeliveryNotFound(delivery_id.to_string())
    })
}

pub(super) async fn bury_pending_in(
    store: &MongoStore,
    tx: &mut MongoTx,
    delivery_id: &str,
    reason: &str,
    now: DateTime,
) -> Result<DeliveryView, StoreError> {
    // Only a well-formed ObjectId reaches a query, so an admin input cannot become an operator.
    let id = ObjectId::parse_str(delivery_id).map_err(|_| StoreError::DeliveryNotFound(delivery_id.to_string()))?;
    let refused = |why: String| StoreError::NotBuriable { id: delivery_id.to_string(), why };
    let session = tx.session();
    let found = store
        .collections
        .deliveries
        .find_one(doc! { delivery::ID: id })
        .session(&mut *session)
        .await?
        .ok_or_else(|| StoreError::DeliveryNotFound(delivery_id.to_string()))?;
    let before = view(&found)?;
    if before.status == DeliveryStatus::Dead {
        return Err(refused("it is dead already".into()));
    }
    let lane_document = store
        .collections
        .lanes
        .find_one(doc! { lane::ID: i32::from(before.lane_id) })
        .session(&mut *session)
        .await?
        .ok_or_else(|| StoreError::Corrupt(format!("lane {} is missing; run setup", before.lane_id)))?;
    let lane_now = lane_state(&lane_document)?;
    if let Some(owner) = lane_now.owner.as_deref().filter(|_| lane_now.lease_expires_at > now) {
        return Err(refused(format!(
            "its lane {} is leased by {owner} until {}; try again once that host lets it go, or stop that host",
            before.lane_id,
            lane_now.lease_expires_at.try_to_rfc3339_string().unwrap_or_default()
        )));
    }
    // Moving the epoch on fails any claim of this lane that read it before this burial.
    store
        .collections
        .lanes
        .update_one(doc! { lane::ID: i32::from(before.lane_id), lane::EPOCH: lane_now.epoch }, doc! { "$inc": { lane::EPOCH: 1_i64 } })
        .session(&mut *session)
        .await?;
    let claims = found.get_i64(delivery::CLAIMS).or_else(|_| found.get_i32(delivery::CLAIMS).map(i64::from)).unwrap_or(0);
    let mut filter = generation_filter(id, claims);
    filter.insert(delivery::STATUS, delivery::PENDING);
    let result = store.collections.deliveries.update_one(filter, burial(reason, false, now)).session(&mut *session).await?;
    if result.matched_count != 1 {
        return Err(refused("it changed while it was being buried; try again".into()));
    }
    if let Some(key) = &before.key {
        // Its key's next delivery may wait parked behind it: it leads the key now. Hosts
        // unpark only the keys they settled themselves between their sweeps.
        let next = super::heads::key_head(store, &before.handler, key, Some(&mut *session)).await?;
        if let Some((next, _)) = next.filter(|(_, lane)| lane == delivery::PARKED) {
            store
                .collections
                .deliveries
                .update_one(doc! { delivery::ID: next }, documents::unparked())
                .session(&mut *session)
                .await?;
        }
    }
    Ok(before)
}
