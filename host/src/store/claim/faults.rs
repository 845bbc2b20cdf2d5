//! Fault injection into the shared claim, against both stores: a worker that dies between
//! charging a takeover and recording it, a claim whose record reached the database while its
//! reply did not (also when that record took the lane), a requeue racing a claim, and a
//! settling write whose reply was lost (the claim trusts its own unsettled leases only for a
//! while), a claim's or a hand-out's lane take that reached the database while its reply
//! did not, a hand-out sent before its commit, which then failed, a takeover whose charge
//! failed (then a stop, or a death, before it is made), and a hand-out's lists lost in a
//! failover after they were acknowledged.
//!
//! Test code only: every test drives the one fault-injecting backend ([`Faulty`]) on both
//! stores (`test_stores`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};

use bson::{DateTime, Document, doc};

use super::{
    Candidate, ClaimBackend, DueWork, HandlerKey, Holder, InFlight, LaneRecord, LaneSearch, LaneState, LaneWrite, CandidateRead, Unpark,
};
use crate::store::memory::MemoryStore;
use crate::store::{DeliveryId, Lease, Settlement, Store, StoreError, Subscription, Subscriptions, run_in_transaction};
use crate::event::NewEvent;
use crate::lane::LaneId;
use super::test_stores::{Parts, T0, both_stores, mongo_store, options};

#[derive(Clone, PartialEq)]
#[allow(clippy::enum_variant_names)]
enum Fault {
    /// An operator requeues this dead delivery while the claim is between reading and
    /// recording.
    RequeueBeforeRecord(String),
    /// The record write never happens and nothing runs after it: the process died.
    DieBeforeRecord,
    /// The record is written but the claim fails afterwards (its reply was lost).
    FailAfterRecord,
    /// The claim's take of lanes is written but its reply is lost.
    FailAfterTake,
    /// A takeover's charge of what the previous owner left in flight fails, having written
    /// nothing (a transaction of a dead host kept it waiting too long, say).
    FailCharge,
    /// A takeover's charge never finishes (a dead host's transaction holds what it writes).
    HoldCharge,
    /// The first record is acknowledged, then lost: a failover rolled it back, the lanes'
    /// lists as they were before it.
    LoseFirstRecord,
    /// Nothing goes wrong in the claim itself.
    Nothing,
}

struct Faulty<'s, B, S> {
    inner: B,
    fault: Fault,
    store: &'s S,
    /// How often the claim asked the database which unsettled entries are still current.
    current_reads: AtomicUsize,
    /// How often the claim tried to charge a takeover.
    charges: AtomicUsize,
    /// How often the claim searched free lanes, and handed lanes back.
    searches: AtomicUsize,
    hand_backs: AtomicUsize,
    /// How often the claim wrote lane records.
    records: AtomicUsize,
}

impl<'s, B, S> Faulty<'s, B, S> {
    fn new(inner: B, fault: Fault, store: &'s S) -> Self {
        let count = || AtomicUsize::new(0);
        Self { inner, fault, store, current_reads: count(), charges: count(), searches: count(), hand_backs: count(), records: count() }
    }
}

fn injected() -> StoreError {
    StoreError::Corrupt("injected fault".to_string())
}

