//! `relayhost replay`, as an operator uses it on the test replica set: a delivery died in a
//! host; a fixed candidate replayed on its event reports success, the old plugin reproduces
//! the error, and neither changes anything in the database.

mod common;

use relayhost::store::Administration;
use std::time::Duration;

use bson::{Document, doc};
use common::deployment::{Deployment, stdout};
use common::{Fixture, keyed, plugins_dir, publish_all};
use futures::TryStreamExt;
use relayhost::store::{DeliveryFilter, DeliveryStatus};

/// Every document of every collection of the deployment's database, in a fixed order.
async fn everything(deployment: &Deployment) -> Vec<(String, Vec<Document>)> {
    let database = deployment.fixture.client.database(&deployment.fixture.database);
    let mut names = database.list_collection_names().await.unwrap();
    names.sort();
    let mut all = Vec::new();
    for name in names {
        let documents: Vec<Document> =
            database.collection::<Document>(&name).find(doc! {}).sort(doc! { "_id": 1 }).await.unwrap().try_collect().await.unwrap();
        all.push((name, documents));
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_candidate_replayed_on_a_dead_event_succeeds_the_old_plugin_reproduces_it_and_nothing_is_written() {
    // The deployed plugin offers `audit-log` but does not know how to handle it.
    let extra = "poll_interval = \"200ms\"\n\n\
                 [plugin.hostile]\nretry = { max_attempts = 1 }\ngrants = { environment = [\"HOSTILE_SQUAT\"] }\n\n\
                 [plugin.audit_log]\ngrants = { collections = [\"audit_log\", \"audit_order\"] }";
    let deployment = Deployment::new(&["hostile"], extra).await;
    // Beside a Kubernetes Service named `relayhost`, whose variables the host passes over.
    let kubernetes = [("RELAYHOST_SERVICE_HOST", "10.0.0.7"), ("RELAYHOST_SERVICE_PORT", "8080"), ("RELAYHOST_PORT_8080_TCP_ADDR", "10.0.0.7")];
    let host = deployment.start_with("host", &[[("HOSTILE_SQUAT", "1")].as_slice(), &kubernetes].concat());
    let store = deployment.fixture.store();
    publish_all(store, vec![keyed("order-1", "order.placed", "customer-1")]).await;
    let dead = DeliveryFilter { status: Some(DeliveryStatus::Dead), ..DeliveryFilter::default() };
    deployment
        .wait_until("the delivery died", Duration::from_secs(30), async |_| store.list_deliveries(&dead).await.unwrap().deliveries.len() == 1)
        .await;
    host.stop();
    let before = everything(&deployment).await;

    let candidate = plugins_dir().join("audit_log.wasm");
    let replay = |plugin: &std::path::Path, env: &[(&str, &str)]| {
        let args = ["replay", "--event", "order-1", "--plugin", plugin.to_str().unwrap(), "--json"];
        deployment.relayhost_with(&args, env)
    };
    let output = replay(&candidate, &[]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let fixed = &report[0];
    assert_eq!((fixed["handler"].as_str(), fixed["result"]["outcome"].as_str()), (Some("audit-log"), Some("completed")), "{fixed}");
    assert_eq!(fixed["attempt"], 2, "the attempt after the one that died");
    let calls: Vec<&str> = fixed["writes"].as_array().unwrap().iter().map(|w| w["collection"].as_str().unwrap()).collect();
    assert_eq!(calls, ["audit_log", "audit_order", "audit_order"], "what the fix would write");
    assert_eq!(fixed["stored"]["status"], "dead");
    assert!(fixed["stored"]["lastError"].as_str().unwrap().contains("unknown handler audit-log"), "{fixed}");
    assert_eq!(everything(&deployment).await, before, "the replay's transaction was aborted");

    // The old plugin reproduces the error, and changes nothing either.
    let output = replay(&plugins_dir().join("hostile.wasm"), &[("HOSTILE_SQUAT", "1")]);
    assert!(!output.status.success());
    let report: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let old = &report[0];
    assert_eq!(old["result"]["outcome"], "dead");
    assert!(old["result"]["reason"].as_str().unwrap().contains("unknown handler audit-log"), "{old}");
    assert_eq!(everything(&deployment).await, before);

    // A plugin that offers no handler of the event's type is told so.
    let output = replay(&plugins_dir().join("dead_letter_alert.wasm"), &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("offers no handler of event type \"order.placed\""), "{stderr}");
    let output = deployment.relayhost(&["replay", "--event", "no-such-event", "--plugin", candidate.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("there is no event \"no-such-event\""), "{stderr}");
}
