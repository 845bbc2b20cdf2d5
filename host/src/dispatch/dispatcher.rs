//! The claim loop ([`Dispatcher::run`]): each turn waits for one thing and does its step.
//!
//! - **Take work** (`dispatch`): fan out in the background (`fan_out_task`; at most one at a
//!   time; a fan-out hands out up to the free capacity of what it creates, see
//!   [`Outbox::fan_out_early`]) and claim up to the free run slots plus `claim_ahead`
//!   (`claim`). Under a backlog the next hand-out batch waits until half the capacity is free,
//!   so a drain's deliveries are handed out rather than claimed; once a batch could not be
//!   (another host's lanes, keyed events) the rest goes to claims at once. A claim never
//!   overlaps a hand-out (both write the lanes' lists). Both keep to each throttled
//!   handler's room (`throttle`); higher priorities go first. Then the gates of handlers
//!   limited across hosts ask their limiters for what they lack (`global_limits`).
//! - **Start** (`start`): each delivery, claimed or handed out, in its own task under a run slot,
//!   counted against its handler's rate limits on this host; across hosts, let in by its
//!   handler's gate before it takes the slot. A run handed out before its fan-out committed
//!   reports its outcome only after the word that it did (as not run otherwise); a
//!   transactional one starts only then.
//! - **Settle** (`settle`): completions are batched (`completion`); failures are rescheduled
//!   with the handler's backoff or buried with a dead letter (`settle.rs`); a delivery out of
//!   attempts (its workers kept dying) is buried without running again. A retry's due time
//!   sets the timer that wakes the loop; finished runs waiting for their completion take
//!   places from the claims past a capacity's worth, so claims never outrun completions.
//! - **Renew** (`renew`): the leases of what runs and what waits for a slot, and this host's
//!   shares of the limits across hosts.
//! - **Stop** (`stop`): no more claims; a running fan-out finishes its batch; what has not
//!   started is handed back at once; running deliveries get the timeout, the rest are
//!   cancelled; all handed back, uncharged, with the lanes.
//!
//! A store error inside the loop is logged and the step tried again at the next poll (an
//! outcome that could not be written stays in flight, its lane renewed; the handler does not
//! run again); a host that dies leaves its leases to expire, so nothing is lost.
//!
//! The steps read and change the one loop state (`flight.rs`), so they are methods of the
//! one [`Dispatcher`]; the last, `stop`, is in `dispatcher/stop.rs`. What needs none of the
//! loop state lives beside it: what a dispatcher is given (`runner`, `options`), `fan_out_task`, `announcements`, `known_handlers` (the registry as
//! this host knows it: a fan-out subscribes every registered handler, those not served here
//! claims-only), `completion`, `starts`, `sequence_watch`, `settle` and `throttle`.

mod stop;

use std::cmp::Reverse;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bson::DateTime;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::time::Instant;

use super::completion::Completions;
use super::fan_out_task::{FanOutTask, join_fan_out};
use super::flight::{Flight, Running};
use super::options::{DispatcherCounters, DispatcherOptions};
use super::runner::{HandlerSpec, RunResult, Runner};
use super::announcements;
use super::known_handlers::KnownHandlers;
use super::starts::StartRecorder;
use super::throttle;
use super::{Settle, bury_with_dead_letter, decide};
use crate::lane::LaneId;
use crate::store::{
    Capacity, ClaimedDelivery, DeliveryId, EarlyHandOuts, KeyLimits, Lease, Priorities, Store, StoreError,
};

/// The claim loop of one store instance.
pub struct Dispatcher<S: Store, R: Runner> {
    store: Arc<S>,
    runner: Arc<R>,
    options: DispatcherOptions,
    wakeup: Arc<Notify>,
    counters: Arc<DispatcherCounters>,
    known: Arc<KnownHandlers>,
}

impl<S: Store, R: Runner> Dispatcher<S, R> {
    pub fn new(store: Arc<S>, runner: Arc<R>, options: DispatcherOptions) -> Self {
        Self { store, runner, options, wakeup: Arc::new(Notify::new()), counters: Arc::default(), known: Arc::default() }
    }

    pub fn counters(&self) -> Arc<DispatcherCounters> {
        self.counters.clone()
    }

    /// The handler registry as this host knows it (for `/metrics`).
    pub fn known_handlers(&self) -> Arc<KnownHandlers> {
        self.known.clone()
    }

