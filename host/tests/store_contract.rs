//! The store contract: every test here runs against the memory store and against the
//! MongoDB store on a real replica set. A behaviour one store has and the other lacks fails
//! here.

#![allow(async_fn_in_trait)]

#[macro_use]
mod common;

use relayhost::store::{Administration, Hosts, Outbox};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::doc;
use common::*;
use relayhost::event::{EventError, NewEvent};
use relayhost::store::{
    Capacity, ClaimedDelivery, DeliveryFilter, KeyLimits, PerKey, PriorityFrom, Priorities, Room, Rooms, DeliveryStatus, PurgeOptions, Published, Settlement, Store, StoreError, StoreOptions,
    StoreTransaction, Subscription, Subscriptions, MALFORMED_EVENT_HANDLER, run_in_transaction, Declaration, Disposal,
    RegisteredHandler,
};


both_stores!(
    purge_deletes_a_keys_counter_only_once_none_of_its_events_remains,
    one_instance_at_a_time_holds_a_jobs_turn,
    listing_filters_by_running_parked_and_age_and_takes_operators_text_as_data,
    the_registry_keeps_a_handler_subscribed_while_no_host_serves_it_until_an_operator_retires_it,
    a_host_that_does_not_serve_a_handler_fans_out_its_keys_as_its_declaration_says,
    retiring_a_handler_buries_or_drops_exactly_its_waiting_deliveries,
    setup_is_idempotent_and_safe_concurrently,
    publish_validates_events_and_numbers_keys_in_commit_order,
    republishing_an_id_creates_nothing,
    aborted_transactions_leave_no_event,
    fan_out_creates_one_delivery_per_subscribed_handler_once,
    a_handler_that_completed_an_event_never_gets_it_again,
    malformed_event_documents_are_dead_lettered_and_block_nothing,
    an_event_that_breaks_its_types_schema_is_dead_at_fan_out_for_each_handler_and_announced,
    skewed_clocks_and_split_batches_keep_sequence_order,
    per_key_rules_hold_within_one_claim,
    a_claim_keeps_to_each_handlers_room_and_leaves_the_rest_as_it_was,
    a_handler_limited_per_key_runs_that_many_of_a_payload_key_at_once_unordered,
    a_handler_limited_per_event_key_runs_that_many_of_a_key_at_once,
    a_claim_reads_a_handlers_priority_from_its_payload_field,
    a_hand_out_and_a_claim_take_higher_priorities_first_wherever_their_lanes,
    a_claim_takes_a_handlers_higher_event_priorities_first_and_keeps_each_keys_order,
    keyed_deliveries_run_one_at_a_time_in_sequence_order,
    a_fan_out_creates_the_followers_of_a_key_parked,
    a_backlog_of_many_keys_is_fanned_out_in_publishing_order_not_a_whole_key_at_a_time,
    applications_events_are_fanned_out_before_follow_ups_and_shallow_follow_ups_before_deep_ones,
    a_handlers_writes_commit_or_abort_with_its_transaction_and_a_refused_call_dooms_it,
    concurrent_workers_never_claim_twice_and_keep_key_order,
    lanes_are_exclusive_under_a_live_lease,
    live_hosts_split_the_lanes_and_leave_each_other_their_events_until_stale,
    a_claim_in_given_lanes_takes_only_those_and_keeps_the_rules,
    a_fan_out_hands_out_unkeyed_deliveries_in_free_or_own_lanes_only,
    a_fan_out_hands_out_nothing_of_a_claims_only_handler,
    a_fan_out_hands_out_a_keys_head_only_while_nothing_of_its_key_is_pending,
    a_keys_later_events_wait_unfanned_while_its_head_runs_unless_nothing_else_is_there,
    a_key_that_waited_for_claims_once_is_awaited_no_more_once_its_head_is_handed_out,
    a_key_read_apart_that_a_new_split_gave_another_host_is_left_to_it,
    a_held_lane_a_new_split_gave_another_host_takes_no_new_work_and_goes_back_to_it,
    a_held_lane_of_another_hosts_share_still_gives_its_holder_what_waited_past_stale,
    a_look_takes_the_share_among_the_live_hosts_and_announces_nothing,
    a_keys_head_handed_out_without_a_document_holds_its_key_and_leads_it_after_a_takeover,
    a_fan_out_that_may_hand_out_early_hands_out_each_once_with_word_of_its_commit,
    racing_plain_marks_of_one_backlog_run_every_event_once,
    lanes_are_held_per_store_instance,
    older_work_in_a_free_lane_goes_before_younger_work_of_a_held_lane,
    held_lanes_past_the_first_group_are_not_starved_by_younger_work_of_the_first,
    relinquish_hands_lanes_back_at_once,
    a_stale_lease_changes_nothing,
    a_lane_taken_over_gives_its_old_holder_nothing,
    a_head_another_instance_settled_does_not_hold_back_its_key,
    what_a_stale_holder_sees_blocked_in_a_lane_it_lost_is_not_parked,
    an_expired_lease_nobody_took_is_still_honoured,
    takeover_charges_the_lost_attempt_once,
    reschedule_release_and_bury,
    handed_out_deliveries_settle_and_are_taken_over_like_claimed_ones,
    a_transactional_handlers_hand_out_keeps_its_document_while_other_handlers_share_its_event,
    lane_lists_keep_event_ids_that_look_like_expressions,
    a_handed_out_delivery_its_holder_checks_later_stays_listed_for_a_takeover,
    a_handed_out_delivery_is_buried_in_the_transaction_that_announces_it,
    requeue_brings_a_dead_delivery_back_before_its_followers,
    an_operator_buries_a_stuck_delivery_unless_its_lane_is_leased,
    operator_inputs_never_become_query_operators,
    long_blocked_backlogs_are_parked_and_drain_in_order,
    followers_wait_parked_and_each_leads_as_soon_as_its_predecessor_settles,
    complete_many_settles_each_lease,
    transactional_completion_commits_with_the_callers_writes,
    a_transactional_completion_frees_its_key_for_the_next_claim,
    extend_lease_renews_only_current_leases,
    purge_keeps_what_is_referenced_or_recent,
    purge_racing_fan_out_never_orphans_a_delivery,
    statistics_count_each_state,
    transaction_budget_aborts_late_commits,
);

async fn setup_is_idempotent_and_safe_concurrently<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b, c) = (fixture.worker("a"), fixture.worker("b"), fixture.worker("c"));
    let (ra, rb, rc) = tokio::join!(a.setup(), b.setup(), c.setup());
    ra.unwrap();
    rb.unwrap();
    rc.unwrap();
    fixture.store().setup().await.unwrap();
    // Still works after repeated setups.
    publish(fixture.store(), event("e-1", "t")).await.unwrap();
    assert_eq!(fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await, 1);
}

async fn publish_validates_events_and_numbers_keys_in_commit_order<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let error = publish(store, event("", "t")).await.unwrap_err();
    assert!(matches!(error, StoreError::InvalidEvent(EventError::Empty { field: "_id" })), "{error}");
    let error = publish(store, NewEvent::new("e", "t", doc! { "blob": "x".repeat(2 * 1024 * 1024) })).await.unwrap_err();
    assert!(error.to_string().contains("`payload` is"), "{error}");
    let error = publish(store, keyed("e", "t", &"k".repeat(600))).await.unwrap_err();
    assert!(error.to_string().contains("`key` is 600 characters"), "{error}");

    let mut sequences = Vec::new();
    for n in 0..3 {
        sequences.push(publish(store, keyed(&format!("e-{n}"), "t", "order-1")).await.unwrap());
    }
    let other = publish(store, keyed("x", "t", "order-2")).await.unwrap();
    assert_eq!(
        sequences,
        [1, 2, 3].map(|n| Published::New { sequence: Some(n) })
    );
    assert_eq!(other, Published::New { sequence: Some(1) });
    let stored = fixture.raw_event("e-2").await.unwrap();
    assert_eq!(stored.get_str("key").unwrap(), "order-1");
    assert_eq!(stored.get_i64("sequence").unwrap(), 3);
    assert_eq!(stored.get_document("payload").unwrap(), &doc! { "n": "e-2" });
    assert!(stored.get_datetime("createdAt").is_ok());
    assert!(!stored.contains_key("fannedOutAt"));

    // Concurrent publishers of one key serialize through its counter: no sequence twice.
    let mut tasks = Vec::new();
    for n in 0..8 {
        let worker = fixture.worker("publisher");
        tasks.push(async move { publish(&worker, keyed(&format!("c-{n}"), "t", "hot")).await.unwrap() });
    }
    let mut numbers: Vec<i64> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|p| match p {
            Published::New { sequence: Some(n) } => n,
            other => panic!("{other:?}"),
        })
        .collect();
    numbers.sort();
    assert_eq!(numbers, (1..=8).collect::<Vec<_>>());
}

async fn republishing_an_id_creates_nothing<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    assert_eq!(publish(store, keyed("e-1", "t", "k")).await.unwrap(), Published::New { sequence: Some(1) });
    assert_eq!(publish(store, keyed("e-1", "t", "k")).await.unwrap(), Published::Duplicate);
    // The duplicate did not take a sequence either.
    assert_eq!(publish(store, keyed("e-2", "t", "k")).await.unwrap(), Published::New { sequence: Some(2) });
    assert_eq!(fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await, 2);
}

async fn aborted_transactions_leave_no_event<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let mut tx = store.begin().await.unwrap();
    store.publish(&mut tx, &keyed("e-1", "t", "k")).await.unwrap();
    tx.abort().await.unwrap();
    assert!(fixture.raw_event("e-1").await.is_none());
    assert_eq!(fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await, 0);
    // The aborted increment is gone too: the next event of the key is sequence 1.
    assert_eq!(publish(store, keyed("e-2", "t", "k")).await.unwrap(), Published::New { sequence: Some(1) });
}

async fn fan_out_creates_one_delivery_per_subscribed_handler_once<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, vec![event("a", "order.placed"), event("b", "order.paid"), event("c", "other")]).await;
    let subscriptions = subs(&[("mailer", &["order.placed"]), ("ledger", &["order.placed", "order.paid"])]);
    let report = store.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap();
    assert_eq!((report.events, report.deliveries, report.malformed), (3, 3, 0));
    // A second fan-out, by this or another worker, finds nothing to do.
    assert_eq!(fixture.worker("w2").fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap().events, 0);
    let all = list_all(store, DeliveryFilter::default()).await;
    let mut pairs: Vec<(String, String)> = all.iter().map(|d| (d.event_id.clone(), d.handler.clone())).collect();
    pairs.sort();
    assert_eq!(
        pairs,
        [("a", "ledger"), ("a", "mailer"), ("b", "ledger")].map(|(e, h)| (e.to_string(), h.to_string()))
    );
    let event_a = fixture.raw_event("a").await.unwrap();
    let mut listed: Vec<&str> = event_a.get_array("handlers").unwrap().iter().filter_map(|h| h.as_str()).collect();
    listed.sort();
    assert_eq!(listed, ["ledger", "mailer"]);
    assert!(event_a.get_datetime("fannedOutAt").is_ok());

    // Concurrent fan-outs of one backlog create each delivery exactly once.
    publish_all(store, (0..60).map(|n| event(&format!("m-{n}"), "order.placed")).collect()).await;
    let workers: Vec<_> = (0..3).map(|n| fixture.worker(&format!("f{n}"))).collect();
    let counts = futures::future::join_all(workers.iter().map(|w| fan_out_all(w, &subscriptions, at(T0)))).await;
    assert_eq!(counts.iter().sum::<usize>(), 120);
    assert_eq!(list_all(store, DeliveryFilter::default()).await.len(), 123);
}

async fn a_handler_that_completed_an_event_never_gets_it_again<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h1", &["t"]), ("h2", &["t"])]);
    publish(store, event("e-1", "t")).await.unwrap();
    fan_out_all(store, &subscriptions, at(T0)).await;
    let claimed = store.claim(&handlers(&["h1"]), 10, at(T0)).await.unwrap();
    assert_eq!(ids(&claimed), ["e-1/h1"]);
    assert_eq!(store.complete_many(&[claimed[0].lease], at(T0)).await.unwrap(), [Settlement::Completed]);
    // A publish retry of the id changes nothing, and nothing runs h1 again.
    assert_eq!(publish(store, event("e-1", "t")).await.unwrap(), Published::Duplicate);
    assert_eq!(fan_out_all(store, &subscriptions, at(T0)).await, 0);
    assert!(store.claim(&handlers(&["h1"]), 10, at(T0 + 1)).await.unwrap().is_empty());

    // An event that another driver wrote with handlers already listed gets only the others.
    let mut raw = event("e-2", "t").to_document(None, at(T0));
    raw.insert("handlers", vec!["h1"]);
    fixture.insert_raw_event(raw).await;
    assert_eq!(fan_out_all(store, &subscriptions, at(T0)).await, 1);
    let pending = list_all(store, DeliveryFilter { event_id: Some("e-2".into()), ..Default::default() }).await;
    assert_eq!(pending.iter().map(|d| d.handler.as_str()).collect::<Vec<_>>(), ["h2"]);
}

async fn malformed_event_documents_are_dead_lettered_and_block_nothing<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let good = |id: &str| event(id, "t").to_document(None, at(T0));
    let mut no_type = good("no-type");
    no_type.remove("type");
    let mut text_payload = good("text-payload");
    text_payload.insert("payload", "not a document");
    let mut keyed_without_sequence = good("no-sequence");
    keyed_without_sequence.insert("key", "k");
    let mut bad_headers = good("bad-headers");
    bad_headers.insert("headers", doc! { "x": 1 });
    let mut numeric_type = good("numeric-type");
    numeric_type.insert("type", 42);
    let mut dollar_header = good("dollar-header");
    dollar_header.insert("headers", doc! { "$where": "x" });
    // Larger than the host can deliver (it adds its marks to the document).
    let mut oversized = good("oversized");
    oversized.insert("payload", doc! { "blob": bson::Binary { subtype: bson::spec::BinarySubtype::Generic, bytes: vec![0; 15_800_000] } });
    for document in [no_type, text_payload, keyed_without_sequence, bad_headers, numeric_type, dollar_header, oversized] {
        fixture.insert_raw_event(document).await;
    }
    fixture.insert_raw_event(doc! { "_id": 7, "type": "t", "payload": {}, "createdAt": at(T0) }).await;
    publish_all(store, vec![event("fine-1", "t"), keyed("fine-2", "t", "k")]).await;

    let subscriptions = subs(&[("h", &["t"])]);
    let report = store.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap();
    assert_eq!(report.malformed, 8);
    let claimed = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    assert_eq!(ids(&claimed), ["fine-1/h", "fine-2/h"]);

    let dead = dead(store).await;
    let reasons: BTreeMap<String, (String, String)> = dead
        .iter()
        .map(|d| (d.event_id.clone(), (d.handler.clone(), d.last_error.clone().unwrap_or_default())))
        .collect();
    assert_eq!(reasons.len(), 8, "{reasons:?}");
    assert!(reasons["dollar-header"].1.contains("header name \"$where\" is not allowed"), "{reasons:?}");
    assert!(reasons["oversized"].1.contains("the event document is 15800"), "{reasons:?}");
    assert_eq!(reasons["no-type"].0, MALFORMED_EVENT_HANDLER);
    assert!(reasons["no-type"].1.contains("`type` is missing"));
    assert_eq!(reasons["numeric-type"].0, MALFORMED_EVENT_HANDLER);
    assert_eq!(reasons["text-payload"].0, "h");
    assert!(reasons["text-payload"].1.contains("`payload` must be a document"));
    assert!(reasons["no-sequence"].1.contains("`sequence` is missing"));
    assert!(reasons["bad-headers"].1.contains("`headers` must be a document of strings"));
    assert!(reasons["7"].1.contains("`_id` must be a string"));
    // Every death is announced, in the fan-out that made it: one dead letter per dead
    // delivery, naming the event and the reason.
    let hook = subs(&[("h", &["t"]), ("dead-letters", &[relayhost::dispatch::DEAD_LETTER_EVENT_TYPE])]);
    let announced = store.fan_out(&hook, 100, 0, at(T0)).await.unwrap();
    assert_eq!((announced.events, announced.malformed), (8, 0), "{announced:?}");
    let letters = store.claim(&handlers(&["dead-letters"]), 10, at(T0)).await.unwrap();
    let said: BTreeMap<String, (String, String)> = letters
        .iter()
        .map(|letter| {
            let payload = &letter.event.payload;
            let field = |name: &str| payload.get_str(name).unwrap_or_default().to_string();
            (field("eventId"), (field("handler"), field("lastError")))
        })
        .collect();
    assert_eq!(said, reasons, "each death is announced with its handler and reason");
    assert!(letters.iter().all(|letter| letter.event.causation_id.as_deref() == letter.event.payload.get_str("eventId").ok()));
    // Nothing is left unfanned: a malformed document never holds the fan-out back.
    assert_eq!(store.fan_out(&hook, 100, 0, at(T0)).await.unwrap().events, 0);
}

