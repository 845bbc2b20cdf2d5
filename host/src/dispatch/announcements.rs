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
/// (or tenth of a lease, if shorter), and more often just after it started ([`waits`]),
/// beside the claim loop so that its ticks never hold back the loop's poll; wakes the loop
/// when the number of live hosts changed.
pub(super) fn spawn<S: Store>(store: Arc<S>, lease_duration: Duration, hosts: usize, hosts_changed: Arc<Notify>) -> JoinHandle<()> {
    let every = ANNOUNCE_EVERY.min(lease_duration / 10);
    tokio::spawn(async move {
        let mut hosts = hosts;
        for wait in waits(every) {
            tokio::time::sleep(wait).await;
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

/// The waits between announcements: a twentieth of `every` after the first, then twice the
/// last, up to `every`. Hosts started together each see only those that announced before
/// them, and until its next announcement the first fans out the others' lanes as its own,
/// and they race for them (measured: one host of four that saw two for a second halved the
/// drain); so a host announces again soon after it started.
fn waits(every: Duration) -> impl Iterator<Item = Duration> {
    std::iter::successors(Some(every / 20), move |wait| Some((*wait * 2).min(every)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreOptions;
    use crate::store::memory::MemoryStore;

    #[test]
    fn a_host_announces_quickly_after_it_started_then_every_interval() {
        let waits: Vec<Duration> = waits(Duration::from_secs(1)).take(7).collect();
        let millis: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(millis, [50, 100, 200, 400, 800, 1000, 1000]);
    }

    /// The first of two hosts started together learns of the second long before a whole
    /// interval passed (in paused time: the test waits no wall-clock second).
    #[tokio::test(start_paused = true)]
    async fn a_host_started_just_before_another_learns_of_it_within_a_twentieth_of_the_interval() {
        let first = Arc::new(MemoryStore::new(StoreOptions::default()));
        let second = first.instance("second");
        let lease = Duration::from_secs(30);
        let hosts = first.announce(DateTime::now()).await.unwrap();
        assert_eq!(hosts, 1, "the first host to announce sees only itself");
        let changed = Arc::new(Notify::new());
        let announcing = spawn(first.clone(), lease, hosts, changed.clone());
        assert_eq!(second.announce(DateTime::now()).await.unwrap(), 2);
        let every = ANNOUNCE_EVERY.min(lease / 10);
        let learned = tokio::time::timeout(every / 10, changed.notified()).await;
        announcing.abort();
        assert!(learned.is_ok(), "the first host learned of the second only after {:?} or later", every / 10);
    }
}
