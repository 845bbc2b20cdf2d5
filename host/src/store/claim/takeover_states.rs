//! The states crashes and races leave in lanes' in-flight lists, and what a takeover makes of
//! them, against both stores: the same delivery listed in two lanes and twice in one, the
//! entries of a fan-out that lost the race for its event (naming a delivery that never
//! existed) beside the winner's when both holders die together, a death with a full
//! claim-ahead, where only what had started is charged, and a death while a run handed out
//! before its fan-out committed, which never did. Each must end with every delivery run once
//! more and nothing waiting.

use crate::store::Outbox;
use bson::oid::ObjectId;
use bson::{Bson, DateTime, doc};

use super::{ClaimBackend, EventOf, HandOutOf, HoldUp, InFlight, LaneRecord, LaneWrite};
use super::test_stores::{Parts, T0, both_stores, mongo_store, options};
use crate::store::memory::MemoryStore;
use crate::store::{
    Capacity, ClaimedDelivery, DeliveryFilter, DeliveryStatus, DeliveryView, Store, Subscription, Subscriptions, run_in_transaction,
};
use crate::event::NewEvent;
use crate::lane::LaneId;

fn at(ms: i64) -> DateTime {
    DateTime::from_millis(ms)
}

/// After the holder's lease of 30 s ran out.
const LATER: i64 = T0 + 31_000;

both_stores!(a_delivery_listed_in_two_lanes_and_twice_in_one_is_charged_once, listed_twice);
both_stores!(two_holders_dying_after_a_racing_fan_out_charge_only_the_delivery_that_exists, racing_fan_outs_then_two_deaths);
both_stores!(a_death_with_a_full_claim_ahead_charges_only_what_had_started, full_claim_ahead);
both_stores!(a_run_its_host_died_in_before_its_fan_out_committed_is_recorded_before_it_runs_again, died_before_the_fan_out_committed);
both_stores!(a_keyed_run_its_host_died_in_before_its_fan_out_committed_is_recorded_before_it_runs_again, keyed_died_before_the_fan_out_committed);
both_stores!(a_plain_mark_landing_after_a_takeover_of_its_lane_hands_nothing_out, mark_after_takeover);
both_stores!(a_keys_head_retried_as_a_fan_out_starts_holds_the_keys_next_event_back, head_retried_as_a_fan_out_starts);

fn handlers() -> Vec<String> {
    vec!["h".to_string()]
}

fn subscriptions() -> Subscriptions {
    Subscriptions::new([Subscription::new("h", ["t"])]).unwrap()
}

async fn publish<S: Store>(store: &S, ids: impl IntoIterator<Item = String>) {
    publish_events(store, ids.into_iter().map(|id| NewEvent::new(id, "t", doc! {})).collect()).await;
}

async fn publish_events<S: Store>(store: &S, events: Vec<NewEvent>) {
    run_in_transaction(store, async |tx| {
        for event in &events {
            store.publish(tx, event).await?;
        }
        Ok(())
    })
    .await
    .unwrap();
}

async fn deliveries<S: Store>(store: &S, status: DeliveryStatus) -> Vec<DeliveryView> {
    let filter = DeliveryFilter { status: Some(status), limit: 1_000, ..Default::default() };
    store.list_deliveries(&filter).await.unwrap().deliveries
}

/// Completes everything claimable at `now` and checks that nothing is left, pending or dead.
async fn drain<S: Store>(store: &S, now: i64) {
    let claimed = store.claim(&handlers(), 100, at(now)).await.unwrap();
    let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
    store.complete_many(&leases, at(now)).await.unwrap();
    assert!(deliveries(store, DeliveryStatus::Pending).await.is_empty(), "nothing is left waiting");
    assert!(deliveries(store, DeliveryStatus::Dead).await.is_empty(), "nothing died");
}

