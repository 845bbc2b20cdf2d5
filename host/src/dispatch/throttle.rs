//! A handler's processing limits, as the operator sets them: how many of its deliveries a
//! host holds at once (running or claimed ahead of a run slot), and how many of them it
//! starts in any window of a given length, on each host; and the same across every host (the
//! global `concurrency` and `rate`, held through the store's limiter documents, see
//! [`crate::store::limiter`]; each run passes its handler's gate, see [`super::global_limits`]).
//!
//! Claims and hand-outs take at most the room a throttled handler's limits leave (they are
//! told each handler's room, [`Rooms`]), so its backlog never takes the places of other
//! handlers' work: what its concurrency on this host lets it hold, and what its rates and its
//! gate could let start within about a second. Rates are held where a run starts: a run of a
//! rate-limited handler takes a run slot only together with a start in its window
//! ([`StartWindows::run_slot`]), so a window never counts more starts than its `max`, and a run
//! waiting for its window never holds a run slot. The loop claims for a throttled handler
//! again when one of its runs ends.
//!
//! This module owns the counting: the limits, the starts each rate-limited handler made in
//! its window, and the rooms they leave. It never claims, and never knows how a handler runs.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::HandlerSpec;
use super::options::CLAIM_AHEAD_PER_RUN_SLOT;
use crate::store::limiter::GlobalRate;
use crate::store::{Room, Rooms};

/// What the operator limits one handler to, on each host and across all. The default limits
/// nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Throttle {
    /// At most this many of its deliveries held at once on each host, running or waiting for
    /// a run slot.
    pub concurrency: Option<usize>,
    /// At most so many starts in any window, on each host.
    pub rate: Option<RateLimit>,
    /// At most this many held at once across all hosts.
    pub global_concurrency: Option<usize>,
    /// At most so many starts a window across all hosts, with a burst.
    pub global_rate: Option<GlobalRate>,
}

/// At most `max` starts in any window of `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub max: usize,
    pub per: Duration,
}

impl Throttle {
    /// Whether it limits anything.
    pub fn limits(&self) -> bool {
        self.concurrency.is_some() || self.rate.is_some() || self.global()
    }

    /// Whether it limits anything on each host.
    pub fn per_host(&self) -> bool {
        self.concurrency.is_some() || self.rate.is_some()
    }

    /// Whether it limits anything across hosts (its claims ask the store's limiter first).
    pub fn global(&self) -> bool {
        self.global_concurrency.is_some() || self.global_rate.is_some()
    }

    /// How many more of its deliveries a host may take, `held` of them held (running, or
    /// waiting for their gate, window or run slot): `None` when it limits nothing. At most its
    /// concurrency on this host; about a second of starts at each of its rates (at least
    /// one); and for its concurrency across hosts, what that runs with each run slot's claims
    /// ahead. A limited backlog keeps its runs fed without taking the places of other
    /// handlers' work.
    pub(super) fn room(&self, held: usize) -> Option<usize> {
        let per_second = |max: u128, per_ms: u128| (max * 1_000 / per_ms.max(1)).clamp(1, usize::MAX as u128) as usize;
        let hold = [
            self.concurrency,
            self.rate.map(|rate| per_second(rate.max as u128, rate.per.as_millis())),
            self.global_concurrency.map(|limit| limit.saturating_mul(1 + CLAIM_AHEAD_PER_RUN_SLOT)),
            self.global_rate.map(|rate| per_second(rate.max as u128, rate.per_ms.max(1) as u128)),
        ];
        hold.into_iter().flatten().min().map(|hold| hold.saturating_sub(held))
    }
}

/// What a claim or hand-out may take of each throttled handler of `specs`, `held(handler)` of
/// its deliveries held.
pub(super) fn rooms(specs: &[HandlerSpec], held: impl Fn(&str) -> usize) -> Rooms {
    Rooms::new(
        specs
            .iter()
            .filter_map(|spec| Some((spec.handler.clone(), Room { most: spec.controls.throttle.room(held(&spec.handler))? }))),
    )
}