/// An event another driver published against its type's schema is dead at fan-out for each
/// of its handlers, the failing path in the reason, its deaths announced; its key's next
/// event is not held back, and events that match run.
async fn an_event_that_breaks_its_types_schema_is_dead_at_fan_out_for_each_handler_and_announced<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let dir = std::env::temp_dir().join(format!("relayhost-contract-schemas-{}-{}", std::process::id(), F::name()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("order.json");
    std::fs::write(&file, r#"{"type": "object", "required": ["orderId"], "properties": {"total": {"type": "number", "minimum": 0}}}"#).unwrap();
    let schemas = relayhost::event_schema::Schemas::load(&BTreeMap::from([("order.placed".to_string(), file)])).unwrap();
    let subscriptions = subs(&[("mailer", &["order.placed"]), ("ledger", &["order.placed"])]).with_schemas(schemas.clone());
    let order = |id: &str, payload: bson::Document| NewEvent::new(id, "order.placed", payload).with_key("customer-1");
    publish_all(store, vec![order("bad", doc! { "orderId": "o-1", "total": -5 }), order("good", doc! { "orderId": "o-2", "total": 5 })]).await;
    let report = store.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap();
    assert_eq!((report.events, report.malformed), (2, 1));
    let dead = dead(store).await;
    let mut dead_for: Vec<&str> = dead.iter().map(|d| d.handler.as_str()).collect();
    dead_for.sort();
    assert_eq!(dead_for, ["ledger", "mailer"], "dead for each of its handlers");
    for delivery in &dead {
        assert_eq!(delivery.event_id, "bad");
        let reason = delivery.last_error.as_deref().unwrap_or_default();
        assert!(reason.contains("at /total") && reason.contains("minimum"), "{reason}");
    }
    // The key's next event, which matches, runs for both handlers.
    let claimed = store.claim(&handlers(&["mailer", "ledger"]), 10, at(T0)).await.unwrap();
    assert_eq!(claimed.iter().filter(|c| c.event.id == "good").count(), 2);
    // Both deaths are announced.
    let hook = subs(&[("dead-letters", &[relayhost::dispatch::DEAD_LETTER_EVENT_TYPE])]).with_schemas(schemas);
    assert_eq!(store.fan_out(&hook, 100, 0, at(T0)).await.unwrap().events, 2);
    let letters = store.claim(&handlers(&["dead-letters"]), 10, at(T0)).await.unwrap();
    assert_eq!(letters.len(), 2);
    assert!(letters.iter().all(|l| l.event.payload.get_str("lastError").unwrap().contains("at /total")));
    std::fs::remove_dir_all(&dir).unwrap();
}

async fn skewed_clocks_and_split_batches_keep_sequence_order<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    // Each later publisher's clock is further behind: createdAt runs backwards while the
    // sequences (commit order) run forwards.
    for n in 0..6_i64 {
        let created = at(T0 - n * 60_000);
        publish(store, keyed(&format!("e-{n}"), "t", "k").with_created_at(created)).await.unwrap();
        publish(store, event(&format!("u-{n}"), "t").with_created_at(at(T0 + n))).await.unwrap();
    }
    let subscriptions = subs(&[("h", &["t"])]);
    let mut order = Vec::new();
    // Fan-out batches of one event split the key; claims in between must never see a later
    // sequence of the key before an earlier one.
    for step in 0..40 {
        store.fan_out(&subscriptions, 1, 0, at(T0)).await.unwrap();
        let claimed = store.claim(&handlers(&["h"]), 10, at(T0 + step)).await.unwrap();
        for c in &claimed {
            if c.event.key.is_some() {
                order.push(c.event.sequence.unwrap());
            }
        }
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        store.complete_many(&leases, at(T0 + step)).await.unwrap();
    }
    assert_eq!(order, [1, 2, 3, 4, 5, 6]);
}

async fn per_key_rules_hold_within_one_claim<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let mut events = Vec::new();
    for n in 0..5 {
        events.push(keyed(&format!("a-{n}"), "t", "key-a"));
        events.push(keyed(&format!("b-{n}"), "t", "key-b"));
    }
    events.push(event("u-1", "t"));
    publish_all(store, events).await;
    fan_out_all(store, &subs(&[("h", &["t"]), ("g", &["t"])]), at(T0)).await;
    let claimed = store.claim(&handlers(&["h", "g"]), 50, at(T0)).await.unwrap();
    // One per (handler, key), each the head of its key; the unkeyed one for both handlers.
    assert_eq!(ids(&claimed), ["a-0/g", "a-0/h", "b-0/g", "b-0/h", "u-1/g", "u-1/h"]);
    // Nothing more of those keys while their heads run, even for another claim.
    assert!(store.claim(&handlers(&["h", "g"]), 50, at(T0 + 1)).await.unwrap().is_empty());
}

async fn a_claim_keeps_to_each_handlers_room_and_leaves_the_rest_as_it_was<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let mut events: Vec<NewEvent> = (0..6).map(|n| event(&format!("u-{n}"), "t")).collect();
    events.extend((0..3).map(|n| keyed(&format!("k-{n}"), "t", "k")));
    publish_all(store, events).await;
    fan_out_all(store, &subs(&[("h", &["t"]), ("g", &["t"])]), at(T0)).await;
    let room = |most: usize| Rooms::new([("h".to_string(), Room { most })]);
    let of = |claimed: &[ClaimedDelivery], handler: &str| claimed.iter().filter(|c| c.handler == handler).count();

    // No room for `h`: only `g`'s deliveries.
    let claimed = store.claim(&handlers(&["h", "g"]), Capacity::new(3, 3).within(room(0)), at(T0)).await.unwrap();
    assert_eq!((of(&claimed, "h"), of(&claimed, "g")), (0, 3), "{:?}", ids(&claimed));
    // Two places for `h`; the rest of `g`'s; three run slots' worth start at once, the others
    // are claimed ahead.
    let claimed = store.claim(&handlers(&["h", "g"]), Capacity::new(20, 3).within(room(2)), at(T0 + 1)).await.unwrap();
    assert_eq!((of(&claimed, "h"), of(&claimed, "g")), (2, 4), "{:?}", ids(&claimed));
    assert_eq!(claimed.iter().filter(|c| c.started).count(), 3);
    // A claim with a room of `h` reads past what it may not take: its key's head is taken
    // the moment there is room, nothing of it having been parked or passed over.
    let mut seen = ids(&claimed);
    loop {
        let claimed = store.claim(&handlers(&["h", "g"]), Capacity::new(20, 20).within(room(1)), at(T0 + 2)).await.unwrap();
        assert!(of(&claimed, "h") <= 1, "{:?}", ids(&claimed));
        if claimed.is_empty() {
            break;
        }
        seen.extend(ids(&claimed));
    }
    let of_h: Vec<&String> = seen.iter().filter(|id| id.ends_with("/h")).collect();
    assert_eq!(of_h.len(), 7, "every unkeyed one and the key's head: {seen:?}");
    assert!(of_h.iter().any(|id| id.as_str() == "k-0/h"), "{seen:?}");
    let statistics = store.statistics(at(T0 + 2)).await.unwrap();
    let h = statistics.iter().find(|s| s.handler == "h").unwrap();
    assert_eq!((h.running, h.pending, h.parked), (7, 2, 2), "the key's followers wait parked behind its head, nothing else");
}

/// `h` runs at most two deliveries of one customer (a field of the payload) at once, in no
/// order; `g`, beside it, keeps the event key's strict order. The customer's deliveries are all
/// in its lane, whose holder counts them; none is handed out by its fan-out.
async fn a_handler_limited_per_key_runs_that_many_of_a_payload_key_at_once_unordered<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let per_customer = Some(PerKey::Payload("/customer".to_string()));
    let subscriptions =
        Subscriptions::new([Subscription::new("h", ["t"]).keyed_by(per_customer), Subscription::new("g", ["t"])]).unwrap();
    let order = |id: String, customer: Option<&str>| {
        let payload = match customer {
            Some(customer) => doc! { "customer": customer },
            None => doc! {},
        };
        NewEvent::new(id, "t", payload).with_key("one-key")
    };
    let mut events: Vec<NewEvent> = (0..6).map(|n| order(format!("a-{n}"), Some("alice"))).collect();
    events.extend((0..3).map(|n| order(format!("b-{n}"), Some("bob"))));
    events.push(order("none".to_string(), None));
    publish_all(store, events).await;
    let report = store.fan_out(&subscriptions, 100, Capacity::new(50, 50), at(T0)).await.unwrap();
    assert_eq!(ids(&report.claimed), ["a-0/g"], "`h`'s never handed out; `g`'s key head is");
    // Listed with the key their limit counts them by.
    let listed = store.list_deliveries(&DeliveryFilter { handler: Some("h".into()), ..Default::default() }).await.unwrap().deliveries;
    let by_limit_key = listed.iter().fold(BTreeMap::<Option<String>, usize>::new(), |mut counts, d| {
        *counts.entry(d.limit_key.clone()).or_default() += 1;
        counts
    });
    assert_eq!(by_limit_key, BTreeMap::from([(None, 1), (Some("alice".into()), 6), (Some("bob".into()), 3)]));
    let two = || Capacity::new(50, 50).keyed_within(KeyLimits::new([("h".to_string(), 2)]));
    let customer = |c: &ClaimedDelivery| c.event.payload.get_str("customer").unwrap_or("-").to_string();
    let of_h = |claimed: &[ClaimedDelivery]| {
        let mut customers: Vec<String> = claimed.iter().filter(|c| c.handler == "h").map(customer).collect();
        customers.sort();
        customers
    };

    let first = store.claim(&handlers(&["h", "g"]), two(), at(T0 + 1)).await.unwrap();
    assert_eq!(of_h(&first), ["-", "alice", "alice", "bob", "bob"], "two of each customer, and the one without");
    let alice: BTreeSet<u8> = first.iter().filter(|c| customer(c) == "alice").map(|c| c.lease.lane).collect();
    assert_eq!(alice.len(), 1, "a customer's deliveries share its lane");
    assert_eq!(first.iter().filter(|c| c.handler == "g").count(), 0, "`g` keeps the event key's order: its head runs");
    assert!(store.claim(&handlers(&["h"]), two(), at(T0 + 2)).await.unwrap().is_empty(), "both customers are at their limit");

    // One of alice's ends: one more of hers, and nothing of bob's.
    let ended = first.iter().find(|c| customer(c) == "alice").unwrap().clone();
    let done = ended.lease;
    store.complete_many(&[done], at(T0 + 3)).await.unwrap();
    let next = store.claim(&handlers(&["h"]), two(), at(T0 + 4)).await.unwrap();
    assert_eq!(of_h(&next), ["alice"]);

    // Drained a claim at a time, never more than two of a customer run, and each runs once.
    let mut running: Vec<ClaimedDelivery> = first.into_iter().filter(|c| c.handler == "h" && c.lease != done).chain(next).collect();
    let mut ran: Vec<String> = vec![ended.event.id.clone()];
    let mut step = 5;
    while !running.is_empty() {
        let counts = running.iter().fold(HashMap::<String, usize>::new(), |mut counts, c| {
            *counts.entry(customer(c)).or_default() += 1;
            counts
        });
        assert!(counts.values().all(|n| *n <= 2), "{counts:?}");
        let finished = running.remove(0);
        ran.push(finished.event.id.clone());
        store.complete_many(&[finished.lease], at(T0 + step)).await.unwrap();
        running.extend(store.claim(&handlers(&["h"]), two(), at(T0 + step + 1)).await.unwrap());
        step += 2;
    }
    ran.sort();
    ran.dedup();
    assert_eq!(ran.len(), 10, "each of h's deliveries ran once: {ran:?}");
}

async fn a_hand_out_and_a_claim_take_higher_priorities_first_wherever_their_lanes<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    // Named so that name and creation order would put `a-low` first.
    let subscriptions = subs(&[("a-low", &["t"]), ("z-high", &["t"])]);
    let priorities = Priorities::new([("a-low".to_string(), 0), ("z-high".to_string(), 5)]);
    let with = |total: usize, run_now: usize| Capacity::new(total, run_now).ordered_by(priorities.clone());
    publish_all(store, (0..2).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    let report = store.fan_out(&subscriptions, 100, with(2, 2), at(T0)).await.unwrap();
    assert_eq!(ids(&report.claimed), ["e-0/z-high", "e-1/z-high"], "handed out");
    // The host now holds the lanes of e-0 and e-1, where `a-low`'s deliveries wait; `z-high`'s
    // newer ones are in free lanes. Of three places, one starting at once: `z-high`'s two
    // first, the one that starts among them.
    publish_all(store, (2..4).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    fan_out_all(store, &subscriptions, at(T0 + 1)).await;
    let claimed = store.claim(&handlers(&["a-low", "z-high"]), with(3, 1), at(T0 + 2)).await.unwrap();
    let high: Vec<&ClaimedDelivery> = claimed.iter().filter(|c| c.handler == "z-high").collect();
    assert_eq!(high.len(), 2, "{:?}", ids(&claimed));
    assert_eq!(claimed.len(), 3);
    assert!(claimed.iter().filter(|c| c.started).all(|c| c.handler == "z-high"), "{claimed:?}");
}

/// Limited per key without a pointer, a handler counts its deliveries by the event's key:
/// that many of a key at once, unordered; an unkeyed event is limited by nothing per key.
async fn a_handler_limited_per_event_key_runs_that_many_of_a_key_at_once<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"]).keyed_by(Some(PerKey::EventKey))]).unwrap();
    let mut events: Vec<NewEvent> = (0..4).map(|n| keyed(&format!("a-{n}"), "t", "alice")).collect();
    events.extend((0..2).map(|n| keyed(&format!("b-{n}"), "t", "bob")));
    events.push(event("u-0", "t"));
    publish_all(store, events).await;
    fan_out_all(store, &subscriptions, at(T0)).await;
    let two = || Capacity::new(50, 50).keyed_within(KeyLimits::new([("h".to_string(), 2)]));
    let key_of = |c: &ClaimedDelivery| c.event.key.clone().unwrap_or_else(|| "-".to_string());
    let keys = |claimed: &[ClaimedDelivery]| {
        let mut keys: Vec<String> = claimed.iter().map(key_of).collect();
        keys.sort();
        keys
    };
    let first = store.claim(&handlers(&["h"]), two(), at(T0 + 1)).await.unwrap();
    assert_eq!(keys(&first), ["-", "alice", "alice", "bob", "bob"], "two of each key at once, and the unkeyed one");
    assert!(store.claim(&handlers(&["h"]), two(), at(T0 + 2)).await.unwrap().is_empty(), "both keys at their limit");
    let alice = first.iter().find(|c| key_of(c) == "alice").unwrap().lease;
    store.complete_many(&[alice], at(T0 + 3)).await.unwrap();
    let next = store.claim(&handlers(&["h"]), two(), at(T0 + 4)).await.unwrap();
    assert_eq!(keys(&next), ["alice"], "one more of alice's as one of hers ends");
}

/// A handler whose priorities come from a payload field: of its due deliveries, a claim takes
/// the higher values first; a value past the range counts as its end, one that is no whole
/// number or is missing as 0.
async fn a_claim_reads_a_handlers_priority_from_its_payload_field<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let from_payload = Some(PriorityFrom::Payload("/order/urgency".to_string()));
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"]).prioritized_by(from_payload)]).unwrap();
    let urgency = |id: &str, value: Option<bson::Bson>| {
        let payload = match value {
            Some(value) => doc! { "order": { "urgency": value } },
            None => doc! { "order": {} },
        };
        NewEvent::new(id, "t", payload)
    };
    publish_all(
        store,
        vec![
            urgency("low", Some(1.into())),
            urgency("missing", None),
            urgency("negative", Some((-3).into())),
            urgency("high", Some(900.into())),
            urgency("text", Some("950".into())),
            urgency("past-the-range", Some(5_000_i64.into())),
        ],
    )
    .await;
    fan_out_all(store, &subscriptions, at(T0)).await;
    let listed = store.list_deliveries(&DeliveryFilter::default()).await.unwrap().deliveries;
    let listed: BTreeMap<&str, Option<i32>> = listed.iter().map(|d| (d.event_id.as_str(), d.priority)).collect();
    let expected = [("high", 900), ("low", 1), ("missing", 0), ("negative", -3), ("past-the-range", 1_000), ("text", 0)];
    assert_eq!(listed, expected.into_iter().map(|(id, p)| (id, Some(p))).collect(), "listed with their priorities");
    let priorities = Priorities::default().per_event(["h".to_string()]);
    let mut order = Vec::new();
    for step in 1..=6 {
        let claimed = store.claim(&handlers(&["h"]), Capacity::from(1).ordered_by(priorities.clone()), at(T0 + step)).await.unwrap();
        order.extend(claimed.iter().map(|c| c.event.id.clone()));
    }
    assert_eq!(order[..3], ["past-the-range", "high", "low"], "{order:?}");
    assert_eq!(order[3..5].iter().map(String::as_str).collect::<BTreeSet<_>>(), BTreeSet::from(["missing", "text"]), "{order:?}");
    assert_eq!(order[5], "negative", "{order:?}");
}

/// `h` takes priorities per event: a claim takes its deliveries of higher priorities first,
/// whatever their age, before `g`'s (of `h`'s handler priority, 0, but in order of age); a
/// key's deliveries keep their order whatever their priorities say. Once in lanes the claimer
/// holds (a fan-out handed `g`'s out there), once in free lanes it searches.
async fn a_claim_takes_a_handlers_higher_event_priorities_first_and_keeps_each_keys_order<F: Fixture>() {
    for lanes_held in [true, false] {
        let fixture = F::new().await;
        higher_event_priorities_first(fixture.store(), lanes_held).await;
    }
}

async fn higher_event_priorities_first<S: Store>(store: &S, lanes_held: bool) {
    use relayhost::lane::lane_for_event;
    let subscriptions =
        Subscriptions::new([Subscription::new("h", ["t"]).prioritized_by(Some(PriorityFrom::Event)), Subscription::new("g", ["t"])])
            .unwrap();
    // Ten of priority 0, all in one lane; three of priority 5; a key whose later event is
    // the most urgent of all.
    let backlog_lane = lane_for_event("low-0", None);
    let lows: Vec<String> = (0..).map(|n| format!("low-{n}")).filter(|id| lane_for_event(id, None) == backlog_lane).take(10).collect();
    let mut events: Vec<NewEvent> = lows.iter().map(|id| event(id, "t")).collect();
    // Six more of priority 0 across other lanes, older than the urgent ones.
    events.extend((0..6).map(|n| event(&format!("spread-{n}"), "t")));
    events.extend((0..3).map(|n| event(&format!("high-{n}"), "t").with_priority(5)));
    events.push(keyed("k-0", "t", "k").with_priority(-1));
    events.push(keyed("k-1", "t", "k").with_priority(9));
    publish_all(store, events).await;
    let hand_out = if lanes_held { Capacity::new(50, 50) } else { Capacity::from(0) };
    let report = store.fan_out(&subscriptions, 100, hand_out, at(T0)).await.unwrap();
    assert!(report.claimed.iter().all(|c| c.handler == "g"), "`h`'s are left to claims: {:?}", ids(&report.claimed));
    let priorities = Priorities::new([("h".to_string(), 0), ("g".to_string(), 0)]).per_event(["h".to_string()]);
    let with = |total: usize| Capacity::new(total, total).ordered_by(priorities.clone());

    let first = store.claim(&handlers(&["h", "g"]), with(3), at(T0 + 1)).await.unwrap();
    assert_eq!(ids(&first), ["high-0/h", "high-1/h", "high-2/h"], "the highest first; k-1 waits behind k-0 (lanes held: {lanes_held})");
    let second = store.claim(&handlers(&["h", "g"]), with(2), at(T0 + 2)).await.unwrap();
    let priority_0 = |c: &ClaimedDelivery| c.event.id.starts_with("low-") || c.event.id.starts_with("spread-");
    assert!(second.iter().all(|c| c.handler == "h" && priority_0(c)), "then priority 0, before `g`'s: {:?}", ids(&second));
    // Urgent events in lanes nobody holds go before the rest of the backlog of a held lane.
    let held: BTreeSet<u8> = first.iter().chain(&second).map(|c| c.lease.lane).chain([lane_for_event("k-0", Some("k"))]).collect();
    let urgent: Vec<String> = (0..).map(|n| format!("urgent-{n}")).filter(|id| !held.contains(&lane_for_event(id, None))).take(2).collect();
    publish_all(store, urgent.iter().map(|id| event(id, "t").with_priority(8)).collect()).await;
    fan_out_all(store, &subscriptions, at(T0 + 3)).await;
    let third = store.claim(&handlers(&["h", "g"]), with(2), at(T0 + 4)).await.unwrap();
    assert_eq!(ids(&third), urgent.iter().map(|id| format!("{id}/h")).collect::<Vec<_>>(), "lanes held: {lanes_held}");

    let rest = store.claim(&handlers(&["h", "g"]), with(50), at(T0 + 5)).await.unwrap();
    let of_h: Vec<String> = ids(&rest).into_iter().filter(|id| id.ends_with("/h")).collect();
    assert!(of_h.contains(&"k-0/h".to_string()) && !of_h.contains(&"k-1/h".to_string()), "{of_h:?}");
    assert_eq!(of_h.len(), 16 - 2 + 1, "the rest of `h`'s but k-1: {of_h:?}");
    let k0 = rest.iter().find(|c| c.event.id == "k-0" && c.handler == "h").unwrap().lease;
    store.complete_many(&[k0], at(T0 + 6)).await.unwrap();
    let after = store.claim(&handlers(&["h"]), with(50), at(T0 + 7)).await.unwrap();
    assert_eq!(ids(&after), ["k-1/h"], "k-1 once k-0 is done");
}