/// Two free lanes next to `lane`, one below and one above it.
fn beside(lane: LaneId) -> (LaneId, LaneId) {
    (lane.wrapping_sub(1).min(lane.wrapping_add(1)), lane.wrapping_sub(1).max(lane.wrapping_add(1)))
}

async fn listed_twice<S: Store + Parts>(a: &S, b: &S, _c: &S) {
    publish(a, ["e-1".to_string()]).await;
    a.fan_out(&subscriptions(), 10, 0, at(T0)).await.unwrap();
    let lease = a.claim(&handlers(), 1, at(T0)).await.unwrap().remove(0).lease;
    // Crashes and failed writes left its entry twice in its lane and once in another lane of
    // the same holder.
    let (backend, claimer) = a.parts();
    let lane = backend.lanes(&[lease.lane]).await.unwrap().remove(0);
    let entry = lane.in_flight[0].clone();
    let twice = LaneRecord {
        lane: lease.lane,
        epoch: lane.epoch,
        in_flight: vec![entry.clone(), entry.clone()],
        lease_until: at(T0 + 30_000),
        takes_free_at: None,
    };
    assert_eq!(backend.record(&claimer.holder, &[twice], LaneWrite::Durable).await.unwrap(), [true]);
    let (other, _) = beside(lease.lane);
    let taken = backend.take_listing(&[(other, vec![entry])], &claimer.holder, at(T0), at(T0 + 30_000), LaneWrite::Applied).await.unwrap();
    assert_eq!(taken.len(), 1);

    // a dies; b takes both lanes over at once.
    let claimed = b.claim_in(&handlers(), &[lease.lane, other], 10, at(LATER)).await.unwrap();
    assert_eq!(claimed.len(), 1, "the lanes do not stall");
    assert_eq!((claimed[0].lease.delivery, claimed[0].attempts), (lease.delivery, 1), "charged once");
    b.complete_many(&[claimed[0].lease], at(LATER)).await.unwrap();
    drain(b, LATER + 1).await;
}

async fn racing_fan_outs_then_two_deaths<S: Store + Parts>(a: &S, b: &S, c: &S) {
    publish(a, ["e-1".to_string()]).await;
    let winner = a.fan_out(&subscriptions(), 10, 1, at(T0)).await.unwrap().claimed.remove(0).lease;
    // b's fan-out of the same event lost the race: what it listed names a delivery that was
    // never created (and, in MongoDB, its own fan-out, whose mark lost). It listed it in two
    // lanes, one below the winner's and one above.
    let (backend_a, _) = a.parts();
    let listed = backend_a.lanes(&[winner.lane]).await.unwrap().remove(0).in_flight[0].clone();
    let losing = || InFlight {
        delivery: ObjectId::new(),
        unstored: listed.unstored.clone().map(|handed| HandOutOf { fan_out: Some(ObjectId::new()), ..handed }),
        ..listed.clone()
    };
    let (below, above) = beside(winner.lane);
    let (backend_b, claimer_b) = b.parts();
    let lists = [(below, vec![losing()]), (above, vec![losing()])];
    assert_eq!(backend_b.take_listing(&lists, &claimer_b.holder, at(T0), at(T0 + 30_000), LaneWrite::Applied).await.unwrap().len(), 2);

    // Both die together; c takes all three lanes over in one claim.
    let claimed = c.claim_in(&handlers(), &[below, winner.lane, above], 10, at(LATER)).await.unwrap();
    assert_eq!(claimed.len(), 1, "the lanes do not stall");
    assert_eq!((claimed[0].lease.delivery, claimed[0].attempts), (winner.delivery, 1), "the winner's delivery, charged once");
    let pending = deliveries(c, DeliveryStatus::Pending).await;
    assert_eq!(pending.iter().map(|d| d.id.clone()).collect::<Vec<_>>(), [winner.delivery.to_hex()], "no delivery of the loser");
    c.complete_many(&[claimed[0].lease], at(LATER)).await.unwrap();
    drain(c, LATER + 1).await;
}

