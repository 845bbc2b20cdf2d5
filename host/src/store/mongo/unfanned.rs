//! Reading unfanned events in MongoDB: a fan-out's batch, the oldest events of this host's
//! lanes (reading on past other hosts' events, see [`crate::store::assignment`]), completed by
//! the lowest unfanned events of every key among them (see [`crate::store::fan_out`]). It only
//! reads; it must never mark or write anything.

use std::collections::{HashMap, HashSet};

use bson::{Bson, DateTime, Document, doc};
use bson::Bson::MinKey;
use futures::TryStreamExt;
use mongodb::ClientSession;
use mongodb::options::Hint;

use super::{MongoStore, setup};
use crate::event::field;
use crate::store::{FanOutReport, StoreError};
use crate::store::fan_out::{self, id_text};

/// Pages of unfanned events a batch reads at most while most of what it finds is other
/// hosts' (see [`crate::store::assignment`]).
const PAGES: usize = 4;

/// A batch read, and how far the read went ([`Reach`]).
pub(super) struct Read {
    pub batch: Vec<Document>,
    pub reach: Reach,
}

/// Whether unfanned events of this host's may remain beyond a batch (`more`: read again at
/// once), and whether its read reached the end of the unfanned events (`to_the_end`: the
/// change stream can be trusted again, see [`super::heard`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Reach {
    more: bool,
    to_the_end: bool,
}

impl Reach {
    /// `report` (of a fan-out of the batch), saying how far its read went.
    pub fn on(self, report: FanOutReport) -> FanOutReport {
        FanOutReport { more: self.more, read_to_the_end: self.to_the_end, ..report }
    }
}

/// A batch of unfanned events of this host's lanes (or stale ones of any): the oldest,
/// completed by the lowest unfanned events of every key among them (see
/// [`crate::store::fan_out`]). Where other hosts' events fill the oldest page, it reads on
/// from where that page ended (an index position, `min`), up to [`PAGES`] pages.
///
/// The pages are read from the index alone ([`page`]): whose an event is needs only its id,
/// key and age, so other hosts' events cost index keys, not documents. This host's own are
/// then read whole: the unkeyed ones by id, the keyed ones with their keys' prefixes.
pub(super) async fn read_batch(
    store: &MongoStore,
    session: Option<&mut ClientSession>,
    limit: usize,
    now: DateTime,
) -> Result<Read, StoreError> {
    let events = &store.collections.events;
    let (assignment, stale_before) = (store.claimer.assignment(), store.claimer.stale_before(now));
    let mut session = session;
    let mut first: Vec<Document> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut from = doc! { field::CREATED_AT: MinKey, field::ID: MinKey, field::KEY: MinKey };
    let mut more = false;
    for _ in 0..PAGES {
        let found = page(store, session.as_deref_mut(), &from, limit).await?;
        more = found.len() >= limit;
        let Some(last) = found.last() else { break };
        // Where the next page starts: the index position of this one's last event (`min`
        // is inclusive; `seen` skips it). A missing field is null in the index.
        let at = |name: &str| last.get(name).cloned().unwrap_or(Bson::Null);
        from = doc! { field::CREATED_AT: at(field::CREATED_AT), field::ID: at(field::ID), field::KEY: at(field::KEY) };
        let mut new = 0;
        for doc in found {
            if seen.insert(id_text(doc.get(field::ID).unwrap_or(&Bson::Null))) {
                new += 1;
                if assignment.fans_out(&doc, stale_before) {
                    first.push(doc);
                }
            }
        }
        if !more || new == 0 || first.len() * 2 >= limit {
            break;
        }
    }
    // Reached the end only if the batch holds every unfanned event of this host's it saw:
    // none cut off here, and no key's left out by a capped prefix read below (the change
    // stream's keyed events are fanned out alone only after such a read, see `Heard`).
    let cut = first.len() > limit;
    first.truncate(limit);
    let reach = |capped: bool| Reach {
        // Read on again at once only while there was something of this host's to read: a
        // backlog of other hosts' events is theirs to drain.
        more: (more || cut || capped) && !first.is_empty(),
        to_the_end: !(more || cut || capped),
    };
    if first.is_empty() {
        return Ok(Read { reach: reach(false), batch: first });
    }
    let unkeyed = whole(store, session.as_deref_mut(), &first).await?;
    let keys = fan_out::keys_of(&first);
    if keys.is_empty() {
        return Ok(Read { reach: reach(false), batch: unkeyed });
    }
    let cap = limit.saturating_mul(PAGES);
    let prefixes = events
        .find(doc! { field::KEY: { "$in": &keys }, field::FANNED_OUT_AT: Bson::Null })
        .sort(doc! { field::KEY: 1, field::SEQUENCE: 1 })
        .hint(Hint::Name(setup::KEY_UNFANNED.into()))
        .limit(cap as i64)
        .batch_size(super::documents::one_batch(cap));
    let prefixes: Vec<Document> = match session {
        Some(session) => prefixes.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
        None => prefixes.await?.try_collect().await?,
    };
    // Capped only when events were committed between the two reads (a read to the end saw
    // fewer than four pages of unfanned events in all), outside a transaction's snapshot.
    Ok(Read { reach: reach(prefixes.len() >= cap), batch: fan_out::assemble(unkeyed, prefixes) })
}

/// Up to `limit` unfanned events from the index position `from` on, oldest first, as the
/// index holds them: id, key and age only. No filter, so that `mongod` reads the partial
/// index alone (a covered scan, `min` bounding it) instead of every event's document.
async fn page(store: &MongoStore, session: Option<&mut ClientSession>, from: &Document, limit: usize) -> Result<Vec<Document>, StoreError> {
    let page = store
        .collections
        .events
        .find(doc! {})
        .projection(doc! { field::ID: 1, field::CREATED_AT: 1, field::KEY: 1 })
        .sort(doc! { field::CREATED_AT: 1, field::ID: 1, field::KEY: 1 })
        .hint(Hint::Name(setup::UNFANNED.into()))
        .min(from.clone())
        .limit(limit as i64)
        .batch_size(super::documents::one_batch(limit));
    Ok(match session {
        Some(session) => page.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
        None => page.await?.try_collect().await?,
    })
}

/// The whole documents of the unkeyed events of `found` (as [`page`] read them) that are
/// still unfanned, in `found`'s order. Keyed ones come with their keys' prefixes.
async fn whole(store: &MongoStore, session: Option<&mut ClientSession>, found: &[Document]) -> Result<Vec<Document>, StoreError> {
    let ids: Vec<Bson> = found.iter().filter(|doc| fan_out::string_key(doc).is_none()).filter_map(|doc| doc.get(field::ID).cloned()).collect();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let read = store
        .collections
        .events
        .find(doc! { field::ID: { "$in": &ids }, field::FANNED_OUT_AT: Bson::Null })
        .hint(super::by_id())
        .batch_size(super::documents::one_batch(ids.len()));
    let read: Vec<Document> = match session {
        Some(session) => read.session(&mut *session).await?.stream(&mut *session).try_collect().await?,
        None => read.await?.try_collect().await?,
    };
    let mut by_id: HashMap<String, Document> =
        read.into_iter().map(|doc| (id_text(doc.get(field::ID).unwrap_or(&Bson::Null)), doc)).collect();
    Ok(ids.iter().filter_map(|id| by_id.remove(&id_text(id))).collect())
}
