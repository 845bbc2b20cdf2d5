//! Limits across hosts: the limiter's contract on both stores (shares that never add up past
//! the limit, even asked at once; a waiting host's even part; a lapsed share back; one bucket
//! of tokens for all), and host processes on a real replica set held to a global concurrency
//! and rate, and to a limit per key, while hosts are killed, and taking priorities per event.

#![allow(async_fn_in_trait)]

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bson::{DateTime, doc};
use common::deployment::{Deployment, Host};
use common::receiver::Receiver;
use common::*;
use relayhost::event::NewEvent;
use relayhost::store::Hosts;
use relayhost::store::limiter::{GlobalRate, ShareRequest};

both_stores!(
    shares_asked_at_once_never_add_up_past_the_limit,
    a_waiting_host_gets_an_even_part_as_the_others_runs_end,
    a_dead_hosts_share_comes_back_when_its_lease_lapses,
    every_host_takes_from_one_bucket_of_tokens,
);

const T0: i64 = 1_800_000_000_000;

fn at(ms: i64) -> DateTime {
    DateTime::from_millis(ms)
}

fn ask(limit: usize, held: usize, wanted: usize) -> ShareRequest {
    ShareRequest { concurrency: Some(limit), held, wanted, ..Default::default() }
}

async fn shares_asked_at_once_never_add_up_past_the_limit<F: Fixture>() {
    let fixture = F::new().await;
    let hosts: Vec<Arc<F::S>> = (0..6).map(|n| Arc::new(fixture.worker(&format!("host-{n}")))).collect();
    // Six hosts ask for 4 each of a limit of 5, all at once, three rounds.
    for round in 0..3 {
        let asks = hosts.iter().map(|host| {
            let host = host.clone();
            async move { host.lease_share("h", &ask(5, 0, 4), at(T0 + round)).await.unwrap().share }
        });
        let shares = futures::future::join_all(asks).await;
        assert_eq!(shares.iter().sum::<usize>(), 5, "round {round}: {shares:?}");
        // Each hands its share back, one at a time.
        for host in &hosts {
            host.lease_share("h", &ask(5, 0, 0), at(T0 + round)).await.unwrap();
        }
    }
}

async fn a_waiting_host_gets_an_even_part_as_the_others_runs_end<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    assert_eq!(a.lease_share("h", &ask(4, 0, 8), at(T0)).await.unwrap().share, 4);
    assert_eq!(b.lease_share("h", &ask(4, 0, 8), at(T0 + 1)).await.unwrap().share, 0, "nothing free: b waits");
    // a's runs end one by one; seeing b wait, a keeps to half.
    assert_eq!(a.lease_share("h", &ask(4, 3, 8), at(T0 + 2)).await.unwrap().share, 3);
    assert_eq!(a.lease_share("h", &ask(4, 1, 8), at(T0 + 3)).await.unwrap().share, 2);
    assert_eq!(b.lease_share("h", &ask(4, 0, 8), at(T0 + 4)).await.unwrap().share, 2);
    // A limiter of another handler is its own.
    assert_eq!(b.lease_share("other", &ask(1, 0, 1), at(T0 + 5)).await.unwrap().share, 1);
}

async fn a_dead_hosts_share_comes_back_when_its_lease_lapses<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let lease = options().lease_duration.as_millis() as i64;
    assert_eq!(a.lease_share("h", &ask(3, 0, 3), at(T0)).await.unwrap().share, 3);
    // a dies holding it all: b gets nothing for a lease, then everything.
    assert_eq!(b.lease_share("h", &ask(3, 0, 3), at(T0 + lease - 1)).await.unwrap().share, 0);
    assert_eq!(b.lease_share("h", &ask(3, 0, 3), at(T0 + lease)).await.unwrap().share, 3);
    // A renewal keeps a share: a comes back and finds none free.
    assert_eq!(b.lease_share("h", &ask(3, 3, 3), at(T0 + 2 * lease - 1)).await.unwrap().share, 3);
    assert_eq!(a.lease_share("h", &ask(3, 0, 3), at(T0 + 2 * lease)).await.unwrap().share, 0);
}