async fn keyed_deliveries_run_one_at_a_time_in_sequence_order<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, (0..10).map(|n| keyed(&format!("e-{n}"), "t", "k")).collect()).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let mut seen = Vec::new();
    for step in 0..12 {
        let claimed = store.claim(&handlers(&["h"]), 10, at(T0 + step)).await.unwrap();
        assert!(claimed.len() <= 1);
        for c in claimed {
            seen.push(c.event.sequence.unwrap());
            if step % 3 == 0 {
                // A failed attempt keeps the key blocked until it is due again.
                store.reschedule(&c.lease, at(T0 + step + 1), "flaky", at(T0 + step)).await.unwrap();
                assert!(store.claim(&handlers(&["h"]), 10, at(T0 + step)).await.unwrap().is_empty());
            } else {
                store.complete_many(&[c.lease], at(T0 + step)).await.unwrap();
            }
        }
    }
    let mut completed_order = seen.clone();
    completed_order.dedup();
    assert_eq!(completed_order, (1..=completed_order.len() as i64).collect::<Vec<_>>());
    assert!(completed_order.len() >= 7, "{seen:?}");
}

async fn a_fan_out_creates_the_followers_of_a_key_parked<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let mut events: Vec<NewEvent> = (0..4).map(|n| keyed(&format!("e-{n}"), "t", "k")).collect();
    events.push(keyed("other", "t", "other-key"));
    events.push(event("u", "t"));
    publish_all(store, events).await;
    let subscriptions = subs(&[("h", &["t"]), ("g", &["t"])]);
    assert_eq!(store.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap().deliveries, 12);
    // Per handler: the key's three followers wait parked from the start, no claim read them.
    let statistics = store.statistics(at(T0)).await.unwrap();
    for handler in ["h", "g"] {
        let of = statistics.iter().find(|s| s.handler == handler).unwrap();
        assert_eq!((of.parked, of.pending), (3, 6), "{handler}: {of:?}");
    }
    // A head that is retried keeps its followers waiting: it is still pending.
    let first = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    let head = first.iter().find(|c| c.event.key.as_deref() == Some("k")).unwrap();
    assert_eq!(head.event.sequence, Some(1));
    store.reschedule(&head.lease, at(T0 + 1), "again", at(T0)).await.unwrap();
    let others: Vec<_> = first.iter().filter(|c| c.lease != head.lease).map(|c| c.lease).collect();
    store.complete_many(&others, at(T0)).await.unwrap();
    let meanwhile = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    assert!(meanwhile.iter().all(|c| c.event.key.as_deref() != Some("k")), "{:?}", ids(&meanwhile));
    let leases: Vec<_> = meanwhile.iter().map(|c| c.lease).collect();
    store.complete_many(&leases, at(T0)).await.unwrap();
    // They run in order all the same: each claim after a completion finds the next.
    let mut order: Vec<(String, i64)> = Vec::new();
    for step in 0..6 {
        let claimed = store.claim(&handlers(&["h", "g"]), 10, at(T0 + 1 + step)).await.unwrap();
        order.extend(claimed.iter().filter(|c| c.event.key.as_deref() == Some("k")).map(|c| (c.handler.clone(), c.event.sequence.unwrap())));
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        store.complete_many(&leases, at(T0 + 1 + step)).await.unwrap();
    }
    for handler in ["h", "g"] {
        let seen: Vec<i64> = order.iter().filter(|(h, _)| h == handler).map(|(_, n)| *n).collect();
        assert_eq!(seen, [1, 2, 3, 4], "{handler}");
    }
}

async fn a_backlog_of_many_keys_is_fanned_out_in_publishing_order_not_a_whole_key_at_a_time<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    // Each key has a delivery pending (fanned out by a fan-out that hands nothing out), so
    // none of the keys is idle: nothing of theirs is handed out, nor left for a later fan-out.
    publish_all(store, ["a", "b", "c"].map(|key| keyed(&format!("0-{key}"), "t", key)).to_vec()).await;
    assert_eq!(store.fan_out(&subscriptions, 10, 0, at(T0)).await.unwrap().deliveries, 3);
    // Then three events of each key, published round after round.
    let events: Vec<NewEvent> =
        (1..=3).flat_map(|round| ["a", "b", "c"].map(|key| keyed(&format!("{round}-{key}"), "t", key))).collect();
    publish_all(store, events).await;
    // A batch of three that may hand out takes the three oldest events and, of their keys,
    // only what precedes them: one round at a time, not the whole of the first key.
    let mut order: Vec<String> = Vec::new();
    for round in 1..=3 {
        let report = store.fan_out(&subscriptions, 3, 3, at(T0)).await.unwrap();
        assert_eq!((report.events, report.deliveries, report.claimed.len()), (3, 3, 0), "round {round}");
    }
    assert_eq!(store.fan_out(&subscriptions, 3, 3, at(T0)).await.unwrap().events, 0);
    // One that hands nothing out reads each key to its end: its followers are created parked
    // behind each other.
    let more: Vec<NewEvent> = (4..=5).map(|round| keyed(&format!("{round}-d"), "t", "d")).collect();
    publish_all(store, more).await;
    let report = store.fan_out(&subscriptions, 1, 0, at(T0)).await.unwrap();
    assert_eq!((report.events, report.deliveries), (2, 2));
    // Each key's events still run in order.
    for step in 0..6 {
        let claimed = store.claim(&handlers(&["h"]), 10, at(T0 + step)).await.unwrap();
        order.extend(claimed.iter().map(|c| c.event.id.clone()));
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        store.complete_many(&leases, at(T0 + step)).await.unwrap();
    }
    for key in ["a", "b", "c"] {
        let seen: Vec<String> = order.iter().filter(|id| id.ends_with(key)).cloned().collect();
        assert_eq!(seen, (0..=3).map(|round| format!("{round}-{key}")).collect::<Vec<_>>());
    }
    let seen: Vec<&String> = order.iter().filter(|id| id.ends_with('d')).collect();
    assert_eq!(seen, ["4-d", "5-d"]);
}

/// A plugin's burst of follow-ups never holds back what applications publish meanwhile: the
/// fan-out reads applications' events first, then follow-ups a chain level at a time, and a
/// key's lower events still come along (per-key order does not depend on depth).
async fn applications_events_are_fanned_out_before_follow_ups_and_shallow_follow_ups_before_deep_ones<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    let follow_up = |id: &str, key: Option<&str>, depth: u32| {
        let mut event = match key {
            Some(key) => keyed(id, "t", key),
            None => event(id, "t"),
        };
        event.chain_depth = depth;
        event
    };
    // The follow-ups are the oldest, the applications' events the newest.
    for event in [follow_up("f-deep", None, 2), follow_up("f-shallow", None, 1), follow_up("f-k", Some("k"), 1)] {
        publish(store, event).await.unwrap();
    }
    for event in [event("a1-app", "t"), keyed("a2-k", "t", "k")] {
        publish(store, event).await.unwrap();
    }
    let fanned = async |expected: &[&str]| {
        let report = store.fan_out(&subscriptions, 1, 0, at(T0)).await.unwrap();
        assert_eq!(report.events, expected.len(), "{expected:?}");
        for id in expected {
            assert!(fixture.raw_event(id).await.unwrap().get_datetime("fannedOutAt").is_ok(), "{id} was fanned out");
        }
    };
    fanned(&["a1-app"]).await;
    for id in ["a2-k", "f-k", "f-shallow", "f-deep"] {
        assert!(fixture.raw_event(id).await.unwrap().get_datetime("fannedOutAt").is_err(), "{id} waits");
    }
    // The key's follow-up comes with the application's event of its key.
    fanned(&["a2-k", "f-k"]).await;
    fanned(&["f-shallow"]).await;
    fanned(&["f-deep"]).await;
    let mut order: Vec<String> = Vec::new();
    for step in 0..3 {
        let claimed = store.claim(&handlers(&["h"]), 10, at(T0 + step)).await.unwrap();
        order.extend(claimed.iter().filter(|c| c.event.key.is_some()).map(|c| c.event.id.clone()));
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        store.complete_many(&leases, at(T0 + step)).await.unwrap();
    }
    assert_eq!(order, ["f-k", "a2-k"], "the key's order is its sequence's");
}

/// What a transactional handler writes through its transaction (the plugins' `transaction`
/// import) means the same on both stores: filters, updates, deletes and finds; its writes
/// commit with the transaction or go with its abort; and a call the store refuses (a duplicate
/// `_id`) leaves the transaction unable to commit, every later call failing as transient, as
/// MongoDB's server-side abort does.
async fn a_handlers_writes_commit_or_abort_with_its_transaction_and_a_refused_call_dooms_it<F: Fixture>() {
    use relayhost::store::HandlerDocuments;
    use relayhost::store::handler_documents::{Found, Update};
    let fixture = F::new().await;
    let store = fixture.store();
    let collection = format!("orders_{}", F::name());
    store.create_collections(std::slice::from_ref(&collection)).await.unwrap();
    let found = async |tx: &mut <F::S as Outbox>::Tx, filter: bson::Document| match tx.find_documents(&collection, filter, 100, 1 << 20).await.unwrap() {
        Found::Documents(documents) => documents,
        Found::TooLarge => panic!("too large"),
    };
    let mut tx = store.begin().await.unwrap();
    for (id, total) in [("o-1", 10), ("o-2", 20), ("o-3", 30)] {
        assert_eq!(tx.insert_document(&collection, doc! { "_id": id, "total": total, "status": "new" }).await.unwrap(), bson::Bson::from(id));
    }
    let made = tx.insert_document(&collection, doc! { "total": 5 }).await.unwrap();
    assert!(matches!(made, bson::Bson::ObjectId(_)), "an _id is made: {made}");
    let update = Update::Document(doc! { "$set": { "status": "paid" }, "$inc": { "total": 1 } });
    assert_eq!(tx.update_documents(&collection, doc! { "total": { "$gte": 20 } }, update).await.unwrap(), 2);
    assert_eq!(tx.delete_documents(&collection, doc! { "_id": { "$in": ["o-1"] } }).await.unwrap(), 1);
    let paid = found(&mut tx, doc! { "status": "paid" }).await;
    assert_eq!(paid.iter().map(|d| d.get_i32("total").unwrap()).collect::<Vec<_>>(), [21, 31]);
    assert_eq!(tx.find_documents(&collection, doc! {}, 100, 40).await.unwrap(), Found::TooLarge, "past the bytes a call may return");
    tx.commit().await.unwrap();
    // An aborted transaction's writes are gone.
    let mut tx = store.begin().await.unwrap();
    tx.insert_document(&collection, doc! { "_id": "o-9" }).await.unwrap();
    tx.delete_documents(&collection, doc! {}).await.unwrap();
    tx.abort().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert_eq!(found(&mut tx, doc! {}).await.len(), 3, "what committed is there, nothing of the abort");
    // A duplicate _id is refused, and the transaction can only be run again.
    let refused = tx.insert_document(&collection, doc! { "_id": "o-2" }).await.unwrap_err();
    assert!(refused.to_string().contains("E11000") && !refused.is_transient(), "{refused}");
    let after = tx.insert_document(&collection, doc! { "_id": "o-10" }).await.unwrap_err();
    assert!(after.is_transient(), "a call after a refused one: {after}");
    let commit = tx.commit().await.unwrap_err();
    assert!(commit.is_transient(), "{commit}");
    let mut tx = store.begin().await.unwrap();
    assert_eq!(found(&mut tx, doc! { "_id": "o-10" }).await.len(), 0);
    tx.abort().await.unwrap();
}

async fn concurrent_workers_never_claim_twice_and_keep_key_order<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let mut events = Vec::new();
    for n in 0..120 {
        events.push(keyed(&format!("e-{n}"), "t", &format!("k{}", n % 12)));
        events.push(event(&format!("u-{n}"), "t"));
    }
    for chunk in events.chunks(40) {
        publish_all(store, chunk.to_vec()).await;
    }
    let subscriptions = subs(&[("h", &["t"])]);
    fan_out_all(store, &subscriptions, bson::DateTime::now()).await;

    let log: Arc<Mutex<Vec<(String, Option<String>, Option<i64>)>>> = Arc::default();
    let running: Arc<Mutex<HashSet<String>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..4 {
        let worker = fixture.worker(&format!("worker-{w}"));
        let (log, running) = (log.clone(), running.clone());
        tasks.push(tokio::spawn(async move {
            let mut idle = 0;
            while idle < 5 {
                let claimed = worker.claim(&handlers(&["h"]), 7, bson::DateTime::now()).await.unwrap();
                if claimed.is_empty() {
                    idle += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                idle = 0;
                for c in &claimed {
                    if let Some(key) = &c.event.key {
                        assert!(running.lock().unwrap().insert(key.clone()), "two deliveries of {key} at once");
                    }
                    log.lock().unwrap().push((c.event.id.clone(), c.event.key.clone(), c.event.sequence));
                }
                tokio::task::yield_now().await;
                for c in &claimed {
                    if let Some(key) = &c.event.key {
                        running.lock().unwrap().remove(key);
                    }
                }
                let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
                let settled = worker.complete_many(&leases, bson::DateTime::now()).await.unwrap();
                assert!(settled.iter().all(|s| *s == Settlement::Completed));
            }
            worker.relinquish().await.unwrap();
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let log = log.lock().unwrap();
    let distinct: HashSet<&String> = log.iter().map(|(id, _, _)| id).collect();
    assert_eq!(log.len(), 240, "every delivery exactly once");
    assert_eq!(distinct.len(), 240);
    let mut last: HashMap<&String, i64> = HashMap::new();
    for (_, key, sequence) in log.iter() {
        if let (Some(key), Some(sequence)) = (key, sequence) {
            let previous = last.insert(key, *sequence).unwrap_or(0);
            assert_eq!(*sequence, previous + 1, "key {key} out of order");
        }
    }
}

async fn live_hosts_split_the_lanes_and_leave_each_other_their_events_until_stale<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    let h = handlers(&["h"]);
    // Events created at `at`: the split leaves an event to its lane's host until it is stale.
    let events = |prefix: &str, at: i64| -> Vec<NewEvent> {
        let mut events: Vec<NewEvent> =
            (0..60).map(|n| event(&format!("{prefix}-{n}"), "t").with_created_at(common::at(at))).collect();
        events.extend((0..20).flat_map(|k| {
            (0..2).map(move |n| keyed(&format!("{prefix}-k{k}-{n}"), "t", &format!("{prefix}-key-{k}")).with_created_at(common::at(at)))
        }));
        events
    };
    assert_eq!(a.announce(at(T0)).await.unwrap(), 1);
    assert_eq!(b.announce(at(T0)).await.unwrap(), 2);
    assert_eq!(a.announce(at(T0)).await.unwrap(), 2);
    publish_all(fixture.store(), events("first", T0)).await;

    // Each fans out the events of its own lanes only: together every event, none twice, and
    // never into the same lane.
    let by_a = a.fan_out(&subscriptions, 1_000, 0, at(T0 + 1)).await.unwrap();
    let by_b = b.fan_out(&subscriptions, 1_000, 0, at(T0 + 1)).await.unwrap();
    assert!(by_a.events >= 20 && by_b.events >= 20, "a split in two: {} and {}", by_a.events, by_b.events);
    assert_eq!(by_a.events + by_b.events, 100);
    assert_eq!(by_a.deliveries + by_b.deliveries, 100);
    assert!(by_a.lanes.is_disjoint(&by_b.lanes), "{:?} {:?}", by_a.lanes, by_b.lanes);

    // A claim takes no free lane of the other live host, however much due work it has.
    let claimed_a = a.claim(&h, 1_000, at(T0 + 2)).await.unwrap();
    assert!(!claimed_a.is_empty());
    assert!(claimed_a.iter().all(|c| by_a.lanes.contains(&c.lease.lane)), "a claimed only in its lanes");
    // Until that work waited past stale (twice the lease): then whoever claims takes it.
    assert_eq!(a.announce(at(T0 + 70_000)).await.unwrap(), 1, "both lapsed meanwhile");
    announce_both(&a, &b, T0 + 70_000).await;
    // (A claim takes a bounded number of such lanes: claim until none is left.)
    let stale_of_b = claim_until_none_is_left(&a, &h, T0 + 70_000).await;
    assert!(!stale_of_b.is_empty() && stale_of_b.iter().all(|c| by_b.lanes.contains(&c.lease.lane)));
    // 60 unkeyed and the heads of the 20 keys, each once.
    let mut every: Vec<String> = ids(&claimed_a).into_iter().chain(ids(&stale_of_b)).collect();
    every.sort();
    every.dedup();
    assert_eq!(every.len(), 80);

    // An event of the other host's lane is fanned out by whoever reads it once stale.
    let t1 = T0 + 90_000;
    announce_both(&a, &b, t1).await;
    publish_all(fixture.store(), events("second", t1)).await;
    let fresh = a.fan_out(&subscriptions, 1_000, 0, at(t1 + 1)).await.unwrap();
    assert!(fresh.events < 100);
    let t2 = t1 + 60_001;
    for now in [t1 + 20_000, t1 + 40_000, t2] {
        announce_both(&a, &b, now).await;
    }
    assert_eq!(a.fan_out(&subscriptions, 1_000, 0, at(t2)).await.unwrap().events, 100 - fresh.events);
    // A stale event brings its key's lower events along, though they are fresh and of the
    // other host's lanes: a key's events are fanned out in sequence order, whoever's they are.
    let late: Vec<NewEvent> = (0..20)
        .flat_map(|k| {
            let key = format!("late-key-{k}");
            [1, 2].map(|n| keyed(&format!("late-k{k}-{n}"), "t", &key).with_created_at(common::at(if n == 1 { t2 } else { t2 - 600_000 })))
        })
        .collect();
    publish_all(fixture.store(), late).await;
    assert_eq!(a.fan_out(&subscriptions, 1_000, 0, at(t2 + 1)).await.unwrap().events, 40);

    // A host whose announcement lapsed (a third of the lease) leaves its share to the others at once; so
    // does one that withdrew (a graceful stop).
    let t3 = t2 + 30_001;
    assert_eq!(a.announce(at(t3)).await.unwrap(), 1, "b's announcement lapsed");
    assert_eq!(b.announce(at(t3)).await.unwrap(), 2);
    b.relinquish().await.unwrap();
    assert_eq!(a.announce(at(t3)).await.unwrap(), 1, "b withdrew");
    publish_all(fixture.store(), events("third", t3)).await;
    assert_eq!(a.fan_out(&subscriptions, 1_000, 0, at(t3 + 1)).await.unwrap().events, 100);
}

/// Everything `store` claims at `now`, claim after claim, until a claim takes nothing.
async fn claim_until_none_is_left<S: Store>(store: &S, handlers: &[String], now: i64) -> Vec<relayhost::store::ClaimedDelivery> {
    let mut every = Vec::new();
    loop {
        let claimed = store.claim(handlers, 1_000, at(now)).await.unwrap();
        if claimed.is_empty() {
            return every;
        }
        every.extend(claimed);
    }
}

/// Announces `a`, then `b`, then `a` again at `now`, each seeing both live.
async fn announce_both<S: Store>(a: &S, b: &S, now: i64) {
    a.announce(at(now)).await.unwrap();
    assert_eq!(b.announce(at(now)).await.unwrap(), 2);
    assert_eq!(a.announce(at(now)).await.unwrap(), 2);
}

async fn lanes_are_exclusive_under_a_live_lease<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let first = id_in_lane("x", 9);
    let second = id_in_lane(&format!("{first}-y"), 9);
    publish_all(fixture.store(), vec![event(&first, "t"), event(&second, "t")]).await;
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = a.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].lease.lane, 9);
    // b sees nothing of lane 9, not even the idle delivery, while a's lease lives.
    assert!(b.claim(&handlers(&["h"]), 10, at(T0 + 1_000)).await.unwrap().is_empty());
    // a itself takes the other one from the lane it holds.
    assert_eq!(a.claim(&handlers(&["h"]), 10, at(T0 + 1_000)).await.unwrap().len(), 1);
}