async fn full_claim_ahead<S: Store + Parts>(a: &S, b: &S, _c: &S) {
    publish(a, (0..6).map(|n| format!("claimed-{n}"))).await;
    a.fan_out(&subscriptions(), 6, 0, at(T0)).await.unwrap();
    // Six claimed with two free run slots: two start, four wait; one of those gets a slot
    // and records its start.
    let claimed = a.claim(&handlers(), Capacity::new(6, 2), at(T0)).await.unwrap();
    assert_eq!(claimed.iter().filter(|c| c.started).count(), 2);
    let ahead: Vec<_> = claimed.iter().filter(|c| !c.started).map(|c| c.lease).collect();
    assert_eq!(a.record_starts(&ahead[..1]).await.unwrap(), [true]);
    // A hand-out of four with one free run slot: one starts, three wait (in MongoDB they have
    // no document).
    publish(a, (0..4).map(|n| format!("handed-{n}"))).await;
    let handed = a.fan_out(&subscriptions(), 4, Capacity::new(4, 1), at(T0)).await.unwrap().claimed;
    assert_eq!((handed.len(), handed.iter().filter(|c| c.started).count()), (4, 1));
    let mut started: Vec<String> =
        claimed.iter().chain(&handed).filter(|c| c.started || c.lease == ahead[0]).map(|c| c.event.id.clone()).collect();
    started.sort();
    // Past half its lease, a's next claim rewrites its lanes' lists to extend them: the start
    // it recorded stays recorded.
    assert!(a.claim(&handlers(), 10, at(T0 + 16_000)).await.unwrap().is_empty());
    let later = T0 + 16_000 + 31_000;

    // a dies; b takes over: each delivery runs again, and only what a had started is charged.
    // (What a takeover gives its document lands in its event's lane: the next claim finds
    // what this one did not.)
    let mut again = b.claim(&handlers(), 100, at(later)).await.unwrap();
    again.extend(b.claim(&handlers(), 100, at(later + 1)).await.unwrap());
    again.sort_by(|x, y| x.event.id.cmp(&y.event.id));
    assert_eq!(again.len(), 10, "every delivery runs again");
    let charged: Vec<String> = again.iter().filter(|c| c.attempts == 1).map(|c| c.event.id.clone()).collect();
    assert_eq!(charged, started, "only what had started is charged");
    assert!(again.iter().all(|c| c.attempts <= 1));
    // What was claimed ahead may have started unrecorded: it is suspect, and records its
    // start before it runs from now on; what was charged is not.
    let suspect: Vec<String> = again.iter().filter(|c| c.suspect).map(|c| c.event.id.clone()).collect();
    let uncharged: Vec<String> = again.iter().filter(|c| c.attempts == 0).map(|c| c.event.id.clone()).collect();
    assert_eq!(suspect, uncharged);
    // The dead host's unstarted picks may not start any more.
    assert_eq!(a.record_starts(&ahead[1..2]).await.unwrap(), [false]);
    let leases: Vec<_> = again.iter().map(|c| c.lease).collect();
    b.complete_many(&leases, at(later)).await.unwrap();
    drain(b, later + 2).await;
}

async fn died_before_the_fan_out_committed<S: Store + Parts>(a: &S, b: &S, c: &S) {
    lost_before_the_fan_out_committed(a, b, c, None).await;
}

async fn keyed_died_before_the_fan_out_committed<S: Store + Parts>(a: &S, b: &S, c: &S) {
    // A fan-out that hands out a key's head names its event in the head's lane entry.
    let head = NewEvent::new("head-0", "t", doc! {}).with_key("j");
    run_in_transaction(a, async |tx| a.publish(tx, &head).await).await.unwrap();
    let handed = a.fan_out(&subscriptions(), 10, 10, at(T0)).await.unwrap().claimed;
    assert_eq!(handed.len(), 1);
    let lane = a.parts().0.lanes(&[handed[0].lease.lane]).await.unwrap().remove(0);
    let entry = lane.in_flight.iter().find(|entry| entry.delivery == handed[0].lease.delivery).expect("listed");
    assert_eq!(entry.before_commit, Some(EventOf(Bson::String("head-0".to_string()))));
    a.complete_many(&[handed[0].lease], at(T0)).await.unwrap();
    lost_before_the_fan_out_committed(a, b, c, Some("k")).await;
}

