//! The claim loop's state (`dispatcher.rs`): what runs, what the next step should look for,
//! the background fan-out and completions. It only holds the state; the loop's steps change it.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::Instant;

use super::completion::Completions;
use super::fan_out_task::FannedOut;
use super::runner::RunResult;
use super::sequence_watch::SequenceWatch;
use super::starts::StartRecorder;
use super::global_limits::GlobalShares;
use super::throttle::StartWindows;
use crate::lane::LaneId;
use crate::store::{ClaimedDelivery, DeliveryId, Lease, Store, StoreError};

/// A claimed delivery, running or waiting for a run slot.
pub(super) struct Running {
    pub(super) lease: Lease,
    pub(super) handler: String,
    pub(super) renew: bool,
    pub(super) task: AbortHandle,
}

/// Loop state the settle and stop steps share.
pub(super) struct Flight<S: Store> {
    /// Claimed deliveries, running or waiting for a run slot.
    pub(super) running: HashMap<DeliveryId, Running>,
    /// When a claim may find work it could not take before, earliest first: the due times of
    /// retries this dispatcher scheduled.
    pub(super) claim_timers: BinaryHeap<Reverse<Instant>>,
    /// The starts of each rate-limited handler in its window, shared with the runs waiting
    /// for theirs.
    pub(super) start_windows: StartWindows,
    /// The gates of handlers limited across hosts, and this host's shares of their limits.
    pub(super) global_shares: GlobalShares,
    /// When the gates of handlers limited across hosts ask their limiters again, if they lack
    /// something.
    pub(super) ask_limiters_at: Option<Instant>,
    /// The throttled handlers whose room the last claim filled: a run of theirs that ends asks
    /// for a claim.
    pub(super) rooms_filled: HashSet<String>,
    /// What the next step should look for. A claim costs several round trips, so the loop
    /// claims only when something may have become claimable.
    pub(super) fan_out: bool,
    pub(super) claim: bool,
    /// The last claim filled all the free capacity: more may be waiting.
    pub(super) backlog: bool,
    /// The last fan-out handed out a full batch: the unfanned events behind it are fanned out
    /// once there is capacity worth a claim, each batch handed out as a whole, instead of all
    /// at once into deliveries left to claims (a hand-out costs a store less than a claim;
    /// in MongoDB it writes no delivery document at all).
    pub(super) fan_out_waits: bool,
    /// The fan-out running in the background, if any.
    pub(super) fanning: Option<JoinHandle<Result<FannedOut, StoreError>>>,
    /// Its first batch, which may hand out, is under way.
    pub(super) fanning_hands_out: Arc<AtomicBool>,
    /// Asks the background fan-out to end after its current batch (a stop).
    pub(super) stop_fanning: Arc<AtomicBool>,
    /// Deliveries fan-outs handed out, started by the next dispatch step (those handed out
    /// before their fan-out's commit carry its word).
    pub(super) handed_out: Vec<ClaimedDelivery>,
    /// Where fan-outs send what they hand out before their commit.
    pub(super) early: UnboundedReceiver<Vec<ClaimedDelivery>>,
    /// Lanes a fan-out just put a few new deliveries in: the next claim looks only there.
    pub(super) claim_lanes: BTreeSet<LaneId>,
    /// Successful runs, completed in batches in the background.
    pub(super) completions: Completions<S>,
    /// Finished runs whose outcome could not be written yet; still in `running`.
    pub(super) unsettled: Vec<(ClaimedDelivery, RunResult)>,
    /// Records the starts of suspects claimed ahead, before they run.
    pub(super) starts: StartRecorder,
    /// Reports keyed deliveries that start out of their key's sequence order.
    pub(super) sequences: SequenceWatch,
}

impl<S: Store> Flight<S> {
    pub(super) fn new(completions: Completions<S>, starts: StartRecorder, early: UnboundedReceiver<Vec<ClaimedDelivery>>) -> Self {
        Self {
            early,
            running: HashMap::new(),
            claim_timers: BinaryHeap::new(),
            start_windows: StartWindows::default(),
            rooms_filled: HashSet::new(),
            global_shares: GlobalShares::default(),
            ask_limiters_at: None,
            fan_out: true,
            claim: true,
            backlog: false,
            fan_out_waits: false,
            fanning: None,
            fanning_hands_out: Arc::default(),
            stop_fanning: Arc::default(),
            handed_out: Vec::new(),
            claim_lanes: BTreeSet::new(),
            completions,
            unsettled: Vec::new(),
            starts,
            sequences: SequenceWatch::default(),
        }
    }
}
