//! Outcomes of claimed deliveries, written once for both stores: completing, rescheduling,
//! burying and handing back a delivery are each one function here, over the primitives of
//! [`OutcomeBackend`], whether or not the delivery has a document.
//!
//! The rule they share: a lease this instance did not issue changes nothing and costs no
//! store call; a delivery handed out without a document (see [`crate::store::unstored`]) is
//! completed by its event's list, and for any other outcome first *materialized* (given its
//! document at claim generation 0) so that the ordinary fenced change applies; the claimer
//! hears of every lease settled. This module must never write to a store itself, nor decide
//! what is current: the primitives check the lease's lane epoch and claim generation.

use std::collections::HashSet;
use std::future::Future;

use bson::DateTime;

use super::claim::Claimer;
use super::unstored::Entry;
use super::{DeliveryId, Lease, Settlement, StoreError, answered};

/// A fenced change of a delivery with a document, other than its completion.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Change<'a> {
    /// The attempt failed: charged, due again at `due_at`.
    Reschedule { due_at: DateTime, error: &'a str },
    /// Dead with `reason`; `charge_attempt` counts the attempt that failed.
    Bury { reason: &'a str, charge_attempt: bool },
    /// Handed back without a charge (a graceful stop).
    HandBack,
}

impl Change<'_> {
    /// What it is, for an error.
    fn what(&self) -> &'static str {
        match self {
            Change::Reschedule { .. } => "a reschedule",
            Change::Bury { .. } => "a burial",
            Change::HandBack => "a hand-back",
        }
    }
}

/// What a store does to write outcomes. Each primitive writes only what is current under the
/// leases it is given (their lane's epoch, their delivery's generation); with `tx` it writes
/// in the caller's transaction.
pub(crate) trait OutcomeBackend: Sync {
    type Tx: Send;

    fn claimer(&self) -> &Claimer;

    /// Whether every completion is to leave a history record: then every completed delivery
    /// needs its document.
    fn completion_history(&self) -> bool;

    /// Completes those of `leases` (deliveries with a document) that are current; returns them.
    fn complete_stored(
        &self,
        tx: Option<&mut Self::Tx>,
        leases: &[Lease],
        now: DateTime,
    ) -> impl Future<Output = Result<HashSet<DeliveryId>, StoreError>> + Send;

    /// Completes those of `entries` (deliveries without a document) whose lane still has their
    /// lease's epoch and whose event still names them; returns them.
    fn complete_unstored(
        &self,
        tx: Option<&mut Self::Tx>,
        entries: &[(Lease, Entry)],
        now: DateTime,
    ) -> impl Future<Output = Result<HashSet<DeliveryId>, StoreError>> + Send;