impl<B: ClaimBackend + Send, S: Store> ClaimBackend for Faulty<'_, B, S> {
    async fn unpark(&self, handlers: &[String], scope: &Unpark) -> Result<HashMap<HandlerKey, DeliveryId>, StoreError> {
        self.inner.unpark(handlers, scope).await
    }
    async fn lanes(&self, ids: &[LaneId]) -> Result<Vec<LaneState>, StoreError> {
        self.inner.lanes(ids).await
    }
    async fn free_lanes_with_due_work(
        &self,
        handlers: &[String],
        due: DueWork<'_>,
        count: usize,
        wanted: usize,
    ) -> Result<Vec<(LaneId, usize)>, StoreError> {
        self.searches.fetch_add(1, Ordering::SeqCst);
        self.inner.free_lanes_with_due_work(handlers, due, count, wanted).await
    }
    async fn take_lanes(&self, lanes: &[LaneId], holder: &Holder, now: DateTime, until: DateTime) -> Result<Vec<LaneState>, StoreError> {
        let taken = self.inner.take_lanes(lanes, holder, now, until).await?;
        match self.fault {
            Fault::FailAfterTake => Err(injected()),
            _ => Ok(taken),
        }
    }
    async fn take_listing(
        &self,
        lanes: &[(LaneId, Vec<InFlight>)],
        holder: &Holder,
        now: DateTime,
        until: DateTime,
        write: LaneWrite,
    ) -> Result<Vec<(LaneId, i64)>, StoreError> {
        let taken = self.inner.take_listing(lanes, holder, now, until, write).await?;
        match self.fault {
            Fault::FailAfterRecord => Err(injected()),
            _ => Ok(taken),
        }
    }
    async fn charge_lost(&self, entries: &[InFlight], now: DateTime) -> Result<(), StoreError> {
        self.charges.fetch_add(1, Ordering::SeqCst);
        match self.fault {
            Fault::FailCharge => Err(injected()),
            Fault::HoldCharge => std::future::pending().await,
            _ => self.inner.charge_lost(entries, now).await,
        }
    }
    async fn record_starts(&self, holder: &Holder, lanes: &[(LaneId, i64, Vec<DeliveryId>)]) -> Result<Vec<bool>, StoreError> {
        self.inner.record_starts(holder, lanes).await
    }
    async fn current(&self, entries: &[InFlight]) -> Result<HashSet<DeliveryId>, StoreError> {
        self.current_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.current(entries).await
    }
    async fn candidates(
        &self,
        lanes: &[LaneId],
        handlers: &[String],
        now: DateTime,
        read: CandidateRead<'_>,
        limit: usize,
    ) -> Result<Vec<Candidate>, StoreError> {
        self.inner.candidates(lanes, handlers, now, read, limit).await
    }
    async fn key_heads(&self, keys: &[HandlerKey]) -> Result<HashMap<HandlerKey, DeliveryId>, StoreError> {
        self.inner.key_heads(keys).await
    }
    async fn park(&self, ids: &[DeliveryId]) -> Result<(), StoreError> {
        self.inner.park(ids).await
    }
    async fn record(&self, holder: &Holder, records: &[LaneRecord], write: LaneWrite) -> Result<Vec<bool>, StoreError> {
        let first = self.records.fetch_add(1, Ordering::SeqCst) == 0;
        match &self.fault {
            Fault::LoseFirstRecord if first => {
                let ids: Vec<LaneId> = records.iter().map(|record| record.lane).collect();
                let before = self.inner.lanes(&ids).await?;
                let flags = self.inner.record(holder, records, write).await?;
                let restored: Vec<LaneRecord> = before
                    .into_iter()
                    .map(|lane| LaneRecord {
                        lane: lane.id,
                        epoch: lane.epoch,
                        in_flight: lane.in_flight,
                        lease_until: lane.lease_expires_at,
                        takes_free_at: None,
                    })
                    .collect();
                self.inner.record(holder, &restored, LaneWrite::Applied).await?;
                Ok(flags)
            }
            Fault::DieBeforeRecord => Err(injected()),
            Fault::FailAfterRecord => {
                self.inner.record(holder, records, write).await?;
                Err(injected())
            }
            Fault::RequeueBeforeRecord(id) => {
                self.store.requeue(id, DateTime::from_millis(T0 + 1)).await?;
                self.inner.record(holder, records, write).await
            }
            Fault::Nothing | Fault::FailAfterTake | Fault::FailCharge | Fault::HoldCharge | Fault::LoseFirstRecord => {
                self.inner.record(holder, records, write).await
            }
        }
    }
    async fn hand_back(&self, holder: &Holder, lanes: &[(LaneId, i64)], now: DateTime) -> Result<(), StoreError> {
        self.hand_backs.fetch_add(1, Ordering::SeqCst);
        self.inner.hand_back(holder, lanes, now).await
    }
    async fn events(&self, ids: &[String]) -> Result<HashMap<String, Document>, StoreError> {
        self.inner.events(ids).await
    }
    async fn requeued_since(&self, since: DateTime) -> Result<bool, StoreError> {
        self.inner.requeued_since(since).await
    }
    async fn give_back(&self, picks: &[(DeliveryId, i64)]) -> Result<(), StoreError> {
        self.inner.give_back(picks).await
    }
    async fn bury_unrunnable(&self, doomed: &[(DeliveryId, i64, String)], now: DateTime) -> Result<(), StoreError> {
        self.inner.bury_unrunnable(doomed, now).await
    }
    async fn reconcile(&self, holder: &Holder, issued: &HashSet<Lease>) -> Result<(), StoreError> {
        match self.fault {
            // A dead process reconciles nothing.
            Fault::DieBeforeRecord => Err(injected()),
            _ => self.inner.reconcile(holder, issued).await,
        }
    }
}

