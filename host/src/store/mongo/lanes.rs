//! The claim primitives in MongoDB: each is one query or one write (or a bounded parallel
//! set of them), on the claim, ordering and parked indexes. The `ClaimBackend` implementation
//! in MongoDB: every primitive the shared claim calls, together, so that each can be checked
//! against its contract in `store/claim/` and its twin in `store/memory/lanes.rs`; finding the
//! heads of keys, which unparking and the scan share, is in `heads.rs`, the search of free lanes
//! with due work in `free_lanes.rs`, and the filters and updates of lane documents that several
//! primitives send are in `lane_statements.rs`.

use std::collections::{HashMap, HashSet};

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;

use super::{Commit, MongoStore};
use super::documents::{self, delivery, entry, in_flight_document, lane, lane_state};
use super::{generations, suspects, unstored};
use super::lane_statements::{free_lane, held_statement, take_lane, take_statement};
use crate::death::Death;
use crate::lane::LaneId;
use crate::store::claim::{Candidate, ClaimBackend, DueWork, HandlerKey, Holder, InFlight, LaneRecord, LaneState, LaneWrite, Unpark};
use crate::store::claim::{After, CandidateRead, ReadOrder};
use crate::store::{DeliveryId, LOST_WHILE_RUNNING, Lease, StoreError, answered};


/// Up to this many lanes are taken with one `findAndModify` each, in parallel, instead of
/// one update of all and a read of them.
const PARALLEL_TAKES_MAX: usize = 4;

pub(super) struct Backend<'a> {
    pub store: &'a MongoStore,
}

fn generation_pairs(entries: &[InFlight]) -> Vec<(DeliveryId, i64)> {
    entries.iter().map(|entry| (entry.delivery, entry.claims)).collect()
}

fn lane_ids(ids: impl IntoIterator<Item = LaneId>) -> Vec<i32> {
    ids.into_iter().map(i32::from).collect()
}

impl Backend<'_> {
    /// Sends conditional lane updates as one `update` command, acknowledged as `commit`
    /// says; returns how many matched.
    async fn update_each(&self, statements: Vec<Document>, commit: Commit) -> Result<u64, StoreError> {
        let write_in = generations::WriteIn::Alone(commit);
        generations::update_each(self.store, self.store.collections.lanes.name(), statements, write_in).await
    }

    /// Those of `ids` that `holder` holds now.
    async fn held_lanes(&self, ids: &[LaneId], holder: &Holder) -> Result<Vec<LaneState>, StoreError> {
        let documents: Vec<Document> = self
            .store
            .collections
            .lanes
            .find(doc! {
                lane::ID: { "$in": lane_ids(ids.iter().copied()) },
                lane::OWNER: &holder.owner,
                lane::INSTANCE: &holder.instance,
            })
            .batch_size(u32::from(crate::lane::LANE_COUNT) + 1)
            .await?
            .try_collect()
            .await?;
        documents.iter().map(lane_state).collect()
    }
}