    /// Gives `entries` their documents (those their events still name). A store whose
    /// transaction holds all its state writes them in `tx` when given; MongoDB writes them in
    /// a transaction of their own, before the caller's uses them.
    fn materialize(&self, tx: Option<&mut Self::Tx>, entries: &[Entry], now: DateTime)
    -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Applies `change` to those of `leases` (deliveries with a document) that are current and
    /// pending; returns how many it changed.
    fn change_stored(
        &self,
        tx: Option<&mut Self::Tx>,
        leases: &[Lease],
        change: Change<'_>,
        now: DateTime,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Whether the latest data, outside any transaction, still honours `lease`, after a write in
    /// a transaction found it lost: its snapshot was behind, and the transaction is to run
    /// again. A store whose transactions see the latest data answers `false`.
    fn honoured_outside(&self, lease: &Lease) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Has the claimer hear of `lease` settled once `tx` commits.
    fn settles_on_commit(tx: &mut Self::Tx, lease: Lease);
}

/// Splits leases into those of deliveries with a document and those without.
fn by_storage(claimer: &Claimer, leases: &[Lease]) -> (Vec<Lease>, Vec<(Lease, Entry)>) {
    let mut stored = Vec::new();
    let mut unstored = Vec::new();
    for lease in leases {
        match claimer.unstored(lease) {
            Some(handed_out) => unstored.push((*lease, Entry::of_lease(lease, handed_out))),
            None => stored.push(*lease),
        }
    }
    (stored, unstored)
}

fn entries(unstored: Vec<(Lease, Entry)>) -> Vec<Entry> {
    unstored.into_iter().map(|(_, entry)| entry).collect()
}

/// Completes a batch; one result per lease, in order.
pub(crate) async fn complete<B: OutcomeBackend>(store: &B, leases: &[Lease], now: DateTime) -> Result<Vec<Settlement>, StoreError> {
    let claimer = store.claimer();
    let issued: Vec<Lease> = leases.iter().filter(|l| claimer.issued(l)).copied().collect();
    let (stored, unstored) = by_storage(claimer, &issued);
    let completed = if issued.is_empty() {
        HashSet::new()
    } else if store.completion_history() {
        // A history record copies the delivery's document: any without one gets it first.
        if !unstored.is_empty() {
            store.materialize(None, &entries(unstored), now).await?;
        }
        store.complete_stored(None, &issued, now).await?
    } else {
        let (stored, unstored) = answered::both(
            async { if stored.is_empty() { Ok(HashSet::new()) } else { store.complete_stored(None, &stored, now).await } },
            async { if unstored.is_empty() { Ok(HashSet::new()) } else { store.complete_unstored(None, &unstored, now).await } },
        )
        .await?;
        stored.into_iter().chain(unstored).collect()
    };
    let (done, lost): (Vec<&Lease>, Vec<&Lease>) = leases.iter().partition(|l| completed.contains(&l.delivery));
    claimer.completed(done);
    claimer.settled(lost);
    Ok(leases.iter().map(|l| if completed.contains(&l.delivery) { Settlement::Completed } else { Settlement::LeaseLost }).collect())
}

/// Completes `lease` in the caller's transaction, settled for the claimer once it commits.
pub(crate) async fn complete_in<B: OutcomeBackend>(store: &B, tx: &mut B::Tx, lease: &Lease, now: DateTime) -> Result<(), StoreError> {
    if !store.claimer().issued(lease) {
        return Err(StoreError::LeaseLost(lease.to_string()));
    }
    let (_, unstored) = by_storage(store.claimer(), std::slice::from_ref(lease));
    let completed = if !unstored.is_empty() && !store.completion_history() {
        store.complete_unstored(Some(&mut *tx), &unstored, now).await?
    } else {
        if !unstored.is_empty() {
            store.materialize(Some(&mut *tx), &entries(unstored), now).await?;
        }
        store.complete_stored(Some(&mut *tx), std::slice::from_ref(lease), now).await?
    };
    settled_in(store, tx, lease, completed.contains(&lease.delivery), "a transactional completion").await
}

/// Applies `change` to each of `leases`; how many it changed (a lease lost changes nothing).
pub(crate) async fn settle<B: OutcomeBackend>(store: &B, leases: &[Lease], change: Change<'_>, now: DateTime) -> Result<usize, StoreError> {
    let claimer = store.claimer();
    let issued: Vec<Lease> = leases.iter().filter(|l| claimer.issued(l)).copied().collect();
    let changed = if issued.is_empty() {
        0
    } else {
        let (_, unstored) = by_storage(claimer, &issued);
        if !unstored.is_empty() {
            store.materialize(None, &entries(unstored), now).await?;
        }
        store.change_stored(None, &issued, change, now).await?
    };
    claimer.settled(leases);
    Ok(changed)
}

/// [`settle`] of one lease, as a settlement.
pub(crate) async fn settle_one<B: OutcomeBackend>(store: &B, lease: &Lease, change: Change<'_>, now: DateTime) -> Result<Settlement, StoreError> {
    let changed = settle(store, std::slice::from_ref(lease), change, now).await?;
    Ok(if changed == 1 { Settlement::Completed } else { Settlement::LeaseLost })
}

/// Applies `change` to `lease` in the caller's transaction, settled for the claimer once it
/// commits.
pub(crate) async fn settle_in<B: OutcomeBackend>(store: &B, tx: &mut B::Tx, lease: &Lease, change: Change<'_>, now: DateTime) -> Result<(), StoreError> {
    if !store.claimer().issued(lease) {
        return Err(StoreError::LeaseLost(lease.to_string()));
    }
    let (_, unstored) = by_storage(store.claimer(), std::slice::from_ref(lease));
    if !unstored.is_empty() {
        // In MongoDB, in a transaction of its own, which the caller's may have begun before:
        // then the change below does not find the document, and the caller's runs again.
        store.materialize(Some(&mut *tx), &entries(unstored), now).await?;
    }
    let changed = store.change_stored(Some(&mut *tx), std::slice::from_ref(lease), change, now).await?;
    settled_in(store, tx, lease, changed == 1, change.what()).await
}

/// The end of a write in the caller's transaction: settled on commit if it applied; if not,
/// lost, or a snapshot behind when the latest data still honours the lease.
async fn settled_in<B: OutcomeBackend>(store: &B, tx: &mut B::Tx, lease: &Lease, applied: bool, what: &str) -> Result<(), StoreError> {
    if applied {
        B::settles_on_commit(tx, *lease);
        Ok(())
    } else if store.honoured_outside(lease).await? {
        Err(StoreError::SnapshotBehind(what.into()))
    } else {
        Err(StoreError::LeaseLost(lease.to_string()))
    }
}
