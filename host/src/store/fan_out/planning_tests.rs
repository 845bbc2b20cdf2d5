//! The fan-out planning's unit tests (see `planning.rs`).

use super::*;
use crate::event::NewEvent;
use crate::store::Subscription;
use bson::doc;

fn keyed(id: &str, key: &str, sequence: i64) -> Document {
    NewEvent::new(id, "t", doc! {}).with_key(key).to_document(Some(sequence), DateTime::from_millis(0))
}

#[test]
fn keyed_events_come_only_from_their_key_prefix() {
    let first = vec![keyed("b", "k", 2), NewEvent::new("u", "t", doc! {}).to_document(None, DateTime::now())];
    assert_eq!(prefixes_to_read(&first, true, &[]), [(vec!["k".to_string()], Some(2))]);
    assert_eq!(prefixes_to_read(&first, false, &[]), [(vec!["k".to_string()], None)]);
    let batch = assemble(first, vec![keyed("a", "k", 1), keyed("b", "k", 2)]);
    let ids: Vec<&str> = batch.iter().map(|d| d.get_str("_id").unwrap()).collect();
    assert_eq!(ids, ["u", "a", "b"]);
}

#[test]
fn a_prefix_read_stops_at_each_keys_highest_integer_sequence_in_the_batch() {
    let unkeyed = NewEvent::new("u", "t", doc! {}).to_document(None, DateTime::now());
    let mut no_sequence = keyed("n", "j", 1);
    no_sequence.remove("sequence");
    let mut odd = keyed("o", "x", 1);
    odd.insert("sequence", 1.5);
    let first = [keyed("a", "k", 2), unkeyed, keyed("b", "j", 5), no_sequence.clone(), keyed("c", "m", 2), odd.clone()];
    let groups = prefixes_to_read(&first, true, &[]);
    let named = |keys: &[&str]| keys.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    assert_eq!(groups, [(named(&["k", "m"]), Some(2)), (named(&["j"]), Some(5)), (named(&["x"]), None)]);
    // A key with no sequence among them has only its missing sequences below its bound.
    let groups = prefixes_to_read(&[no_sequence.clone()], true, &[]);
    assert_eq!(groups, [(named(&["j"]), Some(i64::MIN))]);
    assert!(within_prefix_bound(&no_sequence, Some(i64::MIN)), "the key's index orders a missing sequence first");
    assert!(within_prefix_bound(&keyed("d", "k", 2), Some(2)) && !within_prefix_bound(&keyed("e", "k", 3), Some(2)));
    assert!(within_prefix_bound(&odd, Some(0)));
    // Past eight bounds, neighbours share a group under the highest of them.
    let many: Vec<Document> = (1..=20).map(|n| keyed(&format!("e{n}"), &format!("k{n:02}"), n)).collect();
    let groups = prefixes_to_read(&many, true, &[]);
    assert_eq!(groups.len(), 7);
    assert_eq!(groups[0], (named(&["k01", "k02", "k03"]), Some(3)));
    assert_eq!(groups.iter().map(|(keys, _)| keys.len()).sum::<usize>(), 20);
}

#[test]
fn keys_read_apart_are_read_up_to_their_bounds_and_one_alone_to_its_end() {
    let named = |keys: &[&str]| keys.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    let asked = |keys: &[(&str, i64)]| keys.iter().map(|(k, n)| (k.to_string(), *n)).collect::<Vec<_>>();
    // One key read apart and nothing else: to its end.
    assert_eq!(prefixes_to_read(&[], true, &asked(&[("h", 7)])), [(named(&["h"]), None)]);
    // Beside the oldest events, or beside another key read apart: each up to its bound.
    let first = [keyed("a", "k", 2)];
    assert_eq!(prefixes_to_read(&first, true, &asked(&[("h", 7)])), [(named(&["k"]), Some(2)), (named(&["h"]), Some(7))]);
    assert_eq!(prefixes_to_read(&[], true, &asked(&[("h", 7), ("j", 3)])), [(named(&["j"]), Some(3)), (named(&["h"]), Some(7))]);
    // A key read apart that is among the oldest too: up to the higher of the two.
    assert_eq!(prefixes_to_read(&[keyed("b", "h", 9)], true, &asked(&[("h", 7)])), [(named(&["h"]), Some(9))]);
}

#[test]
fn heard_batches_hold_each_keys_events_in_sequence_order_after_the_unkeyed_ones() {
    let unkeyed = NewEvent::new("u", "t", doc! {}).to_document(None, DateTime::now());
    let mut no_sequence = keyed("n", "k", 1);
    no_sequence.remove("sequence");
    let heard = vec![keyed("k3", "k", 3), keyed("j1", "j", 1), unkeyed, keyed("k2", "k", 2), no_sequence];
    let ids: Vec<String> = in_key_order(heard).iter().map(|d| d.get_str("_id").unwrap().to_string()).collect();
    assert_eq!(ids, ["u", "j1", "n", "k2", "k3"]);
}