async fn every_host_takes_from_one_bucket_of_tokens<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let rate = GlobalRate { max: 10, per_ms: 1_000, burst: 5 };
    let take = |wanted: usize, returned: usize| ShareRequest { rate: Some(rate), tokens_wanted: wanted, tokens_returned: returned, ..Default::default() };
    assert_eq!(a.lease_share("h", &take(8, 0), at(T0)).await.unwrap().tokens, 5, "the burst");
    assert_eq!(b.lease_share("h", &take(8, 0), at(T0)).await.unwrap().tokens, 0, "a took it all");
    assert_eq!(b.lease_share("h", &take(8, 0), at(T0 + 200)).await.unwrap().tokens, 2, "two tokens in 200 ms");
    // a used 3 of its 5: the 2 it gives back are b's to take.
    assert_eq!(a.lease_share("h", &take(0, 2), at(T0 + 200)).await.unwrap().tokens, 0);
    assert_eq!(b.lease_share("h", &take(8, 0), at(T0 + 200)).await.unwrap().tokens, 2);
    // Hours later, still no more than the burst.
    assert_eq!(a.lease_share("h", &take(100, 0), at(T0 + 3_600_000)).await.unwrap().tokens, 5);
}

// ---- host processes ----

/// The webhook plugin, called by every host, limited across hosts by `limits`.
fn webhook_config(receiver: &Receiver, limits: &str) -> String {
    format!(
        "concurrency = 8\nlease = \"2s\"\npoll_interval = \"100ms\"\n\n[plugin.webhook]\nwall_time = \"30s\"\n{limits}\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{}\"], private_networks = true }}",
        receiver.address
    )
}

/// The host-process tests one at a time: each runs three hosts on this machine's two cores, and
/// a rate is measured by when calls arrive.
static ONE_DEPLOYMENT_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Publishes `events` fifty to a transaction: beside three running hosts, one transaction of
/// hundreds of events may outlast the transaction budget on a loaded machine.
async fn publish_in_batches(deployment: &Deployment, events: Vec<NewEvent>) {
    for batch in events.chunks(50) {
        publish_all(deployment.fixture.store(), batch.to_vec()).await;
    }
}

/// Host processes `host-<n>` for `numbers`, calling `receiver` through the webhook plugin,
/// once each runs (its plugin loaded): a host still compiling its plugin when the others
/// already call would join, and split the lanes anew, in the middle of what a test measures.
/// Each host calls its own path, `/hooks/host-N`, so that what each host called can be told.
fn start_hosts(deployment: &Deployment, receiver: &Receiver, numbers: std::ops::Range<usize>) -> Vec<Host> {
    let hosts: Vec<Host> = numbers
        .map(|n| {
            let url = format!("http://{}/hooks/host-{n}", receiver.address);
            deployment.start_with(&format!("host-{n}"), &[("WEBHOOK_URL", url.as_str())])
        })
        .collect();
    for host in &hosts {
        host.wait_for_log("relayhost is running", Duration::from_secs(120));
    }
    hosts
}

