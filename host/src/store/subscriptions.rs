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
        }
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
            if subscription.claims_only {
                result.claims_only.insert(handler.clone());
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

    /// Whether `handler`'s deliveries are only ever claimed, never handed out.
    pub fn claims_only(&self, handler: &str) -> bool {
        self.claims_only.contains(handler)
    }
}

