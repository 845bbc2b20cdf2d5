//! `relayhost test-plugin`, as a plugin author runs it: the real binary, real components built
//! from this repository, an events file, no MongoDB. Transactional handlers run in the memory
//! store's transactions (their writes and the completion commit together, a failure leaves
//! nothing, grants hold), HTTP is answered from fixtures, limits stop a runaway loop, and the
//! exit code says whether every delivery ended as it should.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::deployment::RELAYHOST;
use common::plugins_dir;
use serde_json::Value;

/// A scratch folder with `events.jsonl` and `relayhost.toml` as given.
fn folder(name: &str, events: &str, config: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("relayhost-test-plugin-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("events.jsonl"), events).unwrap();
    std::fs::write(dir.join("relayhost.toml"), config).unwrap();
    dir
}

fn test_plugin(dir: &Path, plugin: &str, extra: &[&str]) -> Output {
    std::process::Command::new(RELAYHOST)
        .arg("test-plugin")
        .arg(plugins_dir().join(format!("{plugin}.wasm")))
        .arg("--events")
        .arg(dir.join("events.jsonl"))
        .arg("--config")
        .arg(dir.join("relayhost.toml"))
        .args(extra)
        // No MongoDB anywhere: a URI that cannot be reached would fail any attempt to use it.
        .env("RELAYHOST_MONGODB_URI", "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=100")
        .output()
        .unwrap()
}

/// The JSON report, by event id and handler.
fn report_of(output: &Output) -> Vec<Value> {
    serde_json::from_slice::<Value>(&output.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout))).as_array().unwrap().clone()
}

fn find<'a>(report: &'a [Value], event: &str, handler: &str) -> &'a Value {
    report.iter().find(|r| r["event"] == event && r["handler"] == handler).unwrap_or_else(|| panic!("no delivery of {event} to {handler}: {report:?}"))
}

fn logs(delivery: &Value) -> Vec<String> {
    delivery["log"].as_array().unwrap().iter().map(|l| l.as_str().unwrap().to_string()).collect()
}