/// Deliveries of `e-1` and `e-2`, in this order, of key `k` to handler `h`.
async fn two_of_one_key<S: Store>(store: &S) {
    run_in_transaction(store, async |tx| {
        for n in 1..=2 {
            store.publish(tx, &NewEvent::new(format!("e-{n}"), "t", doc! {}).with_key("k")).await?;
        }
        Ok(())
    })
    .await
    .unwrap();
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
    store.fan_out(&subscriptions, 10, 0, DateTime::from_millis(T0)).await.unwrap();
}

async fn one_delivery<S: Store>(store: &S) {
    run_in_transaction(store, async |tx| store.publish(tx, &NewEvent::new("e-1", "t", doc! {})).await.map(|_| ()))
        .await
        .unwrap();
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
    store.fan_out(&subscriptions, 10, 0, DateTime::from_millis(T0)).await.unwrap();
}

both_stores!(death_between_takeover_charge_and_record_charges_once, death_between_charge_and_record);
both_stores!(a_claim_failing_after_its_record_reconciles, failure_after_record);
both_stores!(a_requeue_racing_a_claim_takes_precedence, requeue_during_claim);
both_stores!(a_claim_in_failing_after_the_record_that_took_its_lane_reconciles, failure_after_taking_record);
both_stores!(an_unsettled_lease_is_trusted_for_a_while_then_checked, settled_without_a_reply);
both_stores!(a_hand_out_whose_take_reply_was_lost_reconciles, failure_after_hand_out_take);
both_stores!(a_claim_whose_take_reply_was_lost_charges_the_takeover_and_keeps_the_lane, failure_after_take);
both_stores!(a_hand_out_sent_before_its_commit_gives_word_of_it, early_hand_outs);
both_stores!(a_takeover_whose_charge_failed_charges_it_at_the_next_claim, failure_of_charge);
both_stores!(a_charge_kept_waiting_is_tried_again_once_a_second_and_holds_no_claim_up, charge_kept_waiting);
both_stores!(a_stop_before_a_failed_charge_was_made_leaves_it_to_the_next_taker, stop_after_failed_charge);
both_stores!(a_death_before_a_failed_charge_was_made_leaves_it_to_the_next_taker, death_before_failed_charge_was_made);
both_stores!(an_idle_hosts_claim_searches_the_free_lanes_once_and_hands_its_idle_lane_back, idle_claim);
both_stores!(a_plain_hand_out_whose_lists_a_failover_lost_before_its_mark_writes_them_again, lists_lost_before_the_mark);

