//! Operator reads and retention in memory: statistics, listing, purge, as
//! `store/mongo/operations.rs` does them in MongoDB. They only read the state, but for the purge.

use std::collections::{BTreeMap, HashSet};

use bson::{Bson, DateTime, Document};

use super::{Delivery, LaneKind, State};
use crate::event::field;
use crate::store::fan_out::id_text;
use crate::store::backfill::{Backfill, backfill_of, may_reopen};
use crate::store::retention::event_expired;
use crate::store::{DeliveryFilter, DeliveryId, DeliveryPage, DeliveryStatus, DeliveryView, HandlerStatistics, PurgeOptions, PurgeReport};

impl State {
    /// Reopens for fan-out up to `limit` of the events a backfill of `handler` may reopen,
    /// oldest first (see [`crate::store::backfill`]); returns their ids.
    pub(super) fn reopen_for(&mut self, handler: &str, types: &[String], since: Option<DateTime>, limit: usize) -> Vec<Bson> {
        let mut reopenable: Vec<(DateTime, String)> = self
            .events
            .iter()
            .filter(|(_, event)| may_reopen(event, handler, types, since))
            .map(|(id, event)| (event.get_datetime(field::CREATED_AT).copied().unwrap_or(DateTime::MIN), id.clone()))
            .collect();
        reopenable.sort();
        reopenable.truncate(limit);
        let mut ids = Vec::new();
        for (_, id) in reopenable {
            let event = self.events.get_mut(&id).expect("found above");
            event.remove(field::FANNED_OUT_AT);
            event.remove(field::FAN_OUT);
            ids.push(event.get(field::ID).cloned().unwrap_or(Bson::Null));
        }
        ids
    }

    /// How many events a backfill of `handler` leaves waiting for a run (see
    /// [`crate::store::backfill`]).
    pub(super) fn backfill_waiting(&self, handler: &str, types: &[String], since: Option<DateTime>) -> usize {
        self.events.values().filter(|event| backfill_of(event, handler, types, since) == Backfill::Wait).count()
    }

    /// How many of `events` wait for a fan-out.
    pub(super) fn unfanned_among(&self, events: &[Bson]) -> usize {
        events
            .iter()
            .filter(|id| self.events.get(&id_text(id)).is_some_and(|event| !event.contains_key(field::FANNED_OUT_AT)))
            .count()
    }

    pub(super) fn purge(&mut self, options: &PurgeOptions) -> PurgeReport {
        let mut report = PurgeReport::default();
        if let Some(cutoff) = options.dead_before {
            let before = self.deliveries.len();
            self.deliveries.retain(|_, d| {
                !(d.status == DeliveryStatus::Dead && d.updated_at.unwrap_or(d.created_at) < cutoff)
            });
            report.dead_deliveries = (before - self.deliveries.len()) as u64;
        }
        if let Some(cutoff) = options.completed_before {
            let before = self.history.len();
            self.history.retain(|_, record| record.completed_at >= cutoff);
            report.history_records = (before - self.history.len()) as u64;
        }
        let referenced: HashSet<String> = self
            .deliveries
            .values()
            .map(|d| id_text(&d.event_id))
            .chain(self.history.values().map(|r| id_text(&r.event_id)))
            .collect();
        let before = self.events.len();
        // An event still listing a handler in `handedOut` has a delivery running without a record.
        let handed_out = |event: &Document| matches!(event.get(field::HANDED_OUT), Some(Bson::Array(list)) if !list.is_empty());
        let mut keys_gone: HashSet<String> = HashSet::new();
        self.events.retain(|id, event| {
            let keep = referenced.contains(id) || handed_out(event) || !event_expired(event, options);
            if !keep && let Ok(key) = event.get_str(field::KEY) {
                keys_gone.insert(key.to_string());
            }
            keep
        });
        report.events = (before - self.events.len()) as u64;
        // A key's counter goes once none of its events remains.
        for event in self.events.values() {
            if let Ok(key) = event.get_str(field::KEY) {
                keys_gone.remove(key);
            }
        }
        for key in keys_gone {
            report.key_counters += u64::from(self.key_sequences.remove(&key).is_some());
        }
        report
    }

