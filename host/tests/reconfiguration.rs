//! Live reconfiguration of a running host process on a real replica set: a limit changed in
//! the file mid-drain takes effect within a second, a broken file is refused with its reason
//! while the host keeps delivering under the settings in force, a grant given by a reload
//! reaches the plugin's next runs (and a plugin dropped in after the reload), schemas changed
//! by SIGHUP or by the file apply to the next fan-out, and a limit across hosts changed in the
//! file holds on every host. Nothing is lost and nothing runs twice meanwhile.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use bson::doc;
use common::deployment::Deployment;
use common::receiver::Receiver;
use common::*;
use relayhost::event::NewEvent;
use relayhost::store::{Administration, DeliveryFilter, DeliveryStatus};

/// The webhook plugin's section, with `settings` and its grant of `http_host`.
fn webhook(settings: &str, http_host: &str) -> String {
    format!(
        "poll_interval = \"100ms\"\n\n[plugin.webhook]\nwall_time = \"30s\"\n{settings}\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{http_host}\"], private_networks = true }}\n"
    )
}

fn orders(range: std::ops::Range<usize>) -> Vec<NewEvent> {
    range.map(|n| NewEvent::new(format!("order-{n}"), "order.placed", doc! { "n": n as i32 })).collect()
}

/// The configuration file with `old` (a part of it) replaced by `new`, written whole at once
/// (as an editor saves it: a new file renamed over the old).
fn rewrite(deployment: &Deployment, old: &str, new: &str) {
    let text = std::fs::read_to_string(&deployment.config).unwrap();
    assert!(text.contains(old), "{old:?} is not in the file");
    let next = deployment.config.with_extension("toml.new");
    std::fs::write(&next, text.replace(old, new)).unwrap();
    std::fs::rename(&next, &deployment.config).unwrap();
}

/// How many times the log says `text`.
fn logged(host: &common::deployment::Host, text: &str) -> usize {
    host.log().matches(text).count()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A drain held to one call at once: the file is saved with four, and within a second the
/// receiver sees four at once. Then a broken file is refused, its reason logged, and the host
/// goes on under four; every order is called exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_changed_mid_drain_takes_effect_within_a_second_and_a_broken_file_is_refused() {
    let receiver = Receiver::answering(250);
    let host_name = receiver.address.to_string();
    let deployment = Deployment::new(&["webhook"], &webhook("concurrency_per_host = 1", &host_name)).await;
    let url = format!("http://{}/hooks", receiver.address);
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    publish_all(deployment.fixture.store(), orders(0..120)).await;
    wait_for("the host calls", Duration::from_secs(60), || receiver.bodies().len() >= 6);
    assert_eq!(receiver.most_at_once(), 1, "one call at once under concurrency_per_host = 1");

    rewrite(&deployment, "concurrency_per_host = 1", "concurrency_per_host = 4");
    let saved = Instant::now();
    wait_for("four calls at once", Duration::from_secs(10), || receiver.most_at_once() >= 4);
    let took = saved.elapsed();
    eprintln!("four at once {took:?} after the file was saved");
    assert!(took < Duration::from_secs(1), "the new limit took {took:?}");
    assert_eq!(logged(&host, "configuration reloaded"), 1, "{}", host.log());

    // A broken file: refused with its reason, and the settings in force stay.
    rewrite(&deployment, "[plugin.webhook]", "[plugin.webhook");
    wait_for("the refusal is logged", Duration::from_secs(10), || logged(&host, "the configuration was refused") == 1);
    let log = host.log();
    let refusal: String = log[log.find("the configuration was refused").unwrap()..].chars().take(1_000).collect();
    assert!(refusal.contains("relayhost.toml") && refusal.contains("[plugin.webhook"), "the reason names the file and the line: {refusal}");
    receiver.reset_most();
    let called = receiver.bodies().len();
    wait_for("more calls after the refusal", Duration::from_secs(20), || receiver.bodies().len() >= called + 12);
    assert_eq!(receiver.most_at_once(), 4, "still four at once under the settings in force");

    deployment.wait_until("every order was delivered", Duration::from_secs(120), async |d| d.drained().await).await;
    let mut called: Vec<String> = receiver.bodies().iter().map(|b| b["id"].as_str().unwrap_or("?").to_string()).collect();
    called.sort();
    let expected: Vec<String> = {
        let mut ids: Vec<String> = (0..120).map(|n| format!("order-{n}")).collect();
        ids.sort();
        ids
    };
    assert_eq!(called, expected, "every order called exactly once through both reloads");
    let counters = host.stop();
    assert_eq!((counters["completed"], counters["retried"], counters["dead"]), (120, 0, 0), "{counters:?}");
}