    /// Wakes the loop now (new events committed, a retry came due).
    pub fn waker(&self) -> Arc<Notify> {
        self.wakeup.clone()
    }

    /// Runs until `stop` resolves, then stops gracefully.
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<(), StoreError> {
        tokio::pin!(stop);
        let permits = Arc::new(Semaphore::new(self.options.concurrency));
        let (finished_tx, mut finished) = mpsc::unbounded_channel::<(ClaimedDelivery, RunResult)>();
        let (early_tx, early) = mpsc::unbounded_channel::<Vec<ClaimedDelivery>>();
        let fanned = Arc::new(Notify::new());
        let completions = Completions::new(self.store.clone(), self.options.poll_interval);
        let mut flight = Flight::new(completions, StartRecorder::spawn(self.store.clone()), early);
        let mut renewal = tokio::time::interval(self.options.lease_duration / 3);
        renewal.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // An interval, not a sleep made again at every turn: a loop kept turning faster than
        // the poll interval (wakeups, finished runs) must still poll.
        let mut poll = tokio::time::interval(self.options.poll_interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll.tick().await;
        // Announced before the first fan-out, so that it leaves the hosts already live their
        // lanes' events; then again and again beside the loop.
        let hosts = self.store.announce(DateTime::now()).await.unwrap_or_else(|error| {
            tracing::warn!(%error, "announcing this host failed; trying again");
            0
        });
        // The registry read before the first fan-out: it creates the deliveries of every
        // handler subscribed, not only of those loaded here.
        if let Err(error) = self.known.refresh(&*self.store, self.runner.declarations()).await {
            tracing::warn!(%error, "declaring this host's handlers to the registry failed; fan-outs wait until it is read");
        }
        let hosts_changed = Arc::new(Notify::new());
        let runner = self.runner.clone();
        let declared: announcements::Declared = Arc::new(move || runner.declarations());
        let announcing = announcements::spawn(
            self.store.clone(),
            self.options.lease_duration,
            hosts,
            hosts_changed.clone(),
            (self.known.clone(), declared),
        );
        loop {
            let next_claim = flight.claim_timers.peek().map(|Reverse(at)| *at);
            // New events appear only with a wakeup or by the poll; a finished delivery brings
            // none, and makes a claim worth it only when it may have unblocked something.
            let step = tokio::select! {
                () = &mut stop => break,
                // New events become claimable once fanned out, which then asks for a claim.
                () = self.wakeup.notified() => { flight.fan_out = true; Ok(()) }
                _ = poll.tick() => {
                    flight.fan_out = true;
                    flight.claim = true;
                    flight.completions.resume();
                    let again = std::mem::take(&mut flight.unsettled);
                    self.settle(again, &mut flight).await
                }
                () = fanned.notified() => { flight.claim = true; Ok(()) }
                () = sleep_until_some(flight.ask_limiters_at) => { flight.ask_limiters_at = None; Ok(()) }
                () = sleep_until_some(next_claim) => {
                    let now = Instant::now();
                    while flight.claim_timers.peek().is_some_and(|Reverse(at)| *at <= now) {
                        flight.claim_timers.pop();
                    }
                    flight.claim = true;
                    Ok(())
                }
                Some(done) = finished.recv() => {
                    let batch = settle_batch(&mut flight, done, &mut finished);
                    self.settle(batch, &mut flight).await
                }
                fanned_out = join_fan_out(&mut flight.fanning) => {
                    flight.fanning = None;
                    fanned_out.map(|done| {
                        match done.lanes {
                            Some(lanes) => flight.claim_lanes.extend(lanes),
                            None => flight.claim |= done.new_deliveries,
                        }
                        flight.fan_out |= done.more;
                        flight.fan_out_waits = done.handed_out_full;
                        flight.handed_out.extend(done.claimed);
                    })
                }
                Some(claimed) = flight.early.recv() => {
                    flight.handed_out.extend(claimed);
                    Ok(())
                }
                // A key's next delivery is in its key's lane, which this host holds: a claim
                // there finds it, without searching the free lanes.
                written = flight.completions.ended() => written.map(|written| {
                    DispatcherCounters::add(&self.counters.completed, written.completed);
                    flight.claim_lanes.extend(written.keyed_lanes);
                    flight.fan_out |= written.fan_out;
                    // Lanes a new split gave another host go back once they ran empty: a claim
                    // hands them back, so that their host can hand out there.
                    flight.claim |= self.store.hints().holds_lanes_of_another_host();
                }),
                _ = renewal.tick() => self.renew(&mut flight).await,
                // A new split of the lanes may leave this host events it did not fan out so far.
                () = hosts_changed.notified() => { flight.fan_out = true; flight.claim = true; Ok(()) }
            };
            let step = match step {
                Ok(()) => self.dispatch(&permits, &finished_tx, &fanned, &early_tx, &mut flight).await,
                Err(error) => Err(error),
            };
            if let Err(error) = step {
                DispatcherCounters::add(&self.counters.store_errors, 1);
                tracing::warn!(%error, "store error; trying again at the next poll");
                flight.fan_out = true;
                flight.claim = true;
            }
        }
        announcing.abort();
        self.stop(&permits, &finished_tx, &mut flight, &mut finished).await
    }

    /// Starts a fan-out when one is wanted and none runs, claims up to the free capacity and
    /// starts the runs, and starts a completion of what waits for one.
    async fn dispatch(
        &self,
        permits: &Arc<Semaphore>,
        finished_tx: &mpsc::UnboundedSender<(ClaimedDelivery, RunResult)>,
        fanned: &Arc<Notify>,
        early: &EarlyHandOuts,
        flight: &mut Flight<S>,
    ) -> Result<(), StoreError> {
        flight.completions.start();
        let specs = self.runner.handlers();
        // What a fan-out sent before its commit is started before any claim counts rooms: a
        // hand-out that ended sent it already.
        while let Ok(claimed) = flight.early.try_recv() {
            flight.handed_out.extend(claimed);
        }
        let handed_out = std::mem::take(&mut flight.handed_out);
        self.start(handed_out, &specs, permits, finished_tx, flight).await?;
        // A host that serves nothing still fans out its share for the handlers the registry
        // keeps subscribed.
        if specs.is_empty() && !self.known.any_active() {
            return Ok(());
        }
        // A claim and a fan-out that hands out both want the lanes' lists, and the fan-out
        // hands out nothing while a claim holds them: they never overlap. A fan-out started by
        // new events goes first (the short way from a commit to its handler); under a
        // backlog, a claim that is wanted goes before the next batch, so retries due and
        // deliveries left to claims are not held back until the backlog is fanned out.
        let claim_first = flight.fan_out_waits;
        if !claim_first {
            self.fan_out(&specs, fanned, early, flight)?;
        }
        let handing_out = flight.fanning.is_some() && flight.fanning_hands_out.load(Ordering::SeqCst);
        if !handing_out {
            self.claim(&specs, permits, finished_tx, flight).await?;
        }
        if claim_first {
            self.fan_out(&specs, fanned, early, flight)?;
        }
        // What waits at the gates of handlers limited across hosts asks their limiters.
        if !flight.global_shares.is_empty() {
            flight.ask_limiters_at = flight.global_shares.ask(&self.store, &specs);
        }
        Ok(())
    }

    /// The free capacity (run slots and `claim_ahead`), of which the free run slots start at
    /// once (see [`Capacity`]).
    fn capacity(&self, flight: &Flight<S>) -> Capacity {
        let (free, _) = self.free_capacity(flight);
        Capacity::new(free, self.options.concurrency.saturating_sub(flight.running.len()))
    }

    /// The free capacity (run slots and `claim_ahead`), and whether it is worth a claim.
    fn free_capacity(&self, flight: &Flight<S>) -> (usize, bool) {
        let capacity = self.options.concurrency + self.options.claim_ahead;
        // Completions are written in batches, one at a time, so a capacity's worth of finished
        // runs may wait for theirs without holding claims back; beyond that they count, or a
        // claimer whose completions fall behind would keep claiming, and every claim would
        // step over all the finished but unwritten deliveries of its lanes (over a thousand in
        // drains, which made each claim slower than the one before).
        let in_flight = flight.running.len() + flight.completions.pending().saturating_sub(capacity);
        let free = capacity.saturating_sub(in_flight);
        // Under a backlog, claim in big batches: a claim costs about the same whatever its
        // size, and what is already claimed keeps the run slots busy meanwhile.
        let worth_it = free > 0 && (free * 2 >= capacity || in_flight <= self.options.concurrency);
        (free, worth_it)
    }

    /// Starts a fan-out when one is wanted and none runs; it hands out up to the free
    /// capacity.
    fn fan_out(
        &self,
        specs: &[HandlerSpec],
        fanned: &Arc<Notify>,
        early: &EarlyHandOuts,
        flight: &mut Flight<S>,
    ) -> Result<(), StoreError> {
        let (free, worth_it) = self.free_capacity(flight);
        if flight.fan_out && flight.fanning.is_none() && (worth_it || !flight.fan_out_waits) {
            // Until the registry was read, events wait unfanned (the next announcement reads it).
            let Some(subscriptions) = self.known.subscriptions(specs) else { return Ok(()) };
            let subscriptions = subscriptions.map(|s| s.with_schemas(self.options.schemas.current()));
            let subscriptions = subscriptions?;
            flight.fan_out = false;
            // What it hands out runs at once or waits for a run slot, like a claim's picks.
            flight.fanning_hands_out.store(free > 0, Ordering::SeqCst);
            let hands_out = flight.fanning_hands_out.clone();
            // A throttled handler's deliveries are handed out within the room a claim would
            // have.
            let capacity = self.capacity(flight);
            let rooms = throttle::rooms(specs, |h| held(&flight.running, h));
            let capacity = capacity.within(rooms).ordered_by(priorities(specs));
            let task = FanOutTask {
                store: self.store.clone(),
                batch: self.options.fan_out_batch,
                subscriptions,
                fanned: fanned.clone(),
                early: early.clone(),
                hands_out,
                stop: flight.stop_fanning.clone(),
            };
            flight.fanning = Some(task.spawn(capacity));
        }
        Ok(())
    }

    /// Claims up to the free capacity when a claim is wanted and worth it, and starts the runs;
    /// of a throttled handler, no more than the room its throttle leaves (see
    /// [`super::throttle`]).
    async fn claim(
        &self,
        specs: &[HandlerSpec],
        permits: &Arc<Semaphore>,
        finished_tx: &mpsc::UnboundedSender<(ClaimedDelivery, RunResult)>,
        flight: &mut Flight<S>,
    ) -> Result<(), StoreError> {
        let (free, worth_it) = self.free_capacity(flight);
        if specs.is_empty() {
            return Ok(());
        }
        let search_all = flight.claim || flight.backlog;
        let wanted = search_all || !flight.claim_lanes.is_empty();
        if !worth_it || !wanted {
            return Ok(());
        }
        flight.claim = false;
        let lanes: Vec<LaneId> = std::mem::take(&mut flight.claim_lanes).into_iter().collect();
        let handlers: Vec<String> = specs.iter().map(|s| s.handler.clone()).collect();
        let capacity = self.capacity(flight);
        let rooms = throttle::rooms(specs, |h| held(&flight.running, h));
        let started = Instant::now();
        let capacity = capacity.within(rooms.clone()).ordered_by(priorities(specs)).keyed_within(key_limits(specs));
        let claimed = if search_all {
            self.store.claim(&handlers, capacity, DateTime::now()).await?
        } else {
            self.store.claim_in(&handlers, &lanes, capacity, DateTime::now()).await?
        };
        tracing::trace!(elapsed_us = started.elapsed().as_micros() as u64, count = claimed.len(), "claimed");
        flight.backlog = claimed.len() >= free;
        // Throttled handlers whose room the claim filled: more may wait, to claim once one of
        // their runs ends.
        flight.rooms_filled = specs
            .iter()
            .filter(|s| rooms.of(&s.handler).is_some_and(|room| claimed.iter().filter(|c| c.handler == s.handler).count() >= room.most))
            .map(|s| s.handler.clone())
            .collect();
        self.start(claimed, specs, permits, finished_tx, flight).await?;
        let fanning_out = flight.fan_out || flight.fan_out_waits || flight.fanning.is_some();
        flight.global_shares.after_claim(&self.store, specs, &flight.rooms_filled, fanning_out);
        Ok(())
    }

    /// Starts runs of leased deliveries, claimed or handed out (each waits for a run slot), or
    /// buries those whose attempts are used up. The one place that reads a lease's
    /// [`ClaimedDelivery::before_commit`]: a delivery handed out before its fan-out committed
    /// reports its run only once the commit is known, as not run if it failed (it may not
    /// exist then); a transactional handler's run waits for it before it starts, since its
    /// completion deletes the delivery in its own transaction.
    async fn start(
        &self,
        claimed: Vec<ClaimedDelivery>,
        specs: &[HandlerSpec],
        permits: &Arc<Semaphore>,
        finished_tx: &mpsc::UnboundedSender<(ClaimedDelivery, RunResult)>,
        flight: &mut Flight<S>,
    ) -> Result<(), StoreError> {
        for delivery in claimed {
            let Some(spec) = specs.iter().find(|s| s.handler == delivery.handler) else { continue };
            if delivery.attempts >= spec.retry.max_attempts {
                // Its workers kept dying while running it: dead without running again.
                let reason = format!("{} attempts used up by workers that stopped while running it", delivery.attempts);
                bury_with_dead_letter(&*self.store, &delivery, &reason, false, DateTime::now()).await?;
                DispatcherCounters::add(&self.counters.dead, 1);
                // Its dead letter is a new event, and its key may move on.
                flight.fan_out = true;
                flight.claim = true;
                continue;
            }
            // Across hosts, it waits at its handler's gate; on this host, for a start in its
            // handler's window, taken with its run slot.
            let mut place = spec.controls.throttle.global().then(|| flight.global_shares.enter(&spec.handler));
            let (windows, rate) = (flight.start_windows.clone(), spec.controls.throttle.rate);
            let (runner, finished_tx, permits) = (self.runner.clone(), finished_tx.clone(), permits.clone());
            let (lease, delivery_handler) = (delivery.lease, delivery.handler.clone());
            let (commit, transactional) = (delivery.before_commit.clone(), spec.transactional);
            if flight.sequences.starts(&delivery) {
                DispatcherCounters::add(&self.counters.out_of_order, 1);
            }
            // Claimed ahead and suspect (a host died while it may have been running it): its
            // start is recorded once it has a run slot, before it runs.
            let starts = (!delivery.started && delivery.suspect).then(|| flight.starts.clone());
            let task = tokio::spawn(async move {
                // Let in by its gate (counted as running across hosts until it ends; room in
                // its window first, so that it holds no place there meanwhile), then a run slot
                // with a start in its window. A closed gate, window or semaphore means the host
                // is stopping: hand it back unstarted.
                let slot = async {
                    if let Some(place) = place.as_mut() {
                        let window_open = match rate {
                            Some(rate) => windows.wait_for_room(&delivery.handler, rate).await,
                            None => true,
                        };
                        if !window_open || !place.let_in().await {
                            return None;
                        }
                    }
                    windows.run_slot(&delivery.handler, rate, &permits).await
                };
                let Some(_permit) = slot.await else {
                    let _ = finished_tx.send((delivery, RunResult::NotRun));
                    return;
                };
                let recorded = match &starts {
                    Some(starts) => starts.record(lease).await,
                    None => true,
                };
                let result = match commit {
                    _ if !recorded => RunResult::LeaseLost,
                    None => runner.run(delivery.clone()).await,
                    Some(commit) if transactional => {
                        if commit.committed().await { runner.run(delivery.clone()).await } else { RunResult::NotRun }
                    }
                    Some(commit) => {
                        let result = runner.run(delivery.clone()).await;
                        if commit.committed().await { result } else { RunResult::NotRun }
                    }
                };
                drop(place);
                let _ = finished_tx.send((delivery, result));
            });
            let running = Running { lease, handler: delivery_handler, renew: !spec.transactional, task: task.abort_handle() };
            flight.running.insert(lease.delivery, running);
        }
        Ok(())
    }

    /// Settles finished runs, and notes what they may have made worth a fan-out or a claim.
    /// A run whose outcome could not be written stays in flight and in `flight.unsettled`, to
    /// be settled again (the first such error is returned, after the whole batch was tried).
    async fn settle(&self, batch: Vec<(ClaimedDelivery, RunResult)>, flight: &mut Flight<S>) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let specs = self.runner.handlers();
        let now = DateTime::now();
        let mut not_run = Vec::new();
        let mut first_error = None;
        for (delivery, result) in batch {
            // A run that ended leaves room for the next delivery of a handler throttled on this
            // host, or of its key for one limited per key, or of one whose room the last claim
            // filled.
            flight.claim |= flight.rooms_filled.contains(&delivery.handler)
                || specs.iter().any(|s| s.handler == delivery.handler && (s.controls.throttle.per_host() || s.controls.per_key.is_some()));
            // A keyed delivery that ended may let its key's next one go: at once, or (for a
            // completion written in the background) once that is written.
            let keyed = delivery.event.key.is_some();
            let attempt = match &result {
                RunResult::CompletedInTransaction => {
                    flight.running.remove(&delivery.lease.delivery);
                    DispatcherCounters::add(&self.counters.completed, 1);
                    flight.claim |= keyed;
                    continue;
                }
                RunResult::LeaseLost => {
                    flight.running.remove(&delivery.lease.delivery);
                    flight.claim |= keyed;
                    continue;
                }
                RunResult::NotRun => {
                    not_run.push((delivery, result));
                    continue;
                }
                RunResult::Attempt(attempt) => attempt.clone(),
            };
            let policy = specs.iter().find(|s| s.handler == delivery.handler).map(|s| s.retry).unwrap_or_default();
            let written = match decide(attempt, delivery.attempts + 1, &policy, now, fastrand::f64()) {
                Settle::Complete => {
                    let key = delivery.event.key.clone().map(|key| (delivery.handler.clone(), key));
                    flight.completions.push(delivery.lease, key);
                    Ok(())
                }
                Settle::Reschedule { due_at, reason } => {
                    self.store.reschedule(&delivery.lease, due_at, &reason, now).await.map(|_| {
                        flight.claim |= keyed;
                        DispatcherCounters::add(&self.counters.retried, 1);
                        let wait = Duration::from_millis(due_at.timestamp_millis().saturating_sub(now.timestamp_millis()).max(0) as u64);
                        flight.claim_timers.push(Reverse(Instant::now() + wait));
                    })
                }
                Settle::Bury { reason } => bury_with_dead_letter(&*self.store, &delivery, &reason, true, now).await.map(|_| {
                    DispatcherCounters::add(&self.counters.dead, 1);
                    // Its dead letter is a new event: fan it out at once.
                    flight.fan_out = true;
                    flight.claim = true;
                }),
            };
            match written {
                Ok(()) => {
                    flight.running.remove(&delivery.lease.delivery);
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                    flight.unsettled.push((delivery, result));
                }
            }
        }
        if !not_run.is_empty() {
            let leases: Vec<Lease> = not_run.iter().map(|(delivery, _)| delivery.lease).collect();
            match self.store.release(&leases, now).await {
                Ok(_) => {
                    for lease in &leases {
                        flight.running.remove(&lease.delivery);
                    }
                    DispatcherCounters::add(&self.counters.released, leases.len());
                    flight.claim = true;
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                    flight.unsettled.extend(not_run);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Renews the leases of what runs and waits for a slot, and this host's shares of the
    /// limits across hosts.
    async fn renew(&self, flight: &mut Flight<S>) -> Result<(), StoreError> {
        let leases: Vec<Lease> = flight.running.values().filter(|r| r.renew).map(|r| r.lease).collect();
        if !flight.global_shares.is_empty() {
            let specs = self.runner.handlers();
            flight.global_shares.renew(&self.store, &specs);
        }
        if !leases.is_empty() {
            self.store.extend_lease(&leases, DateTime::now()).await?;
        }
        Ok(())
    }
}

/// What to settle once `done` arrived: the outcomes still unwritten, `done`, and every other
/// run that finished meanwhile.
fn settle_batch<S: Store>(
    flight: &mut Flight<S>,
    done: (ClaimedDelivery, RunResult),
    finished: &mut mpsc::UnboundedReceiver<(ClaimedDelivery, RunResult)>,
) -> Vec<(ClaimedDelivery, RunResult)> {
    let mut batch = std::mem::take(&mut flight.unsettled);
    batch.push(done);
    while let Ok(more) = finished.try_recv() {
        batch.push(more);
    }
    batch
}

/// How many deliveries of `handler` this host holds (running or waiting for a run slot).
fn held(running: &HashMap<DeliveryId, Running>, handler: &str) -> usize {
    running.values().filter(|r| r.handler == handler).count()
}

/// The most of one key at once of the handlers that run several of a key, as claims take it.
fn key_limits(specs: &[HandlerSpec]) -> KeyLimits {
    KeyLimits::new(specs.iter().filter_map(|spec| Some((spec.handler.clone(), spec.controls.per_key.as_ref()?.limit))))
}

/// The handlers' priorities, as claims and hand-outs take them.
fn priorities(specs: &[HandlerSpec]) -> Priorities {
    Priorities::new(specs.iter().map(|spec| (spec.handler.clone(), spec.controls.priority)))
        .per_event(specs.iter().filter(|spec| spec.controls.priority_from.is_some()).map(|spec| spec.handler.clone()))
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