async fn a_claim_in_given_lanes_takes_only_those_and_keeps_the_rules<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let key_lane = relayhost::lane::lane_of("key");
    let (three, seven) = (id_in_lane("x", 3), id_in_lane("y", 7));
    let other_three = id_in_lane(&format!("{three}-z"), 3);
    publish_all(
        fixture.store(),
        vec![event(&three, "t"), event(&other_three, "t"), event(&seven, "t"), keyed("k-0", "t", "key"), keyed("k-1", "t", "key")],
    )
    .await;
    let report = fixture.store().fan_out(&subs(&[("h", &["t"])]), 100, 0, at(T0)).await.unwrap();
    assert_eq!(report.lanes, [3, 7, key_lane].into_iter().collect());

    // Only the lanes named are taken: both of lane 3, nothing of lane 7.
    let claimed = a.claim_in(&handlers(&["h"]), &[3], 10, at(T0)).await.unwrap();
    assert_eq!(ids(&claimed), { let mut both = vec![format!("{three}/h"), format!("{other_three}/h")]; both.sort(); both });
    // A lane another worker holds is skipped, a free one is taken.
    assert!(b.claim_in(&handlers(&["h"]), &[3], 10, at(T0 + 1)).await.unwrap().is_empty());
    assert_eq!(ids(&b.claim_in(&handlers(&["h"]), &[7, 3], 10, at(T0 + 1)).await.unwrap()), [format!("{seven}/h")]);
    // Per-key order holds: the head of the key, not its follower.
    assert_eq!(ids(&b.claim_in(&handlers(&["h"]), &[key_lane], 10, at(T0 + 2)).await.unwrap()), ["k-0/h"]);
    // Once a's lease expired, a claim in lane 3 takes it over, charging what a left running.
    let taken_over = b.claim_in(&handlers(&["h"]), &[3], 10, at(T0 + 120_000)).await.unwrap();
    assert_eq!(ids(&taken_over), ids(&claimed));
    assert!(taken_over.iter().all(|c| c.attempts == 1), "the lost attempts are charged");
    assert!(a.complete_many(&[claimed[0].lease], at(T0 + 120_001)).await.unwrap() == [Settlement::LeaseLost]);
}

fn declaration(handler: &str, types: &[&str], version: &str) -> Declaration {
    Declaration { subscription: Subscription::new(handler, types.iter().copied()), plugin: format!("{handler}-plugin"), version: version.to_string() }
}

/// Host a declares `audit` as running up to a limit of one customer at once (a payload
/// field); b, which does not serve it, fans its deliveries out into each customer's lane, as a
/// would, and a's claims keep to the limit. Declared again without it, it is ordered again.
async fn a_host_that_does_not_serve_a_handler_fans_out_its_keys_as_its_declaration_says<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    a.announce(at(T0)).await.unwrap();
    b.announce(at(T0)).await.unwrap();
    let per_customer = PerKey::Payload("/customer".to_string());
    let audit = Subscription::new("audit", ["order"]).keyed_by(Some(per_customer.clone()));
    a.register(&[Declaration { subscription: audit, ..declaration("audit", &[], "v1") }], at(T0)).await.unwrap();
    let registry = b.registered_handlers(at(T0 + 1)).await.unwrap();
    assert_eq!(registered(&registry, "audit").per_key, Some(per_customer));
    let subscriptions = relayhost::store::registry::fan_out_subscriptions([], &registry).unwrap();
    let orders: Vec<NewEvent> = (0..3).map(|n| NewEvent::new(format!("o-{n}"), "order", doc! { "customer": "c" })).collect();
    publish_all(&b, orders).await;
    assert_eq!(b.fan_out(&subscriptions, 100, 10, at(T0 + 2)).await.unwrap().deliveries, 3);
    let later = T0 + 120_000;
    a.announce(at(later)).await.unwrap();
    let one = Capacity::new(10, 10).keyed_within(KeyLimits::new([("audit".to_string(), 1)]));
    let claimed = a.claim(&handlers(&["audit"]), one, at(later)).await.unwrap();
    assert_eq!(claimed.len(), 1, "one of customer c at once: {:?}", ids(&claimed));
    assert_eq!(claimed[0].lease.lane, relayhost::lane::lane_for_event("o-0", Some("c")), "in the customer's lane");
    let registry = a.register(&[declaration("audit", &["order"], "v2")], at(later)).await.unwrap();
    assert_eq!(registered(&registry, "audit").per_key, None, "declared without it, its keys are ordered again");
}

fn registered<'a>(registry: &'a [RegisteredHandler], handler: &str) -> &'a RegisteredHandler {
    registry.iter().find(|r| r.handler == handler).unwrap_or_else(|| panic!("{handler} is not registered: {registry:?}"))
}

/// Host a serves `audit` and `mail`, host b only `mail` (a rolling deploy, one version
/// ahead). When a stops, `audit` is served by nobody and stays subscribed: b's fan-outs create
/// its deliveries, never handed out, and a host that serves it again claims them, in key order.
async fn the_registry_keeps_a_handler_subscribed_while_no_host_serves_it_until_an_operator_retires_it<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    a.announce(at(T0)).await.unwrap();
    b.announce(at(T0)).await.unwrap();
    a.register(&[declaration("audit", &["order"], "v1"), declaration("mail", &["order"], "v1")], at(T0)).await.unwrap();
    let registry = b.register(&[declaration("mail", &["order", "refund"], "v2")], at(T0 + 1)).await.unwrap();
    assert_eq!(registered(&registry, "audit").served_by.len(), 1);
    assert_eq!(registered(&registry, "mail").served_by.len(), 2);
    let mail = registered(&registry, "mail");
    assert_eq!(mail.event_types.iter().collect::<Vec<_>>(), ["order", "refund"], "both versions' types while both run");
    assert_eq!((mail.version.as_str(), mail.first_seen, mail.last_seen), ("v2", at(T0), at(T0 + 1)));
    let refused = b.retire("audit", Disposal::Drop, at(T0 + 2)).await.unwrap_err().to_string();
    assert!(refused.contains("served by live host(s)"), "a handler a live host serves is not retired: {refused}");
    // a stops: nobody serves `audit`, which stays subscribed.
    a.relinquish().await.unwrap();
    let registry = b.registered_handlers(at(T0 + 3)).await.unwrap();
    let audit = registered(&registry, "audit");
    assert!(audit.served_by.is_empty() && audit.active(), "{audit:?}");
    assert_eq!(audit.last_seen, at(T0), "since when nobody serves it");
    // b fans out with the registry: `audit`'s deliveries are created, and never handed out by b.
    let b_serves = [Subscription::new("mail", ["order", "refund"])];
    let subscriptions = relayhost::store::registry::fan_out_subscriptions(b_serves, &registry).unwrap();
    publish_all(&b, vec![keyed("o-1", "order", "c"), keyed("o-2", "order", "c"), event("r-1", "refund")]).await;
    let report = b.fan_out(&subscriptions, 100, 10, at(T0 + 4)).await.unwrap();
    assert_eq!(report.deliveries, 5, "two handlers of each order, one of the refund");
    assert!(report.claimed.iter().all(|c| c.handler == "mail"), "{:?}", ids(&report.claimed));
    let waiting = list_all(&b, DeliveryFilter { handler: Some("audit".into()), ..DeliveryFilter::default() }).await;
    assert_eq!(waiting.len(), 2, "{waiting:?}");
    assert!(b.claim(&handlers(&["mail"]), 10, at(T0 + 5)).await.unwrap().iter().all(|c| c.handler == "mail"));
    // A host serving `audit` again (a, restarted) claims its deliveries, one key at a time,
    // wherever the split put them (in b's share, once they waited past stale).
    let a = fixture.worker("a-again");
    let later = T0 + 120_000;
    a.announce(at(later)).await.unwrap();
    b.announce(at(later)).await.unwrap();
    a.register(&[declaration("audit", &["order"], "v1")], at(later)).await.unwrap();
    let mut order = Vec::new();
    for step in 0..4 {
        let claimed = a.claim(&handlers(&["audit"]), 10, at(later + step)).await.unwrap();
        assert!(claimed.len() <= 1, "one of key c at a time: {:?}", ids(&claimed));
        for delivery in &claimed {
            order.push(delivery.event.id.clone());
            assert_eq!(a.complete_many(&[delivery.lease.clone()], at(later + step)).await.unwrap(), [Settlement::Completed]);
        }
    }
    assert_eq!(order, ["o-1", "o-2"]);
}

async fn retiring_a_handler_buries_or_drops_exactly_its_waiting_deliveries<F: Fixture>() {
    let fixture = F::new().await;
    let (gone, stays) = (fixture.worker("gone-host"), fixture.worker("stays-host"));
    for host in [&gone, &stays] {
        host.announce(at(T0)).await.unwrap();
    }
    gone.register(&[declaration("old", &["t"], "v1"), declaration("older", &["t"], "v1")], at(T0)).await.unwrap();
    stays.register(&[declaration("keep", &["t"], "v1")], at(T0)).await.unwrap();
    gone.relinquish().await.unwrap();
    let registry = stays.registered_handlers(at(T0 + 1)).await.unwrap();
    let subscriptions = relayhost::store::registry::fan_out_subscriptions([Subscription::new("keep", ["t"])], &registry).unwrap();
    publish_all(&stays, vec![keyed("k-1", "t", "k"), keyed("k-2", "t", "k"), event("u-1", "t")]).await;
    stays.fan_out(&subscriptions, 100, 0, at(T0 + 2)).await.unwrap();
    let count = async |handler: &str, status: DeliveryStatus| {
        list_all(&stays, DeliveryFilter { handler: Some(handler.into()), status: Some(status), ..DeliveryFilter::default() }).await.len()
    };
    assert_eq!((count("old", DeliveryStatus::Pending).await, count("older", DeliveryStatus::Pending).await), (3, 3));
    // Not registered, and refused: nothing changes.
    assert!(stays.retire("{\"$gt\": \"\"}", Disposal::Drop, at(T0 + 3)).await.unwrap_err().to_string().contains("is registered (see"));
    let report = stays.retire("old", Disposal::Bury, at(T0 + 3)).await.unwrap();
    assert_eq!((report.disposed, report.still_claimed), (3, 0));
    assert_eq!((count("old", DeliveryStatus::Pending).await, count("old", DeliveryStatus::Dead).await), (0, 3));
    let dead = list_all(&stays, DeliveryFilter { handler: Some("old".into()), status: Some(DeliveryStatus::Dead), ..DeliveryFilter::default() }).await;
    assert!(dead.iter().all(|d| d.last_error.as_deref() == Some(relayhost::store::registry::RETIRED)), "{dead:?}");
    let report = stays.retire("older", Disposal::Drop, at(T0 + 4)).await.unwrap();
    assert_eq!(report.disposed, 3);
    assert_eq!((count("older", DeliveryStatus::Pending).await, count("older", DeliveryStatus::Dead).await), (0, 0));
    assert_eq!(count("keep", DeliveryStatus::Pending).await, 3, "the other handler's deliveries are untouched");
    // Retired handlers are no longer subscribed: a new event reaches `keep` only.
    let registry = stays.registered_handlers(at(T0 + 5)).await.unwrap();
    assert!(registered(&registry, "old").retired_at.is_some());
    let subscriptions = relayhost::store::registry::fan_out_subscriptions([Subscription::new("keep", ["t"])], &registry).unwrap();
    publish_all(&stays, vec![event("u-2", "t")]).await;
    assert_eq!(stays.fan_out(&subscriptions, 100, 0, at(T0 + 6)).await.unwrap().deliveries, 1);
    // Declared again, it is registered anew, from then on.
    let registry = stays.register(&[declaration("keep", &["t"], "v1"), declaration("old", &["t"], "v2")], at(T0 + 7)).await.unwrap();
    let old = registered(&registry, "old");
    assert!(old.active() && old.first_seen == at(T0 + 7), "{old:?}");
}

async fn a_fan_out_hands_out_nothing_of_a_claims_only_handler<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions =
        Subscriptions::new([Subscription::new("h", ["t"]), Subscription::new("slow", ["t"]).claimed_only(true)]).unwrap();
    publish_all(store, vec![event("u-0", "t"), event("u-1", "t"), keyed("k-0", "t", "k")]).await;
    let report = store.fan_out(&subscriptions, 100, 10, at(T0)).await.unwrap();
    assert_eq!((report.events, report.deliveries), (3, 6));
    assert_eq!(ids(&report.claimed), ["k-0/h", "u-0/h", "u-1/h"]);
    let claimed = store.claim(&handlers(&["h", "slow"]), 10, at(T0)).await.unwrap();
    assert_eq!(ids(&claimed), ["k-0/slow", "u-0/slow", "u-1/slow"], "left to claims");
}

async fn a_fan_out_hands_out_unkeyed_deliveries_in_free_or_own_lanes_only<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    // b holds lane 9, running something there.
    let b_runs = id_in_lane("b-runs", 9);
    publish_all(&a, vec![event(&b_runs, "t")]).await;
    a.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap();
    let running = b.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    assert_eq!(ids(&running), [format!("{b_runs}/h")]);

    let free: Vec<String> = (0..4).map(|n| id_in_lane(&format!("free-{n}"), 20 + n)).collect();
    let in_b_lane = id_in_lane("in-b-lane", 9);
    let key_lane = relayhost::lane::lane_of("key");
    let mut events: Vec<_> = free.iter().map(|id| event(id, "t")).collect();
    events.extend([event(&in_b_lane, "t"), keyed("k-0", "t", "key")]);
    publish_all(&a, events).await;
    // Three of the four unkeyed ones in free lanes (the budget, which the events published
    // first take), nor the one in b's lane.
    let report = a.fan_out(&subscriptions, 100, 3, at(T0 + 1)).await.unwrap();
    assert_eq!((report.events, report.deliveries), (6, 6));
    let handed_out = ids(&report.claimed);
    assert_eq!(handed_out.len(), 3, "{handed_out:?}");
    assert!(handed_out.iter().all(|id| id.starts_with("free-")), "{handed_out:?}");
    assert!(report.claimed.iter().all(|c| c.attempts == 0 && c.event.event_type == "t"));
    let handed_lanes: HashSet<u8> = report.claimed.iter().map(|c| c.lease.lane).collect();
    // The lanes left to a claim are those of everything not handed out.
    let not_handed = free.iter().find(|id| !handed_out.contains(&format!("{id}/h"))).unwrap();
    let expected: BTreeSet<u8> =
        [9, key_lane, relayhost::lane::lane_for_event(not_handed, None)].into_iter().collect();
    assert_eq!(report.lanes, expected);
    assert!(handed_lanes.is_disjoint(&report.lanes.iter().copied().collect()));

    // They are a's: b's claim takes everything else (its own lane's too), and a's own claim
    // does not hand them out twice.
    let b_claimed = b.claim(&handlers(&["h"]), 10, at(T0 + 2)).await.unwrap();
    let mut expected = vec![format!("{in_b_lane}/h"), "k-0/h".to_string(), format!("{not_handed}/h")];
    expected.sort();
    assert_eq!(ids(&b_claimed), expected);
    assert!(a.claim(&handlers(&["h"]), 10, at(T0 + 2)).await.unwrap().is_empty());
    let leases: Vec<_> = report.claimed.iter().map(|c| c.lease).collect();
    assert_eq!(a.complete_many(&leases, at(T0 + 3)).await.unwrap(), [Settlement::Completed; 3]);

    // A lane a holds is handed out from under the lease a holds it by, its epoch unchanged.
    let lane = report.claimed[0].lease.lane;
    let again = id_in_lane("again", lane);
    publish_all(&a, vec![event(&again, "t")]).await;
    let report_again = a.fan_out(&subscriptions, 100, 3, at(T0 + 4)).await.unwrap();
    assert_eq!(ids(&report_again.claimed), [format!("{again}/h")]);
    assert_eq!(report_again.claimed[0].lease.epoch, report.claimed[0].lease.epoch);
    assert!(report_again.lanes.is_empty());
    // With a budget of none, nothing is handed out.
    publish_all(&a, vec![event("none", "t")]).await;
    let plain = a.fan_out(&subscriptions, 100, 0, at(T0 + 5)).await.unwrap();
    assert!(plain.claimed.is_empty());
    assert_eq!(plain.lanes.len(), 1);

    // A host holding no lane may hand out everything, but b holds this one's lane: what is
    // not handed out after all gets its record with the fan-out's commit, for b's claim.
    let c = fixture.worker("c");
    let also_in_b_lane = id_in_lane("also-in-b-lane", 9);
    publish_all(&c, vec![event(&also_in_b_lane, "t")]).await;
    let report = c.fan_out(&subscriptions, 100, 10, at(T0 + 6)).await.unwrap();
    assert!(report.claimed.is_empty());
    assert_eq!(report.lanes, [9].into_iter().collect());
    assert_eq!(ids(&b.claim_in(&handlers(&["h"]), &[9], 10, at(T0 + 7)).await.unwrap()), [format!("{also_in_b_lane}/h")]);
}