/// A hand-out's run (unkeyed, without a document; or the head of `key`, whose document comes
/// with the commit) listed as started, its host dead before its fan-out committed.
async fn lost_before_the_fan_out_committed<S: Store + Parts>(a: &S, b: &S, c: &S, key: Option<&str>) {
    let event = NewEvent::new("e-1", "t", doc! {});
    let event = match key {
        Some(key) => event.with_key(key),
        None => event,
    };
    run_in_transaction(a, async |tx| a.publish(tx, &event).await).await.unwrap();
    // a handed e-1 out before its fan-out's commit and died, perhaps of the run, before the
    // fan-out committed: the event is unfanned.
    let lane = hand_out_started(a, key).await;

    // b takes the lane over: nothing exists to charge or run, and the lane does not stall.
    assert!(b.claim_in(&handlers(), &[lane], 10, at(LATER)).await.unwrap().is_empty());
    // Fanned out again, it is not handed out before a durable record of its start (it might
    // kill its host again): it gets a document, suspect, for a claim.
    let fanned = b.fan_out(&subscriptions(), 10, 10, at(LATER)).await.unwrap();
    assert_eq!((fanned.events, fanned.claimed.len()), (1, 0), "created, not handed out");
    let claimed = b.claim(&handlers(), Capacity::new(10, 1), at(LATER)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert!(claimed[0].suspect && claimed[0].started && claimed[0].attempts == 0, "{:?}", claimed[0]);

    // b dies running it: this death is charged.
    let again = c.claim(&handlers(), 10, at(LATER + 31_000)).await.unwrap();
    assert_eq!(again.iter().map(|c| (c.event.id.as_str(), c.attempts)).collect::<Vec<_>>(), [("e-1", 1)]);
    c.complete_many(&[again[0].lease], at(LATER + 31_000)).await.unwrap();
    drain(c, LATER + 31_001).await;
}

/// Lists `e-1`'s run (unkeyed, without a document; or the head of `key`, whose document comes
/// with the commit) as started in a lane `a` takes, as `a`'s hand-out does before its fan-out
/// commits; returns the lane.
async fn hand_out_started<S: Store + Parts>(a: &S, key: Option<&str>) -> crate::lane::LaneId {
    let (backend_a, claimer_a) = a.parts();
    let id = Bson::String("e-1".to_string());
    let entry = InFlight {
        delivery: ObjectId::new(),
        claims: 0,
        handler: "h".to_string(),
        key: key.map(str::to_string),
        unstored: key.is_none().then(|| HandOutOf { event: id.clone(), fan_out: Some(ObjectId::new()) }),
        started: true,
        before_commit: key.is_some().then(|| EventOf(id.clone())),
    };
    let lane = crate::lane::lane_for_event("e-1", key);
    let lists = [(lane, vec![entry])];
    let listed = backend_a.take_listing(&lists, &claimer_a.holder, at(T0), at(T0 + 30_000), LaneWrite::Applied);
    assert_eq!(listed.await.unwrap().len(), 1);
    lane
}

/// A fan-out listed two runs without a document (one started, one claimed ahead) in a lane it
/// took, and was held up before its mark (a failover, say) until its lease lapsed: another
/// instance took the lane over first, and found both events unfanned. The mark that lands
/// then hands nothing out (had it, nothing would list those runs, and they would be lost):
/// the events are fanned out again, and their deliveries run.
async fn mark_after_takeover<S: Store + Parts>(a: &S, b: &S, _c: &S) {
    publish(a, ["e-1".to_string(), "e-2".to_string()]).await;
    let fan_out = ObjectId::new();
    let lane = list_without_documents(a, &[("e-1", true), ("e-2", false)], fan_out).await;

    assert!(b.claim_in(&handlers(), &[lane], 10, at(LATER)).await.unwrap().is_empty());
    for event in ["e-1", "e-2"] {
        assert!(!a.mark_late(event, "h", fan_out, at(LATER)).await, "{event}: the late mark hands nothing out");
    }
    let fanned = b.fan_out(&subscriptions(), 10, 10, at(LATER)).await.unwrap();
    assert_eq!((fanned.events, fanned.claimed.len()), (2, 0), "fanned out again, for a claim");
    let claimed = b.claim(&handlers(), 10, at(LATER)).await.unwrap();
    assert_eq!(claimed.len(), 2, "{claimed:?}");
    assert!(claimed.iter().all(|c| c.suspect && c.attempts == 0), "{claimed:?}");
    let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
    b.complete_many(&leases, at(LATER)).await.unwrap();
    drain(b, LATER + 1).await;
}

/// Lists `events`' runs to `h` without a document (each started or not), as the fan-out
/// `fan_out` of `a` does before its mark, in a lane `a` takes (the first event's); returns
/// the lane.
async fn list_without_documents<S: Store + Parts>(a: &S, events: &[(&str, bool)], fan_out: ObjectId) -> LaneId {
    let (backend_a, claimer_a) = a.parts();
    let entries: Vec<InFlight> = events
        .iter()
        .map(|(event, started)| InFlight {
            delivery: ObjectId::new(),
            claims: 0,
            handler: "h".to_string(),
            key: None,
            unstored: Some(HandOutOf { event: Bson::String(event.to_string()), fan_out: Some(fan_out) }),
            started: *started,
            before_commit: None,
        })
        .collect();
    let lane = crate::lane::lane_for_event(events[0].0, None);
    let lists = [(lane, entries)];
    let listed = backend_a.take_listing(&lists, &claimer_a.holder, at(T0), at(T0 + 30_000), LaneWrite::Applied);
    assert_eq!(listed.await.unwrap().len(), 1);
    lane
}

/// In MongoDB a fan-out transaction holds the event it marked until it ends: a fan-out still
/// on its way from a holder held up past its lease (or dead, until the live hosts end its
/// session, see `mongo/hosts.rs`). A takeover waits for it (its charge is tried again while
/// the claims go on), then materializes the run the fan-out committed, or names the event
/// suspect if it did not commit.
async fn takeover_meeting_an_open_fan_out(commits: bool) {
    let a = mongo_store().await;
    let b = a.instance("b");
    publish(&a, ["e-1".to_string()]).await;
    let fan_out = ObjectId::new();
    let events = a.events_collection();
    let mut open = events.client().start_session().await.unwrap();
    open.start_transaction().await.unwrap();
    let mark = doc! { "$set": { "fannedOutAt": at(T0), "handedOut": ["h"], "handlers": ["h"], "fanOut": fan_out } };
    events.update_one(doc! { "_id": "e-1" }, mark).session(&mut open).await.unwrap();
    let lane = list_without_documents(&a, &[("e-1", true)], fan_out).await;

    assert!(b.claim_in(&handlers(), &[lane], 10, at(LATER)).await.unwrap().is_empty());
    assert_eq!(b.parts().1.lanes_waiting_for_charge(), 1, "the charge waits for the fan-out's transaction");
    if commits {
        open.commit_transaction().await.unwrap();
    } else {
        open.abort_transaction().await.unwrap();
    }
    // The next claim charges first (a charge kept waiting is tried again once a second).
    let claimed = b.claim(&handlers(), 10, at(LATER + 1_000)).await.unwrap();
    assert_eq!(b.parts().1.lanes_waiting_for_charge(), 0, "charged once the transaction ended");
    if commits {
        assert_eq!(claimed.iter().map(|c| (c.event.id.as_str(), c.attempts)).collect::<Vec<_>>(), [("e-1", 1)], "charged, run again");
        b.complete_many(&[claimed[0].lease], at(LATER + 1_000)).await.unwrap();
    } else {
        assert!(claimed.is_empty(), "{claimed:?}");
        assert!(events.find_one(doc! { "_id": "e-1", "suspects": "h" }).await.unwrap().is_some(), "named suspect");
        let fanned = b.fan_out(&subscriptions(), 10, 10, at(LATER + 1_000)).await.unwrap();
        assert_eq!((fanned.events, fanned.claimed.len()), (1, 0), "fanned out again, for a claim");
        let claimed = b.claim(&handlers(), 10, at(LATER + 1_000)).await.unwrap();
        assert!(claimed.len() == 1 && claimed[0].suspect, "{claimed:?}");
        b.complete_many(&[claimed[0].lease], at(LATER + 1_000)).await.unwrap();
    }
    drain(&b, LATER + 1_001).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_a_fan_out_transaction_holding_its_event_and_runs_what_it_committed() {
    takeover_meeting_an_open_fan_out(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_a_fan_out_transaction_holding_its_event_and_names_what_it_did_not_commit_suspect() {
    takeover_meeting_an_open_fan_out(false).await;
}

/// A heard batch's fan-out reads nothing before its mark, so its transaction may begin after
/// a takeover of the lane it listed in: its mark hands nothing out either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heard_batchs_mark_landing_after_a_takeover_of_its_lane_hands_nothing_out() {
    let a = mongo_store().await;
    let b = a.instance("b");
    publish(&a, ["e-1".to_string()]).await;
    let fan_out = ObjectId::new();
    let lane = list_without_documents(&a, &[("e-1", true)], fan_out).await;
    assert!(b.claim_in(&handlers(), &[lane], 10, at(LATER)).await.unwrap().is_empty());
    assert!(!a.mark_late("e-1", "h", fan_out, true).await, "the late mark hands nothing out");
    let fanned = b.fan_out(&subscriptions(), 10, 10, at(LATER)).await.unwrap();
    assert_eq!((fanned.events, fanned.claimed.len()), (1, 0), "fanned out again, for a claim");
    drain(&b, LATER).await;
}

/// A fan-out held up before its read (a failover, say) lists what it hands out under a lease
/// from the clock after the read, not from the `now` it was given: otherwise the lane would
/// lapse as it was written, and another host would take it over from a live holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_held_up_before_its_read_leases_from_the_clock_after_it() {
    let a = mongo_store().await;
    publish(&a, ["e-1".to_string()]).await;
    let held_up = DateTime::from_millis(DateTime::now().timestamp_millis() - 60_000);
    let handed = a.fan_out(&subscriptions(), 10, 10, held_up).await.unwrap().claimed;
    assert_eq!(handed.len(), 1, "handed out");
    let read_at = DateTime::now();
    let lane = a.parts().0.lanes(&[handed[0].lease.lane]).await.unwrap().remove(0);
    assert!(lane.lease_expires_at > read_at, "the lease ran from the stale now: {:?} against {read_at:?}", lane.lease_expires_at);
}

/// The events of `claimed`, in order.
fn events_of(claimed: &[ClaimedDelivery]) -> Vec<&str> {
    claimed.iter().map(|c| c.event.id.as_str()).collect()
}

/// Waits for `both` at most 20 s: a fan-out held up where nothing can come in between would
/// wait for ever.
async fn within_seconds<T>(both: impl Future<Output = T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(20), both).await.expect("what the fan-out was held up for came in between")
}

/// Publishes `k-1` and `k-2` of key `k`, and an unkeyed event; `a`'s fan-out hands out the
/// key's head (without a document) and leaves `k-2` unfanned behind it (a batch of one key
/// alone would fan it out parked). Returns the head's run.
async fn hand_out_a_keys_head<S: Store>(a: &S) -> ClaimedDelivery {
    let mut events: Vec<NewEvent> = ["k-1", "k-2"].iter().map(|id| NewEvent::new(*id, "t", doc! {}).with_key("k")).collect();
    events.push(NewEvent::new("e-1", "t", doc! {}));
    publish_events(a, events).await;
    let mut handed = a.fan_out(&subscriptions(), 10, 10, at(T0)).await.unwrap().claimed;
    handed.sort_by(|x, y| x.event.id.cmp(&y.event.id));
    assert_eq!(events_of(&handed), ["e-1", "k-1"], "only the key's head goes out");
    assert_eq!(a.unfanned_events().await.unwrap(), 1, "k-2 waits unfanned");
    a.complete_many(&[handed[0].lease], at(T0)).await.unwrap();
    handed.remove(1)
}

/// A key's head that ran without a document is retried (it gets its document, then its
/// lease counts as settled) as a fan-out of its instance starts, after it took what it knows
/// of the keys running here and before its read: the read finds the head pending, and the
/// fan-out hands nothing of its key out (the next event would run before the retried head).
async fn head_retried_as_a_fan_out_starts<S: Store + Parts>(a: &S, _b: &S, _c: &S) {
    let head = hand_out_a_keys_head(a).await;
    let (arrived, proceed) = a.parts().1.hold_up(HoldUp::KeysRead);
    let subscriptions = subscriptions();
    let fan_out = a.fan_out(&subscriptions, 10, 10, at(T0 + 1));
    let retry = async {
        arrived.notified().await;
        a.reschedule(&head.lease, at(T0 + 2), "failed", at(T0 + 1)).await.unwrap();
        proceed.notify_one();
    };
    let (fanned, ()) = within_seconds(async { futures::join!(fan_out, retry) }).await;
    assert!(fanned.unwrap().claimed.is_empty(), "k-2 waits for k-1's retry");
    in_order(a, &["k-1", "k-2"], T0 + 2).await;
}

/// Runs what is left of key `k` from `now` on, one event at a time, and checks it is `left`
/// in that order.
async fn in_order<S: Store>(a: &S, left: &[&str], now: i64) {
    for (event, now) in left.iter().zip(now..) {
        a.fan_out(&subscriptions(), 10, 0, at(now)).await.unwrap();
        let claimed = a.claim(&handlers(), 10, at(now)).await.unwrap();
        assert_eq!(events_of(&claimed), [*event], "the key runs in order");
        a.complete_many(&[claimed[0].lease], at(now)).await.unwrap();
    }
    drain(a, now + left.len() as i64).await;
}

/// A takeover charged between a fan-out's read of idle keys and its hand-out: the lane it took
/// over listed a key's head without a document, which the charge gives its document (and the
/// same claim runs again) after the read. The hand-out hands nothing of that key out: its
/// next event would run beside its head. MongoDB only: the memory store's fan-out holds its
/// state from its read to its first stage, so a takeover cannot come in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_charged_between_a_fan_outs_read_and_its_hand_out_holds_the_keys_next_event_back() {
    let a = mongo_store().await;
    let b = a.instance("b");
    hand_out_a_keys_head(&a).await;
    // a dies with it.
    let (arrived, proceed) = b.parts().1.hold_up(HoldUp::HandOut);
    let subscriptions = subscriptions();
    let fan_out = b.fan_out(&subscriptions, 10, 10, at(LATER));
    let takeover = async {
        arrived.notified().await;
        let claimed = b.claim(&handlers(), 10, at(LATER)).await.unwrap();
        proceed.notify_one();
        claimed
    };
    let (fanned, taken) = within_seconds(async { futures::join!(fan_out, takeover) }).await;
    assert_eq!(events_of(&taken), ["k-1"], "the takeover runs the head again");
    assert!(fanned.unwrap().claimed.is_empty(), "k-2 waits for k-1");
    b.complete_many(&[taken[0].lease], at(LATER)).await.unwrap();
    in_order(&b, &["k-2"], LATER + 1).await;
}
