//! The transaction capability: what a transactional handler reads, writes and publishes in its
//! delivery's MongoDB transaction.
//!
//! This unit owns the capability's grant (collections; the event types and the id space of
//! follow-up events), its limits (follow-ups per delivery and their size, the depth of event
//! chains, the bytes one call may return, re-runs after transient errors), its linking (the
//! `transaction` import) and its per-instance state (the backend and what the delivery has
//! published so far). Every bound is checked here, before a call reaches the backend, which
//! the dispatcher implements over the delivery's transaction (`crate::handler_transaction`)
//! and which never has to think about which plugin is calling. It must never commit or abort.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bson::Bson;
use wasmtime::component::{HasSelf, Linker};

use crate::event::{EventRecord, NewEvent};
use crate::plugin::bindings::relayhost::plugin::transaction;

/// Event types only the host publishes (dead-letter announcements and the like).
pub const HOST_EVENT_TYPE_PREFIX: &str = "relayhost.";

/// Whether `event_type` is in the host's namespace, whatever its case (`RELAYHOST.delivery.dead`
/// would read as the host's to any subscriber matching without case).
pub fn is_host_event_type(event_type: &str) -> bool {
    event_type.get(..HOST_EVENT_TYPE_PREFIX.len()).is_some_and(|start| start.eq_ignore_ascii_case(HOST_EVENT_TYPE_PREFIX))
}

/// What the transaction capability may touch. Nothing by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    /// Collections it may read and write.
    pub collections: Vec<String>,
    /// Event types its follow-ups may have: exact names, or prefixes ending in `*`
    /// (`order.*`). `relayhost.*` is the host's alone, whatever this says.
    pub publish_types: Vec<String>,
    /// What its follow-ups' ids must start with; `None` means `<plugin name>:`, so a plugin
    /// can never take an id an application will use.
    pub publish_id_prefix: Option<String>,
}

impl Grant {
    pub(crate) fn allows_collection(&self, collection: &str) -> bool {
        self.collections.iter().any(|granted| granted == collection)
    }

    pub(crate) fn allows_event_type(&self, event_type: &str) -> bool {
        !is_host_event_type(event_type)
            && self.publish_types.iter().any(|granted| match granted.strip_suffix('*') {
                Some(prefix) => event_type.starts_with(prefix),
                None => granted == event_type,
            })
    }

    /// The prefix every follow-up id of `plugin` must have.
    pub fn id_prefix(&self, plugin: &str) -> String {
        self.publish_id_prefix.clone().unwrap_or_else(|| format!("{plugin}:"))
    }
}

/// The transaction capability's limits, per delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Follow-up events one delivery may publish (fewer where its event's chain budget is
    /// smaller, see `descendants`).
    pub follow_ups: u32,
    /// Most events that may descend from one application event through a chain of this
    /// plugin's follow-ups. An event carries its chain budget (`chainBudget`; an application's
    /// event has this whole limit): a delivery may publish `allowed = min(follow_ups, budget)`
    /// follow-ups, and each gets `(budget - allowed) / allowed`, so a tree never outgrows its
    /// root's budget (with the defaults a plugin that publishes all it may stops at
    /// 16 + 256 + 512 = 784 descendants).
    pub descendants: u32,
    /// Largest payload of a follow-up, in BSON bytes.
    pub follow_up_payload_bytes: usize,
    /// Deepest chain of follow-ups: an event an application published has depth 0, a
    /// follow-up of an event of depth `n` has `n + 1`, and one past this is refused.
    pub chain_depth: u32,
    /// Most bytes (of extended JSON) one `find` may hand back; the host stops reading there.
    pub returned_bytes: usize,
    /// Times a delivery's handler runs again in one attempt after a transient transaction
    /// error (a write conflict, a step-down) before the attempt is charged as failed.
    pub reruns: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self { follow_ups: 16, descendants: 1_024, follow_up_payload_bytes: 256 * 1024, chain_depth: 8, returned_bytes: 4 << 20, reruns: 20 }
    }
}

