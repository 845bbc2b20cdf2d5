//! The handler registry: which handlers are subscribed, kept in the store, so that an event
//! waits for a handler that is merely absent instead of being fanned out without it.
//!
//! Every host declares the handlers it serves ([`Declaration`]) with its announcements; the
//! store keeps one record per handler ever declared (its event types, transactional or not,
//! the plugin and version that declared it last, first and last seen) and which live hosts
//! serve it now. A fan-out creates deliveries for every active (not retired) handler of the
//! registry, whatever the fanning host has loaded ([`fan_out_subscriptions`]): those it does
//! not serve itself are only ever claimed, by a host that serves them. A handler stays
//! active until an operator retires it ([`Disposal`]); a host that declares it again
//! registers it anew, from then on.
//!
//! This module owns the registry's types and how they become a fan-out's subscriptions. It
//! never decides who serves a handler (hosts say so), never retires one by itself, and the
//! fan-out reads it from the dispatcher's memory, never per event.

use std::collections::{BTreeMap, BTreeSet};

use bson::DateTime;

use super::{StoreError, Subscription, Subscriptions};

/// A handler a host serves, as it declares it to the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declaration {
    pub subscription: Subscription,
    /// The plugin (file name without `.wasm`) that offers it on this host.
    pub plugin: String,
    /// The plugin's version (its content hash).
    pub version: String,
}

/// A handler as the registry keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredHandler {
    pub handler: String,
    /// The event types it subscribes to: those declared last, with those every live host
    /// serving it declares (hosts running two versions in a rolling deploy: both versions').
    pub event_types: BTreeSet<String>,
    pub in_transaction: bool,
    /// How its deliveries of one key run, as declared last (see [`Subscription::per_key`]).
    pub per_key: Option<super::PerKey>,
    /// Where it takes priorities per event from, as declared last.
    pub priority_from: Option<super::PriorityFrom>,
    /// The plugin and version that declared it last.
    pub plugin: String,
    pub version: String,
    /// When a host first declared it (since its last retirement).
    pub first_seen: DateTime,
    /// When a host last declared it.
    pub last_seen: DateTime,
    /// The live hosts that serve it now.
    pub served_by: Vec<String>,
    /// Retired by an operator: fan-outs no longer create its deliveries.
    pub retired_at: Option<DateTime>,
}

impl RegisteredHandler {
    pub fn active(&self) -> bool {
        self.retired_at.is_none()
    }
}

/// What a retirement does with the handler's waiting deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposal {
    /// Made dead with the reason [`RETIRED`], kept as dead letters (listed, requeued, purged
    /// like any other), their deaths not announced one by one.
    Bury,
    /// Deleted.
    Drop,
}

/// The `lastError` of a delivery buried by its handler's retirement.
pub const RETIRED: &str = "its handler was retired by an operator";

/// What [`crate::store::Administration::retire`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetireReport {
    /// Waiting deliveries buried or dropped.
    pub disposed: u64,
    /// Deliveries left alone because a live lease still lists them (a host that stopped serving
    /// the handler hands them back as not run): retire again once they are back.
    pub still_claimed: u64,
}

/// A host's declarations as the registry keeps them on the host's announcement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Served {
    pub handler: String,
    pub event_types: BTreeSet<String>,
    pub in_transaction: bool,
}

impl From<&Declaration> for Served {
    fn from(declaration: &Declaration) -> Self {
        Self {
            handler: declaration.subscription.handler.clone(),
            event_types: declaration.subscription.event_types.clone(),
            in_transaction: declaration.subscription.in_transaction,
        }
    }
}

/// The registry as read: the stored records (handler, types, transactional, plugin, version,
/// first and last seen, retired) and what each live host serves, joined.
pub(crate) fn joined(
    mut records: BTreeMap<String, RegisteredHandler>,
    live_hosts: impl IntoIterator<Item = (String, Vec<Served>)>,
) -> Vec<RegisteredHandler> {
    for (host, served) in live_hosts {
        for served in served {
            let Some(record) = records.get_mut(&served.handler) else { continue };
            record.event_types.extend(served.event_types);
            record.served_by.push(host.clone());
        }
    }
    records.into_values().collect()
}

