//! The claim loop with native handler functions on the in-memory store (the dispatcher knows
//! nothing of WebAssembly): delivery to every handler once, per-key order across two
//! dispatchers, retries with backoff, dead letters, graceful stop (also while a fan-out
//! hangs or finishes a batch it handed out), completions and reschedulings that failed,
//! claims batched under a backlog, runs handed out before their fan-out's commit, lanes a new
//! split gave another host handed back as their runs end.

mod common;

use relayhost::store::{Administration, Hosts, Outbox};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use relayhost::dispatch::{Jitter, 
    AttemptResult, DEAD_LETTER_EVENT_TYPE, Dispatcher, DispatcherOptions, HandlerSpec, RetryPolicy, RunResult, Runner,
    Controls,
};
use relayhost::store::memory::MemoryStore;
use bson::DateTime;
use relayhost::event::NewEvent;
use relayhost::lane::LaneId;
use relayhost::store::{
    Capacity, ClaimedDelivery, DeliveryFilter, DeliveryPage, DeliveryView, EarlyHandOuts, FanOutCommit, FanOutReport,
    HandlerStatistics, Lease, Published, PurgeOptions, PurgeReport, Settlement, Store, StoreError, StoreOptions,
    Subscription, Subscriptions, Declaration, Disposal, RegisteredHandler, RetireReport,
};

type Behaviour = dyn Fn(&ClaimedDelivery) -> AttemptResult + Send + Sync;

#[derive(Clone)]
struct Run {
    handler: String,
    event: String,
    key: Option<String>,
    sequence: Option<i64>,
    attempt: u32,
}

/// Handlers as plain functions, recording every run and checking that no two deliveries of
/// one (handler, key) ever run at once.
struct NativeRunner {
    specs: Vec<HandlerSpec>,
    behaviour: Arc<Behaviour>,
    delay: Duration,
    runs: Arc<Mutex<Vec<Run>>>,
    busy: Arc<Mutex<HashSet<(String, String)>>>,
}

impl Runner for NativeRunner {
    fn handlers(&self) -> Vec<HandlerSpec> {
        self.specs.clone()
    }

    fn run(&self, delivery: ClaimedDelivery) -> Pin<Box<dyn Future<Output = RunResult> + Send>> {
        let (behaviour, delay, runs, busy) = (self.behaviour.clone(), self.delay, self.runs.clone(), self.busy.clone());
        Box::pin(async move {
            let slot = delivery.event.key.clone().map(|k| (delivery.handler.clone(), k));
            if let Some(slot) = &slot {
                assert!(busy.lock().unwrap().insert(slot.clone()), "two deliveries of {slot:?} at once");
            }
            tokio::time::sleep(delay).await;
            runs.lock().unwrap().push(Run {
                handler: delivery.handler.clone(),
                event: delivery.event.id.clone(),
                key: delivery.event.key.clone(),
                sequence: delivery.event.sequence,
                attempt: delivery.attempts + 1,
            });
            if let Some(slot) = &slot {
                busy.lock().unwrap().remove(slot);
            }
            RunResult::Attempt(behaviour(&delivery))
        })
    }
}

fn spec(handler: &str, types: &[&str], retry: RetryPolicy) -> HandlerSpec {
    HandlerSpec {
        handler: handler.into(),
        event_types: types.iter().map(|t| t.to_string()).collect(),
        retry,
        controls: Controls::default(),
        transactional: false,
    }
}

fn quick_retry(max_attempts: u32) -> RetryPolicy {
    // Without jitter: the tests count on the backoff's bounds.
    RetryPolicy { max_attempts, initial_backoff: Duration::from_millis(20), max_backoff: Duration::from_millis(80), jitter: Jitter::None, ..RetryPolicy::default() }
}

