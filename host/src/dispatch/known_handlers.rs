//! The handler registry as this host knows it (see [`crate::store::registry`]): read, and
//! what this host serves declared, with its announcements, never per event; a fan-out takes
//! its subscriptions from it. It also says, at WARN and at most once a minute, which
//! handlers have work that no live host serves, or that only some hosts serve (it reads the
//! statistics for that only while there is such a handler, at most every five seconds).
//!
//! It must never let a fan-out run on what this host alone has loaded: until the registry
//! was read once, [`KnownHandlers::subscriptions`] gives nothing and the fan-out waits.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bson::DateTime;
use tokio::time::Instant;

use super::runner::HandlerSpec;
use crate::store::registry::fan_out_subscriptions;
use crate::store::{Declaration, RegisteredHandler, Store, StoreError, Subscriptions};

/// How often a host declares again what it serves when nothing changed (its records' last
/// sighting).
const DECLARE_EVERY: Duration = Duration::from_secs(30);
/// How often at most the WARN about unserved handlers is logged.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// How often at most the statistics are read to see whether an unserved handler has work.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// What a host knows of the registry.
#[derive(Default)]
pub struct KnownHandlers {
    known: RwLock<Option<Arc<Vec<RegisteredHandler>>>>,
    declared: Mutex<Option<(Vec<Declaration>, Instant)>>,
    warned: Mutex<Option<Instant>>,
    checked: Mutex<Option<Instant>>,
}

impl KnownHandlers {
    /// The registry as last read; `None` before the first read.
    pub fn known(&self) -> Option<Arc<Vec<RegisteredHandler>>> {
        self.known.read().expect("known handlers").clone()
    }

    /// Declares `declarations` when they changed (or every [`DECLARE_EVERY`]) and reads the
    /// registry otherwise; keeps it, and warns about handlers with work no live host serves.
    pub async fn refresh<S: Store>(&self, store: &S, declarations: Vec<Declaration>) -> Result<(), StoreError> {
        let now = DateTime::now();
        let due = {
            let declared = self.declared.lock().expect("declared");
            declared.as_ref().is_none_or(|(last, at)| *last != declarations || at.elapsed() >= DECLARE_EVERY)
        };
        let registry = if due {
            let registry = store.register(&declarations, now).await?;
            *self.declared.lock().expect("declared") = Some((declarations, Instant::now()));
            registry
        } else {
            store.registered_handlers(now).await?
        };
        let registry = Arc::new(registry);
        *self.known.write().expect("known handlers") = Some(registry.clone());
        self.warn_about_unserved(store, &registry, now).await;
        Ok(())
    }

    /// The subscriptions of a fan-out: this host's handlers (`specs`) and every other active
    /// handler of the registry (see [`fan_out_subscriptions`]); `None` until the registry was
    /// read once.
    pub fn subscriptions(&self, specs: &[HandlerSpec]) -> Option<Result<Subscriptions, StoreError>> {
        let known = self.known()?;
        let local = specs.iter().map(HandlerSpec::subscription);
        Some(fan_out_subscriptions(local, &known))
    }

    /// Whether some handler of the registry is active.
    pub fn any_active(&self) -> bool {
        self.known().is_some_and(|known| known.iter().any(RegisteredHandler::active))
    }

    async fn warn_about_unserved<S: Store>(&self, store: &S, registry: &[RegisteredHandler], now: DateTime) {
        let live: BTreeSet<&String> = registry.iter().flat_map(|r| r.served_by.iter()).collect();
        let short: Vec<&RegisteredHandler> =
            registry.iter().filter(|r| r.active() && r.served_by.len() < live.len().max(1)).collect();
        if short.is_empty() {
            return;
        }
        {
            let mut checked = self.checked.lock().expect("checked");
            if self.warned.lock().expect("warned").is_some_and(|at| at.elapsed() < WARN_EVERY)
                || checked.is_some_and(|at| at.elapsed() < CHECK_EVERY)
            {
                return;
            }
            *checked = Some(Instant::now());
        }
        let statistics = match store.statistics(now).await {
            Ok(statistics) => statistics,
            Err(error) => return tracing::debug!(%error, "reading the statistics of unserved handlers failed"),
        };
        for record in short {
            let waiting = statistics.iter().find(|s| s.handler == record.handler).map_or(0, |s| s.pending);
            if waiting == 0 {
                continue;
            }
            *self.warned.lock().expect("warned") = Some(Instant::now());
            if record.served_by.is_empty() {
                tracing::warn!(
                    handler = %record.handler,
                    waiting,
                    unserved_since = %record.last_seen.try_to_rfc3339_string().unwrap_or_default(),
                    "no live host serves this handler: its deliveries wait for one (load its plugin, or `relayhost handlers retire`)"
                );
            } else {
                tracing::warn!(
                    handler = %record.handler,
                    waiting,
                    served_by = ?record.served_by,
                    live_hosts = live.len(),
                    "only some live hosts serve this handler: its deliveries in the others' lanes wait for one that does"
                );
            }
        }
    }
}
