//! Throttled and prioritized handlers in the claim loop, with native handler functions on the
//! in-memory store (the dispatcher knows nothing of WebAssembly; the host process test runs a
//! throttled plugin on MongoDB): a handler's concurrency and rate on one host hold, the loop
//! claims its next deliveries when a run ends or its window opens (the poll here is an hour
//! away), the other handlers of the same events never wait behind its backlog, and a busy
//! host starts a handler of a higher priority first.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use relayhost::dispatch::{AttemptResult, Controls, Dispatcher, DispatcherOptions, HandlerSpec, RateLimit, RetryPolicy, RunResult, Runner, Throttle};
use relayhost::store::memory::MemoryStore;
use relayhost::store::{ClaimedDelivery, StoreOptions};

/// One run as the handler saw it.
#[derive(Debug, Clone)]
struct Run {
    handler: String,
    event: String,
    key: Option<String>,
    started: Instant,
    ended: Instant,
}

/// Handlers that take `delay` each and record their runs, and the most of each handler's
/// runs that were ever under way at once.
struct Probe {
    specs: Vec<HandlerSpec>,
    delay: HashMap<String, Duration>,
    runs: Arc<Mutex<Vec<Run>>>,
    running: Arc<Mutex<HashMap<String, (usize, usize)>>>,
}

impl Probe {
    fn new(specs: Vec<HandlerSpec>, delay: &[(&str, Duration)]) -> Arc<Self> {
        let delay = delay.iter().map(|(h, d)| (h.to_string(), *d)).collect();
        Arc::new(Self { specs, delay, runs: Arc::default(), running: Arc::default() })
    }

    fn runs_of(&self, handler: &str) -> Vec<Run> {
        self.runs.lock().unwrap().iter().filter(|r| r.handler == handler).cloned().collect()
    }

    fn most_at_once(&self, handler: &str) -> usize {
        self.running.lock().unwrap().get(handler).map_or(0, |(_, most)| *most)
    }
}

impl Runner for Probe {
    fn handlers(&self) -> Vec<HandlerSpec> {
        self.specs.clone()
    }

    fn run(&self, delivery: ClaimedDelivery) -> Pin<Box<dyn Future<Output = RunResult> + Send>> {
        let delay = self.delay.get(&delivery.handler).copied().unwrap_or_default();
        let (runs, running) = (self.runs.clone(), self.running.clone());
        Box::pin(async move {
            let started = Instant::now();
            {
                let mut running = running.lock().unwrap();
                let (now, most) = running.entry(delivery.handler.clone()).or_default();
                *now += 1;
                *most = (*most).max(*now);
            }
            tokio::time::sleep(delay).await;
            running.lock().unwrap().get_mut(&delivery.handler).unwrap().0 -= 1;
            let (handler, event, key) = (delivery.handler.clone(), delivery.event.id.clone(), delivery.event.key.clone());
            runs.lock().unwrap().push(Run { handler, event, key, started, ended: Instant::now() });
            RunResult::Attempt(AttemptResult::Completed)
        })
    }
}

fn spec(handler: &str, throttle: Throttle) -> HandlerSpec {
    HandlerSpec {
        handler: handler.into(),
        event_types: vec!["order.placed".into()],
        retry: RetryPolicy::default(),
        controls: Controls { throttle, ..Controls::default() },
        transactional: false,
    }
}