/// A boxed future of a backend call; errors are messages for the plugin's logs.
pub type CapabilityFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'a>>;

/// Reads and writes inside one delivery's transaction, as checked by this unit. Documents and
/// filters are relaxed extended JSON text.
pub trait TransactionCapability: Send {
    fn insert<'a>(&'a mut self, collection: &'a str, document: &'a str) -> CapabilityFuture<'a, String>;
    fn update<'a>(&'a mut self, collection: &'a str, filter: &'a str, update: &'a str) -> CapabilityFuture<'a, u64>;
    fn delete<'a>(&'a mut self, collection: &'a str, filter: &'a str) -> CapabilityFuture<'a, u64>;
    /// At most `limit` documents, and fails (reading no further) once their extended JSON
    /// passes `max_bytes`.
    fn find<'a>(&'a mut self, collection: &'a str, filter: &'a str, limit: u32, max_bytes: usize) -> CapabilityFuture<'a, Vec<String>>;
    /// A follow-up event, valid and granted, to publish with the delivery's commit.
    fn publish(&mut self, event: NewEvent) -> CapabilityFuture<'_, ()>;
}

/// Links the `transaction` import to the instance's [`TransactionState`].
pub fn link<T: Send + 'static>(linker: &mut Linker<T>, get: fn(&mut T) -> &mut TransactionState) -> wasmtime::Result<()> {
    transaction::add_to_linker::<T, HasSelf<TransactionState>>(linker, get)
}

/// What the handled event hands down to its follow-ups.
#[derive(Debug, Clone)]
struct Lineage {
    causation_id: String,
    correlation_id: String,
    chain_depth: u32,
    /// How many descendants the handled event may still have (see [`Limits::descendants`]).
    chain_budget: u32,
    /// The trace context headers follow-ups carry on (see [`DeliveryInfo::trace_context`]).
    ///
    /// [`DeliveryInfo::trace_context`]: crate::plugin::DeliveryInfo::trace_context
    trace_context: Vec<(String, String)>,
}

impl Lineage {
    /// How many follow-ups the delivery may publish, and the chain budget each gets.
    fn allowance(&self, limits: &Limits) -> (u32, u32) {
        let allowed = limits.follow_ups.min(self.chain_budget);
        let each = if allowed == 0 { 0 } else { (self.chain_budget - allowed) / allowed };
        (allowed, each)
    }
}

/// The per-instance state: the backend (transactional handlers only) and what was published.
pub struct TransactionState {
    plugin: Arc<str>,
    grant: Grant,
    limits: Limits,
    lineage: Option<Lineage>,
    backend: Option<Box<dyn TransactionCapability>>,
    published: u32,
}

impl TransactionState {
    /// The state of an instance handling `event` (none while listing subscriptions), with
    /// `backend` if its handler is transactional.
    pub fn prepare(
        plugin: Arc<str>,
        grant: &Grant,
        limits: &Limits,
        event: Option<(&EventRecord, &[(String, String)])>,
        backend: Option<Box<dyn TransactionCapability>>,
    ) -> Self {
        let lineage = event.map(|(event, trace_context)| Lineage {
            causation_id: event.id.clone(),
            correlation_id: event.correlation_id.clone().unwrap_or_else(|| event.id.clone()),
            chain_depth: event.chain_depth,
            chain_budget: event.chain_budget.unwrap_or(limits.descendants).min(limits.descendants),
            trace_context: trace_context.to_vec(),
        });
        Self { plugin, grant: grant.clone(), limits: limits.clone(), lineage, backend, published: 0 }
    }

    fn backend(&mut self, collection: Option<&str>) -> Result<&mut dyn TransactionCapability, String> {
        let Some(backend) = self.backend.as_deref_mut() else {
            return Err("the transaction capability is only available to transactional handlers".to_string());
        };
        if let Some(collection) = collection {
            if !self.grant.allows_collection(collection) {
                return Err(format!("collection {} is not granted to plugin `{}`", shown(collection), self.plugin));
            }
        }
        Ok(backend)
    }

