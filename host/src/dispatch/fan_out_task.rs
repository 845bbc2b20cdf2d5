//! The dispatcher's background fan-out: batches one after the other until a short one says
//! nothing is left; a fan-out that may hand out is its first batch alone. The loop is woken
//! after each full batch. It owns when a fan-out ends and what it reports back;
//! it must never start a run (the loop starts what it hands out).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bson::DateTime;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::completion::step_result;
use crate::lane::LaneId;
use crate::store::{Capacity, ClaimedDelivery, EarlyHandOuts, Store, StoreError, Subscriptions};

/// How a background fan-out ended.
pub(super) struct FannedOut {
    /// Its last batch made new deliveries that are left to a claim.
    pub(super) new_deliveries: bool,
    /// Their lanes, when it was one batch touching at most [`CLAIM_IN_MAX_LANES`] lanes.
    pub(super) lanes: Option<BTreeSet<LaneId>>,
    /// What its first batch handed out (see [`Outbox::fan_out`]): claimed, to be run.
    pub(super) claimed: Vec<ClaimedDelivery>,
    /// Its last batch was full (it stopped early to hand out, or for a stop): more may wait.
    pub(super) more: bool,
    /// Its one batch, which may hand out, was full: the next waits for room (see
    /// [`FanOutTask::spawn`]).
    pub(super) handed_out_full: bool,
}

/// Malformed events a fan-out names in its log, at most; the rest are counted.
const MALFORMED_LOGGED: usize = 10;

/// Says which events a fan-out found malformed (their deliveries are dead, and announced).
fn log_malformed(malformed: &[(String, String)]) {
    for (event, reason) in malformed.iter().take(MALFORMED_LOGGED) {
        tracing::warn!(event = %event, %reason, "a malformed event was dead-lettered at fan-out");
    }
    if malformed.len() > MALFORMED_LOGGED {
        tracing::warn!(more = malformed.len() - MALFORMED_LOGGED, "more malformed events were dead-lettered at fan-out");
    }
}

/// A fan-out that touched at most this many lanes is followed by a claim in just those.
const CLAIM_IN_MAX_LANES: usize = 8;

/// What a background fan-out is given.
pub(super) struct FanOutTask<S: Store> {
    pub store: Arc<S>,
    /// Events per batch, at most.
    pub batch: usize,
    pub subscriptions: Subscriptions,
    /// Woken after every full batch, so that claims take its deliveries meanwhile.
    pub fanned: Arc<Notify>,
    pub early: EarlyHandOuts,
    /// Cleared once its first batch, the one that may hand out, is done.
    pub hands_out: Arc<AtomicBool>,
    /// Asks it to end after its current batch.
    pub stop: Arc<AtomicBool>,
}

impl<S: Store> FanOutTask<S> {
    /// Fans out until a short batch says nothing is left, waking the loop after every full
    /// batch so that claims take the new deliveries while the rest is still being fanned out.
    /// Given a `hand_out` budget, its first batch is of at most that many events, and hands out
    /// up to that many of their deliveries (the rest waits behind a predecessor, or in a lane
    /// another host holds, for its claims); the fan-out ends there, whatever it handed out, so
    /// that they run at once (the loop fans out again if the batch was full, once there is
    /// room).
    ///
    /// Under priorities, the rest of the backlog is fanned out for claims after that first
    /// batch: a claim takes the higher priorities first only among what is fanned out.
    pub(super) fn spawn(self, mut hand_out: Capacity) -> JoinHandle<Result<FannedOut, StoreError>> {
        let Self { store, batch, subscriptions, fanned, early, hands_out, stop } = self;
        tokio::spawn(async move {
            let started = Instant::now();
            let mut first = true;
            let mut claimed = Vec::new();
            loop {
                let batch_started = Instant::now();
                // A batch that may hand out is no bigger than what it may hand out: the rest
                // would be left to claims.
                let batch = if hand_out.total > 0 { batch.min(hand_out.total) } else { batch };
                let report = store.fan_out_early(&subscriptions, batch, hand_out.clone(), &early, DateTime::now()).await?;
                let handed_out = report.claimed.len() + report.sent_early;
                log_malformed(&report.malformed_events);
                tracing::trace!(
                    elapsed_us = batch_started.elapsed().as_micros() as u64,
                    count = report.deliveries,
                    handed_out,
                    "fan-out batch"
                );
                let full = report.events >= batch || report.more;
                // A batch that may hand out is the whole fan-out, whatever it handed out: the
                // next batch waits for room to hand out too. What it could not hand out (behind
                // a predecessor, in a lane another host holds) has documents, for claims. A
                // first batch that met other hosts' lanes, or lost its mark to another host's
                // fan-out, and then sent the rest of the backlog to claims wrote a document for
                // each: hosts started together, or one joining a running drain, each fan out
                // their first view of the split for a moment (a four-host keyed drain at 0.35x
                // one host's, 4.7 documents written per delivery; two hosts, one joining
                // 300 ms in, 0.6x and 5.3). Only a fan-out given no room to hand out (after
                // its first batch, or from the start) fans the backlog out for claims.
                let may_hand_out = hand_out.total > 0 && hand_out.priorities.is_empty();
                hands_out.store(false, Ordering::SeqCst);
                claimed.extend(report.claimed);
                if !full || may_hand_out || stop.load(Ordering::Relaxed) {
                    tracing::trace!(elapsed_us = started.elapsed().as_micros() as u64, "fanned out");
                    let few = first && report.lanes.len() <= CLAIM_IN_MAX_LANES;
                    return Ok(FannedOut {
                        new_deliveries: !report.lanes.is_empty(),
                        lanes: few.then_some(report.lanes),
                        claimed,
                        more: full,
                        handed_out_full: full && may_hand_out,
                    });
                }
                if report.deliveries > 0 {
                    fanned.notify_one();
                }
                first = false;
                hand_out = Capacity::from(0);
            }
        })
    }
}