/// The starts each rate-limited handler made on this host within its window, shared with the
/// runs that wait for their window.
#[derive(Debug, Default, Clone)]
pub(super) struct StartWindows {
    by_handler: Arc<Mutex<HashMap<String, VecDeque<Instant>>>>,
    /// The host stops: no run waits for its window any more.
    closed: Arc<AtomicBool>,
    closing: Arc<Notify>,
}

impl StartWindows {
    /// A run slot for a run of `handler`, and with a `rate`, a start in its window taken at
    /// the same moment: no window ever counts a start that has not begun, and a run never
    /// holds a run slot while it waits for its window. `None` when the host stops first.
    pub(super) async fn run_slot(&self, handler: &str, rate: Option<RateLimit>, permits: &Arc<Semaphore>) -> Option<OwnedSemaphorePermit> {
        loop {
            if let Some(rate) = rate
                && !self.wait_for_room(handler, rate).await
            {
                return None;
            }
            let permit = permits.clone().acquire_owned().await.ok()?;
            match rate {
                Some(rate) if self.take(handler, rate, Instant::now()).is_err() => drop(permit),
                _ => return Some(permit),
            }
        }
    }

    /// Waits until `handler`'s window has room for a start: `false` when the host stops first.
    pub(super) async fn wait_for_room(&self, handler: &str, rate: RateLimit) -> bool {
        loop {
            let closing = self.closing.notified();
            tokio::pin!(closing);
            closing.as_mut().enable();
            if self.closed.load(Ordering::SeqCst) {
                return false;
            }
            let Some(opens) = self.opening(handler, rate, Instant::now()) else { return true };
            tokio::select! {
                () = tokio::time::sleep_until(opens) => {}
                () = closing => return false,
            }
        }
    }

    /// Wakes every run waiting for its window, to be handed back unstarted.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.closing.notify_waiters();
    }

    /// Counts a start of `handler` at `now` if its window has room; else when it will.
    fn take(&self, handler: &str, rate: RateLimit, now: Instant) -> Result<(), Instant> {
        let mut windows = self.by_handler.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let starts = windows.entry(handler.to_string()).or_default();
        match opening(starts, rate, now) {
            None => {
                starts.push_back(now);
                Ok(())
            }
            Some(opens) => Err(opens),
        }
    }

    /// When `handler`'s window lets its next start in, if it is full at `now`.
    fn opening(&self, handler: &str, rate: RateLimit, now: Instant) -> Option<Instant> {
        let mut windows = self.by_handler.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        opening(windows.get_mut(handler)?, rate, now)
    }
}