/// Waits until `receiver` was called `count` times.
async fn wait_for_calls(receiver: &Receiver, count: usize, hosts: &[Host]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while receiver.bodies().len() < count {
        assert!(Instant::now() < deadline, "the hosts did not call:\n{}", hosts[0].log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGKILLs the first of three `hosts`, starts a fourth, and waits until every order was
/// delivered; returns the hosts that lived through it.
async fn kill_one_and_drain(deployment: &Deployment, receiver: &Receiver, hosts: Vec<Host>) -> Vec<Host> {
    hosts[0].signal(libc::SIGKILL);
    let replacement = start_hosts(deployment, receiver, 3..4);
    deployment.wait_until("every order was delivered", Duration::from_secs(120), async |d| d.drained().await).await;
    hosts.into_iter().skip(1).chain(replacement).collect()
}

fn orders(count: usize) -> Vec<NewEvent> {
    (0..count).map(|n| NewEvent::new(format!("order-{n}"), "order.placed", doc! { "n": n as i32 })).collect()
}

/// Every order's id the receiver was called with, once each at least. (A request a SIGKILL cut
/// off on its way has no body: it names no order.)
fn assert_every_order_called(receiver: &Receiver, count: usize) {
    let mut called: Vec<String> = receiver.bodies().iter().filter_map(|b| Some(b["id"].as_str()?.to_string())).collect();
    called.sort();
    called.dedup();
    assert_eq!(called.len(), count, "every order called");
}

/// Three hosts share a global limit of three calls at once. Under a backlog the receiver
/// sees three at once and never four, while one host is killed mid-run and another started:
/// the dead host's share comes back within a lease, and every order is called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_keep_to_a_global_concurrency_while_one_is_killed() {
    let _alone = ONE_DEPLOYMENT_AT_A_TIME.lock().await;
    let receiver = Receiver::answering(200);
    let deployment = Deployment::new(&["webhook"], &webhook_config(&receiver, "concurrency = 3")).await;
    let hosts = start_hosts(&deployment, &receiver, 0..3);
    publish_in_batches(&deployment, orders(60)).await;
    // Kill one once a third of the orders were called.
    wait_for_calls(&receiver, 20, &hosts).await;
    let hosts = kill_one_and_drain(&deployment, &receiver, hosts).await;
    assert_every_order_called(&receiver, 60);
    assert_eq!(receiver.most_at_once(), 3, "three calls at once across the hosts, never more");
    // The work was shared: the hosts that lived through it both took part.
    let counters: Vec<_> = hosts.into_iter().map(|host| host.stop()).collect();
    assert!(counters[0]["completed"] > 0 && counters[1]["completed"] > 0, "{counters:?}");
    // Idle, the hosts shrank their shares to nothing (and stopped); the killed one's lapsed.
    let limiters = deployment.documents("relayhost_limiters").await;
    assert_eq!(limiters.len(), 1, "{limiters:?}");
    let now = bson::DateTime::now();
    let live: Vec<&bson::Bson> = limiters[0]
        .get_array("shares")
        .unwrap()
        .iter()
        .filter(|share| share.as_document().is_some_and(|s| *s.get_datetime("until").unwrap() > now))
        .collect();
    assert!(live.is_empty(), "shares left live after the stop: {live:?}");
}

/// Three hosts share a global rate of 10 calls a second (a burst of 10): over ten seconds of a
/// backlog the receiver sees at most twice the burst plus the rate (the stated tolerance), and
/// not much less than the rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_keep_to_a_global_rate() {
    let _alone = ONE_DEPLOYMENT_AT_A_TIME.lock().await;
    let receiver = Receiver::answering(0);
    let config = webhook_config(&receiver, "rate = { max = 10, per = \"1s\" }");
    let deployment = Deployment::new(&["webhook"], &config).await;
    let hosts = start_hosts(&deployment, &receiver, 0..3);
    publish_in_batches(&deployment, orders(400)).await;
    wait_for_calls(&receiver, 1, &hosts).await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    let arrivals = receiver.arrivals();
    let first = arrivals[0];
    let within = arrivals.iter().filter(|at| at.duration_since(first) < Duration::from_secs(10)).count();
    eprintln!("{within} calls in the first 10 s");
    // The stated tolerance: any window of W allows the burst in the bucket, the tokens hosts
    // took from it before the window (at most another burst), and W at the rate.
    assert!(within <= 2 * 10 + 100, "{within} calls in 10 s");
    assert!(within >= 80, "only {within} calls in 10 s");
    // Every host took part.
    let counters: Vec<_> = hosts.into_iter().map(|host| host.stop()).collect();
    assert!(counters.iter().all(|c| c["completed"] > 0), "{counters:?}");
}

/// Three hosts run up to two calls of one customer (a payload field) at once, each host
/// allowed eight calls at once: the receiver sees two of each customer at once and never
/// three, several customers at once, while one host is killed mid-run and another started;
/// every order is called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_keep_to_a_limit_per_key_while_one_is_killed() {
    let _alone = ONE_DEPLOYMENT_AT_A_TIME.lock().await;
    let receiver = Receiver::answering(150);
    let config = webhook_config(&receiver, "per_key = { limit = 2, key = \"/customer\" }");
    let deployment = Deployment::new(&["webhook"], &config).await;
    let hosts = start_hosts(&deployment, &receiver, 0..3);
    let customers = ["ada", "bob", "cy"];
    let orders: Vec<NewEvent> = (0..90)
        .map(|n| NewEvent::new(format!("order-{n}"), "order.placed", doc! { "n": n, "customer": customers[n as usize % 3] }))
        .collect();
    publish_in_batches(&deployment, orders).await;
    wait_for_calls(&receiver, 20, &hosts).await;
    let hosts = kill_one_and_drain(&deployment, &receiver, hosts).await;
    assert_every_order_called(&receiver, 90);
    let most = receiver.most_at_once_by_customer();
    assert_eq!(most.values().copied().collect::<Vec<_>>(), [2, 2, 2], "two calls of each customer at once, never more: {most:?}");
    assert!(receiver.most_at_once() > 2, "customers ran beside each other: {}", receiver.most_at_once());
    for host in hosts {
        host.stop();
    }
}