fn options(concurrency: usize) -> DispatcherOptions {
    DispatcherOptions {
        concurrency,
        poll_interval: Duration::from_millis(20),
        lease_duration: Duration::from_secs(30),
        shutdown_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

fn memory_store(owner: &str) -> MemoryStore {
    MemoryStore::new(StoreOptions { owner: owner.into(), ..StoreOptions::default() })
}

async fn until(what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs a dispatcher until `check` holds, then stops it gracefully.
async fn run_until<S: Store, R: Runner>(
    store: Arc<S>,
    runner: Arc<R>,
    options: DispatcherOptions,
    what: &str,
    check: impl Fn() -> bool,
) {
    let (stop, handle) = start(store, runner, options);
    until(what, check).await;
    stop.send(()).unwrap();
    handle.await.unwrap();
}

/// Publishes the `order.placed` events `e-0`, `e-1`, ... in one transaction.
async fn publish_orders(store: &impl Store, count: usize) {
    publish_all(store, (0..count).map(|n| event(&format!("e-{n}"), "order.placed")).collect()).await;
}

/// Starts a dispatcher; the returned sender stops it, the handle ends when it has stopped.
fn start<S: Store, R: Runner>(
    store: Arc<S>,
    runner: Arc<R>,
    options: DispatcherOptions,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        let dispatcher = Dispatcher::new(store, runner, options);
        dispatcher.run(async { let _ = stopped.await; }).await.unwrap();
    });
    (stop, handle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_reaches_every_handler_once_in_key_order_across_two_dispatchers() {
    let first = Arc::new(memory_store("first"));
    let second = Arc::new(first.instance("second"));
    let mut events = Vec::new();
    for n in 0..60 {
        events.push(keyed(&format!("k-{n}"), "order.placed", &format!("customer-{}", n % 6)));
    }
    for n in 0..20 {
        events.push(event(&format!("u-{n}"), "order.placed"));
    }
    publish_all(&*first, events).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let busy: Arc<Mutex<HashSet<(String, String)>>> = Arc::default();
    let runner = |_: ()| {
        Arc::new(NativeRunner {
            specs: vec![spec("mailer", &["order.placed"], quick_retry(5)), spec("ledger", &["order.placed"], quick_retry(5))],
            behaviour: Arc::new(|_| AttemptResult::Completed),
            delay: Duration::from_millis(2),
            runs: runs.clone(),
            busy: busy.clone(),
        })
    };
    let (stop_a, a) = start(first.clone(), runner(()), options(4));
    let (stop_b, b) = start(second.clone(), runner(()), options(4));
    until("160 runs", || runs.lock().unwrap().len() >= 160).await;
    stop_a.send(()).unwrap();
    stop_b.send(()).unwrap();
    a.await.unwrap();
    b.await.unwrap();

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 160, "each of 80 events to each of 2 handlers, once");
    let distinct: HashSet<(String, String)> = runs.iter().map(|r| (r.handler.clone(), r.event.clone())).collect();
    assert_eq!(distinct.len(), 160);
    let mut last: HashMap<(String, String), i64> = HashMap::new();
    for run in &runs {
        if let (Some(key), Some(sequence)) = (&run.key, run.sequence) {
            let previous = last.insert((run.handler.clone(), key.clone()), sequence).unwrap_or(0);
            assert_eq!(sequence, previous + 1, "{} of {key} out of order", run.handler);
        }
    }
    assert!(first.list_deliveries(&Default::default()).await.unwrap().deliveries.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_retry_with_backoff_and_poison_ends_in_the_dead_letters() {
    let store = Arc::new(memory_store("worker"));
    publish_all(&*store, vec![event("order-1", "order.placed")]).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let behaviour: Arc<Behaviour> = Arc::new(|delivery: &ClaimedDelivery| match delivery.handler.as_str() {
        "flaky" if delivery.attempts < 2 => AttemptResult::Retry { reason: "upstream 503".into(), not_before: None },
        "poison" => AttemptResult::Failed("trap: unreachable".into()),
        _ => AttemptResult::Completed,
    });
    let runner = Arc::new(NativeRunner {
        specs: vec![
            spec("flaky", &["order.placed"], quick_retry(3)),
            spec("poison", &["order.placed"], quick_retry(3)),
            spec("dead-letters", &[DEAD_LETTER_EVENT_TYPE], quick_retry(3)),
        ],
        behaviour,
        delay: Duration::ZERO,
        runs: runs.clone(),
        busy: Arc::default(),
    });
    let started = Instant::now();
    let (stop, handle) = start(store.clone(), runner, options(8));
    until("the dead letter", || runs.lock().unwrap().iter().any(|r| r.handler == "dead-letters")).await;
    until("the flaky handler's success", || runs.lock().unwrap().iter().filter(|r| r.handler == "flaky").count() == 3).await;
    stop.send(()).unwrap();
    handle.await.unwrap();

    let runs = runs.lock().unwrap().clone();
    let attempts = |handler: &str| runs.iter().filter(|r| r.handler == handler).map(|r| r.attempt).collect::<Vec<_>>();
    assert_eq!(attempts("flaky"), [1, 2, 3]);
    assert_eq!(attempts("poison"), [1, 2, 3]);
    // Two backoffs (20 ms, then 40 ms) separate the three attempts.
    assert!(started.elapsed() >= Duration::from_millis(60));
    let dead = dead(&*store).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].handler, "poison");
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].last_error.as_deref(), Some("trap: unreachable (attempt 3 of 3)"));
    let letter = runs.iter().find(|r| r.handler == "dead-letters").unwrap();
    assert!(letter.event.starts_with("dead:"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_lets_running_deliveries_finish_and_hands_the_lanes_back() {
    let store = Arc::new(memory_store("leaving"));
    let successor = Arc::new(store.instance("successor"));
    publish_orders(&*store, 6).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let slow = |runs: &Arc<Mutex<Vec<Run>>>| {
        Arc::new(NativeRunner {
            specs: vec![spec("slow", &["order.placed"], quick_retry(3))],
            behaviour: Arc::new(|_| AttemptResult::Completed),
            delay: Duration::from_millis(300),
            runs: runs.clone(),
            busy: Arc::default(),
        })
    };
    // Two run at once and two more are claimed ahead, waiting for a slot.
    let (stop, handle) = start(store.clone(), slow(&runs), DispatcherOptions { claim_ahead: 2, ..options(2) });
    until("two deliveries running and two waiting", || {
        futures::executor::block_on(store.statistics(bson::DateTime::now())).unwrap().first().is_some_and(|s| s.running == 4)
    })
    .await;
    stop.send(()).unwrap();
    handle.await.unwrap();
    // The two that were running finished and completed; the two waiting were handed back
    // without running; nothing else ran. (The fan-out handed out no more than the capacity,
    // and fanned out no more than that while the capacity was taken: the other two events
    // wait unfanned.)
    assert_eq!(runs.lock().unwrap().len(), 2);
    let remaining = store.list_deliveries(&Default::default()).await.unwrap().deliveries;
    assert_eq!(remaining.len(), 2);
    assert!(remaining.iter().all(|d| d.attempts == 0), "a graceful stop charges nothing");
    // The lanes were handed back: a successor takes the rest at once, not after the lease.
    run_until(successor.clone(), slow(&runs), options(8), "the rest", || runs.lock().unwrap().len() == 6).await;
}

/// The host spawns the loop over the MongoDB store: its future must be `Send`.
#[allow(dead_code)]
fn the_loop_over_mongodb_can_be_spawned(dispatcher: &'static Dispatcher<relayhost::store::mongo::MongoStore, NativeRunner>) {
    fn spawnable<T: Send + 'static>(_: T) {}
    spawnable(dispatcher.run(std::future::pending()));
}

/// The memory store with faults injected: its first `complete_many` and `reschedule` calls
/// fail (a network blip) and its first `fan_out` calls never answer (a server that hangs). It
/// notes the size of every claim.
struct FaultyStore {
    inner: MemoryStore,
    completions_failing: AtomicUsize,
    reschedules_failing: AtomicUsize,
    fan_outs_hanging: AtomicUsize,
    /// The next fan-outs that hand out something answer only 300 ms after their batch
    /// committed (a fan-out finishing its batch while the host stops).
    slow_hand_outs: AtomicUsize,
    /// Hanging fan-outs whose caller gave up on them (dropped their future).
    fan_outs_abandoned: AtomicUsize,
    /// The `limit` of every claim.
    claim_limits: Mutex<Vec<usize>>,
    /// The words of the next fan-outs that hand out early: what the memory store handed out
    /// once committed is sent early instead, and the word (whether the fan-out committed)
    /// follows 100 ms later.
    early_words: Mutex<Vec<bool>>,
    /// Words given so far.
    words_given: Arc<AtomicUsize>,
    /// Leases whose starts were recorded.
    starts_recorded: AtomicUsize,
}

/// Counts one up when dropped.
struct CountOnDrop<'a>(&'a AtomicUsize);

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, SeqCst);
    }
}