async fn a_fan_out_hands_out_a_keys_head_only_while_nothing_of_its_key_is_pending<F: Fixture>() {
    let fixture = F::new().await;
    let a = fixture.worker("a");
    let subscriptions = subs(&[("h", &["t"])]);
    // "busy" has a delivery pending already (fanned out without a hand-out).
    publish_all(&a, vec![keyed("busy-1", "t", "busy")]).await;
    a.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap();
    publish_all(&a, vec![keyed("idle-1", "t", "idle"), keyed("idle-2", "t", "idle"), keyed("busy-2", "t", "busy")]).await;
    // Only the head of the idle key, whose follower stays unfanned while the head runs here
    // (its settling is to ask for a fan-out); nothing of the busy key, whose event is created
    // behind the one pending. What it left waits behind a predecessor: nothing runnable.
    let report = a.fan_out(&subscriptions, 100, 10, at(T0 + 1)).await.unwrap();
    assert_eq!(ids(&report.claimed), ["idle-1/h"]);
    assert_eq!(report.claimed[0].lease.lane, relayhost::lane::lane_of("idle"));
    assert_eq!((report.events, report.deliveries), (2, 2));
    assert!(a.hints().unfanned_may_wait("idle") && !a.hints().unfanned_may_wait("busy"));
    assert!(!a.hints().unfanned_may_wait("idle"), "asked once per note");
    // A claim meanwhile takes the busy key's head, and nothing of the idle key, which runs.
    let busy = a.claim(&handlers(&["h"]), 10, at(T0 + 2)).await.unwrap();
    assert_eq!(ids(&busy), ["busy-1/h"]);
    let settled: Vec<_> = report.claimed.iter().chain(&busy).map(|c| c.lease).collect();
    assert_eq!(a.complete_many(&settled, at(T0 + 3)).await.unwrap(), [Settlement::Completed; 2]);
    assert_eq!(ids(&a.claim(&handlers(&["h"]), 10, at(T0 + 4)).await.unwrap()), ["busy-2/h"]);
    // The idle key's follower is fanned out, and handed out, once its head settled.
    assert_eq!(ids(&a.fan_out(&subscriptions, 100, 10, at(T0 + 4)).await.unwrap().claimed), ["idle-2/h"]);

    // After an operator's requeue, which a fan-out's snapshot may have missed, a key's head
    // waits for a claim (the claim checks what a racing requeue overtook) for a while.
    publish_all(&a, vec![keyed("doomed-1", "t", "doomed")]).await;
    a.fan_out(&subscriptions, 100, 0, at(T0 + 5)).await.unwrap();
    let doomed = a.claim(&handlers(&["h"]), 10, at(T0 + 5)).await.unwrap();
    let doomed = doomed.iter().find(|c| c.event.id == "doomed-1").unwrap();
    assert_eq!(a.bury(&doomed.lease, "unprocessable", true, at(T0 + 6)).await.unwrap(), Settlement::Completed);
    a.requeue(&doomed.lease.delivery.to_hex(), at(T0 + 7)).await.unwrap();
    publish_all(&a, vec![keyed("fresh-1", "t", "fresh")]).await;
    assert!(a.fan_out(&subscriptions, 100, 10, at(T0 + 8)).await.unwrap().claimed.is_empty());
    publish_all(&a, vec![keyed("later-1", "t", "later")]).await;
    assert_eq!(ids(&a.fan_out(&subscriptions, 100, 10, at(T0 + 61_000)).await.unwrap().claimed), ["later-1/h"]);
}

async fn a_keys_later_events_wait_unfanned_while_its_head_runs_unless_nothing_else_is_there<F: Fixture>() {
    let fixture = F::new().await;
    let a = fixture.worker("a");
    let subscriptions = subs(&[("h", &["t"])]);
    publish_all(&a, vec![keyed("k-1", "t", "k"), keyed("k-2", "t", "k"), keyed("k-3", "t", "k"), event("u-1", "t")]).await;
    // The key's head and the unkeyed event are handed out; the key's later events stay
    // unfanned (not created parked, to wait for a claim), and the key is noted for a fan-out.
    let report = a.fan_out(&subscriptions, 100, 10, at(T0)).await.unwrap();
    let mut claimed = ids(&report.claimed);
    claimed.sort();
    assert_eq!(claimed, ["k-1/h", "u-1/h"]);
    assert_eq!(report.events, 2);
    assert!(a.hints().unfanned_may_wait("k") && !a.hints().followers_may_wait("h", "k"));
    let head = report.claimed.iter().find(|c| c.event.id == "k-1").unwrap().lease;
    // While the head runs, a fan-out that may hand out reads past the key, and names it again
    // once it read the rest to its end.
    publish_all(&a, vec![event("u-2", "t")]).await;
    let report = a.fan_out(&subscriptions, 100, 10, at(T0 + 1)).await.unwrap();
    assert_eq!((ids(&report.claimed), report.events), (vec!["u-2/h".to_string()], 1));
    assert!(a.hints().unfanned_may_wait("k"));
    // Once the head settled, the key's next event is handed out. The key is read apart, up to
    // its next event: its left-out events, the oldest of all, never fill a batch (of two here)
    // and hold back younger events.
    assert_eq!(a.complete_many(&[head], at(T0 + 2)).await.unwrap(), [Settlement::Completed]);
    publish_all(&a, vec![event("u-3", "t")]).await;
    let report = a.fan_out(&subscriptions, 2, 10, at(T0 + 3)).await.unwrap();
    let mut claimed = ids(&report.claimed);
    claimed.sort();
    assert_eq!(claimed, ["k-2/h", "u-3/h"]);
    assert_eq!(report.events, 2);
    assert!(a.hints().unfanned_may_wait("k"));
    // A batch of nothing but that key's events is kept whole: the one after its head is
    // created parked behind it, for a claim.
    publish_all(&a, vec![keyed("k-4", "t", "k")]).await;
    assert_eq!(a.complete_many(&[report.claimed.iter().find(|c| c.event.id == "k-2").unwrap().lease], at(T0 + 4)).await.unwrap(), [Settlement::Completed]);
    let report = a.fan_out(&subscriptions, 100, 10, at(T0 + 5)).await.unwrap();
    assert_eq!(ids(&report.claimed), ["k-3/h"]);
    assert_eq!((report.events, report.deliveries), (2, 2));
    assert!(a.hints().followers_may_wait("h", "k"));
    assert_eq!(a.complete_many(&[report.claimed[0].lease], at(T0 + 6)).await.unwrap(), [Settlement::Completed]);
    assert_eq!(ids(&a.claim(&handlers(&["h"]), 10, at(T0 + 7)).await.unwrap()), ["k-4/h"]);
}

/// A key whose deliveries a fan-out left to claims is awaited: its completions ask for a
/// claim in its lane. Once a fan-out hands its head out (nothing of it pending), it is awaited
/// no more, so its later completions ask for no claim that would find nothing; a fan-out that
/// leaves some of it to claims again notes it again.
async fn a_key_that_waited_for_claims_once_is_awaited_no_more_once_its_head_is_handed_out<F: Fixture>() {
    let fixture = F::new().await;
    let a = fixture.worker("a");
    let subscriptions = subs(&[("h", &["t"])]);
    // With no room to hand out, the key's first event is left to claims.
    publish_all(&a, vec![keyed("k-1", "t", "k")]).await;
    let report = a.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap();
    assert_eq!((report.deliveries, report.claimed.len()), (1, 0));
    assert!(a.hints().followers_may_wait("h", "k"));
    let claimed = a.claim(&handlers(&["h"]), 10, at(T0 + 1)).await.unwrap();
    assert_eq!(ids(&claimed), ["k-1/h"]);
    assert_eq!(a.complete_many(&[claimed[0].lease], at(T0 + 2)).await.unwrap(), [Settlement::Completed]);
    // Its next event finds it idle and is handed out: the key is awaited no more.
    publish_all(&a, vec![keyed("k-2", "t", "k")]).await;
    let report = a.fan_out(&subscriptions, 100, 10, at(T0 + 3)).await.unwrap();
    assert_eq!(ids(&report.claimed), ["k-2/h"]);
    assert!(!a.hints().followers_may_wait("h", "k"), "a key handed out with nothing pending waits for no claim");
    // A fan-out that hands out its head and leaves its follower to claims notes it again.
    assert_eq!(a.complete_many(&[report.claimed[0].lease], at(T0 + 4)).await.unwrap(), [Settlement::Completed]);
    publish_all(&a, vec![keyed("k-3", "t", "k"), keyed("k-4", "t", "k")]).await;
    let report = a.fan_out(&subscriptions, 100, 10, at(T0 + 5)).await.unwrap();
    assert_eq!((ids(&report.claimed), report.deliveries), (vec!["k-3/h".to_string()], 2));
    assert!(a.hints().followers_may_wait("h", "k"), "its follower waits for a claim");
}

async fn a_key_read_apart_that_a_new_split_gave_another_host_is_left_to_it<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    // Alone, a hands out the heads of twenty keys and leaves their second events unfanned,
    // noted to be read apart.
    assert_eq!(a.announce(at(T0)).await.unwrap(), 1);
    let mut events: Vec<NewEvent> = (0..20).flat_map(|k| [1, 2].map(|n| keyed(&format!("k{k}-{n}"), "t", &format!("key-{k}")))).collect();
    events.push(event("u", "t"));
    let events = events.into_iter().map(|event| event.with_created_at(common::at(T0))).collect();
    publish_all(&a, events).await;
    let report = a.fan_out(&subscriptions, 100, 100, at(T0 + 1)).await.unwrap();
    assert_eq!((report.events, report.claimed.len()), (21, 21));
    let leases: Vec<_> = report.claimed.iter().map(|c| c.lease).collect();
    a.complete_many(&leases, at(T0 + 1)).await.unwrap();
    // Then b comes: the keys of its share are its to fan out, though a noted them.
    assert_eq!(b.announce(at(T0 + 2)).await.unwrap(), 2);
    assert_eq!(a.announce(at(T0 + 2)).await.unwrap(), 2);
    let by_a = a.fan_out(&subscriptions, 100, 100, at(T0 + 3)).await.unwrap().events;
    let by_b = b.fan_out(&subscriptions, 100, 0, at(T0 + 3)).await.unwrap().events;
    assert!(by_b > 0, "b's keys were left to b ({by_a} fanned out by a)");
    assert_eq!(by_a + by_b, 20);
}

/// Alone, `a` runs sixty events, one in each of their lanes; then `b` joins, and its share of
/// 200 new events gets documents in their lanes (due at `b_fans_out_at`), some of which `a`
/// holds. Returns what `a` runs, `b`'s fan-out, and those lanes.
async fn a_joiners_lanes_held<S: Store>(
    store: &S,
    a: &S,
    b: &S,
    b_fans_out_at: i64,
) -> (Vec<relayhost::store::ClaimedDelivery>, relayhost::store::FanOutReport, BTreeSet<relayhost::lane::LaneId>) {
    let subscriptions = subs(&[("h", &["t"])]);
    assert_eq!(a.announce(at(T0)).await.unwrap(), 1);
    let events = |prefix: &str, count: usize, created: i64| -> Vec<NewEvent> {
        (0..count).map(|n| event(&format!("{prefix}-{n}"), "t").with_created_at(common::at(created))).collect()
    };
    publish_all(store, events("first", 60, T0)).await;
    a.fan_out(&subscriptions, 1_000, 0, at(T0 + 1)).await.unwrap();
    let running = a.claim(&handlers(&["h"]), 1_000, at(T0 + 2)).await.unwrap();
    assert_eq!(running.len(), 60);
    let held: BTreeSet<_> = running.iter().map(|c| c.lease.lane).collect();
    announce_both(a, b, T0 + 3).await;
    publish_all(store, events("second", 200, T0 + 3)).await;
    let by_b = b.fan_out(&subscriptions, 1_000, 0, at(b_fans_out_at)).await.unwrap();
    let theirs: BTreeSet<_> = by_b.lanes.intersection(&held).copied().collect();
    assert!(!theirs.is_empty(), "some of b's lanes are held by a: {held:?} {:?}", by_b.lanes);
    (running, by_b, theirs)
}

/// A lane that a new split gives another host (it joined) while this one holds it takes no new
/// work from this one (nor its hand-outs) but what waited past stale, as a free lane of that
/// host's would not: it runs empty, goes back at this one's next claim, and the other host
/// takes it there. Kept, it took that host's deliveries and kept it from handing out its own
/// (a drain that a second host joined wrote 5.3 documents per delivery).
async fn a_held_lane_a_new_split_gave_another_host_takes_no_new_work_and_goes_back_to_it<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    let h = handlers(&["h"]);
    let (running, by_b, theirs) = a_joiners_lanes_held(fixture.store(), &a, &b, T0 + 4).await;
    assert!(a.hints().holds_lanes_of_another_host() && !b.hints().holds_lanes_of_another_host());
    // a hands its share's out into lanes it holds of its own share, or takes free ones.
    let by_a = a.fan_out(&subscriptions, 1_000, 1_000, at(T0 + 4)).await.unwrap();
    assert_eq!(by_a.events + by_b.events, 200);
    assert!(!by_a.claimed.is_empty());
    assert!(by_a.claimed.iter().all(|c| !by_b.lanes.contains(&c.lease.lane)), "a handed out into b's lanes");
    // Its claim takes what is left of its own share's work, none in the lanes it holds of b's.
    let claimed = a.claim(&h, 1_000, at(T0 + 5)).await.unwrap();
    assert_eq!(claimed.len() + by_a.claimed.len(), by_a.deliveries);
    assert!(claimed.iter().all(|c| !theirs.contains(&c.lease.lane)), "a took new work in b's lanes");
    // Its runs there end; its next claim hands those lanes back, and b's claims take every
    // delivery of its share.
    let leases: Vec<_> = running.iter().chain(&by_a.claimed).chain(&claimed).map(|c| c.lease).collect();
    a.complete_many(&leases, at(T0 + 6)).await.unwrap();
    assert!(a.hints().holds_lanes_of_another_host(), "until its next claim");
    assert!(a.claim(&h, 1_000, at(T0 + 7)).await.unwrap().is_empty());
    assert!(!a.hints().holds_lanes_of_another_host());
    let by_b_claimed = claim_until_none_is_left(&b, &h, T0 + 8).await;
    assert_eq!(by_b_claimed.len(), by_b.deliveries, "b claims its share, in the lanes a gave back too");
    assert!(theirs.iter().all(|lane| by_b_claimed.iter().any(|c| c.lease.lane == *lane)));
}

/// What waited past stale (twice the lease) in a lane of another host's share that this one
/// holds is still this one's to take, as in that host's free lanes: a lane its holder keeps
/// with a long run never strands the rest of its work.
async fn a_held_lane_of_another_hosts_share_still_gives_its_holder_what_waited_past_stale<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    // b's share, due long ago (its fan-out's time): waited past stale by a's claim below.
    let (_, _, theirs) = a_joiners_lanes_held(fixture.store(), &a, &b, T0 - 100_000).await;
    let claimed = a.claim(&handlers(&["h"]), 1_000, at(T0 + 4)).await.unwrap();
    let taken: BTreeSet<_> = claimed.iter().map(|c| c.lease.lane).filter(|lane| theirs.contains(lane)).collect();
    assert_eq!(taken, theirs, "a took what waited past stale in the lanes it holds of b's");
}

/// A look at the live hosts (between announcements) takes the share among them as an
/// announcement does, and announces nothing itself.
async fn a_look_takes_the_share_among_the_live_hosts_and_announces_nothing<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b, c) = (fixture.worker("a"), fixture.worker("b"), fixture.worker("c"));
    let subscriptions = subs(&[("h", &["t"])]);
    assert_eq!(a.announce(at(T0)).await.unwrap(), 1);
    assert_eq!(b.announce(at(T0)).await.unwrap(), 2);
    // a learns of b by looking: its fan-out leaves b's share to b.
    assert_eq!(a.look(at(T0 + 1)).await.unwrap(), 2);
    let events = (0..100).map(|n| event(&format!("e-{n}"), "t").with_created_at(common::at(T0 + 1))).collect();
    publish_all(fixture.store(), events).await;
    let by_a = a.fan_out(&subscriptions, 1_000, 0, at(T0 + 2)).await.unwrap();
    assert!(by_a.events > 0 && by_a.events < 100, "a's share only: {}", by_a.events);
    // c only looked: it is not among the live hosts.
    assert_eq!(c.look(at(T0 + 2)).await.unwrap(), 2);
    assert_eq!(b.look(at(T0 + 2)).await.unwrap(), 2);
}

async fn a_keys_head_handed_out_without_a_document_holds_its_key_and_leads_it_after_a_takeover<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    // Two keys' heads handed out, without documents.
    publish_all(&a, vec![keyed("k-1", "t", "k"), keyed("j-1", "t", "j")]).await;
    let report = a.fan_out(&subscriptions, 100, 10, at(T0)).await.unwrap();
    let mut heads = ids(&report.claimed);
    heads.sort();
    assert_eq!(heads, ["j-1/h", "k-1/h"]);
    let statistics = a.statistics(at(T0)).await.unwrap();
    assert_eq!((statistics[0].pending, statistics[0].parked), (0, 0), "{statistics:?}");
    // Nothing of either key is pending in the store, yet their next events are not handed out
    // beside their heads, which run on this instance: a fan-out that may hand out leaves them
    // unfanned, and the heads' completions are to ask for a fan-out.
    publish_all(&a, vec![keyed("k-2", "t", "k"), keyed("j-2", "t", "j")]).await;
    let report = a.fan_out(&subscriptions, 100, 10, at(T0 + 1)).await.unwrap();
    assert_eq!((report.events, report.claimed.len()), (0, 0));
    assert!(a.hints().unfanned_may_wait("k") && a.hints().unfanned_may_wait("j"));
    // One that hands nothing out creates them, for a claim: their completions are to ask for
    // one. The heads run: a claim takes nothing (and parks them).
    assert_eq!(a.fan_out(&subscriptions, 100, 0, at(T0 + 1)).await.unwrap().deliveries, 2);
    assert!(a.hints().followers_may_wait("h", "k") && a.hints().followers_may_wait("h", "j"));
    assert!(a.claim(&handlers(&["h"]), 10, at(T0 + 2)).await.unwrap().is_empty(), "both keys run");

    // Another instance's claim meanwhile unparks "k"'s follower (its predecessor has no
    // document) and learns it as the key's head.
    assert!(b.claim(&handlers(&["h"]), 10, at(T0 + 3)).await.unwrap().is_empty());
    // The first instance dies: its heads get their documents, charged, and lead their keys at
    // the instance that takes their lanes over.
    let late = T0 + 31_000;
    let taken = b.claim(&handlers(&["h"]), 10, at(late)).await.unwrap();
    let mut taken_ids = ids(&taken);
    taken_ids.sort();
    assert_eq!(taken_ids, ["j-1/h", "k-1/h"]);
    assert!(taken.iter().all(|c| c.attempts == 1), "charged: they were running");
    let leases: Vec<_> = taken.iter().map(|c| c.lease).collect();
    assert_eq!(b.complete_many(&leases, at(late + 1)).await.unwrap(), [Settlement::Completed; 2]);
    let mut next = ids(&b.claim(&handlers(&["h"]), 10, at(late + 2)).await.unwrap());
    next.sort();
    assert_eq!(next, ["j-2/h", "k-2/h"]);
}

