//! The fan-out, orchestrated once for both stores over the primitives of [`FanOutBackend`]:
//! which committed events become which deliveries ([`planning`], pure), in which of three ways
//! they are written, and what of them is handed out to this instance as they are.
//!
//! - **Handing out** ([`handing_out`]): one transaction reads a batch (or takes the unkeyed
//!   events the store heard of), marks its events (the first stage, which makes this fan-out
//!   the only one of them) while the claimer lists what it hands out, then writes the rest
//!   and commits; the leases are issued after the commit, or sent early after the first stage.
//! - **Plainly** ([`plainly`]): a backlog batch that can be handed out whole, each delivery
//!   without a document, is listed in held lanes first and then marked by plain updates that
//!   each apply only while the event is unfanned: no transaction at all.
//! - **Whole** (in [`fan_out`]): a batch marked and written in a retrying transaction, handing
//!   out nothing: when the host has no room, or after a hand-out that conflicted.
//!
//! The stores own reading, marking and writing; this module owns the order of those steps,
//! what is handed out, and the report. It must never read or write a store but through its
//! backend, nor issue a lease (the claimer does, see `Claimer::issue_leases`).

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use bson::{DateTime, Document};

mod planning;

pub(crate) use planning::*;

use super::claim::{ClaimBackend, Claimer, HandlerKey};
use super::{Capacity, DeliveryId, EarlyHandOuts, FanOutReport, Retrying, StoreError, StoreTransaction, Subscriptions};

/// A batch read, how far the read went ([`Reach`]), and the keys it read apart (see
/// [`Claimer::keys_left_out`]).
pub(crate) struct Read {
    pub batch: Vec<Document>,
    pub reach: Reach,
    pub asked: Vec<String>,
}

/// Whether unfanned events of this host's may remain beyond a batch (`more`: read again at
/// once), whether its read reached the end of the unfanned events (`to_the_end`: a store that
/// hears of new events can trust what it hears again), and the keys whose events it left
/// unfanned because they run here (`deferred`, named only by a read that reached the end of
/// the rest).
#[derive(Debug, Clone, Default)]
pub(crate) struct Reach {
    pub more: bool,
    pub to_the_end: bool,
    pub deferred: Vec<String>,
}

impl Reach {
    /// `report` (of a fan-out of the batch), saying how far its read went.
    pub fn on(self, report: FanOutReport) -> FanOutReport {
        FanOutReport { more: self.more, read_to_the_end: self.to_the_end, deferred_keys: self.deferred, ..report }
    }
}

/// Where a fan-out's batch comes from.
pub(crate) enum Batch {
    /// Unkeyed events the store heard of (MongoDB's change stream), each to be still unfanned.
    Heard(Vec<Document>),
    /// Read from the store, up to this many (and the lower events of their keys).
    Read(usize),
}

/// What a store does for a fan-out.
pub(crate) trait FanOutBackend: Sync {
    /// A fan-out's transaction: its reads see one snapshot, its writes commit together.
    type Tx: StoreTransaction;

    fn claimer(&self) -> &Claimer;

    /// The claim primitives the claimer lists hand-outs with.
    fn lanes(&self) -> impl ClaimBackend + '_;

    /// Whether every completion is to leave a history record: then every delivery needs a
    /// document, and none is handed out without.
    fn completion_history(&self) -> bool;

    /// Whether a batch is worth trying plainly (see [`PlainMarks`]).
    fn plain_marks(&self) -> &PlainMarks;

    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// The next batch of this host's share of the unfanned events (in `tx` if given),
    /// completed with the lowest unfanned events of every key in it; given `hands_out`, less
    /// the keys that run here (see [`prefixes_to_read`]).
    fn read(&self, tx: Option<&mut Self::Tx>, limit: usize, hands_out: bool, now: DateTime)
    -> impl Future<Output = Result<Read, StoreError>> + Send;

    /// Those of `heads` of which nothing is pending.
    fn idle_keys(&self, tx: &mut Self::Tx, heads: Vec<HandlerKey>)
    -> impl Future<Output = Result<HashSet<HandlerKey>, StoreError>> + Send;