impl FaultyStore {
    fn new(inner: MemoryStore, completions_failing: usize, reschedules_failing: usize) -> Self {
        Self {
            inner,
            completions_failing: completions_failing.into(),
            reschedules_failing: reschedules_failing.into(),
            fan_outs_hanging: 0.into(),
            slow_hand_outs: 0.into(),
            fan_outs_abandoned: 0.into(),
            claim_limits: Mutex::default(),
            early_words: Mutex::default(),
            words_given: Arc::default(),
            starts_recorded: 0.into(),
        }
    }

    fn with_early_words(self, words: &[bool]) -> Self {
        Self { early_words: Mutex::new(words.iter().rev().copied().collect()), ..self }
    }

    fn with_hanging_fan_outs(self, count: usize) -> Self {
        Self { fan_outs_hanging: count.into(), ..self }
    }

    fn with_slow_hand_outs(self, count: usize) -> Self {
        Self { slow_hand_outs: count.into(), ..self }
    }
}

/// Takes one of `left`'s failures, if any is left.
fn fails(left: &AtomicUsize) -> bool {
    left.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok()
}

impl Outbox for FaultyStore {
    type Tx = <MemoryStore as Outbox>::Tx;
    async fn setup(&self) -> Result<(), StoreError> {
        self.inner.setup().await
    }
    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.inner.begin().await
    }
    async fn publish(&self, tx: &mut Self::Tx, event: &NewEvent) -> Result<Published, StoreError> {
        self.inner.publish(tx, event).await
    }
    async fn fan_out(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: impl Into<Capacity> + Send,
        now: DateTime,
    ) -> Result<FanOutReport, StoreError> {
        if fails(&self.fan_outs_hanging) {
            let _abandoned = CountOnDrop(&self.fan_outs_abandoned);
            std::future::pending::<()>().await;
        }
        let report = self.inner.fan_out(subscriptions, limit, hand_out, now).await?;
        if !report.claimed.is_empty() && fails(&self.slow_hand_outs) {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Ok(report)
    }
    async fn fan_out_early(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: impl Into<Capacity> + Send,
        early: &EarlyHandOuts,
        now: DateTime,
    ) -> Result<FanOutReport, StoreError> {
        let mut report = self.fan_out(subscriptions, limit, hand_out, now).await?;
        if report.claimed.is_empty() {
            return Ok(report);
        }
        let Some(word) = self.early_words.lock().unwrap().pop() else { return Ok(report) };
        let (tell, commit) = FanOutCommit::channel();
        report.sent_early = report.claimed.len();
        let mut claimed = std::mem::take(&mut report.claimed);
        for delivery in &mut claimed {
            delivery.before_commit = Some(commit.clone());
        }
        early.send(claimed).unwrap();
        let given = self.words_given.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            given.fetch_add(1, SeqCst);
            // Nobody may be waiting for it any more (the host stopped).
            let _ = tell.send(Some(word));
        });
        Ok(report)
    }
    async fn claim(&self, handlers: &[String], limit: impl Into<Capacity> + Send, now: DateTime) -> Result<Vec<ClaimedDelivery>, StoreError> {
        let limit = limit.into();
        self.claim_limits.lock().unwrap().push(limit.total);
        self.inner.claim(handlers, limit, now).await
    }
    async fn claim_in(
        &self,
        handlers: &[String],
        lanes: &[LaneId],
        limit: impl Into<Capacity> + Send,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        let limit = limit.into();
        self.claim_limits.lock().unwrap().push(limit.total);
        self.inner.claim_in(handlers, lanes, limit, now).await
    }
    async fn record_starts(&self, leases: &[Lease]) -> Result<Vec<bool>, StoreError> {
        self.starts_recorded.fetch_add(leases.len(), SeqCst);
        self.inner.record_starts(leases).await
    }
    fn hints(&self) -> relayhost::store::SchedulerHints<'_> {
        self.inner.hints()
    }
    async fn complete_many(&self, leases: &[Lease], now: DateTime) -> Result<Vec<Settlement>, StoreError> {
        if fails(&self.completions_failing) {
            return Err(StoreError::Corrupt("injected: the completion's reply was lost".into()));
        }
        self.inner.complete_many(leases, now).await
    }
    async fn complete_in(&self, tx: &mut Self::Tx, lease: &Lease, now: DateTime) -> Result<(), StoreError> {
        self.inner.complete_in(tx, lease, now).await
    }
    async fn reschedule(&self, lease: &Lease, due_at: DateTime, error: &str, now: DateTime) -> Result<Settlement, StoreError> {
        if fails(&self.reschedules_failing) {
            return Err(StoreError::Corrupt("injected: the server stepped down".into()));
        }
        self.inner.reschedule(lease, due_at, error, now).await
    }
    async fn release(&self, leases: &[Lease], now: DateTime) -> Result<usize, StoreError> {
        self.inner.release(leases, now).await
    }
    async fn bury(&self, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<Settlement, StoreError> {
        self.inner.bury(lease, reason, charge_attempt, now).await
    }
    async fn bury_in(&self, tx: &mut Self::Tx, lease: &Lease, reason: &str, charge_attempt: bool, now: DateTime) -> Result<(), StoreError> {
        self.inner.bury_in(tx, lease, reason, charge_attempt, now).await
    }
    async fn extend_lease(&self, leases: &[Lease], now: DateTime) -> Result<Vec<bool>, StoreError> {
        self.inner.extend_lease(leases, now).await
    }
}

