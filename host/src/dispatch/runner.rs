//! What runs deliveries, as the dispatcher sees it: the handlers a runner offers and how a
//! run ended. The host implements [`Runner`] with plugins; this module must never know how
//! a handler runs.

use std::future::Future;
use std::pin::Pin;

use super::{AttemptResult, RetryPolicy, Throttle};
use crate::store::{ClaimedDelivery, Declaration, PerKey, PriorityFrom, Subscription};

/// How the operator has one handler's deliveries processed: its throttle, its priority, and
/// how many of one key run at once (see [`HandlerSpec`]). The default limits nothing, puts
/// every handler at priority 0 and runs each key's deliveries one at a time, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Controls {
    pub throttle: Throttle,
    /// Of due deliveries, those of handlers of a higher priority are claimed, handed out and
    /// started first (0 by default).
    pub priority: i32,
    /// Of its due deliveries, those of higher priorities (as its events say) go first
    /// (`None`: in the order they are due).
    pub priority_from: Option<PriorityFrom>,
    /// Runs up to a limit of one key at once, unordered (`None`: one at a time, in order).
    pub per_key: Option<KeyLimit>,
}

/// At most `limit` deliveries of one key at once, across every host, the key taken by `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLimit {
    pub limit: usize,
    pub key: PerKey,
}

/// A handler the runner offers, with its retry policy, throttle and priority.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerSpec {
    pub handler: String,
    pub event_types: Vec<String>,
    pub retry: RetryPolicy,
    /// Its throttle, priority and per-key limit.
    pub controls: Controls,
    /// Completes inside its own transaction: its lease is not renewed (a renewal would
    /// conflict with that completion), so the lease must outlast it.
    pub transactional: bool,
}

impl HandlerSpec {
    /// What a fan-out and the registry need of it: its event types, and how its deliveries are
    /// keyed, prioritized and completed.
    pub fn subscription(&self) -> Subscription {
        Subscription::new(self.handler.clone(), self.event_types.iter().cloned())
            .completing_in_transaction(self.transactional)
            .keyed_by(self.controls.per_key.as_ref().map(|limit| limit.key.clone()))
            .prioritized_by(self.controls.priority_from.clone())
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunResult {
    Attempt(AttemptResult),
    /// The runner completed the delivery in the handler's own transaction.
    CompletedInTransaction,
    /// Nothing ran (no plugin serves the handler any more): hand it back, uncharged.
    NotRun,
    /// The lease was lost while it ran; another worker owns the delivery now.
    LeaseLost,
}

/// Runs deliveries. The host implements it with plugins; the dispatcher never knows how.
pub trait Runner: Send + Sync + 'static {
    fn handlers(&self) -> Vec<HandlerSpec>;

    /// What this host declares to the handler registry: its handlers, with what offers each
    /// (nothing named by default).
    fn declarations(&self) -> Vec<Declaration> {
        self.handlers()
            .into_iter()
            .map(|spec| Declaration {
                subscription: spec.subscription(),
                plugin: String::new(),
                version: String::new(),
            })
            .collect()
    }

    fn run(&self, delivery: ClaimedDelivery) -> Pin<Box<dyn Future<Output = RunResult> + Send>>;
}