    /// The first stage: marks the plan's events fanned out (those still unfanned; how many),
    /// listing in each the handlers of `without` whose deliveries are handed out without a
    /// document, stamped with its fan-out. Once it succeeded no other fan-out of those events
    /// can.
    fn mark(&self, tx: &mut Self::Tx, plan: &FanOutPlan, without: &WithoutDocuments, now: DateTime)
    -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The second stage, before the commit: the documents of every delivery of the plan but
    /// those `handed` out without one, and the dead letters' announcements; those of `without`
    /// not handed out after all leave their events' lists.
    fn write_rest(
        &self,
        tx: &mut Self::Tx,
        plan: &FanOutPlan,
        without: &WithoutDocuments,
        handed: &HashSet<DeliveryId>,
        now: DateTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Marks `events` fanned out by `without`'s fan-out with plain updates, listing its
    /// handlers; returns the events (as [`id_text`] prints them) it marked. An event another
    /// fan-out marked first is left as it is; one this fan-out marked is matched again.
    fn mark_plainly(&self, events: &[FannedEvent], without: &WithoutDocuments, now: DateTime)
    -> impl Future<Output = Result<HashSet<String>, StoreError>> + Send;

    /// The time a hand-out's leases run from, once its batch is read (see MongoDB's).
    fn after_read(&self, now: DateTime) -> DateTime {
        now
    }

    /// A fan-out left events of its batch unfanned, for their keys' heads to settle here.
    fn left_some_unfanned(&self) {}
}

/// Whether a fan-out tries its batch the plain way first ([`plainly`]). A batch that cannot be
/// handed out whole is read twice, so after one whose events do not allow it (keyed events,
/// several handlers, too few run slots, malformed events) the next [`PLAIN_SKIPS`] go
/// straight to the transaction.
#[derive(Debug, Default)]
pub(crate) struct PlainMarks {
    skips: AtomicU64,
}

/// Batches a fan-out reads in a transaction after one whose events could not be handed out
/// whole.
const PLAIN_SKIPS: u64 = 16;

impl PlainMarks {
    fn worth_trying(&self) -> bool {
        self.skips.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |skips| skips.checked_sub(1)).is_err()
    }

    fn skip(&self, batches: u64) {
        self.skips.store(batches, Ordering::SeqCst);
    }
}

/// A fan-out of what is read from the store: handing out up to `hand_out` if it may (plainly
/// first, given `early`), else, or should that conflict with another fan-out, whole.
pub(crate) async fn fan_out<B: FanOutBackend>(
    store: &B,
    subscriptions: &Subscriptions,
    limit: usize,
    hand_out: Capacity,
    early: Option<&EarlyHandOuts>,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    let mut lanes_to_read = Vec::new();
    if hand_out.total > 0 {
        let worth_trying = || !store.completion_history() && store.plain_marks().worth_trying();
        if let Some(early) = early.filter(|_| worth_trying()) {
            match plainly(store, subscriptions, limit, hand_out.clone(), early, now).await {
                Ok(Some(report)) => return Ok(report),
                Ok(None) => {}
                // Nothing of it was written, or what was is handed back: read again.
                Err(error) if error.is_transient() => {}
                Err(error) => return Err(error),
            }
        }
        match handing_out(store, subscriptions, Batch::Read(limit), hand_out.clone(), early, now).await {
            // Another fan-out wrote the same events first: the retrying path sorts it out,
            // and a claim looks at the lanes this one took or listed in.
            Err(error) if error.is_transient() => lanes_to_read = store.claimer().lanes_to_read(),
            done => return done,
        }
    }
    // After a hand-out that failed, the batch read is bounded as that hand-out's was.
    let mut retrying = Retrying::new();
    let mut report = loop {
        let mut tx = store.begin().await?;
        let outcome = async {
            let Read { batch, reach, .. } = store.read(Some(&mut tx), limit, hand_out.total > 0, now).await?;
            let plan = plan(&batch, subscriptions);
            let none = WithoutDocuments::default();
            store.mark(&mut tx, &plan, &none, now).await?;
            store.write_rest(&mut tx, &plan, &none, &HashSet::new(), now).await?;
            Ok(reach.on(plan.report(Vec::new(), &[])))
        }
        .await;
        if let Some(result) = retrying.settle(tx, outcome).await {
            break result?;
        }
    };
    report.lanes.extend(lanes_to_read);
    Ok(report)
}

/// A backlog batch handed out whole without a transaction: read, listed in lanes this
/// instance holds, then marked fanned out by plain updates, its leases sent to `early` once
/// the mark is done. `None`, having written nothing that counts, when the batch cannot be
/// handed out whole (see [`Claimer::hand_out_listed_first`]).
///
/// Every delivery of such a batch is unkeyed, handed out and without a document, so the mark
/// is all a fan-out writes besides the lists, and it needs no transaction: each event is
/// marked by one statement that matches it only while unfanned, so of two racing fan-outs
/// exactly one marks it, and the lists, written first, name every delivery a marked event's
/// `handedOut` lists.
pub(crate) async fn plainly<B: FanOutBackend>(
    store: &B,
    subscriptions: &Subscriptions,
    limit: usize,
    hand_out: Capacity,
    early: &EarlyHandOuts,
    now: DateTime,
) -> Result<Option<FanOutReport>, StoreError> {
    let Read { batch, reach, .. } = store.read(None, limit, true, now).await?;
    let now = store.after_read(now);
    let plan = plan(&batch, subscriptions);
    // Every delivery of such a batch is unkeyed.
    let mut fresh = fresh(&plan, &batch, hand_out, &HashSet::new(), now);
    if plan.events.is_empty() {
        return Ok(Some(reach.on(plan.report(Vec::new(), &[]))));
    }
    if !plan.handed_out_whole_without_documents(&fresh) {
        store.plain_marks().skip(PLAIN_SKIPS);
        return Ok(None);
    }
    let without = WithoutDocuments::of(&plan, &mut fresh);
    let (written, without) = (&plan, &without);
    let mark = || async move {
        let ours = store.mark_plainly(&written.events, without, now).await?;
        Ok(written.deliveries.iter().filter(|d| ours.contains(&id_text(&d.event_id))).map(|d| d.id).collect())
    };
    // `None`: the lanes held have no room for it (the transaction's hand-out takes some), or a
    // claim owns them now.
    let sent = store.claimer().hand_out_listed_first(&store.lanes(), fresh, mark, early, now).await?;
    Ok(sent.map(|sent| reach.on(plan.report(Vec::new(), &sent))))
}