/// Three hosts, two calls at once each, take priorities per event: a backlog of orders of
/// priority 0 is being called when urgent ones (priority 10) are published; those are called
/// before nearly all the rest of the backlog. Each host claims its own lanes: between its
/// first and its last urgent call go only the orders it claimed as the urgent ones were fanned
/// out (one a run slot at most). Across hosts more go between, while a host with fewer urgent
/// ones in its lanes goes back to the backlog. A key's events are called in their order
/// whatever their priorities say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_call_the_higher_priorities_first_and_keep_each_keys_order() {
    let _alone = ONE_DEPLOYMENT_AT_A_TIME.lock().await;
    let receiver = Receiver::answering(100);
    let config = webhook_config(&receiver, "priority_from = \"event\"").replace("concurrency = 8", "concurrency = 2\nclaim_ahead = 0");
    let deployment = Deployment::new(&["webhook"], &config).await;
    let hosts = start_hosts(&deployment, &receiver, 0..3);
    publish_in_batches(&deployment, orders(150)).await;
    wait_for_calls(&receiver, 20, &hosts).await;
    let mut urgent: Vec<NewEvent> =
        (0..20).map(|n| NewEvent::new(format!("urgent-{n}"), "order.placed", doc! { "n": n }).with_priority(10)).collect();
    let key_priorities = [0, 10, -5, 10, 0, 10];
    urgent.extend(key_priorities.iter().enumerate().map(|(n, priority)| {
        NewEvent::new(format!("keyed-{n}"), "order.placed", doc! { "n": n as i32 }).with_key("k").with_priority(*priority)
    }));
    publish_all(deployment.fixture.store(), urgent).await;
    deployment.wait_until("every order was delivered", Duration::from_secs(120), async |d| d.drained().await).await;
    let called: Vec<String> = receiver.bodies().iter().map(|b| b["id"].as_str().unwrap_or("?").to_string()).collect();
    let last_urgent = called.iter().rposition(|id| id.starts_with("urgent-")).expect("the urgent ones were called");
    let orders_after = called[last_urgent..].iter().filter(|id| id.starts_with("order-")).count();
    assert!(orders_after >= 80, "only {orders_after} orders of the backlog were left after the urgent ones: {called:?}");
    let requests = receiver.requests();
    for host in 0..3 {
        let path = format!("/hooks/host-{host}");
        let its: Vec<&str> =
            requests.iter().filter(|request| request.target == path).map(|request| request.body["id"].as_str().unwrap_or("?")).collect();
        let Some(first_urgent) = its.iter().position(|id| id.starts_with("urgent-")) else { continue };
        let last_urgent = its.iter().rposition(|id| id.starts_with("urgent-")).unwrap();
        let orders_between = its[first_urgent..last_urgent].iter().filter(|id| id.starts_with("order-")).count();
        eprintln!("host {host}: {} urgent calls, {orders_between} orders between its first and last", its.iter().filter(|id| id.starts_with("urgent-")).count());
        assert!(orders_between <= 2, "host {host} called {orders_between} orders of priority 0 between its urgent ones: {its:?}");
    }
    let keyed: Vec<&String> = called.iter().filter(|id| id.starts_with("keyed-")).collect();
    let in_order: Vec<String> = (0..key_priorities.len()).map(|n| format!("keyed-{n}")).collect();
    assert_eq!(keyed, in_order.iter().collect::<Vec<_>>(), "a key's events in their order, whatever their priorities");
    for host in hosts {
        host.stop();
    }
}