/// The poll of an idle host is a claim that finds nothing: it costs few round trips, or every
/// event fanned out meanwhile waits for it (a hand-out waits for a claim of its host).
async fn idle_claim<S: Store + Parts>(a: &S, b: &S, _c: &S) {
    let handlers = vec!["h".to_string()];
    one_delivery(a).await;
    let claimed = a.claim(&handlers, 10, DateTime::from_millis(T0)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    a.complete_many(&[claimed[0].lease], DateTime::from_millis(T0 + 1)).await.unwrap();
    // b is live too: a's search covers its own free lanes and b's stale work at once.
    for host in [a, b, a] {
        host.announce(DateTime::from_millis(T0 + 2)).await.unwrap();
    }
    let (backend, claimer) = a.parts();
    let faulty = Faulty::new(backend, Fault::Nothing, a);
    let idle = claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 10, DateTime::from_millis(T0 + 3)).await.unwrap();
    assert!(idle.is_empty());
    let calls = (faulty.searches.load(Ordering::SeqCst), faulty.hand_backs.load(Ordering::SeqCst));
    assert_eq!(calls, (1, 1), "one search and one hand-back");
    let lane = faulty.lanes(&[claimed[0].lease.lane]).await.unwrap().remove(0);
    assert!(lane.owner.is_none() && lane.in_flight.is_empty(), "the idle lane is free again: {lane:?}");
}

async fn requeue_during_claim<S: Store + Parts>(a: &S, b: &S, _c: &S) {
    let handlers = vec!["h".to_string()];
    two_of_one_key(a).await;
    let first = a.claim(&handlers, 1, DateTime::from_millis(T0)).await.unwrap().remove(0);
    assert_eq!(first.event.sequence, Some(1));
    a.bury(&first.lease, "poison", true, DateTime::from_millis(T0)).await.unwrap();
    // Once a's lease ran out, b's claim picks sequence 2; the operator requeues sequence 1
    // before it is recorded.
    let later = |ms: i64| DateTime::from_millis(T0 + 31_000 + ms);
    let (backend, claimer) = b.parts();
    let faulty = Faulty::new(backend, Fault::RequeueBeforeRecord(first.lease.delivery.to_hex()), b);
    let claimed = claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 10, later(0)).await.unwrap();
    assert!(claimed.is_empty(), "sequence 2 was overtaken by the requeued sequence 1");
    // Its key waits for a claim once sequence 1 settles: that settling asks for one.
    assert!(claimer.followers_may_wait(&("h".to_string(), "k".to_string())), "the overtaken key is awaited");
    let next = b.claim(&handlers, 10, later(1)).await.unwrap();
    assert_eq!(next.iter().map(|c| c.event.sequence).collect::<Vec<_>>(), [Some(1)]);
    assert_eq!(next[0].attempts, 0);
}

async fn death_between_charge_and_record<S: Store + Parts>(a: &S, b: &S, c: &S) {
    let handlers = vec!["h".to_string()];
    one_delivery(a).await;
    assert_eq!(a.claim(&handlers, 1, DateTime::from_millis(T0)).await.unwrap().len(), 1);
    // a dies; b takes the lane over, charges a's attempt, and dies before recording.
    let (backend, claimer) = b.parts();
    let faulty = Faulty::new(backend, Fault::DieBeforeRecord, b);
    assert!(claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 1, DateTime::from_millis(T0 + 31_000)).await.is_err());
    // c takes over after b's lease expired: the lane still lists a's claim, which must not
    // be charged a second time.
    let claimed = c.claim(&handlers, 1, DateTime::from_millis(T0 + 62_000)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].attempts, 1, "the lost attempt is charged exactly once");
}

async fn failure_after_taking_record<S: Store + Parts>(a: &S, _b: &S, c: &S) {
    let handlers = vec!["h".to_string()];
    one_delivery(a).await;
    let lane = crate::lane::lane_for_event("e-1", None);
    let (backend, claimer) = a.parts();
    let faulty = Faulty::new(backend, Fault::FailAfterRecord, a);
    // The lane was free: the record itself took it, and then the claim failed.
    assert!(claimer.claim(&faulty, &handlers, LaneSearch::Only(&[lane]), 1, DateTime::from_millis(T0)).await.is_err());
    only_its_holder_claims_it_again_uncharged(a, c, lane).await;
}