impl Hosts for FaultyStore {
    async fn relinquish(&self) -> Result<(), StoreError> {
        self.inner.relinquish().await
    }
    async fn announce(&self, now: DateTime) -> Result<usize, StoreError> {
        self.inner.announce(now).await
    }
    async fn look(&self, now: DateTime) -> Result<usize, StoreError> {
        self.inner.look(now).await
    }
    async fn register(&self, declarations: &[Declaration], now: DateTime) -> Result<Vec<RegisteredHandler>, StoreError> {
        self.inner.register(declarations, now).await
    }
    async fn registered_handlers(&self, now: DateTime) -> Result<Vec<RegisteredHandler>, StoreError> {
        self.inner.registered_handlers(now).await
    }
    async fn membership(&self, now: DateTime) -> Result<relayhost::store::Membership, StoreError> {
        self.inner.membership(now).await
    }
    async fn take_turn(&self, job: &str, turn: Duration, now: DateTime) -> Result<bool, StoreError> {
        self.inner.take_turn(job, turn, now).await
    }
    async fn lease_share(
        &self,
        handler: &str,
        request: &relayhost::store::limiter::ShareRequest,
        now: DateTime,
    ) -> Result<relayhost::store::limiter::ShareGrant, StoreError> {
        self.inner.lease_share(handler, request, now).await
    }
}

