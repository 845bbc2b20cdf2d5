//! Reading unfanned events in MongoDB: a fan-out's batch, the first events of this host's
//! lanes in [`fan_out::unfanned_order`] (reading on past other hosts' events, see [`crate::store::assignment`]), completed by
//! the lowest unfanned events of every key among them (see [`crate::store::fan_out`]), less
//! the events of keys that run on this host when the batch may hand out. It only reads; it
//! must never mark or write anything.

use std::collections::HashSet;

use bson::{Bson, DateTime, Document, doc};
use futures::TryStreamExt;
use mongodb::ClientSession;
use mongodb::options::Hint;

use super::{MongoStore, setup};
use crate::event::field;
use crate::store::StoreError;
use crate::store::fan_out::{self, Reach, Read, id_text};

/// Pages of unfanned events a batch reads at most while most of what it finds is other
/// hosts' (see [`crate::store::assignment`]).
const PAGES: usize = 4;

/// A batch of unfanned events of this host's lanes (or stale ones of any): the first in
/// [`fan_out::unfanned_order`] (the `unfanned_by_depth` index's),
/// completed by the lowest unfanned events of every key among them, up to
/// [`fan_out::prefixes_to_read`] (see [`crate::store::fan_out`]). Where other hosts' events fill the oldest page, it reads on
/// from where that page ended (an index position, `min`), up to [`PAGES`] pages. A batch that
/// may hand out leaves out the keys that run here ([`Claimer::keys_running_here`]), whole,
/// and reads those left out before apart ([`Claimer::keys_left_out`]).
///
/// [`Claimer::keys_running_here`]: crate::store::claim::Claimer::keys_running_here
/// [`Claimer::keys_left_out`]: crate::store::claim::Claimer::keys_left_out
pub(super) async fn read_batch(
    store: &MongoStore,
    session: Option<&mut ClientSession>,
    limit: usize,
    hands_out: bool,
    now: DateTime,
) -> Result<Read, StoreError> {
    let events = &store.collections.events;
    let (assignment, stale_before) = (store.claimer.assignment(), store.claimer.stale_before(now));
    let mut session = session;
    let mut first: Vec<Document> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut from: Option<Document> = None;
    let mut more = false;
    let running: HashSet<String> = if hands_out { store.claimer.keys_running_here() } else { HashSet::new() };
    let asked = if hands_out { fan_out::keys_to_ask(store.claimer.keys_left_out(), |key| running.contains(key), limit) } else { Vec::new() };
    // The oldest events leave room in the batch for one event of each key asked.
    let limit = limit - asked.len();
    let mut unfanned = doc! { field::FANNED_OUT_AT: Bson::Null };
    if !running.is_empty() || !asked.is_empty() {
        let apart: Vec<&String> = running.iter().chain(asked.iter().map(|(key, _)| key)).collect();
        unfanned.insert(field::KEY, doc! { "$nin": apart });
    }
    for _ in 0..PAGES {
        let mut page = events
            .find(unfanned.clone())
            .sort(doc! { field::CHAIN_DEPTH: 1, field::CREATED_AT: 1, field::ID: 1 })
            .hint(Hint::Name(setup::UNFANNED.into()))
            .limit(limit as i64)
            .batch_size(super::documents::one_batch(limit));
        if let Some(from) = from.take() {
            page = page.min(from);
        }
        let page: Vec<Document> = match session.as_deref_mut() {
            Some(session) => page.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
            None => page.await?.try_collect().await?,
        };
        more = page.len() >= limit;
        // Where the next page starts: the index position of this one's last event (`min`
        // is inclusive; `seen` skips it).
        from = page.last().and_then(|last| {
            Some(doc! {
                field::CHAIN_DEPTH: last.get(field::CHAIN_DEPTH).cloned().unwrap_or(Bson::Null),
                field::CREATED_AT: last.get(field::CREATED_AT)?.clone(),
                field::ID: last.get(field::ID)?.clone(),
            })
        });
        let mut new = 0;
        for doc in page {
            if seen.insert(id_text(doc.get(field::ID).unwrap_or(&Bson::Null))) {
                new += 1;
                if assignment.fans_out(&doc, stale_before) {
                    first.push(doc);
                }
            }
        }
        if !more || new == 0 || first.len() * 2 >= limit || from.is_none() {
            break;
        }
    }
    // Reached the end only if the batch holds every unfanned event of this host's it saw:
    // none cut off here, and no key's left out by a capped prefix read below (the change
    // stream's keyed events are fanned out alone only after such a read, see `Heard`).
    let cut = first.len() > limit;
    first.truncate(limit);
    // The keys left out that have unfanned events, once the rest is read to its end: their
    // settling is to start a fan-out. Before that end, fanning out goes on by itself.
    let deferred: Vec<String> = if running.is_empty() || more || cut {
        Vec::new()
    } else {
        let running: Vec<&String> = running.iter().collect();
        let filter = doc! { field::KEY: { "$in": running }, field::FANNED_OUT_AT: Bson::Null };
        // (`distinct` takes no hint before MongoDB 7.1: the filter matches `key_unfanned`'s.)
        let distinct = events.distinct(field::KEY, filter);
        let keys = match session.as_deref_mut() {
            Some(session) => distinct.session(session).await?,
            None => distinct.await?,
        };
        keys.into_iter().filter_map(|key| match key {
            Bson::String(key) => Some(key),
            _ => None,
        }).collect()
    };
    let reach = |capped: bool| Reach {
        // Read on again at once only while there was something of this host's to read: a
        // backlog of other hosts' events is theirs to drain.
        more: (more || cut || capped) && !first.is_empty(),
        // Keys read apart may have events beyond their bound.
        to_the_end: !(more || cut || capped) && deferred.is_empty() && asked.is_empty(),
        deferred: deferred.clone(),
    };
    let asked_keys: Vec<String> = asked.iter().map(|(key, _)| key.clone()).collect();
    if first.is_empty() && asked.is_empty() {
        return Ok(Read { reach: reach(false), batch: first, asked: asked_keys });
    }
    let groups = fan_out::prefixes_to_read(&first, hands_out, &asked);
    if groups.is_empty() {
        return Ok(Read { reach: reach(false), batch: fan_out::assemble(first, Vec::new()), asked: asked_keys });
    }
    let cap = limit.saturating_mul(PAGES);
    // Each group's keys up to its bound: every sequence but the integers above it, as
    // `fan_out::within_prefix_bound` says.
    let group_filter = |(keys, bound): &(Vec<String>, Option<i64>)| match bound {
        Some(bound) => doc! { field::KEY: { "$in": keys }, field::SEQUENCE: { "$not": { "$gt": *bound } } },
        None => doc! { field::KEY: { "$in": keys } },
    };
    let mut filter = match groups.as_slice() {
        [group] => group_filter(group),
        groups => doc! { "$or": groups.iter().map(group_filter).collect::<Vec<Document>>() },
    };
    filter.insert(field::FANNED_OUT_AT, Bson::Null);
    let prefixes = events
        .find(filter)
        .sort(doc! { field::KEY: 1, field::SEQUENCE: 1 })
        .hint(Hint::Name(setup::KEY_UNFANNED.into()))
        .limit(cap as i64)
        .batch_size(super::documents::one_batch(cap));
    let mut prefixes: Vec<Document> = match session {
        Some(session) => prefixes.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
        None => prefixes.await?.try_collect().await?,
    };
    // Capped only when events were committed between the two reads (a read to the end saw
    // fewer than four pages of unfanned events in all), outside a transaction's snapshot.
    let capped = prefixes.len() >= cap;
    fan_out::drop_asked_keys_not_ours(&mut prefixes, &asked_keys, |doc| assignment.fans_out(doc, stale_before));
    Ok(Read { reach: reach(capped), batch: fan_out::assemble(first, prefixes), asked: asked_keys })
}
