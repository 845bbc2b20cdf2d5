//! The fan-out's primitives in memory (orchestrated once, in `crate::store::fan_out`), as
//! `store/mongo/fan_out.rs` writes them in MongoDB, so that the contract suite runs each way
//! of a fan-out on both stores. A fan-out's transaction is its hold on the state, from its
//! read to its first stage (the mark): the claimer lists what it hands out once the mark lets
//! the state go, as a MongoDB fan-out's lane writes run beside its mark. It must never write
//! a delivery record for what it hands out (see `unstored`), nor mark an event another
//! fan-out marked.

use std::collections::HashSet;

use bson::{Bson, DateTime, Document};
use tokio::sync::OwnedMutexGuard;

use super::unstored::{Charge, Entry};
use super::{Backend, MemoryStore, State};
use crate::event::field;
use crate::store::claim::{ClaimBackend, Claimer, HandlerKey};
use crate::store::fan_out::{self, FanOutBackend, FanOutPlan, FannedEvent, PlainMarks, Reach, Read, WithoutDocuments, id_text, string_key};
use crate::store::{DeliveryId, DeliveryStatus, StoreError, StoreTransaction};

impl MemoryStore {
    /// The next batch of this host's share of the unfanned events, in `(createdAt, _id)`
    /// order, completed with the lowest unfanned events of every key in it (up to
    /// [`fan_out::prefixes_to_read`]); given `hands_out`, less the keys that run here, which
    /// it names when it read the rest to its end, and with the keys left out before read apart
    /// (as `mongo/unfanned.rs` does).
    fn read_batch(&self, state: &State, limit: usize, hands_out: bool, now: DateTime) -> Read {
        let (assignment, stale_before) = (self.claimer.assignment(), self.claimer.stale_before(now));
        let running = if hands_out { self.claimer.keys_running_here() } else { HashSet::new() };
        let asked = if hands_out { fan_out::keys_to_ask(self.claimer.keys_left_out(), |key| running.contains(key), limit) } else { Vec::new() };
        // The oldest events leave room in the batch for one event of each key asked.
        let limit = limit - asked.len();
        // A key's lower events come along whoever's they are (as in MongoDB's prefix read).
        let every_unfanned: Vec<&Document> = state.events.values().filter(|doc| !doc.contains_key(field::FANNED_OUT_AT)).collect();
        let unfanned: Vec<&Document> = every_unfanned.iter().copied().filter(|doc| assignment.fans_out(doc, stale_before)).collect();
        let apart = |doc: &&Document| string_key(doc).is_some_and(|key| running.contains(key) || asked.iter().any(|(k, _)| k == key));
        let mut oldest: Vec<&Document> = unfanned.iter().copied().filter(|doc| !apart(doc)).collect();
        let mut deferred: Vec<String> = Vec::new();
        if oldest.len() < limit {
            deferred = unfanned.iter().filter_map(|doc| string_key(doc).filter(|key| running.contains(*key)).map(str::to_string)).collect();
            deferred.sort();
            deferred.dedup();
        }
        oldest.sort_by_key(|doc| fan_out::unfanned_order(doc));
        let first: Vec<Document> = oldest.iter().take(limit).map(|doc| (*doc).clone()).collect();
        let groups = fan_out::prefixes_to_read(&first, hands_out, &asked);
        let read = |doc: &&Document| {
            let Some(key) = string_key(doc) else { return false };
            groups.iter().any(|(keys, bound)| keys.iter().any(|k| k == key) && fan_out::within_prefix_bound(doc, *bound))
        };
        let mut prefixes: Vec<&Document> = every_unfanned.iter().copied().filter(read).collect();
        let asked: Vec<String> = asked.into_iter().map(|(key, _)| key).collect();
        fan_out::drop_asked_keys_not_ours(&mut prefixes, &asked, |doc| assignment.fans_out(doc, stale_before));
        prefixes.sort_by_key(|doc| (string_key(doc).map(str::to_string), doc.get_i64(field::SEQUENCE).ok()));
        let prefixes: Vec<Document> = prefixes.into_iter().take(limit.saturating_mul(4)).cloned().collect();
        Read { batch: fan_out::assemble(first, prefixes), reach: Reach { deferred, ..Reach::default() }, asked }
    }