    /// The follow-up as it will be published, or why it may not be.
    fn follow_up(&self, event: transaction::NewEvent) -> Result<NewEvent, String> {
        let refuse = |why: String| format!("follow-up event {} refused: {why}", shown(&event.id));
        let lineage = self.lineage.as_ref().ok_or_else(|| refuse("no event is being handled".to_string()))?;
        let (allowed, budget_each) = lineage.allowance(&self.limits);
        if self.published >= allowed {
            return Err(refuse(format!(
                "a delivery of this event may publish {allowed} follow-ups (the plugin's `follow_ups` limit, {}, within the {} \
                 descendants its chain may still have of the `descendants` limit, {})",
                self.limits.follow_ups, lineage.chain_budget, self.limits.descendants
            )));
        }
        if !self.grant.allows_event_type(&event.event_type) {
            return Err(refuse(format!("event type {} is not granted to plugin `{}`", shown(&event.event_type), self.plugin)));
        }
        let prefix = self.grant.id_prefix(&self.plugin);
        if !event.id.starts_with(&prefix) {
            return Err(refuse(format!("its id must start with {prefix:?} (the plugin's id space)")));
        }
        if lineage.chain_depth >= self.limits.chain_depth {
            return Err(refuse(format!(
                "the event handled is {} follow-ups deep, the plugin's `chain_depth` limit",
                lineage.chain_depth
            )));
        }
        // A payload larger than its JSON could never fit: refuse it before parsing.
        if event.payload.len() > self.limits.follow_up_payload_bytes.saturating_mul(4) {
            return Err(refuse(format!("its payload is {} bytes of JSON, over the `follow_up_payload` limit", event.payload.len())));
        }
        let value: serde_json::Value = serde_json::from_str(&event.payload).map_err(|e| refuse(format!("its payload is not JSON: {e}")))?;
        let payload = match Bson::try_from(value).map_err(|e| refuse(format!("its payload is not extended JSON: {e}")))? {
            Bson::Document(payload) => payload,
            other => return Err(refuse(format!("its payload must be a JSON object, found {}", crate::event::bson_type_name(&other)))),
        };
        let mut follow_up = NewEvent::new(event.id.clone(), event.event_type.clone(), payload);
        follow_up.key = event.key;
        if event.headers.len() > crate::event::MAX_HEADERS {
            return Err(refuse(format!("it has {} headers; the limit is {}", event.headers.len(), crate::event::MAX_HEADERS)));
        }
        follow_up.headers = event.headers.into_iter().collect();
        // The trace goes on, unless the plugin set its own or left no room for it.
        for (name, value) in &lineage.trace_context {
            let set = follow_up.headers.keys().any(|set| set.eq_ignore_ascii_case(name));
            if !set && follow_up.headers.len() < crate::event::MAX_HEADERS {
                follow_up.headers.insert(name.clone(), value.clone());
            }
        }
        follow_up.causation_id = Some(lineage.causation_id.clone());
        follow_up.correlation_id = Some(lineage.correlation_id.clone());
        follow_up.chain_depth = lineage.chain_depth + 1;
        follow_up.chain_budget = Some(budget_each);
        follow_up.validate(self.limits.follow_up_payload_bytes).map_err(|e| refuse(e.to_string()))?;
        Ok(follow_up)
    }

    /// Hands the backend back (after the run, for the caller to commit or abort).
    pub fn take_backend(&mut self) -> Option<Box<dyn TransactionCapability>> {
        self.backend.take()
    }
}

/// At most 64 characters of a plugin's text, quoted, for an error message.
fn shown(text: &str) -> String {
    format!("{:?}", text.chars().take(64).collect::<String>())
}

impl transaction::Host for TransactionState {
    async fn insert(&mut self, collection: String, document: String) -> Result<String, String> {
        self.backend(Some(&collection))?.insert(&collection, &document).await
    }