/// Two hosts fan the same backlog out at once, each handing out whole batches listed in the
/// lanes it holds before it marks them (MongoDB: without a transaction): of two marks of an
/// event exactly one applies, each host runs only what it marked, and every event runs once.
async fn racing_plain_marks_of_one_backlog_run_every_event_once<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    hold_lanes(&a, &subscriptions, "a", &[3, 7, 11, 13]).await;
    hold_lanes(&b, &subscriptions, "b", &[20, 30, 40, 50]).await;
    let backlog: Vec<String> = (0..600).map(|n| format!("backlog-{n:03}")).collect();
    publish_all(&a, backlog.iter().map(|id| event(id, "t")).collect()).await;

    // Each on a thread of its own, so that their fan-outs interleave in either store.
    let start = Arc::new(tokio::sync::Barrier::new(2));
    let drain = |store: Arc<F::S>, subscriptions: relayhost::store::Subscriptions, start: Arc<tokio::sync::Barrier>| async move {
        start.wait().await;
        let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
        let (mut ran, mut listed_first) = (Vec::new(), 0);
        loop {
            // Small batches, so that the two hosts' reads and marks interleave often.
            let report = store.fan_out_early(&subscriptions, 20, 20, &early, at(T0 + 1_000)).await.unwrap();
            let mut leases: Vec<_> = report.claimed.iter().map(|c| c.lease).collect();
            ran.extend(report.claimed.iter().map(|c| c.event.id.clone()));
            // A whole batch listed first and marked after is all sent early, with word that its
            // fan-out is done.
            listed_first += usize::from(report.sent_early > 0 && report.claimed.is_empty() && report.lanes.is_empty());
            while let Ok(handed) = sent.try_recv() {
                for claimed in handed {
                    assert!(claimed.before_commit.clone().expect("sent early with its word").committed().await);
                    ran.push(claimed.event.id.clone());
                    leases.push(claimed.lease);
                }
            }
            assert!(store.complete_many(&leases, at(T0 + 1_000)).await.unwrap().iter().all(|s| *s == Settlement::Completed));
            if report.events == 0 {
                return (ran, listed_first);
            }
        }
    };
    let (a, b) = (Arc::new(a), Arc::new(b));
    let by_a = tokio::spawn(drain(a.clone(), subscriptions.clone(), start.clone()));
    let by_b = tokio::spawn(drain(b.clone(), subscriptions.clone(), start));
    let ((by_a, whole_a), (by_b, whole_b)) = (by_a.await.unwrap(), by_b.await.unwrap());
    assert!(whole_a + whole_b > 0, "whole batches were handed out");
    // What a host lost to the other's mark it left alone; what neither handed out has a
    // record, for a claim.
    let mut claimed = Vec::new();
    for store in [&*a, &*b] {
        loop {
            let more = store.claim(&handlers(&["h"]), 200, at(T0 + 2_000)).await.unwrap();
            if more.is_empty() {
                break;
            }
            claimed.extend(more.iter().map(|c| c.event.id.clone()));
            let leases: Vec<_> = more.iter().map(|c| c.lease).collect();
            store.complete_many(&leases, at(T0 + 2_000)).await.unwrap();
        }
    }
    let mut ran: Vec<String> = by_a.iter().chain(&by_b).chain(&claimed).cloned().collect();
    ran.sort();
    assert_eq!(ran, backlog, "every event ran once ({} by a, {} by b, {} claimed)", by_a.len(), by_b.len(), claimed.len());
}

async fn a_fan_out_that_may_hand_out_early_hands_out_each_once_with_word_of_its_commit<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    let free: Vec<String> = (0..2).map(|n| id_in_lane(&format!("free-{n}"), 20 + n)).collect();
    publish_all(&a, free.iter().map(|id| event(id, "t")).collect()).await;
    let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
    let report = a.fan_out_early(&subscriptions, 100, 10, &early, at(T0)).await.unwrap();
    // Before its commit, with its word (MongoDB), or after it, in the report (memory): each
    // delivery once, and nothing left to a claim.
    let mut handed = report.claimed.clone();
    assert!(report.claimed.iter().all(|c| c.before_commit.is_none()), "handed out after the commit");
    while let Ok(claimed) = sent.try_recv() {
        for delivery in &claimed {
            assert!(delivery.before_commit.clone().expect("with its word").committed().await, "the fan-out committed");
        }
        handed.extend(claimed);
    }
    assert_eq!(report.claimed.len() + report.sent_early, 2);
    let mut expected: Vec<String> = free.iter().map(|id| format!("{id}/h")).collect();
    expected.sort();
    let mut got = ids(&handed);
    got.sort();
    assert_eq!(got, expected);
    assert!(report.lanes.is_empty());
    assert!(b.claim(&handlers(&["h"]), 10, at(T0 + 1)).await.unwrap().is_empty(), "they are a's");
    let leases: Vec<_> = handed.iter().map(|c| c.lease).collect();
    assert_eq!(a.complete_many(&leases, at(T0 + 2)).await.unwrap(), [Settlement::Completed; 2]);
}

async fn older_work_in_a_free_lane_goes_before_younger_work_of_a_held_lane<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    let held: Vec<String> = (0..15).map(|n| id_in_lane(&format!("held-{n}"), 5)).collect();
    let waiting = id_in_lane("waiting", 200);
    publish_all(store, held[..5].iter().map(|id| event(id, "t")).collect()).await;
    fan_out_all(store, &subscriptions, at(T0)).await;
    let first = store.claim(&handlers(&["h"]), 5, at(T0)).await.unwrap();
    assert_eq!(first.iter().map(|c| c.lease.lane).collect::<Vec<_>>(), [5; 5]);
    // Then one event in another lane, then a new backlog in the lane the store holds.
    publish_all(store, vec![event(&waiting, "t")]).await;
    fan_out_all(store, &subscriptions, at(T0 + 1)).await;
    publish_all(store, held[5..].iter().map(|id| event(id, "t")).collect()).await;
    fan_out_all(store, &subscriptions, at(T0 + 2)).await;
    let leases: Vec<_> = first.iter().map(|c| c.lease).collect();
    store.complete_many(&leases, at(T0 + 3)).await.unwrap();
    // Lane 5 alone could fill the next claim, but with younger work than lane 200 waits with.
    let next = store.claim(&handlers(&["h"]), 5, at(T0 + 4)).await.unwrap();
    assert_eq!(next.len(), 5);
    assert!(ids(&next).contains(&format!("{waiting}/h")), "the oldest due delivery is claimed: {:?}", ids(&next));
}

async fn held_lanes_past_the_first_group_are_not_starved_by_younger_work_of_the_first<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    // One delivery running in each of 201 lanes: the store holds more lanes than a claim reads
    // in one query (`MAX_LANES_PER_QUERY`, in lane order).
    let running: Vec<String> = (0..=200).map(|lane| id_in_lane("running", lane)).collect();
    publish_all(store, running.iter().map(|id| event(id, "t")).collect()).await;
    fan_out_all(store, &subscriptions, at(T0)).await;
    let mut claimed = Vec::new();
    for _ in 0..10 {
        claimed.extend(store.claim(&handlers(&["h"]), running.len() - claimed.len(), at(T0)).await.unwrap());
        if claimed.len() == running.len() {
            break;
        }
    }
    assert_eq!(claimed.len(), running.len());
    let publish_at = async |id: &str, time: i64| {
        publish_all(store, vec![event(id, "t")]).await;
        fan_out_all(store, &subscriptions, at(time)).await;
    };
    let claim_one_at = async |time: i64| ids(&store.claim(&handlers(&["h"]), 1, at(time)).await.unwrap());
    // An older delivery in the highest of those lanes and a younger one in a low one: the
    // first group's younger work fills the claim, and the older work goes first all the same.
    let (older, younger) = (id_in_lane("older", 200), id_in_lane("younger", 3));
    publish_at(&older, T0 + 1).await;
    publish_at(&younger, T0 + 2).await;
    assert_eq!(claim_one_at(T0 + 3).await, [format!("{older}/h")], "the oldest due delivery of the held lanes goes first, whichever lane");
    // Then a steady stream into the first group: its work may go first for a moment (the look
    // past it is taken at most once a second), never for longer.
    let older_again = id_in_lane("older-again", 199);
    publish_at(&older_again, T0 + 4).await;
    for (n, lane) in [4, 5].into_iter().enumerate() {
        publish_at(&id_in_lane(&format!("younger-{n}"), lane), T0 + 5 + n as i64).await;
    }
    let mut next = claim_one_at(T0 + 10).await;
    next.extend(claim_one_at(T0 + 11).await);
    next.extend(claim_one_at(T0 + 1_003).await);
    assert!(next.contains(&format!("{older_again}/h")), "the later lanes' older work waits a second at most: {next:?}");
}

async fn lanes_are_held_per_store_instance<F: Fixture>() {
    let fixture = F::new().await;
    // Two instances with the same owner name, like a restarted process with a fixed name.
    let (before, after) = (fixture.worker("fixed-name"), fixture.worker("fixed-name"));
    let first = id_in_lane("p", 4);
    let second = id_in_lane(&format!("{first}-q"), 4);
    publish_all(fixture.store(), vec![event(&first, "t"), event(&second, "t")]).await;
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    assert_eq!(before.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap().len(), 1);
    // The new instance does not adopt the lane of its namesake...
    assert!(after.claim(&handlers(&["h"]), 10, at(T0 + 1)).await.unwrap().is_empty());
    // ...it takes it over once the lease expired, like any other worker.
    let late = T0 + 31_000;
    let taken = after.claim(&handlers(&["h"]), 10, at(late)).await.unwrap();
    assert_eq!(taken.len(), 2);
}

async fn relinquish_hands_lanes_back_at_once<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let first = id_in_lane("r", 200);
    let second = id_in_lane(&format!("{first}-s"), 200);
    publish_all(fixture.store(), vec![event(&first, "t"), event(&second, "t")]).await;
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = a.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap();
    assert_eq!(a.release(&[claimed[0].lease], at(T0)).await.unwrap(), 1);
    a.relinquish().await.unwrap();
    let taken = b.claim(&handlers(&["h"]), 10, at(T0 + 1)).await.unwrap();
    assert_eq!(taken.len(), 2);
    // A release charges no attempt.
    assert!(taken.iter().all(|c| c.attempts == 0));
}

async fn a_stale_lease_changes_nothing<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    publish(fixture.store(), event("e-1", "t")).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    let stale = a.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap().remove(0);
    // a stops renewing; b takes the lane over after the lease expired.
    let taken = b.claim(&handlers(&["h"]), 1, at(T0 + 31_000)).await.unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].attempts, 1, "the lost attempt is charged");
    assert_ne!(taken[0].lease, stale.lease);
    let now = at(T0 + 32_000);
    assert_eq!(a.complete_many(&[stale.lease], now).await.unwrap(), [Settlement::LeaseLost]);
    assert_eq!(a.reschedule(&stale.lease, now, "x", now).await.unwrap(), Settlement::LeaseLost);
    assert_eq!(a.bury(&stale.lease, "x", true, now).await.unwrap(), Settlement::LeaseLost);
    assert_eq!(a.release(&[stale.lease], now).await.unwrap(), 0);
    assert_eq!(a.extend_lease(&[stale.lease], now).await.unwrap(), [false]);
    // A lease this worker never issued is refused without touching anything.
    assert_eq!(a.complete_many(&[taken[0].lease], now).await.unwrap(), [Settlement::LeaseLost]);
    // b's claim is intact.
    assert_eq!(b.complete_many(&[taken[0].lease], now).await.unwrap(), [Settlement::Completed]);
}

async fn a_lane_taken_over_gives_its_old_holder_nothing<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let lane = relayhost::lane::lane_for_event("e-1", None);
    let neighbour = (0..)
        .map(|n| format!("x-{n}"))
        .find(|id| relayhost::lane::lane_for_event(id, None) == lane)
        .expect("some id shares the lane");
    publish(fixture.store(), event("e-1", "t")).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    assert_eq!(a.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap().len(), 1);
    // a stops renewing; b takes the lane over, and new work arrives in it.
    assert_eq!(b.claim(&handlers(&["h"]), 1, at(T0 + 31_000)).await.unwrap().len(), 1);
    publish(fixture.store(), event(&neighbour, "t")).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0 + 31_001)).await;
    // a still counts the lane among its own: its claim finds the new work there, but the
    // record, conditional on the epoch a held it under, is refused, so a takes nothing from
    // it, while b's next claim does.
    assert!(a.claim(&handlers(&["h"]), 10, at(T0 + 31_002)).await.unwrap().is_empty());
    let next = b.claim(&handlers(&["h"]), 10, at(T0 + 31_003)).await.unwrap();
    assert_eq!(ids(&next), [format!("{neighbour}/h")]);
}

async fn a_head_another_instance_settled_does_not_hold_back_its_key<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let h = handlers(&["h"]);
    let (ka, kb) = keys_in_two_lanes();
    publish(fixture.store(), keyed("ka-1", "t", &ka)).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    // (Fanned out apart: a fan-out creates the followers of a key in its batch parked, and
    // this is about a ready one.)
    publish(fixture.store(), keyed("kb-1", "t", &kb)).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0 + 1)).await;
    publish(fixture.store(), keyed("kb-2", "t", &kb)).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0 + 1)).await;
    // a looks up the heads of both keys but has room for one delivery only: kb-1 stays, and
    // kb's lane, where a runs nothing, goes back.
    assert_eq!(ids(&a.claim(&h, 1, at(T0 + 2)).await.unwrap()), ["ka-1/h"]);
    // b runs and completes kb-1, then hands the lane back (its next claim is for another
    // handler, so nothing of kb's lane runs or is picked).
    let kb1 = b.claim(&h, 1, at(T0 + 3)).await.unwrap();
    assert_eq!(ids(&kb1), ["kb-1/h"]);
    b.complete_many(&[kb1[0].lease], at(T0 + 4)).await.unwrap();
    assert!(b.claim(&handlers(&["other"]), 10, at(T0 + 5)).await.unwrap().is_empty());
    // a still knows kb-1 as kb's head; kb-2 is the head now, and a runs it.
    assert_eq!(ids(&a.claim(&h, 10, at(T0 + 6)).await.unwrap()), ["kb-2/h"]);
}

async fn what_a_stale_holder_sees_blocked_in_a_lane_it_lost_is_not_parked<F: Fixture>() {
    // Leases shorter than the 2 s a claimer trusts its own unsettled leases: a takeover can
    // happen while a still counts its delivery as running.
    let fixture = F::with_options(StoreOptions { lease_duration: Duration::from_secs(1), ..options() }).await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let h = handlers(&["h"]);
    publish(fixture.store(), keyed("k-1", "t", "k")).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    assert_eq!(ids(&a.claim(&h, 10, at(T0)).await.unwrap()), ["k-1/h"]);
    // a's lease runs out; b takes the lane over, runs k-1 to the end and hands the lane back
    // (its next claim is for another handler).
    let taken = b.claim(&h, 10, at(T0 + 1_100)).await.unwrap();
    assert_eq!(ids(&taken), ["k-1/h"]);
    b.complete_many(&[taken[0].lease], at(T0 + 1_100)).await.unwrap();
    assert!(b.claim(&handlers(&["other"]), 10, at(T0 + 1_150)).await.unwrap().is_empty());
    publish(fixture.store(), keyed("k-2", "t", "k")).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0 + 1_200)).await;
    // a still takes k-1 for running, so k-2 looks blocked to it; but the lane is no longer
    // a's (its record is refused), and k-2, the key's head, must stay ready for the next claim.
    assert!(a.claim(&h, 10, at(T0 + 1_300)).await.unwrap().is_empty());
    assert_eq!(ids(&b.claim(&h, 10, at(T0 + 1_400)).await.unwrap()), ["k-2/h"]);
}

async fn an_expired_lease_nobody_took_is_still_honoured<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish(store, event("e-1", "t")).await.unwrap();
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = store.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap().remove(0);
    let late = at(T0 + 120_000);
    assert_eq!(store.complete_many(&[claimed.lease], late).await.unwrap(), [Settlement::Completed]);
}

async fn takeover_charges_the_lost_attempt_once<F: Fixture>() {
    let fixture = F::new().await;
    publish(fixture.store(), event("e-1", "t")).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    let mut now = T0;
    // Five workers in a row die holding it; each successor charges exactly one attempt.
    for round in 1..=5_u32 {
        let worker = fixture.worker(&format!("w{round}"));
        let claimed = worker.claim(&handlers(&["h"]), 1, at(now)).await.unwrap();
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].attempts, round - 1);
        now += 31_000;
    }
}

async fn reschedule_release_and_bury<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, vec![event("r", "t"), event("l", "t"), event("b", "t")]).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    let by_id: HashMap<String, _> = claimed.iter().map(|c| (c.event.id.clone(), c.lease)).collect();
    assert_eq!(store.reschedule(&by_id["r"], at(T0 + 5_000), "503 from upstream", at(T0)).await.unwrap(), Settlement::Completed);
    assert_eq!(store.release(&[by_id["l"]], at(T0)).await.unwrap(), 1);
    assert_eq!(store.bury(&by_id["b"], "unprocessable: no such customer", true, at(T0)).await.unwrap(), Settlement::Completed);

    // The released one is due at once with no attempt charged; the retry waits.
    let again = store.claim(&handlers(&["h"]), 10, at(T0 + 1)).await.unwrap();
    assert_eq!(ids(&again), ["l/h"]);
    assert_eq!(again[0].attempts, 0);
    let later = store.claim(&handlers(&["h"]), 10, at(T0 + 5_000)).await.unwrap();
    assert_eq!(ids(&later), ["r/h"]);
    assert_eq!(later[0].attempts, 1);
    let dead = dead(store).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event_id, "b");
    assert_eq!(dead[0].attempts, 1);
    assert_eq!(dead[0].last_error.as_deref(), Some("unprocessable: no such customer"));
    let pending = list_all(store, DeliveryFilter { event_id: Some("r".into()), ..Default::default() }).await;
    assert_eq!(pending[0].last_error.as_deref(), Some("503 from upstream"));
}