impl ClaimBackend for Backend<'_> {
    async fn unpark(&self, handlers: &[String], scope: &Unpark) -> Result<HashMap<HandlerKey, DeliveryId>, StoreError> {
        let deliveries = &self.store.collections.deliveries;
        let mut heads = match scope {
            Unpark::Keys { behind, .. } if !behind.is_empty() => self.followers_of_settled(handlers, behind).await?,
            _ => HashMap::new(),
        };
        let parked_keys: Vec<HandlerKey> = match scope {
            Unpark::Everything => self.parked_keys(handlers).await?,
            Unpark::Keys { keys, .. } => {
                keys.iter().filter(|key| handlers.contains(&key.0) && !heads.contains_key(*key)).cloned().collect()
            }
        };
        if parked_keys.is_empty() {
            return Ok(heads);
        }
        let mut movable = Vec::new();
        for (key, id, lane) in self.heads(&parked_keys).await? {
            if lane == delivery::PARKED {
                movable.push(id);
            }
            heads.insert(key, id);
        }
        if !movable.is_empty() {
            deliveries
                .update_many(
                    doc! { delivery::ID: { "$in": movable }, delivery::LANE: delivery::PARKED },
                    documents::unparked(),
                )
                .hint(super::by_id())
                // Applied only, as in `followers_of_settled`.
                .write_concern(Commit::Applied.write_concern())
                .await?;
        }
        Ok(heads)
    }

    async fn lanes(&self, ids: &[LaneId]) -> Result<Vec<LaneState>, StoreError> {
        let documents: Vec<Document> = self
            .store
            .collections
            .lanes
            .find(doc! { lane::ID: { "$in": lane_ids(ids.iter().copied()) } })
            .batch_size(u32::from(crate::lane::LANE_COUNT) + 1)
            .await?
            .try_collect()
            .await?;
        documents.iter().map(lane_state).collect()
    }

    async fn free_lanes_with_due_work(
        &self,
        handlers: &[String],
        due: DueWork<'_>,
        count: usize,
        wanted: usize,
    ) -> Result<Vec<(LaneId, usize)>, StoreError> {
        super::free_lanes::free_lanes_with_due_work(self.store, handlers, due, count, wanted).await
    }

    async fn take_lanes(&self, ids: &[LaneId], holder: &Holder, now: DateTime, until: DateTime) -> Result<Vec<LaneState>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let take = take_lane(holder, until, None);
        if ids.len() <= PARALLEL_TAKES_MAX {
            // A few lanes (a fresh commit's): each taken and read back in one round trip.
            let taken = answered::every(ids.iter().map(|id| {
                self.store
                    .collections
                    .lanes
                    .find_one_and_update(free_lane(*id, now), take.clone())
                    .return_document(mongodb::options::ReturnDocument::After)
                    .into_future()
            }))
            .await?;
            return taken.iter().flatten().map(lane_state).collect();
        }
        let statements = ids.iter().map(|id| doc! { "q": free_lane(*id, now), "u": take.clone() }).collect();
        if self.update_each(statements, Commit::Majority).await? == 0 {
            return Ok(Vec::new());
        }
        // What we took is ours under a live lease now, so nobody changes it before this read.
        let taken = self.held_lanes(ids, holder).await?;
        Ok(taken.into_iter().filter(|lane| lane.lease_expires_at == until).collect())
    }

    async fn take_listing(
        &self,
        lanes: &[(LaneId, Vec<InFlight>)],
        holder: &Holder,
        now: DateTime,
        until: DateTime,
        write: LaneWrite,
    ) -> Result<Vec<(LaneId, i64)>, StoreError> {
        // One round trip per lane, all at once: a hand-out names the lanes of a few events.
        let taken = answered::every(lanes.iter().map(|(id, entries)| {
            let mut filter = free_lane(*id, now);
            filter.insert(lane::IN_FLIGHT, doc! { "$size": 0 });
            self.store
                .collections
                .lanes
                .find_one_and_update(filter, take_lane(holder, until, Some(entries)))
                .return_document(mongodb::options::ReturnDocument::After)
                .write_concern(Commit::from(write).write_concern())
                .into_future()
        }))
        .await?;
        taken.iter().flatten().map(|document| lane_state(document).map(|lane| (lane.id, lane.epoch))).collect()
    }

    async fn charge_lost(&self, entries: &[InFlight], now: DateTime) -> Result<(), StoreError> {
        // A delivery its fan-out handed out without a document gets one, charged as the
        // others are, in the transaction that writes it (or, its fan-out not committed, its
        // event is named suspect there, see `unstored::materialize`).
        unstored::materialize(self.store, &unstored::Entry::listed(entries), unstored::Charge::Takeover, now).await?;
        // Keyed runs handed out before their fan-out committed, which brings their document:
        // named beside the charge, once their event is free (see `suspects`).
        let lost_uncommitted = entries
            .iter()
            .filter(|entry| entry.unstored.is_none() && entry.started)
            .filter_map(|entry| Some((entry.before_commit.clone()?.0, entry.handler.clone())))
            .collect();
        let (started, waiting): (Vec<&InFlight>, Vec<&InFlight>) =
            entries.iter().filter(|entry| entry.unstored.is_none()).partition(|entry| entry.started);
        let charged = doc! {
            "$inc": { delivery::ATTEMPTS: 1, delivery::CLAIMS: 1_i64 },
            "$set": { delivery::LAST_ERROR: LOST_WHILE_RUNNING, delivery::UPDATED_AT: now },
        };
        // Unrecorded, it may have started all the same: suspect from now on (see
        // `Candidate::suspect`), not charged.
        let moved_on = doc! { "$inc": { delivery::CLAIMS: 1_i64 }, "$set": { delivery::SUSPECT: true } };
        let pairs = |entries: Vec<&InFlight>| entries.into_iter().map(|entry| (entry.delivery, entry.claims)).collect::<Vec<_>>();
        let (started, waiting) = (pairs(started), pairs(waiting));
        let charges = answered::both(
            async { if started.is_empty() { Ok(0) } else { generations::update_current(self.store, &started, &charged).await } },
            async { if waiting.is_empty() { Ok(0) } else { generations::update_current(self.store, &waiting, &moved_on).await } },
        );
        let (charged, ()) = futures::join!(charges, suspects::name(self.store, lost_uncommitted));
        charged.map(|_| ())
    }

    async fn record_starts(&self, holder: &Holder, lanes: &[(LaneId, i64, Vec<DeliveryId>)]) -> Result<Vec<bool>, StoreError> {
        // One statement per lane, all at once: a batch of starts touches a few lanes.
        let started = format!("{}.$[started].{}", lane::IN_FLIGHT, entry::STARTED);
        let listed = format!("{}.{}", lane::IN_FLIGHT, entry::DELIVERY);
        let writes = lanes.iter().map(|(id, epoch, deliveries)| {
            let filter = doc! {
                lane::ID: i32::from(*id),
                lane::OWNER: &holder.owner,
                lane::INSTANCE: &holder.instance,
                lane::EPOCH: *epoch,
                &listed: { "$all": deliveries },
            };
            self.store
                .collections
                .lanes
                .update_one(filter, doc! { "$unset": { &started: "" } })
                .array_filters(vec![doc! { format!("started.{}", entry::DELIVERY): { "$in": deliveries } }])
                .write_concern(Commit::from(LaneWrite::Applied).write_concern())
                .into_future()
        });
        let results = answered::every(writes).await?;
        Ok(results.iter().map(|result| result.matched_count == 1).collect())
    }

    async fn current(&self, entries: &[InFlight]) -> Result<HashSet<DeliveryId>, StoreError> {
        let projection = doc! { delivery::ID: 1, delivery::CLAIMS: 1 };
        let (pairs, without_document) = (generation_pairs(entries), unstored::Entry::listed(entries));
        let (documents, unfinished) = futures::try_join!(
            generations::find_current(self.store, &pairs, Some(projection), None),
            // Those without a document run while their event lists them.
            unstored::unfinished(self.store, &without_document),
        )?;
        Ok(documents.iter().filter_map(|d| d.get_object_id(delivery::ID).ok()).chain(unfinished).collect())
    }

    async fn candidates(
        &self,
        lanes: &[LaneId],
        handlers: &[String],
        now: DateTime,
        CandidateRead { order, after, running, full_keys }: CandidateRead<'_>,
        limit: usize,
    ) -> Result<Vec<Candidate>, StoreError> {
        let mut filter = doc! {
            delivery::LANE: delivery::READY,
            delivery::LANE_ID: { "$in": lane_ids(lanes.iter().copied()) },
            delivery::DUE_AT: { "$lte": now },
            delivery::HANDLER: { "$in": handlers },
        };
        if !running.is_empty() {
            // `_id` is in the claim index, so these are skipped without reading a document.
            filter.insert(delivery::ID, doc! { "$nin": running.iter().copied().collect::<Vec<_>>() });
        }
        if !full_keys.is_empty() {
            // Not in the index: the rows of a full key are read by the server, not sent.
            let full: Vec<Document> =
                full_keys.iter().map(|(handler, key)| doc! { delivery::HANDLER: handler, delivery::GROUP: key }).collect();
            filter.insert("$nor", full);
        }
        let (sort, index) = match order {
            ReadOrder::Due => (doc! { delivery::DUE_AT: 1, delivery::ID: 1 }, "claim"),
            ReadOrder::Priority => {
                filter.insert(delivery::PRIORITY, doc! { "$exists": true });
                (doc! { delivery::PRIORITY: -1, delivery::DUE_AT: 1, delivery::ID: 1 }, super::setup::CLAIM_BY_PRIORITY)
            }
        };
        match (order, after) {
            (_, None) => {}
            (ReadOrder::Due, Some(After { due_at, id, .. })) => {
                filter.insert(
                    "$or",
                    vec![
                        doc! { delivery::DUE_AT: { "$gt": due_at } },
                        doc! { delivery::DUE_AT: due_at, delivery::ID: { "$gt": id } },
                    ],
                );
            }
            (ReadOrder::Priority, Some(After { priority, due_at, id })) => {
                let priority = priority.unwrap_or(i32::MIN);
                filter.insert(
                    "$or",
                    vec![
                        doc! { delivery::PRIORITY: { "$lt": priority } },
                        doc! { delivery::PRIORITY: priority, delivery::DUE_AT: { "$gt": due_at } },
                        doc! { delivery::PRIORITY: priority, delivery::DUE_AT: due_at, delivery::ID: { "$gt": id } },
                    ],
                );
            }
        }
        let documents: Vec<Document> = self
            .store
            .collections
            .deliveries
            .find(filter)
            .sort(sort)
            .limit(limit as i64)
            .batch_size(super::documents::one_batch(limit))
            .hint(mongodb::options::Hint::Name(index.to_string()))
            .projection(doc! {
                delivery::ID: 1, delivery::EVENT_ID: 1, delivery::HANDLER: 1, delivery::KEY: 1, delivery::GROUP: 1, delivery::PRIORITY: 1, delivery::LANE_ID: 1,
                delivery::DUE_AT: 1, delivery::CLAIMS: 1, delivery::ATTEMPTS: 1, delivery::SUSPECT: 1,
            })
            .await?
            .try_collect()
            .await?;
        documents.iter().map(documents::candidate).collect()
    }

    async fn key_heads(&self, keys: &[HandlerKey]) -> Result<HashMap<HandlerKey, DeliveryId>, StoreError> {
        Ok(self.heads(keys).await?.into_iter().map(|(key, id, _)| (key, id)).collect())
    }

    async fn park(&self, ids: &[DeliveryId]) -> Result<(), StoreError> {
        self.store
            .collections
            .deliveries
            .update_many(
                doc! { delivery::ID: { "$in": ids }, delivery::LANE: delivery::READY },
                doc! { "$set": { delivery::LANE: delivery::PARKED } },
            )
            .hint(super::by_id())
            .await?;
        Ok(())
    }

    async fn record(&self, holder: &Holder, records: &[LaneRecord], write: LaneWrite) -> Result<Vec<bool>, StoreError> {
        let mut statements = Vec::new();
        let mut held = Vec::new();
        for record in records {
            match record.takes_free_at {
                Some(now) => statements.push(take_statement(holder, record, now)),
                None => held.push(record),
            }
        }
        statements.extend(held_statement(holder, &held));
        if self.update_each(statements, write.into()).await? as usize == records.len() {
            return Ok(vec![true; records.len()]);
        }
        // Some lane changed hands (its lease had expired): those records did not match.
        let ids: Vec<LaneId> = records.iter().map(|r| r.lane).collect();
        let held = self.held_lanes(&ids, holder).await?;
        Ok(records.iter().map(|r| held.iter().any(|lane| lane.id == r.lane && lane.epoch == r.epoch)).collect())
    }

    async fn hand_back(&self, holder: &Holder, lanes: &[(LaneId, i64)], _now: DateTime) -> Result<(), StoreError> {
        let statements = lanes
            .iter()
            .map(|(id, epoch)| {
                doc! {
                    "q": { lane::ID: i32::from(*id), lane::EPOCH: *epoch, lane::OWNER: &holder.owner, lane::INSTANCE: &holder.instance },
                    "u": { "$set": { lane::OWNER: Bson::Null, lane::INSTANCE: Bson::Null, lane::IN_FLIGHT: [] } },
                }
            })
            .collect();
        self.update_each(statements, Commit::Majority).await?;
        Ok(())
    }

    async fn events(&self, ids: &[String]) -> Result<HashMap<String, Document>, StoreError> {
        let documents: Vec<Document> =
            self.store
                .collections
                .events
                .find(doc! { "_id": { "$in": ids } })
                .hint(super::by_id())
                .batch_size(super::documents::one_batch(ids.len()))
                .await?
                .try_collect()
                .await?;
        Ok(documents
            .into_iter()
            .filter_map(|doc| doc.get_str("_id").ok().map(str::to_string).map(|id| (id, doc)))
            .collect())
    }

    async fn requeued_since(&self, since: DateTime) -> Result<bool, StoreError> {
        Ok(self
            .store
            .collections
            .deliveries
            .find_one(doc! { delivery::REQUEUED_AT: { "$gte": since } })
            .projection(doc! { delivery::ID: 1 })
            .await?
            .is_some())
    }

    async fn give_back(&self, picks: &[(DeliveryId, i64)]) -> Result<(), StoreError> {
        generations::update_current(self.store, picks, &doc! { "$inc": { delivery::CLAIMS: 1_i64 } }).await?;
        Ok(())
    }

    async fn bury_unrunnable(&self, doomed: &[(DeliveryId, i64, String)], now: DateTime) -> Result<(), StoreError> {
        // Rare (an event deleted or rewritten under its deliveries), so one statement each, in
        // the transaction that publishes each death.
        let store = self.store;
        transaction!(store, |tx| {
            let session = tx.session();
            for (id, claims, reason) in doomed {
                let buried = store
                    .collections
                    .deliveries
                    .find_one_and_update(
                        doc! { delivery::ID: *id, delivery::CLAIMS: *claims, delivery::STATUS: delivery::PENDING },
                        doc! {
                            "$set": {
                                delivery::STATUS: delivery::DEAD, delivery::LANE: delivery::DEAD,
                                delivery::LAST_ERROR: reason, delivery::UPDATED_AT: now,
                            },
                            "$inc": { delivery::CLAIMS: 1_i64 },
                        },
                    )
                    .session(&mut *session)
                    .await?;
                let Some(buried) = buried else { continue };
                let view = documents::view(&buried)?;
                let death = Death {
                    id: format!("dead:{}:{}", view.id, claims),
                    delivery_id: view.id.clone(),
                    event_id: &view.event_id,
                    event_type: &view.event_type,
                    handler: &view.handler,
                    key: view.key.as_deref(),
                    attempts: view.attempts,
                    reason,
                };
                if death.announced() {
                    store.publisher.publish(&mut *session, &death.event()).await?;
                }
            }
            Ok(())
        })
    }

    async fn reconcile(&self, holder: &Holder, issued: &HashSet<Lease>) -> Result<(), StoreError> {
        // Plain reads and writes, not a transaction: a transaction reads a snapshot that may
        // not hold the latest writes acknowledged once applied yet (a hand-out's lane write,
        // a fan-out's deliveries) while others are in flight, and what it did not see it left
        // as it was. Nothing here needs one: each generation moves on only from the one
        // listed, and each lane is rewritten only under its epoch, which only this instance
        // moves while it holds the lane (and its claims wait for this). A failure in between
        // leaves entries listed at generations that are gone, which nothing charges or runs.
        let collections = &self.store.collections;
        let documents: Vec<Document> = collections
            .lanes
            .find(doc! { lane::OWNER: &holder.owner, lane::INSTANCE: &holder.instance })
            .await?
            .try_collect()
            .await?;
        for document in &documents {
            let state = lane_state(document)?;
            let (kept, dropped): (Vec<InFlight>, Vec<InFlight>) = state.in_flight.into_iter().partition(|entry| {
                issued.contains(&Lease { delivery: entry.delivery, lane: state.id, epoch: state.epoch, claims: entry.claims })
            });
            if dropped.is_empty() {
                continue;
            }
            let bump = doc! { "$inc": { delivery::CLAIMS: 1_i64 } };
            generations::update_current(self.store, &generation_pairs(&dropped), &bump).await?;
            let entries: Vec<Document> = kept.iter().map(in_flight_document).collect();
            collections
                .lanes
                .update_one(
                    doc! { lane::ID: i32::from(state.id), lane::EPOCH: state.epoch },
                    doc! { "$set": { lane::IN_FLIGHT: entries } },
                )
                .await?;
        }
        Ok(())
    }
}