/// Refuses a retirement of a handler that a live host serves, or that is not registered.
pub fn check_retirable(registry: &[RegisteredHandler], handler: &str) -> Result<(), StoreError> {
    let Some(record) = registry.iter().find(|r| r.handler == handler) else {
        return Err(StoreError::InvalidArgument(format!("no handler {handler:?} is registered (see `relayhost handlers list`)")));
    };
    if !record.served_by.is_empty() {
        return Err(StoreError::InvalidArgument(format!(
            "handler {handler:?} is served by live host(s) {:?}: remove its plugin there (or stop them) first, then retire it",
            record.served_by
        )));
    }
    Ok(())
}

/// The subscriptions of a fan-out: the handlers this host serves (`local`, with its own
/// rules) and every other active handler of the registry, whose deliveries are only ever
/// claimed (never handed out here: this host cannot run them). A local handler also gets the
/// event types the registry adds (another host's newer version).
pub fn fan_out_subscriptions(
    local: impl IntoIterator<Item = Subscription>,
    registry: &[RegisteredHandler],
) -> Result<Subscriptions, StoreError> {
    let registered: BTreeMap<&str, &RegisteredHandler> =
        registry.iter().filter(|r| r.active()).map(|r| (r.handler.as_str(), r)).collect();
    let mut all: Vec<Subscription> = Vec::new();
    let mut local_handlers = BTreeSet::new();
    for mut subscription in local {
        if let Some(record) = registered.get(subscription.handler.as_str()) {
            subscription.event_types.extend(record.event_types.iter().cloned());
        }
        local_handlers.insert(subscription.handler.clone());
        all.push(subscription);
    }
    for record in registered.values().filter(|r| !local_handlers.contains(&r.handler)) {
        all.push(
            Subscription::new(record.handler.clone(), record.event_types.iter().cloned())
                .completing_in_transaction(record.in_transaction)
                .keyed_by(record.per_key.clone())
                .prioritized_by(record.priority_from.clone())
                .claimed_only(true),
        );
    }
    Subscriptions::new(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(handler: &str, types: &[&str], retired: bool) -> RegisteredHandler {
        RegisteredHandler {
            handler: handler.to_string(),
            event_types: types.iter().map(|t| t.to_string()).collect(),
            in_transaction: false,
            per_key: None,
            priority_from: None,
            plugin: "p".to_string(),
            version: "v".to_string(),
            first_seen: DateTime::from_millis(0),
            last_seen: DateTime::from_millis(0),
            served_by: Vec::new(),
            retired_at: retired.then(|| DateTime::from_millis(1)),
        }
    }

    #[test]
    fn a_fan_out_subscribes_every_active_handler_and_claims_only_those_served_elsewhere() {
        let registry = [record("absent", &["order"], false), record("here", &["refund"], false), record("gone", &["order"], true)];
        let local = [Subscription::new("here", ["order"])];
        let subscriptions = fan_out_subscriptions(local, &registry).unwrap();
        assert_eq!(subscriptions.handlers_for("order").collect::<Vec<_>>(), ["absent", "here"], "the retired one is not subscribed");
        assert_eq!(subscriptions.handlers_for("refund").collect::<Vec<_>>(), ["here"], "a local handler gets the registry's types too");
        assert!(subscriptions.claims_only("absent"), "what this host cannot run is never handed out here");
        assert!(!subscriptions.claims_only("here"));
    }

    #[test]
    fn live_hosts_add_what_they_serve_to_the_records() {
        let records = BTreeMap::from([("h".to_string(), record("h", &["a"], false))]);
        let served = |types: &[&str]| Served {
            handler: "h".to_string(),
            event_types: types.iter().map(|t| t.to_string()).collect(),
            in_transaction: false,
        };
        let joined = joined(records, [("one".to_string(), vec![served(&["a"])]), ("two".to_string(), vec![served(&["a", "b"])])]);
        assert_eq!(joined[0].served_by, ["one", "two"]);
        assert_eq!(joined[0].event_types.iter().collect::<Vec<_>>(), ["a", "b"]);
        assert!(check_retirable(&joined, "h").unwrap_err().to_string().contains("served by live host(s)"));
        assert!(check_retirable(&joined, "x").unwrap_err().to_string().contains("no handler \"x\" is registered"));
    }
}