async fn a_transactional_handlers_hand_out_keeps_its_document_while_other_handlers_share_its_event<F: Fixture>() {
    // Without a document, a delivery's completion is its event's `handedOut`. A transactional
    // handler completes in a transaction as long as its run, where that write would conflict
    // with another handler's completion of the same event (and run the handler again): so
    // such a hand-out keeps its document, and only such a one.
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, vec![event("shared", "t"), event("alone", "solo")]).await;
    let subscriptions = Subscriptions::new([
        Subscription::new("audit", ["t", "solo"]).completing_in_transaction(true),
        Subscription::new("mail", ["t"]),
    ])
    .unwrap();
    let report = store.fan_out(&subscriptions, 100, 10, at(T0)).await.unwrap();
    assert_eq!(report.claimed.len(), 3);
    let listed = store.list_deliveries(&DeliveryFilter::default()).await.unwrap().deliveries;
    let listed: Vec<(&str, &str)> = listed.iter().map(|d| (d.event_id.as_str(), d.handler.as_str())).collect();
    assert_eq!(listed, [("shared", "audit")], "only the transactional handler's delivery of the shared event has a document");
    let lease = |event: &str, handler: &str| report.claimed.iter().find(|c| c.event.id == event && c.handler == handler).unwrap().lease;

    // Each completes as its handler does (`mongo_store`
    // `a_transactional_hand_out_never_conflicts_with_another_handlers_completion_of_its_event`
    // completes them at once).
    assert_eq!(store.complete_many(&[lease("shared", "mail")], at(T0 + 1)).await.unwrap(), [Settlement::Completed]);
    for (event, now) in [("shared", T0 + 2), ("alone", T0 + 3)] {
        run_in_transaction(store, async |tx| store.complete_in(tx, &lease(event, "audit"), at(now)).await).await.unwrap();
    }
    assert!(store.list_deliveries(&DeliveryFilter::default()).await.unwrap().deliveries.is_empty());
    assert!(store.claim(&handlers(&["audit", "mail"]), 10, at(T0 + 100_000)).await.unwrap().is_empty(), "each ran once");
}

async fn handed_out_deliveries_settle_and_are_taken_over_like_claimed_ones<F: Fixture>() {
    // Neither store writes a delivery record for what a fan-out hands out, until an outcome
    // other than a completion, or a takeover, needs one (then it gets the id its lease names).
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let names = ["done", "retry", "back", "dead", "lost"];
    let events: Vec<String> = names.iter().zip(40..).map(|(name, lane)| id_in_lane(name, lane)).collect();
    publish_all(&a, events.iter().map(|id| event(id, "t")).collect()).await;
    let report = a.fan_out(&subs(&[("h", &["t"])]), 100, 10, at(T0)).await.unwrap();
    assert_eq!(report.claimed.len(), 5);
    let lease = |name: &str| {
        let id = &events[names.iter().position(|n| *n == name).unwrap()];
        report.claimed.iter().find(|c| &c.event.id == id).unwrap().lease
    };
    assert!(a.list_deliveries(&DeliveryFilter::default()).await.unwrap().deliveries.is_empty(), "handed out without records");
    // While they run they are counted as running, and a purge keeps their events.
    let stats = a.statistics(at(T0)).await.unwrap();
    let h = stats.iter().find(|s| s.handler == "h").unwrap();
    assert_eq!((h.pending, h.running, h.dead), (0, 5, 0));
    let far = PurgeOptions { dead_before: Some(at(T0 + 10_000_000)), completed_before: Some(at(T0 + 10_000_000)) };
    assert_eq!(a.purge(&far, at(T0)).await.unwrap().events, 0);

    assert_eq!(a.complete_many(&[lease("done")], at(T0 + 1)).await.unwrap(), [Settlement::Completed]);
    assert_eq!(a.reschedule(&lease("retry"), at(T0 + 5_000), "503 from upstream", at(T0 + 1)).await.unwrap(), Settlement::Completed);
    assert_eq!(a.release(&[lease("back")], at(T0 + 1)).await.unwrap(), 1);
    assert_eq!(a.bury(&lease("dead"), "unprocessable", true, at(T0 + 1)).await.unwrap(), Settlement::Completed);
    // Each outcome counts once: settled leases change nothing again.
    assert_eq!(a.complete_many(&[lease("done"), lease("retry")], at(T0 + 2)).await.unwrap(), [Settlement::LeaseLost; 2]);

    // The released one is due at once, uncharged; the retry when it is due, charged.
    let back = a.claim(&handlers(&["h"]), 10, at(T0 + 2)).await.unwrap();
    assert_eq!(ids(&back), [format!("{}/h", events[2])]);
    assert_eq!(back[0].attempts, 0);
    let retry = a.claim(&handlers(&["h"]), 10, at(T0 + 5_000)).await.unwrap();
    assert_eq!(ids(&retry), [format!("{}/h", events[1])]);
    assert_eq!(retry[0].attempts, 1);
    let settled: Vec<_> = back.iter().chain(&retry).map(|c| c.lease).collect();
    assert_eq!(a.complete_many(&settled, at(T0 + 5_001)).await.unwrap(), [Settlement::Completed; 2]);
    let dead = dead(&a).await;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].event_id.as_str(), dead[0].attempts), (events[3].as_str(), 1));
    assert_eq!(dead[0].last_error.as_deref(), Some("unprocessable"));

    // a stops renewing: b takes the lane of the one still running over once its lease ran
    // out, charging the lost attempt, and a's completion of it counts for nothing.
    let lost = b.claim(&handlers(&["h"]), 10, at(T0 + 40_000)).await.unwrap();
    assert_eq!(ids(&lost), [format!("{}/h", events[4])]);
    assert_eq!(lost[0].attempts, 1);
    assert_eq!(a.complete_many(&[lease("lost")], at(T0 + 40_001)).await.unwrap(), [Settlement::LeaseLost]);
    assert_eq!(b.complete_many(&[lost[0].lease], at(T0 + 40_002)).await.unwrap(), [Settlement::Completed]);
    assert!(b.claim(&handlers(&["h"]), 10, at(T0 + 100_000)).await.unwrap().is_empty());
    // Nothing runs any more: every event may go.
    assert_eq!(a.purge(&far, at(T0 + 100_000)).await.unwrap().events, 5);
}

async fn lane_lists_keep_event_ids_that_look_like_expressions<F: Fixture>() {
    // The MongoDB store writes the lists of the lanes a worker holds as values of an
    // expression: an id there that looked like a field path would name another event.
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let (first, second) = (id_in_lane("$inFlight", 40), id_in_lane("$$ROOT.x", 40));
    publish_all(&a, vec![event(&first, "t")]).await;
    assert_eq!(a.fan_out(&subs(&[("h", &["t"])]), 100, 10, at(T0)).await.unwrap().claimed.len(), 1);
    // The lane is held now: this hand-out rewrites its list with both.
    publish_all(&a, vec![event(&second, "t")]).await;
    assert_eq!(a.fan_out(&subs(&[("h", &["t"])]), 100, 10, at(T0 + 1)).await.unwrap().claimed.len(), 1);
    // a dies; b finds both in the list, as written, and charges each once.
    let mut lost = b.claim(&handlers(&["h"]), 10, at(T0 + 40_000)).await.unwrap();
    lost.sort_by_key(|c| c.event.id.clone());
    let mut expected = vec![format!("{first}/h"), format!("{second}/h")];
    expected.sort();
    assert_eq!(ids(&lost), expected);
    assert!(lost.iter().all(|c| c.attempts == 1));
    let leases: Vec<_> = lost.iter().map(|c| c.lease).collect();
    assert_eq!(b.complete_many(&leases, at(T0 + 40_001)).await.unwrap(), [Settlement::Completed; 2]);
}

async fn a_handed_out_delivery_its_holder_checks_later_stays_listed_for_a_takeover<F: Fixture>() {
    // A claim checks in the store whether a lease it issued over two seconds ago still runs;
    // one without a document (MongoDB) runs while its event lists it, and must stay listed.
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let subscriptions = subs(&[("h", &["t"])]);
    let (x, y) = (id_in_lane("x", 50), id_in_lane("y", 50));
    publish_all(&a, vec![event(&x, "t")]).await;
    assert_eq!(a.fan_out(&subscriptions, 100, 10, at(T0)).await.unwrap().claimed.len(), 1);
    // Later, a claims a new delivery in the same lane, rewriting its list.
    publish_all(&a, vec![event(&y, "t")]).await;
    a.fan_out(&subscriptions, 100, 0, at(T0 + 3_000)).await.unwrap();
    assert_eq!(ids(&a.claim(&handlers(&["h"]), 10, at(T0 + 3_000)).await.unwrap()), [format!("{y}/h")]);
    // a dies: b takes the lane over and charges both, the one without a document included.
    let taken = b.claim(&handlers(&["h"]), 10, at(T0 + 40_000)).await.unwrap();
    let mut expected = vec![format!("{x}/h"), format!("{y}/h")];
    expected.sort();
    assert_eq!(ids(&taken), expected);
    assert!(taken.iter().all(|c| c.attempts == 1), "{taken:?}");
}

async fn a_handed_out_delivery_is_buried_in_the_transaction_that_announces_it<F: Fixture>() {
    // As the dispatcher buries: the dead letter is written first, then the burial, in one
    // transaction. A delivery without a document (MongoDB) gets it in a transaction of its
    // own, which the caller's may have begun before.
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, vec![event("poison", "t")]).await;
    let report = store.fan_out(&subs(&[("h", &["t"])]), 100, 10, at(T0)).await.unwrap();
    let lease = report.claimed[0].lease;
    run_in_transaction(store, async |tx| {
        store.publish(tx, &event("announced", "t2")).await?;
        store.bury_in(tx, &lease, "unprocessable", true, at(T0 + 1)).await
    })
    .await
    .unwrap();
    assert!(fixture.raw_event("announced").await.is_some());
    let dead = dead(store).await;
    assert_eq!((dead.len(), dead[0].event_id.as_str(), dead[0].attempts), (1, "poison", 1));
}

async fn an_operator_buries_a_stuck_delivery_unless_its_lane_is_leased<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, (0..2).map(|n| keyed(&format!("e-{n}"), "t", "k")).collect()).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let head = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap().remove(0);
    let id = head.lease.delivery.to_hex();
    let bury = async |id: &str, now: i64| {
        let mut tx = store.begin().await.unwrap();
        let buried = store.bury_pending_in(&mut tx, id, "stuck", at(now)).await;
        if buried.is_ok() {
            tx.commit().await.unwrap();
        }
        buried
    };
    // Its lane is leased: it may be running, so it is left alone.
    assert!(matches!(bury(&id, T0 + 1).await, Err(StoreError::NotBuriable { .. })));
    // Retrying far in the future, it blocks its key with nobody holding the lane.
    store.reschedule(&head.lease, at(T0 + 3_600_000), "flaky", at(T0 + 1)).await.unwrap();
    store.relinquish().await.unwrap();
    assert!(store.claim(&handlers(&["h"]), 10, at(T0 + 2)).await.unwrap().is_empty(), "the key is stuck");
    store.relinquish().await.unwrap();
    let buried = bury(&id, T0 + 3).await.unwrap();
    assert_eq!((buried.event_id.as_str(), buried.attempts), ("e-0", 1));
    let dead = dead(store).await;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].attempts, dead[0].last_error.as_deref()), (1, Some("stuck")));
    // The key moves on, and the old lease is fenced.
    let next = store.claim(&handlers(&["h"]), 10, at(T0 + 4)).await.unwrap();
    assert_eq!(ids(&next), ["e-1/h"]);
    assert_eq!(store.complete_many(&[head.lease], at(T0 + 5)).await.unwrap(), [Settlement::LeaseLost]);
    assert!(matches!(bury(&id, T0 + 6).await, Err(StoreError::NotBuriable { .. })), "dead already");
    assert!(matches!(bury("{\"$gt\": \"\"}", T0 + 6).await, Err(StoreError::DeliveryNotFound(_))));
}

async fn requeue_brings_a_dead_delivery_back_before_its_followers<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, (0..3).map(|n| keyed(&format!("e-{n}"), "t", "k")).collect()).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let head = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap().remove(0);
    store.bury(&head.lease, "poison", true, at(T0)).await.unwrap();
    // A dead head no longer blocks its key.
    let next = store.claim(&handlers(&["h"]), 10, at(T0 + 1)).await.unwrap().remove(0);
    assert_eq!(next.event.sequence, Some(2));
    let dead_id = dead(store).await[0].id.clone();
    assert!(matches!(store.requeue(&next.lease.delivery.to_hex(), at(T0 + 2)).await, Err(StoreError::NotDead(_))));
    store.requeue(&dead_id, at(T0 + 2)).await.unwrap();
    // Sequence 2 runs, so the requeued one cannot start; sequence 3 waits behind it.
    assert!(store.claim(&handlers(&["h"]), 10, at(T0 + 3)).await.unwrap().is_empty());
    store.complete_many(&[next.lease], at(T0 + 3)).await.unwrap();
    let requeued = store.claim(&handlers(&["h"]), 10, at(T0 + 4)).await.unwrap();
    assert_eq!(requeued.len(), 1);
    assert_eq!(requeued[0].event.sequence, Some(1));
    assert_eq!(requeued[0].attempts, 0, "requeue resets the attempts");
    store.complete_many(&[requeued[0].lease], at(T0 + 4)).await.unwrap();
    let last = store.claim(&handlers(&["h"]), 10, at(T0 + 5)).await.unwrap();
    assert_eq!(last[0].event.sequence, Some(3));
}

async fn operator_inputs_never_become_query_operators<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish(store, event("e-1", "t")).await.unwrap();
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    for hostile in [r#"{"$ne": null}"#, "$where", "{ \"$gt\": \"\" }"] {
        let filter = DeliveryFilter {
            handler: Some(hostile.into()),
            event_id: Some(hostile.into()),
            ..Default::default()
        };
        assert!(store.list_deliveries(&filter).await.unwrap().deliveries.is_empty());
        let filter = DeliveryFilter { key: Some(hostile.into()), ..Default::default() };
        assert!(store.list_deliveries(&filter).await.unwrap().deliveries.is_empty());
        assert!(matches!(store.requeue(hostile, at(T0)).await, Err(StoreError::DeliveryNotFound(_))));
        let bad_cursor = DeliveryFilter { after: Some(hostile.into()), ..Default::default() };
        assert!(matches!(store.list_deliveries(&bad_cursor).await, Err(StoreError::InvalidArgument(_))));
    }
    assert_eq!(list_all(store, DeliveryFilter::default()).await.len(), 1);
}

async fn long_blocked_backlogs_are_parked_and_drain_in_order<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let followers = 40;
    publish_all(store, (0..=followers).map(|n| keyed(&format!("k-{n}"), "t", "hot")).collect()).await;
    publish_all(store, (0..5).map(|n| keyed(&format!("o-{n}"), "t", &format!("other-{n}"))).collect()).await;
    let subscriptions = subs(&[("h", &["t"])]);
    fan_out_all(store, &subscriptions, at(T0)).await;
    let head = store.claim(&handlers(&["h"]), 100, at(T0)).await.unwrap();
    assert_eq!(head.len(), 6, "the hot head and one of each other key");
    let stats = store.statistics(at(T0)).await.unwrap();
    assert_eq!(stats[0].parked as usize, followers, "followers behind a running head are parked");
    // Other keys keep flowing while the hot key is blocked.
    let others: Vec<_> = head.iter().filter(|c| c.event.key.as_deref() != Some("hot")).map(|c| c.lease).collect();
    store.complete_many(&others, at(T0)).await.unwrap();
    publish(store, keyed("o-late", "t", "other-late")).await.unwrap();
    fan_out_all(store, &subscriptions, at(T0 + 1)).await;
    let late = store.claim(&handlers(&["h"]), 100, at(T0 + 1)).await.unwrap();
    assert_eq!(ids(&late), ["o-late/h"]);
    store.complete_many(&[late[0].lease], at(T0 + 1)).await.unwrap();
    // The hot key drains one by one, in order, through unparking.
    let mut lease = head.iter().find(|c| c.event.key.as_deref() == Some("hot")).unwrap().lease;
    let mut order = vec![1];
    for step in 0..followers as i64 + 2 {
        store.complete_many(&[lease], at(T0 + 2 + step)).await.unwrap();
        let next = store.claim(&handlers(&["h"]), 100, at(T0 + 2 + step)).await.unwrap();
        if next.is_empty() {
            break;
        }
        assert_eq!(next.len(), 1);
        order.push(next[0].event.sequence.unwrap());
        lease = next[0].lease;
    }
    assert_eq!(order, (1..=followers as i64 + 1).collect::<Vec<_>>());
    assert!(store.statistics(at(T0 + 100)).await.unwrap().iter().all(|s| s.parked == 0 && s.pending == 0));
}

async fn followers_wait_parked_and_each_leads_as_soon_as_its_predecessor_settles<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, (1..=3).map(|n| keyed(&format!("k-{n}"), "t", "k")).collect()).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let parked = async |now: i64| store.statistics(at(now)).await.unwrap()[0].parked;
    let first = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap().remove(0);
    assert_eq!(first.event.sequence, Some(1));
    // Even two followers are moved out of the claims' way while their key is busy.
    assert_eq!(parked(T0).await, 2);
    // Each one leads, and runs, the moment the one before it settles.
    store.complete_many(&[first.lease], at(T0)).await.unwrap();
    let second = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap().remove(0);
    assert_eq!((second.event.sequence, parked(T0).await), (Some(2), 1));
    store.reschedule(&second.lease, at(T0 + 10_000), "flaky", at(T0)).await.unwrap();
    assert!(store.claim(&handlers(&["h"]), 10, at(T0 + 1)).await.unwrap().is_empty(), "a retrying head holds its key");
    let again = store.claim(&handlers(&["h"]), 10, at(T0 + 10_000)).await.unwrap().remove(0);
    assert_eq!((again.event.sequence, again.attempts), (Some(2), 1));
    let buried = store.bury(&again.lease, "unprocessable", true, at(T0 + 10_000)).await.unwrap();
    assert_eq!(buried, Settlement::Completed);
    let third = store.claim(&handlers(&["h"]), 10, at(T0 + 10_000)).await.unwrap();
    assert_eq!(third.iter().map(|c| c.event.sequence).collect::<Vec<_>>(), [Some(3)]);
    assert_eq!(parked(T0 + 10_000).await, 0);
}