impl Administration for FaultyStore {
    async fn retire(&self, handler: &str, disposal: Disposal, now: DateTime) -> Result<RetireReport, StoreError> {
        self.inner.retire(handler, disposal, now).await
    }
    async fn reopen_for(&self, handler: &str, types: &[String], since: Option<DateTime>, limit: usize) -> Result<Vec<bson::Bson>, StoreError> {
        self.inner.reopen_for(handler, types, since, limit).await
    }
    async fn backfill_waiting(&self, handler: &str, types: &[String], since: Option<DateTime>) -> Result<usize, StoreError> {
        self.inner.backfill_waiting(handler, types, since).await
    }
    async fn unfanned_among(&self, events: &[bson::Bson]) -> Result<usize, StoreError> {
        self.inner.unfanned_among(events).await
    }
    async fn event_history(&self, event_id: &str) -> Result<relayhost::store::EventHistory, StoreError> {
        self.inner.event_history(event_id).await
    }
    async fn purge_preview(&self, options: &PurgeOptions, now: DateTime) -> Result<PurgeReport, StoreError> {
        self.inner.purge_preview(options, now).await
    }
    async fn requeue(&self, delivery_id: &str, now: DateTime) -> Result<(), StoreError> {
        self.inner.requeue(delivery_id, now).await
    }
    async fn bury_pending_in(&self, tx: &mut Self::Tx, delivery_id: &str, reason: &str, now: DateTime) -> Result<DeliveryView, StoreError> {
        self.inner.bury_pending_in(tx, delivery_id, reason, now).await
    }
    async fn purge(&self, options: &PurgeOptions, now: DateTime) -> Result<PurgeReport, StoreError> {
        self.inner.purge(options, now).await
    }
    async fn statistics(&self, now: DateTime) -> Result<Vec<HandlerStatistics>, StoreError> {
        self.inner.statistics(now).await
    }
    async fn unfanned_events(&self) -> Result<u64, StoreError> {
        self.inner.unfanned_events().await
    }
    async fn list_deliveries(&self, filter: &DeliveryFilter) -> Result<DeliveryPage, StoreError> {
        self.inner.list_deliveries(filter).await
    }
}

/// A `mailer` handler of `order.placed` that behaves as `behaviour` after `delay`.
fn mailer(behaviour: Arc<Behaviour>, delay: Duration, runs: &Arc<Mutex<Vec<Run>>>) -> Arc<NativeRunner> {
    Arc::new(NativeRunner {
        specs: vec![spec("mailer", &["order.placed"], quick_retry(3))],
        behaviour,
        delay,
        runs: runs.clone(),
        busy: Arc::default(),
    })
}

/// The event of every run, sorted.
fn events_run(runs: &Mutex<Vec<Run>>) -> Vec<String> {
    let mut ran: Vec<String> = runs.lock().unwrap().iter().map(|r| r.event.clone()).collect();
    ran.sort();
    ran
}

/// A handler whose first attempt asks for a retry and whose later ones complete.
fn fails_its_first_attempt() -> Arc<Behaviour> {
    Arc::new(|delivery: &ClaimedDelivery| match delivery.attempts {
        0 => AttemptResult::Retry { reason: "upstream 503".into(), not_before: None },
        _ => AttemptResult::Completed,
    })
}