/// The lane is `holder`'s, and it claims the delivery there again at once, under a new claim
/// generation and with no attempt charged; `other` sees nothing meanwhile.
async fn only_its_holder_claims_it_again_uncharged<S: Store>(holder: &S, other: &S, lane: LaneId) {
    let handlers = vec!["h".to_string()];
    assert!(other.claim(&handlers, 1, DateTime::from_millis(T0 + 1)).await.unwrap().is_empty());
    let claimed = holder.claim(&handlers, 1, DateTime::from_millis(T0 + 2)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].lease.lane, lane);
    assert_eq!(claimed[0].attempts, 0);
    assert_eq!(claimed[0].lease.claims, 1);
}

async fn failure_after_hand_out_take<S: Store + Parts>(a: &S, _b: &S, c: &S) {
    one_delivery(a).await;
    let lane = crate::lane::lane_for_event("e-1", None);
    let now = DateTime::from_millis(T0);
    let (backend, claimer) = a.parts();
    let fresh = vec![fresh(&backend, now).await];
    let faulty = Faulty::new(backend, Fault::FailAfterRecord, a);
    // The take that lists the delivery reached the database; its reply did not.
    let write = async { Ok(|_: &HashSet<DeliveryId>| std::future::ready(Ok(()))) };
    assert!(claimer.hand_out(&faulty, fresh, &claimer.before_idle_read().await, write, None, now).await.is_err());
    only_its_holder_claims_it_again_uncharged(a, c, lane).await;
}

async fn failure_after_take<S: Store + Parts>(a: &S, b: &S, c: &S) {
    let handlers = vec!["h".to_string()];
    one_delivery(a).await;
    let lane = crate::lane::lane_for_event("e-1", None);
    assert_eq!(a.claim(&handlers, 1, DateTime::from_millis(T0)).await.unwrap().len(), 1);
    // a dies; b's take of the lane, after a's lease expired, reached the database, and its
    // reply did not.
    let (backend, claimer) = b.parts();
    let faulty = Faulty::new(backend, Fault::FailAfterTake, b);
    let later = |ms| DateTime::from_millis(T0 + 31_000 + ms);
    assert!(claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 1, later(0)).await.is_err());
    // The lane is b's, and b claims the delivery there at once, with a's lost attempt charged
    // once; c sees nothing meanwhile.
    assert!(c.claim(&handlers, 1, later(1)).await.unwrap().is_empty());
    let claimed = b.claim(&handlers, 1, later(2)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].lease.lane, lane);
    assert_eq!(claimed[0].attempts, 1, "the lost attempt is charged exactly once");
}

/// a runs e-1, handed out by its fan-out (in MongoDB without a document), and dies; b takes
/// a's lane over after its lease expired, and the charge of a's run fails, so the lane sits
/// that claim out. Returns the time of that claim plus `ms`, and a's lease.
async fn lost_run_whose_charge_failed<S: Store + Parts>(a: &S, b: &S) -> (impl Fn(i64) -> DateTime, Lease) {
    run_in_transaction(a, async |tx| a.publish(tx, &NewEvent::new("e-1", "t", doc! {})).await.map(|_| ()))
        .await
        .unwrap();
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
    let handed = a.fan_out(&subscriptions, 10, 10, DateTime::from_millis(T0)).await.unwrap().claimed;
    assert_eq!(handed.len(), 1);
    let (backend, claimer) = b.parts();
    let faulty = Faulty::new(backend, Fault::FailCharge, b);
    let later = |ms| DateTime::from_millis(T0 + 31_000 + ms);
    let handlers = vec!["h".to_string()];
    assert!(claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 1, later(0)).await.unwrap().is_empty());
    (later, handed[0].lease)
}