/// How the background fan-out ended; never resolves while none runs.
pub(super) async fn join_fan_out<T>(task: &mut Option<JoinHandle<Result<T, StoreError>>>) -> Result<T, StoreError> {
    match task {
        Some(task) => step_result(task.await, "the fan-out"),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use crate::store::{Administration, Outbox};
    use super::*;
    use crate::event::NewEvent;
    use crate::lane::lane_for_event;
    use crate::store::memory::MemoryStore;
    use crate::store::{StoreOptions, Subscription, run_in_transaction};

    /// This host's store, the subscriptions, and a lane another host holds (it runs an event
    /// there).
    async fn a_lane_another_host_holds() -> (Arc<MemoryStore>, Subscriptions, LaneId) {
        let here = Arc::new(MemoryStore::new(StoreOptions::default()));
        let there = here.instance("there");
        let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
        publish(&here, vec!["theirs".to_string()]).await;
        there.fan_out(&subscriptions, 10, 0, DateTime::now()).await.unwrap();
        assert_eq!(there.claim(&["h".to_string()], 1, DateTime::now()).await.unwrap().len(), 1);
        (here, subscriptions, lane_for_event("theirs", None))
    }

    async fn publish(store: &MemoryStore, ids: Vec<String>) {
        run_in_transaction(store, async |tx| {
            for id in &ids {
                store.publish(tx, &NewEvent::new(id.clone(), "t", bson::doc! {})).await?;
            }
            Ok(())
        })
        .await
        .unwrap();
    }

    /// `count` event ids starting with `prefix` whose lane is `lane`.
    fn ids_in(lane: LaneId, prefix: &str, count: usize) -> Vec<String> {
        (0..).map(|i| format!("{prefix}-{i}")).filter(|id| lane_for_event(id, None) == lane).take(count).collect()
    }

    /// A fan-out of batches of 10 that may hand out 10, run to its end, and how many it
    /// handed out (after its commit, or sent early).
    async fn fan_out(here: &Arc<MemoryStore>, subscriptions: Subscriptions) -> (FannedOut, usize) {
        let (early, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        let task = FanOutTask {
            store: here.clone(),
            batch: 10,
            subscriptions,
            fanned: Arc::new(Notify::new()),
            early,
            hands_out: Arc::new(AtomicBool::new(true)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let done = task.spawn(Capacity::from(10)).await.unwrap().unwrap();
        let mut handed_out = done.claimed.len();
        while let Ok(sent) = receiver.try_recv() {
            handed_out += sent.len();
        }
        (done, handed_out)
    }

    /// A first batch whose hand-out met a lane another host holds still hands out the rest
    /// of what it made, and the fan-out ends there (to go on once there is room); it does not
    /// send the rest of the backlog to claims, a document each.
    #[tokio::test]
    async fn a_first_batch_that_met_a_lane_another_host_holds_ends_the_fan_out_rather_than_sending_the_backlog_to_claims() {
        let (here, subscriptions, held) = a_lane_another_host_holds().await;
        // A backlog of 30 whose oldest event (the lowest id, of those published together) falls
        // in that lane.
        publish(&here, ids_in(held, "a", 1).into_iter().chain((1..30).map(|i| format!("e-{i}"))).collect()).await;
        let (done, handed_out) = fan_out(&here, subscriptions).await;
        assert_eq!(handed_out, 9, "the first batch handed out all but the event in the other host's lane");
        assert!(done.handed_out_full, "the next fan-out waits for room");
        assert_eq!(here.unfanned_events().await.unwrap(), 20, "the rest of the backlog waits unfanned");
    }

    /// So does a first batch that could hand out nothing at all, every event of it in lanes
    /// another host holds (as for a host that joined a running drain, whose share's lanes the
    /// others still hold): its next batch may find those lanes free.
    #[tokio::test]
    async fn a_first_batch_that_handed_out_nothing_ends_the_fan_out_too() {
        let (here, subscriptions, held) = a_lane_another_host_holds().await;
        publish(&here, ids_in(held, "a", 10).into_iter().chain((0..20).map(|i| format!("e-{i}"))).collect()).await;
        let (done, handed_out) = fan_out(&here, subscriptions).await;
        assert_eq!(handed_out, 0, "the first batch's lane is another host's");
        assert!(done.handed_out_full, "the next fan-out waits for room");
        assert_eq!(here.unfanned_events().await.unwrap(), 20, "the rest of the backlog waits unfanned");
    }
}
