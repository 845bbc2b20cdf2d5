//! A host's announcements to the others, beside the claim loop (see [`Store::announce`]): the
//! live hosts split the lanes. It must never hold back the loop: it only wakes it when the
//! number of live hosts changed.

use std::sync::Arc;
use std::time::Duration;

use bson::DateTime;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::store::{ANNOUNCE_EVERY, Store};

/// Announces this host to the others (see [`Store::announce`]) every [`ANNOUNCE_EVERY`]
/// (or tenth of a lease, if shorter), beside the claim loop so that its ticks never hold
/// back the loop's poll; wakes the loop when the number of live hosts changed.
pub(super) fn spawn<S: Store>(store: Arc<S>, lease_duration: Duration, hosts: usize, hosts_changed: Arc<Notify>) -> JoinHandle<()> {
    let every = ANNOUNCE_EVERY.min(lease_duration / 10);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        let mut hosts = hosts;
        loop {
            ticks.tick().await;
            match store.announce(DateTime::now()).await {
                Ok(live) if live != hosts => {
                    hosts = live;
                    hosts_changed.notify_one();
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "announcing this host failed; trying again"),
            }
        }
    })
}
