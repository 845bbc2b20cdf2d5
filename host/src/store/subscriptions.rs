//! Subscriptions: which handlers a fan-out creates deliveries for, by event type, and how
//! (completing in their own transaction, claims-only here), with the event types' schemas a
//! fan-out checks payloads against. Pure: it validates and answers, never writes.

use std::collections::{BTreeMap, BTreeSet};

use super::{MALFORMED_EVENT_HANDLER, MAX_HANDLER_CHARS, StoreError};
use crate::event::EventRecord;

/// One handler's interest in event types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub handler: String,
    pub event_types: BTreeSet<String>,
    /// Its deliveries complete in its own transaction ([`Outbox::complete_in`]).
    pub in_transaction: bool,
    /// Its deliveries are only ever claimed, never handed out by their fan-out: its host
    /// limits how many of them it takes (see `dispatch::Throttle`), which a claim is told and
    /// a hand-out is not.
    pub claims_only: bool,
    /// How its deliveries of one key run: `None`, one at a time in their key's order (the
    /// event's key); else several at once, unordered, by the key [`PerKey`] names.
    pub per_key: Option<PerKey>,
    /// Where each delivery's priority comes from, for a handler that takes one per event
    /// (`None`: its deliveries are of its handler's priority alone).
    pub priority_from: Option<PriorityFrom>,
}

/// Where a handler that takes priorities per event finds each one: the event's `priority`
/// (see [`crate::event::field::PRIORITY`]) or an integer at a JSON pointer in its payload. A
/// fan-out computes it once, as the delivery's `priority` (0 when the event has none, clamped
/// to -1000..=1000), and claims take the higher first among its handler's deliveries (see
/// [`crate::store::Priorities`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PriorityFrom {
    Event,
    Payload(String),
}

impl PriorityFrom {
    /// `event` for the event's priority, else a JSON pointer into the payload (starting with
    /// `/`); `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "event" => Some(Self::Event),
            pointer if pointer.starts_with('/') => Some(Self::Payload(pointer.to_string())),
            _ => None,
        }
    }

    /// As [`PriorityFrom::parse`] reads it.
    pub fn text(&self) -> &str {
        match self {
            Self::Event => "event",
            Self::Payload(pointer) => pointer,
        }
    }

    /// `event`'s priority under it: 0 when it has none (or the payload's value is no integer).
    pub fn priority_of(&self, event: &EventRecord) -> i32 {
        let found = match self {
            Self::Event => event.priority.map(i64::from),
            Self::Payload(pointer) => match pointer_into(&event.payload, pointer) {
                Some(bson::Bson::Int32(n)) => Some(i64::from(*n)),
                Some(bson::Bson::Int64(n)) => Some(*n),
                Some(bson::Bson::Double(n)) if n.fract() == 0.0 && n.is_finite() => Some(*n as i64),
                _ => None,
            },
        };
        let range = crate::event::PRIORITY_RANGE;
        found.map_or(0, |n| n.clamp(*range.start(), *range.end()) as i32)
    }
}

/// The key a handler's deliveries are counted by when it runs up to a limit of one key at
/// once, unordered (`per_key = { limit = N }`), instead of one at a time in order: its event's
/// key, or a field of its payload (a JSON pointer). A fan-out computes it once, as the
/// delivery's `group`, and puts the delivery in that key's lane, so that the one holder of the
/// lane counts what of the key runs, across every host (see `claim/plan.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerKey {
    EventKey,
    Payload(String),
}

impl PerKey {
    /// `pointer` (a JSON pointer into the payload), or the event's key when `None`.
    pub fn from_pointer(pointer: Option<&str>) -> Self {
        pointer.map_or(Self::EventKey, |pointer| Self::Payload(pointer.to_string()))
    }

    /// The pointer it takes its key from, `None` for the event's key.
    pub fn pointer(&self) -> Option<&str> {
        match self {
            Self::EventKey => None,
            Self::Payload(pointer) => Some(pointer),
        }
    }

