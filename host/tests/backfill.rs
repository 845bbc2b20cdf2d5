//! Backfill: a handler added later gets the older events it never had. The store's contract on
//! both stores (what is reopened, once, and what the next fan-out makes of it), and the
//! command beside a running host on a real replica set: 10,000 events, in key order, each
//! once, beside live traffic, and again for nothing.

#![allow(async_fn_in_trait)]

#[macro_use]
mod common;

use std::time::Duration;

use bson::{Bson, doc};
use common::deployment::{Deployment, keyed_orders, publish_orders, stdout};
use common::*;
use relayhost::store::{Administration, DeliveryFilter, Hosts, Outbox};

both_stores!(events_are_reopened_once_for_a_handler_that_never_had_them_and_the_fan_out_gives_it_alone_its_deliveries);

const T0: i64 = 1_800_000_000_000;

fn ids(reopened: &[Bson]) -> Vec<&str> {
    reopened.iter().filter_map(Bson::as_str).collect()
}

async fn events_are_reopened_once_for_a_handler_that_never_had_them_and_the_fan_out_gives_it_alone_its_deliveries<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, vec![event("a", "t"), event("b", "t"), event("c", "other")]).await;
    let before = subs(&[("old", &["t", "other"])]);
    assert_eq!(store.fan_out(&before, 100, 0, at(T0)).await.unwrap().deliveries, 3);
    // Published later, after a pause, and not fanned out yet.
    tokio::time::sleep(Duration::from_millis(20)).await;
    publish_all(store, vec![event("d", "t")]).await;
    // One whose delivery runs without a document just now waits (its next mark would
    // rewrite `handedOut`).
    let at_t0 = bson::DateTime::from_millis(T0 - 60_000);
    let running = doc! { "_id": "h", "type": "t", "payload": {}, "createdAt": at_t0, "fannedOutAt": at_t0, "handlers": ["old"], "handedOut": ["old"] };
    fixture.insert_raw_event(running).await;
    let types = vec!["t".to_string()];
    // Only what was fanned out, of its types, is reopened, oldest first.
    let reopened = store.reopen_for("new", &types, None, 10).await.unwrap();
    assert_eq!(ids(&reopened), ["a", "b"]);
    assert_eq!(store.unfanned_among(&reopened).await.unwrap(), 2);
    assert!(store.reopen_for("new", &types, None, 10).await.unwrap().is_empty(), "reopened once");
    assert_eq!(store.backfill_waiting("new", &types, None).await.unwrap(), 1, "the running one waits");
    assert_eq!(store.backfill_waiting("old", &types, None).await.unwrap(), 0, "it lists its own handler");
    // The next fan-out gives the new handler its deliveries, and the old one nothing again.
    let after = subs(&[("old", &["t", "other"]), ("new", &["t"])]);
    let report = store.fan_out(&after, 100, 0, at(T0 + 1)).await.unwrap();
    assert_eq!((report.events, report.deliveries), (3, 4), "a and b for new; d for both");
    assert_eq!(store.unfanned_among(&reopened).await.unwrap(), 0);
    let mut pairs: Vec<(String, String)> =
        list_all(store, DeliveryFilter::default()).await.iter().map(|d| (d.event_id.clone(), d.handler.clone())).collect();
    pairs.sort();
    let expected = [("a", "new"), ("a", "old"), ("b", "new"), ("b", "old"), ("c", "old"), ("d", "new"), ("d", "old")];
    assert_eq!(pairs, expected.map(|(e, h)| (e.to_string(), h.to_string())));
    // Now every event lists it: a backfill again reopens nothing.
    assert!(store.reopen_for("new", &types, None, 10).await.unwrap().is_empty());
    // `since` leaves older events alone; a batch is at most its limit.
    let d_created = *fixture.raw_event("d").await.unwrap().get_datetime("createdAt").unwrap();
    assert_eq!(ids(&store.reopen_for("third", &types, Some(d_created), 10).await.unwrap()), ["d"]);
    assert_eq!(ids(&store.reopen_for("third", &types, None, 1).await.unwrap()), ["a"]);
}

/// A handler added after 10,000 events were delivered to another: the backfill gives it every
/// one of them, in each key's order, once, while a live order of a new key reaches it too; run
/// again, it reopens nothing. The other handler gets nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_added_after_ten_thousand_events_gets_each_once_in_key_order() {
    let deployment = Deployment::new(&["noop", "audit_log"], "concurrency = 16\npoll_interval = \"200ms\"").await;
    let audit_log = deployment.dir.join("plugins/audit_log.wasm");
    let kept = deployment.dir.join("audit_log.wasm.later");
    std::fs::rename(&audit_log, &kept).unwrap();
    let host = deployment.start("host");
    let orders = keyed_orders(0..10_000, 50);
    publish_orders(&deployment, &orders).await;
    deployment.wait_until("the noop handler had every order", Duration::from_secs(180), async |d| d.drained().await).await;
    assert!(deployment.documents("audit_log").await.is_empty());

    // Bad input first: nothing is reopened.
    let unknown = deployment.relayhost(&["backfill", "--handler", "audit-log"]);
    assert!(!unknown.status.success() && stdout(&unknown).contains("not registered"), "{}", stdout(&unknown));

    // The handler arrives (hot-added), then a live order of a new key.
    std::fs::rename(&kept, &audit_log).unwrap();
    deployment
        .wait_until("the registry lists audit-log", Duration::from_secs(30), async |d| {
            let registry = d.fixture.store().registered_handlers(bson::DateTime::now()).await.unwrap();
            registry.iter().any(|h| h.handler == "audit-log" && !h.served_by.is_empty())
        })
        .await;
    let bad_type = deployment.relayhost(&["backfill", "--handler", "audit-log", "--type", "order.cancelled"]);
    assert!(!bad_type.status.success() && stdout(&bad_type).contains("does not subscribe"), "{}", stdout(&bad_type));
    let live = vec![("order-live".to_string(), "customer-live".to_string())];
    publish_orders(&deployment, &live).await;

    let backfilled = deployment.relayhost(&["backfill", "--handler", "audit-log", "--batch", "1000"]);
    assert!(backfilled.status.success(), "{}\n{}", stdout(&backfilled), host.log());
    assert!(stdout(&backfilled).contains("backfilled 10000 events for audit-log"), "{}", stdout(&backfilled));
    let everything: Vec<(String, String)> = orders.iter().chain(&live).cloned().collect();
    deployment.assert_audited_exactly(&everything, Duration::from_secs(300), "after the backfill").await;

    let again = deployment.relayhost(&["backfill", "--handler", "audit-log"]);
    assert!(stdout(&again).contains("backfilled 0 events"), "{}", stdout(&again));
    // The noop handler completed each order once, before and after.
    let noop = deployment.collection("relayhost_completed_deliveries").count_documents(doc! { "handler": "noop" }).await.unwrap();
    assert_eq!(noop, 10_001);
    deployment.assert_audited_exactly(&everything, Duration::from_secs(10), "after a second backfill").await;
    host.stop();
}