/// One fan-out transaction that hands out what it creates (see [`Claimer::hand_out`]): the
/// lane lists are written while the events are marked. Tried once: an error aborts it, and a
/// conflict leaves the batch to the retrying path.
pub(crate) async fn handing_out<B: FanOutBackend>(
    store: &B,
    subscriptions: &Subscriptions,
    batch: Batch,
    hand_out: Capacity,
    early: Option<&EarlyHandOuts>,
    now: DateTime,
) -> Result<FanOutReport, StoreError> {
    let claimer = store.claimer();
    // Before the transaction's first read, which takes its snapshot (see `KeysBeforeRead`).
    let keys = claimer.before_idle_read().await;
    let mut tx = store.begin().await?;
    let (batch, heard, reach, asked) = match batch {
        Batch::Heard(events) => (events, true, Reach::default(), Vec::new()),
        Batch::Read(limit) => match store.read(Some(&mut tx), limit, hand_out.total > 0, now).await {
            Ok(Read { batch, reach, asked }) => (batch, false, reach, asked),
            Err(error) => {
                let _ = tx.abort().await;
                return Err(error);
            }
        },
    };
    let now = store.after_read(now);
    let plan = plan(&batch, subscriptions);
    let heads = if hand_out.total == 0 { Vec::new() } else { keyed_heads(&plan) };
    let mut idle = HashSet::new();
    if !heads.is_empty() {
        match store.idle_keys(&mut tx, heads).await {
            Ok(found) => idle = found,
            Err(error) => {
                let _ = tx.abort().await;
                return Err(error);
            }
        }
    }
    idle.retain(|key| !keys.running.contains(key));
    // Of an idle key, only its head: the rest waits unfanned for the head to settle here.
    let (batch, left_out) = if idle.is_empty() { (batch, Vec::new()) } else { heads_of_idle_keys(batch, &plan, &idle) };
    let plan = if left_out.is_empty() { plan } else { planning::plan(&batch, subscriptions) };
    if !left_out.is_empty() {
        store.left_some_unfanned();
    }
    let noted = claimer.note_left_out(&asked, &batch, &left_out);
    let mut fresh = fresh(&plan, &batch, hand_out, &idle, now);
    // What is handed out gets no document (see `crate::store::unstored`), unless every
    // completion is to be recorded: the history copies the delivery's document.
    let without = if store.completion_history() { WithoutDocuments::default() } else { WithoutDocuments::of(&plan, &mut fresh) };
    let (written, without) = (&plan, &without);
    // The first stage is the mark, which makes this fan-out the only one of its events; the
    // rest goes with the commit, so that a hand-out sent early need not wait for it.
    let write = async move {
        match store.mark(&mut tx, written, without, now).await {
            // Every heard event must still have been unfanned: one that was not is another
            // fan-out's (whose deliveries may even be completed and gone by now).
            Ok(marked) if marked == written.events.len() as u64 || !heard => Ok(move |handed: &HashSet<DeliveryId>| {
                let handed = handed.clone();
                async move {
                    if let Err(error) = store.write_rest(&mut tx, written, without, &handed, now).await {
                        let _ = tx.abort().await;
                        return Err(error);
                    }
                    tx.commit().await
                }
            }),
            outcome => {
                let _ = tx.abort().await;
                Err(outcome.err().unwrap_or_else(|| StoreError::Raced("a heard event was fanned out already".into())))
            }
        }
    };
    let handed = claimer.hand_out(&store.lanes(), fresh, &keys, write, early, now).await?;
    let mut report = reach.on(plan.report(handed.claimed, &handed.sent_early));
    if !left_out.is_empty() {
        report.read_to_the_end = false;
    }
    report.deferred_keys.extend(noted);
    Ok(report)
}