    /// `event`'s key under it: the event's key, or the payload's value at the pointer (a
    /// string as it is, any other value as its relaxed extended JSON); `None` when there is
    /// none (the delivery is then limited by nothing but its handler's throttles).
    pub fn key_of(&self, event: &EventRecord) -> Option<String> {
        match self {
            Self::EventKey => event.key.clone(),
            Self::Payload(pointer) => {
                let value = pointer_into(&event.payload, pointer)?;
                Some(match value {
                    bson::Bson::String(text) => text.clone(),
                    other => other.clone().into_relaxed_extjson().to_string(),
                })
            }
        }
    }
}

/// The value at a JSON pointer (RFC 6901) in a BSON document; `""` names the document itself,
/// which is no key.
fn pointer_into<'a>(document: &'a bson::Document, pointer: &str) -> Option<&'a bson::Bson> {
    let mut tokens = pointer.strip_prefix('/')?.split('/').map(|token| token.replace("~1", "/").replace("~0", "~"));
    let mut value = document.get(tokens.next()?)?;
    for token in tokens {
        value = match value {
            bson::Bson::Document(inner) => inner.get(&token)?,
            bson::Bson::Array(items) => items.get(token.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(value)
}

impl Subscription {
    pub fn new<I, T>(handler: impl Into<String>, event_types: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        Self {
            handler: handler.into(),
            event_types: event_types.into_iter().map(Into::into).collect(),
            in_transaction: false,
            claims_only: false,
            per_key: None,
            priority_from: None,
        }
    }

    /// The same, each delivery of the priority `priority_from` finds in its event.
    pub fn prioritized_by(self, priority_from: Option<PriorityFrom>) -> Self {
        Self { priority_from, ..self }
    }

    /// The same, its deliveries of one key running several at once, by `per_key`'s key.
    pub fn keyed_by(self, per_key: Option<PerKey>) -> Self {
        Self { per_key, ..self }
    }

    /// The same, its deliveries completing in its own transaction if `in_transaction`.
    pub fn completing_in_transaction(self, in_transaction: bool) -> Self {
        Self { in_transaction, ..self }
    }

    /// The same, its deliveries only ever claimed if `claims_only`.
    pub fn claimed_only(self, claims_only: bool) -> Self {
        Self { claims_only, ..self }
    }
}

/// The subscriptions fan-out uses: which handlers receive which event types.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subscriptions {
    /// The event types' schemas a fan-out checks payloads against (none by default).
    schemas: crate::event_schema::Schemas,
    by_type: BTreeMap<String, BTreeSet<String>>,
    handlers: BTreeSet<String>,
    in_transaction: BTreeSet<String>,
    claims_only: BTreeSet<String>,
    per_key: BTreeMap<String, PerKey>,
    priority_from: BTreeMap<String, PriorityFrom>,
}

impl Subscriptions {
    /// The same, a fan-out making an event whose payload does not match its type's schema
    /// dead for each of its handlers, the failing path in the reason.
    pub fn with_schemas(self, schemas: crate::event_schema::Schemas) -> Self {
        Self { schemas, ..self }
    }

    /// Why `event`'s payload does not match its type's schema, if it does not.
    pub(crate) fn schema_violation(&self, event: &EventRecord) -> Option<String> {
        self.schemas.check(&event.event_type, &event.payload).err()
    }

    /// Validates handler ids (non-empty, bounded, no control characters, unique).
    pub fn new(subscriptions: impl IntoIterator<Item = Subscription>) -> Result<Self, StoreError> {
        let mut result = Self::default();
        for subscription in subscriptions {
            let handler = &subscription.handler;
            if handler.is_empty()
                || handler.chars().count() > MAX_HANDLER_CHARS
                || handler.chars().any(char::is_control)
                || handler == MALFORMED_EVENT_HANDLER
            {
                return Err(StoreError::InvalidArgument(format!(
                    "handler id {handler:?} must be 1-{MAX_HANDLER_CHARS} printable characters and not {MALFORMED_EVENT_HANDLER:?}"
                )));
            }
            if !result.handlers.insert(handler.clone()) {
                return Err(StoreError::InvalidArgument(format!("handler id {handler:?} is subscribed twice")));
            }
            if subscription.in_transaction {
                result.in_transaction.insert(handler.clone());
            }
            // Counted by the holder of their key's lane, or to be taken in their priorities'
            // order, they are never handed out by a fan-out, which takes neither into account.
            if subscription.claims_only || subscription.per_key.is_some() || subscription.priority_from.is_some() {
                result.claims_only.insert(handler.clone());
            }
            if let Some(per_key) = subscription.per_key {
                result.per_key.insert(handler.clone(), per_key);
            }
            if let Some(from) = subscription.priority_from {
                result.priority_from.insert(handler.clone(), from);
            }
            for event_type in subscription.event_types {
                result.by_type.entry(event_type).or_default().insert(handler.clone());
            }
        }
        Ok(result)
    }

    /// Handlers subscribed to `event_type`, in name order.
    pub fn handlers_for(&self, event_type: &str) -> impl Iterator<Item = &String> {
        self.by_type.get(event_type).into_iter().flatten()
    }

    /// Every subscribed handler, in name order.
    pub fn handlers(&self) -> Vec<String> {
        self.handlers.iter().cloned().collect()
    }

    /// Whether `handler`'s deliveries complete in its own transaction.
    pub fn completes_in_transaction(&self, handler: &str) -> bool {
        self.in_transaction.contains(handler)
    }

    /// How `handler`'s deliveries of one key run several at once (see [`PerKey`]); `None`
    /// for one at a time in order.
    pub fn per_key(&self, handler: &str) -> Option<&PerKey> {
        self.per_key.get(handler)
    }

    /// Where `handler` takes each delivery's priority from, if it takes one per event.
    pub fn priority_from(&self, handler: &str) -> Option<&PriorityFrom> {
        self.priority_from.get(handler)
    }

    /// Whether `handler`'s deliveries are only ever claimed, never handed out.
    pub fn claims_only(&self, handler: &str) -> bool {
        self.claims_only.contains(handler)
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    fn event(payload: bson::Document, key: Option<&str>) -> EventRecord {
        let mut event = crate::event::NewEvent::new("e", "t", payload);
        if let Some(key) = key {
            event = event.with_key(key);
        }
        EventRecord::from_document(&event.to_document(Some(1), bson::DateTime::from_millis(0))).unwrap()
    }

    #[test]
    fn a_per_key_key_is_the_events_or_the_payloads_value_at_a_json_pointer() {
        let payload = bson::doc! { "customer": { "id": "c-7", "n": 42, "tags": ["x", "y"], "a/b": "slash" } };
        let with = |pointer: &str| PerKey::Payload(pointer.to_string()).key_of(&event(payload.clone(), Some("k")));
        assert_eq!(with("/customer/id").as_deref(), Some("c-7"));
        assert_eq!(with("/customer/n").as_deref(), Some("42"), "a number as its JSON");
        assert_eq!(with("/customer/tags/1").as_deref(), Some("y"));
        assert_eq!(with("/customer/a~1b").as_deref(), Some("slash"), "escaped as RFC 6901 says");
        assert_eq!(with("/customer/missing"), None, "no key: limited by nothing per key");
        assert_eq!(with("/customer/id/deeper"), None);
        assert_eq!(PerKey::EventKey.key_of(&event(payload.clone(), Some("k"))).as_deref(), Some("k"));
        assert_eq!(PerKey::EventKey.key_of(&event(payload, None)), None);
    }

    #[test]
    fn a_priority_per_event_is_the_events_or_an_integer_in_its_payload_else_0() {
        let payload = bson::doc! { "urgency": 7, "big": 1_000_000_i64, "whole": 3.0, "half": 2.5, "text": "9" };
        let of = |from: &str, priority: Option<i32>| {
            let mut event = event(payload.clone(), None);
            event.priority = priority;
            PriorityFrom::parse(from).unwrap().priority_of(&event)
        };
        assert_eq!((of("event", Some(-3)), of("event", None)), (-3, 0));
        assert_eq!((of("/urgency", Some(-3)), of("/big", None), of("/whole", None)), (7, 1000, 3), "clamped to 1000");
        assert_eq!((of("/half", None), of("/text", None), of("/missing", None)), (0, 0, 0), "no integer: 0");
        assert_eq!(PriorityFrom::parse("urgency"), None);
        assert_eq!(PriorityFrom::parse("/a").map(|p| p.text().to_string()).as_deref(), Some("/a"));
    }
}