    /// What [`State::purge`] would delete, counted as the MongoDB store counts it.
    pub(super) fn purge_preview(&self, options: &PurgeOptions) -> PurgeReport {
        let dead = |d: &&Delivery| d.status == DeliveryStatus::Dead && options.dead_before.is_some_and(|cutoff| d.updated_at.unwrap_or(d.created_at) < cutoff);
        PurgeReport {
            dead_deliveries: self.deliveries.values().filter(dead).count() as u64,
            history_records: self.history.values().filter(|r| options.completed_before.is_some_and(|cutoff| r.completed_at < cutoff)).count() as u64,
            events: self.events.values().filter(|event| event_expired(event, options)).count() as u64,
            key_counters: 0,
        }
    }


    pub(super) fn statistics(&self, now: DateTime, completion_history: bool) -> Vec<HandlerStatistics> {
        let running_entries = self.running(now);
        let running: HashSet<DeliveryId> = running_entries.iter().map(|entry| entry.delivery).collect();
        let mut by_handler: BTreeMap<String, HandlerStatistics> = BTreeMap::new();
        // Those without a record run, and have no record to be counted by below.
        for entry in running_entries.iter().filter(|entry| entry.unstored.is_some()) {
            stats_for(&mut by_handler, &entry.handler).running += 1;
        }
        for (id, d) in &self.deliveries {
            let stats = stats_for(&mut by_handler, &d.handler);
            match d.status {
                DeliveryStatus::Dead => stats.dead += 1,
                DeliveryStatus::Pending => {
                    if running.contains(id) {
                        stats.running += 1;
                    } else {
                        stats.pending += 1;
                    }
                    if d.lane == LaneKind::Parked {
                        stats.parked += 1;
                    }
                    stats.oldest_due_at = Some(stats.oldest_due_at.map_or(d.due_at, |at| at.min(d.due_at)));
                }
            }
        }
        if completion_history {
            for record in self.history.values() {
                *stats_for(&mut by_handler, &record.handler).completed.get_or_insert(0) += 1;
            }
            for stats in by_handler.values_mut() {
                stats.completed.get_or_insert(0);
            }
        }
        by_handler.into_values().collect()
    }


    pub(super) fn list_deliveries(&self, filter: &DeliveryFilter, after: Option<DeliveryId>) -> DeliveryPage {
        let limit = filter.page_limit();
        let running: HashSet<DeliveryId> = self.running(DateTime::now()).iter().map(|entry| entry.delivery).collect();
        let matches = |id: &DeliveryId, d: &Delivery| {
            filter.status.is_none_or(|s| d.status == s)
                && filter.running.is_none_or(|r| running.contains(id) == r)
                && filter.parked.is_none_or(|p| (d.lane == LaneKind::Parked) == p)
                && filter.created_before.is_none_or(|before| d.created_at < before)
                && filter.handler.as_ref().is_none_or(|h| &d.handler == h)
                && filter.event_type.as_ref().is_none_or(|t| &d.event_type == t)
                && filter.event_id.as_ref().is_none_or(|e| id_text(&d.event_id) == *e)
                && filter.key.as_ref().is_none_or(|k| d.key.as_ref() == Some(k))
        };
        let range = match after {
            Some(after) => self.deliveries.range((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded)),
            None => self.deliveries.range(..),
        };
        let deliveries = range
            .filter(|(id, d)| matches(id, d))
            .take(limit + 1)
            .map(|(id, d)| DeliveryView { running: running.contains(id), ..to_view(id, d) })
            .collect();
        DeliveryPage::from_overfetch(deliveries, limit)
    }

}

pub(super) fn to_view(id: &DeliveryId, d: &Delivery) -> DeliveryView {
    DeliveryView {
        id: id.to_hex(),
        event_id: id_text(&d.event_id),
        event_type: d.event_type.clone(),
        handler: d.handler.clone(),
        key: d.key.clone(),
        sequence: d.sequence,
        limit_key: d.group.clone(),
        priority: d.priority,
        status: d.status,
        lane: d.lane.as_str().to_string(),
        lane_id: d.lane_id,
        attempts: d.attempts,
        due_at: d.due_at,
        created_at: d.created_at,
        updated_at: d.updated_at,
        last_error: d.last_error.clone(),
        running: false,
    }
}

fn stats_for<'m>(map: &'m mut BTreeMap<String, HandlerStatistics>, handler: &str) -> &'m mut HandlerStatistics {
    map.entry(handler.to_string())
        .or_insert_with(|| HandlerStatistics { handler: handler.to_string(), ..Default::default() })
}
