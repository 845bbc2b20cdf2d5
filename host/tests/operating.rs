//! Operating relayhost, as an operator does it, on the test replica set with host processes:
//! retention applied by one host at a time (per-key order and idempotency kept across it),
//! `relayhost purge --dry-run`, and finding and acting on what is stuck from the command line.

mod common;

use relayhost::store::Administration;
use std::collections::BTreeMap;
use std::time::Duration;

use bson::doc;
use common::deployment::{Deployment, keyed_orders, publish_orders, stdout};
use common::{Fixture, event, publish};
use relayhost::store::{DeliveryFilter, DeliveryStatus, Published};

/// The times (ms since the epoch) at which a host's log says it purged.
fn purges(log: &str) -> Vec<i64> {
    log.lines()
        .filter(|line| line.contains("retention: purged"))
        .filter_map(|line| line.split_whitespace().next())
        .filter_map(|at| bson::DateTime::parse_rfc3339_str(at).ok())
        .map(|at| at.timestamp_millis())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_purges_on_one_host_at_a_time_and_keeps_key_order_and_idempotency() {
    let extra = "poll_interval = \"200ms\"\n\n[retention]\ncompleted = \"3s\"\ndead_letters = \"off\"\nevery = \"1s\"";
    let deployment = Deployment::new(&["audit_log", "noop"], extra).await;
    let (one, two) = (deployment.start("one"), deployment.start("two"));
    let store = deployment.fixture.store();
    let orders = keyed_orders(0..12, 3);
    publish_orders(&deployment, &orders).await;
    deployment.assert_audited_exactly(&orders, Duration::from_secs(60), "before the purge").await;
    // Within the window an id is its event's: publishing it again writes nothing.
    assert_eq!(publish(store, event("order-0000", "order.placed")).await.unwrap(), Published::Duplicate);
    // The completed events go, and with them their keys' counters.
    let events = store.events_collection();
    deployment
        .wait_until("the completed events are purged", Duration::from_secs(30), async |_| {
            events.count_documents(doc! { "type": "order.placed" }).await.unwrap() == 0
        })
        .await;
    let sequences = deployment.collection("relayhost_key_sequences");
    deployment.wait_until("the keys' counters are purged", Duration::from_secs(10), async |_| sequences.count_documents(doc! {}).await.unwrap() == 0).await;
    // Both hosts were up; each turn went to one of them: no two purges within a turn.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut all: Vec<i64> = purges(&one.log()).into_iter().chain(purges(&two.log())).collect();
    all.sort();
    assert!(all.len() >= 2, "{all:?}");
    assert!(all.windows(2).all(|pair| pair[1] - pair[0] >= 700), "one host at a time, once a turn: {all:?}");
    // The same keys again: their sequences start over, and each key is handled in order.
    let mut later = keyed_orders(100..112, 3);
    publish_orders(&deployment, &later).await;
    let first = events.find_one(doc! { "_id": "order-0100" }).await.unwrap().unwrap();
    assert_eq!(first.get_i64("sequence").unwrap(), 1, "no event of its key remained, so its counter started again");
    let mut everything = orders.clone();
    everything.append(&mut later);
    deployment.assert_audited_exactly(&everything, Duration::from_secs(60), "after the purge").await;
    let (_, order) = deployment.audit().await;
    let expected: BTreeMap<String, Vec<String>> = common::deployment::by_key(&everything);
    assert_eq!(order, expected, "every key in order, across the purge");
    one.stop();
    two.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_what_is_stuck_and_requeues_or_buries_it_by_filter() {
    let extra = "poll_interval = \"200ms\"\n\n[plugin.hostile]\nwall_time = \"60s\"\n\
                 retry = { max_attempts = 3, initial_backoff = \"10ms\", max_backoff = \"20ms\" }";
    let deployment = Deployment::new(&["hostile", "noop"], extra).await;
    let host = deployment.start("host");
    let store = deployment.fixture.store();
    // Poison dies after three quick attempts; two deliveries wait a week for their retry; a
    // hung delivery holds its key, whose next events wait behind it.
    let mut events: Vec<_> = (0..3).map(|n| event(&format!("poison-{n}"), "poison")).collect();
    let retry_later = doc! { "retry": true, "bytes": 100 };
    events.extend((0..2).map(|n| relayhost::event::NewEvent::new(format!("later-{n}"), "huge-reason", retry_later.clone())));
    events.extend((0..3).map(|n| common::keyed(&format!("hang-{n}"), "hang", "stuck")));
    common::publish_all(store, events).await;
    deployment
        .wait_until("the poison died and the key's followers wait", Duration::from_secs(30), async |d| {
            let filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), limit: 10, ..Default::default() };
            d.fixture.store.list_deliveries(&filter).await.unwrap().deliveries.len() == 3
        })
        .await;
    let list = |args: &[&str]| {
        let mut all = vec!["deliveries", "list", "--json"];
        all.extend_from_slice(args);
        let output = deployment.relayhost(&all);
        assert!(output.status.success(), "{}", stdout(&output));
        let listed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        listed["deliveries"].as_array().unwrap().iter().map(|d| d["eventId"].as_str().unwrap().to_string()).collect::<Vec<_>>()
    };
    assert_eq!(list(&["--status", "dead"]).len(), 3);
    deployment.wait_until("the hung one runs", Duration::from_secs(10), async |_| list(&["--status", "running"]) == ["hang-0"]).await;
    deployment.wait_until("the retries wait", Duration::from_secs(10), async |_| list(&["--status", "pending", "--handler", "huge-reason"]).len() == 2).await;
    // The key's later events wait behind its head: parked, or not fanned out yet (no delivery).
    let shown = deployment.relayhost(&["events", "show", "hang-1", "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["event"]["key"], "stuck", "{shown}");
    assert!(shown["deliveries"].as_array().unwrap().iter().all(|d| d["state"] == "parked"), "{shown}");
    assert!(list(&["--key", "{\"$gt\": \"\"}"]).is_empty(), "a filter value is data");
    assert!(list(&["--handler", "poison", "--older-than", "1h"]).is_empty(), "nothing that old");
    // Burying the running head is refused, naming who holds its lane until when.
    let refused = deployment.relayhost(&["dead", "bury", &running_id(&deployment, "hang-0").await]);
    assert!(!refused.status.success() && stdout(&refused).contains("is leased by") && stdout(&refused).contains(" until "), "{}", stdout(&refused));
    // Bulk: a dry run counts, --yes acts.
    let dry = deployment.relayhost(&["deliveries", "requeue", "--handler", "poison"]);
    assert_eq!(dry.status.code(), Some(2));
    assert!(stdout(&dry).contains("would requeue 3 dead deliveries"), "{}", stdout(&dry));
    let requeued = deployment.relayhost(&["deliveries", "requeue", "--handler", "poison", "--yes"]);
    assert!(requeued.status.success() && stdout(&requeued).contains("requeued 3 of 3"), "{}", stdout(&requeued));
    // Requeued (attempts reset), they really run again, and die again: the plugin still traps.
    deployment.wait_until("the requeued poison ran again", Duration::from_secs(30), async |_| list(&["--status", "dead", "--handler", "poison"]).len() == 3).await;
    let filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), handler: Some("poison".into()), limit: 10, ..Default::default() };
    let again = store.list_deliveries(&filter).await.unwrap().deliveries;
    assert!(again.iter().all(|d| d.attempts == 3), "each ran its three attempts again, from none: {again:?}");
    let buried = deployment.relayhost(&["deliveries", "bury", "--handler", "huge-reason", "--reason", "given up", "--yes"]);
    assert!(buried.status.success() && stdout(&buried).contains("buried 2 of 2"), "{}", stdout(&buried));
    let shown = deployment.relayhost(&["events", "show", "later-1", "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!((shown["deliveries"][0]["state"].as_str(), shown["deliveries"][0]["lastError"].as_str()), (Some("dead"), Some("given up")), "{shown}");
    assert_eq!(list(&["--status", "running"]), ["hang-0"], "the running head was left alone");
    host.stop();
}

async fn running_id(deployment: &Deployment, event_id: &str) -> String {
    let filter = DeliveryFilter { event_id: Some(event_id.into()), limit: 10, ..Default::default() };
    deployment.fixture.store.list_deliveries(&filter).await.unwrap().deliveries[0].id.clone()
}

/// One HTTP/1.1 request (closing the connection): the status and the body.
fn request(address: std::net::SocketAddr, method: &str, path: &str, token: Option<&str>, body: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(5)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: relayhost\r\nconnection: close\r\n");
    if let Some(token) = token {
        head += &format!("authorization: Bearer {token}\r\n");
    }
    let body = body.unwrap_or("");
    if !body.is_empty() {
        head += &format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len());
    }
    stream.write_all(format!("{head}\r\n{body}").as_bytes()).unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default();
    // A chunked body: the JSON is the one chunk between its size lines.
    let body = match body.find('{') {
        Some(start) if !body.starts_with('{') => body[start..body.rfind('}').map_or(body.len(), |end| end + 1)].to_string(),
        _ => body,
    };
    (status, body)
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_answers_only_with_the_token_and_takes_every_input_as_data() {
    let port = relayhost::mongod::free_port().unwrap();
    let address: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let token = "s3cret-admin-token-0123456789";
    let extra = format!(
        "poll_interval = \"200ms\"\n\n[admin]\nlisten = \"{address}\"\ntoken = \"{token}\"\n\n[plugin.hostile]\n\
         retry = {{ max_attempts = 1 }}"
    );
    let deployment = Deployment::new(&["hostile", "noop"], &extra).await;
    std::fs::write(deployment.dir.join("plugins/broken.wasm"), b"not a component").unwrap();
    let host = deployment.start("host");
    host.wait_for_log("admin API listening", Duration::from_secs(10));
    assert!(host.log().lines().any(|l| l.contains("admin API listening") && l.contains(&address.to_string())), "{}", host.log());
    let store = deployment.fixture.store();
    common::publish_all(store, (0..3).map(|n| event(&format!("poison-{n}"), "poison")).collect()).await;
    deployment
        .wait_until("the poison died", Duration::from_secs(30), async |d| {
            let filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), limit: 10, ..Default::default() };
            d.fixture.store.list_deliveries(&filter).await.unwrap().deliveries.len() == 3
        })
        .await;
    let api = |method: &str, path: &str, body: Option<&str>| request(address, method, path, Some(token), body);
    // Without the token, with a wrong one (longer, shorter, same length), and with it.
    for wrong in [None, Some("s3cret-admin-token-0123456789-and-more"), Some("short"), Some("s3cret-admin-token-0123456780")] {
        let (status, body) = request(address, "GET", "/api/v1/stats", wrong, None);
        assert_eq!(status, 401, "{wrong:?}: {body}");
    }
    let (status, stats) = api("GET", "/api/v1/stats", None);
    assert_eq!(status, 200, "{stats}");
    let stats = json(&stats);
    let poison = stats["handlers"].as_array().unwrap().iter().find(|h| h["handler"] == "poison").expect("listed").clone();
    assert_eq!(poison["dead"], 3);
    // Listing: bounded pages, filters as data, bad input named.
    let (_, page) = api("GET", "/api/v1/deliveries?status=dead&limit=2", None);
    let page = json(&page);
    assert_eq!(page["deliveries"].as_array().unwrap().len(), 2);
    let next = page["next"].as_str().expect("a full page says where to go on").to_string();
    let (_, rest) = api("GET", &format!("/api/v1/deliveries?status=dead&limit=2&after={next}"), None);
    let rest = json(&rest);
    assert_eq!((rest["deliveries"].as_array().unwrap().len(), rest["next"].is_null()), (1, true));
    let (status, _) = api("GET", "/api/v1/deliveries?limit=100000", None);
    assert_eq!(status, 200, "a page is capped, not refused");
    let (status, injected) = api("GET", "/api/v1/deliveries?key=%7B%22%24gt%22%3A%22%22%7D&handler=%7B%22%24ne%22%3A1%7D", None);
    assert_eq!((status, json(&injected)["deliveries"].as_array().unwrap().len()), (200, 0), "{injected}");
    let (status, bad) = api("GET", "/api/v1/deliveries?status=%7B%22%24gt%22%3A%22%22%7D", None);
    assert!(status == 400 && bad.contains("is none of pending, running, parked, dead"), "{status} {bad}");
    let (status, bad) = api("GET", "/api/v1/deliveries?older_than=soon", None);
    assert!(status == 400 && bad.contains("older_than"), "{status} {bad}");
    // Bulk: a count without confirm, the action with it; then the deliveries run again.
    let (_, counted) = api("POST", "/api/v1/deliveries/requeue", Some(r#"{"handler": "poison"}"#));
    assert_eq!((json(&counted)["matched"].as_u64(), json(&counted)["done"].as_u64()), (Some(3), Some(0)), "{counted}");
    let (_, done) = api("POST", "/api/v1/deliveries/requeue", Some(r#"{"handler": "poison", "confirm": true}"#));
    assert_eq!(json(&done)["done"], 3, "{done}");
    deployment
        .wait_until("the requeued poison died again", Duration::from_secs(30), async |d| {
            let filter = DeliveryFilter { status: Some(DeliveryStatus::Dead), handler: Some("poison".into()), limit: 10, ..Default::default() };
            let dead = d.fixture.store.list_deliveries(&filter).await.unwrap().deliveries;
            dead.len() == 3 && dead.iter().all(|d| d.attempts == 1)
        })
        .await;
    // One delivery by id: an id shaped like an operator is not found, not matched.
    for id in ["000000000000000000000000", "%7B%22%24gt%22%3A%22%22%7D"] {
        let (status, body) = api("POST", &format!("/api/v1/deliveries/{id}/requeue"), None);
        assert_eq!(status, 404, "{id}: {body}");
    }
    let (status, event) = api("GET", "/api/v1/events/poison-1", None);
    assert_eq!(status, 200);
    assert_eq!(json(&event)["deliveries"][0]["state"], "dead");
    assert_eq!(api("GET", "/api/v1/events/nope", None).0, 404);
    // Plugins (with the refused file's reason), handlers, lanes, hosts, the purge's dry run.
    let (_, plugins) = api("GET", "/api/v1/plugins", None);
    let plugins = json(&plugins);
    let hostile = plugins["plugins"].as_array().unwrap().iter().find(|p| p["plugin"] == "hostile").expect("loaded").clone();
    assert_eq!(hostile["version"].as_str().map(str::len), Some(64));
    assert!(hostile["limits"]["fuel"].as_u64().is_some() && hostile["grants"]["collections"].is_array(), "{hostile}");
    assert!(plugins["refused"]["broken"].as_str().is_some_and(|why| why.contains("not a WebAssembly binary")), "{plugins}");
    let (_, handlers) = api("GET", "/api/v1/handlers", None);
    assert!(json(&handlers)["handlers"].as_array().unwrap().iter().any(|h| h["handler"] == "poison"));
    let (_, lanes) = api("GET", "/api/v1/lanes", None);
    assert_eq!(json(&lanes)["lanes"].as_array().unwrap().len(), 256);
    let (_, hosts) = api("GET", "/api/v1/hosts", None);
    let hosts = json(&hosts);
    assert_eq!(hosts["hosts"].as_array().unwrap().len(), 1, "{hosts}");
    assert!(hosts["hosts"][0]["serves"].as_array().unwrap().iter().any(|h| h == "noop"), "{hosts}");
    let (_, purge) = api("POST", "/api/v1/purge", None);
    assert_eq!(json(&purge)["dryRun"], true, "without a body, only counted");
    assert_eq!(api("GET", "/api/v1/nothing-here", None).0, 404);
    assert!(!host.log().contains(token), "the token is never logged");
    host.stop();
}

/// The host's `/metrics`, read by Prometheus's own Python parser (OpenMetrics): each sample's
/// name, labels and value.
fn parsed_metrics(text: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    let python_path = std::process::Command::new(common::deployment::repo_root().join("scripts/ensure-python-deps.sh")).output().unwrap();
    let mut parser = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, json\n\
             from prometheus_client.openmetrics.parser import text_string_to_metric_families\n\
             print(json.dumps([[s.name, s.labels, s.value] for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]))",
        ])
        .env("PYTHONPATH", stdout(&python_path).trim())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    parser.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let output = parser.wait_with_output().unwrap();
    assert!(output.status.success(), "the parser refused the scrape: {}\n{text}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_openmetrics_and_each_run_is_one_sample_of_each_histogram() {
    let health: std::net::SocketAddr = format!("127.0.0.1:{}", relayhost::mongod::free_port().unwrap()).parse().unwrap();
    let extra = format!("poll_interval = \"200ms\"\nhealth_listen = \"{health}\"\n\n[plugin.hostile]\nretry = {{ max_attempts = 2, initial_backoff = \"10ms\" }}");
    let deployment = Deployment::new(&["audit_log", "noop", "hostile"], &extra).await;
    let host = deployment.start("host");
    let orders = keyed_orders(0..7, 3);
    publish_orders(&deployment, &orders).await;
    // A poisoned event: two runs that trap, then dead.
    common::publish_all(deployment.fixture.store(), vec![event("poison-0", "poison")]).await;
    deployment.assert_audited_exactly(&orders, Duration::from_secs(60), "before the scrape").await;
    let (status, text) = common::deployment::http_get(health, "/metrics");
    assert_eq!(status, 200, "{text}");
    let samples = parsed_metrics(&text);
    let value = |name: &str, handler: Option<&str>| {
        samples
            .iter()
            .find(|(n, labels, _)| n == name && handler.is_none_or(|h| labels.get("handler").map(String::as_str) == Some(h)))
            .map(|(_, _, v)| *v)
            .unwrap_or_else(|| panic!("no sample {name} {handler:?} in:\n{text}"))
    };
    for handler in ["audit-log", "noop"] {
        for histogram in ["relayhost_delivery_run_seconds", "relayhost_delivery_fuel", "relayhost_delivery_peak_memory_bytes", "relayhost_delivery_lag_seconds"] {
            assert_eq!(value(&format!("{histogram}_count"), Some(handler)), 7.0, "{histogram} of {handler}: one sample a run");
        }
        assert!(value("relayhost_delivery_fuel_sum", Some(handler)) > 0.0);
        assert!(value("relayhost_delivery_peak_memory_bytes_sum", Some(handler)) >= 7.0 * 65_536.0, "a component has a page of memory at least");
        assert_eq!(value("relayhost_deliveries_pending", Some(handler)), 0.0);
    }
    let runs = |handler: &str, outcome: &str| {
        samples
            .iter()
            .find(|(n, labels, _)| {
                n == "relayhost_delivery_runs_total" && labels.get("handler").map(String::as_str) == Some(handler) && labels.get("outcome").map(String::as_str) == Some(outcome)
            })
            .map_or(0.0, |(_, _, v)| *v)
    };
    assert_eq!((runs("noop", "completed"), runs("audit-log", "completed")), (7.0, 7.0));
    assert_eq!((runs("poison", "failed"), runs("poison", "completed")), (2.0, 0.0), "each run counted by how it ended");
    assert_eq!(value("relayhost_completed_total", None), 14.0);
    assert_eq!(value("relayhost_plugins_loaded", None), 3.0);
    assert_eq!(value("relayhost_events_unfanned", None), 0.0);
    assert_eq!(value("relayhost_handler_hosts_serving", Some("noop")), 1.0);
    host.stop();
}

/// Event schemas, as an operator configures them: `relayhost publish` refuses an invalid
/// payload with its failing path and writes nothing; an invalid event another driver
/// published is dead at fan-out for its handler, announced, while valid ones run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_that_break_their_types_schema_are_refused_at_publish_and_dead_at_fan_out() {
    let schema = std::env::temp_dir().join(format!("relayhost-operating-schema-{}.json", std::process::id()));
    std::fs::write(&schema, r#"{"type": "object", "required": ["orderId"], "properties": {"total": {"type": "number", "minimum": 0}}}"#).unwrap();
    let extra = format!("poll_interval = \"200ms\"\n\n[schemas]\n\"order.placed\" = {:?}", schema.display().to_string());
    let deployment = Deployment::new(&["audit_log"], &extra).await;
    let host = deployment.start("host");
    let refused = deployment.relayhost(&["publish", "--type", "order.placed", "--id", "refused", "--payload", r#"{"orderId": "o-0", "total": -1}"#]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("at /total") && stderr.contains("nothing was published"), "{stderr}");
    let store = deployment.fixture.store();
    assert!(store.events_collection().find_one(doc! { "_id": "refused" }).await.unwrap().is_none());
    // Another driver knows nothing of schemas.
    common::publish_all(store, vec![
        relayhost::event::NewEvent::new("bad", "order.placed", doc! { "total": 5 }),
        relayhost::event::NewEvent::new("good", "order.placed", doc! { "orderId": "o-1", "total": 5 }),
    ]).await;
    deployment.wait_until("both settled", Duration::from_secs(30), async |d| d.drained().await).await;
    host.stop();
    let dead = store.list_deliveries(&DeliveryFilter { status: Some(DeliveryStatus::Dead), ..DeliveryFilter::default() }).await.unwrap();
    assert_eq!(dead.deliveries.len(), 1);
    let reason = dead.deliveries[0].last_error.clone().unwrap_or_default();
    assert!(dead.deliveries[0].event_id == "bad" && reason.contains("orderId"), "{reason}");
    assert!(store.event_history("good").await.unwrap().completions.iter().any(|(handler, _)| handler == "audit-log"));
    std::fs::remove_file(&schema).unwrap();
}