    async fn update(&mut self, collection: String, filter: String, update: String) -> Result<u64, String> {
        self.backend(Some(&collection))?.update(&collection, &filter, &update).await
    }

    async fn delete(&mut self, collection: String, filter: String) -> Result<u64, String> {
        self.backend(Some(&collection))?.delete(&collection, &filter).await
    }

    async fn find(&mut self, collection: String, filter: String, limit: u32) -> Result<Vec<String>, String> {
        let max_bytes = self.limits.returned_bytes;
        self.backend(Some(&collection))?.find(&collection, &filter, limit, max_bytes).await
    }

    async fn publish(&mut self, event: transaction::NewEvent) -> Result<(), String> {
        self.backend(None)?;
        let follow_up = self.follow_up(event)?;
        self.published += 1;
        self.backend(None)?.publish(follow_up).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(grant: Grant, chain_depth: u32) -> TransactionState {
        let mut event = EventRecord::from_document(&NewEvent::new("e-1", "order.placed", bson::doc! {}).to_document(None, bson::DateTime::now())).unwrap();
        event.chain_depth = chain_depth;
        let trace = [("traceparent".to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string())];
        TransactionState::prepare("billing".into(), &grant, &Limits { follow_ups: 2, ..Limits::default() }, Some((&event, &trace)), None)
    }

    fn new_event(id: &str, event_type: &str) -> transaction::NewEvent {
        transaction::NewEvent { id: id.into(), event_type: event_type.into(), key: None, payload: "{}".into(), headers: vec![] }
    }

    #[test]
    fn follow_ups_are_granted_by_type_in_the_plugins_id_space_and_never_host_types() {
        let grant = Grant { publish_types: vec!["invoice.*".into(), "relayhost.delivery.dead".into(), "audit".into()], ..Grant::default() };
        let state = state(grant, 0);
        let follow_up = state.follow_up(new_event("billing:1", "invoice.sent")).unwrap();
        assert_eq!((follow_up.causation_id.as_deref(), follow_up.correlation_id.as_deref(), follow_up.chain_depth), (Some("e-1"), Some("e-1"), 1));
        assert!(state.follow_up(new_event("billing:2", "audit")).is_ok());
        for (id, event_type, why) in [
            ("billing:3", "auditing", "is not granted"),
            ("billing:4", "relayhost.delivery.dead", "is not granted"),
            ("order-placed-o-9", "invoice.sent", "must start with \"billing:\""),
        ] {
            let error = state.follow_up(new_event(id, event_type)).unwrap_err();
            assert!(error.contains(why), "{error}");
        }
        let anything = Grant { publish_types: vec!["*".into()], publish_id_prefix: Some(String::new()), ..Grant::default() };
        assert!(state_with(anything.clone()).follow_up(new_event("order-9", "x")).is_ok());
        let anything = state_with(anything);
        for host_type in ["relayhost.x", "RELAYHOST.delivery.dead", "RelayHost.delivery.dead", "relayHOST.anything"] {
            assert!(anything.follow_up(new_event("order-9", host_type)).is_err(), "{host_type}: the host's types stay the host's");
        }
        assert!(anything.follow_up(new_event("order-9", "relayhosting.x")).is_ok(), "only the namespace itself is the host's");
    }

    fn state_with(grant: Grant) -> TransactionState {
        state(grant, 0)
    }

    /// Whatever a plugin publishes, the tree under one application event stays within its
    /// `descendants` limit (the chain of fan-out 16 that made 5,776 events now makes 784).
    #[test]
    fn a_tree_of_follow_ups_never_outgrows_its_roots_budget() {
        for (follow_ups, descendants) in [(16, 1_024), (1_000, 1_024), (3, 10), (2, 1), (7, 100)] {
            let limits = Limits { follow_ups, descendants, chain_depth: 64, ..Limits::default() };
            let mut level = vec![descendants];
            let mut total = 0u64;
            while !level.is_empty() {
                let mut next = Vec::new();
                for budget in level {
                    let lineage = Lineage {
                        causation_id: String::new(),
                        correlation_id: String::new(),
                        chain_depth: 0,
                        chain_budget: budget,
                        trace_context: Vec::new(),
                    };
                    let (allowed, each) = lineage.allowance(&limits);
                    total += u64::from(allowed);
                    next.extend(std::iter::repeat_n(each, allowed as usize));
                }
                level = next;
            }
            assert!(total <= u64::from(descendants), "follow_ups {follow_ups}, descendants {descendants}: {total}");
            if (follow_ups, descendants) == (16, 1_024) {
                assert_eq!(total, 784);
            }
        }
    }

    #[test]
    fn chains_count_and_headers_are_bounded() {
        let grant = Grant { publish_types: vec!["*".into()], ..Grant::default() };
        let error = state(grant.clone(), 8).follow_up(new_event("billing:1", "t")).unwrap_err();
        assert!(error.contains("8 follow-ups deep"), "{error}");
        let mut counted = state(grant.clone(), 0);
        counted.published = 2;
        assert!(counted.follow_up(new_event("billing:1", "t")).unwrap_err().contains("may publish 2 follow-ups"));
        // An application's event has the whole budget; each follow-up gets its share of what
        // is left once the delivery published all it may.
        let follow_up = state(grant.clone(), 0).follow_up(new_event("billing:1", "t")).unwrap();
        assert_eq!(follow_up.chain_budget, Some((1_024 - 2) / 2));
        // A follow-up with a budget of 1 may publish one event, with nothing left to it.
        let mut thin = state(grant.clone(), 1);
        thin.lineage.as_mut().unwrap().chain_budget = 1;
        assert_eq!(thin.follow_up(new_event("billing:1", "t")).unwrap().chain_budget, Some(0));
        thin.published = 1;
        assert!(thin.follow_up(new_event("billing:2", "t")).unwrap_err().contains("may publish 1 follow-ups"));
        let mut spent = state(grant.clone(), 2);
        spent.lineage.as_mut().unwrap().chain_budget = 0;
        assert!(spent.follow_up(new_event("billing:1", "t")).unwrap_err().contains("may publish 0 follow-ups"));
        let mut headers = new_event("billing:1", "t");
        headers.headers = vec![("$set".into(), "x".into())];
        assert!(state(grant.clone(), 0).follow_up(headers).unwrap_err().contains("header name \"$set\""));
        let mut big = new_event("billing:1", "t");
        big.payload = format!("{{\"a\": \"{}\"}}", "x".repeat(300 * 1024));
        assert!(state(grant, 0).follow_up(big).unwrap_err().contains("`payload` is"));
    }

    #[test]
    fn follow_ups_carry_the_trace_on_unless_the_plugin_set_its_own_or_left_no_room() {
        let grant = Grant { publish_types: vec!["t".into()], ..Grant::default() };
        let carried = state(grant.clone(), 0).follow_up(new_event("billing:1", "t")).unwrap();
        assert_eq!(carried.headers["traceparent"], "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let mut own = new_event("billing:1", "t");
        own.headers = vec![("TraceParent".into(), "00-ffffffffffffffffffffffffffffffff-ffffffffffffffff-01".into())];
        let kept = state(grant.clone(), 0).follow_up(own).unwrap();
        assert_eq!(kept.headers.len(), 1, "the plugin's own context stays alone: {:?}", kept.headers);
        assert!(kept.headers["TraceParent"].starts_with("00-ffff"));
        let mut full = new_event("billing:1", "t");
        full.headers = (0..crate::event::MAX_HEADERS).map(|n| (format!("h{n}"), "v".to_string())).collect();
        let crowded = state(grant, 0).follow_up(full).unwrap();
        assert_eq!(crowded.headers.len(), crate::event::MAX_HEADERS, "no room is made for the trace");
    }
}
