//! The handler registry in memory (see [`crate::store::registry`]): the records by handler,
//! and what each host serves beside its announcement, as the MongoDB store keeps them.

use std::collections::BTreeMap;

use bson::DateTime;

use super::{DeliveryStatus, LaneKind, MemoryStore, State};
use crate::store::StoreError;
use crate::store::registry::{self, Declaration, Disposal, RegisteredHandler, RetireReport, Served};

impl MemoryStore {
    pub(super) async fn register_served(&self, declarations: &[Declaration], now: DateTime) -> Result<Vec<RegisteredHandler>, StoreError> {
        let mut state = self.state.lock().await;
        for declaration in declarations {
            let handler = &declaration.subscription.handler;
            let record = state.handlers.entry(handler.clone()).or_insert_with(|| RegisteredHandler {
                handler: handler.clone(),
                event_types: Default::default(),
                in_transaction: false,
                per_key: None,
                priority_from: None,
                plugin: String::new(),
                version: String::new(),
                first_seen: now,
                last_seen: now,
                served_by: Vec::new(),
                retired_at: None,
            });
            if record.retired_at.take().is_some() {
                record.first_seen = now;
            }
            record.event_types = declaration.subscription.event_types.clone();
            record.in_transaction = declaration.subscription.in_transaction;
            record.per_key = declaration.subscription.per_key.clone();
            record.priority_from = declaration.subscription.priority_from.clone();
            record.plugin = declaration.plugin.clone();
            record.version = declaration.version.clone();
            record.last_seen = now;
        }
        state.serves.insert(self.claimer.host_id(), declarations.iter().map(Served::from).collect());
        Ok(handlers_now(&state, now))
    }

    pub(super) async fn registered(&self, now: DateTime) -> Vec<RegisteredHandler> {
        handlers_now(&*self.state.lock().await, now)
    }

    pub(super) async fn retire_handler(&self, handler: &str, disposal: Disposal, now: DateTime) -> Result<RetireReport, StoreError> {
        let mut state = self.state.lock().await;
        registry::check_retirable(&handlers_now(&state, now), handler)?;
        state.handlers.get_mut(handler).expect("checked").retired_at.get_or_insert(now);
        let listed: Vec<_> = state
            .lanes
            .iter()
            .filter(|lane| lane.lease_expires_at > now)
            .flat_map(|lane| lane.in_flight.iter().map(|entry| entry.delivery))
            .collect();
        let mut report = RetireReport::default();
        let waiting: Vec<_> = state
            .deliveries
            .iter()
            .filter(|(_, d)| d.handler == handler && d.status == DeliveryStatus::Pending)
            .map(|(id, _)| *id)
            .collect();
        for id in waiting {
            if listed.contains(&id) {
                report.still_claimed += 1;
                continue;
            }
            report.disposed += 1;
            match disposal {
                Disposal::Drop => {
                    state.deliveries.remove(&id);
                }
                Disposal::Bury => {
                    let d = state.deliveries.get_mut(&id).expect("listed above");
                    d.status = DeliveryStatus::Dead;
                    d.lane = LaneKind::Dead;
                    d.claims += 1;
                    d.last_error = Some(registry::RETIRED.to_string());
                    d.updated_at = Some(now);
                }
            }
        }
        Ok(report)
    }
}

fn handlers_now(state: &State, now: DateTime) -> Vec<RegisteredHandler> {
    let records: BTreeMap<String, RegisteredHandler> = state.handlers.clone();
    let live = state
        .serves
        .iter()
        .filter(|(host, _)| state.hosts.get(*host).is_some_and(|until| *until > now))
        .map(|(host, served)| (host.clone(), served.clone()));
    registry::joined(records, live)
}