    /// The plain mark of the fan-out `fan_out`, which listed `event`'s delivery to `handler`
    /// in a lane and handed it out, landing only now; whether it marked the event.
    #[cfg(test)]
    pub(crate) async fn mark_late(&self, event: &str, handler: &str, fan_out: bson::oid::ObjectId, now: DateTime) -> bool {
        let handlers = vec![handler.to_string()];
        let fanned = FannedEvent { id: Bson::String(event.to_string()), new_handlers: handlers.clone(), handlers: handlers.clone() };
        let without = WithoutDocuments { fan_out, handlers: [(event.to_string(), handlers)].into(), ..Default::default() };
        self.state.lock().await.mark_plainly(&[fanned], &without, now).contains(event)
    }
}

/// A fan-out's hold on the state, from its read to its mark (see the module's doc).
pub(crate) struct FanOutHold(Option<OwnedMutexGuard<State>>);

impl FanOutHold {
    fn state(&mut self) -> &mut State {
        self.0.as_mut().expect("a fan-out reads and marks before it lets the state go")
    }
}

/// Nothing to commit or undo: every write of a fan-out here is made whole, under the lock.
impl StoreTransaction for FanOutHold {
    async fn commit(self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn abort(self) -> Result<(), StoreError> {
        Ok(())
    }
}

impl FanOutBackend for MemoryStore {
    type Tx = FanOutHold;

    fn claimer(&self) -> &Claimer {
        &self.claimer
    }

    fn lanes(&self) -> impl ClaimBackend + '_ {
        Backend(&self.state)
    }

    fn completion_history(&self) -> bool {
        self.options.completion_history
    }

    fn plain_marks(&self) -> &PlainMarks {
        &self.plain_marks
    }

    async fn begin(&self) -> Result<FanOutHold, StoreError> {
        Ok(FanOutHold(Some(self.state.clone().lock_owned().await)))
    }

    async fn read(&self, tx: Option<&mut FanOutHold>, limit: usize, hands_out: bool, now: DateTime) -> Result<Read, StoreError> {
        Ok(match tx {
            Some(tx) => self.read_batch(tx.state(), limit, hands_out, now),
            None => self.read_batch(&*self.state.lock().await, limit, hands_out, now),
        })
    }

    async fn idle_keys(&self, tx: &mut FanOutHold, heads: Vec<HandlerKey>) -> Result<HashSet<HandlerKey>, StoreError> {
        Ok(tx.state().idle_keys(heads))
    }

    /// Writes the whole plan but the deliveries of `without`, which their events list, and
    /// lets the state go.
    async fn mark(&self, tx: &mut FanOutHold, plan: &FanOutPlan, without: &WithoutDocuments, now: DateTime) -> Result<u64, StoreError> {
        tx.state().write_fan_out(plan, without, now);
        tx.0 = None;
        Ok(plan.events.len() as u64)
    }

    /// Gives those of `without` not handed out their records.
    async fn write_rest(
        &self,
        _tx: &mut FanOutHold,
        _plan: &FanOutPlan,
        without: &WithoutDocuments,
        handed: &HashSet<DeliveryId>,
        now: DateTime,
    ) -> Result<(), StoreError> {
        let not_handed: Vec<Entry> = without
            .deliveries
            .iter()
            .filter(|(id, _)| !handed.contains(*id))
            .map(|(id, (event, handler, key))| Entry {
                delivery: *id,
                event: event.clone(),
                fan_out: Some(without.fan_out),
                handler: handler.clone(),
                key: key.clone(),
                started: false,
            })
            .collect();
        if !not_handed.is_empty() {
            self.state.lock().await.materialize(&not_handed, Charge::Nothing, now);
        }
        Ok(())
    }