async fn failure_of_charge<S: Store + Parts>(a: &S, b: &S, c: &S) {
    let handlers = vec!["h".to_string()];
    let (later, lost) = lost_run_whose_charge_failed(a, b).await;
    // The lane waits, and says so (the `/metrics` gauge).
    assert_eq!(b.parts().1.lanes_waiting_for_charge(), 1);
    // Its lane is b's: a's late completion counts for nothing, though the charge that gives
    // the delivery its record (both stores hand it out without one) is not made yet.
    assert_eq!(a.complete_many(&[lost], later(1)).await.unwrap(), [Settlement::LeaseLost]);
    // The lane is b's, and so is the charge: its next claims make it, then run e-1 again;
    // nobody else sees it meanwhile.
    assert!(c.claim(&handlers, 1, later(1)).await.unwrap().is_empty());
    let mut claimed = Vec::new();
    for ms in 2..5 {
        claimed.extend(b.claim(&handlers, 1, later(ms)).await.unwrap());
    }
    assert_eq!(b.parts().1.lanes_waiting_for_charge(), 0);
    assert_eq!(claimed.len(), 1, "e-1 runs again");
    assert_eq!(claimed[0].attempts, 1, "the lost attempt is charged exactly once");
}

async fn charge_kept_waiting<S: Store + Parts>(a: &S, b: &S, _c: &S) {
    run_in_transaction(a, async |tx| a.publish(tx, &NewEvent::new("e-1", "t", doc! {})).await.map(|_| ())).await.unwrap();
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
    assert_eq!(a.fan_out(&subscriptions, 10, 10, DateTime::from_millis(T0)).await.unwrap().claimed.len(), 1);
    // a dies running e-1; b's charge of it waits for good (a lock of a's that nobody ends).
    let (backend, claimer) = b.parts();
    let faulty = Faulty::new(backend, Fault::HoldCharge, b);
    let later = |ms| DateTime::from_millis(T0 + 31_000 + ms);
    let handlers = vec!["h".to_string()];
    let claim = async |ms| claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 1, later(ms)).await.unwrap();
    assert!(claim(0).await.is_empty(), "its lane sits the claim out");
    assert_eq!((faulty.charges.load(Ordering::SeqCst), claimer.lanes_waiting_for_charge()), (1, 1));
    // Later claims try it again once a second, each for a moment only.
    let started = std::time::Instant::now();
    for ms in [1, 2, 500, 999, 1_001, 1_500] {
        assert!(claim(ms).await.is_empty());
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(2), "no claim waited long: {:?}", started.elapsed());
    assert_eq!((faulty.charges.load(Ordering::SeqCst), claimer.lanes_waiting_for_charge()), (3, 1), "tried at 1 and 1,001 ms");
    // Once the lock is gone, the next try charges it and e-1 runs again.
    let claimed = b.claim(&handlers, 1, later(2_100)).await.unwrap();
    assert_eq!(claimer.lanes_waiting_for_charge(), 0);
    assert_eq!(claimed.iter().map(|c| (c.event.id.as_str(), c.attempts)).collect::<Vec<_>>(), [("e-1", 1)]);
}

async fn stop_after_failed_charge<S: Store + Parts>(a: &S, b: &S, c: &S) {
    let (later, _) = lost_run_whose_charge_failed(a, b).await;
    // b stops before charging: the lane it gives back still lists a's run, for the next taker.
    b.relinquish().await.unwrap();
    let claimed = c.claim(&["h".to_string()], 1, later(1)).await.unwrap();
    assert_eq!(claimed.len(), 1, "e-1 runs again");
    assert_eq!(claimed[0].attempts, 1, "the lost attempt is charged exactly once");
}

async fn death_before_failed_charge_was_made<S: Store + Parts>(a: &S, b: &S, c: &S) {
    let (later, _) = lost_run_whose_charge_failed(a, b).await;
    // b dies before charging: once its lease ran out, c takes the lane over, with a's run
    // still listed, and charges it once.
    let claimed = c.claim(&["h".to_string()], 1, later(31_000)).await.unwrap();
    assert_eq!(claimed.len(), 1, "e-1 runs again");
    assert_eq!(claimed[0].attempts, 1, "the lost attempt is charged exactly once");
}

/// The delivery of `e-1` as a fan-out that just wrote it would hand it out.
async fn fresh<B: ClaimBackend>(backend: &B, now: DateTime) -> super::Fresh {
    let lane = crate::lane::lane_for_event("e-1", None);
    let handlers = vec!["h".to_string()];
    let candidate = backend.candidates(&[lane], &handlers, now, CandidateRead::plain(&HashSet::new()), 10).await.unwrap().remove(0);
    let event = crate::event::EventRecord::from_document(&backend.events(&["e-1".to_string()]).await.unwrap()["e-1"]).unwrap();
    super::Fresh { candidate, event }
}

