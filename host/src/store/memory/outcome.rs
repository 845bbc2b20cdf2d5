//! The primitives the shared outcomes (`crate::store::outcome`) are written over, in memory,
//! as `store/mongo/outcome.rs` writes them in MongoDB. Each locks the state for itself, or
//! works in the caller's transaction, which holds it; it must never decide what a lease lost
//! means (the shared outcomes do).

use std::collections::HashSet;

use bson::DateTime;

use super::unstored::{Charge, Entry};
use super::{MemoryStore, MemoryTx, State};
use crate::store::claim::Claimer;
use crate::store::outcome::{Change, OutcomeBackend};
use crate::store::{DeliveryId, Lease, Settlement, StoreError};

impl MemoryStore {
    /// Runs `write` on the state: the caller's transaction's, or the store's, locked for it.
    async fn on_state<T>(&self, tx: Option<&mut MemoryTx>, write: impl FnOnce(&mut State) -> T) -> T {
        match tx {
            Some(tx) => write(&mut tx.state),
            None => write(&mut *self.state.lock().await),
        }
    }
}

impl OutcomeBackend for MemoryStore {
    type Tx = MemoryTx;

    fn claimer(&self) -> &Claimer {
        &self.claimer
    }

    fn completion_history(&self) -> bool {
        self.options.completion_history
    }

    async fn complete_stored(&self, tx: Option<&mut MemoryTx>, leases: &[Lease], now: DateTime) -> Result<HashSet<DeliveryId>, StoreError> {
        let history = self.options.completion_history;
        Ok(self
            .on_state(tx, |state| {
                leases.iter().filter(|lease| state.complete(lease, now, history) == Settlement::Completed).map(|l| l.delivery).collect()
            })
            .await)
    }

    async fn complete_unstored(
        &self,
        tx: Option<&mut MemoryTx>,
        entries: &[(Lease, Entry)],
        now: DateTime,
    ) -> Result<HashSet<DeliveryId>, StoreError> {
        Ok(self
            .on_state(tx, |state| {
                entries
                    .iter()
                    .filter(|(lease, entry)| state.lane_current(lease) && state.complete_unstored(entry, now))
                    .map(|(lease, _)| lease.delivery)
                    .collect()
            })
            .await)
    }

    async fn materialize(&self, tx: Option<&mut MemoryTx>, entries: &[Entry], now: DateTime) -> Result<(), StoreError> {
        self.on_state(tx, |state| state.materialize(entries, Charge::Nothing, now)).await;
        Ok(())
    }

    async fn change_stored(&self, tx: Option<&mut MemoryTx>, leases: &[Lease], change: Change<'_>, now: DateTime) -> Result<usize, StoreError> {
        Ok(self.on_state(tx, |state| leases.iter().filter(|lease| state.change(lease, change, now)).count()).await)
    }

    /// A transaction here holds the whole state: what it found is the latest.
    async fn honoured_outside(&self, _lease: &Lease) -> Result<bool, StoreError> {
        Ok(false)
    }

    fn settles_on_commit(tx: &mut MemoryTx, lease: Lease) {
        tx.settles.push(lease);
    }
}

impl State {
    /// Applies `change` to the delivery of `lease` if the lease is current; whether it did.
    fn change(&mut self, lease: &Lease, change: Change<'_>, now: DateTime) -> bool {
        if !self.current(lease) {
            return false;
        }
        let delivery = self.deliveries.get_mut(&lease.delivery).expect("current");
        delivery.claims += 1;
        delivery.updated_at = Some(now);
        match change {
            Change::Reschedule { due_at, error } => {
                delivery.attempts += 1;
                delivery.due_at = due_at;
                delivery.last_error = Some(error.to_string());
            }
            Change::Bury { reason, charge_attempt } => {
                delivery.status = super::DeliveryStatus::Dead;
                delivery.lane = super::LaneKind::Dead;
                delivery.attempts += u32::from(charge_attempt);
                delivery.last_error = Some(reason.to_string());
            }
            Change::HandBack => {}
        }
        true
    }
}
