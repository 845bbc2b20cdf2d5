//! Operating relayhost, as an operator does it, on the test replica set with host processes:
//! retention applied by one host at a time (per-key order and idempotency kept across it),
//! `relayhost purge --dry-run`, and finding and acting on what is stuck from the command line.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bson::doc;
use common::deployment::{Deployment, keyed_orders, publish_orders, stdout};
use common::{Fixture, event, publish};
use relayhost::store::{DeliveryFilter, DeliveryStatus, Published, Store};

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
    // The key's later events wait behind its head, not fanned out: they have no delivery yet.
    let shown = deployment.relayhost(&["events", "show", "hang-1", "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!((shown["event"]["key"].as_str(), shown["deliveries"].as_array().map(Vec::len)), (Some("stuck"), Some(0)), "{shown}");
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