/// A plugin denied the receiver's host fails its calls and retries; the operator grants the
/// host in the file, the plugin is loaded again under the new grant, and the calls that were
/// retrying get through: none is lost, none is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_given_by_a_reload_reaches_the_plugins_next_runs() {
    let receiver = Receiver::answering(0);
    let retry = "retry = { max_attempts = 1000, initial_backoff = \"100ms\", max_backoff = \"200ms\" }";
    let deployment = Deployment::new(&["webhook"], &webhook(retry, "elsewhere.invalid")).await;
    let url = format!("http://{}/hooks", receiver.address);
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    publish_all(deployment.fixture.store(), orders(0..10)).await;
    let store = deployment.fixture.store();
    // Refused by the HTTP capability, each call fails and waits for its retry.
    let failed = async || {
        let page = store.list_deliveries(&DeliveryFilter::default()).await.unwrap();
        page.deliveries.iter().filter(|d| d.attempts > 0).count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while failed().await < 10 {
        assert!(Instant::now() < deadline, "the calls were not refused:\n{}", host.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(receiver.bodies().is_empty(), "the host is not granted yet");

    rewrite(&deployment, "http_hosts = [\"elsewhere.invalid\"]", &format!("http_hosts = [\"{}\"]", receiver.address));
    deployment.wait_until("every order was delivered", Duration::from_secs(60), async |d| d.drained().await).await;
    assert!(host.log().contains("plugin loaded again under its new limits and grants"), "{}", host.log());
    let mut called: Vec<String> = receiver.bodies().iter().map(|b| b["id"].as_str().unwrap_or("?").to_string()).collect();
    called.sort();
    called.dedup();
    assert_eq!(called.len(), 10, "every order called once granted");
    let dead = store.list_deliveries(&DeliveryFilter { status: Some(DeliveryStatus::Dead), ..DeliveryFilter::default() }).await.unwrap();
    assert!(dead.deliveries.is_empty(), "{:?}", dead.deliveries);
    host.stop();
}

/// The reason each dead delivery of `deployment` was buried with, by event id.
async fn dead_reasons(deployment: &Deployment) -> std::collections::BTreeMap<String, String> {
    let store = deployment.fixture.store();
    let dead = store.list_deliveries(&DeliveryFilter { status: Some(DeliveryStatus::Dead), ..DeliveryFilter::default() }).await.unwrap();
    dead.deliveries.into_iter().map(|d| (d.event_id.clone(), d.last_error.clone().unwrap_or_default())).collect()
}

/// An event type's schema checked at fan-out, changed live: its file rewritten and SIGHUP
/// sent, then its entry taken out of the configuration file. Each event is checked against the
/// schema in force when it is fanned out; valid ones are called, invalid ones are dead with
/// their failing path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_changed_by_sighup_or_by_the_file_apply_to_the_next_fan_out() {
    let receiver = Receiver::answering(0);
    let folder = std::env::temp_dir().join(format!("relayhost-reconfiguration-{}", bson::oid::ObjectId::new()));
    std::fs::create_dir_all(&folder).unwrap();
    let schema = folder.join("order.json");
    let integer = r#"{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}"#;
    std::fs::write(&schema, integer).unwrap();
    let schemas = format!("\n[schemas]\n\"order.placed\" = {:?}\n", schema.display().to_string());
    let deployment = Deployment::new(&["webhook"], &(webhook("", &receiver.address.to_string()) + &schemas)).await;
    let url = format!("http://{}/hooks", receiver.address);
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    let store = deployment.fixture.store();
    let publish = async |id: &str, n: bson::Bson| {
        publish_all(store, vec![NewEvent::new(id, "order.placed", doc! { "n": n })]).await;
        deployment.wait_until(&format!("{id} settled"), Duration::from_secs(30), async |d| d.drained().await).await;
    };
    publish("integer-1", 1.into()).await;
    publish("string-1", "one".into()).await;

    // The schema file alone changed: SIGHUP reads it again.
    std::fs::write(&schema, r#"{"type": "object", "required": ["n"], "properties": {"n": {"type": "string"}}}"#).unwrap();
    host.signal(libc::SIGHUP);
    wait_for("the reload", Duration::from_secs(10), || logged(&host, "configuration reloaded") == 1);
    assert!(host.log().contains("SIGHUP"), "{}", host.log());
    publish("integer-2", 2.into()).await;
    publish("string-2", "two".into()).await;

    // The schema's entry taken out of the file: its next change reloads it.
    rewrite(&deployment, &schemas, "\n");
    wait_for("the second reload", Duration::from_secs(10), || logged(&host, "configuration reloaded") == 2);
    publish("anything", true.into()).await;

    let mut called: Vec<String> = receiver.bodies().iter().map(|b| b["id"].as_str().unwrap_or("?").to_string()).collect();
    called.sort();
    assert_eq!(called, ["anything", "integer-1", "string-2"], "the valid events, each under the schema in force");
    let dead = dead_reasons(&deployment).await;
    assert_eq!(dead.keys().collect::<Vec<_>>(), ["integer-2", "string-1"], "{dead:?}");
    assert!(dead.values().all(|reason| reason.contains("/n")), "each reason names the failing path: {dead:?}");
    host.stop();
    std::fs::remove_dir_all(&folder).unwrap();
}

/// Two hosts share a limit across hosts of two calls at once; the file is saved with five, and
/// within a second or two the receiver sees five at once, never more; saved again with one, it
/// sees one at a time once the runs under the old limit ended. Every order is called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_across_hosts_changed_in_the_file_holds_on_every_host() {
    let receiver = Receiver::answering(150);
    let host_name = receiver.address.to_string();
    let deployment = Deployment::new(&["webhook"], &webhook("concurrency = 2", &host_name)).await;
    let url = format!("http://{}/hooks", receiver.address);
    let env = [("WEBHOOK_URL", url.as_str())];
    let hosts = [deployment.start_with("host-a", &env), deployment.start_with("host-b", &env)];
    publish_all(deployment.fixture.store(), orders(0..300)).await;
    wait_for("the hosts call", Duration::from_secs(60), || receiver.bodies().len() >= 10);
    assert_eq!(receiver.most_at_once(), 2, "two calls at once across both hosts");

    rewrite(&deployment, "concurrency = 2", "concurrency = 5");
    let saved = Instant::now();
    wait_for("five calls at once", Duration::from_secs(10), || receiver.most_at_once() >= 5);
    eprintln!("five at once {:?} after the file was saved", saved.elapsed());
    assert!(saved.elapsed() < Duration::from_secs(2), "the new limit took {:?}", saved.elapsed());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(receiver.most_at_once(), 5, "never more than the new limit");

    rewrite(&deployment, "concurrency = 5", "concurrency = 1");
    // The runs under the old limit end (150 ms each); then one at a time.
    std::thread::sleep(Duration::from_millis(1_000));
    receiver.reset_most();
    let before = receiver.bodies().len();
    wait_for("ten more calls", Duration::from_secs(30), || receiver.bodies().len() >= before + 10);
    assert_eq!(receiver.most_at_once(), 1, "one call at once under the lowered limit");
    for host in &hosts {
        assert_eq!(logged(host, "configuration reloaded"), 2, "{}", host.log());
    }
    deployment.wait_until("every order was delivered", Duration::from_secs(120), async |d| d.drained().await).await;
    let mut called: Vec<String> = receiver.bodies().iter().map(|b| b["id"].as_str().unwrap_or("?").to_string()).collect();
    called.sort();
    called.dedup();
    assert_eq!(called.len(), 300, "every order called");
    for host in hosts {
        host.stop();
    }
}

/// The operator grants a plugin that is not there yet in the file, then drops its file in:
/// it is loaded under the grants the file gives it now, and its calls get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_dropped_in_after_a_reload_runs_under_the_grants_the_file_gives_it_now() {
    let receiver = Receiver::answering(0);
    let deployment = Deployment::new(&["noop"], "poll_interval = \"100ms\"\n").await;
    let url = format!("http://{}/hooks", receiver.address);
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    let text = std::fs::read_to_string(&deployment.config).unwrap();
    let granted = format!(
        "\n[plugin.webhook]\nretry = {{ max_attempts = 3, initial_backoff = \"100ms\" }}\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{}\"], private_networks = true }}\n",
        receiver.address
    );
    let next = deployment.config.with_extension("toml.new");
    std::fs::write(&next, text + &granted).unwrap();
    std::fs::rename(&next, &deployment.config).unwrap();
    wait_for("the file is reloaded", Duration::from_secs(10), || logged(&host, "configuration reloaded") == 1);

    std::fs::copy(plugins_dir().join("webhook.wasm"), deployment.dir.join("plugins").join("webhook.wasm")).unwrap();
    let loaded = || host.log().lines().any(|line| line.contains("plugin loaded") && line.contains("webhook"));
    wait_for("the plugin is loaded", Duration::from_secs(60), loaded);
    // Published once a host declared the new handler (the registry then subscribes it).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    publish_all(deployment.fixture.store(), orders(0..5)).await;
    deployment.wait_until("every order was delivered", Duration::from_secs(60), async |d| d.drained().await).await;
    let mut called: Vec<String> = receiver.bodies().iter().map(|b| b["id"].as_str().unwrap_or("?").to_string()).collect();
    called.sort();
    called.dedup();
    assert_eq!(called.len(), 5, "every order called under the new grant:\n{}", host.log());
    let counters = host.stop();
    assert_eq!(counters["dead"], 0, "{counters:?}");
}
