//! The claim primitives of the memory store ([`ClaimBackend`] over its one state), as
//! `store/mongo/lanes.rs` is the MongoDB store's: lanes read, taken, recorded and handed back,
//! candidates scanned, keys' heads looked up, parking, takeover charges. It never decides what
//! a claim picks (the shared claim does).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bson::{DateTime, Document};
use tokio::sync::Mutex;

use super::unstored::{Charge, Entry};
use super::{LaneKind, State};
use crate::death::Death;
use crate::lane::LaneId;
use crate::store::claim::{Candidate, ClaimBackend, DueWork, EventOf, HandlerKey, Holder, InFlight, LaneRecord, LaneState, LaneWrite, Unpark};
use crate::store::claim::{After, CandidateRead, ReadOrder};
use crate::store::fan_out::id_text;
use crate::store::{DeliveryId, DeliveryStatus, LOST_WHILE_RUNNING, Lease, StoreError};

/// Makes `holder` the owner of `lane` until `until`, at its next epoch, if it is free at `now`
/// (no owner, or an expired lease).
pub(super) fn take_if_free(lane: &mut LaneState, holder: &Holder, now: DateTime, until: DateTime) -> bool {
    if lane.owner.is_some() && lane.lease_expires_at >= now {
        return false;
    }
    lane.owner = Some(holder.owner.clone());
    lane.instance = Some(holder.instance.clone());
    lane.lease_expires_at = until;
    lane.epoch += 1;
    true
}

/// The claim primitives over the in-memory state.
pub(super) struct Backend<'a>(pub(super) &'a Arc<Mutex<State>>);