/// At least `count` runs, and nothing left to run or running: no delivery record, and none
/// running without one (a delivery a fan-out handed out has no record until an outcome other
/// than its completion needs one).
fn drained(store: &impl Store, runs: &Mutex<Vec<Run>>, count: usize) -> bool {
    let now = DateTime::now();
    runs.lock().unwrap().len() >= count
        && futures::executor::block_on(store.list_deliveries(&DeliveryFilter::default())).unwrap().deliveries.is_empty()
        && futures::executor::block_on(store.statistics(now)).unwrap().iter().all(|s| s.pending == 0 && s.running == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_failed_is_written_later_without_running_the_handler_again() {
    let store = Arc::new(FaultyStore::new(memory_store("worker"), 2, 0));
    publish_orders(&*store, 3).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::ZERO, &runs);
    // The lease (30 s) outlives the test: only a retried completion can finish it in time.
    run_until(store.clone(), runner, options(4), "the deliveries completed", || drained(&*store, &runs, 3)).await;
    assert_eq!(store.completions_failing.load(SeqCst), 0, "both injected failures happened");
    assert_eq!(events_run(&runs), ["e-0", "e-1", "e-2"], "each ran once");
}

/// The poll is the loop's net: an outcome that could not be written is written again there
/// when no other run finishes (which would try it too). Wakeups that keep the loop turning
/// faster than the poll interval must not starve it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_loop_still_polls() {
    let store = Arc::new(FaultyStore::new(memory_store("worker"), 0, 1));
    publish_orders(&*store, 1).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let fail_first = fails_its_first_attempt();
    let runner = mailer(fail_first, Duration::ZERO, &runs);
    let options = DispatcherOptions { poll_interval: Duration::from_millis(300), lease_duration: Duration::from_secs(300), ..options(4) };
    let dispatcher = Dispatcher::new(store.clone(), runner, options);
    let waker = dispatcher.waker();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(async move { dispatcher.run(async { let _ = stopped.await; }).await.unwrap() });
    // A wakeup every 20 ms, as a busy change stream would send.
    let busy = tokio::spawn(async move {
        loop {
            waker.notify_one();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    until("the failed rescheduling written again and the retry run", || drained(&*store, &runs, 2)).await;
    busy.abort();
    stop.send(()).unwrap();
    handle.await.unwrap();
    assert_eq!(store.reschedules_failing.load(SeqCst), 0, "the injected failure happened");
}

/// A key's events run one after another as each completion is written: the completion of a
/// keyed delivery asks for a claim in its key's lane, with no poll to wait for (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_events_follow_each_other_without_the_poll() {
    let store = Arc::new(memory_store("worker"));
    // The unpark sweep, due at an instance's first claim and then every 5 s, is spent first:
    // it would find the key's followers (their head runs without a document) and have its
    // claim note the key, where this test is about what the fan-out that made them noted.
    assert!(store.claim(&["mailer".to_string()], 1, bson::DateTime::now()).await.unwrap().is_empty());
    publish_all(&*store, (0..5).map(|n| keyed(&format!("k-{n}"), "order.placed", "customer")).collect()).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::ZERO, &runs);
    let options = DispatcherOptions { poll_interval: Duration::from_secs(3_600), ..options(4) };
    run_until(store.clone(), runner, options, "the key's five events run", || drained(&*store, &runs, 5)).await;
    let sequences: Vec<Option<i64>> = runs.lock().unwrap().iter().map(|run| run.sequence).collect();
    assert_eq!(sequences, [Some(1), Some(2), Some(3), Some(4), Some(5)]);
}

/// A key's later events, which a fan-out leaves unfanned while the key's head runs here, are
/// fanned out once the head's completion is written: the completion asks for a fan-out, with
/// no poll to wait for (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_events_left_unfanned_while_it_ran_follow_without_the_poll() {
    let store = Arc::new(memory_store("worker"));
    // With an unkeyed event beside them, the first batch hands out the key's head and that
    // event, and leaves the key's two later events unfanned.
    let mut events: Vec<NewEvent> = (0..3).map(|n| keyed(&format!("k-{n}"), "order.placed", "customer")).collect();
    events.push(event("unkeyed", "order.placed"));
    publish_all(&*store, events).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::ZERO, &runs);
    let options = DispatcherOptions { poll_interval: Duration::from_secs(3_600), ..options(4) };
    run_until(store.clone(), runner, options, "the four events run", || drained(&*store, &runs, 4)).await;
    let runs = runs.lock().unwrap();
    let sequences: Vec<Option<i64>> = runs.iter().filter(|run| run.key.is_some()).map(|run| run.sequence).collect();
    assert_eq!(sequences, [Some(1), Some(2), Some(3)]);
}