/// A plain fan-out listed its run in a lane it held, and the list was acknowledged; then a
/// failover lost the list, while the mark landed on the next primary, late. The hand-out writes
/// the list again before it runs anything, so a takeover after its host's death finds the run
/// and charges it.
async fn lists_lost_before_the_mark<S: Store + Parts>(a: &S, _b: &S, c: &S) {
    let handlers = vec!["h".to_string()];
    run_in_transaction(a, async |tx| {
        for id in ["e-0", "e-1"] {
            a.publish(tx, &NewEvent::new(id, "t", doc! {})).await?;
        }
        Ok(())
    })
    .await
    .unwrap();
    let now = DateTime::from_millis(T0);
    // a holds e-0's lane, and knows its list: it claimed e-0 there.
    let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
    a.fan_out(&subscriptions, 1, 0, now).await.unwrap();
    let held = a.claim(&handlers, 1, now).await.unwrap();
    assert_eq!(held.iter().map(|c| c.event.id.as_str()).collect::<Vec<_>>(), ["e-0"]);
    let (backend, claimer) = a.parts();
    let fan_out = bson::oid::ObjectId::new();
    let event = crate::event::EventRecord::from_document(&backend.events(&["e-1".to_string()]).await.unwrap()["e-1"]).unwrap();
    let candidate = Candidate {
        id: bson::oid::ObjectId::new(),
        event_id: "e-1".to_string(),
        handler: "h".to_string(),
        key: None,
        group: None,
        priority: None,
        lane: crate::lane::lane_for_event("e-1", None),
        due_at: now,
        claims: 0,
        attempts: 0,
        unstored: Some(super::HandOutOf { event: bson::Bson::String("e-1".to_string()), fan_out: Some(fan_out) }),
        started: true,
        suspect: false,
        before_commit: None,
    };
    let run = candidate.id;
    let faulty = Faulty::new(backend, Fault::LoseFirstRecord, a);
    let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
    // The mark lands late, as one held up by a failover does.
    let mark = || async move {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        Ok(if a.mark_late("e-1", "h", fan_out, now).await { HashSet::from([run]) } else { HashSet::new() })
    };
    let fresh = vec![super::Fresh { candidate, event }];
    assert_eq!(claimer.hand_out_listed_first(&faulty, fresh, mark, &early, now).await.unwrap(), Some(vec![run]));
    let handed = sent.try_recv().unwrap();
    assert!(handed[0].before_commit.clone().expect("the mark's word").committed().await, "handed out");
    let lane = held[0].lease.lane;
    let listed = faulty.lanes(&[lane]).await.unwrap().remove(0).in_flight;
    assert!(listed.iter().any(|entry| entry.delivery == run), "listed again: {listed:?}");
    // a dies: its lane's next holder charges both runs (e-1's gets its document in its own
    // event's lane, which the next claim takes), and runs them again.
    let later = DateTime::from_millis(T0 + 31_000);
    let mut again = c.claim(&handlers, 10, later).await.unwrap();
    again.extend(c.claim(&handlers, 10, later).await.unwrap());
    let mut runs: Vec<(&str, u32)> = again.iter().map(|c| (c.event.id.as_str(), c.attempts)).collect();
    runs.sort();
    assert_eq!(runs, [("e-0", 1), ("e-1", 1)]);
}

