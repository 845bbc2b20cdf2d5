//! Fan-outs in memory, the two ways the MongoDB store makes them (`store/mongo/fan_out.rs`),
//! so that the contract suite runs both on both stores: a batch written at once while the
//! claimer lists what it hands out (the transaction's way), and a backlog batch handed out
//! whole, listed in held lanes first and then marked (the plain mark's way, given a sender for
//! early hand-outs). It must never write a delivery record for what it hands out (see
//! `unstored`), nor mark an event another fan-out marked.

use std::collections::HashSet;

use bson::{Bson, DateTime, Document};

use super::unstored::{Charge, Entry};
use super::{Backend, MemoryStore, State};
use crate::event::field;
use crate::store::fan_out::{self, FannedEvent, WithoutDocuments, id_text, string_key};
use crate::store::claim::HandlerKey;
use crate::store::{Capacity, DeliveryId, DeliveryStatus, EarlyHandOuts, FanOutReport, StoreError, Subscriptions};

impl MemoryStore {
    /// The next batch of this host's share of the unfanned events, in `(createdAt, _id)`
    /// order, completed with the lowest unfanned events of every key in it (up to
    /// [`fan_out::prefixes_to_read`]); given `hands_out`, less the keys that run here, which
    /// it names when it read the rest to its end, and with the keys left out before read apart
    /// (as `mongo/unfanned.rs` does). Returns the batch, those keys, and the keys read apart.
    fn read_batch(&self, state: &State, limit: usize, hands_out: bool, now: DateTime) -> (Vec<Document>, Vec<String>, Vec<String>) {
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
        (fan_out::assemble(first, prefixes), deferred, asked)
    }

    /// A batch written at once, handing out up to `hand_out` of its deliveries that nothing can
    /// be ahead of (unkeyed ones, and the heads of idle keys).
    pub(super) async fn fan_out_handing_out(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: Capacity,
        now: DateTime,
    ) -> Result<FanOutReport, StoreError> {
        // Before the state is read (see `KeysBeforeRead`).
        let keys = self.claimer.before_idle_read().await;
        let mut state = self.state.lock().await;
        let (batch, mut deferred, asked) = self.read_batch(&state, limit, hand_out.total > 0, now);
        let plan = fan_out::plan(&batch, subscriptions);
        let mut idle = HashSet::new();
        if hand_out.total > 0 {
            idle = state.idle_keys(fan_out::keyed_heads(&plan));
            idle.retain(|key| !keys.running.contains(key));
        }
        // Of an idle key, only its head: the rest waits unfanned for the head to settle here.
        let (batch, left_out) = if idle.is_empty() { (batch, Vec::new()) } else { fan_out::heads_of_idle_keys(batch, &plan, &idle) };
        let plan = if left_out.is_empty() { plan } else { fan_out::plan(&batch, subscriptions) };
        deferred.extend(self.claimer.note_left_out(&asked, &batch, &left_out));
        let mut fresh = fan_out::fresh(&plan, &batch, hand_out, &idle, now);
        // What is handed out gets no record (see `unstored`), unless every completion is to be
        // recorded, as in MongoDB.
        let without =
            if self.options.completion_history { WithoutDocuments::default() } else { WithoutDocuments::of(&plan, &mut fresh) };
        // The first stage is written while the claimer waits to list what it hands out (it
        // locks the state after this), as a MongoDB fan-out marks its events while the lists
        // are written; the commit stage, told what was handed out, gives the rest their records.
        let shared = self.state.clone();
        let write = async move {
            state.write_fan_out(&plan, &without, now);
            drop(state);
            Ok(move |handed: &HashSet<DeliveryId>| {
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
                async move {
                    shared.lock().await.materialize(&not_handed, Charge::Nothing, now);
                    Ok(plan)
                }
            })
        };
        let handed = self.claimer.hand_out(&Backend(&self.state), fresh, &keys, write, None, now).await?;
        let mut report = handed.committed.report(handed.claimed, &handed.sent_early);
        report.deferred_keys = deferred;
        Ok(report)
    }

    /// A backlog batch handed out whole: listed in lanes this instance holds, then marked
    /// (only the events still unfanned, or marked by this very fan-out), its leases sent to
    /// `early`. `None`, having written nothing, when the batch cannot be handed out whole (see
    /// `Claimer::hand_out_listed_first`). The state is not held from the read to the mark, so
    /// another fan-out may mark some of its events first, as in MongoDB.
    pub(super) async fn fan_out_plainly(
        &self,
        subscriptions: &Subscriptions,
        limit: usize,
        hand_out: Capacity,
        early: &EarlyHandOuts,
        now: DateTime,
    ) -> Result<Option<FanOutReport>, StoreError> {
        let (plan, mut fresh, deferred) = {
            let state = self.state.lock().await;
            let (batch, deferred, _) = self.read_batch(&state, limit, true, now);
            let plan = fan_out::plan(&batch, subscriptions);
            // Every delivery of such a batch is unkeyed.
            let fresh = fan_out::fresh(&plan, &batch, hand_out, &HashSet::new(), now);
            (plan, fresh, deferred)
        };
        let deferred_report = |report: FanOutReport| FanOutReport { deferred_keys: deferred.clone(), ..report };
        if plan.events.is_empty() {
            return Ok(Some(deferred_report(plan.report(Vec::new(), &[]))));
        }
        if !plan.handed_out_whole_without_documents(&fresh) {
            return Ok(None);
        }
        let without = WithoutDocuments::of(&plan, &mut fresh);
        let (written, without) = (&plan, &without);
        let mark = || async move {
            let ours = self.state.lock().await.mark_plainly(&written.events, without, now);
            Ok(written.deliveries.iter().filter(|d| ours.contains(&id_text(&d.event_id))).map(|d| d.id).collect())
        };
        let sent = self.claimer.hand_out_listed_first(&Backend(&self.state), fresh, mark, early, now).await?;
        Ok(sent.map(|sent| deferred_report(plan.report(Vec::new(), &sent))))
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
    use crate::store::{StoreOptions, Subscription, run_in_transaction};

    #[tokio::test]
    async fn a_plain_mark_leaves_an_event_another_fan_out_marked() {
        let store = MemoryStore::new(StoreOptions::default());
        run_in_transaction(&store, async |tx| store.publish(tx, &NewEvent::new("e-1", "t", bson::doc! {})).await.map(|_| ()))
            .await
            .unwrap();
        let subscriptions = Subscriptions::new([Subscription::new("h", ["t"])]).unwrap();
        let now = DateTime::from_millis(1_000);
        let mut state = store.state.lock().await;
        let (batch, ..) = store.read_batch(&state, 10, true, now);
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