#[test]
fn a_transactional_handler_writes_in_the_memory_store_and_a_failure_after_a_write_leaves_nothing() {
    let target = r#""target": "hostile_target""#;
    let events = [
        format!(r#"{{"id": "w-1", "type": "write-then-fail", "payload": {{{target}, "fail": false}}}}"#),
        format!(r#"{{"id": "count-1", "type": "find-all", "payload": {{{target}}}}}"#),
        format!(r#"{{"id": "w-2", "type": "write-then-fail", "payload": {{{target}}}}}"#),
        format!(r#"{{"id": "count-2", "type": "find-all", "payload": {{{target}}}}}"#),
        r#"{"id": "stolen", "type": "write-then-fail", "payload": {"target": "not_granted"}, "expect": "dead"}"#.to_string(),
    ]
    .join("\n");
    let config = "[plugin.hostile]\nretry = { max_attempts = 3 }\ngrants = { collections = [\"hostile_target\"] }\n";
    let dir = folder("transactional", &events, config);
    let output = test_plugin(&dir, "hostile", &["--json", "--expect", "w-2/write-then-fail=retry"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report = report_of(&output);
    // The write that completed is there for the next delivery; the one that failed is not.
    let written = find(&report, "w-1", "write-then-fail");
    assert_eq!(written["result"]["outcome"], "completed", "{written}");
    assert_eq!(written["writes"][0]["call"], "insert");
    assert_eq!(written["writes"][0]["collection"], "hostile_target");
    assert_eq!(logs(find(&report, "count-1", "find-all")), ["INFO found 1"]);
    let failed = find(&report, "w-2", "write-then-fail");
    assert_eq!(failed["result"]["outcome"], "retry", "{failed}");
    assert_eq!(failed["result"]["reason"], "failed after its write");
    assert!(failed["result"]["at"].as_i64().unwrap() > 0);
    assert_eq!(failed["writes"][0]["call"], "insert", "the report shows the write it made, which did not commit");
    assert_eq!(logs(find(&report, "count-2", "find-all")), ["INFO found 1"], "the failed delivery's write was taken back");
    // The grant holds: a collection not granted is refused, with the reason.
    let stolen = find(&report, "stolen", "write-then-fail");
    assert_eq!(stolen["result"]["outcome"], "dead", "{stolen}");
    assert!(stolen["result"]["reason"].as_str().unwrap().contains("not_granted"), "{stolen}");
    assert!(stolen["writes"].as_array().unwrap().is_empty());
    assert_eq!(report.len(), 5, "one delivery an event: {report:?}");
    assert!(output.status.success(), "every delivery ended as stated: {stderr}");
    // Without the expectation, the same file fails, naming what did not complete.
    let output = test_plugin(&dir, "hostile", &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("w-2 / write-then-fail: retry at") && stderr.contains("where Completed was expected"), "{stderr}");
    // The text report says the same for a reader.
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("w-1 (write-then-fail) -> write-then-fail, attempt 1: completed"), "{stdout}");
    assert!(stdout.contains("  log      INFO found 1"), "{stdout}");
}

#[test]
fn the_audit_log_example_projects_its_events_and_a_runaway_loop_ends_as_the_limits_say() {
    let events = "{\"id\": \"o-1\", \"type\": \"order.placed\", \"key\": \"c-1\", \"payload\": {\"total\": 10}}\n\
                  {\"id\": \"o-2\", \"type\": \"order.paid\", \"key\": \"c-1\", \"payload\": {\"total\": 10}}\n";
    let config = "[plugin.audit_log]\ngrants = { collections = [\"audit_log\", \"audit_order\"] }\n";
    let dir = folder("audit", events, config);
    let output = test_plugin(&dir, "audit_log", &["--json"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report = report_of(&output);
    let first = find(&report, "o-1", "audit-log");
    let calls: Vec<(&str, &str)> =
        first["writes"].as_array().unwrap().iter().map(|w| (w["call"].as_str().unwrap(), w["collection"].as_str().unwrap())).collect();
    // The key's projection does not exist yet: the update matches nothing, the insert makes it.
    assert_eq!(calls, [("insert", "audit_log"), ("update", "audit_order"), ("insert", "audit_order")]);
    let second = find(&report, "o-2", "audit-log");
    assert_eq!(second["writes"][1]["matched"], 1, "the second event of the key finds the projection the first committed");
    assert!(first["fuel"].as_u64().unwrap() > 0 && first["peakMemoryBytes"].as_u64().unwrap() > 0);

    // A loop that never ends is stopped by its fuel, and retried.
    let events = "{\"id\": \"spin\", \"type\": \"attack.spin\", \"payload\": {}}\n";
    let config = "[plugin.hostile]\nfuel = 5000000\n";
    let dir = folder("spin", events, config);
    let output = test_plugin(&dir, "hostile", &["--json"]);
    assert!(!output.status.success());
    let report = report_of(&output);
    let spin = find(&report, "spin", "spin");
    assert_eq!(spin["result"]["outcome"], "retry");
    assert!(spin["result"]["reason"].as_str().unwrap().contains("fuel"), "{spin}");
    assert_eq!(spin["fuel"], 5_000_000);
}

#[test]
fn http_is_answered_from_fixtures_and_sent_only_when_allowed() {
    let events = "{\"id\": \"o-1\", \"type\": \"order.placed\", \"payload\": {\"total\": 10}}\n";
    let config = "[plugin.webhook]\ngrants = { http_hosts = [\"hooks.example.com\"], environment = [\"WEBHOOK_URL\"] }\n";
    let dir = folder("webhook", events, config);
    let run = |extra: &[&str], url: &str| {
        let mut command = std::process::Command::new(RELAYHOST);
        command
            .arg("test-plugin")
            .arg(plugins_dir().join("webhook.wasm"))
            .arg("--events")
            .arg(dir.join("events.jsonl"))
            .arg("--config")
            .arg(dir.join("relayhost.toml"))
            .arg("--json")
            .args(extra)
            .env("WEBHOOK_URL", url);
        command.output().unwrap()
    };
    // Without a fixture, nothing leaves: the request is refused and recorded.
    let output = run(&[], "http://hooks.example.com/orders");
    let report = report_of(&output);
    let delivery = &report[0];
    assert_eq!(delivery["http"][0]["method"], "POST");
    assert_eq!(delivery["http"][0]["url"], "http://hooks.example.com/orders");
    assert!(delivery["http"][0]["answer"]["refused"].as_str().unwrap().contains("--allow-http"), "{delivery}");
    assert_ne!(delivery["result"]["outcome"], "completed");
    // A fixture answers it; the body the plugin sent is in the report.
    let fixture = "{\"http\": {\"method\": \"POST\", \"url\": \"http://hooks.example.com/orders\", \"status\": 202}}\n";
    std::fs::write(dir.join("events.jsonl"), format!("{fixture}{events}")).unwrap();
    let output = run(&[], "http://hooks.example.com/orders");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let delivery = &report_of(&output)[0];
    assert_eq!(delivery["http"][0]["answer"]["fixture"], 202);
    assert!(delivery["http"][0]["body"].as_str().unwrap().contains("o-1"), "{delivery}");
    // A host the grant does not name is refused before anything else, fixture or not.
    let output = run(&[], "http://elsewhere.example.com/orders");
    let delivery = &report_of(&output)[0];
    assert!(delivery["http"][0]["answer"]["refused"].as_str().unwrap().contains("not granted"), "{delivery}");
    // With --allow-http an unanswered request is really sent, to a real local server.
    let receiver = common::receiver::Receiver::start();
    receiver.hold.store(false, std::sync::atomic::Ordering::SeqCst);
    let config = format!("[plugin.webhook]\ngrants = {{ http_hosts = [\"{}\"], environment = [\"WEBHOOK_URL\"], private_networks = true }}\n", receiver.address);
    std::fs::write(dir.join("relayhost.toml"), config).unwrap();
    std::fs::write(dir.join("events.jsonl"), events).unwrap();
    let output = run(&["--allow-http"], &format!("http://{}/orders", receiver.address));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(report_of(&output)[0]["http"][0]["answer"]["sent"], 200);
    assert_eq!(receiver.bodies().len(), 1, "the request reached the server");
}

#[test]
fn a_malformed_events_file_is_refused_with_its_line() {
    let dir = folder("malformed", "{\"id\": \"a\", \"type\": \"t\"}\n{\"id\": \"b\"}\n", "");
    let output = test_plugin(&dir, "noop", &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("line 2") && stderr.contains("missing field `type`"), "{stderr}");
}

#[test]
fn an_event_that_breaks_its_types_schema_is_dead_as_on_a_host() {
    let events = "{\"id\": \"o-1\", \"type\": \"order.placed\", \"payload\": {\"orderId\": \"o-1\"}}\n\
                  {\"id\": \"o-2\", \"type\": \"order.placed\", \"payload\": {\"total\": 5}, \"expect\": \"dead\"}\n";
    let config = "[plugin.audit_log]\ngrants = { collections = [\"audit_log\", \"audit_order\"] }\n\n\
                  [schemas]\n\"order.placed\" = \"order.json\"\n";
    let dir = folder("schema", events, config);
    std::fs::write(dir.join("order.json"), r#"{"type": "object", "required": ["orderId"]}"#).unwrap();
    let output = test_plugin(&dir, "audit_log", &["--json"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report = report_of(&output);
    assert_eq!(find(&report, "o-1", "audit-log")["result"]["outcome"], "completed");
    let dead = find(&report, "o-2", "audit-log");
    assert!(dead["result"]["reason"].as_str().unwrap().contains("orderId"), "{dead}");
    assert!(dead["writes"].as_array().unwrap().is_empty(), "it never ran");
}
