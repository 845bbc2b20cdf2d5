//! A host's announcements to the others, beside the claim loop (see [`Hosts::announce`]), and
//! its looks at theirs between them (see [`Hosts::look`]): the live hosts split the lanes.
//! With each announcement it declares what it serves to the handler registry and reads it
//! ([`KnownHandlers::refresh`]). It must never hold back the loop: it only wakes it when the
//! number of live hosts changed.

use std::sync::Arc;
use std::time::Duration;

use bson::DateTime;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::KnownHandlers;
use crate::store::{ANNOUNCE_EVERY, Declaration, Store};

/// What the host serves now, to declare with its announcements.
pub(super) type Declared = Arc<dyn Fn() -> Vec<Declaration> + Send + Sync>;

/// Looks at the live hosts between two announcements.
const LOOKS_PER_ANNOUNCEMENT: u32 = 10;

/// Announces this host to the others (see [`Hosts::announce`]) every [`ANNOUNCE_EVERY`]
/// (or tenth of a lease, if shorter), and more often just after it started ([`waits`]), and
/// looks at the live hosts every tenth of that between ([`Hosts::look`], a read): a host that
/// joins is learned of within a tenth of the interval, not at the next announcement, so that
/// the others leave it its share's lanes before its fan-outs meet them held. Runs beside the
/// claim loop so that its ticks never hold back the loop's poll; wakes the loop when the
/// number of live hosts changed.
pub(super) fn spawn<S: Store>(
    store: Arc<S>,
    lease_duration: Duration,
    hosts: usize,
    hosts_changed: Arc<Notify>,
    registry: (Arc<KnownHandlers>, Declared),
) -> JoinHandle<()> {
    let every = ANNOUNCE_EVERY.min(lease_duration / 10);
    let look_every = every / LOOKS_PER_ANNOUNCEMENT;
    tokio::spawn(async move {
        let mut hosts = hosts;
        let mut waits = waits(every);
        let mut announce_at = Instant::now() + waits.next().unwrap_or(every);
        loop {
            let look_at = Instant::now() + look_every;
            let announcing = announce_at <= look_at;
            tokio::time::sleep_until(if announcing { announce_at } else { look_at }).await;
            let live = if announcing {
                let announced = store.announce(DateTime::now()).await;
                announce_at = Instant::now() + waits.next().unwrap_or(every);
                let (known, declared) = &registry;
                if let Err(error) = known.refresh(&*store, declared()).await {
                    tracing::warn!(%error, "declaring this host's handlers to the registry failed; trying again");
                }
                announced.inspect_err(|error| tracing::warn!(%error, "announcing this host failed; trying again"))
            } else {
                // A look that fails is followed by another a tenth of the interval later.
                store.look(DateTime::now()).await.inspect_err(|error| tracing::debug!(%error, "looking at the live hosts failed"))
            };
            if let Ok(live) = live
                && live != hosts
            {
                hosts = live;
                hosts_changed.notify_one();
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
    use crate::store::Hosts;
    use super::*;
    use crate::store::StoreOptions;
    use crate::store::memory::MemoryStore;

    fn nothing_declared() -> (Arc<KnownHandlers>, Declared) {
        (Arc::default(), Arc::new(Vec::new))
    }

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
        let announcing = spawn(first.clone(), lease, hosts, changed.clone(), nothing_declared());
        assert_eq!(second.announce(DateTime::now()).await.unwrap(), 2);
        let every = ANNOUNCE_EVERY.min(lease / 10);
        let learned = tokio::time::timeout(every / 10, changed.notified()).await;
        announcing.abort();
        assert!(learned.is_ok(), "the first host learned of the second only after {:?} or later", every / 10);
    }

    /// A host that has run for a while (announcing once an interval) learns of one that joins
    /// within a tenth of the interval, by looking between its announcements (in paused time).
    #[tokio::test(start_paused = true)]
    async fn a_running_host_learns_of_one_that_joins_within_a_tenth_of_the_interval() {
        let first = Arc::new(MemoryStore::new(StoreOptions::default()));
        let second = first.instance("second");
        let lease = Duration::from_secs(30);
        let every = ANNOUNCE_EVERY.min(lease / 10);
        let hosts = first.announce(DateTime::now()).await.unwrap();
        let changed = Arc::new(Notify::new());
        let announcing = spawn(first.clone(), lease, hosts, changed.clone(), nothing_declared());
        // Its announcements come at 50, 150, 350, 750, 1,550 ms and every interval after: the
        // next after ten intervals is half an interval away.
        tokio::time::sleep(every * 10).await;
        assert_eq!(second.announce(DateTime::now()).await.unwrap(), 2);
        let learned = tokio::time::timeout(every / 5, changed.notified()).await;
        announcing.abort();
        assert!(learned.is_ok(), "the running host learned of the one that joined only after {:?} or later", every / 5);
    }
}