/// A lane that a new split gives another host while this one runs work there goes back as
/// soon as those runs end: their completions ask for a claim, which hands it back, with no
/// poll to wait for (an hour here). Kept until this host's next claim, it kept the other host
/// from handing out or claiming there (two hosts' keyed drain, one joining 300 ms in, ran at
/// 0.7-0.9x the rate of two started together).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_a_new_split_gave_another_host_goes_back_once_its_runs_end_without_the_poll() {
    let first = Arc::new(memory_store("first"));
    let joiner = first.instance("joiner");
    assert_eq!(first.announce(DateTime::now()).await.unwrap(), 1);
    publish_orders(&*first, 60).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::from_millis(300), &runs);
    let options = DispatcherOptions { poll_interval: Duration::from_secs(3_600), ..options(64) };
    let (stop, handle) = start(first.clone(), runner, options);
    let running = || futures::executor::block_on(first.statistics(DateTime::now())).unwrap().iter().map(|s| s.running).sum::<u64>();
    until("the first host runs the sixty", || running() == 60).await;
    // The joiner comes: the split gives it lanes the first host runs work in.
    joiner.announce(DateTime::now()).await.unwrap();
    first.look(DateTime::now()).await.unwrap();
    publish_all(&*first, (0..200).map(|n| event(&format!("later-{n}"), "order.placed")).collect()).await;
    let subscriptions = Subscriptions::new([Subscription::new("mailer", ["order.placed"])]).unwrap();
    let by_joiner = joiner.fan_out(&subscriptions, 1_000, 0, DateTime::now()).await.unwrap();
    let mailer_handler = vec!["mailer".to_string()];
    let mut claimed = joiner.claim(&mailer_handler, 1_000, DateTime::now()).await.unwrap().len();
    assert!(claimed < by_joiner.deliveries, "some of the joiner's lanes are held by the first host");
    // The first host's runs end, it hands those lanes back, and the joiner claims the rest.
    let deadline = Instant::now() + Duration::from_secs(5);
    while claimed < by_joiner.deliveries {
        assert!(Instant::now() < deadline, "the first host kept the joiner's lanes: {claimed} of {} claimed", by_joiner.deliveries);
        tokio::time::sleep(Duration::from_millis(20)).await;
        claimed += joiner.claim(&mailer_handler, 1_000, DateTime::now()).await.unwrap().len();
    }
    stop.send(()).unwrap();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_whose_rescheduling_failed_are_written_later_without_running_the_handler_again() {
    let store = Arc::new(FaultyStore::new(memory_store("worker"), 0, 2));
    publish_orders(&*store, 3).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let fail_first = fails_its_first_attempt();
    // All three finish together and are settled as one batch, which the first failure must
    // not cut short.
    let runner = mailer(fail_first, Duration::from_millis(50), &runs);
    // The lease outlives the test: only a rescheduling written again lets the retries run.
    let options = DispatcherOptions { lease_duration: Duration::from_secs(300), ..options(4) };
    let what = "every delivery completed on its second attempt";
    run_until(store.clone(), runner, options, what, || drained(&*store, &runs, 6)).await;
    assert_eq!(store.reschedules_failing.load(SeqCst), 0, "both injected failures happened");
    let mut attempts: Vec<(String, u32)> = runs.lock().unwrap().iter().map(|r| (r.event.clone(), r.attempt)).collect();
    attempts.sort();
    let expected: Vec<(String, u32)> = (0..3).flat_map(|n| [(format!("e-{n}"), 1), (format!("e-{n}"), 2)]).collect();
    assert_eq!(attempts, expected, "each ran twice: the failed attempt and its retry, never more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_cancels_a_fan_out_that_hangs_and_the_next_host_loses_nothing() {
    let store = Arc::new(FaultyStore::new(memory_store("worker"), 0, 0).with_hanging_fan_outs(1));
    publish_orders(&*store, 3).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::ZERO, &runs);
    let (stop, handle) = start(store.clone(), runner.clone(), options(4));
    until("the fan-out hangs", || store.fan_outs_hanging.load(SeqCst) == 0).await;
    stop.send(()).unwrap();
    // The stop waits for the fan-out only up to its timeout (5 s here), then cancels it (a
    // real one never commits).
    tokio::time::timeout(Duration::from_secs(30), handle).await.expect("the stop waited for the fan-out past its timeout").unwrap();
    until("the fan-out was cancelled", || store.fan_outs_abandoned.load(SeqCst) == 1).await;
    assert!(runs.lock().unwrap().is_empty());
    run_until(store.clone(), runner, options(4), "the deliveries completed", || drained(&*store, &runs, 3)).await;
    assert_eq!(events_run(&runs), ["e-0", "e-1", "e-2"], "each ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_backlog_claims_wait_until_half_the_capacity_is_free() {
    let store = Arc::new(FaultyStore::new(memory_store("worker"), 0, 0));
    publish_orders(&*store, 200).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::from_millis(2), &runs);
    // Run slots 4, claimed ahead 16: 20 in all.
    let options = DispatcherOptions { claim_ahead: 16, ..options(4) };
    run_until(store.clone(), runner, options, "the backlog drained", || drained(&*store, &runs, 200)).await;
    let limits = store.claim_limits.lock().unwrap().clone();
    // Never a claim for a delivery or two each time one finished: each waited for half the
    // capacity (or found the run slots idle, with the whole claim-ahead free).
    assert!(limits.iter().all(|limit| *limit >= 10), "claim limits {limits:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_wait_for_completions_that_fall_behind() {
    // Every completion fails until the test lets them through.
    let store = Arc::new(FaultyStore::new(memory_store("worker"), usize::MAX, 0));
    publish_orders(&*store, 20).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::ZERO, &runs);
    // Run slots 2, claimed ahead 2: 4 in all, and as many again finished and waiting for
    // their completion.
    let options = DispatcherOptions { claim_ahead: 2, ..options(2) };
    let (stop, handle) = start(store.clone(), runner, options);
    until("the capacity ran", || runs.lock().unwrap().len() >= 4).await;
    // Twenty-five polls, each of which claims whatever capacity is free.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ran = runs.lock().unwrap().len();
    assert!(ran <= 8, "claims went on while {ran} finished runs waited for their completion");
    store.completions_failing.store(0, SeqCst);
    until("the backlog drained", || drained(&*store, &runs, 20)).await;
    stop.send(()).unwrap();
    handle.await.unwrap();
    let mut all: Vec<String> = (0..20).map(|n| format!("e-{n}")).collect();
    all.sort();
    assert_eq!(events_run(&runs), all, "each ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_handed_out_before_its_fan_out_failed_to_commit_is_handed_back_uncharged() {
    // The word says the fan-out did not commit (a commit whose reply was lost, say: the memory
    // store did commit it).
    let store = Arc::new(FaultyStore::new(memory_store("worker"), 0, 0).with_early_words(&[false]));
    publish_orders(&*store, 1).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::ZERO, &runs);
    run_until(store.clone(), runner, options(4), "the delivery completed", || drained(&*store, &runs, 2)).await;
    assert_eq!(store.words_given.load(SeqCst), 1);
    // It ran before the word, was handed back as not run when the word came, and ran again
    // from a claim: neither run was charged an attempt.
    let attempts: Vec<(String, u32)> = runs.lock().unwrap().iter().map(|r| (r.event.clone(), r.attempt)).collect();
    assert_eq!(attempts, [("e-0".to_string(), 1), ("e-0".to_string(), 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_run_handed_out_before_its_fan_out_committed_starts_after_the_word() {
    let store = Arc::new(FaultyStore::new(memory_store("worker"), 0, 0).with_early_words(&[true]));
    publish_orders(&*store, 1).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let given = store.words_given.clone();
    let started_after_word = Arc::new(AtomicUsize::new(0));
    let seen = started_after_word.clone();
    let behaviour: Arc<Behaviour> = Arc::new(move |_| {
        seen.fetch_add(given.load(SeqCst), SeqCst);
        AttemptResult::Completed
    });
    let runner = Arc::new(NativeRunner {
        specs: vec![HandlerSpec { transactional: true, ..spec("ledger", &["order.placed"], quick_retry(3)) }],
        behaviour,
        delay: Duration::ZERO,
        runs: runs.clone(),
        busy: Arc::default(),
    });
    run_until(store.clone(), runner, options(4), "the delivery completed", || drained(&*store, &runs, 1)).await;
    assert_eq!(events_run(&runs), ["e-0"], "it ran once");
    assert_eq!(started_after_word.load(SeqCst), 1, "it started once the word had come");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_lets_a_fan_out_finish_and_hands_back_what_it_handed_out_unrun() {
    stop_while_a_fan_out_finishes(FaultyStore::new(memory_store("leaving"), 0, 0).with_slow_hand_outs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_hands_back_unrun_what_a_finishing_fan_out_hands_out_before_its_commit() {
    // The fan-out sends what it handed out only as it finishes, while the host stops.
    let store = FaultyStore::new(memory_store("leaving"), 0, 0).with_slow_hand_outs(1).with_early_words(&[true]);
    stop_while_a_fan_out_finishes(store).await;
}

/// Stops the host while a fan-out that handed out two deliveries finishes its batch.
async fn stop_while_a_fan_out_finishes(store: FaultyStore) {
    let store = Arc::new(store);
    publish_orders(&*store, 2).await;
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = mailer(Arc::new(|_| AttemptResult::Completed), Duration::ZERO, &runs);
    let (stop, handle) = start(store.clone(), runner.clone(), options(4));
    until("a fan-out handed both out and is finishing", || store.slow_hand_outs.load(SeqCst) == 0).await;
    stop.send(()).unwrap();
    handle.await.unwrap();
    // The stop waited for the fan-out, and handed back what it handed out without running it
    // or charging an attempt.
    assert!(runs.lock().unwrap().is_empty());
    let remaining = store.list_deliveries(&DeliveryFilter::default()).await.unwrap().deliveries;
    assert_eq!(remaining.len(), 2);
    assert!(remaining.iter().all(|d| d.attempts == 0), "a graceful stop charges nothing");
    assert!(remaining.iter().all(|d| d.updated_at.is_some()), "each was released (its claim ended)");
    // Their lanes were handed back too: a successor runs them at once, not after the lease.
    let successor = Arc::new(store.inner.instance("successor"));
    run_until(successor, runner, options(4), "the deliveries ran", || runs.lock().unwrap().len() == 2).await;
    assert_eq!(events_run(&runs), ["e-0", "e-1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_claimed_ahead_when_its_host_died_is_not_charged_and_records_its_start_before_it_runs_again() {
    // A host claimed four deliveries ahead of its run slots and died: none is charged, but
    // any may have been running, so each is suspect, and records its start before it runs.
    let lease = Duration::from_millis(300);
    let dead = MemoryStore::new(StoreOptions { owner: "dead".into(), lease_duration: lease, ..StoreOptions::default() });
    publish_orders(&dead, 4).await;
    dead.fan_out(&Subscriptions::new([Subscription::new("mailer", ["order.placed"])]).unwrap(), 10, 0, DateTime::now()).await.unwrap();
    let claimed = dead.claim(&["mailer".to_string()], Capacity::new(4, 0), DateTime::now()).await.unwrap();
    assert_eq!((claimed.len(), claimed.iter().filter(|c| c.started || c.suspect).count()), (4, 0));
    tokio::time::sleep(lease + Duration::from_millis(50)).await;

    let store = Arc::new(FaultyStore::new(dead.instance("survivor"), 0, 0));
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let runner = Arc::new(NativeRunner {
        specs: vec![spec("mailer", &["order.placed"], quick_retry(3))],
        behaviour: Arc::new(|_| AttemptResult::Completed),
        delay: Duration::from_millis(20),
        runs: runs.clone(),
        busy: Arc::default(),
    });
    let seen = runs.clone();
    run_until(store.clone(), runner, options(1), "the four run again", move || seen.lock().unwrap().len() == 4).await;
    let attempts: Vec<u32> = runs.lock().unwrap().iter().map(|run| run.attempt).collect();
    assert_eq!(attempts, [1, 1, 1, 1], "nothing charged");
    // One run slot: the first pick starts at once, the three claimed ahead of it record
    // their starts first.
    assert_eq!(store.starts_recorded.load(SeqCst), 3);
}
