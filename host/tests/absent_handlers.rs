//! A handler that is not loaded loses nothing, in real host processes on the test replica set:
//! a plugin refused at startup (squatted, then a broken file), a rolling deploy where one of
//! two hosts serves a handler, and an operator's retirement. Beside the absent handler, the
//! others keep flowing; what waits is reported by `relayhost stats`, `handlers list`,
//! `/metrics` and a WARN; and it all reaches the handler, in per-key order, once it is served.

mod common;

use relayhost::store::Administration;
use std::path::Path;
use std::time::Duration;

use common::deployment::{Deployment, http_get, keyed_orders, publish_orders, stdout};
use common::plugins_dir;
use relayhost::store::{DeliveryFilter, DeliveryStatus};

const HOSTILE_SQUAT: (&str, &str) = ("HOSTILE_SQUAT", "1");

/// Pending deliveries of `handler`.
async fn waiting(deployment: &Deployment, handler: &str) -> u64 {
    let statistics = deployment.fixture.store.statistics(bson::DateTime::now()).await.unwrap();
    statistics.iter().find(|s| s.handler == handler).map_or(0, |s| s.pending)
}

/// Waits until every event is fanned out and `handler` has nothing pending or running.
async fn wait_until_handled_by(deployment: &Deployment, handler: &str, timeout: Duration) {
    deployment
        .wait_until(&format!("{handler} handled everything fanned out"), timeout, async |d| {
            let unfanned = d.fixture.store.unfanned_events().await.unwrap();
            let statistics = d.fixture.store.statistics(bson::DateTime::now()).await.unwrap();
            let busy = statistics.iter().find(|s| s.handler == handler).is_some_and(|s| s.pending + s.running > 0);
            unfanned == 0 && !busy
        })
        .await;
}

fn copy_plugin(name: &str, to: &Path) {
    let temporary = to.with_file_name(format!(".{}.partial", to.file_name().unwrap().to_str().unwrap()));
    std::fs::copy(plugins_dir().join(format!("{name}.wasm")), &temporary).unwrap();
    std::fs::rename(temporary, to).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_refused_at_startup_gets_every_event_published_meanwhile_in_key_order() {
    let health: std::net::SocketAddr = format!("127.0.0.1:{}", relayhost::mongod::free_port().unwrap()).parse().unwrap();
    let extra = format!(
        "poll_interval = \"200ms\"\nhealth_listen = \"{health}\"\n\n[plugin.squatter]\ngrants = {{ environment = [\"HOSTILE_SQUAT\"] }}"
    );
    let deployment = Deployment::new(&["audit_log", "noop"], &extra).await;
    let plugins = deployment.dir.join("plugins");
    // The handler is registered by a first run.
    let host = deployment.start("first");
    let mut orders = keyed_orders(0..3, 3);
    publish_orders(&deployment, &orders).await;
    wait_until_handled_by(&deployment, "audit-log", Duration::from_secs(60)).await;
    host.stop();

    // A squatter offers `audit-log` beside it: both are refused at startup, and say how to resolve it.
    copy_plugin("hostile", &plugins.join("squatter.wasm"));
    let host = deployment.start_with("squatted", &[HOSTILE_SQUAT]);
    let refusal = host.log();
    assert!(
        refusal.contains("plugin refused")
            && refusal.contains(&plugins.join("squatter.wasm").display().to_string())
            && refusal.contains("remove all but one of these files")
            && refusal.contains("The handler stays subscribed"),
        "{refusal}"
    );
    let squatted = keyed_orders(3..15, 3);
    publish_orders(&deployment, &squatted).await;
    // The other handler flows meanwhile; audit-log's deliveries wait, none lost.
    wait_until_handled_by(&deployment, "noop", Duration::from_secs(60)).await;
    assert_eq!(waiting(&deployment, "audit-log").await, 12);
    assert_eq!(deployment.documents("audit_log").await.len(), 3);
    let stats = stdout(&deployment.relayhost(&["stats"]));
    assert!(stats.contains("WARNING: no live host serves `audit-log` since") && stats.contains("12 waiting deliveries"), "{stats}");
    let listed = stdout(&deployment.relayhost(&["handlers", "list", "--json"]));
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap_or_else(|e| panic!("{e}: {listed}"));
    let audit = listed["handlers"].as_array().unwrap().iter().find(|h| h["handler"] == "audit-log").expect("registered");
    assert_eq!((audit["plugin"].as_str(), audit["servedBy"].as_array().map(Vec::len)), (Some("audit_log"), Some(0)), "{audit}");
    host.wait_for_log("no live host serves this handler", Duration::from_secs(15));
    let (_, metrics) = http_get(health, "/metrics");
    assert!(metrics.contains("relayhost_handler_hosts_serving{handler=\"audit-log\"} 0"), "{metrics}");
    assert!(metrics.contains("relayhost_handler_hosts_serving{handler=\"noop\"} 1"), "{metrics}");
    // The squatter removed, the real plugin loads and gets every event, in each key's order.
    std::fs::remove_file(plugins.join("squatter.wasm")).unwrap();
    orders.extend(squatted);
    deployment.assert_audited_exactly(&orders, Duration::from_secs(60), "after the squatter left").await;
    host.stop();

    // A broken new version deployed while the host restarts: refused, nothing of it lost.
    std::fs::write(plugins.join("audit_log.wasm"), b"\0asm broken upload").unwrap();
    let host = deployment.start("broken");
    assert!(host.log().contains("plugin refused") && host.log().contains("audit_log"), "{}", host.log());
    let broken = keyed_orders(15..24, 3);
    publish_orders(&deployment, &broken).await;
    wait_until_handled_by(&deployment, "noop", Duration::from_secs(60)).await;
    assert_eq!(waiting(&deployment, "audit-log").await, 9);
    copy_plugin("audit_log", &plugins.join("audit_log.wasm"));
    orders.extend(broken);
    deployment.assert_audited_exactly(&orders, Duration::from_secs(60), "after the file was fixed").await;
    // Within a registry refresh, /metrics says it is served again.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, metrics) = http_get(health, "/metrics");
        if metrics.contains("relayhost_handler_unserved_seconds{handler=\"audit-log\"} 0") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    host.stop();
}

/// A rolling deploy: host `old` has only the noop plugin, host `new` also audit-log. Nothing of
/// audit-log is lost: what falls in old's lanes waits, reported, and drains once old loads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_where_only_one_serves_a_handler_lose_nothing_and_drain_once_both_do() {
    let deployment = Deployment::new(&["audit_log", "noop"], "poll_interval = \"200ms\"").await;
    let old_plugins = deployment.dir.join("old-plugins");
    std::fs::create_dir_all(&old_plugins).unwrap();
    copy_plugin("noop", &old_plugins.join("noop.wasm"));
    let new = deployment.start("new");
    let old_directory = old_plugins.to_str().unwrap().to_string();
    let old = deployment.start_with("old", &[("RELAYHOST_PLUGINS_DIRECTORY", old_directory.as_str())]);
    // Both hosts see each other before anything is published.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let orders = keyed_orders(0..48, 16);
    publish_orders(&deployment, &orders).await;
    wait_until_handled_by(&deployment, "noop", Duration::from_secs(60)).await;
    // Some keys' lanes are old's (16 keys: all on one host 1 time in 32,768).
    deployment
        .wait_until("new handled what its lanes hold", Duration::from_secs(30), async |d| {
            let audited = d.documents("audit_log").await.len() as u64;
            audited > 0 && audited + waiting(d, "audit-log").await == 48
        })
        .await;
    let waited = waiting(&deployment, "audit-log").await;
    assert!(waited > 0, "old's lanes hold some of audit-log's deliveries");
    let stats = stdout(&deployment.relayhost(&["stats"]));
    assert!(stats.contains("WARNING: `audit-log` is served by 1 of 2 live hosts"), "{stats}");
    assert!(stats.contains("1 of 2 hosts"), "{stats}");
    // Nothing of it is lost: every order is audited or waiting, none twice.
    let filter = DeliveryFilter { handler: Some("audit-log".into()), status: Some(DeliveryStatus::Pending), limit: 100, ..DeliveryFilter::default() };
    let pending = deployment.fixture.store.list_deliveries(&filter).await.unwrap();
    assert_eq!(pending.deliveries.len() as u64, waited);
    // old gets the plugin: everything drains, each key in order.
    copy_plugin("audit_log", &old_plugins.join("audit_log.wasm"));
    deployment.assert_audited_exactly(&orders, Duration::from_secs(60), "once both hosts serve it").await;
    old.stop();
    new.stop();
}