    async fn mark_plainly(&self, events: &[FannedEvent], without: &WithoutDocuments, now: DateTime) -> Result<HashSet<String>, StoreError> {
        Ok(self.state.lock().await.mark_plainly(events, without, now))
    }
}

impl State {
    /// Those of `heads` of which nothing is pending.
    fn idle_keys(&self, heads: Vec<HandlerKey>) -> HashSet<HandlerKey> {
        let mut idle: HashSet<HandlerKey> = heads.into_iter().collect();
        for d in self.deliveries.values().filter(|d| d.status == DeliveryStatus::Pending) {
            if let Some(key) = &d.key {
                idle.remove(&(d.handler.clone(), key.clone()));
            }
        }
        idle
    }

    /// Marks the plan's events fanned out by the fan-out `without` names, listing its handed
    /// out deliveries' handlers; an event another fan-out marked is left as it is. Returns the
    /// events (as [`id_text`] prints them) marked by this fan-out.
    fn mark_plainly(&mut self, events: &[FannedEvent], without: &WithoutDocuments, now: DateTime) -> HashSet<String> {
        let mut ours = HashSet::new();
        for fanned in events {
            let id = id_text(&fanned.id);
            let Some(event) = self.events.get_mut(&id) else { continue };
            let handed_out = without.handlers.get(&id);
            // A takeover that named a handler suspect dropped this fan-out's lane entry of it.
            let suspect = |handler: &Bson| handed_out.is_some_and(|handed| handed.iter().any(|h| Some(h.as_str()) == handler.as_str()));
            let named_suspect = matches!(event.get(field::SUSPECTS), Some(Bson::Array(suspects)) if suspects.iter().any(suspect));
            let unfanned = !event.contains_key(field::FANNED_OUT_AT) && !named_suspect;
            let marked_by_us = event.get_object_id(field::FAN_OUT).ok() == Some(without.fan_out);
            if !(unfanned || marked_by_us) {
                continue;
            }
            event.insert(field::FANNED_OUT_AT, now);
            event.insert(field::HANDLERS, fanned.handlers.clone());
            event.insert(field::FAN_OUT, without.fan_out);
            match handed_out {
                Some(handlers) => event.insert(field::HANDED_OUT, handlers.clone()),
                None => event.remove(field::HANDED_OUT),
            };
            ours.insert(id);
        }
        ours
    }
}

#[cfg(test)]
mod tests {
    use crate::store::Outbox;
    use super::*;
    use crate::event::NewEvent;
    use crate::store::{Capacity, StoreOptions, Subscription, Subscriptions, run_in_transaction};

    #[tokio::test]
    async fn a_plain_mark_leaves_an_event_another_fan_out_marked() {
        let store = MemoryStore::new(StoreOptions::default());
        run_in_transaction(&store, async |tx| store.publish(tx, &NewEvent::new("e-1", "t", bson::doc! {})).await.map(|_| ()))
            .await
            .unwrap();
        let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
        let now = DateTime::from_millis(1_000);
        let mut state = store.state.lock().await;
        let Read { batch, .. } = store.read_batch(&state, 10, true, now);
        let plan = fan_out::plan(&batch, &subscriptions);
        let mut fresh = fan_out::fresh(&plan, &batch, Capacity::from(10), &HashSet::new(), now);
        let (first, second) = (WithoutDocuments::of(&plan, &mut fresh), WithoutDocuments::of(&plan, &mut fresh));
        assert_eq!(state.mark_plainly(&plan.events, &first, now), HashSet::from(["e-1".to_string()]));
        // Another fan-out of the same batch marks nothing; the first may mark again (a mark
        // sent again after an error), changing nothing.
        assert!(state.mark_plainly(&plan.events, &second, now).is_empty());
        assert_eq!(state.mark_plainly(&plan.events, &first, now).len(), 1);
        assert_eq!(state.events["e-1"].get_object_id(field::FAN_OUT).unwrap(), first.fan_out);
    }
}