/// When a window of `starts` lets the next one in, if it is full at `now`; starts that left it
/// are forgotten.
fn opening(starts: &mut VecDeque<Instant>, rate: RateLimit, now: Instant) -> Option<Instant> {
    while starts.front().is_some_and(|start| *start + rate.per <= now) {
        starts.pop_front();
    }
    // The start that leaves the window first makes room for one more.
    let max = rate.max.max(1);
    (starts.len() >= max).then(|| starts[starts.len() - max] + rate.per)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::Controls;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn the_room_is_the_least_that_any_limit_leaves() {
        assert_eq!(Throttle::default().room(100), None, "unthrottled");
        let both = Throttle { concurrency: Some(3), rate: Some(RateLimit { max: 5, per: SECOND }), ..Default::default() };
        assert_eq!(both.room(0), Some(3));
        assert_eq!(both.room(2), Some(1));
        assert_eq!(both.room(7), Some(0), "held beyond a lowered limit");
        // A second of starts at each rate, at least one.
        let paced = |max: usize, per: Duration| Throttle { rate: Some(RateLimit { max, per }), ..Default::default() };
        assert_eq!(paced(3, Duration::from_millis(300)).room(2), Some(8));
        assert_eq!(paced(100, Duration::from_secs(60)).room(0), Some(1));
        let global = Throttle { global_concurrency: Some(4), ..Default::default() };
        assert_eq!(global.room(0), Some(4 * (1 + CLAIM_AHEAD_PER_RUN_SLOT)));
    }

    #[test]
    fn rooms_name_the_throttled_handlers_only() {
        let spec = |handler: &str, throttle: Throttle| HandlerSpec {
            handler: handler.into(),
            event_types: vec!["t".into()],
            retry: Default::default(),
            controls: Controls { throttle, ..Controls::default() },
            transactional: false,
        };
        let paced = Throttle { rate: Some(RateLimit { max: 4, per: SECOND }), ..Default::default() };
        let specs = [spec("free", Throttle::default()), spec("paced", paced), spec("held", Throttle { concurrency: Some(10), ..Default::default() })];
        let rooms = rooms(&specs, |handler| if handler == "held" { 3 } else { 1 });
        assert_eq!(rooms.of("free"), None);
        assert_eq!(rooms.of("paced"), Some(Room { most: 3 }));
        assert_eq!(rooms.of("held"), Some(Room { most: 7 }));
    }

    #[test]
    fn a_full_window_opens_when_its_oldest_start_leaves_it() {
        let windows = StartWindows::default();
        let rate = RateLimit { max: 2, per: SECOND };
        let t0 = Instant::now();
        assert_eq!(windows.take("h", rate, t0), Ok(()));
        assert_eq!(windows.opening("h", rate, t0), None, "room left");
        assert_eq!(windows.take("h", rate, t0 + Duration::from_millis(300)), Ok(()));
        let opens = t0 + SECOND;
        assert_eq!(windows.take("h", rate, t0 + Duration::from_millis(600)), Err(opens), "full: no start counted");
        assert_eq!(windows.opening("h", rate, opens - Duration::from_millis(1)), Some(opens));
        assert_eq!(windows.take("h", rate, opens), Ok(()), "the first start left the window");
        assert_eq!(windows.opening("h", rate, opens), Some(t0 + Duration::from_millis(1_300)));
        assert_eq!(windows.opening("other", rate, t0), None, "each handler counts its own");
    }

    /// Six runs of a handler allowed two starts in any 200 ms, four run slots: no window ever
    /// holds three starts, and the runs waiting for their window hold no run slot (another
    /// handler's run takes one at once).
    #[tokio::test(start_paused = true)]
    async fn runs_start_within_their_window_and_wait_for_it_without_a_run_slot() {
        let windows = StartWindows::default();
        let permits = Arc::new(Semaphore::new(4));
        let rate = Some(RateLimit { max: 2, per: Duration::from_millis(200) });
        let started = Arc::new(Mutex::new(Vec::new()));
        let runs: Vec<_> = (0..6)
            .map(|_| {
                let (windows, permits, started) = (windows.clone(), permits.clone(), started.clone());
                tokio::spawn(async move {
                    let _slot = windows.run_slot("paced", rate, &permits).await.unwrap();
                    started.lock().unwrap().push(Instant::now());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(started.lock().unwrap().len(), 2);
        let other = tokio::time::timeout(Duration::from_millis(1), windows.run_slot("other", None, &permits)).await;
        assert!(other.is_ok_and(|slot| slot.is_some()), "the waiting runs hold no run slot");
        for run in runs {
            run.await.unwrap();
        }
        let started = started.lock().unwrap().clone();
        assert_eq!(started.len(), 6);
        for (first, third) in started.iter().zip(&started[2..]) {
            assert!(*third - *first >= Duration::from_millis(200), "three starts within {:?}", *third - *first);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_waiting_for_its_window_comes_back_when_the_host_stops() {
        let windows = StartWindows::default();
        let permits = Arc::new(Semaphore::new(4));
        let rate = Some(RateLimit { max: 1, per: Duration::from_secs(3600) });
        let _first = windows.run_slot("paced", rate, &permits).await.unwrap();
        let waiting = tokio::spawn({
            let (windows, permits) = (windows.clone(), permits.clone());
            async move { windows.run_slot("paced", rate, &permits).await.is_none() }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        windows.close();
        let came_back = tokio::time::timeout(Duration::from_secs(1), waiting).await.expect("not woken by the stop").unwrap();
        assert!(came_back);
    }
}