/// Eight run slots, and a poll an hour away: whatever the loop claims after its first claim,
/// something asked for.
fn options() -> DispatcherOptions {
    DispatcherOptions {
        concurrency: 8,
        poll_interval: Duration::from_secs(3_600),
        lease_duration: Duration::from_secs(30),
        shutdown_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Runs a dispatcher over `store` until `probe` ran `count` deliveries, then stops it.
async fn run_until_ran(store: Arc<MemoryStore>, probe: Arc<Probe>, count: usize) {
    run_with_until_ran(store, probe, options(), count).await
}

async fn run_with_until_ran(store: Arc<MemoryStore>, probe: Arc<Probe>, options: DispatcherOptions, count: usize) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dispatcher = Dispatcher::new(store, probe.clone(), options);
    let handle = tokio::spawn(async move { dispatcher.run(async { let _ = stopped.await; }).await.unwrap() });
    let deadline = Instant::now() + Duration::from_secs(30);
    while probe.runs.lock().unwrap().len() < count {
        assert!(Instant::now() < deadline, "ran {} of {count}", probe.runs.lock().unwrap().len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    handle.await.unwrap();
}

fn store() -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(StoreOptions { owner: "host".into(), ..StoreOptions::default() }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_holds_to_its_concurrency_and_the_others_never_wait_behind_it() {
    let store = store();
    // Twelve unkeyed events and two keys of four.
    let mut events: Vec<_> = (0..12).map(|n| event(&format!("u-{n}"), "order.placed")).collect();
    events.extend((0..8).map(|n| keyed(&format!("k-{n}"), "order.placed", if n % 2 == 0 { "even" } else { "odd" })));
    publish_all(&*store, events).await;
    let two_at_once = Throttle { concurrency: Some(2), ..Default::default() };
    let probe = Probe::new(
        vec![spec("slow", two_at_once), spec("quick", Throttle::default())],
        &[("slow", Duration::from_millis(60)), ("quick", Duration::from_millis(5))],
    );
    run_until_ran(store, probe.clone(), 40).await;

    assert_eq!(probe.most_at_once("slow"), 2, "two runs at once, never more");
    assert!(probe.most_at_once("quick") > 2, "the other handler is not held to it: {}", probe.most_at_once("quick"));
    let slow = probe.runs_of("slow");
    let quick = probe.runs_of("quick");
    assert_eq!((slow.len(), quick.len()), (20, 20));
    // The other handler's deliveries of the same events were done long before the backlog.
    let quick_done = quick.iter().map(|r| r.ended).max().unwrap();
    let mut slow_ends: Vec<Instant> = slow.iter().map(|r| r.ended).collect();
    slow_ends.sort();
    assert!(quick_done < slow_ends[5], "the quick handler waited behind the slow one's backlog");
    // A key's events still ran in order, one at a time.
    for key in ["even", "odd"] {
        let mut of_key: Vec<&Run> = slow.iter().filter(|r| r.key.as_deref() == Some(key)).collect();
        of_key.sort_by_key(|r| r.started);
        let order: Vec<u32> = of_key.iter().map(|r| r.event[2..].parse().unwrap()).collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{key}: {order:?}");
        assert!(of_key.windows(2).all(|w| w[0].ended <= w[1].started), "{key} overlapped");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_starts_no_more_than_its_rate_in_any_window_and_the_others_never_wait() {
    let store = store();
    publish_all(&*store, (0..12).map(|n| event(&format!("e-{n}"), "order.placed")).collect()).await;
    let window = Duration::from_millis(300);
    let three_a_window = Throttle { rate: Some(RateLimit { max: 3, per: window }), ..Default::default() };
    let probe = Probe::new(vec![spec("paced", three_a_window), spec("quick", Throttle::default())], &[]);
    run_until_ran(store, probe.clone(), 24).await;

    let mut starts: Vec<Instant> = probe.runs_of("paced").iter().map(|r| r.started).collect();
    starts.sort();
    assert_eq!(starts.len(), 12);
    // The host counts a start as it takes the run slot; the run (where the probe reads the
    // clock) begins a moment later, on a thread a loaded machine may not schedule at once:
    // the spread allowed here. (Starts not counted at all come microseconds apart.)
    let spread = Duration::from_millis(30);
    for (first, fourth) in starts.iter().zip(&starts[3..]) {
        assert!(*fourth - *first >= window - spread, "four starts within {:?}", *fourth - *first);
    }
    assert!(starts[11] - starts[0] >= 3 * window - spread, "twelve starts need four windows");
    let quick_done = probe.runs_of("quick").iter().map(|r| r.ended).max().unwrap();
    assert!(quick_done < starts[3], "the quick handler waited for the paced one's window");
}

/// A host that stops while a rate-limited handler's delivery waits for its window (an hour
/// away) hands it back at once, uncharged, with the rest of that handler's backlog; the other
/// handler ran all of its deliveries meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_hands_back_at_once_what_waits_for_its_window() {
    use relayhost::store::{Administration, DeliveryFilter};
    let store = store();
    publish_all(&*store, (0..3).map(|n| event(&format!("e-{n}"), "order.placed")).collect()).await;
    let once_an_hour = Throttle { rate: Some(RateLimit { max: 1, per: Duration::from_secs(3600) }), ..Default::default() };
    let probe = Probe::new(vec![spec("paced", once_an_hour), spec("quick", Throttle::default())], &[]);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dispatcher = Dispatcher::new(store.clone(), probe.clone(), DispatcherOptions { shutdown_timeout: Duration::from_secs(3600), ..options() });
    let handle = tokio::spawn(async move { dispatcher.run(async { let _ = stopped.await; }).await.unwrap() });
    let paced = |running: bool| DeliveryFilter { handler: Some("paced".into()), running: Some(running), ..DeliveryFilter::default() };
    let deadline = Instant::now() + Duration::from_secs(30);
    // One paced run, the three quick ones, and the next paced delivery claimed, waiting.
    while probe.runs.lock().unwrap().len() < 4 || store.list_deliveries(&paced(true)).await.unwrap().deliveries.is_empty() {
        assert!(Instant::now() < deadline, "ran {:?}", probe.runs.lock().unwrap().len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), handle).await.expect("the stop waited for the window").unwrap();
    assert_eq!((probe.runs_of("paced").len(), probe.runs_of("quick").len()), (1, 3));
    let back = store.list_deliveries(&paced(false)).await.unwrap().deliveries;
    assert_eq!(back.len(), 2, "{back:?}");
    assert!(back.iter().all(|d| d.attempts == 0), "a stop charges nothing: {back:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_host_starts_every_delivery_of_a_higher_priority_first() {
    let store = store();
    // Unkeyed: each is ready at once (a key's next would wait for its predecessor, and
    // the free slot meanwhile go to what is ready).
    publish_all(&*store, (0..12).map(|n| event(&format!("u-{n}"), "order.placed")).collect()).await;
    let urgent = HandlerSpec { controls: Controls { priority: 10, ..Controls::default() }, ..spec("urgent", Throttle::default()) };
    // Named so that without priorities, name and creation order would put `bulk` first.
    let probe = Probe::new(
        vec![spec("bulk", Throttle::default()), urgent],
        &[("bulk", Duration::from_millis(20)), ("urgent", Duration::from_millis(20))],
    );
    // Two run slots and nothing claimed ahead: every start is a choice.
    let options = DispatcherOptions { concurrency: 2, claim_ahead: 0, ..options() };
    run_with_until_ran(store, probe.clone(), options, 24).await;
    let last_urgent = probe.runs_of("urgent").iter().map(|r| r.started).max().unwrap();
    let first_bulk = probe.runs_of("bulk").iter().map(|r| r.started).min().unwrap();
    assert!(last_urgent <= first_bulk, "a bulk delivery started {:?} before the last urgent one", last_urgent - first_bulk);
}

/// A plugin's handlers get their own settings from `[plugin.<name>.handler.<id>]`, over the
/// plugin's: the runner asks by plugin and handler id, as the dispatcher's specs show.
#[tokio::test]
async fn a_runner_gives_each_handler_the_settings_of_its_own_section() {
    use relayhost::config::Config;
    use relayhost::plugin::{PluginPolicy, PluginRegistry};
    use relayhost::plugin_runner::PluginRunner;

    let plugins = std::env::temp_dir().join(format!("relayhost-handler-settings-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&plugins);
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(plugins_dir().join("noop.wasm"), plugins.join("noop.wasm")).unwrap();
    let registry = Arc::new(PluginRegistry::new(Arc::new(plugin_runtime()), &plugins, |_| PluginPolicy::default()));
    registry.scan().await.unwrap();
    let toml = "[plugin.noop]\npriority = 3\nconcurrency_per_host = 2\n[plugin.noop.handler.noop]\npriority = 8\nretry = { max_attempts = 2 }";
    let file = plugins.join("relayhost.toml");
    std::fs::write(&file, toml).unwrap();
    let config = Config::load(Some(&file), std::iter::empty::<(String, String)>()).unwrap();
    let retries = config.clone();
    let store = Arc::new(MemoryStore::new(StoreOptions::default()));
    let runner = PluginRunner::new(registry, store, Arc::new(move |p: &str, h: &str| retries.retry_for(p, h).policy()))
        .controlled_by(Arc::new(move |p: &str, h: &str| config.controls_for(p, h)));
    let specs = runner.handlers();
    let noop = specs.iter().find(|s| s.handler == "noop").expect("the noop plugin's handler");
    assert_eq!((noop.controls.priority, noop.retry.max_attempts, noop.controls.throttle.concurrency), (8, 2, Some(2)));
    let _ = std::fs::remove_dir_all(&plugins);
}

/// A host that stops gracefully hands its share of a limit across hosts back at once, though
/// work of the handler is still pending: another host asking right after gets the whole limit,
/// not a lease later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_host_hands_its_share_of_a_limit_across_hosts_back_at_once() {
    use relayhost::store::Hosts;
    use relayhost::store::limiter::ShareRequest;
    let store = store();
    let other = store.instance("other");
    publish_all(&*store, (0..40).map(|n| event(&format!("e-{n}"), "order.placed")).collect()).await;
    let four_across_hosts = Throttle { global_concurrency: Some(4), ..Default::default() };
    let probe = Probe::new(vec![spec("limited", four_across_hosts)], &[("limited", Duration::from_millis(100))]);
    run_until_ran(store.clone(), probe.clone(), 4).await;
    assert_eq!(probe.most_at_once("limited"), 4, "the share was taken whole");
    assert!(probe.runs_of("limited").len() < 40, "work of the handler is still pending");
    let ask = ShareRequest { concurrency: Some(4), held: 0, wanted: 4, ..Default::default() };
    let grant = other.lease_share("limited", &ask, bson::DateTime::now()).await.unwrap();
    assert_eq!(grant.share, 4, "the stopped host's share came back with its stop");
}

/// A handler limited across hosts runs its share at once on a host with more run slots; its
/// backlog is held only as far as its gate could start it soon, so another handler's work
/// published while the backlog runs takes the other places and is done long before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_limited_across_hosts_runs_its_share_and_its_backlog_takes_no_other_handlers_places() {
    let store = store();
    publish_all(&*store, (0..60).map(|n| event(&format!("o-{n}"), "order.placed")).collect()).await;
    let two_across_hosts = Throttle { global_concurrency: Some(2), ..Default::default() };
    let quick = HandlerSpec { event_types: vec!["mail.sent".into()], ..spec("quick", Throttle::default()) };
    let probe = Probe::new(
        vec![spec("limited", two_across_hosts), quick],
        &[("limited", Duration::from_millis(40)), ("quick", Duration::from_millis(5))],
    );
    // Places for 8 running and 16 claimed ahead: fewer than the backlog.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dispatcher = Dispatcher::new(store.clone(), probe.clone(), DispatcherOptions { claim_ahead: 16, ..options() });
    let wakeup = dispatcher.waker();
    let running = tokio::spawn(async move { dispatcher.run(async { let _ = stopped.await; }).await.unwrap() });
    // The backlog runs: the host holds what it may of it. Then the other handler's events.
    while probe.most_at_once("limited") == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    publish_all(&*store, (0..20).map(|n| event(&format!("m-{n}"), "mail.sent")).collect()).await;
    wakeup.notify_one();
    let deadline = Instant::now() + Duration::from_secs(30);
    while probe.runs.lock().unwrap().len() < 80 {
        assert!(Instant::now() < deadline, "ran {} of 80", probe.runs.lock().unwrap().len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap();

    assert_eq!(probe.most_at_once("limited"), 2, "its share at once, never more");
    let mut limited_ends: Vec<Instant> = probe.runs_of("limited").iter().map(|r| r.ended).collect();
    limited_ends.sort();
    assert_eq!(limited_ends.len(), 60);
    let quick_done = probe.runs_of("quick").iter().map(|r| r.ended).max().unwrap();
    assert!(quick_done < limited_ends[10], "the other handler waited behind the limited one's backlog");
}