impl ClaimBackend for Backend<'_> {
    async fn unpark(&self, handlers: &[String], scope: &Unpark) -> Result<HashMap<HandlerKey, DeliveryId>, StoreError> {
        Ok(self.0.lock().await.unpark(handlers, scope))
    }

    async fn lanes(&self, ids: &[LaneId]) -> Result<Vec<LaneState>, StoreError> {
        let state = self.0.lock().await;
        Ok(ids.iter().map(|id| state.lanes[usize::from(*id)].clone()).collect())
    }

    async fn free_lanes_with_due_work(
        &self,
        handlers: &[String],
        due: DueWork<'_>,
        count: usize,
        _wanted: usize,
    ) -> Result<Vec<(LaneId, usize)>, StoreError> {
        let now = due.before;
        let state = self.0.lock().await;
        let free_lanes =
            state.lanes.iter().filter(|lane| (lane.owner.is_none() || lane.lease_expires_at < now) && !due.exclude.contains(&lane.id));
        // Lanes whose last holder left deliveries without a record in flight come first: no
        // record shows that work, and it is the oldest there is (it was running).
        let mut stranded: Vec<(LaneId, usize)> = Vec::new();
        let mut free: HashSet<LaneId> = HashSet::new();
        for lane in free_lanes {
            let left = lane.in_flight.iter().filter(|entry| entry.unstored.is_some() && handlers.contains(&entry.handler)).count();
            if left > 0 && stranded.len() < count {
                stranded.push((lane.id, left));
            } else {
                free.insert(lane.id);
            }
        }
        // Each lane's first work in the claim's order (as MongoDB's store reads it).
        let first = |d: &super::Delivery| match due.order {
            ReadOrder::Due => (std::cmp::Reverse(0), d.due_at),
            ReadOrder::Priority => (std::cmp::Reverse(d.priority.unwrap_or(i32::MIN)), d.due_at),
        };
        let mut oldest: BTreeMap<LaneId, ((std::cmp::Reverse<i32>, DateTime), usize)> = BTreeMap::new();
        for d in state.deliveries.values() {
            let ordered = match (due.order, due.above) {
                (ReadOrder::Due, _) => true,
                (ReadOrder::Priority, above) => d.priority.is_some_and(|priority| above.is_none_or(|above| priority > above)),
            };
            if d.lane == LaneKind::Ready
                && ordered
                && free.contains(&d.lane_id)
                && d.due_at <= due.due_before(d.lane_id)
                && handlers.contains(&d.handler)
            {
                let (at, due) = oldest.entry(d.lane_id).or_insert((first(d), 0));
                *at = (*at).min(first(d));
                *due += 1;
            }
        }
        let mut lanes: Vec<((std::cmp::Reverse<i32>, DateTime), LaneId, usize)> =
            oldest.into_iter().map(|(lane, (at, due))| (at, lane, due)).collect();
        lanes.sort();
        let rest = count - stranded.len();
        stranded.extend(lanes.into_iter().take(rest).map(|(_, lane, due)| (lane, due)));
        Ok(stranded)
    }

    async fn take_lanes(&self, lanes: &[LaneId], holder: &Holder, now: DateTime, until: DateTime) -> Result<Vec<LaneState>, StoreError> {
        let mut state = self.0.lock().await;
        let mut taken = Vec::new();
        for id in lanes {
            let lane = &mut state.lanes[usize::from(*id)];
            if take_if_free(lane, holder, now, until) {
                taken.push(lane.clone());
            }
        }
        Ok(taken)
    }

    async fn take_listing(
        &self,
        lanes: &[(LaneId, Vec<InFlight>)],
        holder: &Holder,
        now: DateTime,
        until: DateTime,
        _write: LaneWrite,
    ) -> Result<Vec<(LaneId, i64)>, StoreError> {
        let mut state = self.0.lock().await;
        let mut taken = Vec::new();
        for (id, entries) in lanes {
            let lane = &mut state.lanes[usize::from(*id)];
            if lane.in_flight.is_empty() && take_if_free(lane, holder, now, until) {
                lane.in_flight = entries.clone();
                taken.push((*id, lane.epoch));
            }
        }
        Ok(taken)
    }

    async fn charge_lost(&self, entries: &[InFlight], now: DateTime) -> Result<(), StoreError> {
        let mut state = self.0.lock().await;
        // A delivery its fan-out handed out without a record gets one, charged as the others are.
        state.materialize(&Entry::listed(entries), Charge::Takeover, now);
        for entry in entries.iter().filter(|entry| entry.unstored.is_none()) {
            // A keyed run handed out before its fan-out committed, which it never did.
            if let (true, Some(EventOf(event))) = (entry.started, &entry.before_commit) {
                state.suspect(event, &entry.handler);
            }
            if let Some(d) = state.deliveries.get_mut(&entry.delivery) {
                if d.claims == entry.claims && d.status == DeliveryStatus::Pending {
                    d.claims += 1;
                    if entry.started {
                        d.attempts += 1;
                        d.last_error = Some(LOST_WHILE_RUNNING.to_string());
                        d.updated_at = Some(now);
                    } else {
                        d.suspect = true;
                    }
                }
            }
        }
        Ok(())
    }

    async fn record_starts(&self, holder: &Holder, lanes: &[(LaneId, i64, Vec<DeliveryId>)]) -> Result<Vec<bool>, StoreError> {
        let mut state = self.0.lock().await;
        Ok(lanes
            .iter()
            .map(|(id, epoch, deliveries)| {
                let lane = &mut state.lanes[usize::from(*id)];
                let listed = |d: &DeliveryId| lane.in_flight.iter().any(|entry| entry.delivery == *d);
                let ok = lane.held_by(holder) && lane.epoch == *epoch && deliveries.iter().all(listed);
                if ok {
                    for entry in lane.in_flight.iter_mut().filter(|entry| deliveries.contains(&entry.delivery)) {
                        entry.started = true;
                    }
                }
                ok
            })
            .collect())
    }

    async fn current(&self, entries: &[InFlight]) -> Result<HashSet<DeliveryId>, StoreError> {
        let state = self.0.lock().await;
        Ok(entries.iter().filter(|entry| state.runs(entry)).map(|entry| entry.delivery).collect())
    }

    async fn candidates(
        &self,
        lanes: &[LaneId],
        handlers: &[String],
        now: DateTime,
        CandidateRead { order, after, running, full_keys }: CandidateRead<'_>,
        limit: usize,
    ) -> Result<Vec<Candidate>, StoreError> {
        // The order MongoDB's indexes read them in: a higher priority first, then oldest due.
        let place = |row: &After| match order {
            ReadOrder::Due => (std::cmp::Reverse(0), row.due_at, row.id),
            ReadOrder::Priority => (std::cmp::Reverse(row.priority.unwrap_or(i32::MIN)), row.due_at, row.id),
        };
        let state = self.0.lock().await;
        let mut rows: Vec<Candidate> = state
            .deliveries
            .iter()
            .filter(|(id, d)| {
                !running.contains(*id)
                    && d.lane == LaneKind::Ready
                    && d.due_at <= now
                    && lanes.contains(&d.lane_id)
                    && handlers.contains(&d.handler)
                    && !d.group.as_ref().is_some_and(|group| full_keys.iter().any(|(h, g)| *h == d.handler && g == group))
                    && (order == ReadOrder::Due || d.priority.is_some())
            })
            .map(|(id, d)| Candidate {
                id: *id,
                event_id: id_text(&d.event_id),
                handler: d.handler.clone(),
                key: d.key.clone(),
                group: d.group.clone(),
                priority: d.priority,
                lane: d.lane_id,
                due_at: d.due_at,
                claims: d.claims,
                attempts: d.attempts,
                unstored: None,
                started: false,
                suspect: d.suspect,
                before_commit: None,
            })
            .collect();
        rows.retain(|row| after.is_none_or(|after| place(&After::of(row)) > place(&after)));
        rows.sort_by_key(|row| place(&After::of(row)));
        rows.truncate(limit);
        Ok(rows)
    }

    async fn key_heads(&self, keys: &[HandlerKey]) -> Result<HashMap<HandlerKey, DeliveryId>, StoreError> {
        let state = self.0.lock().await;
        let wanted: HashSet<&HandlerKey> = keys.iter().collect();
        let mut heads: HashMap<HandlerKey, (i64, DeliveryId)> = HashMap::new();
        for (id, d) in &state.deliveries {
            let (Some(key), Some(sequence)) = (&d.key, d.sequence) else { continue };
            if d.status != DeliveryStatus::Pending {
                continue;
            }
            let handler_key = (d.handler.clone(), key.clone());
            if wanted.contains(&handler_key) {
                let head = heads.entry(handler_key).or_insert((sequence, *id));
                if sequence < head.0 {
                    *head = (sequence, *id);
                }
            }
        }
        Ok(heads.into_iter().map(|(key, (_, id))| (key, id)).collect())
    }

    async fn park(&self, ids: &[DeliveryId]) -> Result<(), StoreError> {
        let mut state = self.0.lock().await;
        for id in ids {
            if let Some(d) = state.deliveries.get_mut(id) {
                if d.lane == LaneKind::Ready {
                    d.lane = LaneKind::Parked;
                }
            }
        }
        Ok(())
    }

    async fn record(&self, holder: &Holder, records: &[LaneRecord], _write: LaneWrite) -> Result<Vec<bool>, StoreError> {
        let mut state = self.0.lock().await;
        Ok(records
            .iter()
            .map(|record| {
                let lane = &mut state.lanes[usize::from(record.lane)];
                if let Some(now) = record.takes_free_at {
                    let free = lane.owner.is_none() || lane.lease_expires_at < now;
                    if lane.epoch != record.epoch - 1 || !free || !lane.in_flight.is_empty() {
                        return false;
                    }
                    lane.owner = Some(holder.owner.clone());
                    lane.instance = Some(holder.instance.clone());
                    lane.epoch = record.epoch;
                    lane.lease_expires_at = record.lease_until;
                    lane.in_flight = record.in_flight.clone();
                    return true;
                }
                let ok = lane.epoch == record.epoch && lane.held_by(holder);
                if ok {
                    lane.in_flight = record.in_flight.clone();
                    lane.lease_expires_at = lane.lease_expires_at.max(record.lease_until);
                }
                ok
            })
            .collect())
    }

    async fn hand_back(&self, holder: &Holder, lanes: &[(LaneId, i64)], _now: DateTime) -> Result<(), StoreError> {
        let mut state = self.0.lock().await;
        for (lane, epoch) in lanes {
            let lane = &mut state.lanes[usize::from(*lane)];
            if lane.epoch == *epoch && lane.held_by(holder) {
                lane.owner = None;
                lane.instance = None;
                lane.in_flight.clear();
            }
        }
        Ok(())
    }

    async fn events(&self, ids: &[String]) -> Result<HashMap<String, Document>, StoreError> {
        let state = self.0.lock().await;
        Ok(ids.iter().filter_map(|id| state.events.get(id).map(|doc| (id.clone(), doc.clone()))).collect())
    }

    async fn requeued_since(&self, since: DateTime) -> Result<bool, StoreError> {
        let state = self.0.lock().await;
        Ok(state.deliveries.values().any(|d| d.requeued_at.is_some_and(|at| at >= since)))
    }

    async fn give_back(&self, picks: &[(DeliveryId, i64)]) -> Result<(), StoreError> {
        let mut state = self.0.lock().await;
        for (id, claims) in picks {
            if let Some(d) = state.deliveries.get_mut(id) {
                if d.claims == *claims {
                    d.claims += 1;
                }
            }
        }
        Ok(())
    }

    async fn bury_unrunnable(&self, doomed: &[(DeliveryId, i64, String)], now: DateTime) -> Result<(), StoreError> {
        let mut state = self.0.lock().await;
        for (id, claims, reason) in doomed {
            let Some(d) = state.deliveries.get_mut(id).filter(|d| d.claims == *claims && d.status == DeliveryStatus::Pending)
            else {
                continue;
            };
            d.status = DeliveryStatus::Dead;
            d.lane = LaneKind::Dead;
            d.claims += 1;
            d.last_error = Some(reason.clone());
            d.updated_at = Some(now);
            let (event_id, event_type, handler, key, attempts) =
                (id_text(&d.event_id), d.event_type.clone(), d.handler.clone(), d.key.clone(), d.attempts);
            let death = Death {
                id: format!("dead:{}:{}", id.to_hex(), claims),
                delivery_id: id.to_hex(),
                event_id: &event_id,
                event_type: &event_type,
                handler: &handler,
                key: key.as_deref(),
                attempts,
                reason,
            };
            if death.announced() {
                // Built by the store itself, so it is valid; one published already stays.
                let _ = state.publish(&death.event(), usize::MAX);
            }
        }
        Ok(())
    }

    async fn reconcile(&self, holder: &Holder, issued: &HashSet<Lease>) -> Result<(), StoreError> {
        let mut state = self.0.lock().await;
        let State { lanes, deliveries, .. } = &mut *state;
        for lane in lanes.iter_mut().filter(|lane| lane.held_by(holder)) {
            let (lane_id, epoch) = (lane.id, lane.epoch);
            lane.in_flight.retain(|entry| {
                let keep = issued.contains(&Lease { delivery: entry.delivery, lane: lane_id, epoch, claims: entry.claims });
                if !keep {
                    if let Some(d) = deliveries.get_mut(&entry.delivery) {
                        if d.claims == entry.claims {
                            d.claims += 1;
                        }
                    }
                }
                keep
            });
        }
        Ok(())
    }
}