#[test]
fn of_an_idle_key_only_its_head_is_fanned_out_while_anything_else_is() {
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"]), Subscription::new("g", ["t"])]).unwrap();
    let unkeyed = NewEvent::new("u", "t", doc! {}).to_document(None, DateTime::now());
    let mut malformed = keyed("m1", "m", 1);
    malformed.remove("type");
    let batch = vec![unkeyed, keyed("k1", "k", 1), keyed("k2", "k", 2), malformed, keyed("m2", "m", 2), keyed("j1", "j", 1), keyed("j2", "j", 2)];
    let ids = |batch: &[Document]| batch.iter().map(|d| d.get_str("_id").unwrap().to_string()).collect::<Vec<_>>();
    let plan = plan(&batch, &subscriptions);
    let heads = |keys: &[(&str, &str)]| keys.iter().map(|(h, k)| (h.to_string(), k.to_string())).collect::<HashSet<_>>();
    // "k" is idle for both its handlers: only its head. "m"'s first event is malformed
    // (dead at once, it runs nothing): its next is kept. "j" is idle for one handler only.
    let idle = heads(&[("h", "k"), ("g", "k"), ("h", "m"), ("g", "m"), ("h", "j")]);
    let (kept, left_out) = heads_of_idle_keys(batch.clone(), &plan, &idle);
    assert_eq!(ids(&kept), ["u", "k1", "m1", "m2", "j1", "j2"]);
    assert_eq!(left_out, [("k".to_string(), Some(2))]);
    // A batch of nothing but such heads is kept whole.
    let alone = vec![keyed("k1", "k", 1), keyed("k2", "k", 2)];
    let (kept, left_out) = heads_of_idle_keys(alone.clone(), &super::plan(&alone, &subscriptions), &idle);
    assert_eq!((ids(&kept), left_out.len()), (vec!["k1".to_string(), "k2".to_string()], 0));
}

#[test]
fn a_claims_only_handlers_deliveries_are_never_handed_out() {
    let subscriptions =
        Subscriptions::new([Subscription::new("h", ["t"]), Subscription::new("slow", ["t"]).claimed_only(true)]).unwrap();
    let batch = vec![NewEvent::new("u", "t", doc! {}).to_document(None, DateTime::now()), keyed("k1", "k", 1)];
    let plan = plan(&batch, &subscriptions);
    assert_eq!(plan.deliveries.len(), 4, "both handlers get a delivery of each event");
    assert_eq!(keyed_heads(&plan), [("h".to_string(), "k".to_string())]);
    let idle: HashSet<HandlerKey> = [("h", "k"), ("slow", "k")].iter().map(|(h, k)| (h.to_string(), k.to_string())).collect();
    let fresh = fresh(&plan, &batch, Capacity::from(10), &idle, DateTime::now());
    let handed: Vec<(String, &str)> = fresh.iter().map(|f| (f.candidate.event_id.clone(), f.candidate.handler.as_str())).collect();
    assert_eq!(handed, [("u".to_string(), "h"), ("k1".to_string(), "h")]);
}

#[test]
fn a_hand_out_keeps_to_each_handlers_room_and_starts_the_first_in_the_free_run_slots() {
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"]), Subscription::new("paced", ["t"])]).unwrap();
    let batch: Vec<Document> = (0..4).map(|n| NewEvent::new(format!("u{n}"), "t", doc! {}).to_document(None, DateTime::now())).collect();
    let plan = plan(&batch, &subscriptions);
    let rooms = crate::store::Rooms::new([("paced".to_string(), crate::store::Room { most: 2 })]);
    let budget = Capacity::new(5, 2).within(rooms);
    let handed = fresh(&plan, &batch, budget, &HashSet::new(), DateTime::now());
    let of = |handler: &str| handed.iter().filter(|f| f.candidate.handler == handler).count();
    // Two of the paced handler's, the rest of the five places the other handler's; the first
    // two start in the free run slots, the others are claimed ahead.
    assert_eq!((of("paced"), of("h")), (2, 3));
    let started: Vec<bool> = handed.iter().map(|f| f.candidate.started).collect();
    assert_eq!(started, [true, true, false, false, false]);
    // No room: none of its deliveries.
    let closed = crate::store::Rooms::new([("paced".to_string(), crate::store::Room { most: 0 })]);
    let handed = fresh(&plan, &batch, Capacity::from(10).within(closed), &HashSet::new(), DateTime::now());
    assert!(handed.iter().all(|f| f.candidate.handler == "h") && handed.len() == 4);
}

#[test]
fn listed_handlers_are_skipped_and_malformed_events_are_dead_letters() {
    let subscriptions =
        Subscriptions::new([Subscription::new("h1", ["t"]), Subscription::new("h2", ["t"])]).unwrap();
    let mut listed = keyed("a", "k", 1);
    listed.insert("handlers", vec!["h1"]);
    let mut no_type = keyed("b", "k", 2);
    no_type.remove("type");
    let plan = plan(&[listed, no_type], &subscriptions);
    let summary: Vec<(String, &str, bool)> =
        plan.deliveries.iter().map(|d| (id_text(&d.event_id), d.handler.as_str(), d.dead_reason.is_some())).collect();
    assert_eq!(
        summary,
        [("a".to_string(), "h2", false), ("b".to_string(), MALFORMED_EVENT_HANDLER, true)]
    );
    assert_eq!(plan.malformed, 1);
    assert!(plan.deliveries[1].dead_reason.as_ref().unwrap().contains("`type` is missing"));
}