async fn complete_many_settles_each_lease<F: Fixture>() {
    let fixture = F::with_options(StoreOptions { completion_history: true, ..options() }).await;
    let store = fixture.store();
    publish_all(store, (0..300).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = store.claim(&handlers(&["h"]), 300, at(T0)).await.unwrap();
    assert_eq!(claimed.len(), 300);
    let mut leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
    // One of them was settled already: it is reported lost, the others complete.
    store.release(&[leases[0]], at(T0)).await.unwrap();
    leases.push(leases[0]);
    let settled = store.complete_many(&leases, at(T0)).await.unwrap();
    assert_eq!(settled.len(), 301);
    assert_eq!(settled[0], Settlement::LeaseLost);
    assert!(settled[1..300].iter().all(|s| *s == Settlement::Completed));
    let stats = store.statistics(at(T0)).await.unwrap();
    assert_eq!((stats[0].pending, stats[0].completed), (1, Some(299)));
    let event = fixture.raw_event("e-7").await.unwrap();
    assert_eq!(event.get_datetime("completedAt").unwrap(), &at(T0));
}

async fn a_transactional_completion_frees_its_key_for_the_next_claim<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, (1..=3).map(|n| keyed(&format!("k-{n}"), "t", "k")).collect()).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let mut lease = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap().remove(0).lease;
    // An aborted completion leaves the key busy...
    let mut tx = store.begin().await.unwrap();
    store.complete_in(&mut tx, &lease, at(T0)).await.unwrap();
    tx.abort().await.unwrap();
    assert!(store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap().is_empty());
    // ...a committed one lets the key's next delivery go at once, claim after claim.
    for (step, sequence) in [(1, 2), (2, 3)] {
        run_in_transaction(store, async |tx| store.complete_in(tx, &lease, at(T0 + step)).await).await.unwrap();
        let next = store.claim(&handlers(&["h"]), 10, at(T0 + step)).await.unwrap();
        assert_eq!(next.iter().map(|c| c.event.sequence).collect::<Vec<_>>(), [Some(sequence)]);
        lease = next[0].lease;
    }
}

async fn transactional_completion_commits_with_the_callers_writes<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, vec![event("e-1", "t"), event("e-2", "t")]).await;
    fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    let (first, second) = (claimed[0].clone(), claimed[1].clone());

    // Abort: the follow-up event and the completion both vanish.
    let mut tx = store.begin().await.unwrap();
    store.publish(&mut tx, &event("follow-up-1", "t2")).await.unwrap();
    store.complete_in(&mut tx, &first.lease, at(T0)).await.unwrap();
    tx.abort().await.unwrap();
    assert!(fixture.raw_event("follow-up-1").await.is_none());
    // Commit: both happen.
    run_in_transaction(store, async |tx| {
        store.publish(tx, &event("follow-up-1", "t2")).await?;
        store.complete_in(tx, &first.lease, at(T0)).await
    })
    .await
    .unwrap();
    assert!(fixture.raw_event("follow-up-1").await.is_some());
    assert_eq!(store.complete_many(&[first.lease], at(T0)).await.unwrap(), [Settlement::LeaseLost]);

    // A takeover and a transactional completion never both succeed.
    let usurper = fixture.worker("usurper");
    let late = at(T0 + 31_000);
    let completion = run_in_transaction(store, async |tx| {
        store.publish(tx, &event("follow-up-2", "t2")).await?;
        store.complete_in(tx, &second.lease, late).await
    });
    let wanted = handlers(&["h"]);
    let takeover = usurper.claim(&wanted, 10, late);
    let (completion, takeover) = tokio::join!(completion, takeover);
    let took = takeover.unwrap();
    match completion {
        Ok(()) => {
            assert!(took.is_empty(), "completed and taken over");
            assert!(fixture.raw_event("follow-up-2").await.is_some());
        }
        Err(error) => {
            assert!(matches!(error, StoreError::LeaseLost(_)), "{error}");
            assert_eq!(took.len(), 1);
            assert_eq!(took[0].attempts, 1);
            assert!(fixture.raw_event("follow-up-2").await.is_none());
        }
    }
}

async fn extend_lease_renews_only_current_leases<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    publish(fixture.store(), event("e-1", "t")).await.unwrap();
    fan_out_all(fixture.store(), &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = a.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap().remove(0);
    // Renewed at +20 s, the lease lives until +50 s: b cannot take it at +40 s.
    assert_eq!(a.extend_lease(&[claimed.lease], at(T0 + 20_000)).await.unwrap(), [true]);
    assert!(b.claim(&handlers(&["h"]), 1, at(T0 + 40_000)).await.unwrap().is_empty());
    let taken = b.claim(&handlers(&["h"]), 1, at(T0 + 51_000)).await.unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!(a.extend_lease(&[claimed.lease], at(T0 + 52_000)).await.unwrap(), [false]);
}

async fn purge_keeps_what_is_referenced_or_recent<F: Fixture>() {
    let fixture = F::with_options(StoreOptions { completion_history: true, purge_batch_size: 3, ..options() }).await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["done", "dead"]), ("slow", &["done"])]);
    let created = |e: NewEvent| e.with_created_at(at(T0));
    publish_all(store, (0..5).map(|n| created(event(&format!("done-{n}"), "done"))).collect()).await;
    publish_all(store, (0..4).map(|n| created(event(&format!("dead-{n}"), "dead"))).collect()).await;
    publish(store, created(event("nobody", "unsubscribed"))).await.unwrap();
    fan_out_all(store, &subscriptions, at(T0)).await;
    publish(store, event("unfanned", "done").with_created_at(at(T0 - 10_000_000))).await.unwrap();
    let claimed = store.claim(&handlers(&["h"]), 100, at(T0)).await.unwrap();
    for c in &claimed {
        if c.event.event_type == "done" {
            store.complete_many(&[c.lease], at(T0)).await.unwrap();
        } else {
            store.bury(&c.lease, "poison", true, at(T0)).await.unwrap();
        }
    }
    // Nothing is old enough yet.
    let report = store.purge(&PurgeOptions { dead_before: Some(at(T0)), completed_before: Some(at(T0)) }, at(T0)).await.unwrap();
    assert_eq!(report, Default::default());
    let report = store
        .purge(&PurgeOptions { dead_before: Some(at(T0 + 1)), completed_before: Some(at(T0 + 1)) }, at(T0 + 1))
        .await
        .unwrap();
    assert_eq!(report.dead_deliveries, 4);
    assert_eq!(report.history_records, 5);
    // The dead events go; "done" events are still referenced by the slow handler's deliveries;
    // the event nobody subscribed to is old enough; the unfanned one is never purged.
    assert_eq!(report.events, 5, "{report:?}");
    for n in 0..5 {
        assert!(fixture.raw_event(&format!("done-{n}")).await.is_some());
    }
    assert!(fixture.raw_event("dead-0").await.is_none());
    assert!(fixture.raw_event("nobody").await.is_none());
    assert!(fixture.raw_event("unfanned").await.is_some());
    // Once the slow handler completed, the events stay as deduplication records until the
    // completed cutoff passes their latest completion.
    let slow = store.claim(&handlers(&["slow"]), 100, at(T0 + 2)).await.unwrap();
    let leases: Vec<_> = slow.iter().map(|c| c.lease).collect();
    store.complete_many(&leases, at(T0 + 2)).await.unwrap();
    let report = store.purge(&PurgeOptions { dead_before: Some(at(T0 + 3)), completed_before: Some(at(T0 + 2)) }, at(T0 + 3)).await.unwrap();
    assert_eq!(report.events, 0);
    assert_eq!(publish(store, event("done-1", "done")).await.unwrap(), Published::Duplicate);
    let report = store.purge(&PurgeOptions { dead_before: None, completed_before: Some(at(T0 + 3)) }, at(T0 + 3)).await.unwrap();
    assert_eq!((report.events, report.history_records), (5, 5));
}

/// Key `a` has a dead delivery left after its completed events go; key `b` has none left:
/// only `b`'s counter goes, and `b` starts again at 1 with nothing of it left to order
/// against, while `a` goes on from its counter (per-key order across a purge).
async fn purge_deletes_a_keys_counter_only_once_none_of_its_events_remains<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    let created = |e: NewEvent| e.with_created_at(at(T0));
    publish_all(store, vec![created(keyed("a-1", "t", "a")), created(keyed("a-2", "t", "a")), created(keyed("b-1", "t", "b"))]).await;
    fan_out_all(store, &subscriptions, at(T0)).await;
    for step in 0..3 {
        for c in store.claim(&handlers(&["h"]), 10, at(T0 + step)).await.unwrap() {
            if c.event.id == "a-2" {
                store.bury(&c.lease, "poison", true, at(T0 + step)).await.unwrap();
            } else {
                store.complete_many(&[c.lease], at(T0 + step)).await.unwrap();
            }
        }
    }
    let options = PurgeOptions { completed_before: Some(at(T0 + 10)), dead_before: None };
    let preview = store.purge_preview(&options, at(T0 + 10)).await.unwrap();
    // Every event is past its cutoff; a-2 stays all the same, its dead delivery refers to it.
    assert_eq!((preview.events, preview.dead_deliveries), (3, 0), "{preview:?}");
    assert!(fixture.raw_event("a-1").await.is_some(), "a preview deletes nothing");
    let report = store.purge(&options, at(T0 + 10)).await.unwrap();
    assert_eq!((report.events, report.key_counters), (2, 1), "{report:?}");
    assert!(fixture.raw_event("a-2").await.is_some(), "the dead delivery keeps its event");
    assert_eq!(publish(store, keyed("a-3", "t", "a")).await.unwrap(), Published::New { sequence: Some(3) });
    assert_eq!(publish(store, keyed("b-2", "t", "b")).await.unwrap(), Published::New { sequence: Some(1) });
}

async fn one_instance_at_a_time_holds_a_jobs_turn<F: Fixture>() {
    let fixture = F::new().await;
    let (a, b) = (fixture.worker("a"), fixture.worker("b"));
    let turn = Duration::from_secs(60);
    assert!(a.take_turn("retention", turn, at(T0)).await.unwrap());
    assert!(!b.take_turn("retention", turn, at(T0 + 1)).await.unwrap(), "a holds it");
    assert!(a.take_turn("retention", turn, at(T0 + 2)).await.unwrap(), "its holder may take it again");
    assert!(b.take_turn("other", turn, at(T0 + 2)).await.unwrap(), "turns are per job");
    assert!(!b.take_turn("retention", turn, at(T0 + 60_001)).await.unwrap(), "a's second turn runs to T0 + 60,002");
    assert!(b.take_turn("retention", turn, at(T0 + 60_002)).await.unwrap(), "once it lapses, another takes it");
    // A job's name is data: one shaped like an operator is a job of its own, matching no other.
    assert!(a.take_turn("{\"$gt\": \"\"}", turn, at(T0 + 60_003)).await.unwrap());
    assert!(!a.take_turn("retention", turn, at(T0 + 60_004)).await.unwrap(), "b still holds retention");
}

async fn listing_filters_by_running_parked_and_age_and_takes_operators_text_as_data<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    publish_all(store, vec![keyed("k-1", "t", "k").with_created_at(at(T0 - 1_000)), keyed("k-2", "t", "k"), event("u-1", "t")]).await;
    fan_out_all(store, &subscriptions, at(T0)).await;
    let running = store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    assert_eq!(ids(&running), ["k-1/h", "u-1/h"], "k-2 waits behind k-1");
    let list = async |filter: DeliveryFilter| -> Vec<String> {
        let mut found: Vec<String> = list_all(store, filter).await.iter().map(|d| format!("{}/{}", d.event_id, d.handler)).collect();
        found.sort();
        found
    };
    let pending = Some(DeliveryStatus::Pending);
    assert_eq!(list(DeliveryFilter { status: pending, running: Some(true), ..Default::default() }).await, ["k-1/h", "u-1/h"]);
    assert_eq!(list(DeliveryFilter { status: pending, running: Some(false), ..Default::default() }).await, ["k-2/h"]);
    assert_eq!(list(DeliveryFilter { status: pending, parked: Some(true), ..Default::default() }).await, ["k-2/h"]);
    assert_eq!(list(DeliveryFilter { created_before: Some(at(T0 - 500)), ..Default::default() }).await.len(), 0, "by the delivery's creation");
    let views = list_all(store, DeliveryFilter { running: Some(true), ..Default::default() }).await;
    assert!(views.iter().all(|v| v.running));
    for hostile in ["{\"$gt\": \"\"}", "k\" || true", "/.*/", "$where"] {
        let filter = DeliveryFilter { key: Some(hostile.into()), handler: Some(hostile.into()), ..Default::default() };
        assert!(list(filter).await.is_empty(), "{hostile} is a value, never an operator");
        let history = store.event_history(hostile).await.unwrap();
        assert!(history.event.is_none() && history.completions.is_empty());
    }
    assert_eq!(store.event_history("u-1").await.unwrap().event.and_then(|e| e.get_str("type").ok().map(str::to_string)).as_deref(), Some("t"));
}

async fn purge_racing_fan_out_never_orphans_a_delivery<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    let purger = fixture.worker("purger");
    let publisher = fixture.worker("publisher");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let purging = {
        let stop = stop.clone();
        async move {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let now = bson::DateTime::now();
                purger.purge(&PurgeOptions { dead_before: Some(now), completed_before: Some(now) }, now).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    let working = async {
        for round in 0..30 {
            // New ids, and retries of old ids that may or may not have been purged yet.
            let mut events: Vec<NewEvent> = (0..5).map(|n| event(&format!("r{round}-{n}"), "t")).collect();
            if round > 0 {
                events.push(event(&format!("r{}-0", round - 1), "t"));
            }
            for e in events {
                publisher_publish(&publisher, e).await;
            }
            fan_out_all(store, &subscriptions, bson::DateTime::now()).await;
            let claimed = store.claim(&handlers(&["h"]), 100, bson::DateTime::now()).await.unwrap();
            let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
            store.complete_many(&leases, bson::DateTime::now()).await.unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    tokio::join!(purging, working);
    for delivery in list_all(store, DeliveryFilter::default()).await {
        assert!(fixture.raw_event(&delivery.event_id).await.is_some(), "delivery of a purged event");
    }
    assert!(dead(store).await.is_empty(), "no claim met a missing event");
}

async fn publisher_publish<S: Store>(store: &S, event: NewEvent) {
    publish(store, event).await.unwrap();
}

async fn statistics_count_each_state<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    publish_all(store, (0..6).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    assert_eq!(store.unfanned_events().await.unwrap(), 6);
    fan_out_all(store, &subs(&[("h", &["t"]), ("idle", &["t"])]), at(T0)).await;
    assert_eq!(store.unfanned_events().await.unwrap(), 0);
    let claimed = store.claim(&handlers(&["h"]), 3, at(T0)).await.unwrap();
    store.bury(&claimed[0].lease, "x", true, at(T0)).await.unwrap();
    let stats = store.statistics(at(T0)).await.unwrap();
    let h = stats.iter().find(|s| s.handler == "h").unwrap();
    assert_eq!((h.pending, h.running, h.dead, h.parked), (3, 2, 1, 0));
    assert_eq!(h.oldest_due_at, Some(at(T0)));
    assert_eq!(h.completed, None, "unknown without completion history");
    let idle = stats.iter().find(|s| s.handler == "idle").unwrap();
    assert_eq!((idle.pending, idle.running), (6, 0));
    // Paginated listing sees every delivery exactly once.
    let page = store.list_deliveries(&DeliveryFilter { limit: 4, ..Default::default() }).await.unwrap();
    assert_eq!(page.deliveries.len(), 4);
    let all = list_all(store, DeliveryFilter { limit: 4, ..Default::default() }).await;
    assert_eq!(all.iter().map(|d| &d.id).collect::<HashSet<_>>().len(), 12);
    let only_dead = list_all(store, DeliveryFilter { status: Some(DeliveryStatus::Dead), handler: Some("h".into()), ..Default::default() }).await;
    assert_eq!(only_dead.len(), 1);
}

async fn transaction_budget_aborts_late_commits<F: Fixture>() {
    let fixture = F::with_options(StoreOptions { transaction_budget: Duration::from_millis(200), ..options() }).await;
    let store = fixture.store();
    let mut tx = store.begin().await.unwrap();
    store.publish(&mut tx, &event("late", "t")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let error = tx.commit().await.unwrap_err();
    assert!(matches!(error, StoreError::TransactionTimeout(_)), "{error}");
    assert!(fixture.raw_event("late").await.is_none());
}

mod dead_letters {
    use super::*;
    use relayhost::dispatch::{DEAD_LETTER_EVENT_TYPE, bury_with_dead_letter};

    async fn a_dead_delivery_is_announced_in_the_same_transaction<F: Fixture>() {
        let fixture = F::new().await;
        let (a, b) = (fixture.worker("a"), fixture.worker("b"));
        publish_all(fixture.store(), vec![keyed("e-1", "order.placed", "c-1"), event("e-2", "order.placed")]).await;
        let subscriptions = subs(&[("mailer", &["order.placed"]), ("dead-letters", &[DEAD_LETTER_EVENT_TYPE])]);
        fan_out_all(fixture.store(), &subscriptions, at(T0)).await;
        let claimed = a.claim(&handlers(&["mailer"]), 10, at(T0)).await.unwrap();
        let first = claimed.iter().find(|c| c.event.id == "e-1").unwrap();
        assert_eq!(bury_with_dead_letter(&a, first, "SMTP said no", true, at(T0)).await.unwrap(), Settlement::Completed);

        // A stale lease buries nothing and announces nothing.
        let second = claimed.iter().find(|c| c.event.id == "e-2").unwrap().clone();
        b.claim(&handlers(&["mailer"]), 10, at(T0 + 31_000)).await.unwrap();
        assert_eq!(bury_with_dead_letter(&a, &second, "late", true, at(T0 + 32_000)).await.unwrap(), Settlement::LeaseLost);

        // The dead letter's lane comes from its id, which holds the delivery's random id: it
        // may be the lane `b` holds for `e-2`, so `b` (which may also take any other lane now)
        // claims it.
        fan_out_all(fixture.store(), &subscriptions, at(T0 + 33_000)).await;
        let letters = b.claim(&handlers(&["dead-letters"]), 10, at(T0 + 33_000)).await.unwrap();
        assert_eq!(letters.len(), 1, "exactly one dead letter: {:?}", ids(&letters));
        let payload = &letters[0].event.payload;
        assert_eq!(payload.get_str("eventId").unwrap(), "e-1");
        assert_eq!(payload.get_str("handler").unwrap(), "mailer");
        assert_eq!(payload.get_i64("attempts").unwrap(), 1);
        assert_eq!(payload.get_str("lastError").unwrap(), "SMTP said no");
        assert_eq!(payload.get_str("key").unwrap(), "c-1");
        assert_eq!(letters[0].event.causation_id.as_deref(), Some("e-1"));
        let dead = dead(fixture.store()).await;
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].last_error.as_deref(), Some("SMTP said no"));

        // The dead letter's own death is not announced again.
        assert_eq!(bury_with_dead_letter(&b, &letters[0], "hook failed", true, at(T0 + 33_000)).await.unwrap(), Settlement::Completed);
        fan_out_all(fixture.store(), &subscriptions, at(T0 + 34_000)).await;
        assert!(b.claim(&handlers(&["dead-letters"]), 10, at(T0 + 34_000)).await.unwrap().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        a_dead_delivery_is_announced_in_the_same_transaction::<MemoryFixture>().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mongo() {
        a_dead_delivery_is_announced_in_the_same_transaction::<MongoFixture>().await
    }
}
