//! The `relayhost` binary end to end: real host processes on the test replica set, real
//! plugins compiled from this repository, publishers in Python, Node.js and Rust, signals.

mod common;

use relayhost::store::{Administration, Outbox};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bson::{Document, doc};
use common::deployment::{Deployment, RELAYHOST, http_get, integer, keyed_orders, publish_orders, repo_root, stdout};
use common::receiver::Receiver;
use common::{Fixture, plugins_dir, publish_all};
use futures::TryStreamExt;
use relayhost::event::NewEvent;
use relayhost::store::DeliveryFilter;

// ---- publishers in other languages ----

/// A publisher program commits 8 orders (the odd ones abort); a running host delivers exactly
/// the committed ones to the transactional audit-log plugin, each key in order.
async fn host_delivers_what_a_publisher_committed(program: &str, script: &Path, env: (&str, String)) {
    let deployment = Deployment::new(&["audit_log"], "").await;
    let host = deployment.start("host");
    let uri = relayhost::mongod::process_server().unwrap();
    let run = Command::new(program).arg(script).args([uri, &deployment.fixture.database, "8", "--abort-odd"]).env(env.0, env.1).output().unwrap();
    assert!(run.status.success(), "{}", stdout(&run));
    let committed = [(0, 0), (2, 2), (4, 1), (6, 0)].map(|(n, customer)| (format!("order-placed-o-{n}"), format!("customer-{customer}")));
    deployment.assert_audited_exactly(&committed, Duration::from_secs(60), "aborted orders left no event").await;
    let counters = host.stop();
    assert_eq!(counters["completed"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_creates_the_collections_its_transactional_plugins_are_granted_before_it_runs_anything() {
    // Left to the first deliveries' transactions, the creation conflicts between them (and a
    // plugin runs again); done when the first one runs, the catalog change aborts transactions
    // running meanwhile (a fan-out's, say).
    let deployment = Deployment::new(&["audit_log"], "").await;
    let host = deployment.start("host");
    let database = deployment.fixture.client.database(&deployment.fixture.database);
    let names = database.list_collection_names().await.unwrap();
    assert!(["audit_log", "audit_order"].iter().all(|name| names.iter().any(|n| n == name)), "{names:?}");
    host.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_while_the_host_starts_is_a_graceful_stop() {
    // The signal handlers are installed before the host starts, not when it first waits for
    // a signal: until then a SIGTERM would do its default and kill it.
    let deployment = Deployment::new(&["audit_log"], "").await;
    let host = deployment.spawn_with("host", &[]);
    host.wait_for_log("plugin loaded", Duration::from_secs(120));
    host.signal(libc::SIGTERM);
    let log = host.log.clone();
    assert!(host.wait(Duration::from_secs(60)), "killed by the signal:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    assert!(std::fs::read_to_string(&log).unwrap().contains("relayhost stopped"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_delivers_events_pymongo_committed() {
    let python_path = Command::new(repo_root().join("scripts/ensure-python-deps.sh")).output().unwrap();
    assert!(python_path.status.success(), "{}", stdout(&python_path));
    let path = String::from_utf8(python_path.stdout).unwrap().trim().to_string();
    host_delivers_what_a_publisher_committed("python3", &repo_root().join("examples/publishers/python/publish.py"), ("PYTHONPATH", path)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_delivers_events_the_node_driver_committed() {
    let script = Command::new(repo_root().join("scripts/ensure-node-deps.sh")).output().unwrap();
    assert!(script.status.success(), "{}", stdout(&script));
    let script = PathBuf::from(String::from_utf8(script.stdout).unwrap().trim());
    host_delivers_what_a_publisher_committed("node", &script, ("NODE_NO_WARNINGS", "1".into())).await;
}

/// Handlers in every language this repository builds plugins in (Rust, Python, JavaScript
/// and C) run in one host process, on orders committed by pymongo and by the Node.js driver:
/// the transactional Rust handler's projection (written through the transaction capability)
/// holds exactly the committed orders, each key in order, and each of the others completed
/// every committed order once and logged it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_in_every_language_run_in_one_host_process() {
    let plugins = ["audit_log", "py_order_check", "js_order_check", "c_order_check"];
    let deployment = Deployment::new(&plugins, "poll_interval = \"200ms\"\n\n[defaults]\nwall_time = \"10s\"").await;
    let host = deployment.start("host");
    let uri = relayhost::mongod::process_server().unwrap();
    let python_path = Command::new(repo_root().join("scripts/ensure-python-deps.sh")).output().unwrap();
    assert!(python_path.status.success(), "{}", stdout(&python_path));
    let python_path = String::from_utf8(python_path.stdout).unwrap().trim().to_string();
    let node_script = Command::new(repo_root().join("scripts/ensure-node-deps.sh")).output().unwrap();
    assert!(node_script.status.success(), "{}", stdout(&node_script));
    let node_script = PathBuf::from(String::from_utf8(node_script.stdout).unwrap().trim());
    let python_script = repo_root().join("examples/publishers/python/publish.py");
    let publishers: [(&str, &Path, (&str, String), &str); 2] = [
        ("python3", &python_script, ("PYTHONPATH", python_path), "py-"),
        ("node", &node_script, ("NODE_NO_WARNINGS", "1".into()), "node-"),
    ];
    let mut committed = Vec::new();
    for (program, script, env, prefix) in publishers {
        let args = [uri.to_string(), deployment.fixture.database.clone(), "8".into(), "--abort-odd".into(), format!("--id-prefix={prefix}")];
        let run = Command::new(program).arg(script).args(args).env(env.0, env.1).output().unwrap();
        assert!(run.status.success(), "{program}: {}", stdout(&run));
        committed.extend([(0, 0), (2, 2), (4, 1), (6, 0)].map(|(n, customer)| (format!("order-placed-{prefix}o-{n}"), format!("customer-{customer}"))));
    }
    deployment.assert_audited_exactly(&committed, Duration::from_secs(120), "every language").await;
    let mut expected: Vec<String> = committed.iter().map(|(id, _)| id.clone()).collect();
    expected.sort();
    let history = deployment.documents("relayhost_completed_deliveries").await;
    for handler in ["py-order-check", "js-order-check", "c-order-check"] {
        let mut done: Vec<String> =
            history.iter().filter(|d| d.get_str("handler") == Ok(handler)).map(|d| d.get_str("eventId").unwrap().to_string()).collect();
        done.sort();
        assert_eq!(done, expected, "{handler} completed every committed order once");
    }
    let log = host.log();
    for prefix in ["py-", "node-"] {
        for n in [0, 2, 4, 6] {
            let line = format!("order {prefix}o-{n} checked on attempt 1");
            assert_eq!(log.matches(&line).count(), 3, "each order-check plugin logged {line:?}:\n{log}");
        }
    }
    let counters = host.stop();
    assert_eq!(counters["completed"], 4 * committed.len() as u64);
}

// ---- several hosts, crashes ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_share_the_work_and_keep_every_keys_order() {
    let deployment = Deployment::new(&["audit_log"], "concurrency = 4\npoll_interval = \"200ms\"").await;
    let first = deployment.start("first");
    let second = deployment.start_with("second", &[("RELAYHOST_HOST_LOG_FORMAT", "json")]);
    let orders = keyed_orders(0..400, 40);
    publish_orders(&deployment, &orders).await;
    deployment.assert_audited_exactly(&orders, Duration::from_secs(180), "two hosts").await;
    let second_log = second.log();
    assert!(second_log.lines().all(|line| line.starts_with('{') && line.contains("\"level\"")), "JSON logs: {second_log}");
    let (first, second) = (first.stop_with(libc::SIGINT), second.stop());
    assert!(first["completed"] > 0 && second["completed"] > 0, "both hosts delivered: {first:?} {second:?}");
    assert_eq!(first["completed"] + second["completed"], 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_killed_mid_delivery_lose_nothing_and_duplicate_nothing() {
    // A killed host's open transaction holds its locks until the server aborts it (15 s on the
    // test server): the handlers' wall time stays below that.
    let extra = "concurrency = 8\nlease = \"2s\"\npoll_interval = \"200ms\"\n\n[defaults]\nwall_time = \"5s\"";
    let deployment = Deployment::new(&["audit_log"], extra).await;
    let orders = keyed_orders(0..600, 30);
    publish_orders(&deployment, &orders).await;
    let lanes = deployment.collection("relayhost_lanes");
    let deliveries = deployment.collection("relayhost_deliveries");
    let audit = deployment.collection("audit_log");
    let (mut interrupted, mut waiting): (Vec<bson::oid::ObjectId>, Vec<bson::oid::ObjectId>) = (Vec::new(), Vec::new());
    for round in 0..3 {
        let host = deployment.start("host");
        // Kill it while it is delivering: once the projection grew by another 100 orders and a
        // delivery is in flight.
        let target = 100 * (round + 1);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (started, ahead) = in_flight(&lanes, &deliveries).await;
            if audit.count_documents(doc! {}).await.unwrap() >= target && (!started.is_empty() || !ahead.is_empty()) {
                break;
            }
            assert!(Instant::now() < deadline, "round {round}: the host did not deliver:\n{}", host.log());
        }
        host.signal(libc::SIGKILL);
        assert!(!host.wait(Duration::from_secs(10)));
        // What the killed host had started and not completed, and what it had claimed ahead.
        let (started, ahead) = in_flight(&lanes, &deliveries).await;
        interrupted.extend(started);
        waiting.extend(ahead);
    }
    assert!(!interrupted.is_empty() || !waiting.is_empty(), "some deliveries were cut off by the kills");
    let survivor = deployment.start("host");
    deployment.assert_audited_exactly(&orders, Duration::from_secs(180), "across the kills").await;
    // The takeover charged the attempt the killed host had started.
    let history = deployment.collection("relayhost_completed_deliveries");
    for delivery in &interrupted {
        let record = history.find_one(doc! { "_id": delivery }).await.unwrap().expect("every interrupted delivery completed later");
        assert!(record.get_i32("attempts").unwrap() >= 2, "{record}");
        // The run that committed saw the charged attempt too.
        let audited = audit.find_one(doc! { "_id": record.get_str("eventId").unwrap() }).await.unwrap().unwrap();
        assert!(audited.get("attempt").and_then(integer).unwrap() >= 2, "{audited}");
    }
    // What was only claimed ahead at every kill was never charged.
    for delivery in waiting.iter().filter(|delivery| !interrupted.contains(delivery)) {
        let record = history.find_one(doc! { "_id": delivery }).await.unwrap().expect("every delivery completed later");
        assert_eq!(record.get_i32("attempts").unwrap(), 1, "{record}");
    }
    let dead = deployment.fixture.store().list_deliveries(&DeliveryFilter { status: Some(relayhost::store::DeliveryStatus::Dead), ..Default::default() }).await.unwrap();
    assert!(dead.deliveries.is_empty(), "{dead:?}");
    survivor.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_killed_while_running_deliveries_without_documents_lose_nothing_and_duplicate_nothing() {
    // Without completion history a fan-out hands unkeyed deliveries out with no document of
    // their own: a killed host leaves them named only by its lanes and their events.
    let extra = "concurrency = 8\nlease = \"2s\"\npoll_interval = \"200ms\"\n\n[defaults]\nwall_time = \"5s\"";
    let deployment = Deployment::with_history(&["audit_log"], extra, false).await;
    let orders: Vec<String> = (0..1_200).map(|n| format!("order-{n:04}")).collect();
    for chunk in orders.chunks(100) {
        publish_all(deployment.fixture.store(), chunk.iter().map(|id| NewEvent::new(id.clone(), "order.placed", doc! {})).collect()).await;
    }
    let events = deployment.collection("relayhost_events");
    let lanes = deployment.collection("relayhost_lanes");
    let audit = deployment.collection("audit_log");
    let (mut interrupted, mut waiting): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    let mut started_with_document: Vec<String> = Vec::new();
    let deliveries = deployment.collection("relayhost_deliveries");
    for round in 0..3 {
        let host = deployment.start("host");
        // Kill it once the projection grew by another 150 orders, the first time while such a
        // delivery is in flight. Later hosts may have none of their own: a host whose first batch
        // cannot be handed out whole (the dead host's lanes are still leased) fans the rest of
        // the backlog out with documents, and what the dead hosts left may be taken over
        // already (or wait, as long as the server keeps a dead host's open transaction).
        let target = 150 * (round + 1);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let audited = audit.count_documents(doc! {}).await.unwrap();
            let (started, ahead) = in_flight_without_document(&events, &lanes).await;
            if audited >= target && (round > 0 || !started.is_empty() || !ahead.is_empty()) {
                break;
            }
            assert!(Instant::now() < deadline, "round {round}: {audited} audited, none running now:\n{}", host.log());
        }
        host.signal(libc::SIGKILL);
        assert!(!host.wait(Duration::from_secs(10)));
        let (started, ahead) = in_flight_without_document(&events, &lanes).await;
        interrupted.extend(started);
        waiting.extend(ahead);
        // Those given a document at an earlier takeover run with it: started ones of them are
        // charged too.
        let (running, _) = in_flight(&lanes, &deliveries).await;
        for delivery in running {
            let document = deliveries.find_one(doc! { "_id": delivery }).await.unwrap().unwrap();
            started_with_document.push(document.get_str("eventId").unwrap().to_string());
        }
    }
    assert!(!interrupted.is_empty() || !waiting.is_empty(), "some deliveries without documents were cut off by the kills");
    let survivor = deployment.start("host");
    deployment.wait_until("all 1,200 orders are audited", Duration::from_secs(180), async |d| {
        d.documents("audit_log").await.len() >= 1_200 && d.drained().await
    })
    .await;
    let (ids, _) = deployment.audit().await;
    assert_eq!(ids, orders, "the projection is the set of events, no gap, no duplicate");
    // The takeover charged the attempt the killed host had started, and the run that
    // committed saw it; what it had only claimed ahead was never charged.
    for event in &interrupted {
        let audited = audit.find_one(doc! { "_id": event }).await.unwrap().unwrap();
        assert!(audited.get("attempt").and_then(integer).unwrap() >= 2, "{audited}");
    }
    for event in waiting.iter().filter(|event| !interrupted.contains(event) && !started_with_document.contains(event)) {
        let audited = audit.find_one(doc! { "_id": event }).await.unwrap().unwrap();
        assert_eq!(audited.get("attempt").and_then(integer), Some(1), "{audited}");
    }
    assert_eq!(in_flight_without_document(&events, &lanes).await, (Vec::new(), Vec::new()));
    let dead = deployment.fixture.store().list_deliveries(&DeliveryFilter { status: Some(relayhost::store::DeliveryStatus::Dead), ..Default::default() }).await.unwrap();
    assert!(dead.deliveries.is_empty(), "{dead:?}");
    survivor.stop();
}

/// Events whose delivery is in flight without a document (their `handedOut` still lists its
/// handler): those a lane lists as started, and those it lists as claimed ahead (which a
/// takeover does not charge).
async fn in_flight_without_document(
    events: &mongodb::Collection<Document>,
    lanes: &mongodb::Collection<Document>,
) -> (Vec<String>, Vec<String>) {
    let listed: Vec<Document> =
        events.find(doc! { "handedOut.0": { "$exists": true } }).projection(doc! { "_id": 1 }).await.unwrap().try_collect().await.unwrap();
    let (mut started, mut ahead) = (Vec::new(), Vec::new());
    for event in listed {
        let id = event.get_str("_id").unwrap();
        let running = doc! { "inFlight": { "$elemMatch": { "e": id, "s": { "$ne": false } } } };
        if lanes.find_one(running).await.unwrap().is_some() {
            started.push(id.to_string());
        } else if lanes.find_one(doc! { "inFlight": { "$elemMatch": { "e": id, "s": false } } }).await.unwrap().is_some() {
            ahead.push(id.to_string());
        }
    }
    (started, ahead)
}

/// Deliveries a lane lists in flight that still exist at the generation they were claimed
/// with (not completed): those listed as started, and those claimed ahead (which a takeover
/// does not charge).
async fn in_flight(
    lanes: &mongodb::Collection<Document>,
    deliveries: &mongodb::Collection<Document>,
) -> (Vec<bson::oid::ObjectId>, Vec<bson::oid::ObjectId>) {
    let (mut running, mut ahead) = (Vec::new(), Vec::new());
    let busy: Vec<Document> = lanes.find(doc! { "inFlight.0": { "$exists": true } }).await.unwrap().try_collect().await.unwrap();
    for lane in busy {
        for entry in lane.get_array("inFlight").unwrap() {
            let entry = entry.as_document().unwrap();
            let (id, claims) = (entry.get_object_id("d").unwrap(), entry.get_i64("c").unwrap());
            if deliveries.find_one(doc! { "_id": id, "claims": claims }).await.unwrap().is_some() {
                if entry.get_bool("s") == Ok(false) { ahead.push(id) } else { running.push(id) }
            }
        }
    }
    (running, ahead)
}

// ---- dead letters and the hook ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayhost_publish_waits_out_a_transaction_holding_its_key() {
    // Another transaction (a handler publishing on the key, say) holds the key's counter for a
    // second: the command's transaction conflicts, is retried, and publishes after it.
    let deployment = Deployment::new(&[], "").await;
    let store = deployment.fixture.store();
    assert!(deployment.relayhost(&["setup"]).status.success());
    let mut holding = store.begin().await.unwrap();
    store.publish(&mut holding, &NewEvent::new("first", "t", doc! {}).with_key("k")).await.unwrap();
    let config = deployment.config.clone();
    let publishing = tokio::task::spawn_blocking(move || {
        Command::new(RELAYHOST)
            .args(["publish", "--type", "t", "--key", "k", "--id", "second", "--payload", "{}", "--config"])
            .arg(&config)
            .output()
            .unwrap()
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    relayhost::store::StoreTransaction::commit(holding).await.unwrap();
    let output = publishing.await.unwrap();
    assert!(output.status.success(), "{}", stdout(&output));
    assert!(stdout(&output).contains("published second (sequence 2 of its key)"), "{}", stdout(&output));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_failure_reasons_are_cut_and_stall_nothing_beside_them() {
    // A plugin hands back failure reasons of 1.1 MB (over the dead letter's 1 MiB payload) and
    // 17 MB (over a document's 16 MiB), and retries not before the end of time. Beside it a
    // transactional plugin's deliveries keep flowing; the hostile ones end dead or rescheduled
    // with reasons cut to the limit, and their deaths are announced.
    let extra = "concurrency = 8\npoll_interval = \"200ms\"\n\n[plugin.hostile]\nmemory = \"128MiB\"\nreason = \"1KiB\"\n\
                 retry = { max_attempts = 3, initial_backoff = \"100ms\", max_backoff = \"1s\" }";
    let deployment = Deployment::new(&["hostile", "audit_log", "dead_letter_alert"], extra).await;
    let host = deployment.start("host");
    let store = deployment.fixture.store();
    let mut hostile = Vec::new();
    for n in 0..20 {
        let bytes = if n % 2 == 0 { 1_100_000 } else { 17_000_000 };
        hostile.push(NewEvent::new(format!("huge-{n}"), "huge-reason", doc! { "bytes": bytes }));
    }
    hostile.push(NewEvent::new("never", "huge-reason", doc! { "bytes": 2_000, "retry": true }));
    publish_all(store, hostile).await;
    let orders = keyed_orders(0..40, 4);
    let published = Instant::now();
    publish_orders(&deployment, &orders).await;
    deployment.wait_until("the orders beside them are audited", Duration::from_secs(20), async |d| {
        d.documents("audit_log").await.len() == orders.len()
    })
    .await;
    assert!(published.elapsed() < Duration::from_secs(20));
    deployment.wait_until("every huge reason is dead and announced", Duration::from_secs(60), async |d| {
        d.documents("dead_letter_alerts").await.len() == 20
    })
    .await;
    let dead = store
        .list_deliveries(&DeliveryFilter { status: Some(relayhost::store::DeliveryStatus::Dead), limit: 100, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(dead.deliveries.len(), 20);
    for delivery in &dead.deliveries {
        let error = delivery.last_error.as_deref().unwrap();
        assert!(error.len() <= 1_100 && error.contains("bytes in all]"), "{} bytes: {}", error.len(), &error[..80]);
    }
    // The retry asked for the end of time: it is due within the horizon (7 days), stored as a
    // date every driver reads.
    let never = deployment.collection("relayhost_deliveries").find_one(doc! { "eventId": "never" }).await.unwrap().unwrap();
    let due = never.get_datetime("dueAt").unwrap().timestamp_millis();
    assert!(due <= bson::DateTime::now().timestamp_millis() + 7 * 24 * 3_600_000, "{never}");
    assert!(never.get_str("lastError").unwrap().len() <= 1_024);
    host.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_plugin_runs_into_the_dead_letters_and_the_hook_is_delivered() {
    let extra = "poll_interval = \"5s\"\n\n[plugin.hostile]\nretry = { max_attempts = 3, initial_backoff = \"100ms\", max_backoff = \"1s\" }";
    let deployment = Deployment::new(&["hostile", "dead_letter_alert"], extra).await;
    let host = deployment.start("host");
    for n in 0..2 {
        let output = deployment.relayhost(&["publish", "--type", "poison", "--key", "k", "--id", &format!("poison-{n}"), "--payload", "{\"n\": 1}"]);
        assert!(output.status.success(), "{}", stdout(&output));
    }
    // Retries come due by timers, not by the (slow) poll.
    deployment.wait_until("both burials are announced", Duration::from_secs(60), async |d| {
        d.documents("dead_letter_alerts").await.len() == 2
    }).await;
    let mut alerts = deployment.documents("dead_letter_alerts").await;
    alerts.sort_by_key(|a| a.get_str("eventId").unwrap().to_string());
    for (n, alert) in alerts.iter().enumerate() {
        assert_eq!(alert.get_str("eventId").unwrap(), format!("poison-{n}"));
        assert_eq!(alert.get_str("handler").unwrap(), "poison");
        assert_eq!(alert.get("attempts").and_then(integer), Some(3), "{alert}");
        let error = alert.get_str("lastError").unwrap();
        assert!(error.starts_with("trap: ") && error.contains(&format!("poisoned by event poison-{n}")), "{error}");
        assert!(error.ends_with("(attempt 3 of 3)"), "{error}");
    }

    let listed = deployment.relayhost(&["dead", "list", "--handler", "poison"]);
    let text = stdout(&listed);
    assert!(listed.status.success() && text.contains("poison-0") && text.contains("poison-1") && text.contains("attempts 3"), "{text}");
    // Requeue one: it runs again (attempts reset), dies again, and is announced again.
    let id = text.lines().find(|l| l.contains("poison-0")).unwrap().split_whitespace().next().unwrap().to_string();
    let requeued = deployment.relayhost(&["dead", "requeue", &id]);
    assert!(requeued.status.success(), "{}", stdout(&requeued));
    deployment.wait_until("the requeued delivery dies again", Duration::from_secs(60), async |d| {
        d.documents("dead_letter_alerts").await.len() == 3
    }).await;
    // Admin input is never an operator or a query: refused by name.
    let refused = deployment.relayhost(&["dead", "requeue", "{\"$ne\": null}"]);
    let text = stdout(&refused);
    assert!(!refused.status.success() && text.contains("$ne") && text.contains("does not exist"), "{text}");
    let counters = host.stop();
    assert_eq!(counters["dead"], 3);
    assert_eq!(counters["retried"], 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_kills_its_host_every_time_goes_dead_after_max_attempts_deaths() {
    // Its handler hangs; each host that runs it is killed with SIGKILL while it does, as a
    // poison event that crashes its host would. Each death is charged at takeover, so it goes
    // dead after `max_attempts` of them, and the death is announced. The events claimed with
    // it, ahead of a free run slot (there is one), never started, and are never charged.
    let extra = "concurrency = 1\nclaim_ahead = 8\nlease = \"2s\"\npoll_interval = \"200ms\"\n\n\
                 [plugin.hostile]\nwall_time = \"60s\"\nretry = { max_attempts = 3 }";
    let deployment = Deployment::new(&["hostile", "dead_letter_alert"], extra).await;
    let (deliveries, lanes) = (deployment.collection("relayhost_deliveries"), deployment.collection("relayhost_lanes"));
    let hang = doc! { "eventId": "hang-1", "handler": "hang" };
    let bystanders = ["bystander-1", "bystander-2", "bystander-3"];
    let mut deaths: i64 = 0;
    loop {
        let host = deployment.start("host");
        if deaths == 0 {
            let publish = |id: &str, payload: &str| deployment.relayhost(&["publish", "--type", "hang", "--id", id, "--payload", payload]);
            assert!(publish("hang-1", "{}").status.success());
            for id in bystanders {
                assert!(publish(id, "{\"hang\": false}").status.success());
            }
        }
        // Until its attempts are used up: then the host buries it without running it.
        let deadline = Instant::now() + Duration::from_secs(60);
        let buried = loop {
            let delivery = deliveries.find_one(hang.clone()).await.unwrap().expect("its delivery is there");
            if delivery.get_str("status") == Ok("dead") {
                break true;
            }
            // Listed as started by this host: after each death's charge, at the next claim
            // generation (the dead host's lane lists the one before until it is charged).
            let id = delivery.get_object_id("_id").unwrap();
            let running = doc! { "inFlight": { "$elemMatch": { "d": id, "c": deaths, "s": { "$ne": false } } } };
            if deaths < 3 && lanes.find_one(running).await.unwrap().is_some() {
                break false;
            }
            assert!(Instant::now() < deadline, "the host neither ran nor buried it:\n{}", host.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if buried {
            deployment.wait_until("the bystanders are delivered", Duration::from_secs(60), async |d| d.drained().await).await;
            host.stop();
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        host.signal(libc::SIGKILL);
        assert!(!host.wait(Duration::from_secs(10)));
        deaths += 1;
        assert!(deaths <= 3, "it keeps running after three deaths");
    }
    assert_eq!(deaths, 3, "dead after exactly max_attempts deaths");
    let dead = deliveries.find_one(hang.clone()).await.unwrap().unwrap();
    assert_eq!(dead.get("attempts").and_then(integer), Some(3), "{dead}");
    assert!(dead.get_str("lastError").unwrap().contains("attempts used up by workers that stopped while running it"), "{dead}");
    let alerts = deployment.documents("dead_letter_alerts").await;
    assert!(alerts.iter().any(|a| a.get_str("eventId") == Ok("hang-1")), "its death is announced: {alerts:?}");
    // Claimed ahead at every death, the bystanders ran once, in their first attempt.
    let history = deployment.collection("relayhost_completed_deliveries");
    for bystander in bystanders {
        let record = history.find_one(doc! { "eventId": bystander }).await.unwrap().expect("delivered");
        assert_eq!(record.get("attempts").and_then(integer), Some(1), "{record}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_hosts_open_transaction_is_ended_by_another_host_long_before_the_servers_lifetime() {
    // Its transactional handler wrote a projection's document and hangs (its first attempt
    // only); its host is killed. The server would keep that transaction, and its lock on the
    // document, for its transaction lifetime (15 s on the test server, a minute by default),
    // and the delivery's next attempt would meet the lock until then. The other host ends the
    // dead one's sessions once its announcement lapsed, well within the 2 s lease after which
    // it takes the lane over and runs the delivery again.
    let extra = "lease = \"2s\"\npoll_interval = \"200ms\"\n\n\
                 [plugin.hostile]\nwall_time = \"60s\"\ngrants = { collections = [\"projection\"] }";
    let deployment = Deployment::new(&["hostile"], extra).await;
    let projection = deployment.collection("projection");
    projection.insert_one(doc! { "_id": "held", "runs": 0 }).await.unwrap();
    let health: Vec<std::net::SocketAddr> =
        (0..2).map(|_| format!("127.0.0.1:{}", relayhost::mongod::free_port().unwrap()).parse().unwrap()).collect();
    let start = |name: &str, at: usize| deployment.start_with(name, &[("RELAYHOST_HOST_HEALTH_LISTEN", &health[at].to_string())]);
    let hosts = [start("a", 0), start("b", 1)];
    let published = deployment.relayhost(&["publish", "--type", "hold", "--id", "hold-1", "--payload", "{\"target\": \"projection\"}"]);
    assert!(published.status.success(), "{}", stdout(&published));
    // Running where a lane lists it as started; its write comes first thing.
    let (deliveries, lanes) = (deployment.collection("relayhost_deliveries"), deployment.collection("relayhost_lanes"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let owner = loop {
        if let Some(delivery) = deliveries.find_one(doc! { "eventId": "hold-1" }).await.unwrap() {
            let running = doc! { "inFlight": { "$elemMatch": { "d": delivery.get("_id").unwrap(), "s": { "$ne": false } } } };
            if let Some(lane) = lanes.find_one(running).await.unwrap() {
                break lane.get_str("owner").unwrap().to_string();
            }
        }
        assert!(Instant::now() < deadline, "neither host ran it:\n{}\n{}", hosts[0].log(), hosts[1].log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let holding = hosts.iter().position(|host| owner.ends_with(&format!(":{}", host.child.id()))).expect("one of the two");
    let [a, b] = hosts;
    let (killed, survivor) = if holding == 0 { (a, b) } else { (b, a) };
    let survivor_health = health[1 - holding];
    let killed_at = Instant::now();
    killed.signal(libc::SIGKILL);
    assert!(!killed.wait(Duration::from_secs(10)));
    deployment
        .wait_until("the next attempt wrote the document", Duration::from_secs(60), async |d| {
            d.collection("projection").find_one(doc! { "_id": "held", "runs": 1 }).await.unwrap().is_some()
        })
        .await;
    let took = killed_at.elapsed();
    assert!(survivor.log().contains("ended its open sessions"), "{}", survivor.log());
    assert!(took < Duration::from_secs(10), "the lock was held {took:?} after the kill:\n{}", survivor.log());
    let (_, metrics) = http_get(survivor_health, "/metrics");
    let ended = metrics.lines().find_map(|line| line.strip_prefix("relayhost_dead_hosts_sessions_ended_total "));
    assert!(ended.and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 1), "counted: {metrics}");
    deployment.wait_until("it is completed", Duration::from_secs(30), async |d| d.drained().await).await;
    survivor.stop();
}

// ---- throttles ----

/// The operator limits the webhook plugin to two calls at once on each host: the receiver
/// never answers more, while the noop plugin, given the same events, is not held behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_plugin_calls_out_two_at_a_time_and_the_plugin_beside_it_never_waits() {
    let receiver = Receiver::start();
    receiver.hold.store(false, Ordering::SeqCst);
    receiver.delay_ms.store(300, Ordering::SeqCst);
    let extra = format!(
        "concurrency = 8\npoll_interval = \"100ms\"\n\n[plugin.webhook]\nwall_time = \"30s\"\nconcurrency_per_host = 2\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{}\"], private_networks = true }}",
        receiver.address
    );
    let deployment = Deployment::new(&["webhook", "noop"], &extra).await;
    let url = format!("http://{}/hooks", receiver.address);
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    let orders: Vec<NewEvent> = (0..12).map(|n| NewEvent::new(format!("order-{n}"), "order.placed", doc! { "n": n as i32 })).collect();
    publish_all(deployment.fixture.store(), orders).await;
    deployment
        .wait_until("the noop plugin completed all twelve", Duration::from_secs(60), async |d| {
            let completed = d.collection("relayhost_completed_deliveries").count_documents(doc! { "handler": "noop" }).await.unwrap();
            completed == 12
        })
        .await;
    // Two calls at a time of 300 ms each: twelve take 1.8 s, and the noop plugin's runs of
    // the same events finished before most of them.
    let called = receiver.bodies().len();
    assert!(called <= 8, "the noop plugin waited for {called} of the webhook's calls:\n{}", host.log());
    deployment.wait_until("the webhook was called twelve times", Duration::from_secs(60), async |d| d.drained().await).await;
    let counters = host.stop();
    assert_eq!(counters["completed"], 24);
    let mut called: Vec<String> = receiver.bodies().iter().map(|b| b["id"].as_str().unwrap_or("?").to_string()).collect();
    called.sort();
    called.dedup();
    assert_eq!(called.len(), 12);
    assert_eq!(receiver.most_at_once(), 2, "two calls at once, never more");
}

// ---- graceful stop ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_releases_claimed_work_without_charging_attempts_and_an_operator_can_bury() {
    let receiver = Receiver::start();
    let extra = format!(
        "concurrency = 2\nshutdown_timeout = \"1s\"\n\n[plugin.webhook]\nwall_time = \"60s\"\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{}\"], private_networks = true }}",
        receiver.address
    );
    let deployment = Deployment::new(&["webhook"], &extra).await;
    let url = format!("http://{}/hooks", receiver.address);
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    let orders: Vec<NewEvent> = (0..4).map(|n| NewEvent::new(format!("order-{n}"), "order.placed", doc! { "n": n as i32 })).collect();
    publish_all(deployment.fixture.store(), orders).await;
    // Two deliveries are running (their requests are held), two are claimed ahead and wait
    // for a run slot.
    let deadline = Instant::now() + Duration::from_secs(60);
    while receiver.bodies().len() < 2 {
        assert!(Instant::now() < deadline, "the webhook was not called:\n{}", host.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let store = deployment.fixture.store();
    while store.statistics(bson::DateTime::now()).await.unwrap().iter().map(|s| s.running).sum::<u64>() < 4 {
        assert!(Instant::now() < deadline, "the other two were not claimed ahead:\n{}", host.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let counters = host.stop();
    assert_eq!(counters["released"], 4, "the two cut-off runs and the two waiting were handed back");
    assert_eq!(counters["completed"], 0);
    let pending = deployment.fixture.store().list_deliveries(&DeliveryFilter::default()).await.unwrap().deliveries;
    assert_eq!(pending.len(), 4);
    assert!(pending.iter().all(|d| d.attempts == 0 && d.last_error.is_none()), "nothing was charged: {pending:?}");

    // An operator buries one of them while no host holds its lane; its death is announced.
    let order_3 = pending.iter().find(|d| d.event_id == "order-3").unwrap().id.clone();
    let buried = deployment.relayhost(&["dead", "bury", &order_3, "--reason", "customer cancelled"]);
    assert!(buried.status.success(), "{}", stdout(&buried));
    let announced = deployment.fixture.store().events_collection().find_one(doc! { "type": "relayhost.delivery.dead" }).await.unwrap().unwrap();
    let payload = announced.get_document("payload").unwrap();
    assert_eq!(payload.get_str("eventId").unwrap(), "order-3");
    assert_eq!(payload.get_str("lastError").unwrap(), "buried by an operator: customer cancelled");
    let again = deployment.relayhost(&["dead", "bury", &order_3]);
    assert!(!again.status.success() && stdout(&again).contains("dead already"), "{}", stdout(&again));

    // The next host delivers the other three; each successful call is the first charged attempt.
    receiver.hold.store(false, Ordering::SeqCst);
    let host = deployment.start_with("host", &[("WEBHOOK_URL", url.as_str())]);
    deployment.wait_until("the three are delivered", Duration::from_secs(60), async |d| d.drained().await).await;
    let counters = host.stop();
    assert_eq!(counters["completed"], 3);
    let bodies = receiver.bodies();
    let mut delivered: Vec<&str> = bodies[bodies.len() - 3..].iter().map(|b| b["id"].as_str().unwrap_or("?")).collect();
    delivered.sort();
    assert_eq!(delivered, ["order-0", "order-1", "order-2"], "{bodies:?}");
    assert!(bodies.iter().all(|b| b["attempt"] == 1), "{bodies:?}");
    let listed = stdout(&deployment.relayhost(&["dead", "list"]));
    assert!(listed.contains("order-3") && listed.contains("customer cancelled"), "{listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_running_longer_than_its_lease_keeps_it_by_renewal() {
    let receiver = Receiver::start();
    receiver.hold.store(false, Ordering::SeqCst);
    // The webhook answers after 3.5 s: three and a half leases.
    receiver.delay_ms.store(3_500, Ordering::SeqCst);
    let extra = format!(
        "concurrency = 1\nlease = \"1s\"\npoll_interval = \"100ms\"\n\n[plugin.webhook]\nwall_time = \"30s\"\n\
         grants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{}\"], private_networks = true }}",
        receiver.address
    );
    let deployment = Deployment::new(&["webhook"], &extra).await;
    let url = format!("http://{}/hooks", receiver.address);
    let first = deployment.start_with("first", &[("WEBHOOK_URL", url.as_str())]);
    publish_all(deployment.fixture.store(), vec![NewEvent::new("slow-1", "order.placed", doc! { "n": 1 })]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while receiver.bodies().is_empty() {
        assert!(Instant::now() < deadline, "the webhook was not called:\n{}", first.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A second host, polling every 100 ms, would take an expired lane over at once.
    let second = deployment.start_with("second", &[("WEBHOOK_URL", url.as_str())]);
    deployment.wait_until("the slow delivery completes", Duration::from_secs(60), async |d| d.drained().await).await;
    let (first, second) = (first.stop(), second.stop());
    assert_eq!(receiver.bodies().len(), 1, "nobody ran it a second time: {:?}", receiver.bodies());
    assert_eq!((first["completed"], second["completed"]), (1, 0));
}

// ---- embedded MongoDB, admin commands, health endpoints ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_server_keeps_its_data_and_admin_commands_join_a_running_host() {
    let health: std::net::SocketAddr = format!("127.0.0.1:{}", relayhost::mongod::free_port().unwrap()).parse().unwrap();
    let deployment = Deployment::new(&["audit_log"], &format!("health_listen = \"{health}\"")).await;
    let data_dir = deployment.dir.join("embedded-data");
    let data = data_dir.to_str().unwrap().to_string();
    let embedded = [("RELAYHOST_MONGODB_URI", "embedded"), ("RELAYHOST_MONGODB_EMBEDDED_DATA_DIR", data.as_str())];
    let state_file = data_dir.join("relayhost-embedded.json");

    // Without a host, each command starts the embedded server for its own duration.
    let setup = deployment.relayhost_with(&["setup"], &embedded);
    assert!(setup.status.success(), "{}", stdout(&setup));
    assert!(data_dir.join("mongod.lock").exists() && !state_file.exists(), "the server ran and was stopped");
    let publish = |id: &str| deployment.relayhost_with(&["publish", "--type", "order.placed", "--key", "k", "--id", id, "--payload", "{\"total\": 1}"], &embedded);
    let first = publish("e-1");
    assert!(first.status.success() && stdout(&first).contains("published e-1 (sequence 1 of its key)"), "{}", stdout(&first));
    // A new server on the same data still has it.
    let again = publish("e-1");
    assert!(again.status.success() && stdout(&again).contains("exists already"), "{}", stdout(&again));

    // A host owns the server now; admin commands join it instead of starting another one.
    let host = deployment.start_with("host", &embedded);
    assert!(state_file.exists());
    // (A second mongod on the same data directory would fail on its lock file.)
    let second = publish("e-2");
    assert!(second.status.success() && stdout(&second).contains("sequence 2 of its key"), "{}", stdout(&second));
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = loop {
        let (status, metrics) = http_get(health, "/metrics");
        if status == 200 && metrics.contains("relayhost_completed_total 2") {
            break metrics;
        }
        assert!(Instant::now() < deadline, "both events delivered: {status} {metrics}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let unfanned = metrics.lines().find_map(|line| line.strip_prefix("relayhost_events_unfanned "));
    assert!(unfanned.is_some_and(|n| n.parse::<u64>().is_ok()), "the backlog's gauge: {metrics}");
    assert_eq!(http_get(health, "/healthz").0, 200);
    assert_eq!(http_get(health, "/readyz"), (200, "ready\n".to_string()));
    assert_eq!(http_get(health, "/anything").0, 404);
    let stats = deployment.relayhost_with(&["stats", "--json"], &embedded);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).expect("stats --json prints JSON");
    assert_eq!(stats["unfannedEvents"].as_u64(), Some(0), "{stats}");
    let rows = &stats["handlers"];
    assert_eq!(rows[0]["handler"], "audit-log");
    assert_eq!((rows[0]["completed"].as_u64(), rows[0]["pending"].as_u64()), (Some(2), Some(0)), "{rows}");

    // The host stops the server it started.
    let port: u16 = serde_json::from_slice::<serde_json::Value>(&std::fs::read(&state_file).unwrap()).unwrap()["port"].as_u64().unwrap() as u16;
    assert_eq!(host.stop()["completed"], 2);
    assert!(!state_file.exists());
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "the embedded mongod is gone");
}

// ---- check ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_every_problem_and_exits_non_zero() {
    let throttled = "\n[plugin.noop]\nconcurrency_per_host = 3\nrate_per_host = { max = 20, per = \"1s\" }\npriority = 7\n\
                     concurrency = 16\nrate = { max = 50, per = \"1s\", burst = 5 }\n\
                     [plugin.noop.handler.noop]\npriority = 9\nper_key = { limit = 2, key = \"/customer\" }\npriority_from = \"event\"";
    let deployment = Deployment::new(&["noop"], throttled).await;
    let ok = deployment.relayhost(&["check"]);
    assert!(ok.status.success(), "{}", stdout(&ok));
    assert!(stdout(&ok).contains("noop"), "{}", stdout(&ok));
    let said = "[at most 3 at once per host, at most 20 starts per 1s per host, at most 16 at once across hosts, \
                at most 50 starts per 1s across hosts (burst 5), at most 2 of one key at once, unordered (by payload /customer), \
                priority 9, priority per event from the event's `priority`]";
    assert!(stdout(&ok).contains(said), "{}", stdout(&ok));

    std::fs::write(deployment.dir.join("plugins/broken.wasm"), b"\0asm not really").unwrap();
    let config = std::fs::read_to_string(&deployment.config).unwrap() + "\n[plugin.audit_log]\nfuel = 1000000\n";
    std::fs::write(&deployment.config, config).unwrap();
    let output = deployment.relayhost(&["check"]);
    let text = stdout(&output);
    assert!(!output.status.success());
    assert!(text.contains("plugin broken"), "{text}");
    assert!(text.contains("[plugin.audit_log] is configured but"), "{text}");

    std::fs::write(deployment.dir.join("bad.toml"), "[host]\nconcurrency = \"many\"\n").unwrap();
    let output = Command::new(RELAYHOST).args(["check", "--config"]).arg(deployment.dir.join("bad.toml")).output().unwrap();
    assert!(!output.status.success());
    assert!(stdout(&output).contains("concurrency"), "{}", stdout(&output));
    let output = deployment.relayhost(&["publish", "--type", "t", "--payload", "[1, 2]"]);
    assert!(!output.status.success() && stdout(&output).contains("must be a JSON object"), "{}", stdout(&output));
    let output = deployment.relayhost(&["publish", "--type", "t", "--payload", "{}", "--priority", "-1001"]);
    assert!(!output.status.success() && stdout(&output).contains("`priority` must be an integer from -1000 to 1000"), "{}", stdout(&output));
}

// ---- bench ----

/// What `relayhost bench` with `args` printed on the example plugins; it must succeed.
fn bench_output(args: &[&str]) -> String {
    let output = Command::new(RELAYHOST).arg("bench").args(args).arg("--plugins").arg(plugins_dir()).output().unwrap();
    let text = stdout(&output);
    assert!(output.status.success(), "{text}");
    text
}

/// The line of `text` that starts with `label`.
fn line_of<'a>(text: &'a str, label: &str) -> &'a str {
    text.lines().find(|line| line.starts_with(label)).unwrap_or_else(|| panic!("no {label:?} line: {text}"))
}

/// `relayhost bench` end to end on a small scale: every measure is printed with a number, and
/// the goals' verdicts are there. Its speed is for the release build to measure, not for a test.
#[test]
fn bench_measures_the_floor_the_drain_the_latency_and_mongods_work() {
    let text = bench_output(&["--events", "400", "--latency-events", "20", "--rate", "100"]);
    let number_after = |label: &str| -> f64 {
        let line = line_of(&text, label);
        let rest = line[label.len()..].trim_start().trim_start_matches("p50").trim_start();
        rest.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no number in {line:?}"))
    };
    assert!(number_after("raw floor") > 0.0 && number_after("drain") > 0.0, "{text}");
    assert!(number_after("latency") > 0.0 && number_after("commit") > 0.0 && number_after("round trip") > 0.0, "{text}");
    assert!(text.contains("% of the floor (goal >= 50 %)") && text.contains("publisher commits (goal <= 1.7), p99"), "{text}");
    // The drain wrote at least the event's two stamps (the fan-out's and the completion's; a
    // delivery handed out has no document of its own), and both processes spent CPU time on it.
    let work = line_of(&text, "mongod work  per delivery:");
    let number_before = |what: &str| -> f64 {
        let (before, _) = work.split_once(what).unwrap_or_else(|| panic!("no {what:?} in {work:?}"));
        before.split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no number before {what:?}"))
    };
    assert!(number_before(" documents written") >= 2.0, "{work}");
    assert!(number_before(" µs of mongod's CPU") > 0.0 && number_before(" µs of this process's") > 0.0, "{work}");
    // Every delivery of the drain ran the plugin (once each: one host races nobody).
    assert!(text.contains("\n             400 plugin runs\n"), "{text}");
}

/// `--store-only` drains the same backlog with each delivery completed at once: the plugin
/// runs not once (so what it costs shows against the same drain with it), and the drain still
/// completes every delivery (the bench fails otherwise).
#[test]
fn bench_store_only_drains_without_running_the_plugin() {
    let text = bench_output(&["--events", "400", "--store-only", "--latency-events", "5", "--rate", "100"]);
    let drain = line_of(&text, "drain");
    assert!(drain.contains("(400 unkeyed events each completed at once, no plugin run)"), "{drain}");
    assert!(text.contains("\n             0 plugin runs\n"), "{text}");
}

/// Two hosts share the drain and the latency events (the bench fails if a delivery died or
/// the drain stalled) and the bench says so. A smoke test of the option, like the keyed one.
#[test]
fn bench_runs_on_several_hosts_when_asked() {
    let text = bench_output(&["--events", "400", "--hosts", "2", "--latency-events", "10", "--rate", "100"]);
    let drain = line_of(&text, "drain");
    assert!(drain.contains("(400 unkeyed events on 2 hosts through the no-op plugin)"), "{drain}");
    let latency = line_of(&text, "latency");
    assert!(latency.contains("10 events at 100/s on 2 hosts"), "{latency}");
}

/// The keyed drain finishes (the bench waits until every delivery completed, and fails if any
/// died) and says what it drained, and the latency is measured over the keys too. A smoke test of the option: what keyed drains cost is
/// measured, not asserted.
#[test]
fn bench_drains_a_keyed_backlog_when_asked() {
    let text = bench_output(&["--events", "400", "--keys", "20", "--latency-events", "5", "--rate", "100"]);
    let drain = line_of(&text, "drain");
    assert!(drain.contains("(400 events over 20 keys through the no-op plugin)"), "{drain}");
    assert!(drain.contains("(goal >= 35 %)"), "{drain}");
    // The latency events are keyed too: the matrix's keyed latency row, alone.
    let latency = line_of(&text, "latency");
    assert!(latency.contains("5 events over 20 keys at 100/s"), "{latency}");
}

/// The matrix runs every workload on one mongod and prints one table row each, with its
/// ratios and a verdict against its goal (what they measure is for the release build).
#[test]
fn bench_matrix_prints_every_workload_against_its_goal() {
    let text = bench_output(&["--matrix", "--events", "400", "--latency-events", "10", "--rate", "100"]);
    let rows: Vec<&str> = text.lines().filter(|line| line.starts_with("| ") && line.ends_with("met |")).collect();
    let drains: Vec<(&str, &str)> = rows
        .iter()
        .filter_map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            (cells.len() == 13).then(|| (cells[1], cells[2]))
        })
        .collect();
    assert_eq!(
        drains,
        [
            ("unkeyed", "1"),
            ("unkeyed", "2"),
            ("unkeyed", "4"),
            ("unkeyed, limited across hosts", "1"),
            ("1,000 keys", "1"),
            ("1,000 keys", "2"),
            ("1,000 keys", "4"),
            ("hot key + 1,000 keys", "1")
        ],
        "{text}"
    );
    for row in rows.iter().filter(|row| row.split('|').count() == 13) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert!(cells[3].parse::<f64>().unwrap() > 0.0 && cells[6].parse::<f64>().unwrap() > 0.0, "{row}");
    }
    assert_eq!(rows.iter().filter(|row| row.contains("p50 ≤ 1.7 commits")).count(), 4, "{text}");
    // Each several-host drain runs between two one-host drains of its workload, which it is
    // divided by.
    let order: Vec<&str> = text.lines().filter_map(|line| line.strip_prefix("  ")?.split(':').next()).collect();
    // The unkeyed drain limited across hosts too, before another one-host drain. Then, for
    // the unkeyed and the keyed workload, one drain without plugin runs.
    let mut expected = Vec::new();
    for name in ["unkeyed", "1,000 keys"] {
        expected.extend(["1", "2", "1", "4", "1"].map(|count| format!("{name} on {count} host(s)")));
        if name == "unkeyed" {
            expected.extend([format!("{name}, limited across hosts, on 1 host(s)"), format!("{name} on 1 host(s)")]);
        }
        expected.push(format!("{name}, store only, on 1 host(s)"));
    }
    expected.push("hot key + 1,000 keys on 1 host(s)".to_string());
    assert_eq!(order, expected, "{text}");
    // Those two are a table of their own, each beside its workload's one-host drains.
    let alone: Vec<Vec<&str>> = text
        .lines()
        .skip_while(|line| !line.starts_with("| the store alone, 1 host"))
        .skip(2)
        .take_while(|line| line.starts_with("| "))
        .map(|row| row.split('|').map(str::trim).collect())
        .collect();
    assert_eq!(alone.iter().map(|cells| cells[1]).collect::<Vec<_>>(), ["unkeyed", "1,000 keys"], "{text}");
    for cells in &alone {
        assert!(cells[2..8].iter().all(|cell| cell.trim_end_matches(" %").parse::<f64>().is_ok_and(|n| n > 0.0)), "{cells:?}");
    }
}

/// A drain whose deliveries never complete fails, naming how far it got, instead of waiting
/// forever: here the plugin the bench loads subscribes to something else entirely.
#[test]
fn bench_fails_a_drain_that_stalls() {
    let plugins = std::env::temp_dir().join(format!("relayhost-bench-stall-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&plugins);
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(plugins_dir().join("dead_letter_alert.wasm"), plugins.join("noop.wasm")).unwrap();
    let output = Command::new(RELAYHOST)
        .args(["bench", "--events", "50", "--latency-events", "5", "--stall-after", "2", "--plugins"])
        .arg(&plugins)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&plugins);
    let text = format!("{}{}", stdout(&output), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("the drain stalled: 0 of 50 deliveries completed, none in the last 2 s"), "{text}");
}