/// Retiring a handler is an operator's act: refused while a host serves it, a dry run says
/// what it would do, and it buries (or drops) exactly that handler's waiting deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retire_buries_exactly_the_retired_handlers_waiting_deliveries() {
    let deployment = Deployment::new(&["audit_log", "noop"], "poll_interval = \"200ms\"").await;
    let plugins = deployment.dir.join("plugins");
    let host = deployment.start("with-audit");
    host.stop();
    std::fs::remove_file(plugins.join("audit_log.wasm")).unwrap();
    let host = deployment.start("without-audit");
    publish_orders(&deployment, &keyed_orders(0..5, 2)).await;
    wait_until_handled_by(&deployment, "noop", Duration::from_secs(60)).await;
    assert_eq!(waiting(&deployment, "audit-log").await, 5);

    let served = deployment.relayhost(&["handlers", "retire", "noop", "--drop", "--yes"]);
    assert!(!served.status.success() && stdout(&served).contains("is served by live host(s)"), "{}", stdout(&served));
    let dry = deployment.relayhost(&["handlers", "retire", "audit-log", "--bury"]);
    assert_eq!(dry.status.code(), Some(2), "{}", stdout(&dry));
    assert!(stdout(&dry).contains("would bury its 5 waiting deliveries"), "{}", stdout(&dry));
    assert_eq!(waiting(&deployment, "audit-log").await, 5, "a dry run changes nothing");
    let injected = deployment.relayhost(&["handlers", "retire", "{\"$gt\": \"\"}", "--drop", "--yes"]);
    assert!(!injected.status.success() && stdout(&injected).contains("is registered"), "{}", stdout(&injected));
    let retired = deployment.relayhost(&["handlers", "retire", "audit-log", "--bury", "--yes"]);
    assert!(retired.status.success() && stdout(&retired).contains("5 waiting deliveries buried"), "{}", stdout(&retired));
    let filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), limit: 100, ..DeliveryFilter::default() };
    let dead = deployment.fixture.store.list_deliveries(&filter).await.unwrap().deliveries;
    assert_eq!(dead.len(), 5);
    assert!(dead.iter().all(|d| d.handler == "audit-log" && d.last_error.as_deref() == Some(relayhost::store::registry::RETIRED)));
    // The other handler's deliveries were all completed and none was touched; new events go
    // to it alone.
    publish_orders(&deployment, &keyed_orders(5..8, 2)).await;
    wait_until_handled_by(&deployment, "noop", Duration::from_secs(60)).await;
    assert_eq!(waiting(&deployment, "audit-log").await, 0, "a retired handler gets no new deliveries");
    let listed = stdout(&deployment.relayhost(&["handlers", "list"]));
    assert!(listed.lines().any(|l| l.starts_with("audit-log") && l.contains("retired")), "{listed}");
    host.stop();
}