async fn early_hand_outs<S: Store + Parts>(a: &S, _b: &S, c: &S) {
    one_delivery(a).await;
    let (backend, claimer) = a.parts();
    let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
    // The fan-out's first stage and the lane list were written, and then the commit failed.
    let now = DateTime::from_millis(T0);
    let failing = async { Ok(|_: &HashSet<DeliveryId>| async { Err::<(), _>(injected()) }) };
    assert!(claimer.hand_out(&backend, vec![fresh(&backend, now).await], &claimer.before_idle_read().await, failing, Some(&early), now).await.is_err());
    let handed = sent.try_recv().expect("handed out before the commit");
    assert_eq!(handed.len(), 1);
    let word = handed[0].before_commit.clone().expect("handed out before the commit, with its word");
    assert!(!word.committed().await, "its runs hear that the commit failed");
    // Handed back as not run, it is handed out again (uncharged), this time committed.
    assert_eq!(a.release(&[handed[0].lease], DateTime::from_millis(T0 + 1)).await.unwrap(), 1);
    let now = DateTime::from_millis(T0 + 2);
    let committing = async { Ok(|_: &HashSet<DeliveryId>| async { Ok(()) }) };
    let done = claimer.hand_out(&backend, vec![fresh(&backend, now).await], &claimer.before_idle_read().await, committing, Some(&early), now).await.unwrap();
    let handed = sent.try_recv().expect("handed out before the commit");
    assert!(done.claimed.is_empty());
    assert_eq!(done.sent_early, [handed[0].lease.delivery]);
    assert_eq!(handed[0].attempts, 0);
    assert!(handed[0].before_commit.clone().expect("its word").committed().await);
    // Its lease is as good as a claim's: nobody else gets it, and it completes it.
    assert!(c.claim(&["h".to_string()], 1, DateTime::from_millis(T0 + 3)).await.unwrap().is_empty());
    let settled = a.complete_many(&[handed[0].lease], DateTime::from_millis(T0 + 4)).await.unwrap();
    assert_eq!(settled, [Settlement::Completed]);
}

async fn failure_after_record<S: Store + Parts>(a: &S, _b: &S, c: &S) {
    let handlers = vec!["h".to_string()];
    one_delivery(a).await;
    let (backend, claimer) = a.parts();
    let faulty = Faulty::new(backend, Fault::FailAfterRecord, a);
    assert!(claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 1, DateTime::from_millis(T0)).await.is_err());
    // Reconciled: the same instance claims it again at once, under a new claim generation,
    // with no attempt charged; the unissued lease of the failed claim matches nothing.
    let claimed = a.claim(&handlers, 1, DateTime::from_millis(T0 + 1)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].attempts, 0);
    assert_eq!(claimed[0].lease.claims, 1);
    // Nobody else sees it while a holds it.
    assert!(c.claim(&handlers, 1, DateTime::from_millis(T0 + 2)).await.unwrap().is_empty());
}

async fn settled_without_a_reply<S: Store + Parts>(a: &S, _b: &S, _c: &S) {
    let handlers = vec!["h".to_string()];
    two_of_one_key(a).await;
    let first = a.claim(&handlers, 10, DateTime::from_millis(T0)).await.unwrap();
    assert_eq!(first.iter().map(|c| c.event.sequence).collect::<Vec<_>>(), [Some(1)]);
    let lease = first[0].lease;
    a.complete_many(&[lease], DateTime::from_millis(T0 + 1)).await.unwrap();
    // The completion was written but its reply never came: the instance still counts the
    // lease as issued to a run of its own.
    let (backend, claimer) = a.parts();
    claimer.lose_settlement_reply(lease, Some(("h".to_string(), "k".to_string())), DateTime::from_millis(T0));
    let faulty = Faulty::new(backend, Fault::Nothing, a);
    let soon = claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 10, DateTime::from_millis(T0 + 1_000)).await.unwrap();
    assert!(soon.is_empty(), "a young unsettled lease keeps its key busy");
    assert_eq!(faulty.current_reads.load(Ordering::SeqCst), 0, "young leases are trusted without a read");
    let later = claimer.claim(&faulty, &handlers, LaneSearch::FreeWithDueWork, 10, DateTime::from_millis(T0 + 2_500)).await.unwrap();
    assert_eq!(faulty.current_reads.load(Ordering::SeqCst), 1, "an older one is checked");
    assert_eq!(later.iter().map(|c| c.event.sequence).collect::<Vec<_>>(), [Some(2)], "and found gone, so the key moves on");
    assert!(!claimer.issued(&lease));
}
