//! A plugin author's way, outside this repository, in each of the four languages: `relayhost
//! new` in a temporary folder, `relayhost build` there, `relayhost test-plugin` on the
//! project's own `events.jsonl` (green, no MongoDB), then the same component and events in a
//! host on the test replica set: the outcomes agree, event by event.

mod common;

use relayhost::store::Administration;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::deployment::{Deployment, RELAYHOST, repo_root};
use common::{Fixture, plugins_dir, publish_all};
use relayhost::store::{DeliveryFilter, DeliveryStatus};
use relayhost::trial::EventsFile;

fn relayhost(args: &[&str], dir: &Path) -> std::process::Output {
    // The Rust template's dependencies build once for every run of the suite.
    let output = Command::new(RELAYHOST)
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", repo_root().join("target/plugin-projects"))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "relayhost {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Creates, builds and tries the project `name` in `language`; its folder and each event's
/// outcome as `test-plugin` reported it.
fn made_and_tried(name: &str, language: &str) -> (PathBuf, BTreeMap<String, String>) {
    // The set-up scripts' toolchains (componentize-py and -js, the C tools) are in the cache.
    plugins_dir();
    let parent = std::env::temp_dir().join(format!("relayhost-projects-{}-{language}", std::process::id()));
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir_all(&parent).unwrap();
    assert!(!parent.starts_with(repo_root()), "outside the checkout");
    relayhost(&["new", name, "--lang", language], &parent);
    let project = parent.join(name);
    let built = relayhost(&["build"], &project);
    assert!(String::from_utf8_lossy(&built.stdout).contains(&format!("{name}.wasm")));
    let wasm = format!("{name}.wasm");
    let tried = relayhost(&["test-plugin", &wasm, "--events", "events.jsonl", "--config", "relayhost.toml", "--json"], &project);
    let report: serde_json::Value = serde_json::from_slice(&tried.stdout).unwrap();
    let outcomes = report
        .as_array()
        .unwrap()
        .iter()
        .map(|delivery| {
            assert_eq!(delivery["handler"], name, "the handler is the project's name");
            (delivery["event"].as_str().unwrap().to_string(), delivery["result"]["outcome"].as_str().unwrap().to_string())
        })
        .collect();
    (project, outcomes)
}

/// Runs the project's component on its events in a host on MongoDB; each event's outcome.
async fn outcomes_on_mongodb(project: &Path, name: &str) -> BTreeMap<String, String> {
    let config = std::fs::read_to_string(project.join("relayhost.toml")).unwrap();
    let deployment = Deployment::new(&[], &format!("poll_interval = \"200ms\"\n\n{config}")).await;
    std::fs::copy(project.join(format!("{name}.wasm")), deployment.dir.join("plugins").join(format!("{name}.wasm"))).unwrap();
    let host = deployment.start("host");
    let file = EventsFile::parse(&std::fs::read_to_string(project.join("events.jsonl")).unwrap()).unwrap();
    let store = deployment.fixture.store();
    publish_all(store, file.events.iter().map(|(event, _)| event.clone()).collect()).await;
    deployment.wait_until("the events are settled", Duration::from_secs(60), async |d| d.drained().await).await;
    host.stop();
    let dead = store.list_deliveries(&DeliveryFilter { status: Some(DeliveryStatus::Dead), ..DeliveryFilter::default() }).await.unwrap();
    let mut outcomes = BTreeMap::new();
    for (event, _) in &file.events {
        let completed = store.event_history(&event.id).await.unwrap().completions.iter().any(|(handler, _)| handler == name);
        let died = dead.deliveries.iter().any(|d| d.event_id == event.id && d.handler == name);
        let outcome = match (completed, died) {
            (true, false) => "completed",
            (false, true) => "dead",
            other => panic!("{}: completed and dead {other:?}", event.id),
        };
        outcomes.insert(event.id.clone(), outcome.to_string());
    }
    outcomes
}

async fn the_way_of(language: &str) {
    let name = format!("order-audit-{language}");
    let (project, tried) = made_and_tried(&name, language);
    let expected: BTreeMap<String, String> =
        [("order-1", "completed"), ("order-2", "completed"), ("order-3", "dead")].iter().map(|(e, o)| (e.to_string(), o.to_string())).collect();
    assert_eq!(tried, expected, "test-plugin runs the template's events green");
    assert_eq!(outcomes_on_mongodb(&project, &name).await, tried, "a host on MongoDB agrees");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_project_is_made_built_tried_and_run() {
    the_way_of("rust").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_project_is_made_built_tried_and_run() {
    the_way_of("python").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_javascript_project_is_made_built_tried_and_run() {
    the_way_of("javascript").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_c_project_is_made_built_tried_and_run() {
    the_way_of("c").await;
}

#[test]
fn a_missing_tool_is_named_with_how_to_get_it() {
    let parent = std::env::temp_dir().join(format!("relayhost-projects-{}-missing", std::process::id()));
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir_all(&parent).unwrap();
    relayhost(&["new", "lonely", "--lang", "python"], &parent);
    // Neither the cache nor PATH has componentize-py (nor python3): the build says so.
    let output = Command::new(RELAYHOST)
        .arg("build")
        .current_dir(parent.join("lonely"))
        .env("RELAYHOST_CACHE", parent.join("empty-cache"))
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("python3 is missing: install Python 3"), "{stderr}");
    let output = Command::new(RELAYHOST)
        .arg("build")
        .current_dir(parent.join("lonely"))
        .env("RELAYHOST_CACHE", parent.join("empty-cache"))
        .env("PATH", std::env::join_paths([Path::new("/usr/bin"), Path::new("/bin")]).unwrap())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("componentize-py 0.25.1 is missing: pip install componentize-py==0.25.1"), "{stderr}");
    // Outside a project, it says what a project is.
    let output = Command::new(RELAYHOST).arg("build").current_dir(&parent).output().unwrap();
    assert!(String::from_utf8_lossy(&output.stderr).contains("has no plugin.toml"));
}
